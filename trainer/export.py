"""Export a training checkpoint as a Hugging Face checkpoint that `transformers` (and so vLLM,
SGLang, lm-eval) loads:

    python -m trainer.export --checkpoint runs/mine/checkpoints/step_00000200 --out hf-out \\
        [--dtype bf16|fp16|fp32] [--model-type mixtral|qwen2_moe|qwen3_moe|deepseek_v2|deepseek_v3]
        [--max-shard-size 5GB] [--overwrite]

Writes `config.json` and safetensors shards (+ `model.safetensors.index.json` when there is more
than one) in the published per-expert layout of the model type, which is also what
`save_pretrained` of transformers 5 writes. The model type defaults to the one the run was
imported from (`--model.hf_path`), else the first of EXPORT_TYPES that represents the model's
architecture exactly (checked by converting the config there and back). The dtype defaults to
the imported checkpoint's, else bf16. Tokenizer files of the imported checkpoint are copied.

Memory: the checkpoint (torch.distributed.checkpoint, layout-free) is read shard by shard, one
output shard's tensors at a time, so the exporter holds about one shard (`--max-shard-size`),
never the whole model. Shard boundaries come from huggingface_hub's
`split_torch_state_dict_into_shards`; files are written with `safetensors`. Everything goes to
`<out>.tmp/` first and is renamed to `<out>` when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointError, read_meta

__all__ = ["export_checkpoint", "ExportError", "check_out_dir", "main", "pick_model_type"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# fields that do not change the computation (naming, init, training-only coefficients)
_NON_ARCH = ("name", "init_std", "aux_loss_coef", "bias_update_rate")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "generation_config.json", "vocab.json", "merges.txt")


class ExportError(ValueError):
    """The export cannot be done as asked; the message names the value and what is valid."""


def _represents(cfg, model_type: str) -> list[str]:
    """Architecture fields that `model_type`'s config cannot carry for `cfg` ([] = exact)."""
    from model.hf import config_from_hf, config_to_hf

    try:
        back = config_from_hf(config_to_hf(cfg, model_type)).to_dict()
    except ValueError as e:
        return [str(e)]
    ours = cfg.to_dict()
    bad = [f"{k} ({ours[k]!r} -> {back[k]!r})" for k in ours
           if k not in _NON_ARCH and ours[k] != back.get(k)]
    # routers transformers implements for the DeepSeek types (its config accepts more)
    if model_type == "deepseek_v2" and (cfg.router != "softmax" or cfg.norm_topk_prob
                                        or cfg.bias_balancing or cfg.group_score != "max"):
        bad.append("router (transformers' deepseek_v2 routes by softmax, greedy or group-max, "
                   "without renormalising or a correction bias)")
    if model_type == "deepseek_v3" and (cfg.router != "sigmoid" or cfg.group_score != "top2_sum"):
        bad.append("router (transformers' deepseek_v3 routes by sigmoid with top-2-sum groups)")
    return bad


def check_out_dir(out: Path, overwrite: bool, option: str,
                  fix: str = "pass --overwrite to replace it, or choose another folder") -> None:
    """Refuse an output folder that exists and is not empty, unless `overwrite`."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise ExportError(f"{option}={str(out)!r} exists and is not empty; {fix}")


def pick_model_type(cfg, meta: dict[str, Any], asked: str | None) -> str:
    """The transformers model type to write `cfg` as (see the module docstring); `meta` is
    the checkpoint's meta.json (its "hf" and "run" entries)."""
    from model.hf_checkpoint import EXPORT_TYPES

    if asked is not None and asked not in EXPORT_TYPES:
        raise ExportError(f"--model-type={asked!r} is not supported; valid: "
                          f"{', '.join(EXPORT_TYPES)}")
    from model.presets import HF_MODEL_TYPE

    src = (meta.get("hf") or {}).get("model_type")
    if src is None:  # a preset run: its family (presets.HF_MODEL_TYPE), when it has one
        preset = ((meta.get("run") or {}).get("model") or {}).get("preset")
        src = HF_MODEL_TYPE.get(preset) if isinstance(preset, str) else None
    if asked is None and src == "kimi_k2":
        asked = "deepseek_v3"  # Kimi-K2 uses the DeepSeek-V3 format, which transformers loads
    candidates = [asked] if asked else ([src] if src in EXPORT_TYPES else list(EXPORT_TYPES))
    why = {}
    for mt in candidates:
        bad = _represents(cfg, mt)
        if not bad:
            return mt
        why[mt] = bad
    raise ExportError("the model's architecture cannot be written as "
                      + "; ".join(f"{mt} (differs in {', '.join(b[:4])})" for mt, b in why.items())
                      + f"; valid model types: {', '.join(EXPORT_TYPES)}")


def _dcp_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _plan(cfg, model_type: str, stored: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """HF key -> (checkpoint key, transpose?) for every tensor of the export."""
    from model.hf_checkpoint import ExpertKeys, hf_names

    plan: dict[str, tuple[str, bool]] = {}
    for ours, src in hf_names(cfg, model_type).items():
        if isinstance(src, ExpertKeys):  # stored per logical expert: model.<name>.<e> [in, out]
            for e, key in enumerate(src.per_expert):
                plan[key] = (f"model.{ours}.{e}", True)
        elif ours.endswith("e_score_correction_bias"):
            plan[src] = (f"buffer.{ours}", False)
        else:
            plan[src] = (f"model.{ours}", False)
    missing = sorted({k for k, _ in plan.values() if k not in stored})
    if missing:
        raise ExportError(f"the checkpoint lacks {len(missing)} tensor(s) the export needs (first "
                          f"5): {missing[:5]}; it is from another model or version")
    return plan


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | None = None,
                      model_type: str | None = None, max_shard_size: str | int = "5GB",
                      overwrite: bool = False, progress: bool = True) -> Path:
    """Write the Hugging Face checkpoint of training checkpoint `checkpoint` to `out` (see the
    module docstring). Every check runs before anything is written."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import load as dcp_load
    from tqdm import tqdm

    from model import ModelConfig
    from model.hf import config_to_hf
    from model.hf_checkpoint import ARCHITECTURES

    ckpt, out = Path(checkpoint), Path(out)
    try:
        meta = read_meta(ckpt)  # refuses a checkpoint of an interrupted save
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype={dtype!r}; valid: {', '.join(DTYPES)}")
    check_out_dir(out, overwrite, "--out")
    if out.resolve() == ckpt.resolve() or ckpt.resolve() in out.resolve().parents:
        raise ExportError(f"--out {str(out)!r} lies inside the checkpoint {str(ckpt)!r}")
    cfg = ModelConfig.from_dict(meta["model"])
    mt = pick_model_type(cfg, meta, model_type)
    src_cfg: dict[str, Any] = dict((meta.get("hf") or {}).get("config") or {})
    if dtype is None:
        dtype = _DTYPE_NAMES.get(str(src_cfg.get("dtype") or src_cfg.get("torch_dtype")), "bf16")
    stored = _dcp_shapes(ckpt)
    plan = _plan(cfg, mt, stored)
    tdtype = DTYPES[dtype]

    def out_shape(key: str) -> tuple[int, ...]:
        k, tr = plan[key]
        s = stored[k][0]
        return tuple(reversed(s)) if tr else s

    meta_sd = {k: torch.empty(out_shape(k), dtype=tdtype, device="meta") for k in plan}
    split = split_torch_state_dict_into_shards(meta_sd, max_shard_size=max_shard_size)

    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for fname, keys in tqdm(split.filename_to_tensors.items(), desc="export shards",
                            disable=not progress, file=sys.stderr):
        need = {plan[k][0] for k in keys}
        sd = {k: torch.empty(stored[k][0], dtype=stored[k][1]) for k in need}
        with warnings.catch_warnings():  # one process, no process group: intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(sd, checkpoint_id=str(ckpt), no_dist=True)  # also inside a training job
        shard = {}
        for k in keys:
            src, tr = plan[k]
            t = sd[src].t() if tr else sd[src]
            shard[k] = t.to(tdtype).contiguous()
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        del sd, shard
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hf_cfg = dict(src_cfg) if src_cfg.get("model_type") == mt else {}
    hf_cfg.pop("quantization_config", None)  # written dequantized
    hf_cfg.update(config_to_hf(cfg, mt))
    if isinstance(hf_cfg.get("layer_types"), list):  # per-layer list (Qwen2-MoE): a run with
        hf_cfg["layer_types"] = hf_cfg["layer_types"][: cfg.n_layers]  # fewer layers keeps its own
    hf_cfg.update(architectures=[ARCHITECTURES[mt]], dtype=str(tdtype).removeprefix("torch."))
    hf_cfg.pop("torch_dtype", None)
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    source = (meta.get("hf") or {}).get("source")
    if source and Path(source).is_dir():
        for name in _TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, tmp / name)
    if out.exists():
        old = out.with_name(out.name + ".old")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a complete checkpoint: RUN/checkpoints/step_N")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="tensor dtype (default: the imported checkpoint's, else bf16)")
    p.add_argument("--model-type", default=None,
                   help="mixtral, qwen2_moe, qwen3_moe, deepseek_v2 or deepseek_v3 (default: the "
                        "imported checkpoint's, else the first that represents the model)")
    p.add_argument("--max-shard-size", default="5GB", help="per safetensors file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    a = p.parse_args(argv)
    try:
        out = export_checkpoint(a.checkpoint, a.out, a.dtype, a.model_type, a.max_shard_size,
                                a.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = sorted(f.name for f in out.iterdir())
    print(f"wrote {out}: {', '.join(files[:6])}{' ...' if len(files) > 6 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hugging Face checkpoints on disk: a folder with `config.json` and `*.safetensors` (one file,
or shards listed in `model.safetensors.index.json`).

    ckpt = HFCheckpoint(folder)              # config.json + every shard's header; no weights read
    skipped = ckpt.validate(cfg)             # missing / extra / mis-shaped tensors, before any work
    load_hf_weights(model, ckpt)             # fills what this rank holds, slice by slice

`load_hf_weights` walks the parameters this process actually holds (its pipeline stage's layers,
its EP rank's expert slots) and reads exactly those tensors with `safe_open(...).get_slice`, so
no process ever loads the whole checkpoint: a routed expert is read one logical expert at a
time and lands in the local slot that the layer's placement (its slot map, `first_slot`) says.
Both expert layouts load: the per-expert tensors of published checkpoints (and of
`save_pretrained` in transformers 5, which writes that layout) and transformers' fused
`experts.gate_up_proj` / `experts.down_proj`.

fp8 checkpoints (DeepSeek-V3's original release: float8_e4m3fn weights with a
`weight_scale_inv` per 128 x 128 block, `quantization_config.weight_block_size`) are
dequantized on load: weight = fp8 value * scale_inv of its block, in fp32.

The name map (`hf_names`) is shared with the export (`trainer.export`), so what is read and what
is written are one table. Shape legend: E experts, D model, F expert ffn.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .config import ModelConfig
from .hf import SUPPORTED_MODEL_TYPES, config_from_hf
from .moe import MoELayer
from .transformer import MoETransformer

__all__ = ["HFCheckpoint", "HFCheckpointError", "ExpertKeys", "hf_names", "load_hf_weights",
           "EXPORT_TYPES", "ARCHITECTURES"]

# model types a checkpoint can be exported to (transformers implements each); kimi_k2 uses the
# DeepSeek-V3 format, Llama-4 state dicts are not supported (model.hf docstring)
ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
EXPORT_TYPES = tuple(ARCHITECTURES)
_LOADABLE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2")


class HFCheckpointError(ValueError):
    """The checkpoint folder cannot be used; the message names the file, tensor or field."""


_GQA = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm",
        "k_norm": "k_norm"}
_MLA = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
        "wo": "o_proj"}
_DENSE = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertKeys:
    """Where one of our stacked expert tensors ([E, in, out]) lives in a HF checkpoint."""

    per_expert: tuple[str, ...]  # HF Linear [out, in] of logical expert e at index e
    fused: str  # transformers >= 5: gate_up_proj [E, 2F, D] (gate rows first) or down_proj [E, D, F]
    part: int  # rows of the fused tensor: 0 gate half, 1 up half, -1 whole (down)


def _family(model_type: str) -> str:
    return "deepseek_v3" if model_type == "kimi_k2" else model_type


def hf_names(cfg: ModelConfig, model_type: str,
             shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, str | ExpertKeys]:
    """Our state-dict name -> HF key (or ExpertKeys) for every tensor the HF checkpoint of
    `model_type` holds, in the published (per-expert) layout. Our tensors with no HF
    counterpart (the placement `expert2slot`; DeepSeek-V2's unused router bias) are absent."""
    mt = _family(model_type)
    if mt not in _LOADABLE:
        raise HFCheckpointError(f"model_type={model_type!r} has no supported weight layout; "
                                f"supported: {', '.join(_LOADABLE)}")
    moe = "block_sparse_moe" if mt == "mixtral" else "mlp"
    proj = {"w1": "w1", "w3": "w3", "w2": "w2"} if mt == "mixtral" else _DENSE
    shared = "shared_experts" if mt.startswith("deepseek") else "shared_expert"
    attn = _MLA if cfg.attention == "mla" else _GQA
    out: dict[str, str | ExpertKeys] = {}
    for name in shapes if shapes is not None else _expected_shapes(cfg):
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        if name in ("embed.weight", "norm.weight"):
            out[name] = {"embed.weight": "model.embed_tokens.weight",
                         "norm.weight": "model.norm.weight"}[name]
            continue
        if name == "lm_head.weight":
            out[name] = name
            continue
        _, i, rest = name.split(".", 2)
        p = f"model.layers.{i}."
        if rest == "attn_norm.weight":
            out[name] = p + "input_layernorm.weight"
        elif rest == "ffn_norm.weight":
            out[name] = p + "post_attention_layernorm.weight"
        elif rest.startswith("attn."):
            mod, leaf = rest[len("attn."):].split(".", 1)
            out[name] = p + f"self_attn.{attn[mod]}.{leaf}"
        elif rest.startswith("ffn.experts."):
            w = rest[len("ffn.experts."):]
            E = cfg.n_routed_experts
            out[name] = ExpertKeys(
                tuple(p + f"{moe}.experts.{e}.{proj[w]}.weight" for e in range(E)),
                p + f"{moe}.experts." + ("down_proj" if w == "w2" else "gate_up_proj"),
                {"w1": 0, "w3": 1, "w2": -1}[w])
        elif rest == "ffn.router.weight":
            out[name] = p + f"{moe}.gate.weight"
        elif rest == "ffn.router.e_score_correction_bias":
            if mt == "deepseek_v3":
                out[name] = p + f"{moe}.gate.e_score_correction_bias"
        elif rest == "ffn.expert2slot":
            continue
        elif rest.startswith("ffn.shared_experts."):
            w, leaf = rest[len("ffn.shared_experts."):].split(".", 1)
            out[name] = p + f"mlp.{shared}.{_DENSE[w]}.{leaf}"
        elif rest == "ffn.shared_gate.weight":
            out[name] = p + "mlp.shared_expert_gate.weight"
        elif rest.startswith("ffn.w"):  # dense SwiGLU layer
            w, leaf = rest[len("ffn."):].split(".", 1)
            out[name] = p + f"mlp.{_DENSE[w]}.{leaf}"
        else:  # pragma: no cover - a new module in the model without a mapping
            raise HFCheckpointError(f"no Hugging Face name for our tensor {name!r}")
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the full model's state dict (built on meta)."""
    with torch.device("meta"):
        from .transformer import MoETransformer

        return {k: tuple(v.shape) for k, v in MoETransformer(cfg).state_dict().items()}


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


class HFCheckpoint:
    """A Hugging Face checkpoint folder, opened lazily: the constructor reads config.json and
    every safetensors header, never a weight.

    config      the config.json dict;  model_type  its (supported) model type
    files       HF key -> shard file;  shapes / dtypes  from the headers
    reads       (key, bytes) of every tensor read since opening
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reads: list[tuple[str, int]] = []
        self._handles: dict[Path, Any] = {}
        if not self.path.is_dir():
            raise HFCheckpointError(f"--model.hf_path={str(path)!r} is not a folder; pass the "
                                    f"folder holding config.json and *.safetensors")
        cfg_file = self.path / "config.json"
        if not cfg_file.is_file():
            raise HFCheckpointError(f"{str(self.path)!r} has no config.json; a Hugging Face "
                                    f"checkpoint folder holds config.json and *.safetensors")
        try:
            self.config = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFCheckpointError(f"{str(cfg_file)!r} is not valid JSON: {e}") from None
        mt = self.config.get("model_type")
        if mt == "llama4":
            mt = "llama4_text"
        if mt not in SUPPORTED_MODEL_TYPES:
            raise HFCheckpointError(f"{str(cfg_file)!r}: model_type={mt!r} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.model_type = str(mt)
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for f in self._weight_files():
            from safetensors import safe_open

            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        self.files[k] = f
                        self.shapes[k] = tuple(sl.get_shape())
                        self.dtypes[k] = sl.get_dtype()
            except Exception as e:  # safetensors raises its own SafetensorError
                raise HFCheckpointError(f"{str(f)!r} is not a readable safetensors file: "
                                        f"{e}") from None

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{str(index)!r} is not a safetensors index (needs a "
                                        f"'weight_map'): {e}") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise HFCheckpointError(
                    f"{str(index)!r} names {len(missing)} shard file(s) that do not exist in "
                    f"{str(self.path)!r}: {missing[:5]}")
            return [self.path / f for f in files]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise HFCheckpointError(f"{str(self.path)!r} holds no *.safetensors file (and no "
                                    f"model.safetensors.index.json)")
        return files

    # ------------------------------------------------------------------ config
    def model_config(self) -> ModelConfig:
        try:
            cfg = config_from_hf(self.config)
        except (ValueError, TypeError) as e:
            raise HFCheckpointError(f"{str(self.path / 'config.json')!r}: {e}") from None
        if self.model_type.startswith("llama4"):
            raise HFCheckpointError(
                f"{str(self.path)!r}: Llama-4 weights cannot be loaded (MoETransformer matches "
                f"Llama-4's shapes, not its numerics; see model/hf.py); supported for weights: "
                f"{', '.join(_LOADABLE)}")
        return cfg

    @property
    def block_size(self) -> tuple[int, int]:
        q = self.config.get("quantization_config") or {}
        b = q.get("weight_block_size") or (128, 128)
        return int(b[0]), int(b[1])

    def resolve(self, key: str) -> str:
        """The checkpoint's spelling of `key`: transformers 5 names Mixtral's MoE block `mlp`
        (in memory and in fused-layout files) where published checkpoints say
        `block_sparse_moe`."""
        if key not in self.shapes and ".block_sparse_moe." in key:
            alt = key.replace(".block_sparse_moe.", ".mlp.")
            if alt in self.shapes:
                return alt
        return key

    # ------------------------------------------------------------------ checks
    def validate(self, cfg: ModelConfig) -> list[int]:
        """Check the tensors against the model `cfg` describes, before any work: missing,
        unexpected and mis-shaped tensors raise HFCheckpointError naming the first few.
        Returns the checkpoint's layer indices >= cfg.n_layers that a run with fewer layers
        skips (DeepSeek-V3's multi-token-prediction layers are skipped silently)."""
        shapes = _expected_shapes(cfg)
        names = hf_names(cfg, self.model_type, shapes)
        used: set[str] = set()
        missing: list[str] = []
        wrong: list[str] = []
        for ours, src in names.items():
            if isinstance(src, ExpertKeys):
                E, din, dout = shapes[ours]
                if all(k in self.shapes for k in src.per_expert):
                    for k in src.per_expert:
                        used.add(k)
                        if self.shapes[k] != (dout, din):
                            wrong.append(f"{k}: checkpoint {self.shapes[k]}, model {(dout, din)}")
                elif (fused := self.resolve(src.fused)) in self.shapes:
                    used.add(fused)
                    want = (E, 2 * dout, din) if src.part >= 0 else (E, dout, din)
                    if self.shapes[fused] != want:
                        wrong.append(f"{fused}: checkpoint {self.shapes[fused]}, model {want}")
                else:
                    missing.extend(k for k in src.per_expert if k not in self.shapes)
                continue
            src = self.resolve(src)
            if src not in self.shapes:
                if src.endswith("e_score_correction_bias"):
                    continue  # absent in some exports: zero bias, as transformers initialises it
                missing.append(src)
                continue
            used.add(src)
            if self.shapes[src] != shapes[ours]:
                wrong.append(f"{src}: checkpoint {self.shapes[src]}, model {shapes[ours]}")
        scales = {k for k in self.shapes if k.endswith(".weight_scale_inv")}
        for k in scales:
            base = k[: -len("_scale_inv")]
            if base in used:
                used.add(k)
        n_ckpt = int(self.config.get("num_hidden_layers", cfg.n_layers))
        skipped: set[int] = set()
        extra: list[str] = []
        for k in self.shapes:
            if k in used or "rotary_emb" in k:
                continue
            m = _LAYER_KEY.match(k)
            if m is not None and int(m.group(1)) >= cfg.n_layers:
                if int(m.group(1)) < n_ckpt:
                    skipped.add(int(m.group(1)))
                continue  # layers the run does not build, or DeepSeek-V3's MTP layers
            extra.append(k)
        if missing:
            raise HFCheckpointError(
                f"{str(self.path)!r} lacks {len(missing)} tensor(s) the model needs "
                f"(first {min(5, len(missing))}): {missing[:5]}")
        if extra:
            raise HFCheckpointError(
                f"{str(self.path)!r} has {len(extra)} tensor(s) the model does not use "
                f"(first {min(5, len(extra))}): {sorted(extra)[:5]}")
        if wrong:
            raise HFCheckpointError(
                f"{str(self.path)!r}: {len(wrong)} tensor(s) have the wrong shape for the "
                f"model (first {min(5, len(wrong))}): {wrong[:5]}")
        fp8 = [k for k in used if self.dtypes.get(k, "").startswith("F8")]
        unscaled = [k for k in fp8 if k + "_scale_inv" not in self.shapes
                    and k.replace(".weight", ".weight_scale_inv") not in self.shapes]
        if unscaled:
            raise HFCheckpointError(f"{str(self.path)!r}: fp8 tensor(s) without a "
                                    f"weight_scale_inv to dequantize them: {unscaled[:5]}")
        return sorted(skipped)

    # ------------------------------------------------------------------ reads
    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            h = self._handles[f] = safe_open(str(f), framework="pt")
        return h

    def close(self) -> None:
        self._handles.clear()

    def read(self, key: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """Tensor `key` (or `index` of it, read as a slice: only those bytes are copied), in
        its stored dtype; fp8 weights come back dequantized (fp32)."""
        h = self._handle(self.files[key])
        scale_key = key + "_scale_inv"
        if self.dtypes[key].startswith("F8") and scale_key in self.files:
            w = h.get_slice(key)[:]
            t = self._dequantize(w, self.read(scale_key))
            t = t[index] if index else t
            self.reads.append((key, w.numel() * w.element_size()))
            return t
        t = h.get_slice(key)[index] if index else h.get_slice(key)[:]
        self.reads.append((key, t.numel() * t.element_size()))
        return t

    def _dequantize(self, w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        """fp8 [out, in] * scale_inv [ceil(out/bo), ceil(in/bi)] per (bo, bi) block -> fp32."""
        bo, bi = self.block_size
        out_dim, in_dim = w.shape
        want = (math.ceil(out_dim / bo), math.ceil(in_dim / bi))
        if tuple(scale_inv.shape) != want:
            raise HFCheckpointError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does "
                                    f"not match weight {tuple(w.shape)} in {bo}x{bi} blocks "
                                    f"(expected {want})")
        s = scale_inv.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
        return w.float() * s


def _held_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and persistent buffer this process holds."""
    yield from model.named_parameters()
    sd_names = set(model.state_dict())
    for name, b in model.named_buffers():
        if name in sd_names:
            yield name, b


@torch.no_grad()
def load_hf_weights(model: MoETransformer, ckpt: HFCheckpoint) -> dict[str, int]:
    """Fill every tensor this process holds from `ckpt` (validated before with
    `ckpt.validate(model.cfg)`); experts land in the local slots their placement says.
    Returns {"tensors": reads, "bytes": bytes read}."""
    cfg = model.cfg
    names = hf_names(cfg, ckpt.model_type)
    layers = {f"layers.{i}.ffn": blk.ffn for i, blk in enumerate(model.layers)
              if isinstance(blk.ffn, MoELayer)}  # other stages' layers: ffn None
    n0 = len(ckpt.reads)
    for ours, t in _held_tensors(model):
        src = names.get(ours)
        if src is None:
            continue
        if isinstance(src, ExpertKeys):
            layer = layers[ours.rsplit(".experts.", 1)[0]]
            slot2expert = layer.slot_map().cpu()  # every replica loads its expert
            per_expert = src.per_expert[0] in ckpt.files
            for j in range(t.shape[0]):
                e = int(slot2expert[layer.experts.first_slot + j])
                if per_expert:
                    w = ckpt.read(src.per_expert[e])  # [out, in]
                else:
                    F_ = t.shape[2] if src.part >= 0 else t.shape[1]
                    rows = slice(None) if src.part < 0 else slice(src.part * F_,
                                                                 (src.part + 1) * F_)
                    w = ckpt.read(ckpt.resolve(src.fused), (slice(e, e + 1), rows))[0]
                t[j].copy_(w.t())
            continue
        src = ckpt.resolve(src)
        if src not in ckpt.files:  # e.g. a router bias the export left out: keep zeros
            continue
        if isinstance(t, DTensor):  # tensor parallel: read only this process's shard
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                                  t.placements)
            t._local_tensor.copy_(ckpt.read(src, tuple(slice(o, o + n)
                                                       for o, n in zip(offset, shape,
                                                                       strict=True))))
            continue
        t.copy_(ckpt.read(src))
    return {"tensors": len(ckpt.reads) - n0, "bytes": sum(b for _, b in ckpt.reads[n0:])}

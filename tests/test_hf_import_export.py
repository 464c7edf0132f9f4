"""Hugging Face checkpoints in and out, against transformers as the reference.

- config.json: every spelling transformers' config classes accept (their `attribute_map`) loads;
  a missing field is named.
- Import (`model.hf_checkpoint`): logits of the imported model equal transformers' on the same
  folder (sharded per-expert layout and the fused transformers-5 layout); fp8 block-quantized
  weights are dequantized.
- Round trip: import -> train with lr 0 on PP=2 x EP=2 (4 gloo processes) -> export gives every
  tensor bitwise equal to the original, and no rank reads a tensor it does not hold; under
  TP=2 x EP=2 the same, each rank reading only its shard of every TP-split tensor.
- Export: transformers loads it with no missing or unexpected keys and its logits equal ours
  for the same training checkpoint.
- Bad input: each refused with a message naming the problem, before any work.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_train
from test_model_hf import randomize

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from model import ModelConfig, MoETransformer  # noqa: E402
from model.hf import HF_ALIASES, SUPPORTED_MODEL_TYPES  # noqa: E402
from model.hf_checkpoint import HFCheckpoint, load_hf_weights  # noqa: E402
from trainer.export import ExportError, export_checkpoint  # noqa: E402

COMMON = dict(vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_experts_per_tok=2, max_position_embeddings=128)
KW = {
    "mixtral": dict(num_local_experts=4, intermediate_size=48, num_key_value_heads=2),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, intermediate_size=40,
                      num_key_value_heads=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1]),
    "deepseek_v3": dict(n_routed_experts=4, moe_intermediate_size=16, intermediate_size=40,
                        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        n_group=2, topk_group=1, num_key_value_heads=4),
}


def make_hf(path: Path, model_type: str, shard: str = "60KB", **over) -> Path:
    """A tiny random checkpoint saved by transformers itself (O(0.1) weights so that routing
    does not hinge on near-ties; a non-zero DeepSeek-V3 router bias)."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **KW[model_type], **over})
    randomize(transformers.AutoModelForCausalLM.from_config(cfg)).save_pretrained(
        path, max_shard_size=shard)
    return path


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def ours_from_hf(path: Path) -> MoETransformer:
    ckpt = HFCheckpoint(path)
    cfg = ckpt.model_config()
    ckpt.validate(cfg)
    model = MoETransformer(cfg).eval()
    load_hf_weights(model, ckpt)
    return model


def ref_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        return ref(tokens).logits


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory) -> str:
    """Byte tokens (< 256 < the tiny vocab 300) as a legacy uint16 .bin."""
    import numpy as np

    src = (ROOT / "trainer" / "loop.py").read_bytes() * 2
    p = tmp_path_factory.mktemp("data") / "bytes.bin"
    np.frombuffer(src, dtype=np.uint8).astype(np.uint16).tofile(p)
    return str(p)


# ------------------------------------------------------------------------------ config.json
def test_aliases_cover_transformers_attribute_maps() -> None:
    checked = 0
    for mt in SUPPORTED_MODEL_TYPES:
        if mt == "llama4":  # the multimodal wrapper: its text fields come from llama4_text
            continue
        try:
            cls = type(transformers.AutoConfig.for_model(mt))
        except ValueError:  # kimi_k2 is not in transformers (DeepSeek-V3 format)
            continue
        for alias, canon in cls.attribute_map.items():
            groups = [{k, *v} for k, v in HF_ALIASES.get(mt, {}).items()]
            assert any({alias, canon} <= g for g in groups), (mt, alias, canon)
            checked += 1
    assert checked >= 5  # mixtral, qwen3_moe, deepseek_v2 and deepseek_v3 (2) have aliases


def test_qwen3_config_written_by_transformers5(tmp_path) -> None:
    path = make_hf(tmp_path / "q", "qwen3_moe")
    d = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in d and "num_experts" not in d  # what transformers 5 writes
    cfg = ModelConfig.from_hf_config(path)
    assert cfg.n_routed_experts == 4 and cfg.qk_norm and cfg.dense_layers == (1,)
    d.pop("num_local_experts")
    with pytest.raises(ValueError, match="no field 'num_experts' \\(also accepted: num_local_experts"):
        ModelConfig.from_hf_config(d)


# ------------------------------------------------------------------------------ import
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_import_logits_match_transformers(tmp_path, model_type) -> None:
    path = make_hf(tmp_path / "ck", model_type)
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded, with an index
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        got = ours_from_hf(path)(tokens)
    torch.testing.assert_close(got, ref_logits(path, tokens), atol=2e-5, rtol=1e-5)


def test_import_fused_expert_layout(tmp_path) -> None:
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2F, D], down_proj
    [E, D, F]); a single-file checkpoint of that layout loads with the same logits."""
    path = make_hf(tmp_path / "ck", "mixtral", shard="50MB")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    fused = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    (path / "model.safetensors").unlink()
    save_file(fused, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        got = ours_from_hf(path)(tokens)
    torch.testing.assert_close(got, ref_logits(path, tokens), atol=2e-5, rtol=1e-5)


def test_fp8_block_quantized_weights_are_dequantized(tmp_path) -> None:
    path = make_hf(tmp_path / "ck", "deepseek_v3", shard="50MB")
    sd = load_file(path / "model.safetensors")
    block = 8
    want = {}
    for k in [k for k in sd if ".experts.0." in k or k.endswith("kv_b_proj.weight")]:
        w = sd[k]
        o, i = w.shape
        scale = torch.rand((o + block - 1) // block, (i + block - 1) // block) * 0.01 + 0.001
        full = scale.repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]
        q = (w / full).to(torch.float8_e4m3fn)
        sd[k], sd[k + "_scale_inv"] = q, scale
        want[k] = q.float() * full  # the definition: fp8 value times its block's scale
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (path / "config.json").write_text(json.dumps(d))
    ckpt = HFCheckpoint(path)
    ckpt.validate(ckpt.model_config())
    for k, ref in want.items():
        assert torch.equal(ckpt.read(k), ref), k
    ours = ours_from_hf(path)
    w1 = ours.layers[1].ffn.experts.w1[0]
    assert torch.equal(w1, want["model.layers.1.mlp.experts.0.gate_proj.weight"].t())


# ------------------------------------------------------------------------------ round trip
def _owned(rank: int, ckpt: HFCheckpoint, n_layers: int, E: int,
           placement: str = "local") -> set[str]:
    """Keys rank `rank` of PP=2 x EP=2 must read: its stage's layers, its EP rank's experts."""
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.pipe import split_layers

    mesh = Mesh.plan(4, rank, pp=2, ep=2, dp=0, placement=placement)
    pp_idx, ep_idx = mesh.pp_idx, mesh.ep_idx
    bounds = split_layers(n_layers, 2)
    layers = range(bounds[pp_idx], bounds[pp_idx + 1])
    mine = set(range(ep_idx * E // 2, (ep_idx + 1) * E // 2))
    out = set()
    for k in ckpt.shapes:
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i not in layers:
                continue
            if ".experts." in k and int(k.split(".experts.")[1].split(".")[0]) not in mine:
                continue
            out.add(k)
        elif k == "model.embed_tokens.weight":
            if pp_idx == 0:
                out.add(k)
        elif pp_idx == 1:  # final norm and lm_head
            out.add(k)
    return out


def _assert_export_equals(src: Path, run: Path, out: Path) -> None:
    """The run's step-2 checkpoint exported in fp32 holds every tensor of `src`, bitwise (lr 0:
    the weights are only moved, never computed on)."""
    export_checkpoint(run / "checkpoints" / "step_00000002", out, dtype="fp32", progress=False)
    a, b = all_tensors(src), all_tensors(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k


def round_trip(tmp_path: Path, model_type: str, data: str, placement: str = "local") -> None:
    src = make_hf(tmp_path / "src", model_type)
    run = tmp_path / "run"
    r = run_train([f"--model.hf_path={src}", "--data", data, f"--train.out_dir={run}",
                   "--parallel.pp=2", "--parallel.ep=2", "--parallel.microbatches=2",
                   "--comm.alltoall=flat", "--train.steps=2", "--train.seq_len=32",
                   "--train.global_batch=8", "--train.eval_every=0", "--train.eval_batches=1",
                   "--train.plot=false", "--optim.lr=0", "--optim.min_lr=0",
                   "--model.bias_update_rate=0", f"--parallel.ep_placement={placement}"],
                  nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ckpt = HFCheckpoint(src)
    cfg = ckpt.model_config()
    for rank in range(4):
        rec = json.loads((run / "hf_import" / f"rank_{rank}.json").read_text())
        want = _owned(rank, ckpt, cfg.n_layers, cfg.n_routed_experts, placement)
        assert set(rec["keys"]) == want, rank
    _assert_export_equals(src, run, tmp_path / "out")


@pytest.mark.multiproc
def test_round_trip_pp2_ep2_mixtral(tmp_path, data_bin) -> None:
    round_trip(tmp_path, "mixtral", data_bin)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "placement"),
                         [("qwen3_moe", "local"), ("deepseek_v3", "local"), ("mixtral", "spread")])
def test_round_trip_pp2_ep2(tmp_path, data_bin, model_type, placement) -> None:
    round_trip(tmp_path, model_type, data_bin, placement)


# the HF tensors split over TP (column- or row-wise): attention projections, dense and shared
# MLPs, the head; experts, routers, norms, the embedding and MLA's down-projections stay whole
_TP_SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
             "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight",
             "down_proj.weight", "lm_head.weight")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_round_trip_tp2_ep2(tmp_path, data_bin, model_type) -> None:
    """Import -> 2 steps at lr 0 under TP=2 (SP) x EP=2 on 4 processes -> export: every tensor
    bitwise equal to the original; each rank read its EP rank's experts and, of every TP-split
    tensor, exactly its half (the bytes of its shard, not of the whole tensor)."""
    src = make_hf(tmp_path / "src", model_type)
    run = tmp_path / "run"
    r = run_train([f"--model.hf_path={src}", "--data", data_bin, f"--train.out_dir={run}",
                   "--parallel.tp=2", "--parallel.ep=2", "--comm.alltoall=flat",
                   "--train.steps=2", "--train.seq_len=32", "--train.global_batch=8",
                   "--train.eval_every=0", "--train.eval_batches=1", "--train.plot=false",
                   "--optim.lr=0", "--optim.min_lr=0", "--model.bias_update_rate=0"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ckpt = HFCheckpoint(src)
    E = ckpt.model_config().n_routed_experts
    for rank in range(4):  # rank = dp_idx * 2 + ep_idx; tp_idx = rank % 2
        rec = json.loads((run / "hf_import" / f"rank_{rank}.json").read_text())
        mine = set(range((rank % 2) * E // 2, (rank % 2 + 1) * E // 2))
        want = {k for k in ckpt.shapes if ".experts." not in k
                or int(k.split(".experts.")[1].split(".")[0]) in mine}
        assert set(rec["keys"]) == want, rank
        split = [k for k in want if ".experts." not in k and k.endswith(_TP_SPLIT)]
        assert split, "the model has TP-split tensors"
        nbytes = {k: 4 * math.prod(ckpt.shapes[k]) for k in want}  # fp32
        assert rec["bytes"] == sum(nbytes.values()) - sum(nbytes[k] // 2 for k in split), rank
    _assert_export_equals(src, run, tmp_path / "out")


def test_experts_land_in_their_placement_slots(tmp_path) -> None:
    """An EP rank holding slots [2, 4) of 4 under a permuted placement gets, in local slot j,
    the logical expert that the placement puts in slot 2 + j (as after a migration)."""
    src = make_hf(tmp_path / "src", "mixtral", shard="50MB")
    ckpt = HFCheckpoint(src)
    cfg = ckpt.model_config()
    model = MoETransformer(cfg)
    slot2expert = [1, 3, 2, 0]  # slot g holds expert slot2expert[g] (expert2slot [3, 0, 2, 1])
    for layer in model.moe_layers():
        layer.set_slots(slot2expert)
        ex = layer.experts
        for name in ("w1", "w2", "w3"):
            setattr(ex, name, torch.nn.Parameter(getattr(ex, name).detach()[2:4].clone()))
        ex.first_slot = 2
    load_hf_weights(model, ckpt)
    sd = all_tensors(src)
    for i, layer in enumerate(model.moe_layers()):
        for j, e in enumerate((2, 0)):  # slot 2 holds expert 2, slot 3 holds expert 0
            key = f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"
            assert torch.equal(layer.experts.w1[j], sd[key].t()), (i, j)
    assert not any(".experts.1." in k or ".experts.3." in k for k, _ in ckpt.reads)


# ------------------------------------------------------------------------------ export
@pytest.mark.multiproc
@pytest.mark.slow
def test_export_loads_in_transformers_with_equal_logits(tmp_path, data_bin) -> None:
    from trainer.checkpoint import load_checkpoint

    src = make_hf(tmp_path / "src", "qwen3_moe")
    run = tmp_path / "run"
    r = run_train([f"--model.hf_path={src}", "--data", data_bin, f"--train.out_dir={run}",
                   "--parallel.ep=2", "--comm.alltoall=flat", "--train.steps=2",
                   "--train.seq_len=32", "--train.global_batch=4", "--train.eval_every=0",
                   "--train.eval_batches=1", "--train.plot=false", "--optim.warmup_steps=0",
                   f"--train.export_hf={tmp_path / 'at_end'}"], nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    step = run / "checkpoints" / "step_00000002"
    out = export_checkpoint(step, tmp_path / "out", dtype="fp32", max_shard_size="50KB",
                            progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    at_end = all_tensors(tmp_path / "at_end")  # --train.export_hf: the same, in the source dtype
    assert all(torch.equal(t, all_tensors(out)[k]) for k, t in at_end.items())
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref.config._attn_implementation = "eager"
    meta = json.loads((step / "meta.json").read_text())
    ours = MoETransformer(ModelConfig.from_dict(meta["model"])).eval()
    optim = torch.optim.AdamW(ours.parameters())
    load_checkpoint(step, ours, optim)
    changed = all_tensors(src)["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(changed, all_tensors(out)["model.layers.0.self_attn.q_proj.weight"])
    tokens = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        diff = (ours(tokens) - ref.eval()(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


# ------------------------------------------------------------------------------ bad input
def _prepare(args: list[str]):
    from trainer import parse_args, prepare

    return prepare(parse_args(args), 1, 0)


def test_bad_checkpoint_folders(tmp_path, data_bin) -> None:
    base = ["--data", data_bin, "--train.seq_len=32"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        _prepare([*base, f"--model.hf_path={tmp_path / 'empty'}"])
    src = make_hf(tmp_path / "src", "mixtral", shard="50MB")
    d = json.loads((src / "config.json").read_text())
    bad = tmp_path / "badtype"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**d, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama' is not supported; supported: mixtral"):
        _prepare([*base, f"--model.hf_path={bad}"])
    sd = load_file(src / "model.safetensors")
    variants = {
        "missing": ({k: v for k, v in sd.items() if "layers.1.self_attn.k_proj" not in k},
                    r"lacks 1 tensor.*model.layers.1.self_attn.k_proj.weight"),
        "extra": ({**sd, "model.layers.0.self_attn.foo.weight": torch.zeros(2)},
                  r"does not use.*model.layers.0.self_attn.foo.weight"),
        "shape": ({**sd, "model.norm.weight": torch.ones(31)},
                  r"wrong shape.*model.norm.weight: checkpoint \(31,\), model \(32,\)"),
    }
    for name, (tensors, msg) in variants.items():
        p = tmp_path / name
        p.mkdir()
        (p / "config.json").write_text(json.dumps(d))
        save_file(tensors, str(p / "model.safetensors"))
        with pytest.raises(ValueError, match=msg):
            _prepare([*base, f"--model.hf_path={p}"])
    sharded = make_hf(tmp_path / "sharded", "mixtral")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"names 1 shard file.*{victim.name}"):
        _prepare([*base, f"--model.hf_path={sharded}"])


def test_export_hf_target_checked_before_training(tmp_path, data_bin) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="export_hf=.*exists and is not empty"):
        _prepare(["--data", data_bin, "--train.seq_len=32",
                  f"--train.export_hf={tmp_path / 'taken'}"])
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
    with pytest.raises(ValueError, match="export_hf: the model's architecture cannot be written"):
        _prepare(["--data", data_bin, "--train.seq_len=32", "--model.qk_norm=true",
                  "--model.attn_qkv_bias=true", f"--train.export_hf={tmp_path / 'new'}"])


def test_fewer_layers_skip_the_rest_with_a_warning(tmp_path, data_bin, capsys) -> None:
    src = make_hf(tmp_path / "src", "mixtral", shard="50MB")
    prep = _prepare(["--data", data_bin, "--train.seq_len=32", f"--model.hf_path={src}",
                     "--model.n_layers=2"])
    assert prep.mcfg.n_layers == 2 and prep.hf_skipped == (2, 3)
    assert "checkpoint layers [2, 3] are skipped" in capsys.readouterr().err


@pytest.mark.integration
def test_bad_exports(tmp_path, data_bin) -> None:
    run = tmp_path / "run"
    r = run_train(["--data", data_bin, f"--train.out_dir={run}", "--train.steps=1",
                   "--train.seq_len=32", "--train.global_batch=2", "--train.eval_batches=1",
                   "--train.plot=false", "--model.n_layers=1"])
    assert r.returncode == 0, r.stderr[-3000:]
    step = run / "checkpoints" / "step_00000001"
    # the tiny preset (GQA, no q/k norm, softmax top-2 renormalised) is a Mixtral architecture
    out = export_checkpoint(step, tmp_path / "out", progress=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "mixtral"
    assert all(t.dtype == torch.bfloat16 for t in all_tensors(out).values())
    with pytest.raises(ExportError, match="exists and is not empty; pass --overwrite"):
        export_checkpoint(step, out, progress=False)
    export_checkpoint(step, out, overwrite=True, dtype="fp16", progress=False)
    assert all(t.dtype == torch.float16 for t in all_tensors(out).values())
    with pytest.raises(ExportError, match=r"qwen3_moe \(differs in qk_norm"):
        export_checkpoint(step, tmp_path / "o2", model_type="qwen3_moe", progress=False)
    with pytest.raises(ExportError, match="--model-type='gpt2' is not supported"):
        export_checkpoint(step, tmp_path / "o3", model_type="gpt2", progress=False)
    interrupted = run / "checkpoints" / "step_00000002.tmp"
    interrupted.mkdir()
    with pytest.raises(ExportError, match="incomplete"):
        export_checkpoint(interrupted, tmp_path / "o4", progress=False)
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o4").exists()
    cli = subprocess.run([sys.executable, "-m", "trainer.export", "--checkpoint", str(step),
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert cli.returncode == 2 and "error: --out" in cli.stderr


def test_plan_for_a_hf_checkpoint_launches_from_it(tmp_path, data_bin) -> None:
    from trainer import parse_args, prepare
    from tuner.cli import main as tuner_main

    src = make_hf(tmp_path / "src", "mixtral", shard="50MB")
    rc = tuner_main(["plan", "--model", str(src), "--platform", "local", "--gpus", "4",
                     "--seq", "32", "--global-batch", "8", "--search", "tpe", "--trials", "10",
                     "--out", str(tmp_path / "plans")])
    assert rc == 0
    plan = next((tmp_path / "plans").glob("*.toml"))
    assert f'hf_path = "{src.resolve()}"' in plan.read_text()
    cfg = parse_args(["--plan", str(plan), "--data", data_bin])
    assert cfg.model.hf_path == str(src.resolve())
    prep = prepare(cfg, 4, 0)
    assert prep.hf is not None and prep.mcfg.n_routed_experts == 4


@pytest.mark.slow
@pytest.mark.multiproc
def test_readme_fine_tune_recipe_runs_as_written(tmp_path) -> None:
    """The README's "Fine-tune a Hugging Face MoE checkpoint" commands, verbatim except that
    runs/ points into a temporary folder."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Fine-tune a Hugging Face MoE checkpoint", 1)[1]
    block = block.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "make_tiny_hf.py" in block and "trainer.export" in block
    script = block.replace("runs/", f"{tmp_path}/runs/")
    bin_dir = Path(sys.executable).parent
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    # transformers loads the export as a Mixtral (the python -c line's print), and the chat
    # variant after it trains its 20 steps into its own folder
    assert "mixtral" in lines
    assert lines[-1].startswith("done: 20 steps") and "runs/ft-chat/checkpoints" in lines[-1]


def test_export_type_follows_what_transformers_implements() -> None:
    """A preset exports as its family; DeepSeek-V3 routing (sigmoid, top-2-sum groups, bias) is
    not written as deepseek_v2, whose transformers router is softmax only."""
    from model import presets
    from trainer.export import pick_model_type

    for name, want in (("tiny", "mixtral"), ("qwen3-30b-a3b", "qwen3_moe"),
                       ("deepseek-v2", "deepseek_v2"), ("deepseek-v3", "deepseek_v3"),
                       ("kimi-k2", "deepseek_v3")):
        assert pick_model_type(presets.get(name), {"run": {"model": {"preset": name}}}, None) == want
        assert pick_model_type(presets.get(name), {}, None) == want
    with pytest.raises(ExportError, match="deepseek_v2 .*router"):
        pick_model_type(presets.get("deepseek-v3"), {}, "deepseek_v2")

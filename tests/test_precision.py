"""Mixed precision (trainer/distributed/precision.py): bf16 working weights with fp32 masters and fp32
gradients against fp32 training, no weight cast in the forward, the router's fp32 guard under
autocast, checkpoints holding the masters, and the flags' bad values.

The model is a small MoE transformer run on one process through the trainer's own GradSync
and optimizer (the parts that hold masters and main grads), so each test takes seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model import MoETransformer, presets
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import ConfigError, RunConfig
from trainer.distributed.grad_sync import GradSync
from trainer.distributed.mesh import Mesh
from trainer.distributed.precision import check_precision, resolve_precision, to_working_dtype
from trainer.distributed.zero import ZeroOptimizer, build_optimizer

CFG = dataclasses.replace(presets.get("tiny"), d_model=32, n_layers=2, moe_ffn_dim=32,
                          dense_ffn_dim=64, vocab_size=96, n_heads=4, n_kv_heads=2)
B, S = 2, 16


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step % 4)  # 4 batches, seen over and over: it learns
    tok = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def _setup(dtype: torch.dtype, m: int = 1):
    model = MoETransformer(CFG)
    before = to_working_dtype(model, dtype)
    mesh = Mesh.plan(1, 0, pp=1, ep=1).build_groups()
    sync = GradSync(model, mesh, zero=0, overlap=m > 1)
    opt = build_optimizer(model, sync, 3e-3, (0.9, 0.95), 1e-8, 0.1, before)
    return model, sync, opt


def _train(dtype: torch.dtype, steps: int, m: int = 1) -> tuple[list[float], MoETransformer, object]:
    model, sync, opt = _setup(dtype, m)
    losses = []
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16
           else torch.autocast("cpu", enabled=False))
    for step in range(steps):
        tok, tgt = _batch(step)
        sync.start_step(m)
        total = 0.0
        for tk, tg in zip(tok.chunk(m), tgt.chunk(m), strict=True):
            with ctx:
                logits = model(tk)
            ce = F.cross_entropy(logits.float().flatten(0, 1), tg.flatten())
            ((ce + model.aux_loss()) / m).backward()
            total += float(ce.detach()) / m
        sync.finish()
        sync.clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, model, opt


@pytest.mark.slow  # 60 steps: ~30 s on the loaded 2-core machine
def test_bf16_weights_with_fp32_masters_track_fp32_training():
    """30 steps: the bf16 run's loss (mean of the last 5 steps) within 3 % of fp32's; both
    learn. 3 %: bf16 rounds every GEMM input to 8 mantissa bits (~0.4 % per product) and the
    two trajectories drift apart; against the ~15-20 % the loss falls over these steps."""
    fp32, _, _ = _train(torch.float32, 30)
    bf16, model, opt = _train(torch.bfloat16, 30, m=2)
    tail32, tail16 = sum(fp32[-5:]) / 5, sum(bf16[-5:]) / 5
    assert tail32 < 0.9 * fp32[0]  # it trained
    assert abs(tail16 - tail32) / tail32 < 0.03, (tail16, tail32)
    # the state is what the policy says: bf16 weights, fp32 masters + moments
    assert isinstance(opt, ZeroOptimizer)
    w = model.layers[1].ffn.experts.w1
    st = opt.state[w]
    assert w.dtype == torch.bfloat16 and st["master"].dtype == torch.float32
    assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["master"].bfloat16(), w.data)
    assert model.layers[1].ffn.router.weight.dtype == torch.float32  # the router stays fp32


class _CastCounter(TorchDispatchMode):
    """Counts aten._to_copy calls whose input shares a parameter's storage."""

    def __init__(self, params) -> None:
        super().__init__()
        self.ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.casts: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage().data_ptr() in self.ptrs:
            self.casts.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_weight_cast_inside_the_forward(dtype):
    """bf16 weights under bf16 autocast (the GPU and CPU bf16 path): no parameter is copied
    to another dtype in the forward. The counter itself is checked: fp32 weights under bf16
    autocast cast every GEMM weight (what the trainer did before, expert stacks included)."""
    model = MoETransformer(CFG)
    to_working_dtype(model, dtype)
    tok, _ = _batch(0)
    counter = _CastCounter(model.parameters())
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        model(tok)
    if dtype == torch.bfloat16:
        assert counter.casts == []
    else:
        expert = tuple(model.layers[1].ffn.experts.w1.shape)
        assert expert in counter.casts and len(counter.casts) > 10


def test_router_is_fp32_under_autocast():
    """Logits, scores, top-k weights and aux loss in fp32 inside a bf16 autocast region, equal
    to the same router run outside autocast (same ops, same shapes: exact)."""
    model = MoETransformer(CFG)
    router = model.layers[1].ffn.router
    x = torch.randn(B, S, CFG.d_model).bfloat16()
    ref_s = router.scores(x.reshape(-1, CFG.d_model))
    ref_idx, ref_w, ref_aux = router.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = router.scores(x.reshape(-1, CFG.d_model))
        idx, w, aux = router.route(x)
        plain = F.linear(x.float(), router.weight)  # what autocast does without the guard
    assert plain.dtype == torch.bfloat16  # the guard is needed: autocast would make it bf16
    assert s.dtype == torch.float32 and aux.dtype == torch.float32
    assert torch.equal(s, ref_s) and torch.equal(idx, ref_idx) and torch.equal(aux, ref_aux)
    assert torch.equal(w, ref_w)  # returned in x's dtype (bf16) from the same fp32 weights


def test_checkpoint_holds_fp32_masters_and_resumes_bf16_and_fp32(tmp_path):
    """A bf16 run's checkpoint has the fp32 masters under the fp32 run's keys: a bf16 run
    resumed from it has the same masters and moments, bit for bit; an fp32 run loads the
    masters as its weights."""
    _, model, opt = _train(torch.bfloat16, 3)
    path = save_checkpoint(tmp_path, 3, model, opt, {"model": CFG.to_dict()})
    m2, _, o2 = _setup(torch.bfloat16)
    load_checkpoint(path, m2, o2)
    for (n, p), p2 in zip(model.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(p.data, p2.data), n
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            if k in opt.state[p]:
                assert torch.equal(opt.state[p][k], o2.state[p2][k]), (n, k)
    m3, _, o3 = _setup(torch.float32)
    load_checkpoint(path, m3, o3)
    for (n, p), p3 in zip(model.named_parameters(), m3.parameters(), strict=True):
        want = opt.state[p].get("master", p.data)
        assert p3.dtype == torch.float32 and torch.equal(p3.data, want), n


def test_precision_flags_bad_values_and_resolution():
    t = RunConfig().train
    for field, bad in (("dtype", "fp16"), ("param_dtype", "half"), ("reduce_dtype", "fp8")):
        t2 = dataclasses.replace(t, **{field: bad})
        with pytest.raises(ConfigError, match=rf"train\.{field}='{bad}'; valid: "):
            check_precision(t2)
    with pytest.raises(ConfigError, match="param_dtype='bf16' with train.dtype='fp32'"):
        check_precision(dataclasses.replace(t, dtype="fp32", param_dtype="bf16"))
    with pytest.raises(ConfigError, match="resolves to fp32 on cpu"):
        resolve_precision(dataclasses.replace(t, param_dtype="bf16"), "cpu")
    # auto: fp32 on CPU, bf16 weights + compute on GPUs; bf16 on CPU is bf16, never fp32
    assert resolve_precision(t, "cpu").param == torch.float32
    gpu = resolve_precision(t, "cuda")
    assert gpu.param == gpu.compute == torch.bfloat16 and gpu.reduce == torch.float32
    cpu16 = resolve_precision(dataclasses.replace(t, dtype="bf16"), "cpu")
    assert cpu16.param == cpu16.compute == torch.bfloat16 and cpu16.autocast


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.multiproc
def test_trainer_bf16_zero1_migration_and_resume(tmp_path, tmp_path_factory):
    """train.py on CPU with --train.dtype=bf16 (bf16 weights, fp32 masters) at EP=2 x DP=2,
    ZeRO-1, forced migrations (the masters move with the moments): a run stopped at step 4
    and resumed equals the uninterrupted run (same ops in the same order: rel 1e-6, the
    printed precision), and it ends within 3 % of the fp32 run's loss."""
    from conftest import stdlib_corpus, step_losses, train_ok
    from test_zero import COMMON

    data = stdlib_corpus(tmp_path_factory.mktemp("d") / "c.txt", 40, 400_000)
    base = [*COMMON, "--data", data, "--parallel.ep=2", "--train.steps=8", "--parallel.zero=1",
            "--balance.enabled=true", "--debug.force_every=3"]
    full = step_losses(train_ok([*base, "--train.dtype=bf16"], tmp_path / "full", 4))
    part = [*base, "--train.dtype=bf16"]
    train_ok([*part, "--train.stop_after=4"], tmp_path / "part", 4)
    resumed = step_losses(train_ok([*part, "--resume"], tmp_path / "part", 4))
    for s in range(5, 9):
        assert resumed[s] == pytest.approx(full[s], rel=1e-6), s
    fp32 = step_losses(train_ok(base, tmp_path / "fp32", 4))
    assert abs(full[8] - fp32[8]) / fp32[8] < 0.03, (full[8], fp32[8])


def _reduce_worker(rank: int, world: int, _group) -> dict:
    from trainer.distributed.precision import grad_of

    torch.manual_seed(0)
    mesh = Mesh.plan(world, rank, pp=1, ep=1).build_groups()
    out = {}
    for name, rd in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = MoETransformer(CFG)
        model.reset_parameters(seed=0)
        to_working_dtype(model, torch.bfloat16)
        sync = GradSync(model, mesh, zero=0, overlap=True, reduce_dtype=rd)
        tok, tgt = _batch(rank)
        sync.start_step(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tok)
        F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten()).backward()
        sync.finish()
        grads = [grad_of(p) for p in model.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        out[name] = [g.numpy().copy() for g in grads]  # type: ignore[union-attr]
    return out


@pytest.mark.multiproc
def test_reduce_dtype_bf16_sends_bf16_and_keeps_fp32_gradients():
    """DP=2, bf16 weights: the fp32 main grads averaged over the ranks; with reduce_dtype=bf16
    the same within bf16 rounding of the summands and the sum (3 roundings of 2^-8 relative,
    so 2 % of each gradient's largest entry), and equal on both ranks."""
    from comm import run_local

    res = run_local(_reduce_worker, 2)
    for a, b in zip(res[0]["bf16"], res[1]["bf16"], strict=True):
        assert (a == b).all()
    for a, b in zip(res[0]["fp32"], res[0]["bf16"], strict=True):
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        assert (ta - tb).abs().max() <= 0.02 * ta.abs().max() + 1e-12
    assert any((a != b).any() for a, b in zip(res[0]["fp32"], res[0]["bf16"], strict=True))

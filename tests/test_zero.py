"""GradSync (bucketed, overlapped with backward) + ZeRO-1/2 against plain torch on one process.

The toy model has the two kinds of parameters the trainer has: dense ones (replicated over the
dp x ep ranks of a stage) and an `experts.w` stack sharded over the EP ranks (replicated over
dp). Rank r's loss uses only its EP shard, so the reference is one process holding the whole
stack, the whole batch, `torch.optim.AdamW` and `torch.nn.utils.clip_grad_norm_`: its loss is
the mean of the ranks' losses. float64 throughout, so the 1e-5 tolerance leaves room only for
summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import step_losses, train_ok
from torch import nn

from comm import run_local
from trainer.config import ConfigError, RunConfig
from trainer.distributed.grad_sync import GradSync
from trainer.distributed.mesh import Mesh
from trainer.distributed.zero import ZeroOptimizer, assign_owners, build_optimizer, check_zero

D, E, V, B = 8, 4, 5, 8  # model width, experts (all EP ranks), outputs, global batch rows
LR, CLIP, STEPS = 1e-2, 0.05, 3


def _full_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"inp.weight": torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5,
            "inp.bias": torch.randn(D, generator=g, dtype=torch.float64) * 0.1,
            "experts.w": torch.randn(E, D, D, generator=g, dtype=torch.float64) / D ** 0.5,
            "scale": 1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64),
            "out.weight": torch.randn(V, D, generator=g, dtype=torch.float64) / D ** 0.5}


class Toy(nn.Module):
    """x -> inp -> residual tanh experts -> * scale -> out. Holds experts [lo, hi)."""

    def __init__(self, full: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=torch.float64)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(full["experts.w"][lo:hi].clone())
        self.scale = nn.Parameter(full["scale"].clone())
        self.out = nn.Linear(D, V, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.inp.weight.copy_(full["inp.weight"])
            self.inp.bias.copy_(full["inp.bias"])
            self.out.weight.copy_(full["out.weight"])

    def forward(self, x: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        h = self.inp(x)
        for j in range(lo, hi if hi is not None else self.experts.w.shape[0]):
            h = h + torch.tanh(h @ self.experts.w[j])
        return self.out(h * self.scale)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, D, generator=g, dtype=torch.float64), torch.randn(B, V, generator=g,
                                                                           dtype=torch.float64)


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def reference(ep: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, whole batch: rows of data shard s use the experts of EP rank s % ep."""
    model = Toy(_full_params(), 0, E)
    opt = torch.optim.AdamW(_groups(model), lr=LR, foreach=False)
    El, shards = E // ep, B // 2  # 2 rows per data shard in these tests (B / (dp*ep) = 2)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = 0.0
        for s in range(shards):
            e = s % ep
            rows = slice(2 * s, 2 * s + 2)
            loss = loss + ((model(x[rows], e * El, (e + 1) * El) - y[rows]) ** 2).mean() / shards
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _train(mesh: Mesh, zero: int, overlap: bool, m: int, legacy: bool = False):
    El = E // mesh.ep
    model = Toy(_full_params(), mesh.ep_idx * El, (mesh.ep_idx + 1) * El)
    sync = GradSync(model, mesh, zero=zero, bucket_bytes=200, overlap=overlap)
    opt = build_optimizer(model, sync, LR, (0.9, 0.999), 1e-8, 0.1)
    assert isinstance(opt, torch.optim.AdamW if zero == 0 else ZeroOptimizer)
    norms, in_backward = [], 0
    for step in range(STEPS):
        x, y = _batch(step)
        rows = slice(2 * mesh.data_idx, 2 * mesh.data_idx + 2)
        if not legacy:
            sync.start_step(m)
        for xm, ym in zip(x[rows].chunk(m), y[rows].chunk(m), strict=True):
            (((model(xm) - ym) ** 2).mean() / m).backward()
        if legacy:
            sync.sync()
        else:
            sync.finish()
            in_backward += sync.launched_in_backward
        norms.append(sync.clip(CLIP))
        for g in opt.param_groups:
            g["lr"] = LR
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {n: bool(opt.state.get(p)) for n, p in model.named_parameters()}
    # numpy: pickled by value (a tensor would travel as shared memory the worker takes along)
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    return params, norms, state, in_backward, len(sync.buckets)


CASES = {"legacy": (0, False, 1, True), "z0_flat": (0, False, 1, False),
         "z0": (0, True, 2, False), "z1": (1, True, 2, False), "z2": (2, True, 2, False),
         "z1_flat": (1, False, 1, False), "z2_flat": (2, False, 2, False)}


def _zero_worker(rank: int, world: int, _group, ep: int, names: list[str]) -> dict:
    mesh = Mesh.plan(world, rank, pp=1, ep=ep).build_groups()
    runs = {name: _train(mesh, *CASES[name]) for name in names}
    return {"ep_idx": mesh.ep_idx, "dp_idx": mesh.dp_idx, "runs": runs}


def _check(results: list[dict], ep: int) -> None:
    ref, ref_norms = reference(ep)
    El = E // ep
    for res in results:
        lo = res["ep_idx"] * El
        runs = res["runs"]
        for name, (params, norms, _, _, _) in runs.items():
            assert all(n > CLIP for n in norms), (name, norms)  # clipping is active
            assert norms == pytest.approx(ref_norms, rel=1e-9), (name, norms, ref_norms)
            for n, a in params.items():
                p = torch.from_numpy(a)
                want = ref[n][lo:lo + El] if n == "experts.w" else ref[n]
                torch.testing.assert_close(p, want, rtol=1e-5, atol=0, msg=f"{name} {n}")
        # zero=0 without overlap is the earlier flat all-reduce, bit for bit; ZeRO-1 reduces
        # exactly as ZeRO-0 and steps the same AdamW, so it matches ZeRO-0 bit for bit too
        for a, b in (("legacy", "z0_flat"), ("z0_flat", "z1_flat"), ("z0", "z1")):
            if a not in runs or b not in runs:
                continue
            for n in runs[a][0]:
                assert (runs[a][0][n] == runs[b][0][n]).all(), (a, b, n)
        assert runs["z0"][3] > 0 and runs["z2"][3] > 0  # buckets launched during backward
        assert runs["z0"][4] > 2  # bucket_bytes=200 splits the toy's gradients
        assert all(runs["z0"][2].values())  # ZeRO-0: every parameter has state
    # ZeRO-1/2: each parameter's state lives on exactly one rank of its replica group
    for name in [n for n in ("z1", "z2", "z1_flat", "z2_flat") if n in results[0]["runs"]]:
        for n in results[0]["runs"][name][2]:
            if n == "experts.w":  # replicas: the dp ranks of one EP index
                for e in range(ep):
                    owners = [r["runs"][name][2][n] for r in results if r["ep_idx"] == e]
                    assert sum(owners) == 1, (name, n, e, owners)
            else:
                assert sum(r["runs"][name][2][n] for r in results) == 1, (name, n)
    # the EP ranks of one dp index own the same expert parameters (migration swaps their rows)
    for d in {r["dp_idx"] for r in results}:
        same_dp = [r["runs"]["z1"][2]["experts.w"] for r in results if r["dp_idx"] == d]
        assert len(set(same_dp)) == 1


@pytest.mark.multiproc
def test_zero_matches_single_process_adamw():
    """EP=2 x DP=2: ZeRO-0/1/2, overlap on and off, 2 accumulated micro-batches, clipping."""
    _check(run_local(_zero_worker, 4, 2, ["legacy", "z0_flat", "z0", "z1", "z2"]), ep=2)


@pytest.mark.multiproc
@pytest.mark.slow
def test_zero_dp4_dense_only_replicas():
    """DP=4 x EP=1: four replicas of every parameter (experts too); every case."""
    _check(run_local(_zero_worker, 4, 1, list(CASES)), ep=1)


def test_assign_owners_balanced_and_deterministic():
    sizes = [100, 7, 50, 50, 3, 100, 1]
    own = assign_owners(sizes, 3)
    assert own == assign_owners(list(sizes), 3)
    loads = [sum(s for s, o in zip(sizes, own, strict=True) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= 7
    assert assign_owners([5, 5], 1) == [0, 0]


def test_accumulation_count_mismatch_is_named():
    mesh = Mesh.plan(1, 0, pp=1, ep=1).build_groups()
    model = Toy(_full_params(), 0, E)
    sync = GradSync(model, mesh, zero=0)
    sync.start_step(1)
    x, y = _batch(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="armed for 1 micro-batches"):
        ((model(x) - y) ** 2).mean().backward()


def test_check_zero_bad_values():
    mesh = Mesh.plan(4, 0, pp=1, ep=2)
    for bad in (4, -1, "1", True):
        cfg = RunConfig()
        cfg.parallel.zero = bad
        with pytest.raises(ConfigError, match=r"parallel\.zero=.*valid: 0 .*1 .*2 .*3"):
            check_zero(cfg, mesh)
    cfg = RunConfig()
    cfg.parallel.zero = 3
    assert check_zero(cfg, mesh) is None
    cfg.parallel.schedule = "zb-h1"
    with pytest.raises(ConfigError, match=r"parallel\.zero=3 with parallel\.schedule='zb-h1'"):
        check_zero(cfg, Mesh.plan(4, 0, pp=2, ep=2))
    cfg.parallel.schedule = "1f1b"
    cfg.balance.redundant = 1
    with pytest.raises(ConfigError, match=r"parallel\.zero=3 with balance\.redundant=1"):
        check_zero(cfg, mesh)
    cfg = RunConfig()
    cfg.parallel.zero = 1
    assert check_zero(cfg, mesh) is None
    assert "no effect" in check_zero(cfg, Mesh.plan(1, 0, pp=1, ep=1))
    assert "expert state stays whole" in check_zero(cfg, Mesh.plan(2, 0, pp=1, ep=2))
    with pytest.raises(ValueError, match="zero=3"):
        GradSync(Toy(_full_params(), 0, E), Mesh.plan(1, 0, pp=1, ep=1).build_groups(), zero=3)




# -- the trainer: train.py runs (slow tier; the toy test above is the default-tier check) ------
COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64", "--train.eval_every=0",
          "--train.eval_batches=1", "--optim.warmup_steps=2", "--train.plot=false",
          "--comm.alltoall=flat", "--optim.grad_clip=0.5"]  # norms 2-4: clipping is active


def _run(tmp: Path, name: str, nproc: int, extra: list[str], data: str) -> Path:
    return train_ok([*COMMON, "--data", data, *extra], tmp / name, nproc)


def _same(a: dict[int, float], b: dict[int, float], steps: int, rel: float) -> None:
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=rel), (s, a[s], b[s])


def _norms(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("nproc,layout", [(4, ["--parallel.ep=2"]),
                                          (4, ["--parallel.ep=2", "--parallel.microbatches=2"]),
                                          (8, ["--parallel.pp=2", "--parallel.ep=2",
                                               "--parallel.microbatches=2"])],
                         ids=["ep2-dp2", "ep2-dp2-accumulate2", "pp2-ep2-dp2"])
def test_trainer_zero_losses_equal_zero0(tmp_path, small_data, nproc, layout):
    """ZeRO-1 and ZeRO-2 repeat the ZeRO-0 losses step by step (rel 1e-5), clipping active;
    also with 2 accumulated micro-batches per step (pp=1) and with a pipeline."""
    args = [*layout, "--train.steps=6"]
    base = _run(tmp_path, "z0", nproc, [*args, "--parallel.zero=0"], small_data)
    assert min(_norms(base)) > 0.5
    for z in (1, 2):
        got = _run(tmp_path, f"z{z}", nproc, [*args, f"--parallel.zero={z}"], small_data)
        _same(step_losses(base), step_losses(got), 6, 1e-5)


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_resume_across_zero_levels_and_layouts(tmp_path, small_data):
    """Checkpoints are the same under every ZeRO level. Same layout (EP=2 x DP=2): saved under
    ZeRO-1, resumed under ZeRO-2, the uninterrupted ZeRO-0 losses (rel 1e-5). Across layouts
    the losses move by summation order and by the per-rank aux loss (1 vs 4 processes), so
    there the reference is the same layout change under ZeRO-0: a ZeRO-1 checkpoint of
    EP=2 x DP=2 resumed by one process with ZeRO-0 equals the ZeRO-0 checkpoint resumed so,
    and a one-process ZeRO-0 checkpoint resumed with ZeRO-1 at EP=2 x DP=2 equals it resumed
    there with ZeRO-0 (rel 1e-5)."""
    ep2dp2 = ["--parallel.ep=2", "--train.steps=8"]
    full = _run(tmp_path, "full", 4, [*ep2dp2, "--train.ckpt_every=4"], small_data)
    c = _run(tmp_path, "c", 4, [*ep2dp2, "--parallel.zero=1", "--train.stop_after=4"],
             small_data)
    z1_ckpt = c / "checkpoints" / "step_00000004"
    z0_ckpt = full / "checkpoints" / "step_00000004"
    a = _run(tmp_path, "a", 1, ["--parallel.ep=1", "--train.steps=8",
                                f"--train.resume={z1_ckpt}"], small_data)
    ref_a = _run(tmp_path, "ref_a", 1, ["--parallel.ep=1", "--train.steps=8",
                                        f"--train.resume={z0_ckpt}"], small_data)
    one = _run(tmp_path, "one", 1, ["--parallel.ep=1", "--train.steps=8",
                                    "--train.stop_after=4"], small_data)
    one_ckpt = one / "checkpoints" / "step_00000004"
    b = _run(tmp_path, "b", 4, [*ep2dp2, "--parallel.zero=1", f"--train.resume={one_ckpt}"],
             small_data)
    ref_b = _run(tmp_path, "ref_b", 4, [*ep2dp2, f"--train.resume={one_ckpt}"], small_data)
    _run(tmp_path, "c", 4, [*ep2dp2, "--parallel.zero=2", "--resume"], small_data)
    _same(step_losses(full), step_losses(c), 8, 1e-5)
    for got, ref in ((a, ref_a), (b, ref_b)):
        want = step_losses(ref)
        assert sorted(want) == [5, 6, 7, 8]
        for s in want:
            assert step_losses(got)[s] == pytest.approx(want[s], rel=1e-5), (got.name, s)


@pytest.mark.slow
@pytest.mark.multiproc
def test_trainer_migration_under_zero1(tmp_path, small_data):
    """Forced expert migrations (weights + the owners' AdamW rows move between EP ranks) under
    ZeRO-1 at EP=2 x DP=2 give the losses of ZeRO-0 with the same migrations, and of no
    migration at all; experts really moved."""
    base = ["--parallel.ep=2", "--train.steps=6"]
    mig = [*base, "--balance.enabled=true", "--debug.force_every=2"]
    plain = step_losses(_run(tmp_path, "plain", 4, base, small_data))
    z0 = step_losses(_run(tmp_path, "z0", 4, mig, small_data))
    out = _run(tmp_path, "z1", 4, [*mig, "--parallel.zero=1"], small_data)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if r.get("event") == "migration"}) == [2, 4, 6]
    z1 = step_losses(out)
    _same(z0, z1, 6, 1e-5)
    _same(plain, z1, 6, 1e-5)

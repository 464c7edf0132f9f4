"""PP x EP (x DP) training equals a 1-process run of the same model and global batch.

Every layout runs the same 6 steps; per-step losses must match the 1-process run within
rel 2e-4 (fp32 on CPU: micro-batching, the all-to-all and the gradient all-reduces change the
summation order only, ~1e-7 relative per op; a routing flip would be a jump far above this).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_train, stdlib_corpus, step_losses

pytestmark = pytest.mark.multiproc

STEPS = 6
COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=32", "--train.global_batch=8",
          "--model.d_model=32", "--model.moe_ffn_dim=32", "--model.n_heads=2",
          "--model.n_kv_heads=1", "--model.head_dim=16", "--train.eval_every=0",
          "--train.eval_batches=1", "--optim.warmup_steps=3", "--train.plot=false",
          "--comm.alltoall=flat"]


def _run(out: Path, nproc: int, extra: list[str], data: str) -> dict[int, float]:
    r = run_train([*COMMON, "--data", data, f"--train.out_dir={out}", f"--train.steps={STEPS}",
                   *extra], nproc=nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return step_losses(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 20, 200_000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> dict[int, float]:
    return _run(tmp_path_factory.mktemp("ref"), 1, ["--parallel.ep=1"], data)


LAYOUTS = {
    "pp2-ep2-1f1b": (4, ["--parallel.schedule=1f1b"]),
    "pp2-ep2-interleaved": (4, ["--parallel.schedule=interleaved-1f1b", "--parallel.n_virtual=2"]),
    "pp2-ep2-zb": (4, ["--parallel.schedule=zb-h1"]),
    "pp2-ep2-dp2-1f1b": (8, ["--parallel.schedule=1f1b"]),
    "pp2-ep2-dp2-interleaved": (8, ["--parallel.schedule=interleaved-1f1b", "--parallel.n_virtual=2"]),
    "pp2-ep2-dp2-zb": (8, ["--parallel.schedule=zb-h1"]),
    # activation checkpointing recomputes the MoE all-to-all in the backward (also under the
    # split backward of zb-h1); EP placement "spread" renumbers every group
    "ep2-ckpt-full": (2, ["--parallel.pp=1", "--train.checkpointing=full"]),
    "pp2-ep2-zb-ckpt-full": (4, ["--parallel.schedule=zb-h1", "--train.checkpointing=full"]),
    "pp2-ep2-dp2-spread-ckpt-selective": (8, ["--parallel.schedule=1f1b",
                                              "--parallel.ep_placement=spread",
                                              "--train.checkpointing=selective"]),
}


# CI time budget (2 cores: an 8-process run costs ~50 s, mostly 8 interpreter start-ups; full
# recompute under zb-h1 doubles a 4-process run): the default tier keeps the 4-process
# interleaved and zb-h1 layouts and the 2-process full-recompute one; the rest (DP x PP x EP,
# spread placement, selective recompute in the trainer) run with -m slow
SLOW_LAYOUTS = {"pp2-ep2-1f1b", "pp2-ep2-dp2-1f1b", "pp2-ep2-dp2-interleaved", "pp2-ep2-dp2-zb",
                "pp2-ep2-zb-ckpt-full", "pp2-ep2-dp2-spread-ckpt-selective"}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_LAYOUTS
                                    else k for k in LAYOUTS])
def test_pipeline_matches_single_process(layout, tmp_path, data, reference):
    nproc, extra = LAYOUTS[layout]
    # 8 sequences over dp*ep shards; micro-batches of 1-2 sequences per shard
    mb = 2 if nproc == 8 else 4
    got = _run(tmp_path / layout, nproc, ["--parallel.pp=2", "--parallel.ep=2",
                                         f"--parallel.microbatches={mb}", *extra], data)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1))
    for s in reference:
        assert got[s] == pytest.approx(reference[s], rel=2e-4), (layout, s, reference[s], got[s])


def test_checkpoint_moves_between_layouts(tmp_path, data, reference):
    """Stop a PP=2 x EP=2 run at step 3, resume it as PP=1 x EP=2: same losses as 1 process."""
    out = tmp_path / "run"
    _run(out, 4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.microbatches=2",
                  "--train.stop_after=3"], data)
    got = _run(out, 2, ["--parallel.ep=2", "--resume"], data)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in reference:
        assert got[s] == pytest.approx(reference[s], rel=2e-4), (s, reference[s], got[s])

"""Training with --comm.a2a_overlap=fb equals the plain run (fp32, 20 steps, rel 1e-5).

fb pairs micro-batch j - 1's backward with micro-batch j's forward; the backwards still run
in order and every op sees the same shapes, so the only difference from the plain run is
the layer pipeline's path (comm/ep/pipeline.py) against dispatch / combine: the same rows
through the same GEMMs, ~1e-7 relative per op, which 20 AdamW steps amplify to ~1e-6 (the
layer-overlap runs of tests/test_trainer_a2a.py drift by that much). A lost or misrouted
row, or a gradient accumulated twice, moves the first step's loss by far more.
"""

from __future__ import annotations

import pytest
from conftest import run_train, step_losses

pytestmark = [pytest.mark.multiproc, pytest.mark.integration, pytest.mark.slow]

COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64", "--model.top_k=2",
          "--model.shared_ffn_dim=32", "--train.eval_every=0", "--train.eval_batches=2",
          "--optim.warmup_steps=5", "--train.plot=false", "--train.steps=20",
          "--comm.alltoall=flat"]

# (processes, extra args): PP=1 at EP=2 and EP=4 with M = 2..4; PP=2 with 1F1B and interleaved
CASES = {
    "ep2-m2": (2, ["--parallel.ep=2", "--parallel.microbatches=2"]),
    "ep2-m4": (2, ["--parallel.ep=2", "--parallel.microbatches=4"]),
    "ep4-m3": (4, ["--parallel.ep=4", "--train.global_batch=12",
                   "--parallel.microbatches=3"]),
    "ep2dp2-m2-halo": (4, ["--parallel.ep=2", "--parallel.microbatches=2",
                           "--comm.alltoall=halo",
                           "--comm.topology=configs/topologies/2x2-local.toml"]),
    "pp2-ep2-1f1b": (4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.microbatches=4",
                         "--parallel.schedule=1f1b"]),
    "pp2-ep2-interleaved": (4, ["--parallel.pp=2", "--parallel.ep=2",
                                "--parallel.microbatches=4",
                                "--parallel.schedule=interleaved-1f1b",
                                "--parallel.n_virtual=2"]),
}


def _losses(tmp_path, small_data, nproc: int, extra: list[str], overlap: str) -> dict:
    out = tmp_path / overlap
    r = run_train([*COMMON, "--data", small_data, *extra, f"--comm.a2a_overlap={overlap}",
                   f"--train.out_dir={out}"], nproc=nproc)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return step_losses(out)


@pytest.mark.parametrize("case", list(CASES))
def test_fb_losses_equal_plain(tmp_path, small_data, case):
    nproc, extra = CASES[case]
    plain = _losses(tmp_path, small_data, nproc, extra, "none")
    got = _losses(tmp_path, small_data, nproc, extra, "fb")
    assert sorted(got) == sorted(plain) == list(range(1, 21))
    for s in plain:
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])


def test_auto_runs_fb_across_nodes_and_says_so(tmp_path, small_data):
    """--comm.a2a_overlap=auto over two declared nodes with 2 micro-batches: train.py hands
    the trainer the planner's memory of the run, auto picks fb with 2 chunks, logs why, and
    trains the plain run's losses."""
    extra = ["--parallel.ep=4", "--parallel.microbatches=2", "--train.steps=6",
             "--comm.topology=configs/topologies/2x2-local.toml"]
    plain = _losses(tmp_path, small_data, 4, extra, "none")
    out = tmp_path / "auto"
    r = run_train([*COMMON, "--data", small_data, *extra, "--comm.a2a_overlap=auto",
                   f"--train.out_dir={out}"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "comm.a2a_overlap=auto: fb (EP group on 2 nodes, 2 micro-batches, a rank's " \
           "predicted peak with fb" in r.stdout, r.stdout[-3000:]
    assert "comm.a2a_chunks=auto: 2 (a2a_overlap=auto)" in r.stdout
    got = step_losses(out)
    assert sorted(got) == sorted(plain) == list(range(1, 7))
    for s in plain:
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])


def test_dedup_with_fb_and_chunks_equals_plain_flat(tmp_path, small_data):
    """dedup under fb with the layer pipeline inside each micro-batch (2 chunks), EP = 4 over
    two declared nodes at top-4: the plain flat run's losses (what auto runs across nodes
    with >= 2 micro-batches and top-k > 1; the emulator's dedup/fb/2 arm)."""
    extra = ["--parallel.ep=4", "--parallel.microbatches=2", "--model.top_k=4",
             "--comm.topology=configs/topologies/2x2-local.toml"]
    plain = _losses(tmp_path, small_data, 4, extra, "none")
    out = tmp_path / "dedup-fb2"
    r = run_train([*COMMON, "--data", small_data, *extra, "--comm.alltoall=dedup",
                   "--comm.a2a_overlap=fb", "--comm.a2a_chunks=2", f"--train.out_dir={out}"],
                  nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = step_losses(out)
    assert sorted(got) == sorted(plain) == list(range(1, 21))
    for s in plain:
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])

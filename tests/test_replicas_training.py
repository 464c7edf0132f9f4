"""Training with redundant expert slots (--balance.redundant=r) equals training without.

Reference: the same run on one process (no EP, no replicas). Replicas of an expert hold the same
weights and, after `trainer.distributed.replicas.sum_replica_grads`, the same gradient, so the model's
function and update are those of one copy per expert; what differs is only the fp32 summation
order (an expert's tokens split over replicas), hence rel 1e-5. Re-placement is forced every 2
steps (`debug.force_every`): each rank's redundant slots take other experts, so weights and
AdamW state move between ranks (balance.move_slots) during the run. Resuming at another r loads
one copy per logical expert into whatever slots the new run has.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import stdlib_corpus, step_losses, train_ok

pytestmark = pytest.mark.multiproc

COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64", "--train.eval_every=0",
          "--train.eval_batches=1", "--optim.warmup_steps=2", "--train.plot=false",
          "--train.steps=4", "--train.tensorboard=false", "--comm.alltoall=flat"]
FORCED = ["--balance.enabled=true", "--debug.force_every=2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 10, 100_000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> dict[int, float]:
    return _losses(tmp_path_factory.mktemp("ref"), 1, ["--parallel.ep=1"], data)


def _losses(out: Path, nproc: int, extra: list[str], data: str, events: list | None = None):
    train_ok([*COMMON, "--data", data, *extra], out, nproc)
    if events is not None:
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
        events += [x for x in rows if x.get("event") == "migration"]
    return step_losses(out)


def _same(ref: dict[int, float], got: dict[int, float]) -> None:
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), (s, ref[s], got[s])


def test_replicas_with_replacement_and_resume_at_another_r(tmp_path, data, reference):
    """EP=2 with r=1, re-placed at step 2, stopped there and resumed with r=2 (re-placed at 4)."""
    out, events = tmp_path / "run", []
    args = ["--parallel.ep=2", *FORCED]
    _losses(out, 2, [*args, "--balance.redundant=1", "--train.stop_after=2"], data, events)
    meta = json.loads((out / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert all(len(p["slots"]) == 2 * (8 // 2 + 1) for p in meta["placement"].values())
    got = _losses(out, 2, [*args, "--balance.redundant=2", "--resume"], data, events)
    _same(reference, got)
    assert {e["step"] for e in events} == {2, 4} and all(e["replicas"] for e in events)
    assert all(e["swaps"] > 0 for e in events)  # slots changed: weights and state moved


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,extra", [
    ("ep4-r1", 4, ["--parallel.ep=4", "--balance.redundant=1"]),
    ("pp2-ep2-r1", 4, ["--parallel.pp=2", "--parallel.ep=2", "--parallel.microbatches=2",
                       "--balance.redundant=1"]),
    ("ep2-dp2-zero2-r1", 4, ["--parallel.ep=2", "--parallel.zero=2", "--balance.redundant=1"]),
])
def test_replicas_equal_one_process(name, nproc, extra, tmp_path, data, reference):
    _same(reference, _losses(tmp_path / name, nproc, [*extra, *FORCED], data))


@pytest.mark.slow
def test_resume_without_replicas_on_one_process(tmp_path, data, reference):
    out = tmp_path / "run"
    _losses(out, 2, ["--parallel.ep=2", "--balance.redundant=2", *FORCED,
                     "--train.stop_after=2"], data)
    _same(reference, _losses(out, 1, ["--parallel.ep=1", "--resume"], data))


@pytest.mark.slow
def test_hf_import_fills_every_replica(tmp_path, data):
    """--model.hf_path with r = 1: every replica slot reads its expert's weights, so the first
    loss equals the import without replicas."""
    import subprocess
    import sys

    hf = tmp_path / "hf"
    subprocess.run([sys.executable, "examples/make_tiny_hf.py", "--out", str(hf)], check=True,
                   capture_output=True)
    args = [f"--model.hf_path={hf}", "--parallel.ep=2", "--train.steps=1", "--train.seq_len=64",
            "--train.global_batch=4", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.plot=false", "--train.tensorboard=false", "--comm.alltoall=flat",
            "--data", data]
    first = []
    for r in (0, 1):
        out = tmp_path / f"r{r}"
        first.append(step_losses(train_ok([*args, f"--balance.redundant={r}"], out, 2))[1])
    assert first[1] == pytest.approx(first[0], rel=1e-6)

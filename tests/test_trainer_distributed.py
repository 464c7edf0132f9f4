"""Expert-parallel training equals one process; checkpoints resume exactly and survive crashes.

Tolerance: fp32 on CPU. The 4-process run sums gradients in a different order (all-reduce and
all-to-all vs one batch), so per-step losses drift by float32 rounding (~1e-7 relative per op),
amplified by 20 AdamW steps; we allow 2e-4 relative. A routing flip (a token choosing another
expert because of a rounding difference at a near-tie) would show as a jump far above that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import step_losses, train_ok

pytestmark = pytest.mark.multiproc

COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64",
          "--train.eval_every=0", "--train.eval_batches=2", "--optim.warmup_steps=5",
          "--train.plot=false"]


def _run(tmp: Path, name: str, nproc: int, extra: list[str], data: str) -> Path:
    return train_ok([*COMMON, "--data", data, *extra], tmp / name, nproc)


@pytest.mark.slow  # CI time: covered in the default tier by test_trainer_pipeline (ep2 vs one process)
def test_ep2_dp2_matches_single_process(tmp_path, small_data):
    one = step_losses(_run(tmp_path, "one", 1, ["--parallel.ep=1", "--train.steps=20"], small_data))
    four = step_losses(_run(tmp_path, "four", 4, ["--parallel.ep=2", "--train.steps=20",
                                              "--comm.alltoall=flat"], small_data))
    assert sorted(one) == sorted(four) == list(range(1, 21))
    for s in one:
        assert four[s] == pytest.approx(one[s], rel=2e-4), (s, one[s], four[s])
    assert one[20] < one[1] - 0.5  # it learns


@pytest.mark.slow  # CI time: covered in the default tier by test_chaos (kill -9, resume, same losses)
def test_resume_matches_uninterrupted(tmp_path, small_data):
    args = ["--parallel.ep=2", "--train.steps=12", "--comm.alltoall=flat"]
    full = step_losses(_run(tmp_path, "full", 2, args, small_data))
    # the same run, stopped after 6 steps (checkpoint), then resumed to 12
    part = tmp_path / "part"
    _run(tmp_path, "part", 2, [*args, "--train.stop_after=6"], small_data)
    assert (part / "checkpoints" / "step_00000006" / "meta.json").is_file()
    # the resumed run must use the same schedule length as the uninterrupted one
    _run(tmp_path, "part", 2, [*args, "--resume"], small_data)
    resumed = step_losses(part)
    assert sorted(resumed) == list(range(1, 13))
    for s in range(1, 13):
        assert resumed[s] == pytest.approx(full[s], rel=1e-6), (s, full[s], resumed[s])


@pytest.mark.slow  # CI time: covered in the default tier by test_zero3 (migration + resume)
def test_migration_keeps_losses_and_resumes(tmp_path, small_data):
    """Forced expert migrations every 2 steps (weights + AdamW moments move between the EP
    ranks) leave the per-step losses of a run without migration unchanged, also across a
    checkpoint resume in the middle (the placement is restored from the checkpoint)."""
    base = ["--parallel.ep=2", "--train.steps=10", "--comm.alltoall=flat"]
    plain = step_losses(_run(tmp_path, "plain", 2, base, small_data))
    mig = [*base, "--balance.enabled=true", "--debug.force_every=2"]
    out = tmp_path / "mig"
    _run(tmp_path, "mig", 2, [*mig, "--train.stop_after=5"], small_data)
    meta = json.loads((out / "checkpoints" / "step_00000005" / "meta.json").read_text())
    ident = list(range(8))
    assert any(p != ident for p in meta["placement"].values())  # experts really moved
    _run(tmp_path, "mig", 2, [*mig, "--resume"], small_data)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "migration"]
    # 4 MoE layers x migrations at steps 2, 4, 6, 8, 10
    assert sorted({e["step"] for e in events}) == [2, 4, 6, 8, 10]
    assert all(e["moved_experts"] == 2 and e["bytes_sent"] > 0 for e in events)
    got = step_losses(out)
    for s in range(1, 11):
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])


def test_halo_training_equals_flat(tmp_path, small_data):
    """EP=4 over two (declared) nodes of 2 ranks: HALO's hierarchical exchange trains with the
    same per-step losses as the flat all-to-all (it is an exact permutation of the same rows)."""
    args = ["--parallel.ep=4", "--train.steps=4", "--train.global_batch=8",
            "--comm.topology=configs/topologies/2x2-local.toml"]
    flat = step_losses(_run(tmp_path, "flat", 4, [*args, "--comm.alltoall=flat"], small_data))
    halo = step_losses(_run(tmp_path, "halo", 4, [*args, "--comm.alltoall=halo"], small_data))
    assert sorted(flat) == sorted(halo) == list(range(1, 5))
    for s in flat:
        assert halo[s] == pytest.approx(flat[s], rel=1e-6), (s, flat[s], halo[s])

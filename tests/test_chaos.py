"""Run-level faults, once each, on the smallest multi-process layout (EP=2, 2 gloo processes).

The reference is an unfaulted run of the same job; the full fault matrix (PP=2 x EP=2, 5 seeds
per fault) is benchmarks/chaos.py, whose launch/kill helpers these tests reuse.
  NaN, skip policy  -> the run completes; steps before the fault equal the reference (rel
                       1e-6; same layout, same summation order), the fault step is logged and
                       skipped, every later loss is finite
  stall             -> the peers fail within the timeout with `error: rank R: <phase> failed at
                       step K`; the job exits, nothing hangs
  kill -9 (slow)    -> torchrun --max-restarts 1 + --train.resume=auto: losses equal to the
                       reference (rel 1e-6). Launched with chaos's default "c10d" rendezvous and
                       TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a static rendezvous (--master-port)
                       shares one store across restarts and the relaunch fails (see chaos.py)
The reference, NaN and stall runs start their ranks with the tests' fork launcher (conftest's
run_train: the trainer and torchrun's worker environment unchanged, without torchrun's start-up);
only kill -9 needs torchrun's agent (its restart).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_train, stdlib_corpus

sys.path.insert(0, str(ROOT / "benchmarks"))
import chaos  # noqa: E402  (the harness lives in benchmarks/, a folder of scripts)

pytestmark = pytest.mark.multiproc

STEPS = 6
NPROC = 2
# chaos.SMALL is the pipeline tests' smallest model; EP=2 only, so 2 processes suffice
ARGS = [*chaos.SMALL, "--parallel.pp=1", "--parallel.ep=2", "--parallel.microbatches=1",
        f"--train.steps={STEPS}", "--train.ckpt_every=2"]
SAME_LAYOUT_REL = 1e-6


def run_forked(args: list[str], out: Path) -> chaos.Run:
    """One launch through the fork launcher, returned as the chaos harness's Run."""
    t0 = time.monotonic()
    r = run_train([*args, f"--train.out_dir={out}"], nproc=NPROC, timeout=300)
    return chaos.Run(out, r.returncode, time.monotonic() - t0, r.stdout, r.stderr, args)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 20, 200_000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> dict[int, float]:
    r = run_forked([*ARGS, "--data", data], tmp_path_factory.mktemp("ref") / "run")
    assert r.rc == 0, r.stderr[-3000:]
    got = chaos.losses(r.out)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def test_nan_skip_continues(tmp_path, data, reference):
    k = 3
    r = run_forked([*ARGS, "--data", data, f"--debug.fault_nan_step={k}",
                    "--debug.fault_rank=1", "--train.nan_policy=skip"], tmp_path / "run")
    assert r.rc == 0, r.stderr[-3000:]
    got = chaos.losses(r.out)
    for s in range(1, k):
        assert math.isclose(got[s], reference[s], rel_tol=SAME_LAYOUT_REL), (s, got[s], reference[s])
    assert not math.isfinite(got[k])
    assert all(math.isfinite(got[s]) for s in range(k + 1, STEPS + 1)), got
    # the skipped update changes what follows: later losses are not the reference's
    assert got[STEPS] != reference[STEPS]
    ev = [e for e in chaos.events(r.out) if e["event"] == "nonfinite"]
    assert [(e["step"], e["action"]) for e in ev] == [(k, "skipped step")]
    assert chaos.check_checkpoint(r.out, r.args) == ""


def test_stall_stops_with_clear_error(tmp_path, data, reference):
    k, timeout_s = 3, 10
    t0 = time.monotonic()
    r = run_forked([*ARGS, "--data", data, f"--debug.fault_stall_step={k}",
                    "--debug.fault_rank=1", f"--train.timeout_s={timeout_s}"], tmp_path / "run")
    assert r.rc not in (0, None), (r.rc, r.stderr[-3000:])
    line = chaos.clear_error(r.stderr, k)
    assert line.startswith("error: rank 0: ") and f"failed at step {k}" in line, r.stderr[-3000:]
    assert "timeout_s=10" in line  # tells the user which knob decided
    # rank 0 logged the steps before the stall and stopped waiting within the timeout: the
    # whole job (startup included) ends far before the stalled rank's 10 * timeout + 60 s sleep
    assert chaos.last_step(r.out) == k - 1
    assert time.monotonic() - t0 < 10 * timeout_s + 60
    # the checkpoint written before the stall (step 2) is complete and loads
    assert (r.out / "checkpoints" / "step_00000002" / "meta.json").is_file()
    assert chaos.check_checkpoint(r.out, r.args) == ""


# slow tier: torchrun's agent and its restart start 4 fresh interpreters (~55 s of a default
# tier on 2 cores); the default tier keeps resume=auto from a checkpoint (test_elastic.py) and
# the NaN and stall faults here
@pytest.mark.slow
def test_kill9_restart_resumes_the_losses(tmp_path, data, reference):
    r = chaos.run_kill_at_step([*ARGS, "--data", data, "--train.resume=auto"], tmp_path / "run",
                               rank=1, step=3, limit_s=300, nproc=NPROC)
    assert r.injected, "the job ended before the kill"
    assert r.rc == 0, chaos.first_error(r.stderr)
    assert "resumed from" in r.stdout  # it really restarted from a checkpoint
    got = chaos.losses(r.out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert math.isclose(got[s], reference[s], rel_tol=SAME_LAYOUT_REL), (s, got[s], reference[s])
    rows = [json.loads(x) for x in (r.out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS  # resumed steps were not logged twice
    assert chaos.check_checkpoint(Path(r.out), r.args) == ""

"""The tests' zygote launcher (tests/zygote.py) against a fresh interpreter.

A run forked from the zygote must be the run `python train.py` gives: the same losses as a
fresh interpreter's (exactly: the same ops on the same shapes in the same order on one machine,
same thread count), train.py's exit status and error line for a bad request; a run past its
timeout is killed whole and the zygote serves the next request.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import zygote
from conftest import ROOT, base_env, run_train, step_losses

pytestmark = pytest.mark.integration

SMALL = ["--model.d_model=32", "--model.moe_ffn_dim=32", "--model.n_heads=2",
         "--model.n_kv_heads=1", "--model.head_dim=16", "--model.n_layers=2",
         "--train.seq_len=16", "--train.global_batch=4", "--train.eval_every=0",
         "--train.plot=false", "--train.steps=3"]


def test_zygote_run_equals_a_fresh_interpreter(tmp_path, small_data):
    args = [*SMALL, f"--data={small_data}"]
    fresh = subprocess.run([sys.executable, "train.py", *args, f"--train.out_dir={tmp_path / 'a'}"],
                           cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    forked = run_train([*args, f"--train.out_dir={tmp_path / 'b'}"])
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert step_losses(tmp_path / "b") == step_losses(tmp_path / "a")
    assert sorted(step_losses(tmp_path / "b")) == [1, 2, 3]
    # a bad request: train.py's exit status and one error line (tests/test_trainer_bad_inputs.py
    # checks the same contract through torchrun)
    got = run_train([*args, "--model.preset=nope", f"--train.out_dir={tmp_path / 'c'}"])
    assert got.returncode == 2, got.stderr
    assert got.stderr.count("error: unknown model preset 'nope'; valid: ") == 1, got.stderr


def test_zygote_timeout_kills_the_run_and_serves_the_next(tmp_path, small_data):
    z = zygote.Zygote.shared(base_env())
    stall = [*SMALL, f"--data={small_data}", "--debug.fault_stall_step=1", "--debug.fault_rank=0",
             f"--train.out_dir={tmp_path / 'stall'}"]
    with pytest.raises(subprocess.TimeoutExpired):
        z.run(stall, 1, 0, base_env(), timeout=5)
    r = z.run([*SMALL, "--model.preset=nope"], 1, 0, base_env(), timeout=60)
    assert r.returncode == 2 and "unknown model preset 'nope'" in r.stderr, r.stderr

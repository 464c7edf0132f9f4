"""`--train.cpu_affinity`: train.py pins each rank of a single-node CPU run to its own cores
where the processes x threads fill them (comm/tools/affinity.py), says so in its start-up
log, and leaves placement to the OS with `none`. The rule itself: tests/test_comm_spawn.py."""

from __future__ import annotations

import os

import pytest
from conftest import run_train

TINY = ["--model.d_model=32", "--model.moe_ffn_dim=32", "--model.n_heads=2",
        "--model.n_kv_heads=1", "--model.head_dim=16", "--model.n_layers=2",
        "--train.seq_len=16", "--train.global_batch=4", "--train.steps=1",
        "--train.eval_every=0", "--train.eval_batches=1", "--train.plot=false",
        "--train.ckpt_every=0", "--parallel.dp=2", "--comm.alltoall=flat"]


@pytest.mark.integration
@pytest.mark.multiproc
def test_two_ranks_are_pinned_to_their_own_cores_only_when_they_fill_them(tmp_path):
    mask = sorted(os.sched_getaffinity(0))
    threads = max(1, (os.cpu_count() or 1) // 2)  # train.py's default for 2 local ranks
    # the reference: rank 0 gets the first `threads` cores of the mask when 2 x threads fill it
    want = mask[:threads] if 2 * threads == len(mask) else None
    for mode in ("auto", "none"):
        r = run_train([*TINY, f"--train.cpu_affinity={mode}",
                       f"--train.out_dir={tmp_path / mode}"], nproc=2)
        assert r.returncode == 0, r.stderr[-3000:]
        line = f"CPU affinity: each rank pinned to {threads} core(s) of its own (rank 0: {want})"
        assert (line in r.stdout) == (mode == "auto" and want is not None), r.stdout[-2000:]

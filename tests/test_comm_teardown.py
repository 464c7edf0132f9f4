"""Process teardown after `comm` exchanges, without a barrier: every rank exits with status 0.

The job (issue 22): a gloo group calls `comm.all_to_all` five times (forward only), then one
`all_reduce` and `destroy_process_group()`, and the process ends by falling off its script,
so the interpreter shuts down as a launched training script's would. Nothing may abort
there (SIGABRT, `terminate called without an active exception`). The ranks fork from a
parent that imported torch once (a fresh interpreter per rank costs seconds on 2 cores),
run from `python tests/test_comm_teardown.py`, which reports each run's exit statuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _job(rank: int, world: int, init: str, algorithm: str) -> None:
    import torch
    import torch.distributed as dist

    import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    topo = comm.Topology.uniform(2, world // 2)
    g = torch.Generator().manual_seed(rank)
    kept = []  # the outputs (and their autograd nodes) live until the interpreter ends
    for _ in range(5):
        splits = torch.randint(0, 6, (world,), generator=g).tolist()
        x = torch.randn(sum(splits), 16, generator=g, requires_grad=True)
        y, _ = comm.all_to_all(x, splits, None, algorithm, topology=topo)
        kept.append(y)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    _job.kept = kept  # type: ignore[attr-defined]


def _runs(algorithm: str, world: int, runs: int) -> list[list[int]]:
    """Fork `world` ranks per run; each ends through interpreter shutdown (SystemExit
    unwinds to the top of this script). Returns every run's exit statuses (-6: SIGABRT)."""
    import torch  # noqa: F401  (imported once here, inherited by every rank)

    import comm  # noqa: F401

    statuses = []
    for _ in range(runs):
        init = os.path.join(tempfile.mkdtemp(prefix="comm-teardown-"), "rendezvous")
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _job(rank, world, init, algorithm)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                sys.exit(code)  # normal interpreter shutdown, as after a script's last line
            pids.append(pid)
        statuses.append([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
    return statuses


def _run_script(algorithm: str, world: int, runs: int, tmp_path: Path) -> list[list[int]]:
    out = tmp_path / f"{algorithm}.json"
    proc = subprocess.run([sys.executable, __file__, algorithm, str(world), str(runs), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60 + 30 * runs,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-3000:]
    statuses = json.loads(out.read_text())
    assert len(statuses) == runs and all(len(s) == world for s in statuses)
    return statuses


@pytest.mark.multiproc
@pytest.mark.parametrize("algorithm", [pytest.param("flat", marks=pytest.mark.slow), "halo"])
def test_no_abort_at_teardown_without_a_barrier(algorithm: str, tmp_path: Path) -> None:
    statuses = _run_script(algorithm, 4, 2, tmp_path)
    assert statuses == [[0] * 4] * 2, statuses


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("algorithm", ["flat", "halo"])
def test_no_abort_at_teardown_six_ranks_many_runs(algorithm: str, tmp_path: Path) -> None:
    statuses = _run_script(algorithm, 6, 10, tmp_path)
    assert statuses == [[0] * 6] * 10, statuses


if __name__ == "__main__":
    algorithm, world, runs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    result = _runs(algorithm, world, runs)
    Path(out).write_text(json.dumps(result))

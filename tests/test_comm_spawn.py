"""`comm.run_local`, the one launcher of local process groups (tests, benchmarks, `tuner
measure`): results come back in rank order, tensors included, a rank's failure is raised in
the parent with its traceback, and bad arguments are refused before any process starts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import run_local


def _sum_worker(rank: int, world: int, group: dist.ProcessGroup, scale: float) -> dict:
    # Returned tensors travel as plain pickle bytes: the rank has exited when the parent reads.
    t = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(t, group=group)
    return {"rank": rank, "world": world, "sum": t, "threads": torch.get_num_threads()}


def _failing_worker(rank: int, world: int, group: dist.ProcessGroup) -> None:
    if rank == 1:
        raise KeyError("rank one's own message")
    dist.barrier(group=group)


@pytest.mark.multiproc
def test_results_in_rank_order_with_tensors() -> None:
    out = run_local(_sum_worker, 2, 0.5, threads=2)
    # The reference: the all-reduced sum written out (ranks hold 1 and 2, times 0.5).
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["threads"] == 2 for o in out)
    for o in out:
        assert torch.equal(o["sum"], torch.full((3,), 1.5))


@pytest.mark.multiproc
@pytest.mark.slow
def test_failing_rank_is_raised_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*KeyError.*rank one's own"):
        run_local(_failing_worker, 2, timeout_s=60, start_method="spawn")


@pytest.mark.parametrize("kw, needle", [
    ({"world_size": 0}, "world_size must be >= 1, got 0"),
    ({"threads": 0}, "threads must be >= 1, got 0"),
    ({"start_method": "fork"}, "start_method must be 'forkserver' or 'spawn', got 'fork'"),
])
def test_bad_arguments(kw: dict, needle: str) -> None:
    args = {"world_size": 2, **kw}
    with pytest.raises(ValueError, match=needle):
        run_local(_sum_worker, args.pop("world_size"), 1.0, **args)

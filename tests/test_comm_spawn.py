"""`comm.run_local`, the one launcher of local process groups (tests, benchmarks, `tuner
measure`): results come back in rank order, tensors included, a rank's failure is raised in
the parent with its traceback, and bad arguments are refused before any process starts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import run_local
from comm.tools.affinity import rank_cores


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
    ({"cpu_affinity": "cores"}, "cpu_affinity='cores'; valid: auto, none"),
])
def test_bad_arguments(kw: dict, needle: str) -> None:
    args = {"world_size": 2, **kw}
    with pytest.raises(ValueError, match=needle):
        run_local(_sum_worker, args.pop("world_size"), 1.0, **args)


def _mask_worker(rank: int, world: int, group: dist.ProcessGroup) -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("args, want", [
    ((0, 2, 1, [0, 1]), [0]), ((1, 2, 1, [1, 0]), [1]),  # a core each (this project's VM)
    ((1, 2, 2, [4, 5, 6, 7]), [6, 7]), ((2, 3, 1, [3, 5, 9]), [9]),  # blocks of the mask
    ((0, 4, 1, [0, 1]), None),  # more processes than cores: shared, left to the OS
    ((0, 2, 1, [0, 1, 2, 3]), None),  # spare cores (other jobs may use them): left alone
    ((0, 1, 2, [0, 1]), None),  # one process: nothing to separate
])
def test_rank_cores_gives_each_rank_its_own_block_only_when_they_fill_the_mask(args, want):
    assert rank_cores(*args) == want


@pytest.mark.parametrize("args, needle", [((2, 2, 1, [0, 1]), "local_rank=2 outside 0..1"),
                                          ((0, 2, 0, [0, 1]), "threads=0 must be >= 1")])
def test_rank_cores_names_bad_arguments(args, needle):
    with pytest.raises(ValueError, match=needle):
        rank_cores(*args)


@pytest.mark.multiproc
def test_auto_affinity_pins_two_ranks_to_disjoint_cores() -> None:
    import os

    mask = sorted(os.sched_getaffinity(0))
    if len(mask) % 2:  # an odd mask has no equal halves: "auto" pins nothing there (tested above)
        pytest.skip(f"{len(mask)} cores do not split between 2 ranks")
    t = len(mask) // 2
    pinned = run_local(_mask_worker, 2, threads=t, cpu_affinity="auto")
    # the reference: the parent's mask cut in two halves, in order
    assert pinned == [mask[:t], mask[t:]]
    assert run_local(_mask_worker, 2, threads=t, cpu_affinity="none") == [mask, mask]

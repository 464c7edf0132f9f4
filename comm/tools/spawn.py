"""Run a function on N local processes joined in one torch.distributed group.

The one launcher of local process groups: the multi-process tests, the single-machine
benchmarks and `tuner measure` all use it. It gives every rank the WORLD group explicitly (no
global state in the callee), collects each rank's return value in the parent and re-raises a
rank's exception there with its traceback. Rendezvous goes through a file in a fresh temporary
directory, so concurrent runs on a shared machine never race for a port.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from comm.tools.affinity import check_mode

__all__ = ["run_local"]


def _worker(
    rank: int,
    world: int,
    init_file: str,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    threads: int,
    cpu_affinity: str,
) -> None:
    # One intra-op thread per rank by default: up to 9 ranks share 2 cores in CI, and
    # oversubscription makes collective timings and test runtimes erratic.
    import torch

    from comm.tools.affinity import pin_local_rank

    pin_local_rank(cpu_affinity, rank, world, threads)  # before torch's and gloo's threads
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        # gloo returns from init on a rank once its own pairs connect; a rank that finished
        # early and destroyed the group would reset a slower rank's handshake ("Connection
        # closed by peer"). Barriers on both sides keep the group alive for everyone.
        dist.barrier()
        try:
            out = fn(rank, world, dist.group.WORLD, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes, not the queue's shared-memory tensor passing: that needs the
        # sender alive until the parent reads, and ranks exit right after this put.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure (incl. KeyboardInterrupt) to the parent
        results.put((rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    start_method: str = "forkserver",
    threads: int = 1,
    cpu_affinity: str = "none",
) -> list[Any]:
    """Call `fn(rank, world_size, group, *args)` on `world_size` spawned processes.

    `fn` must be importable by name (a module-level function); `group` is the WORLD group,
    also the default one. `start_method="spawn"` gives each rank a fresh interpreter (slower;
    use it where a fork server is unwanted); `threads` is each rank's torch intra-op thread
    count; `cpu_affinity="auto"` pins the ranks as train.py does (`comm.tools.affinity`: each
    rank its own cores where world x threads fill them). Returns the per-rank results in rank order; raises RuntimeError with the first
    failing rank's traceback, or on timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    check_mode(cpu_affinity, "cpu_affinity")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx: ForkServerContext | SpawnContext  # a literal name each: typeshed types them
    if start_method == "forkserver":
        ctx = mp.get_context("forkserver")
        # The fork server imports torch once and forks every rank from that clean process:
        # ~0.1 s per rank instead of a 2-5 s torch import each (9 ranks on 2 loaded cores).
        ctx.set_forkserver_preload(["torch", "torch.distributed", "comm"])
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="comm-spawn-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, backend, fn, args, results, threads,
                      cpu_affinity),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, Any] = {}
        failure: str | None = None
        try:
            for _ in range(world_size):
                try:
                    rank, ok, out = results.get(timeout=timeout_s)
                except queue.Empty:
                    failure = f"timed out after {timeout_s:.0f} s waiting for {world_size} ranks"
                    break
                if not ok:
                    failure = f"rank {rank} failed:\n{out}"
                    break
                collected[rank] = pickle.loads(out)
        finally:
            for p in procs:
                p.join(timeout=5.0 if failure is None else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    if failure is not None:
        raise RuntimeError(failure)
    return [collected[r] for r in range(world_size)]

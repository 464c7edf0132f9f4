"""Run a function on N local processes in one gloo group (tests and the CPU benchmark).

Rendezvous goes through a file in a fresh temporary directory, so concurrent runs on a shared
machine never race for a port. Each rank's return value comes back to the parent through a
queue; a failing rank's traceback is re-raised in the parent as RuntimeError.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_local"]


def _worker(rank: int, world: int, init_file: str, fn: Callable[..., Any],
            args: tuple[Any, ...], results: Any, threads: int) -> None:
    import torch

    # Ranks share few cores; one intra-op thread each keeps them from fighting over them.
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes, not the queue's shared-memory tensor passing: that needs the
        # sender alive until the parent reads, and ranks exit right after this put.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure to the parent instead of hanging it
        results.put((rank, False, traceback.format_exc()))


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0,
              threads: int = 1) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned processes joined in the
    default (WORLD) gloo group; return the results in rank order. `fn` must be importable
    by name (a module-level function)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="pipeline-spawn-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world_size, init_file, fn, args, results, threads))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        try:
            while len(got) < world_size:
                try:
                    rank, ok, out = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise RuntimeError(
                        f"timed out after {timeout_s}s; ranks done: {sorted(got)}"
                    ) from None
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{out}")
                got[rank] = pickle.loads(out)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [got[r] for r in range(world_size)]

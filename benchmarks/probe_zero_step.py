"""Where does a ZeRO step's optimizer time go? (issue 33, item 7: the small ZeRO rows)

Runs under torchrun with train.py's options; every rank builds the real `Trainer`, takes 3
warm-up steps, then N instrumented `Trainer.train_step()`s, then N rounds of each piece alone
(every rank entering it at the same moment: a barrier before each), and prints each rank's
medians. Timed inside the step (wrappers around the trainer's own calls, no copies of its
code; `_patch`):

    ZeroOptimizer.step     the inner AdamW step over the owned parameters (zs_inner), then
                           `GradSync.broadcast_params` (bc), split into pack
                           (`GradSync.pack_bucket`, the owner's torch.cat per bucket), launch
                           (dist.broadcast(async_op=True) calls), wait (work.wait()), unpack
                           (`GradSync.unpack_bucket`, the receivers' per-parameter copy_) and
                           the rest (the receivers' empty buffers, the loop); zs_rest: the
                           hyper-parameters and master copies around the inner step
    plain AdamW            (zero=0) the torch optimizer's step
    the rest of update_state    state_bytes (memory report) and zero_grad
    "other"                allreduce_mean (loss), expert counts, imbalance, the metrics gather

and alone: the inner AdamW step, broadcast_params, a 16-value fp64 all-reduce, the pack
copies alone (torch.cat over each owned bucket) and the unpack copies alone. Appends the
medians to probe_zero_step.jsonl (runs/bench/probe_zero_step/, `--out`, or `--record`:
benchmarks/results/); every other argument is train.py's.

    OMP_NUM_THREADS=1 flock /tmp/piper-bench.lock python -m torch.distributed.run \\
        --nproc-per-node 2 benchmarks/probe_zero_step.py --model.preset=tiny \\
        --train.seq_len=128 --train.global_batch=8 --parallel.dp=2 --parallel.ep=1 \\
        --parallel.zero=1 --train.steps=1000 --train.eval_every=0 --train.ckpt_every=0 \\
        --train.plot=false --train.memory_report=true --train.out_dir=runs/probe_zero
    PROBE_ITERS=40 (default 30) sets N.

What it showed (docs/planner.md, "ZeRO's weight broadcast"): the inner update runs at the
platform's optimizer rate and the broadcasts' launch + wait at its broadcast fit; the pack
and unpack copies (one pass over every broadcast weight on each rank) were not priced.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_output_args, output_dir, probe_trainer, record_ranks  # noqa: E402

import trainer.distributed.grad_sync as grad_sync_mod  # noqa: E402
import trainer.step as step_mod  # noqa: E402
from trainer.distributed.grad_sync import GradSync  # noqa: E402
from trainer.distributed.tensor_parallel import local  # noqa: E402
from trainer.distributed.zero import ZeroOptimizer  # noqa: E402
from trainer.observe.metrics import LayerGather  # noqa: E402
from trainer.observe.stats import StepStats  # noqa: E402
from tuner.measure import (  # noqa: E402
    COLL_SIZES,
    collective_times,
    copy_bandwidth,
    fit_latency_bandwidth,
    optimizer_rate,
    tiny_params_with_grads,
)

ACC: dict[str, float] = defaultdict(float)  # this step's seconds per piece


def _timed(name: str, fn):
    @functools.wraps(fn)
    def run(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            ACC[name] += time.perf_counter() - t
    return run


class _TimedWork:
    """A collective's Work whose wait() adds its seconds to ACC["bc_wait"]."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self):
        t = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            ACC["bc_wait"] += time.perf_counter() - t


class _TimedDist:
    """torch.distributed as trainer/distributed/grad_sync.py sees it during the probe: its
    broadcast launch timed (bc_launch, buckets, bytes) and its Work's wait timed."""

    def __getattr__(self, name: str):
        return getattr(dist, name)

    @staticmethod
    def broadcast(tensor, *a, **kw):
        t = time.perf_counter()
        work = dist.broadcast(tensor, *a, **kw)
        ACC["bc_launch"] += time.perf_counter() - t
        ACC["bc_buckets"] += 1
        ACC["bc_bytes"] += tensor.numel() * tensor.element_size()
        return _TimedWork(work) if work is not None else None


def _bytes_timed(name: str, fn, flat_of):
    """`fn` timed into ACC[name], and the bytes of its flat bucket into ACC[name + "_bytes"]."""
    @functools.wraps(fn)
    def run(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        ACC[name] += time.perf_counter() - t
        flat = flat_of(out, a)
        ACC[name + "_bytes"] += flat.numel() * flat.element_size()
        return out
    return staticmethod(run)


def _enter(name: str, fn):
    """`fn` timed into ACC[name], its entry time on the host's monotonic clock kept too."""
    timed = _timed(name, fn)

    @functools.wraps(fn)
    def run(*a, **kw):
        ACC[name + "_enter_mono"] = time.monotonic()
        return timed(*a, **kw)
    return run


def _patch() -> None:
    """Time the trainer's own calls (wrappers, no copies of its code): ZeroOptimizer.step
    (zs), its inner AdamW step (zs_inner, wrapped per instance in main), broadcast_params
    (bc; its pack, launch, wait and unpack inside)."""
    grad_sync_mod.dist = _TimedDist()
    GradSync.pack_bucket = _bytes_timed("bc_pack", GradSync.pack_bucket, lambda out, a: out)
    GradSync.unpack_bucket = _bytes_timed("bc_unpack", GradSync.unpack_bucket,
                                          lambda out, a: a[1])
    GradSync.broadcast_params = _enter("bc", GradSync.broadcast_params)
    ZeroOptimizer.step = _enter("zs", ZeroOptimizer.step)
    step_mod.allreduce_mean = _timed("o_allreduce_mean", step_mod.allreduce_mean)
    step_mod.state_bytes = _timed("u_state_bytes", step_mod.state_bytes)
    StepStats.expert_counts = _timed("o_expert_counts", StepStats.expert_counts)
    StepStats.imbalance = _timed("o_imbalance", StepStats.imbalance)
    LayerGather.reduce = _timed("o_gather", LayerGather.reduce)
    step_mod.update_state = _timed("u_update", step_mod.update_state)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "probe_zero_step")
    return p


def _alone(fn, n: int, world: int) -> float:
    """Median seconds of `fn` over n rounds, every rank entering each round together."""
    ts = []
    for _ in range(n):
        if world > 1:
            dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv: list[str]) -> None:
    _patch()  # module and class attributes: before the Trainer is built
    args, train_argv, cfg, tr, world, rank, n_iter = probe_trainer(parser(), argv, 30)
    parts = tr.parts
    opt = parts.optim
    opt.step = _timed("u_optim_step", opt.step)
    opt.zero_grad = _timed("u_zero_grad", opt.zero_grad)
    if isinstance(opt, ZeroOptimizer) and opt.inner is not None:
        opt.inner.step = _timed("zs_inner", opt.inner.step)
    for _ in range(3):
        tr.train_step()
    res: dict[str, list[float]] = defaultdict(list)
    enter = []
    for _ in range(n_iter):
        ACC.clear()
        r = tr.train_step()
        for k in ("step_time_s", "fwd_bwd_s", "grad_sync_s", "optim_s"):
            res[k].append(getattr(r, k))
        res["other_s"].append(r.step_time_s - r.fwd_bwd_s - r.grad_sync_s - r.optim_s)
        ACC["u_rest"] = ACC["u_update"] - sum(ACC[k] for k in ("u_optim_step", "u_state_bytes",
                                                               "u_zero_grad"))
        ACC["optim_rest"] = r.optim_s - ACC["u_optim_step"]  # = u_rest + state_bytes + ...
        if "zs" in ACC:  # ZeroOptimizer.step = inner AdamW + broadcast + the rest
            ACC["zs_broadcast"] = ACC["bc"]
            ACC["zs_rest"] = ACC["zs"] - ACC["zs_inner"] - ACC["bc"]
            ACC["bc_rest"] = ACC["bc"] - sum(ACC[k] for k in ("bc_pack", "bc_launch", "bc_wait",
                                                               "bc_unpack"))
        for k, v in ACC.items():
            if not k.endswith("_mono"):
                res[k].append(v)
        enter.append((ACC.get("zs_enter_mono", 0.0), ACC.get("bc_enter_mono", 0.0)))
    # arrival skew at ZeroOptimizer.step and at broadcast_params (rank r minus rank 0; the
    # monotonic clock is the host's, shared by the processes)
    if world > 1 and isinstance(opt, ZeroOptimizer):
        all_enter = [enter] * world
        dist.all_gather_object(all_enter, enter)
        for j in range(n_iter):
            res["skew_zs_max_s"].append(max(e[j][0] for e in all_enter)
                                        - min(e[j][0] for e in all_enter))
            res["skew_bc_max_s"].append(max(e[j][1] for e in all_enter)
                                        - min(e[j][1] for e in all_enter))
            res["late_bc_s"].append(enter[j][1] - min(e[j][1] for e in all_enter))
    # each piece alone, every rank entering together
    alone: dict[str, float] = {}
    small = torch.zeros(16, dtype=torch.float64)
    alone["allreduce16"] = _alone(lambda: dist.all_reduce(small), 5 * n_iter, world)
    # what `tuner measure` measures, here in the same minute: the optimizer rate over the
    # tiny preset's 43 tensors, the copy bandwidth and the broadcast fit (rank 0 the root)
    dist.barrier()
    alone["optimizer_bandwidth"] = optimizer_rate(tiny_params_with_grads()[0], 7)
    dist.barrier()
    alone["copy_bandwidth"] = copy_bandwidth(256 * 2**20, 7)
    if world > 1:
        bt = collective_times(rank, None, 0, COLL_SIZES[0], 7)["broadcast"]
        alone["broadcast_fit"] = fit_latency_bandwidth(COLL_SIZES[0], bt)
    for p in parts.model.parameters():  # zero_grad left none: the update skips those
        p.grad = torch.randn_like(p) * 1e-3
    if isinstance(opt, ZeroOptimizer):
        sync = opt.sync
        if opt.inner is not None:
            alone["inner_adamw"] = _alone(opt.inner.step, n_iter, world)
            n_owned = sum(q.numel() for g in opt.inner.param_groups for q in g["params"])
            alone["inner_tensors"] = sum(len(g["params"]) for g in opt.inner.param_groups)
            alone["inner_state_bytes"] = 16.0 * n_owned
        ACC.clear()
        alone["broadcast_params"] = _alone(sync.broadcast_params, n_iter, world)
        for k in ("bc_pack", "bc_launch", "bc_wait", "bc_unpack"):
            alone[k] = ACC.get(k, 0.0) / n_iter
        owned = [b for b in sync.bcast if b.owner == sync.group_rank[b.kind]]
        others = [b for b in sync.bcast if b.owner != sync.group_rank[b.kind]]

        def pack() -> None:
            for b in owned:
                sync.pack_bucket(b)

        bufs = [torch.empty(sum(local(p).numel() for p in b.params)) for b in others]

        @torch.no_grad()
        def unpack() -> None:
            for b, flat in zip(others, bufs, strict=True):
                sync.unpack_bucket(b, flat)

        alone["pack_copy"] = _alone(pack, n_iter, world)
        alone["unpack_copy"] = _alone(unpack, n_iter, world)
        alone["pack_bytes"] = 4.0 * sum(local(p).numel() for b in owned for p in b.params)
        alone["unpack_bytes"] = 4.0 * sum(b.numel() for b in bufs)
        alone["buckets"] = [(b.kind, b.owner, len(b.params),
                             4 * sum(local(p).numel() for p in b.params)) for b in sync.bcast]
    else:
        alone["adamw"] = _alone(opt.step, n_iter, world)  # the instance's: timed above
        alone["adamw_state_bytes"] = 16.0 * sum(q.numel() for q in parts.model.parameters())
    med = {k: round(statistics.median(v), 6) for k, v in res.items()}
    out = {"steps": med, "alone": alone}
    record_ranks(output_dir(args), "probe_zero_step", rank, world, out, {"argv": train_argv, "iters": n_iter})


if __name__ == "__main__":
    main(sys.argv[1:])

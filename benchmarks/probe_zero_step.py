"""Where does a ZeRO step's optimizer time go? (issue 33, item 7: the small ZeRO rows)

Runs under torchrun with train.py's options; every rank builds the real `Trainer`, takes 3
warm-up steps, then N instrumented `Trainer.train_step()`s, then N rounds of each piece alone
(every rank entering it at the same moment: a barrier before each), and prints each rank's
medians. Timed inside the step (instrumented copies of the trainer's code, same calls):

    ZeroOptimizer.step     hyper-parameters into the inner AdamW, the inner AdamW step over
                           the owned parameters, then `GradSync.broadcast_params`, split into
                           pack (the owner's torch.cat per bucket), alloc (the receivers'
                           empty buffer), launch (dist.broadcast(async_op=True) calls), wait
                           (work.wait()) and unpack (the receivers' per-parameter copy_)
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
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_output_args, git_sha, output_dir, print_written  # noqa: E402

import trainer.step as step_mod  # noqa: E402
from trainer import Trainer, parse_args, prepare  # noqa: E402
from trainer.distributed.grad_sync import GradSync  # noqa: E402
from trainer.distributed.precision import grad_of  # noqa: E402
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


@torch.no_grad()
def broadcast_params(self: GradSync) -> None:
    """`GradSync.broadcast_params`, the same calls, each kind of work timed."""
    pending = []
    for b in self.bcast:
        group = self.groups[b.kind]
        if group is None:
            continue
        mine = b.owner == self.group_rank[b.kind]
        single = len(b.params) == 1 and local(b.params[0].data).is_contiguous()
        t = time.perf_counter()
        if single:
            flat = local(b.params[0].data)
        elif mine:
            flat = torch.cat([local(p.data).reshape(-1) for p in b.params])
            ACC["bc_pack"] += time.perf_counter() - t
            ACC["bc_pack_bytes"] += flat.numel() * flat.element_size()
        else:
            flat = torch.empty(sum(local(p).numel() for p in b.params),
                               dtype=b.params[0].dtype, device=b.params[0].device)
            ACC["bc_alloc"] += time.perf_counter() - t
        t = time.perf_counter()
        work = dist.broadcast(flat, dist.get_global_rank(group, b.owner), group=group,
                              async_op=True)
        ACC["bc_launch"] += time.perf_counter() - t
        ACC["bc_buckets"] += 1
        ACC["bc_bytes"] += flat.numel() * flat.element_size()
        pending.append((b, flat, work, mine or single))
    for b, flat, work, done in pending:
        t = time.perf_counter()
        work.wait()
        ACC["bc_wait"] += time.perf_counter() - t
        if done:
            continue
        t = time.perf_counter()
        i = 0
        for p in b.params:
            d = local(p.data)
            n = d.numel()
            d.copy_(flat[i:i + n].view_as(d))
            i += n
        ACC["bc_unpack"] += time.perf_counter() - t
        ACC["bc_unpack_bytes"] += flat.numel() * flat.element_size()


@torch.no_grad()
def zero_step(self: ZeroOptimizer) -> None:
    """`ZeroOptimizer.step`, its parts timed."""
    ACC["zs_enter_mono"] = time.monotonic()
    t0 = t = time.perf_counter()
    if self.inner is not None:
        for og, ig in zip(self.param_groups, self.inner.param_groups, strict=True):
            for k, v in og.items():
                if k != "params":
                    ig[k] = v
        for p, m in self.master.items():
            m.grad = grad_of(p)
        ACC["zs_hparams"] += time.perf_counter() - t
        t = time.perf_counter()
        self.inner.step()
        ACC["zs_inner"] += time.perf_counter() - t
        t = time.perf_counter()
        for p, m in self.master.items():
            p.copy_(m)
            m.grad = None
        ACC["zs_masters"] += time.perf_counter() - t
    ACC["bc_enter_mono"] = time.monotonic()
    t = time.perf_counter()
    self.sync.broadcast_params()
    t1 = time.perf_counter()
    ACC["zs_broadcast"] += t1 - t
    ACC["zs_rest"] += (t1 - t0) - sum(ACC[k] for k in ("zs_hparams", "zs_inner", "zs_masters",
                                                        "zs_broadcast"))


def _patch() -> None:
    GradSync.broadcast_params = broadcast_params
    ZeroOptimizer.step = zero_step
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
    n_iter = int(os.environ.get("PROBE_ITERS", "30"))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    args, train_argv = parser().parse_known_args(argv)
    cfg = parse_args(train_argv)
    prep = prepare(cfg, world, rank)
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo")
    _patch()
    tr = Trainer(prep)
    parts = tr.parts
    opt = parts.optim
    opt.step = _timed("u_optim_step", opt.step)
    opt.zero_grad = _timed("u_zero_grad", opt.zero_grad)
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
        for k in ("bc_pack", "bc_alloc", "bc_launch", "bc_wait", "bc_unpack"):
            alone[k] = ACC.get(k, 0.0) / n_iter
        owned = [b for b in sync.bcast if b.owner == sync.group_rank[b.kind]]
        others = [b for b in sync.bcast if b.owner != sync.group_rank[b.kind]]

        def pack() -> None:
            for b in owned:
                torch.cat([local(p.data).reshape(-1) for p in b.params])

        bufs = [torch.empty(sum(local(p).numel() for p in b.params)) for b in others]

        @torch.no_grad()
        def unpack() -> None:
            for b, flat in zip(others, bufs, strict=True):
                i = 0
                for p in b.params:
                    d = local(p.data)
                    d.copy_(flat[i:i + d.numel()].view_as(d))
                    i += d.numel()

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
    every = [out] * world
    if world > 1:
        dist.all_gather_object(every, out)
        dist.destroy_process_group()
    if rank == 0:
        for i, m in enumerate(every):
            print(f"rank {i} {json.dumps(m)}", flush=True)
        path = output_dir(args) / "probe_zero_step.jsonl"
        with path.open("a") as f:
            f.write(json.dumps({"commit": git_sha(), "world": world, "argv": train_argv,
                                "iters": n_iter, "ranks": every}) + "\n")
        print_written(path)


if __name__ == "__main__":
    main(sys.argv[1:])

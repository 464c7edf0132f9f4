"""`python -m tuner measure`: micro-benchmark this machine into `configs/platforms/local.toml`.

On a CPU machine a "device" is one training process: `n_procs` of them share the cores, each
with max(1, cores // n_procs) intra-op threads and each pinned to its own cores where they
fill them (what train.py gives each rank: `comm.tools.affinity`). The compute
micro-benchmarks run in all `n_procs` processes at once, and the platform takes the median
rank's rate: with 4 processes on 2 cores each process gets about half a core, which a
benchmark run in one process alone would not see (it measured ~2x too fast). Measured, each
as the median of repeats after a warm-up:
    GEMM          fp32 matmul over shapes -> peak = best shape; gemm_efficiency = median /
                  best; [2048, w] x [w, w] for w = 64..1024 -> gemm_width_efficiency; a grid
                  m x n x k (GEMM_GRID, 27 shapes; 8 with `quick`) -> [gemm_table]
    grouped GEMM  model.GroupedExperts forward + backward (SwiGLU: 3 grouped GEMMs through
                  piper_kernels.grouped_gemm, the torch path the trainer runs on CPU): uneven token
                  counts -> grouped_gemm_efficiency; every expert given exactly r rows, r over
                  GROUPED_ROWS -> [grouped_table] (at D = 128, F = 256)
    attention     scaled_dot_product_attention causal forward + backward -> its efficiency
                  (against the full s x s count, as before tables); over seq x head_dim
                  (ATTN_SEQ x ATTN_HEAD_DIM) -> [attention_table] against the causal count
    layer overhead  forward + backward of one MoE decoder layer at 4 tokens (no math to speak
                  of): the fixed per-layer cost of an eager framework -> layer_overhead
    memory        large tensor copy (read + write bytes / s) -> hbm_bandwidth
    all-to-all    torch.distributed all_to_all_single over message sizes on `n_procs` gloo
                  processes -> bandwidth and per-message latency by a least-squares fit
                  t = latency + bytes / bandwidth
    P2P           send/recv ping-pong between ranks 0 and 1, fitted the same way
    collectives   all_reduce, reduce (to rank 0 of the group) and broadcast (from it) over
                  COLL_SIZES (the trainer's gradient buckets and ZeRO's per-owner buckets
                  span 0.1-25 MB) on all `n_procs` processes, and with n_procs >= 4 also on
                  concurrent disjoint pairs (a DP group of 2 beside another), each fitted
                  t = latency + bytes / bandwidth -> [collectives] (the model prices these
                  collectives with them instead of ring formulas over the all-to-all rate)
    split backward  one tiny-preset decoder layer at 4 x 256 tokens, forward + zero-bubble
                  split backward (pipeline/split_backward.py: B, then W) against forward +
                  plain backward -> split_backward_extra (the fraction it adds), and B's
                  share of B + W -> split_backward_input_share
    gradient passes  the trainer's work on the gradients after the backward besides the
                  collectives (trainer/distributed/grad_sync.py), over the tiny preset's
                  gradients in all processes at once: flatten (cat, scale, copy back) and the
                  fp64 squared norm -> grad_flatten_bandwidth, grad_norm_bandwidth (fp32
                  gradient bytes per second)
    ZeRO copies   per-parameter ZeRO's pack and unpack around its weight broadcast
                  (trainer/distributed/grad_sync.py `broadcast_params`) over the tiny
                  preset's weights, in all processes at once: torch.cat of the weights into
                  one buffer, then one copy_ per parameter back out of it ->
                  zero_copy_bandwidth (weight bytes per second of one pass)
    loss          `model.cross_entropy` forward + backward over fp32 logits [1024, 2048]
                  (the trainer's loss), in all processes at once -> loss_bandwidth (logit
                  bytes per second)
    small all-reduce  all_reduce of 16 fp64 values over all `n_procs` processes (the step's
                  loss, norm and metrics all-reduces) -> sync_latency (the slowest rank's
                  mean over SYNC_CALLS single calls: their tail is part of a step's price)
                  and collective_tail (that mean minus the slowest rank's median); the
                  same over concurrent pairs (4+ processes) -> pair_sync_latency
    elementwise   the tiny preset's first decoder layer (MoE, experts local) forward + backward
                  at BLOCK_TOKENS tokens in all processes at once, minus what this platform's
                  GEMM, attention and overhead entries price for it (`tuner.estimate.
                  layer_device_time`): the rest, fitted as CPU_TRAFFIC_PASSES passes over the
                  layer's saved activations (least squares through the origin) ->
                  elementwise_bandwidth (the unfused elementwise kernels; 0 if the rest is
                  not positive)
    shared pipeline  where the processes share the cores (more processes x threads than
                  cores, an even count): a real 1F1B pipeline of 2 stages (PipelineRuntime,
                  gloo P2P), half the processes per stage, against the shared-core replay
                  (`tuner.sharing`) of the same schedule with its forward and backward timed
                  with every process computing -> shared_pipeline_factor: 1 + (measured -
                  replayed) / the replay's contended seconds (more processes computing than
                  cores); the estimate scales its replayed pipeline's contended part by it.
                  On this project's 2-core VM a pipeline of 4 processes ran 1.02-1.22x its
                  replay with the P2P hand-overs priced as the estimate prices them,
                  1.12-1.27x without them (2026-12-06): its processes took 2-8 % more CPU
                  time for the same actions than in lock-step, and the cores idled 2-6 % of
                  the step; the replay credits neither. The probe's replay is contended
                  for ~69 % of its span; the written factors were 1.18-1.27 (six probes,
                  2026-12-07)
    rank skew     one tiny-preset decoder layer's forward + backward at RANK_SKEW_TOKENS
                  tokens, the same input on every process, after a barrier, RANK_SKEW_ROUNDS
                  rounds: the slowest process's time over the mean, median over rounds ->
                  rank_skew where each process has cores of its own (the estimate scales the
                  compute of plans whose stages hold several ranks by it), shared_rank_skew
                  where they share the cores (the estimate scales plans with neither a
                  pipeline nor EP by it: the other shared-core terms hold the wait)
    pipeline      where each process has cores of its own (an even count): the same probe,
                  against the plain replay of its schedule (`pipeline.analysis.simulate`)
                  with its measured actions and P2P hand-overs as priced -> pipeline_action_
                  overhead (what each action adds for the replay to take the measured step;
                  the estimate adds it to every action of a pipelined plan)
    optimizer     the trainer's AdamW step (foreach=False, fp32) over the tiny preset's
                  parameters, in all processes at once -> optimizer_bandwidth (state bytes
                  updated per second: 16 per parameter, weights + gradients + 2 moments)
Everything runs on one node, so the network (NIC) entries repeat the intra-node fit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from comm.tools.affinity import rank_cores
from tuner.layout import CPU_TRAFFIC_PASSES
from tuner.platform import Grid, Platform

__all__ = ["compute_fields", "elementwise_bandwidth_fit", "ep_layer_extra", "ep_layer_times", "probe_config",
           "measure_platform", "fit_latency_bandwidth", "sweep_fits", "write_platform_toml",
           "p2p_one_way_s", "emulator_platform", "emulator_payload_share", "parse_emulator_shape",
           "write_emulator_platform", "copy_bandwidth", "tiny_params_with_grads",
           "zero_copy_rate", "loss_rate", "optimizer_rate", "collective_times", "median_platform",
           "shared_pipeline_factor", "pipeline_action_overhead", "fit_action_overhead", "replay_span",
           "rank_skew", "call_times", "SYNC_CALLS",
           "PIPE_PROBE", "pipeline_probe_worker",
           "pipeline_probe_summary", "residual_fields"]


def fit_latency_bandwidth(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = latency + size / bandwidth; returns (latency s, bytes/s).
    The latency is clamped at 0 (a negative intercept is noise)."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"need >= 2 (size, time) pairs of equal length, got {len(sizes)}, {len(times)}")
    mx, my = statistics.fmean(sizes), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise ValueError(f"sizes must differ to fit a bandwidth, got {sizes}")
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True)) / sxx
    if slope <= 0:
        raise ValueError(f"time does not grow with size (slope {slope}); the timings are noise")
    return max(my - slope * mx, 0.0), 1.0 / slope


def _median_time(fn: Callable[[], object], repeats: int, warmup: int = 1,
                 min_s: float = 0.05) -> float:
    """Median seconds of one call of `fn`; each repeat times enough calls to last `min_s`.
    With more processes than cores the OS shares a core in slices of a few ms: a 0.5 ms GEMM
    timed alone often runs inside one slice at full speed, so only timings long against a
    slice see a process's real share (4 processes on 2 cores: 72 GFLOP/s best-shape rate
    with single calls, what one process alone gets)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    one = (time.perf_counter() - t0) / max(warmup, 1)
    n = max(1, int(min_s / max(one, 1e-9)))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def _gemm_rates(shapes: list[tuple[int, int, int]], repeats: int) -> list[float]:
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)

        def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
            return a @ b

        out.append(2 * m * k * n / _median_time(mm, repeats))
    return out


def _grouped_rate(E: int, D: int, F_: int, tokens: int, repeats: int) -> float:
    from model import GroupedExperts

    ex = GroupedExperts(E, D, F_)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.02)
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, E, (tokens,), generator=g), minlength=E)
    x = torch.randn(tokens, D, requires_grad=True)

    def step() -> None:
        ex(x, counts).sum().backward()

    return 3 * 2 * 3 * tokens * D * F_ / _median_time(step, repeats)  # fwd + 2x bwd, 3 GEMMs


def _grouped_rows_rate(E: int, D: int, F_: int, rows: int, repeats: int) -> float:
    """FLOP/s of GroupedExperts fwd + bwd when each of the E experts gets exactly `rows` rows."""
    from model import GroupedExperts

    ex = GroupedExperts(E, D, F_)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.02)
    counts = torch.full((E,), rows, dtype=torch.long)
    x = torch.randn(E * rows, D, requires_grad=True)

    def step() -> None:
        ex(x, counts).sum().backward()

    return 3 * 2 * 3 * E * rows * D * F_ / _median_time(step, repeats)


def _attention_rate(B: int, H: int, S: int, hd: int, repeats: int) -> float:
    q, k, v = (torch.randn(B, H, S, hd, requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    # The model's FLOP convention counts the full s x s products (no causal discount).
    return 3 * 4 * B * H * S * S * hd / _median_time(step, repeats)


def _layer_overhead(repeats: int) -> float:
    """Seconds of one MoE decoder layer's forward + backward at 4 tokens: the tiny preset's
    architecture (GQA, softmax top-2 router, 8 grouped SwiGLU experts) at widths 32, where
    the ~0.1 MFLOP of math is negligible and what remains is per-op dispatch cost."""
    from model.transformer import Block

    cfg = probe_config()
    block = Block(cfg, 0)
    x = torch.randn(1, 4, cfg.d_model, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return _median_time(step, repeats, warmup=3)


def probe_config() -> Any:
    """The tiny preset's architecture (GQA, softmax top-2 router, 8 grouped SwiGLU experts) at
    the per-op-cost probe's widths (32): `_layer_overhead`'s and `ep_layer_extra`'s layer."""
    from model import presets

    return dataclasses.replace(presets.get("tiny"), d_model=32, n_heads=2, n_kv_heads=1,
                               head_dim=16, moe_ffn_dim=32)


def _slowest_time(fn: Callable[[], object], group: dist.ProcessGroup | None = None) -> float:
    """Seconds of one call of `fn` on the slowest rank of `group`: every rank enters it after
    a barrier, and the times are all-reduced with MAX (a collective step ends with its last
    member). Every rank must call it."""
    dist.barrier(group)
    t = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(dt, dist.ReduceOp.MAX, group=group)
    return float(dt)


def ep_layer_times(group: dist.ProcessGroup | None, world: int, rounds: int, cfg: Any = None,
                   tokens: int = 4, warmup: int = 3, overlap: str = "none", chunks: int = 1
                   ) -> tuple[float, float] | None:
    """(local, EP) median seconds of one decoder block's forward + backward (`cfg`: default
    `probe_config()`, `tokens` per rank, each rank its own): the same block twice from one
    seed, one with its MoE layer sharded over the `world` processes through the real
    EPDispatcher (flat; `trainer.distributed.parallel.shard_layer`), one local; alternated
    round by round, each round's time the slowest rank's (an EP layer ends with its last
    member). Every rank makes the same calls (collectives inside). None where the experts
    do not split over `world`. `overlap`, `chunks`: the EP layer's dispatcher runs the layer
    pipeline (`comm.ep.pipeline`: "layer" with `chunks` chunks) instead of one exchange."""
    from comm.ep.dispatcher import EPDispatcher
    from model.transformer import Block
    from trainer.distributed.parallel import shard_layer

    cfg = probe_config() if cfg is None else cfg
    torch.manual_seed(0)
    local = Block(cfg, 0)
    torch.manual_seed(0)
    ep = Block(cfg, 0)
    layer: Any = next(m for m in ep.modules() if hasattr(m, "experts") and hasattr(m, "dispatcher"))
    n_slots: int = layer.n_slots
    if n_slots % world:
        return None
    rank = dist.get_rank(group)
    shard_layer(layer, EPDispatcher(group, world, n_slots, "flat", overlap=overlap,
                                    chunks=chunks), rank)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, tokens, cfg.d_model, requires_grad=True)
    runs = {"local": lambda: local(x).sum().backward(), "ep": lambda: ep(x).sum().backward()}
    times: dict[str, list[float]] = {"local": [], "ep": []}
    for i in range(warmup + rounds):
        for k in (("local", "ep") if i % 2 else ("ep", "local")):
            dt = _slowest_time(runs[k], group)
            if i >= warmup:
                times[k].append(dt)
    return statistics.median(times["local"]), statistics.median(times["ep"])


def zero3_layer_times(world: int, rounds: int, tokens: int = 1024, warmup: int = 2,
                      group: int = 0) -> dict[str, float] | None:
    """Median seconds of the tiny preset's forward + backward (`tokens` tokens per rank in
    sequences of its max_seq_len) and of the trainer's AdamW step (foreach=False) over it:
    the same model twice from one seed, one sharded over all `world` processes by the
    trainer's FSDP2 wrapping (`trainer.distributed.zero3.shard_model`, fp32), one plain;
    alternated round by round, each round's time the slowest rank's. Keys: plain, zero3
    (fwd + bwd), plain_opt, zero3_opt. Every rank makes the same calls (the mesh's groups,
    the gathers). None with one process (nothing to shard over). `group` (dividing `world`;
    0 = all): shard over concurrent groups of that many processes instead (the mesh's stage
    groups: a PP mesh of world / group stages, each holding the whole model here)."""
    if world < 2:
        return None
    from model import MoETransformer, presets
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.parallel import parallelize
    from trainer.distributed.precision import Precision
    from trainer.distributed.zero3 import shard_model

    cfg = presets.get("tiny")
    rank = dist.get_rank()
    g = group or world
    if world % g:
        raise ValueError(f"group={group} must divide world={world}")
    mesh = Mesh.plan(world, rank, pp=world // g, ep=1).build_groups()
    models: dict[str, Any] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    for kind in ("plain", "zero3"):
        with torch.device("meta"):
            m = MoETransformer(cfg)
        parallelize(m, mesh, alltoall="flat")
        m.materialize(torch.device("cpu"), seed=0)
        if kind == "zero3":
            shard_model(m, mesh, Precision(torch.float32, torch.float32, torch.float32), "cpu")
        models[kind] = m
        opts[kind] = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False)
    seq = min(tokens, cfg.max_seq_len)
    tok = torch.randint(0, cfg.vocab_size, (max(1, tokens // seq), seq),
                        generator=torch.Generator().manual_seed(1 + rank))
    times: dict[str, list[float]] = {k: [] for k in ("plain", "zero3", "plain_opt", "zero3_opt")}

    for i in range(warmup + rounds):
        for k in (("plain", "zero3") if i % 2 else ("zero3", "plain")):
            model = models[k]

            def fwd_bwd(model: Any = model) -> None:
                model(tok).sum().backward()

            fb = _slowest_time(fwd_bwd)
            opt = _slowest_time(opts[k].step)
            opts[k].zero_grad()
            if i >= warmup:
                times[k].append(fb)
                times[f"{k}_opt"].append(opt)
    return {k: statistics.median(v) for k, v in times.items()}


def zero3_layer_overhead(extra_s: float, world: int, pf: Platform) -> float:
    """Seconds per decoder layer and micro-batch that ZeRO-3 adds on `pf` beyond what the
    model prices of its collectives: `extra_s` (what `zero3_layer_times` measured sharded
    minus plain, over the tiny preset's whole model) / its layers, minus `tuner.costs.
    zero3_time` of its first layer (the weights the estimate gathers for it, fp32, over the
    `world` processes: on a CPU platform two all-gathers and a reduce-scatter, none hidden);
    clamped at 0. The rest is FSDP2's per-group work in Python (copy-in / copy-out of the
    flat buffers, the DTensor views) and the embedding / head group, spread over the layers."""
    from model import presets
    from tuner.costs import place_groups, zero3_time
    from tuner.counts import layer_counts
    from tuner.estimate import _layer_weights
    from tuner.layout import FP32_TRAINER_PRECISION, ParallelPlan

    cfg = presets.get("tiny")
    plan = ParallelPlan(pp=1, ep=1, dp=world, microbatches=1, global_batch=world,
                        seq_len=cfg.max_seq_len, zero=3)
    groups = place_groups(plan, pf.gpus_per_node, "replicated")[0]
    w = _layer_weights(layer_counts(cfg, 0, 1, cfg.max_seq_len, True), plan, cfg)
    priced = zero3_time({}, 0.0, plan, pf, FP32_TRAINER_PRECISION, groups, w)
    return max(0.0, extra_s / cfg.n_layers - priced)


def ep_layer_extra(group: dist.ProcessGroup | None, world: int, repeats: int) -> float:
    """Seconds the EP path adds to `_layer_overhead`'s probe layer (forward + backward), from
    `ep_layer_times` over 3 x `repeats` rounds; 0 where the probe's experts do not split over
    these processes (not measured)."""
    got = ep_layer_times(group, world, 3 * repeats)
    return 0.0 if got is None else got[1] - got[0]


def _speed_worker(rank: int, world: int, group: dist.ProcessGroup | None, threads: int,
                  rounds: int) -> list[float]:
    """`speed_probe`'s work on one of `world` processes: the tiny preset's first decoder
    block (its MoE layer local) forward + backward at 512 tokens, then an AdamW step on its
    parameters; each round's time the slowest process's."""
    from model import presets
    from model.transformer import Block

    torch.set_num_threads(threads)
    cfg = presets.get("tiny")
    torch.manual_seed(0)
    block = Block(cfg, 0)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4, foreach=False)
    torch.manual_seed(1 + rank)
    x = torch.randn(1, 512, cfg.d_model)
    out = []
    for i in range(2 + rounds):
        dist.barrier(group)
        t = time.perf_counter()
        block(x).sum().backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(dt, dist.ReduceOp.MAX, group=group)
        if i >= 2:
            out.append(float(dt))
    return out


def speed_probe(n_procs: int, rounds: int = 15) -> float:
    """Median seconds of one fixed unit of training work (`_speed_worker`: a tiny-preset
    block's forward + backward + AdamW step, all `n_procs` processes at once, the slowest
    counting): how fast this machine runs now. Timed beside `measure_platform` and again
    beside a later run, the ratio of the two says how much the machine's speed moved in
    between (a shared VM's does: benchmarks/bench_tuner_validate.py). ~2-4 s."""
    from comm import run_local

    if n_procs < 1:
        raise ValueError(f"n_procs={n_procs} must be >= 1")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    threads = max(1, (os.cpu_count() or 1) // n_procs)
    return statistics.median(run_local(_speed_worker, n_procs, threads, rounds,
                                       threads=threads, cpu_affinity="auto")[0])


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats)


WIDTHS = (64, 128, 256, 512, 1024)  # inner GEMM widths of the efficiency-by-width table
# Grids of the per-shape tables: (full, quick). m spans the token rows of a micro-batch,
# n and k the projection widths of the CPU presets (D = 128, F = 256, heads x hd).
GEMM_GRID = {"m": ((128, 512, 2048), (128, 1024)), "n": ((64, 256, 1024), (64, 512)),
             "k": ((64, 256, 1024), (64, 512))}
GROUPED_ROWS = ((2, 8, 32, 128, 512), (8, 128))
# tokens of the elementwise probe's layer (sequences of 256, the tiny preset's): the validation
# rows' micro-batches hold 512-2048 tokens per rank (benchmarks/bench_tuner_validate.py)
BLOCK_TOKENS = ((512, 1024, 2048), (256, 512))
RANK_SKEW_TOKENS = 512
RANK_SKEW_ROUNDS = (30, 8)  # full, quick
GROUPED_SHAPE = (8, 128, 256)  # experts, D, F of the rows-per-expert table
ATTN_SEQ = ((64, 256, 1024), (128, 512))
ATTN_HEAD_DIM = ((32, 64), (32,))


def _say(rank: int, verbose: bool, msg: str) -> None:
    if verbose and rank == 0:
        print(f"[tuner measure] {msg}", file=sys.stderr, flush=True)


def _compute_worker(rank: int, world: int, group: dist.ProcessGroup | None, threads: int, quick: bool,
                    reps: int, verbose: bool = False) -> dict:
    """Every compute rate, measured in each of the `world` processes at the same time, and
    the rank-skew probe (`rank_skew`: `rank_skew` or `shared_rank_skew` by the cores)."""
    torch.set_num_threads(threads)
    q = 1 if quick else 0
    shapes = [(256, 256, 256), (512, 512, 512)] if quick else \
        [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 512, 2048), (4096, 256, 1024)]
    rates, widths, grid, grouped_rows, attn_grid = [], [], [], [], []
    t0 = time.perf_counter()
    _say(rank, verbose, f"GEMM shapes ({len(shapes)}) and widths ({len(WIDTHS)})")
    for shape in shapes:  # a barrier per shape keeps every process on the same work at once
        dist.barrier(group)
        rates += _gemm_rates([shape], reps)
    for w in WIDTHS:
        dist.barrier(group)
        widths += _gemm_rates([(2048, w, w)], reps)
    ms, ns, ks = (GEMM_GRID[a][q] for a in "mnk")
    _say(rank, verbose, f"GEMM grid {len(ms)} x {len(ns)} x {len(ks)} "
                        f"({time.perf_counter() - t0:.0f} s so far)")
    for m in ms:
        for n in ns:
            for k in ks:
                dist.barrier(group)
                grid += _gemm_rates([(m, k, n)], reps)
    dist.barrier(group)
    _say(rank, verbose, f"grouped GEMM ({time.perf_counter() - t0:.0f} s so far)")
    grouped = _grouped_rate(8, 128, 256, 1024 if quick else 4096, reps)
    for r in GROUPED_ROWS[q]:
        dist.barrier(group)
        grouped_rows.append(_grouped_rows_rate(*GROUPED_SHAPE, r, reps))
    dist.barrier(group)
    _say(rank, verbose, f"attention ({time.perf_counter() - t0:.0f} s so far)")
    attn = _attention_rate(2, 4, 128 if quick else 256, 32, reps)
    for S in ATTN_SEQ[q]:
        for hd in ATTN_HEAD_DIM[q]:
            dist.barrier(group)
            attn_grid.append(_attention_rate(1, 4, S, hd, reps))
    dist.barrier(group)
    _say(rank, verbose, f"memory copy and layer overhead ({time.perf_counter() - t0:.0f} s so far)")
    copy = copy_bandwidth((32 if quick else 256) * 2**20, reps)
    dist.barrier(group)
    overhead = _layer_overhead(reps)
    dist.barrier(group)
    params, grads = tiny_params_with_grads()
    optimizer = optimizer_rate(params, reps)
    dist.barrier(group)
    split_extra, split_share = _split_backward(reps)
    dist.barrier(group)
    grad_flatten, grad_norm = _grad_pass_rates(grads, reps)
    dist.barrier(group)
    zero_copy = zero_copy_rate(params, reps)
    dist.barrier(group)
    loss = loss_rate(reps)
    _say(rank, verbose, f"decoder layer at {BLOCK_TOKENS[q]} tokens ({time.perf_counter() - t0:.0f} s so far)")
    block = _block_times(BLOCK_TOKENS[q], reps, group)
    spread = rank_skew(group, world, RANK_SKEW_ROUNDS[q])
    return {"block": block, "skew": spread, "rates": rates, "grouped": grouped, "attn": attn, "copy": copy, "shapes": len(shapes),
            "overhead": overhead, "widths": widths, "grid": grid, "grouped_rows": grouped_rows,
            "attn_grid": attn_grid, "optimizer": optimizer, "split_extra": split_extra,
            "split_share": split_share,
            "grad_flatten": grad_flatten, "grad_norm": grad_norm, "zero_copy": zero_copy,
            "loss": loss}


def _block_times(tokens: Sequence[int], repeats: int, group: dist.ProcessGroup | None) -> list[float]:
    """Median seconds of the tiny preset's first decoder layer (experts local) forward +
    backward at each of `tokens` tokens, in sequences of the preset's 256."""
    from model import presets
    from model.transformer import Block

    cfg = presets.get("tiny")
    torch.manual_seed(0)
    block = Block(cfg, 0)
    out = []
    for n in tokens:
        x = torch.randn(n // cfg.max_seq_len, cfg.max_seq_len, cfg.d_model, requires_grad=True)

        def step(x: torch.Tensor = x) -> None:
            block(x).sum().backward()

        dist.barrier(group)
        out.append(_median_time(step, repeats, warmup=2))
    return out


def rank_skew(group: dist.ProcessGroup | None, world: int, rounds: int,
              tokens: int = RANK_SKEW_TOKENS, warmup: int = 2) -> float:
    """The slowest process's time over the mean of the `world` processes of `group` on the
    same work between two synchronizations: every process runs the tiny preset's first
    decoder layer (experts local) forward + backward on the same `tokens` tokens after a
    barrier; per round max / mean of the times (all-reduced), the median over `rounds`.
    1.0 with one process. Every rank must call it (collectives inside)."""
    if world < 2:
        return 1.0
    from model import presets
    from model.transformer import Block

    cfg = presets.get("tiny")
    torch.manual_seed(0)
    block = Block(cfg, 0)
    g = torch.Generator().manual_seed(1)  # one input for every process: identical work
    x = torch.randn(max(1, tokens // cfg.max_seq_len), min(tokens, cfg.max_seq_len),
                    cfg.d_model, generator=g).requires_grad_()
    ratios = []
    for i in range(warmup + rounds):
        dist.barrier(group)
        t = time.perf_counter()
        block(x).sum().backward()
        dt = time.perf_counter() - t
        mx, tot = torch.tensor([dt], dtype=torch.float64), torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(mx, dist.ReduceOp.MAX, group=group)
        dist.all_reduce(tot, group=group)
        if i >= warmup:
            ratios.append(float(mx) / (float(tot) / world))
    return statistics.median(ratios)


def elementwise_bandwidth_fit(act_bytes: Sequence[float], measured_s: Sequence[float],
                              modelled_s: Sequence[float],
                              passes: float = CPU_TRAFFIC_PASSES) -> float:
    """Bytes per second of the activation traffic term that fits a layer's measured times:
    the rest of each time beyond the modelled GEMM / attention / overhead seconds, against
    `passes` x the layer's saved activation bytes, least squares through the origin. 0 where
    the rest is not positive overall (the model's other terms already cover the layer)."""
    if not len(act_bytes) == len(measured_s) == len(modelled_s) >= 1:
        raise ValueError(f"need equal, non-empty lists; got {len(act_bytes)} byte counts, "
                         f"{len(measured_s)} measured and {len(modelled_s)} modelled times")
    b = [passes * a for a in act_bytes]
    rest = [m - p for m, p in zip(measured_s, modelled_s, strict=True)]
    slope = sum(x * y for x, y in zip(b, rest, strict=True)) / sum(x * x for x in b)
    return 1.0 / slope if slope > 0 else 0.0


def _split_backward(repeats: int, tokens: int = 1024) -> tuple[float, float]:
    """(extra, input share) of the zero-bubble split backward on one decoder layer of the tiny
    preset at `tokens` tokens in sequences of its max_seq_len (the shape of a validation
    run's micro-batch), as its stages run it (B, then W): extra = (forward + B + W) /
    (forward + plain backward) - 1, clamped at 0; input share = B / (B + W). Each call is
    timed phase by phase, the medians taken over at least 5 calls of each form."""
    from model import presets
    from model.transformer import Block
    from pipeline.split_backward import backward_input, backward_weight

    cfg = presets.get("tiny")
    block = Block(cfg, 1)
    params = list(block.parameters())
    seq = min(tokens, cfg.max_seq_len)
    x = torch.randn(max(1, tokens // seq), seq, cfg.d_model, requires_grad=True)

    def plain() -> None:
        block(x).sum().backward()

    t_plain = _median_time(plain, repeats, warmup=2)
    fwd, b_in, w = [], [], []
    for i in range(max(5, repeats) + 2):
        t0 = time.perf_counter()
        out = block(x).sum()
        t1 = time.perf_counter()
        _, work = backward_input([out], [None], x, params)
        t2 = time.perf_counter()
        backward_weight(work, params)
        t3 = time.perf_counter()
        if i >= 2:  # the first two warm up
            fwd.append(t1 - t0)
            b_in.append(t2 - t1)
            w.append(t3 - t2)
    med = statistics.median
    t_split = med(fwd) + med(b_in) + med(w)
    return max(0.0, t_split / t_plain - 1.0), med(b_in) / (med(b_in) + med(w))


def tiny_params_with_grads() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """The tiny preset's 43 fp32 parameters (3.4 M), each with a random gradient (also
    returned): what the optimizer and gradient-pass rates are measured on."""
    from model import MoETransformer, presets

    params = list(MoETransformer(presets.get("tiny")).parameters())
    grads = [torch.randn_like(q) for q in params]
    for q, g in zip(params, grads, strict=True):
        q.grad = g
    return params, grads


def _grad_pass_rates(grads: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """fp32 gradient bytes per second of the trainer's two gradient passes after the backward
    (trainer/distributed/grad_sync.py) over `grads`: (flatten: cat into one buffer, scale in
    place, copy each tensor back out, as `GradSync._allreduce` does around its all-reduce;
    norm: each tensor's fp64 squared sum, as `GradSync.clip`)."""
    nbytes = 4 * sum(g.numel() for g in grads)

    def flatten() -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.mul_(0.5)
        i = 0
        for g in grads:
            flat[i:i + g.numel()].clone()
            i += g.numel()

    def norm() -> None:
        sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))

    return (nbytes / _median_time(flatten, repeats, warmup=2),
            nbytes / _median_time(norm, repeats, warmup=2))


def loss_rate(repeats: int, tokens: int = 1024, vocab: int = 2048) -> float:
    """fp32 logit bytes per second of the trainer's loss, `model.cross_entropy`, forward +
    backward over [tokens, vocab] logits (log-softmax over the vocab and its gradient: the
    loss's elementwise work, beside the head GEMM that `tuner.costs.head_fwd` prices)."""
    from model.transformer import cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)

    def step() -> None:
        logits.grad = None
        cross_entropy(logits, targets).backward()

    return tokens * vocab * 4 / _median_time(step, repeats, warmup=2)


def zero_copy_rate(params: Sequence[torch.Tensor], repeats: int) -> float:
    """Weight bytes per second of one pass of per-parameter ZeRO's copies around its weight
    broadcast (trainer/distributed/grad_sync.py `broadcast_params`) over `params` (the tiny
    preset's 43 fp32 weights): the owner's pack (torch.cat of a bucket's parameters into a
    new buffer) and a receiver's unpack (one copy_ per parameter out of the received
    buffer). Each rank makes one of the two passes over every byte of a bucket, so the
    rate is 2 x bytes / (pack + unpack)."""
    weights = [q.detach() for q in params]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    received = torch.cat([w.reshape(-1) for w in weights])

    def pack_unpack() -> None:
        torch.cat([w.reshape(-1) for w in weights])
        i = 0
        for w in weights:
            w.copy_(received[i:i + w.numel()].view_as(w))
            i += w.numel()

    return 2 * nbytes / _median_time(pack_unpack, repeats, warmup=2)


def optimizer_rate(params: list[torch.nn.Parameter], repeats: int) -> float:
    """State bytes per second of the trainer's optimizer step (trainer/distributed/zero.py's
    torch.optim.AdamW(foreach=False) on fp32 parameters, here the tiny preset's 43 tensors,
    3.4 M parameters): 16 bytes per parameter (weight, gradient, two moments) / step time. The
    per-tensor Python cost is the tiny model's share of it (an assumption for other shapes).
    `params`: `tiny_params_with_grads()`; the step changes the weights, not the gradients."""
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    n = sum(q.numel() for q in params)
    return 16 * n / _median_time(opt.step, repeats, warmup=2)


def p2p_one_way_s(rank: int, buf: torch.Tensor, repeats: int) -> float:
    """Median seconds of one transfer of `buf` between ranks 0 and 1 of the default group:
    half a send/recv round trip. Other ranks return at once (call a barrier after)."""

    def ping() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    return _median_time(ping, repeats, min_s=0.0) / 2


# The size sweeps (collectives, all-to-all, P2P: `_sweep_worker`) take SWEEP_REPEATS repeats
# and the quick ones span 256x in size: over 16x at the quick measurement's 3 repeats, this
# VM's jitter (a 1 MB reduce measured 0.56-3.6 ms) gave negative fitted slopes.
SWEEP_REPEATS = 7
COLL_SIZES = ((2**16, 2**18, 2**20, 2**22, 2**24), (2**16, 2**20, 2**24))  # (full, quick)


def collective_times(rank: int, group: dist.ProcessGroup | None, root: int, sizes: Sequence[int],
                      repeats: int) -> dict[str, list[float]]:
    """Median seconds of all_reduce, reduce to and broadcast from global rank `root` on
    `group` (every member calls; concurrent groups run at once) per size in bytes."""
    out: dict[str, list[float]] = {"all_reduce": [], "reduce": [], "broadcast": []}
    for nb in sizes:
        x = torch.ones(max(1, nb // 4))
        calls = {"all_reduce": lambda x=x: dist.all_reduce(x, group=group),
                 "reduce": lambda x=x: dist.reduce(x, root, group=group),
                 "broadcast": lambda x=x: dist.broadcast(x, root, group=group)}
        for kind, fn in calls.items():
            dist.barrier()
            out[kind].append(_median_time(fn, repeats, min_s=0.0))
    return out


# Small all-reduces timed one call at a time (every rank makes the same number of calls,
# as a collective needs). Their times have a heavy tail: on 2 processes with a core each
# (this 2-vCPU VM, 2026-12-07) the median call took 0.5-0.8 ms and the mean 1.7-2.1 ms, a
# call now and then waiting 2-5 ms (a blocked process's wake-up late by up to a 4 ms
# scheduler tick); a trainer step makes 1-3 such calls and paid 3-6 ms for them (its
# "other" part, benchmarks/bench_tuner_validate.py), so the price is the mean.
SYNC_CALLS = 60


def call_times(fn: Callable[[], object], calls: int, warmup: int = 1) -> tuple[float, float]:
    """(mean, median) seconds of `calls` single calls of `fn` after `warmup` calls. The
    mean is what a step that makes a few such calls pays for each, tail included
    (`SYNC_CALLS`); the mean minus the median is what a call pays beyond the median-based
    fits of the other collectives (`Platform.collective_tail`)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.fmean(ts), statistics.median(ts)


def _pair_groups(world: int) -> list[dist.ProcessGroup]:
    """Groups of ranks (0, 1), (2, 3), ...: every rank creates all of them, as `new_group`
    requires, and uses its own (`rank // 2`)."""
    return [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]


def _comm_worker(rank: int, world: int, group: dist.ProcessGroup | None, repeats: int) -> dict:
    """Mean seconds of a small all-reduce (the step's syncs), and the EP and ZeRO-3 paths'
    extra over the plain layer (`ep_layer_extra`, `zero3_layer_times`; ZeRO-3 also over
    concurrent pairs)."""
    out: dict[str, Any] = {}
    small = torch.zeros(16, dtype=torch.float64)  # the step's loss / norm / metrics values
    dist.barrier()
    out["sync"], out["sync_median"] = call_times(lambda: dist.all_reduce(small, group=group),
                                                  SYNC_CALLS, warmup=3)
    if world >= 4 and world % 2 == 0:  # the same over concurrent pairs (a step's 2-rank syncs)
        pair = _pair_groups(world)[rank // 2]
        dist.barrier()
        out["pair_sync"] = call_times(lambda: dist.all_reduce(small, group=pair), SYNC_CALLS,
                                      warmup=3)[0]
    out["ep_extra"] = ep_layer_extra(group, world, repeats)
    z3 = zero3_layer_times(world, 3 * repeats)
    out["zero3_extra"] = 0.0 if z3 is None else z3["zero3"] - z3["plain"]
    out["zero3_opt_extra"] = 0.0 if z3 is None else z3["zero3_opt"] - z3["plain_opt"]
    if world >= 4 and world % 2 == 0:  # the same over concurrent pairs (the constant's size)
        z3p = zero3_layer_times(world, 3 * repeats, group=2)
        out["zero3_pair_extra"] = 0.0 if z3p is None else z3p["zero3"] - z3p["plain"]
    return out


def _sweep_worker(rank: int, world: int, group: dist.ProcessGroup | None, sizes: list[int],
                  coll_sizes: Sequence[int]) -> dict:
    """Median seconds (SWEEP_REPEATS repeats) of all_to_all_single and of a 0 <-> 1 ping-pong
    per message size, and of the collectives (`collective_times`) on all ranks and on
    concurrent pairs: the size sweeps `sweep_fits` fits."""
    out: dict[str, Any] = {"a2a": [], "p2p": []}
    out["coll"] = {world: collective_times(rank, group, 0, coll_sizes, SWEEP_REPEATS)}
    if world >= 4 and world % 2 == 0:  # every rank in a pair: same barrier count
        out["coll"][2] = collective_times(rank, _pair_groups(world)[rank // 2], rank - rank % 2,
                                           coll_sizes, SWEEP_REPEATS)
    for nb in sizes:
        n = max(world, nb // 4 // world * world)
        x, y = torch.ones(n), torch.empty(n)
        # min_s=0: every rank must make the same number of calls (each is a collective).

        def a2a(x: torch.Tensor = x, y: torch.Tensor = y) -> object:
            return dist.all_to_all_single(y, x, group=group)

        out["a2a"].append(_median_time(a2a, SWEEP_REPEATS, min_s=0.0))
        out["p2p"].append(p2p_one_way_s(rank, torch.ones(max(1, nb // 4)), SWEEP_REPEATS))
        dist.barrier()
    return out


PIPE_PROBE = {"microbatches": 4, "tokens": 512, "blocks": 2}  # per stage: tiny blocks
# the least shared_pipeline_factor written (the platform wants > 0): reached only by a probe
# whose pipeline beat its replay by nearly the whole contended part (measured on this
# project's VM: 1.18-1.27, the five probes of the 2a5cdec validation record and
# configs/platforms/local.toml, 2026-12-07)
SHARED_FACTOR_FLOOR = 0.05


def pipeline_probe_worker(rank: int, world: int, group: dist.ProcessGroup | None,
                          rounds: int) -> dict[str, list[float]]:
    """`shared_pipeline_factor`'s probe on one of `world` processes: a real 1F1B pipeline of
    2 stages (`pipeline.PipelineRuntime`, gloo P2P), `world` / 2 processes per stage (ranks
    below world / 2 run stage 0, rank r pairs with r + world / 2), each stage
    PIPE_PROBE["blocks"] tiny-preset decoder blocks (MoE local) over PIPE_PROBE
    ["microbatches"] micro-batches of PIPE_PROBE["tokens"] tokens. Each round first times the
    stage's forward and backward of one micro-batch with every process computing at once (the
    rate the platform's other entries are measured at), then one pipelined step. Returns this
    rank's per-round times: "F", "B" and "step" (this rank's own pipelined step, as the
    trainer times a step on each rank)."""
    import pipeline
    from model import presets
    from model.transformer import Block

    cfg = presets.get("tiny")
    half = world // 2
    stage = int(rank >= half)
    pairs = [dist.new_group([i, i + half]) for i in range(half)]  # every rank: same order
    torch.manual_seed(stage)
    mod = torch.nn.Sequential(*[Block(cfg, i) for i in range(PIPE_PROBE["blocks"])])
    m, T = PIPE_PROBE["microbatches"], PIPE_PROBE["tokens"]
    shape = (max(1, T // cfg.max_seq_len), min(T, cfg.max_seq_len), cfg.d_model)
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(shape, generator=gen) for _ in range(m)]
    ys = [torch.randn(shape, generator=gen) for _ in range(m)]

    def loss_fn(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y, t)

    rt = pipeline.PipelineRuntime(pipeline.build("1f1b", 2, m), {stage: mod}, loss_fn,
                                  act_shape=shape, group=pairs[rank % half])
    out: dict[str, list[float]] = {"F": [], "B": [], "step": []}
    for i in range(2 + rounds):  # the first two warm up
        dist.barrier(group)
        x = xs[0].clone().requires_grad_(stage > 0)
        t0 = time.perf_counter()
        y = mod(x)
        loss = loss_fn(y, ys[0]) if stage else (y * ys[0]).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        del x, y, loss
        mod.zero_grad(set_to_none=True)
        dist.barrier(group)
        t3 = time.perf_counter()
        rt.step(None if stage else xs, ys if stage else None)
        step = time.perf_counter() - t3
        mod.zero_grad(set_to_none=True)
        if i >= 2:
            out["F"].append(t1 - t0)
            out["B"].append(t2 - t1)
            out["step"].append(step)
    return out


def pipeline_probe_summary(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """`pipeline_probe_worker`'s results of every rank -> {"procs": processes, "F0", "B0",
    "F1", "B1": each stage's forward and backward at the all-computing rate (medians over the
    stage's processes and the rounds), "step": the pipelined step as the trainer reports it,
    its first stage's (1F1B ends with that stage's last backward; the trainer's step times
    are rank 0's): the median over the first stage's processes and the rounds}.

    The first stage's own time, not the slowest process's: the stage's processes run
    independent pipelines here (each pairs with one process of the other stage), and the
    slowest of them read 1-4 % above the first stage's median in three probes on this
    project's VM (2026-12-06, docs/planner.md "Shared cores")."""
    world = len(per_rank)
    if world < 2 or world % 2:
        raise ValueError(f"pipeline probe results of {world} ranks; need an even count >= 2")
    half = world // 2
    med = statistics.median
    out = {f"{k}{s}": med(v for r in per_rank[s * half:(s + 1) * half] for v in r[k])
           for s in (0, 1) for k in ("F", "B")}
    return {"procs": float(world), **out,
            "step": med(v for r in per_rank[:half] for v in r["step"])}


def _probe_costs(summary: dict[str, float], pf: Platform
                 ) -> tuple[dict[tuple[int, str], float], float]:
    """The pipeline probe's measured actions by (stage, kind) and one P2P hand-over of its
    micro-batch as the estimate prices it on `pf` (`tuner.comms.p2p_time`)."""
    from model import presets
    from tuner.comms import p2p_time
    from tuner.layout import FP32_TRAINER_PRECISION

    cost = {(s, k): summary[f"{k}{s}"] for s in (0, 1) for k in ("F", "B")}
    hop = p2p_time(PIPE_PROBE["tokens"] * presets.get("tiny").d_model
                   * FP32_TRAINER_PRECISION.p2p_bytes, False, pf)
    return cost, hop


def shared_pipeline_factor(summary: dict[str, float], pf: Platform) -> float:
    """What a real pipeline takes over the shared-core replay of it, per second of the
    replay's contended part: 1 + (measured step - replay) / the replay's contended seconds
    (`pipeline_probe_summary` of the probe on `pf`'s processes, `pf` the platform being
    written). The replay (`tuner.sharing.shared_replay`) runs the probe's 1F1B schedule with
    each stage's forward and backward at their all-computing medians and each action's two
    P2P hand-overs priced as the estimate prices them (`tuner.comms.p2p_time`, waiting that
    takes no core); its contended part is where more processes compute than the cores hold.
    The excess is put there: the processes' extra CPU time for the same actions comes from
    sharing the cores (docs/planner.md, "Shared cores"), and a pipeline whose stages never
    compute at once (one micro-batch) ran as replayed (`tuner.estimate.shared_span`)."""
    import pipeline
    from tuner.sharing import shared_replay

    half = int(summary["procs"]) // 2
    cost, hop = _probe_costs(summary, pf)
    # one cpu_share for the replay: the busier stage's (the estimate passes the busiest's)
    busiest = max((0, 1), key=lambda s: cost[(s, "F")] + cost[(s, "B")])
    cpu = ((cost[(busiest, "F")] + cost[(busiest, "B")])
           / (cost[(busiest, "F")] + cost[(busiest, "B")] + 4 * hop))
    replay = shared_replay(
        pipeline.build("1f1b", 2, PIPE_PROBE["microbatches"]),
        lambda a: cost[(a.stage, a.kind)] + 2 * hop, {0: half, 1: half},
        pf.cores_per_node, pf.threads_per_process, cpu)
    if replay.contended <= 0.0:  # every stage alone on the cores: nothing to put it on
        return 1.0
    # floored where the pipeline beat the replay by more than its contended part holds
    return max(SHARED_FACTOR_FLOOR, 1.0 + (summary["step"] - replay.span) / replay.contended)


def _toml_value(v: object, digits: int = 6) -> str:
    """A number or (nested) list of numbers as TOML; floats to `digits` significant digits."""
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x, digits) for x in v) + "]"
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        val = f"{v:.{digits}g}"
        return val + ".0" if "." not in val and "e" not in val and "n" not in val else val
    raise ValueError(f"cannot write {v!r} as a platform value")


def write_platform_toml(p: Platform, path: Path, comments: dict[str, str]) -> Path:
    """Write `p` in the platform-file layout, a comment after each measured value (keys of
    `comments`: a value's key, or a table section's name for a comment above it)."""
    lines = ["# Measured on this machine by `python -m tuner measure`; rerun to refresh.",
             "# Units: TFLOPS, GB (1e9 bytes), GB/s per direction, microseconds.", ""]
    d = p.to_dict()
    for key in ("name", "description", "device", "backend", "launcher"):
        lines.append(f'{key} = "{d[key]}"')
    for section in ("compute", "memory", "node", "network"):
        lines.append(f"\n[{section}]")
        for key, v in d[section].items():
            note = comments.get(key, "")
            if isinstance(v, list):  # [[width, efficiency], ...]
                val = "[" + ", ".join(f"[{w}, {e:.4g}]" for w, e in v) + "]"
            else:
                val = _toml_value(v)
            lines.append(f"{key} = {val}" + (f"  # {note}" if note else ""))
    if "collectives" in d:
        lines.append("")
        if comments.get("collectives"):
            lines.append(f"# {comments['collectives']}")
        lines.append("[collectives]")
        for key, fits in d["collectives"].items():
            lines.append(f"{key} = [" + ", ".join(f"[{n}, {lat:.6g}, {bw:.6g}]"
                                                  for n, lat, bw in fits) + "]")
    for section in ("gemm_table", "grouped_table", "attention_table", "roofline"):
        if section not in d:
            continue
        lines.append("")
        if comments.get(section):
            lines.append(f"# {comments[section]}")
        lines.append(f"[{section}]")
        for key, v in d[section].items():
            lines.append(f"{key} = {_toml_value(v, 4 if key == 'efficiency' else 6)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def compute_fields(per_rank: list[dict], quick: bool) -> dict[str, Any]:
    """The compute fields of the platform (Platform keyword arguments) from every rank's
    `_compute_worker` result: each rate the median over ranks (one lucky process does not set
    it), the peak the best rate of the reference GEMM shapes, every efficiency rate / peak
    clamped at 1."""
    q = 1 if quick else 0

    def med(key: str) -> float:
        return statistics.median(r[key] for r in per_rank)

    def meds(key: str) -> list[float]:
        return [statistics.median(r[key][i] for r in per_rank) for i in range(len(per_rank[0][key]))]

    def eff(rate: float) -> float:
        return min(1.0, rate / peak)

    # The peak stays the best of the reference shapes (as before the tables), so the single
    # efficiencies keep their meaning; a grid shape that beats it clamps at 1.
    rates, grid = meds("rates"), meds("grid")
    peak = max(rates)
    return {
        "peak_flops": peak,
        "gemm_efficiency": eff(statistics.median(rates)),
        "grouped_gemm_efficiency": eff(med("grouped")),
        "attention_efficiency": eff(med("attn")),
        "hbm_bandwidth": med("copy"),
        "layer_overhead": med("overhead"),
        "gemm_width_efficiency": tuple((w, eff(e)) for w, e in zip(WIDTHS, meds("widths"),
                                                                    strict=True)),
        "gemm_table": Grid("gemm_table", ("m", "n", "k"),
                           tuple(tuple(float(v) for v in GEMM_GRID[a][q]) for a in "mnk"),
                           tuple(eff(e) for e in grid)),
        "grouped_table": Grid("grouped_table", ("rows_per_expert",),
                              (tuple(float(r) for r in GROUPED_ROWS[q]),),
                              tuple(eff(e) for e in meds("grouped_rows"))),
        # The attention rates count the full s x s products; the causal kernel does half.
        "attention_table": Grid("attention_table", ("seq", "head_dim"),
                                (tuple(map(float, ATTN_SEQ[q])),
                                 tuple(map(float, ATTN_HEAD_DIM[q]))),
                                tuple(eff(e / 2) for e in meds("attn_grid"))),
    }


def _elementwise_from_blocks(measured: Sequence[float], probe: Platform, quick: bool) -> float:
    """`elementwise_bandwidth` from the layer times at BLOCK_TOKENS (median over ranks)
    against the platform being written (`probe`), priced by `tuner.estimate.
    layer_device_time`."""
    from model import presets
    from tuner.estimate import layer_device_time

    cfg = presets.get("tiny")
    tokens = BLOCK_TOKENS[1 if quick else 0]
    if len(measured) != len(tokens):
        raise ValueError(f"{len(measured)} layer times for {len(tokens)} token counts {tokens}")
    priced = [layer_device_time(cfg, 0, n, cfg.max_seq_len, probe) for n in tokens]
    return elementwise_bandwidth_fit([a for _, a in priced], list(measured),
                                     [t for t, _ in priced])


def replay_span(schedule: Any, cost: Any, d: float = 0.0) -> float:
    """Seconds `schedule` takes replayed with `cost(action)` + d seconds per action
    (`pipeline.analysis.simulate`: an action starts when its rank is free and its inputs
    have ended)."""
    from pipeline.analysis import simulate

    return max(s.end for s in simulate(schedule, lambda a: cost(a) + d))


def fit_action_overhead(schedule: Any, cost: Any, step: float) -> float:
    """The d >= 0 that, added to every action of `schedule` replayed with `cost(action)`
    seconds each (`pipeline.analysis.simulate`: an action starts when its rank is free and
    its inputs have ended), makes the replay take `step` seconds. The replay's span grows with
    d by the number of actions on its critical path, piecewise linearly: solved by bisection.
    0 where the replay takes `step` or longer already (`replay_span`)."""
    if replay_span(schedule, cost) >= step:
        return 0.0
    lo, hi = 0.0, step  # span(step) > step: every action then takes longer than it
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if replay_span(schedule, cost, mid) < step else (lo, mid)
    return (lo + hi) / 2


def pipeline_action_overhead(summary: dict[str, float], pf: Platform) -> float:
    """Seconds each pipeline action takes beyond its measured compute and the estimate's
    price of its P2P hand-overs, on processes with cores of their own (`fit_action_overhead`
    on the probe's 1F1B schedule, each action its stage's measured forward or backward + one
    hand-over as `tuner.comms.p2p_time` prices it: the estimate's two per stage and
    micro-batch; the step `pipeline_probe_summary`'s)."""
    import pipeline

    cost, hop = _probe_costs(summary, pf)
    return fit_action_overhead(pipeline.build("1f1b", 2, PIPE_PROBE["microbatches"]),
                               lambda a: cost[(a.stage, a.kind)] + hop, summary["step"])


def residual_fields(raw: dict[str, Any], p: Platform) -> dict[str, Any]:
    """The platform fields that are measured against the platform's other entries (each is
    what a probe took beyond the model's own price of it on `p`), from `raw`, the probes'
    measured inputs (`measure_platform`'s raw_out): elementwise_bandwidth (the layer times at
    BLOCK_TOKENS), ep_layer_overhead (the EP layer's extra minus 4 all-to-all intercepts),
    zero3_layer_overhead and zero3_optimizer_overhead (ZeRO-3's measured extras), and from
    the pipeline probe's summary shared_pipeline_factor where its processes share the cores
    (1 otherwise) or pipeline_action_overhead where they do not (0 otherwise). Fitting them
    again against a median platform keeps each consistent with the entries it was fitted
    against (a field-wise median of residuals from different measurements is not)."""
    from model import presets

    out = {
        "elementwise_bandwidth": _elementwise_from_blocks(raw["block_s"], p, bool(raw["quick"])),
        # what the EP path adds beyond the model's own price of the probe's four exchanges (a
        # dispatch and a combine, forward and backward; their bytes are negligible at 4 tokens)
        "ep_layer_overhead": max(0.0, raw["ep_extra_s"] - 4 * max(p.intra_node_latency, 0.0)),
        "zero3_layer_overhead": zero3_layer_overhead(raw["zero3_extra_s"], raw["n_procs"], p),
        # raw files from before the pair probe lack it: 0, not measured
        "zero3_pair_overhead": zero3_layer_overhead(raw["zero3_pair_extra_s"], 2, p)
        if raw.get("zero3_pair_extra_s") else 0.0,
        "zero3_optimizer_overhead": max(0.0, raw["zero3_opt_extra_s"]
                                        / presets.get("tiny").n_layers),
        "shared_pipeline_factor": 1.0,
        "pipeline_action_overhead": 0.0,
    }
    summary = raw.get("pipeline")
    if summary:
        if p.shares_cores(int(summary["procs"])):
            out["shared_pipeline_factor"] = shared_pipeline_factor(summary, p)
        else:
            out["pipeline_action_overhead"] = pipeline_action_overhead(summary, p)
    return out


COMM_ATTEMPTS = 3  # measurements of the communication sweeps before giving up on noise


def sweep_fits(per_rank_sweep: list[dict], sizes: Sequence[int], coll_sizes: Sequence[int]
                ) -> tuple[list[tuple[str, int, float, float]], tuple[float, float],
                           tuple[float, float]]:
    """(collectives as (kind, group size, latency, bandwidth), all-to-all (latency,
    bandwidth), P2P (latency, bandwidth)) fitted to `_sweep_worker`'s results; ValueError
    where a sweep's times do not grow with size (`fit_latency_bandwidth`). The collectives
    from the median over ranks of the per-size times (the slowest rank sets a collective's
    end, but one lucky or unlucky rank does not set the fit); all-to-all and P2P from rank
    0's."""
    res = per_rank_sweep[0]
    collectives = []
    for n in sorted(res["coll"]):
        for kind in ("all_reduce", "reduce", "broadcast"):
            ts = [statistics.median(r["coll"][n][kind][i] for r in per_rank_sweep if n in r["coll"])
                  for i in range(len(coll_sizes))]
            lat, bw = fit_latency_bandwidth(coll_sizes, ts)
            collectives.append((kind, n, lat, bw))
    return (collectives, fit_latency_bandwidth(sizes, res["a2a"]),
            fit_latency_bandwidth(sizes, res["p2p"]))


def measure_platform(out: Path, n_procs: int = 2, quick: bool = False,
                     verbose: bool = True, raw_out: Path | None = None) -> Path:
    """Run the micro-benchmarks (a few minutes; well under one with `quick`) and write `out`;
    `verbose` reports progress on stderr. `raw_out`: also write the measured inputs of the
    fields fitted against the platform's other entries (`residual_fields`) as JSON there,
    so that `median_platform` can fit them again against a median of several measurements."""
    from comm import run_local

    if n_procs < 2:
        raise ValueError(f"n_procs={n_procs}: collectives need at least 2 processes")
    cores = os.cpu_count() or 1
    threads = max(1, cores // n_procs)
    # processes with cores of their own (`Platform.shares_cores` of the platform written):
    # the rank-skew probe's value is rank_skew there, shared_rank_skew on shared cores
    dedicated = n_procs * threads <= cores
    reps = 3 if quick else 7
    pinned = rank_cores(0, n_procs, threads, sorted(os.sched_getaffinity(0))) is not None \
        if hasattr(os, "sched_getaffinity") else False
    # every worker placed as train.py places its ranks (pinned where they fill the cores)
    per_rank = run_local(_compute_worker, n_procs, threads, quick, reps, verbose,
                         timeout_s=1200.0, threads=threads, cpu_affinity="auto")

    fields = compute_fields(per_rank, quick)
    # the all-to-all / P2P sweep (the quick one up to 4 MB too, as COLL_SIZES says why)
    sizes = [2**12, 2**16, 2**20, 2**22] if quick else [2**12, 2**14, 2**16, 2**18, 2**20, 2**22]
    coll_sizes = COLL_SIZES[1 if quick else 0]
    per_rank_comm = run_local(_comm_worker, n_procs, reps, threads=threads,
                              cpu_affinity="auto")
    for attempt in range(1, COMM_ATTEMPTS + 1):  # only the sweeps again on noise
        per_rank_sweep = run_local(_sweep_worker, n_procs, sizes, coll_sizes,
                                   threads=threads, cpu_affinity="auto")
        try:
            collectives, (a2a_lat, a2a_bw_total), (p2p_lat, p2p_bw) = sweep_fits(
                per_rank_sweep, sizes, coll_sizes)
            break
        except ValueError as e:  # a sweep whose times do not grow with size: noise
            if attempt == COMM_ATTEMPTS:
                raise ValueError(f"the communication sweeps were noise in {attempt} "
                                 f"attempts ({e}); measure on a quieter machine") from e
            if verbose:
                print(f"[tuner measure] {e}: measuring the communication again (attempt "
                      f"{attempt + 1} of {COMM_ATTEMPTS})", file=sys.stderr, flush=True)
    fields["optimizer_bandwidth"] = statistics.median(r["optimizer"] for r in per_rank)
    fields["split_backward_extra"] = statistics.median(r["split_extra"] for r in per_rank)
    fields["split_backward_input_share"] = statistics.median(r["split_share"] for r in per_rank)
    fields["grad_flatten_bandwidth"] = statistics.median(r["grad_flatten"] for r in per_rank)
    fields["grad_norm_bandwidth"] = statistics.median(r["grad_norm"] for r in per_rank)
    fields["zero_copy_bandwidth"] = statistics.median(r["zero_copy"] for r in per_rank)
    fields["loss_bandwidth"] = statistics.median(r["loss"] for r in per_rank)
    # the processes' spread on identical work (every rank computed the same ratio): on
    # dedicated cores rank_skew, on shared ones shared_rank_skew (the other 1.0)
    spread = max(1.0, per_rank[0]["skew"])
    fields["rank_skew"] = spread if dedicated else 1.0
    fields["shared_rank_skew"] = 1.0 if dedicated else spread
    # the slowest rank's mean: a collective ends when its last member arrives; the tail
    # beyond the slowest rank's median
    fields["sync_latency"] = max(r["sync"] for r in per_rank_comm)
    fields["collective_tail"] = max(
        0.0, fields["sync_latency"] - max(r["sync_median"] for r in per_rank_comm))
    # every pair at once (the slowest rank's mean): the 2-rank syncs of a step on more ranks
    fields["pair_sync_latency"] = max((r.get("pair_sync", 0.0) for r in per_rank_comm),
                                      default=0.0)
    # An all-to-all of B bytes per rank moves B (n-1)/n off each rank: report per-rank
    # injection bandwidth, the quantity the model divides by.
    a2a_bw = a2a_bw_total * (n_procs - 1) / n_procs
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p = Platform(
        name="local", description=f"this machine: {n_procs} processes x {threads} threads, gloo"
                                  + (", each pinned to its cores" if pinned else ""),
        device=f"CPU process ({threads} threads)", backend="gloo", launcher="torchrun",
        hbm_bytes=ram / n_procs, gpus_per_node=n_procs,
        nic_bandwidth=p2p_bw, nics_per_node=n_procs, intra_node_bandwidth=a2a_bw,
        usable_fraction=0.9, intra_node_latency=a2a_lat, network_latency=p2p_lat,
        collectives=tuple(collectives), cores_per_node=cores, threads_per_process=threads,
        **fields,
    )
    raw: dict[str, Any] = {
        "n_procs": n_procs, "quick": quick,
        "block_s": [statistics.median(ts)
                    for ts in zip(*(r["block"] for r in per_rank), strict=True)],
        "ep_extra_s": per_rank_comm[0]["ep_extra"],
        "zero3_extra_s": statistics.median(r["zero3_extra"] for r in per_rank_comm),
        "zero3_opt_extra_s": statistics.median(r["zero3_opt_extra"] for r in per_rank_comm),
        "zero3_pair_extra_s": statistics.median(r.get("zero3_pair_extra", 0.0)
                                                for r in per_rank_comm),
        "pipeline": None,
    }
    piped = n_procs % 2 == 0
    shared = p.shares_cores(n_procs)
    if piped:
        _say(0, verbose, f"pipeline on {'shared' if shared else 'dedicated'} cores: 1F1B, 2 "
                         f"stages x {n_procs // 2} processes (~{3 if quick else 10} s)")
        raw["pipeline"] = pipeline_probe_summary(run_local(
            pipeline_probe_worker, n_procs, 4 if quick else 15, threads=threads,
            timeout_s=600.0, cpu_affinity="auto"))
    p = dataclasses.replace(p, **residual_fields(raw, p))
    if raw_out is not None:
        raw_out.parent.mkdir(parents=True, exist_ok=True)
        raw_out.write_text(json.dumps(raw, indent=1) + "\n")
    n_rates = len(per_rank[0]["rates"])
    notes = {
        "peak_tflops": f"best fp32 GEMM of {n_rates} shapes, {threads} "
                       f"threads, all {n_procs} processes at once",
        "gemm_efficiency": f"median of {n_rates} GEMM shapes / best",
        "grouped_gemm_efficiency": "model.GroupedExperts fwd+bwd, 8 experts, uneven counts",
        "attention_efficiency": "sdpa fwd+bwd, causal, no causal discount in FLOPs",
        "gemm_width_efficiency": "[2048, w] x [w, w] rate / peak, by inner width w",
        "layer_overhead_us": "MoE layer fwd+bwd at 4 tokens, width 32 (per-op dispatch)",
        "ep_layer_overhead_us": f"the same layer's MoE sharded over the {n_procs} processes "
                                f"(EPDispatcher, flat) minus local, minus 4 x the all-to-all "
                                f"intercept",
        "zero3_layer_overhead_us": "ZeRO-3 (the trainer's FSDP2) tiny model fwd+bwd over the "
                                   "processes minus plain, per layer, minus its modelled "
                                   "gathers and reduce-scatter",
        "zero3_pair_overhead_us": "the same over concurrent groups of 2 processes (0: fewer "
                                  "than 4 processes, not measured)",
        "zero3_optimizer_overhead_us": "AdamW step over those DTensor shards minus over the "
                                       "plain model, per layer",
        "shared_pipeline_factor": (f"1F1B pipeline, 2 stages x {n_procs // 2} processes "
                                   f"on these cores (PipelineRuntime, {PIPE_PROBE['blocks']} "
                                   f"tiny blocks per stage, {PIPE_PROBE['microbatches']} x "
                                   f"{PIPE_PROBE['tokens']} tokens): 1 + (measured step - "
                                   f"the shared-core replay of its measured actions) / the "
                                   f"replay's contended seconds"
                                   if piped and shared else "not measured: the processes do "
                                   "not share the cores (or are an odd count); 1 = the replay "
                                   "as is"),
        "rank_skew": (f"the slowest process / the mean on one tiny decoder layer fwd+bwd at "
                      f"{RANK_SKEW_TOKENS} tokens, the same input everywhere, median of "
                      f"{RANK_SKEW_ROUNDS[1 if quick else 0]} rounds"
                      if dedicated else "not measured: the "
                      "processes share the cores (shared_rank_skew); 1 = all equally fast"),
        "shared_rank_skew": (f"the slowest process / the mean on one tiny decoder layer "
                             f"fwd+bwd at {RANK_SKEW_TOKENS} tokens, the same input "
                             f"everywhere, the processes sharing the cores, median of "
                             f"{RANK_SKEW_ROUNDS[1 if quick else 0]} rounds"
                             if not dedicated else "not measured: the processes have cores "
                             "of their own (rank_skew); 1 = all equally fast"),
        "pipeline_action_overhead_us": ("the same pipeline probe on cores of their own: what "
                                        "each action adds for the replay of its measured "
                                        "actions to take the measured step"
                                        if piped and not shared else "not measured: the "
                                        "processes share the cores (shared_pipeline_factor "
                                        "instead) or are an odd count"),
        "hbm_gb": "physical RAM / processes",
        "hbm_bandwidth_gbs": "tensor copy, read + write",
        "split_backward_extra": "zero-bubble split backward's extra time / plain fwd+bwd, "
                                "tiny layer, 4 x 256 tokens",
        "split_backward_input_share": "B / (B + W) of that split backward",
        "optimizer_bandwidth_gbs": "AdamW(foreach=False) step, 16 B/param / s, tiny preset",
        "grad_flatten_bandwidth_gbs": "fp32 grad bytes / s of cat + mul_ + clone, tiny preset",
        "grad_norm_bandwidth_gbs": "fp32 grad bytes / s of the fp64 squared norm, tiny preset",
        "zero_copy_bandwidth_gbs": "fp32 weight bytes / s of one pass of ZeRO's broadcast "
                                   "pack (cat) / unpack (copy_ per parameter), tiny preset",
        "loss_bandwidth_gbs": "fp32 logit bytes / s of model.cross_entropy fwd+bwd, [1024, "
                              "2048] logits",
        "elementwise_bandwidth_gbs": f"{CPU_TRAFFIC_PASSES:g} passes over the saved activations "
                                     f"/ s: tiny layer fwd+bwd at {BLOCK_TOKENS[0]} tokens minus "
                                     f"its GEMM / attention / overhead price (0: not positive)",
        "cores_per_node": "os.cpu_count() of this machine",
        "threads_per_process": f"torch intra-op threads per process (cores // {n_procs}, >= 1)",
        "sync_latency_us": f"all_reduce of 16 fp64 values over the {n_procs} processes, mean of "
                           f"{SYNC_CALLS} single calls",
        "collective_tail_us": "that all_reduce's mean minus its median (slowest ranks): what "
                              "a blocking collective call pays beyond the median-based fits",
        "pair_sync_latency_us": f"the same all_reduce over concurrent pairs of the {n_procs} "
                                f"processes, mean of {SYNC_CALLS} single calls (0: 2 processes, "
                                f"the pair is the whole group)",
        "collectives": f"measured: gloo collectives over groups of n of the {n_procs} "
                       f"processes (concurrent pairs below {n_procs}), t = latency + bytes per "
                       f"rank / bandwidth fitted over {coll_sizes[0] >> 10} KB - "
                       f"{coll_sizes[-1] >> 20} MB; [n, latency_us, bandwidth_gbs]",
        "intra_node_bandwidth_gbs": f"gloo all_to_all_single fit, {n_procs} processes",
        "intra_node_latency_us": "all_to_all_single fit intercept",
        "nic_bandwidth_gbs": "gloo send/recv fit (one node: loopback)",
        "network_latency_us": "send/recv fit intercept",
        "gemm_table": "measured: fp32 [m, k] x [k, n] rate / peak on the grid m x n x k",
        "grouped_table": f"measured: model.GroupedExperts fwd+bwd, {GROUPED_SHAPE[0]} experts "
                         f"x r rows each, D={GROUPED_SHAPE[1]}, F={GROUPED_SHAPE[2]}; rate / peak",
        "attention_table": "measured: sdpa causal fwd+bwd, 1 x 4 heads; causal FLOPs "
                           "(half the s x s products) / time / peak",
    }
    return write_platform_toml(p, out, notes)


def _median_value(vals: list[Any], where: str) -> Any:
    """`median_platform`'s combine: numbers -> their median (ints must agree: they are
    counts, not measurements), lists and tables element by element, strings must agree."""
    first = vals[0]
    if isinstance(first, (bool, str, int)) or first is None:  # names, flags, counts
        if any(v != first for v in vals):
            raise ValueError(f"median_platform: {where} differs between the files: {vals}")
        return first
    if isinstance(first, float):
        return statistics.median(float(v) for v in vals)
    if isinstance(first, dict):
        keys = list(first)
        if any(list(v) != keys for v in vals):
            raise ValueError(f"median_platform: {where} has other keys in another file")
        return {k: _median_value([v[k] for v in vals], f"{where}.{k}" if where else k)
                for k in keys}
    if isinstance(first, (list, tuple)):
        if any(len(v) != len(first) for v in vals):
            raise ValueError(f"median_platform: {where} has another length in another file")
        return [_median_value([v[i] for v in vals], f"{where}[{i}]") for i in range(len(first))]
    raise ValueError(f"median_platform: cannot combine {where} = {vals!r}")


# The efficiencies a measurement writes as its own rate / its own peak (`compute_fields`):
# (section, key) of the platform file's layout.
PEAK_RELATIVE = (("compute", "gemm_efficiency"), ("compute", "grouped_gemm_efficiency"),
                 ("compute", "attention_efficiency"), ("gemm_table", "efficiency"),
                 ("grouped_table", "efficiency"), ("attention_table", "efficiency"))


def _scaled(v: Any, f: float) -> Any:
    """A number, or a nested list of numbers, times f."""
    return [_scaled(x, f) for x in v] if isinstance(v, list) else float(v) * f


def _median_rates(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """`_median_value` of platform dicts, except the efficiencies relative to the peak
    (`PEAK_RELATIVE`, `gemm_width_efficiency`): each file's are its rates / its own peak, the
    best of a few reference shapes, which moves more between measurements than the rates do
    (2026-12-07, c43d3be's five 4-process measurements: peaks 0.051-0.103 TFLOP/s, the mean
    GEMM-table rate 46-51 GFLOP/s). A median of those ratios beside the median peak prices a
    shape at a rate that no measurement had (a grouped-GEMM entry 22 % off the median of its
    rates there). So each efficiency is the median of its measured rates (efficiency x that
    file's peak) / the median peak; at most 1, since each rate is at most its own file's peak
    (`compute_fields` clamps it there) and the median keeps that order. Every peak is > 0
    (`Platform` refuses a file without one)."""
    med = _median_value(dicts, "")
    peaks = [float(d["compute"]["peak_tflops"]) for d in dicts]
    per_peak = 1.0 / float(med["compute"]["peak_tflops"])
    for section, key in PEAK_RELATIVE:
        if key in med.get(section, {}):
            rates = [_scaled(d[section][key], p) for d, p in zip(dicts, peaks, strict=True)]
            med[section][key] = _scaled(_median_value(rates, f"{section}.{key}"), per_peak)
    if med["compute"].get("gemm_width_efficiency"):
        rates = [[[w, e * p] for w, e in d["compute"]["gemm_width_efficiency"]]
                 for d, p in zip(dicts, peaks, strict=True)]
        med["compute"]["gemm_width_efficiency"] = [
            [w, r * per_peak]
            for w, r in _median_value(rates, "compute.gemm_width_efficiency")]
    return med


def _value_comments(path: Path) -> dict[str, str]:
    """The comments of a platform file as `write_platform_toml` writes them: after a value
    (by its key), above a table (by the table's name)."""
    out: dict[str, str] = {}
    above = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]"):
            if above:
                out[s[1:-1]] = above
            above = ""
        elif s.startswith("# "):
            above = s[2:]
        else:
            above = ""
            if "=" in s and "  # " in s:
                key, rest = s.split("=", 1)
                out[key.strip()] = rest.split("  # ", 1)[1]
    return out


def median_platform(paths: Sequence[Path], out: Path, raws: Sequence[Path] = ()) -> Path:
    """One platform file from several measurements of the same machine (`measure_platform`
    run at different moments: this VM's speed drifts by 10-30 % over minutes): every
    measured number is the median of the files' (tables and collective fits element by
    element), counts and names must agree. `raws`: the measurements' raw_out files, one per
    path; then the fields fitted against the platform's other entries (`residual_fields`)
    are fitted again, from the medians of their measured inputs, against the median
    platform. Written to `out` with the first file's comments and a header naming the files."""
    from tuner.platform import load_platform

    if not paths:
        raise ValueError("median_platform: no platform files")
    if raws and len(raws) != len(paths):
        raise ValueError(f"median_platform: {len(raws)} raw files for {len(paths)} platforms; "
                         f"give one per platform or none")
    dicts = [load_platform(p).to_dict() for p in paths]
    p = Platform.from_dict(_median_rates(dicts), source=str(out))
    how = "value by value, each efficiency as the median of its measured rates / the median peak"
    if raws:
        loaded = [json.loads(Path(r).read_text()) for r in raws]
        if any((r.get("pipeline") is None) != (loaded[0].get("pipeline") is None)
               for r in loaded):
            raise ValueError("median_platform: the raw files disagree on the pipeline probe "
                             "(measured in some, not in others)")
        p = dataclasses.replace(p, **residual_fields(_median_value(loaded, "raw"), p))
        how += "; the fitted fields (residual_fields) fitted again against the medians"
    write_platform_toml(p, out, _value_comments(Path(paths[0])))
    text = out.read_text()
    names = ", ".join(Path(q).name for q in paths)
    out.write_text(f"# The median of {len(paths)} measurements ({names}), {how}.\n" + text)
    return out


# ---- the namespace-emulated cluster (`python -m comm.emulate`) -----------------------------
# Per-frame bytes of a TCP segment on the emulated links (comm/tools/emulate.py): tbf counts
# what the veth carries, the Ethernet header (14 B) and the IP packet; the TCP payload of a
# full frame is the MTU less the IPv4 (20 B) and TCP headers (20 B + the 12 B timestamps
# option Linux sends by default). At MTU 1500: 1448 / 1514 = 0.956, the share
# comm/tools/emulate.py states and benchmarks/results/netsim_validate.md measured (duplex
# goodput 0.956 of the shaped rate).
ETH_HEADER_BYTES = 14
IPV4_TCP_HEADER_BYTES = 20 + 20 + 12


def emulator_payload_share(mtu: int = 1500) -> float:
    """Share of a shaped emulated link's rate that is TCP payload with full frames of `mtu`."""
    if not 576 <= mtu <= 65535:
        raise ValueError(f"mtu must be in 576..65535 bytes, got {mtu}")
    return (mtu - IPV4_TCP_HEADER_BYTES) / (mtu + ETH_HEADER_BYTES)


def parse_emulator_shape(spec: str) -> tuple[int, int, float]:
    """"NODESxGPUS@MBIT" (benchmarks/bench_moe_overlap.py's --setups) -> (nodes, gpus, mbit)."""
    try:
        shape, mbit = spec.split("@")
        nodes, gpus = (int(v) for v in shape.lower().split("x"))
        rate = float(mbit)
    except ValueError:
        raise ValueError(f"emulator shape {spec!r}: want NODESxGPUS@MBIT, e.g. 2x2@200") from None
    if nodes < 1 or gpus < 1 or not rate > 0:
        raise ValueError(f"emulator shape {spec!r}: nodes, gpus and Mbit/s must be > 0")
    return nodes, gpus, rate


def emulator_platform(base: Platform, nodes: int, gpus_per_node: int, nic_mbit: float,
                      latency_ms: float | None = None, mtu: int = 1500) -> Platform:
    """The platform of `python -m comm.emulate --nodes N --gpus-per-node G --nic-mbit X
    [--latency-ms L] [--mtu B]`, from `base`, a platform `tuner measure` measured on this
    machine with N x G processes (every emulated node runs on the same cores, so N x G
    processes share them as in the measurement).

    From `base` (measured): compute, memory, the per-process rates, the intra-node
    all-to-all (the ranks of one emulated node talk over unshaped local routes, as the
    measurement's processes do) and the gloo collective fits of groups inside one node.
    From the emulator's parameters (comm/tools/emulate.py, no measurement): one NIC per node
    (the node's veth) shaped by tbf at X Mbit/s per direction on both ends, of which
    `emulator_payload_share(mtu)` is TCP payload -> nic_bandwidth; the per-message latency
    is `base`'s send/recv intercept (gloo over a veth, unshaped) plus the netem delay, which
    `--latency-ms` puts on both ends (node i's egress and the bridge port's egress towards
    node j), so 2 L one way. The small all-reduce (`sync_latency`) then crosses the delay in
    each of its 2 (n - 1) ring steps. Dragonfly groups (--groups) are not described here."""
    if nodes < 1 or gpus_per_node < 1 or not nic_mbit > 0:
        raise ValueError(f"emulator {nodes}x{gpus_per_node}@{nic_mbit}: all must be > 0")
    if latency_ms is not None and latency_ms < 0:
        raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
    n = nodes * gpus_per_node
    if base.gpus_per_node != n:
        raise ValueError(f"base platform {base.name!r} describes {base.gpus_per_node} "
                         f"processes; the {nodes}x{gpus_per_node} emulator runs {n} (measure "
                         f"it with `python -m tuner measure --procs {n}`)")
    delay = 2 * (latency_ms or 0.0) * 1e-3
    shape = f"{nodes}x{gpus_per_node}@{nic_mbit:g}" + (f", {latency_ms:g} ms" if latency_ms else "")
    return dataclasses.replace(
        base, name=f"emulator-{nodes}x{gpus_per_node}-{nic_mbit:g}mbit",
        description=f"comm.emulate {shape} (MTU {mtu}) on {base.name}: {base.description}",
        gpus_per_node=gpus_per_node, nics_per_node=1, host_nodes=nodes,
        nic_bandwidth=nic_mbit * 1e6 / 8 * emulator_payload_share(mtu),
        network_latency=base.network_latency + delay,
        sync_latency=base.sync_latency + 2 * (n - 1) * delay if nodes > 1 else base.sync_latency,
        # a pair may span two emulated nodes: its syncs take the whole group's price there
        pair_sync_latency=base.pair_sync_latency if nodes == 1 else 0.0,
        collectives=tuple(c for c in base.collectives if c[1] <= gpus_per_node))


def write_emulator_platform(base: Platform, out: Path, nodes: int, gpus_per_node: int,
                            nic_mbit: float, latency_ms: float | None = None,
                            mtu: int = 1500) -> Path:
    """`emulator_platform` written as a platform file, the derived values commented."""
    p = emulator_platform(base, nodes, gpus_per_node, nic_mbit, latency_ms, mtu)
    share = emulator_payload_share(mtu)
    notes = {
        "gpus_per_node": "comm.emulate --gpus-per-node",
        "nics_per_node": "one veth per emulated node",
        "nic_bandwidth_gbs": f"tbf {nic_mbit:g} Mbit/s x TCP payload share {share:.4f} "
                             f"(MTU {mtu}: (MTU - 52) / (MTU + 14))",
        "network_latency_us": f"{base.name}'s send/recv intercept + netem 2 x "
                              f"{latency_ms or 0:g} ms",
        "intra_node_bandwidth_gbs": f"{base.name}: gloo all_to_all_single, local routes",
        "intra_node_latency_us": f"{base.name}: all_to_all_single fit intercept",
        "sync_latency_us": f"{base.name}'s + the netem delay in each ring step",
        "collectives": f"{base.name}'s fits of groups inside one emulated node",
    }
    return write_platform_toml(p, out, notes)

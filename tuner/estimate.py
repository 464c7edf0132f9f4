"""The analytic resource model: per-stage memory, step time breakdown and MFU of one layout.

Memory of pipeline rank r (bytes):
    state        sum over its layers and parts of params x (weight + grad + master + optimizer)
                 bytes; routed experts E/EP per rank, everything else replicated over EP;
                 embedding on the first stage, final norm + lm_head on the last.
                 ZeRO (`ParallelPlan.zero`) divides a part's sharded bytes by its replica
                 group (`ParallelPlan.replica_groups`: DP x EP for non-expert parts, DP for
                 experts), sharded evenly element by element (or, with
                 `Assumptions.zero_sharding="per-parameter"`, as whole tensors of the model
                 built on the meta device, greedily: the largest load of a group):
                   ZeRO-1  master + optimizer moments / group
                   ZeRO-2  also gradients / group, when they are held sharded while
                           micro-batches are in flight: M = 1, or a reduce-scatter after every
                           micro-batch (`Assumptions.zero2_grad_sync`)
                   ZeRO-3  weights too, as flat shards (FSDP's), plus the gathered weights
                           of the largest layer held by this rank once computing and
                           `Assumptions.zero3_prefetch` more times arriving, and that layer's
                           whole gradient until its reduce-scatter
                 TP (with sequence parallel) splits the dense-side weights (attention,
                 shared experts, dense FFN, embedding, lm_head) tp ways, ETP the routed
                 experts etp ways; norms and router stay whole.
                 Redundant expert slots (`ParallelPlan.redundant` = r, the trainer's
                 `--balance.redundant`): every EP rank holds r more expert slots per MoE layer
                 (part "redundant_experts": r x one expert's parameters per MoE layer), each
                 with its own weights, gradients and optimizer state, sharded under ZeRO
                 like the other experts (replica group DP).
    activations  peak_inflight(schedule)[r] x the largest per-micro-batch activation of one of
                 its chunks (see `tuner.counts`; with a2a_overlap fb the paired schedule's
                 in-flight count, `fb_inflight`), + what one layer's recompute rebuilds
                 (its activations less those the checkpoint kept) when recomputing,
                 + the last stage's logits (bf16 and fp32 for the loss) for one micro-batch
                 With TP + SP and CP the tokens of a micro-batch are split over the whole
                 stage (b s / (M x stage ranks) per rank), so every activation is per rank
                 what those tokens keep; ETP holds each routed D-wide row etp times.
    buffers      all-to-all send/receive rows (x etp), P2P send/receive, the sequence-parallel
                 all-gather output (TP), the ring attention K/V blocks (CP), one gradient
                 bucket
Under the published assumptions (MHA, no embeddings/norms/router/shared/dense, 16 B/param,
1F1B, attention replicated over EP, scores stored) the state + activations of stage i equal
docs/reference.md 1.1's M(i); tests/test_tuner_estimate.py checks it.

Step time (seconds), for the busiest rank:
    per micro-batch and chunk (for zb-h1 on the stages after the first all of it x (1 + the
    platform's measured split_backward_extra): B then W cost more than one plain backward):
    forward + 2 x forward (backward) [+ recompute] compute at the
    platform's GEMM / grouped-GEMM / attention efficiency, + the platform's fixed per-layer
    overhead (measured on CPU, 0 on GPUs), + `Assumptions.activation_traffic_passes` passes
    over the chunk's activations as saved without recompute, and one more over those a
    recompute writes again, at the platform's `traffic_bandwidth` (measured
    elementwise rate on CPU, else the memory bandwidth; 0 passes by default); 4 all-to-alls per MoE layer (6 with
    full recompute); P2P of the activation and its gradient, and with pp > 1 the pipeline
    runtime's measured work per action (`Platform.pipeline_action_overhead`: x 2 per stage
    and micro-batch, x 3 under zb-h1; 0 unless measured; in the "p2p" part); none overlapped unless the
    `Assumptions` say so; a MoE layer whose device time (compute, exposed all-to-all, its
    TP/CP/ETP/ZeRO-3 collectives) is below `Assumptions.host_floor` takes the floor (the
    difference is the "host" part: a host-bound eager framework, 0 by default)
    pipeline  busy / (1 - bubble_fraction(schedule, F=1, B=2)) (zb-h1: the backward, with
              the extra, split into B and W by the platform's measured input share; 0.5
              where not measured): the unit bubble scaled to the slowest rank; a step of several whole schedule runs
              (`Assumptions.zero3_runs`) pays one fill and drain per run (`run_bubble`).
              Where the platform's processes share the
              node's cores (`Platform.shares_cores`: a measured CPU platform with more
              processes x threads than cores; `Assumptions.shared_cores`), busy x the
              makespan of the same unit-cost schedule replayed with processor sharing
              (`tuner.sharing`: the compute share of each action runs at min(threads,
              cores / k) / min(threads, cores / N) of the measured rate with k of the N
              processes computing; its all-to-all and P2P share waits without a core) over
              the busy time: waiting ranks give their cores to the busy ones
    + DP gradient sync, once per step (ring collectives, `tuner.comms` link rates):
        ZeRO-0    all-reduce of the gradients over each part's replica group
        ZeRO-1/2  reduce-scatter of the gradients (M times for ZeRO-2 with
                  zero2_grad_sync="each"), then all-gather of the updated weights (weight
                  bytes): a ring all-reduce *is* a reduce-scatter plus an all-gather, so with
                  equal gradient and weight bytes the wire time equals ZeRO-0's.
                  "per-parameter" sharding (this trainer): ZeRO-1 all-reduces, ZeRO-2
                  reduces to owners (a reduce-scatter's time); owners broadcast the weights
                  (an all-gather's time), each bucket of several parameters packed by its
                  owner and unpacked by the others: one pass over its weights per rank at
                  the platform's `zero_copy_rate` ("broadcast_copy", `_bcast_copy_params`)
        redundant (r > 0): the gradients of replicated experts summed over their replicas
                  after the DP sync (trainer/distributed/replicas.py): per MoE layer, one all-to-all in
                  the EP group in which each rank sends r x c gradient rows (c =
                  `Assumptions.replicas_per_expert`, each holder sending its partial to the
                  c - 1 others). Its buffers are allocated after the backward, when the
                  activations are freed: not added to the peak
    + optimizer update (memory bound: 2 x the state bytes of the parameters this rank
      updates / HBM, or those bytes / the platform's measured optimizer_bandwidth; with ZeRO
      only its shard). Collectives with a measured fit on the platform ([collectives]: gloo's
      all-reduce, reduce, broadcast by group size) are priced with it (`tuner.comms`)
    + the trainer's gradient passes after the backward (flatten / scale / copy back, the fp64
      norm, the clip's scale: `tuner.costs.grad_post_time`) and the step's small all-reduces
      (the norm's over EP / PP, the loss's, the expert counts', the metrics':
      `tuner.costs.step_sync_groups`), at the platform's measured grad_flatten_bandwidth,
      grad_norm_bandwidth and sync_latency (pair_sync_latency for a 2-rank group in a
      larger job: `Platform.sync_time`) (time keys "grad_post", "step_syncs"; absent where
      the platform has none of them, e.g. every GPU file)
    + the other dimensions, per layer and micro-batch (`layer_collectives`), on the links
      of their groups (`groups`: TP innermost, then CP, as trainer.layout places them):
        TP + SP   per TP region (attention; the dense branch: shared experts or dense FFN)
                  an all-gather and a reduce-scatter of the TP group's rows (t tp D) per pass
                  (forward, backward, recompute), exposed
        CP        ring attention: cp - 1 steps of the rank's K/V (t x K/V width) per forward,
                  twice that in the backward (K/V and their gradients); exposed beyond the
                  attention core of the same pass
        ETP       per MoE pass an all-gather of the routed rows to the etp ranks of each
                  expert and a reduce-scatter of its outputs
        ZeRO-3    per layer an all-gather of its weights in the forward and the backward and
                  a reduce-scatter of its gradients (every micro-batch: gradients stay
                  sharded), prefetched: exposed beyond the layer's compute of that pass; no
                  step-end sync (`Assumptions.zero3_gather="step"`: once per step, the
                  stage held gathered between; `tuner.costs.zero3_time`)
      and the all-to-all by `ParallelPlan.alltoall` (flat, halo, dedup: one copy per
      remote node, auto: the cheapest the trainer's auto picks among; `tuner.comms`) and
      `a2a_overlap` (none; layer: chunked, hidden behind the shared/dense branch and the
      other chunks' expert GEMMs; fb: a forward and a backward micro-batch hide each other's
      exchange in the pipeline's steady state; `a2a_exposed`; auto: the mode and chunks the
      trainer's auto runs, `resolve_overlap`)
    FP8 GEMMs (`precision="fp8"`): projections and FFNs at the FP8 peak (`gemm_peak`);
    the attention core, router and lm_head stay bf16; MFU stays against the bf16 peak; the
    casts to FP8 of each GEMM's input and output gradient at HBM bandwidth
    (`tuner.costs.fp8_cast_time`, `Assumptions.fp8_cast_bytes`).
Bytes on the wire per element come from the precision policy (`PrecisionPolicy`:
grad_comm_bytes, param_comm_bytes, dispatch_bytes, combine_bytes, p2p_bytes).
MFU = model.flops_per_token(s) x tokens per step / (step time x GPUs x peak).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from dataclasses import dataclass, field

from model import ModelConfig
from pipeline import bubble_fraction, build, peak_inflight
from pipeline.schedule import build_fb
from trainer.layout import auto_overlap, fb_problems
from tuner.comms import (
    GroupPlacement,
    allreduce_time,
    alltoall_time,
    broadcast_time,
    dedup_factor,
    p2p_time,
    reduce_time,
)
from tuner.costs import (
    a2a_exposed,
    a2a_one,
    all_gather_time,
    fp8_cast_time,
    gemm_peak,
    grad_post_time,
    head_fwd,
    kv_width,
    layer_collectives,
    layer_parts,
    moe_module_time,
    place_groups,
    recompute_time,
    recomputes_a2a,
    reduce_scatter_time,
    step_sync_groups,
)
from tuner.counts import LayerCounts, chunk_layers, head_params, layer_counts
from tuner.layout import (
    DEFAULT_ASSUMPTIONS,
    FP32_TRAINER_PRECISION,
    PUBLISHED_PRECISION,
    Assumptions,
    ParallelPlan,
    PrecisionPolicy,
)
from tuner.platform import Platform
from tuner.sharing import core_speed, exchange_tail_saving, shared_imbalance, shared_replay

__all__ = ["Estimate", "StageMemory", "estimate", "run_bubble", "stage_memory", "schedule_stats",
           "step_time_lower_bound", "reduce_scatter_time", "all_gather_time", "layer_device_time",
           "fb_inflight", "fb_memory", "resolve_overlap"]

_TP_PARTS = ("attention", "shared_experts", "dense_ffn")  # split over TP (norms, router not)


def _tp_divisor(part: str, plan: ParallelPlan) -> int:
    """How many ranks share one copy of `part`'s parameters: TP for the dense-side weights,
    ETP for the routed experts, 1 for norms and router."""
    if part in _TP_PARTS:
        return plan.tp
    return plan.etp if part in ("experts", "redundant_experts") else 1


def _layer_weights(lc: LayerCounts, plan: ParallelPlan, cfg: ModelConfig) -> tuple[float, float]:
    """(non-expert, expert) parameters of one layer that one rank holds unsharded: what
    ZeRO-3 gathers for it (the expert ones incl. the redundant slots)."""
    rep = sum(n / _tp_divisor(p, plan) for p, n in lc.params.items() if p != "experts")
    exp = lc.params.get("experts", 0) / plan.etp
    if lc.is_moe and plan.redundant:
        exp += plan.redundant * cfg.expert_params() / plan.etp
    return rep, exp


@dataclass(frozen=True)
class StageMemory:
    """Bytes on one pipeline rank (every EP/DP rank of a stage holds the same)."""

    rank: int
    layers: tuple[int, ...]
    params: int
    weights: float
    grads: float
    optimizer: float  # fp32 master copy + optimizer moments
    activations: float
    buffers: float
    # held state bytes per part; under per-parameter ZeRO each part carries the group's
    # largest owned share (the total is exact, the split over parts proportional)
    state_by_part: dict[str, float] = field(default_factory=dict)
    act_by_part: dict[str, float] = field(default_factory=dict)
    params_by_part: dict[str, float] = field(default_factory=dict)
    zero: int = 0
    update_bytes: float = 0.0  # state bytes of the parameters this rank's optimizer updates
    zero_saved: float = 0.0  # grads + optimizer bytes ZeRO spares this rank (vs ZeRO-0)
    redundant: int = 0  # ParallelPlan.redundant: extra expert slots per MoE layer
    moe_layers: int = 0  # MoE layers on this rank
    # per-parameter ZeRO-1/2: parameters whose updated weights this rank packs or unpacks
    # around the weight broadcast (`_bcast_copy_params`)
    bcast_copy_params: float = 0.0
    # per-parameter ZeRO-1/2: the weight broadcast's calls on this rank (buckets whose group
    # has more than one rank), each paying `Platform.collective_tail`
    bcast_calls: int = 0

    @property
    def redundant_bytes(self) -> float:
        """State bytes (weights, gradients, optimizer, as held under the ZeRO level) of the
        redundant expert slots on this rank: what r > 0 adds to its memory."""
        return self.state_by_part.get("redundant_experts", 0.0)

    @property
    def state(self) -> float:
        """Weights + gradients + optimizer state: what the optimizer step streams."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.buffers


@dataclass(frozen=True)
class Estimate:
    """Prediction for one (model, layout, platform)."""

    model: str
    platform: str
    plan: ParallelPlan
    stages: tuple[StageMemory, ...]
    time: dict[str, float]  # compute, alltoall, p2p, bubble, dp_sync, optimizer
    step_time: float
    model_flops: float  # per step, all GPUs
    tflops_per_gpu: float
    mfu: float
    usable_hbm: float
    notes: tuple[str, ...] = ()
    dp_collectives: dict[str, float] = field(default_factory=dict)  # dp_sync by collective
    alltoall_hidden: float = 0.0  # all-to-all seconds the overlap hid (not in step_time)

    @property
    def zero_saved(self) -> float:
        """Bytes ZeRO spares the rank with the peak memory (0 for ZeRO-0)."""
        return max(self.stages, key=lambda s: s.total).zero_saved

    @property
    def peak_memory_zero0(self) -> float:
        """Peak memory the same layout would need with replicated state (ZeRO-0)."""
        return max(s.total + s.zero_saved for s in self.stages)

    @property
    def peak_memory(self) -> float:
        return max(s.total for s in self.stages)

    @property
    def redundant_memory(self) -> float:
        """Bytes the redundant expert slots take on the rank with the peak memory (0 for r=0)."""
        return max(self.stages, key=lambda s: s.total).redundant_bytes

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.usable_hbm

    @property
    def tokens_per_s(self) -> float:
        return self.plan.global_batch * self.plan.seq_len / self.step_time


# zb-h1's split of a backward when the platform measures none: B and W equal halves, no extra
EQUAL_SPLIT = (0.5, 0.0)


def zb_split(pf: Platform) -> tuple[float, float]:
    """(B's share of the split backward, its extra over a plain forward + backward) on `pf`,
    rounded so that schedule statistics of nearby platforms share a cache entry."""
    return round(pf.split_backward_input_share, 3), round(pf.split_backward_extra, 3)


def _unit_costs(name: str, split: tuple[float, float]) -> tuple[dict[str, float], float]:
    """(per-kind action costs in units of one forward, one (stage, micro-batch)'s total): F=1
    and B=2 (a backward is two forwards); for zb-h1 the backward of (1 + extra) x 3 - 1 units
    split into B (the input share) and W (the rest). Every stage is priced as a split one (the
    first, fed token ids, runs its backward plain: the busiest rank's time carries that)."""
    if name != "zb-h1":
        return {"F": 1.0, "B": 2.0}, 3.0
    share, extra = split
    back = 2.0 + 3.0 * extra
    return {"F": 1.0, "B": share * back, "W": (1.0 - share) * back}, 1.0 + back


def _exact_stats(name: str, pp: int, m: int, v: int, split: tuple[float, float]
                 ) -> tuple[float, tuple[int, ...]]:
    """(makespan in units of F, peak in-flight per rank) of the simulated schedule."""
    kw = {"n_virtual": v} if name == "interleaved-1f1b" else {}
    sched = build(name, pp, m, **kw)
    costs, unit = _unit_costs(name, split)
    bubble = bubble_fraction(sched, costs) if pp > 1 else 0.0
    makespan = m * v * unit / (1.0 - bubble)
    peaks = peak_inflight(sched)
    return makespan, tuple(peaks[r] for r in range(pp))


def shared_span(plan: ParallelPlan, pf: Platform, cpu_share: float) -> float:
    """Makespan of `plan`'s schedule replayed on `pf`'s shared cores (`tuner.sharing`), in
    units of the busiest rank's busy time: the factor that replaces 1 / (1 - bubble). Unit
    costs as `schedule_stats` (F=1, B=2; zb-h1 split by the platform's `zb_split`),
    `plan.n_gpus / pp` processes per pipeline rank, `cpu_share` of each action computing.
    The replay's contended part (more computing processes than cores) takes the platform's
    measured excess: x `Platform.shared_pipeline_factor` (`tuner.measure.
    shared_pipeline_factor`, fitted on the same split); the rest runs as replayed."""
    span, contended = _shared_span(plan.schedule, plan.pp, plan.microbatches, plan.n_virtual,
                                   plan.n_gpus // plan.pp, plan.n_gpus, pf.cores_per_node,
                                   pf.threads_per_process, round(cpu_share, 4), zb_split(pf))
    return span + (pf.shared_pipeline_factor - 1.0) * contended


@functools.lru_cache(maxsize=1024)
def _shared_span(name: str, pp: int, m: int, v: int, per_stage: int, n: int, cores: int,
                 threads: int, cpu_share: float, split: tuple[float, float]
                 ) -> tuple[float, float]:
    """(replayed makespan, its contended part), each in units of the busiest rank's busy
    time."""
    kw = {"n_virtual": v} if name == "interleaved-1f1b" else {}
    sched = build(name, pp, m, **kw)
    costs, unit = _unit_costs(name, split)
    if per_stage * pp != n:
        raise ValueError(f"{n} processes do not split evenly over {pp} pipeline ranks")
    got = shared_replay(sched, costs, dict.fromkeys(sched, per_stage), cores, threads,
                        cpu_share)
    return got.span / (m * v * unit), got.contended / (m * v * unit)


@functools.lru_cache(maxsize=4096)
def schedule_stats(name: str, pp: int, microbatches: int, n_virtual: int,
                   split: tuple[float, float] = EQUAL_SPLIT) -> tuple[float, tuple[int, ...]]:
    """(bubble fraction with F=1, B=2 (zb-h1: B and W as `split`, (B's share, extra), says:
    `_unit_costs`), peak in-flight micro-batches per rank).

    Beyond the warm-up every schedule here is periodic: each extra micro-batch adds the same
    work and no idle time, and in-flight counts stay flat (grow by one per micro-batch for
    GPipe). So for m > 4 p v the makespan and peaks are extrapolated linearly from
    simulations at m0 = 2 p v and 2 m0 (exact; tests compare with the full simulation),
    which keeps planning at thousands of micro-batches fast (12 s -> 1 s for p=32, m=2048).
    """
    m, v = microbatches, n_virtual
    m0 = 2 * pp * v
    unit = _unit_costs(name, split)[1]
    if pp == 1 or m <= 2 * m0:
        span, peaks = _exact_stats(name, pp, m, v, split)
    else:
        s0, p0 = _exact_stats(name, pp, m0, v, split)
        s1, p1 = _exact_stats(name, pp, 2 * m0, v, split)
        f = (m - m0) / m0
        span = s0 + (s1 - s0) * f
        peaks = tuple(int(round(a + (b - a) * f)) for a, b in zip(p0, p1, strict=True))
    return 1.0 - m * v * unit / span, peaks


def fb_pairs(plan: ParallelPlan) -> bool:
    """Whether `plan` pairs micro-batches (a2a_overlap fb with an exchange, >= 2 micro-batches
    and, with pp > 1, a schedule `pipeline.schedule.build_fb` pairs): then its ranks hold
    `fb_inflight` micro-batches' activations."""
    # the trainer's fb rules on micro-batches and schedule (`fb_problems`); recompute left out:
    # a refused fb plan with full recompute is still priced with fb's in-flight count
    return (plan.a2a_overlap == "fb" and plan.ep > 1
            and not fb_problems(plan.microbatches, plan.pp, plan.schedule, "none"))


@functools.lru_cache(maxsize=1024)
def fb_inflight(name: str, pp: int, microbatches: int, n_virtual: int) -> tuple[int, ...]:
    """Peak in-flight micro-batches per pipeline rank of the paired schedule
    (`pipeline.schedule.build_fb`; with pp = 1 the trainer's paired loop, which holds what
    build_fb("1f1b", 1, M) does: 2 against the plain loop's 1), a pair's F alive beside its
    B. 1F1B's deeper warm-up makes rank r hold 2(p - r) against p - r. The peaks are flat
    beyond the warm-up, so M is capped at 4 p v (checked for p 1-4, v 1-3 up to 8 p v)."""
    name = name if pp > 1 else "1f1b"
    m = min(microbatches, 4 * pp * n_virtual)
    kw = {"n_virtual": n_virtual} if name == "interleaved-1f1b" else {}
    peaks = peak_inflight(build_fb(name, pp, m, **kw))
    return tuple(peaks[r] for r in range(pp))


def run_bubble(plan: ParallelPlan, asm: Assumptions,
               split: tuple[float, float] = EQUAL_SPLIT) -> float:
    """Bubble fraction of a step's pipeline. One schedule run of all M micro-batches, except
    where the step accumulates over several whole runs (`Assumptions.zero3_runs` with
    zero3_gather="step": FSDP2 under torch.distributed.pipelining, one schedule per local
    batch): then every run fills and drains the pipeline, the M micro-batches split as evenly
    as the runs allow. A run of m micro-batches spans 3 m v / (1 - b(m)) unit costs
    (`schedule_stats`), so the step's fraction is 1 - 3 M v / (sum of the runs' spans).
    `split`: zb-h1's (B share, extra), `zb_split` of the platform."""
    runs = asm.zero3_runs if plan.zero == 3 and asm.zero3_gather == "step" else 1
    m, v = plan.microbatches, plan.n_virtual
    if runs <= 1 or runs > m:  # runs > m: refused by the ZeRO-3 term (tuner.costs.zero3_time)
        return schedule_stats(plan.schedule, plan.pp, m, v, split)[0]
    span = 0.0
    for i in range(runs):
        mi = m // runs + (i < m % runs)
        span += 3.0 * mi * v / (1.0 - schedule_stats(plan.schedule, plan.pp, mi, v, split)[0])
    return 1.0 - 3.0 * m * v / span


def _kind_counts(cfg: ModelConfig, ep: int, seq: int, flash: bool) -> dict[bool, LayerCounts]:
    """All MoE layers are alike, as are all dense ones: count one of each."""
    out: dict[bool, LayerCounts] = {}
    for i in range(cfg.n_layers):
        moe = cfg.is_moe_layer(i)
        if moe not in out:
            out[moe] = layer_counts(cfg, i, ep, seq, flash)
    return out


def layer_device_time(cfg: ModelConfig, layer: int, tokens: int, seq: int,
                      pf: Platform) -> tuple[float, float]:
    """Decoder layer `layer` of `cfg`, forward + backward over `tokens` tokens (sequences of
    `seq`) on one rank holding all its experts, fp32, no recompute, as `estimate` prices it on
    `pf` before its activation traffic term: (seconds of its GEMMs, attention and per-layer
    overhead; bytes of the activations it saves, the trainer's set). `tuner measure` times
    the same layer and fits `Platform.elementwise_bandwidth` to the difference."""
    if tokens < seq or tokens % seq:
        raise ValueError(f"tokens={tokens} must be a positive multiple of seq={seq}")
    plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=tokens // seq,
                        seq_len=seq)
    asm = Assumptions(activation_set="trainer")
    lc = layer_counts(cfg, layer, 1, seq, asm.flash_attention)
    t = float(tokens)
    parts = layer_parts(lc, t, t, pf, cfg, plan, asm)
    act = sum(_layer_act(lc, "none", t, t, cfg.d_model, asm.activation_set).values())
    return 3 * sum(parts.values()) + pf.layer_overhead, act * FP32_TRAINER_PRECISION.activation_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_split_dims(cfg: ModelConfig, plan: ParallelPlan, asm: Assumptions) -> None:
    """What TP, CP and ETP split must divide evenly (named errors, before any pricing)."""
    heads = [("n_heads", cfg.n_heads)] + ([("n_kv_heads", cfg.n_kv_heads)]
                                          if cfg.attention == "gqa" else [])
    for name, h in heads:
        if plan.tp > 1 and h % plan.tp:
            raise ValueError(f"tp={plan.tp} does not divide {cfg.name}'s {name}={h}; valid tp: "
                             f"{_divisors(h)}")
    if plan.cp > 1 and plan.seq_len % (2 * plan.cp):
        raise ValueError(f"cp={plan.cp} needs seq_len divisible by 2 x cp = {2 * plan.cp} "
                         f"(causal load balance: each rank takes chunks i and 2 cp - 1 - i); "
                         f"seq_len={plan.seq_len}")
    if plan.etp > 1 and cfg.n_routed_experts and cfg.moe_ffn_dim % plan.etp:
        raise ValueError(f"etp={plan.etp} does not divide {cfg.name}'s expert width "
                         f"moe_ffn_dim={cfg.moe_ffn_dim}; valid etp: {_divisors(cfg.moe_ffn_dim)}")
    if plan.etp > 1 and not cfg.n_routed_experts:
        raise ValueError(f"etp={plan.etp} needs routed experts; {cfg.name} has none: use etp=1")
    if asm.attention == "replicated" and plan.tp * plan.cp * plan.etp > 1:
        raise ValueError("attention='replicated' (the published model) is defined for tp = cp = "
                         f"etp = 1; got tp={plan.tp}, cp={plan.cp}, etp={plan.etp}")


def _check(cfg: ModelConfig, plan: ParallelPlan, asm: Assumptions) -> None:
    E = cfg.n_routed_experts
    if E and E % plan.ep:
        raise ValueError(f"ep={plan.ep} does not divide {E} experts of {cfg.name}; valid: "
                         f"{[d for d in range(1, E + 1) if E % d == 0]}")
    if not E and plan.ep != 1:
        raise ValueError(f"{cfg.name} has no routed experts; ep={plan.ep} must be 1")
    _check_split_dims(cfg, plan, asm)
    if plan.redundant > E - E // plan.ep:
        raise ValueError(
            f"redundant={plan.redundant} exceeds the {E - E // plan.ep} experts of {cfg.name} an "
            f"EP rank does not hold (E={E}, ep={plan.ep}): a redundant slot holds a replica of "
            f"one of them; valid: 0..{E - E // plan.ep}")
    if asm.attention == "sharded" and plan.global_batch % (plan.attn_dp * plan.microbatches):
        raise ValueError(
            f"global_batch={plan.global_batch} is not divisible by dp={plan.attn_dp} x "
            f"microbatches={plan.microbatches} (dp = edp={plan.dp} x ep={plan.ep} x "
            f"etp={plan.etp} / (tp={plan.tp} x cp={plan.cp})): each data-parallel rank needs "
            f"whole sequences")


def _rank_chunks(cfg: ModelConfig, plan: ParallelPlan, mtp: int = 0) -> list[list[list[int]]]:
    """Each pipeline rank's chunks (layer indices). `mtp` (`Assumptions.mtp_layers`, time
    only): that many multi-token-prediction modules, each one decoder layer of the last
    layer's kind, appended to the last virtual stage, where Megatron-Core places them."""
    chunks = chunk_layers(cfg.n_layers, plan.pp, plan.n_virtual)
    if mtp:
        chunks = [list(c) for c in chunks]
        chunks[-1] += [cfg.n_layers - 1] * mtp
    return [[chunks[s] for s in range(r, len(chunks), plan.pp)] for r in range(plan.pp)]


def _layer_act(lc: LayerCounts, ckpt: str, t_attn: float, t_exp: float, D: int,
               act_set: str = "published") -> dict[str, float]:
    """Activation elements of one layer for one micro-batch on one rank, per part."""
    if ckpt == "full":
        return {"attention": D * t_attn}
    if act_set == "trainer":
        if not lc.act_trainer:
            raise ValueError("activation_set='trainer' is only derived for GQA models without "
                             "qk_norm; use activation_set='published'")
        table = lc.act_trainer_selective if ckpt == "selective" else lc.act_trainer
    else:
        table = lc.act_selective if ckpt == "selective" else lc.act
    if ckpt == "moe" and lc.is_moe:
        # the MoE module keeps only its D-wide input; router, routed and shared experts'
        # tensors are rebuilt in the backward
        table = {p: v for p, v in table.items() if p not in _MOE_MODULE_PARTS}
        table["moe_input"] = float(D)
    return {p: v * (t_exp if p == "experts" else t_attn) for p, v in table.items()}


_MOE_MODULE_PARTS = ("router", "experts", "shared_experts")


def _rebuilt(lc: LayerCounts, ckpt: str, t_attn: float, t_exp: float, D: int,
             act_set: str = "published") -> float:
    """Activation elements one layer's recompute rebuilds for one micro-batch: per part, the
    layer's set without checkpointing less what `ckpt` kept of it (the FFN intermediates
    under "selective", the router's and experts' tensors under "moe", all but the block's
    input under "full"); 0 for "none"."""
    if ckpt == "none":
        return 0.0
    kept = _layer_act(lc, ckpt, t_attn, t_exp, D, act_set)
    return sum(max(0.0, v - kept.get(p, 0.0))
               for p, v in _layer_act(lc, "none", t_attn, t_exp, D, act_set).items())


def stage_memory(cfg: ModelConfig, plan: ParallelPlan, platform: Platform | None,
                 precision: PrecisionPolicy = PUBLISHED_PRECISION,
                 assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> list[StageMemory]:
    """Per pipeline rank memory breakdown (see the module docstring). `platform` places the
    groups and states the memory of a2a_overlap "auto" (`resolve_overlap`); nothing else here
    reads it. With fb (`fb_pairs`) the in-flight micro-batches are `fb_inflight`'s."""
    if plan.a2a_overlap == "auto":
        if platform is None:
            raise ValueError("a2a_overlap='auto' needs the platform (its nodes, its memory)")
        plan, assumptions, _ = resolve_overlap(cfg, plan, platform, precision, assumptions)
    _check(cfg, plan, assumptions)
    D, pb = cfg.d_model, precision
    if plan.zero == 3 and pb.fsdp_master_shard:
        # the fp32 master shard is the weight held; no separate low-precision copy
        pb = dataclasses.replace(pb, weight_bytes=pb.master_bytes, master_bytes=0)
    kinds = _kind_counts(cfg, plan.ep, plan.seq_len, assumptions.flash_attention)
    t_attn = plan.attention_tokens(assumptions.attention)
    t_exp = plan.expert_tokens * assumptions.routing_imbalance
    _, inflight = schedule_stats(plan.schedule, plan.pp, plan.microbatches, plan.n_virtual)
    # fb's pairs: whole micro-batches in flight (this trainer), or one layer more than the
    # plain schedule (Megatron-Core's layer-interleaved pairs: Assumptions.fb_pairing)
    paired = fb_pairs(plan)
    fb_layer = paired and assumptions.fb_pairing == "layer"
    if paired and not fb_layer:
        inflight = fb_inflight(plan.schedule, plan.pp, plan.microbatches, plan.n_virtual)
    emb, head = head_params(cfg)
    aset = assumptions.activation_set
    out = []
    for r, chunks in enumerate(_rank_chunks(cfg, plan)):
        params: dict[str, float] = {}
        layers = [i for c in chunks for i in c]
        for i in layers:
            for p, k in kinds[cfg.is_moe_layer(i)].params.items():
                params[p] = params.get(p, 0) + k / _tp_divisor(p, plan)
            if plan.redundant and cfg.is_moe_layer(i):
                params["redundant_experts"] = (params.get("redundant_experts", 0)
                                               + plan.redundant * cfg.expert_params() / plan.etp)
        if r == 0:
            params["embedding"] = emb / plan.tp  # vocab-parallel under TP
        if r == plan.pp - 1:
            params["head"] = head / plan.tp
        # Activations: the largest chunk times the micro-batches alive at the peak.
        act: dict[str, float] = {}
        best = -1.0
        one_layer = 0.0  # the largest layer's, one micro-batch (fb_pairing "layer")
        for c in chunks:
            per: dict[str, float] = {}
            for i in c:
                lc = kinds[cfg.is_moe_layer(i)]
                la = _layer_act(lc, plan.checkpointing, t_attn, t_exp, D, aset)
                if fb_layer:  # only there: stage_memory is the search's inner loop
                    one_layer = max(one_layer, sum(la.values()) * pb.activation_bytes)
                for p, v in la.items():
                    per[p] = per.get(p, 0.0) + v * pb.activation_bytes
                if plan.etp > 1 and lc.is_moe and plan.checkpointing not in ("full", "moe"):
                    # ETP gathers each routed row to the etp ranks of its expert: the D-wide
                    # input row is held etp times, the F-wide intermediates are split
                    per["experts"] += (plan.etp - 1) * cfg.top_k * D * t_exp * pb.activation_bytes
                if aset == "trainer" and plan.checkpointing != "full":
                    # rotary cos/sin tables [s, hd], saved once per layer and micro-batch
                    per["rope"] = (per.get("rope", 0.0)
                                   + 2 * plan.seq_len * cfg.qk_head_dim * pb.activation_bytes)
            if sum(per.values()) > best:
                best, act = sum(per.values()), per
        act = {p: v * inflight[r] for p, v in act.items()}
        if fb_layer:  # the paired forward's newest layer beside the backward's oldest
            act["fb_pair_layer"] = one_layer
        if plan.checkpointing != "none":
            # Recomputing a layer in the backward rebuilds, for one micro-batch, what its
            # checkpoint dropped (`_rebuilt`: the FFN intermediates under "selective", the
            # MoE module's tensors under "moe", all but the block's input under "full")
            act["recompute"] = max(_rebuilt(kinds[cfg.is_moe_layer(i)], plan.checkpointing,
                                            t_attn, t_exp, D, aset)
                                   for i in layers) * pb.activation_bytes
        if aset == "trainer":
            # Every micro-batch in flight keeps its head (and token ids) until its backward.
            if r == plan.pp - 1:
                act["logits"] = inflight[r] * t_attn * (3 * D + 1 + cfg.vocab_size) * pb.activation_bytes
            if r == 0:
                act["tokens"] = inflight[r] * t_attn * 8
        elif r == plan.pp - 1:
            act["logits"] = t_attn * cfg.vocab_size * (pb.activation_bytes + 4)
        has_moe = any(cfg.is_moe_layer(i) for i in layers)
        buffers = 0.0
        if has_moe and plan.ep > 1:  # all-to-all send and receive rows (gathered under ETP)
            buffers += cfg.top_k * t_exp * D * plan.etp * (pb.dispatch_bytes + pb.combine_bytes)
        if plan.pp > 1:
            buffers += 2 * t_attn * D * pb.p2p_bytes
        if plan.tp > 1:  # the sequence-parallel all-gather's output, one region at a time
            buffers += t_attn * plan.tp * D * pb.activation_bytes
        if plan.cp > 1:  # ring attention: the K/V block in flight and the one computing
            buffers += 2 * t_attn * kv_width(cfg) * pb.activation_bytes
        g_rep, g_exp = plan.replica_groups(assumptions.attention)
        if g_rep > 1 or g_exp > 1:
            buffers += assumptions.grad_bucket_bytes
        n = sum(params.values())
        shares = _shares(cfg, plan, assumptions, tuple(layers), r == 0, r == plan.pp - 1)
        held = {p: _held_params(p, v, plan, assumptions, shares) for p, v in params.items()}
        weights = sum(h[0] for h in held.values()) * pb.weight_bytes
        grads = sum(h[1] for h in held.values()) * pb.grad_bytes
        if plan.zero == 3:
            # one layer gathered and computing, `zero3_prefetch` more arriving (held in the
            # dtype they are gathered in); its gradient whole until its reduce-scatter.
            # zero3_gather="step": the whole stage stays gathered, with its whole gradient,
            # from the first forward to the step's one reduce-scatter
            per_layer = [sum(_layer_weights(kinds[cfg.is_moe_layer(i)], plan, cfg))
                         for i in layers]
            if assumptions.zero3_gather == "step":
                gathered = big = float(sum(per_layer))
            else:
                big = max(per_layer)
                gathered = (1 + assumptions.zero3_prefetch) * big
            held["zero3_gathered"] = (gathered, big, 0.0, 0.0)
            weights += gathered * pb.param_comm_bytes
            grads += big * pb.grad_bytes
        optim = sum(h[2] for h in held.values()) * (pb.master_bytes + pb.optimizer_bytes)
        full_go = n * (pb.grad_bytes + pb.master_bytes + pb.optimizer_bytes)
        bcast = _bcast_copies(cfg, plan, assumptions, tuple(layers), r == 0, r == plan.pp - 1,
                              pb.param_comm_bytes)
        out.append(StageMemory(
            rank=r, layers=tuple(layers), params=int(n), weights=weights,
            grads=grads, optimizer=optim, activations=sum(act.values()), buffers=buffers,
            state_by_part={p: w * (pb.param_comm_bytes if p == "zero3_gathered"
                                   else pb.weight_bytes) + g * pb.grad_bytes
                           + o * (pb.master_bytes + pb.optimizer_bytes)
                           for p, (w, g, o, _) in held.items()},
            act_by_part=act, params_by_part=dict(params), zero=plan.zero,
            update_bytes=sum(h[3] for h in held.values()) * pb.state_bytes,
            zero_saved=full_go + n * pb.weight_bytes - weights - grads - optim,
            redundant=plan.redundant,
            moe_layers=sum(1 for i in layers if cfg.is_moe_layer(i)),
            bcast_copy_params=bcast[0], bcast_calls=bcast[1],
        ))
    return out


def fb_memory(cfg: ModelConfig, plan: ParallelPlan, precision: PrecisionPolicy,
              asm: Assumptions) -> tuple[float, float]:
    """(peak bytes, extra activation bytes) of the rank with the largest peak when `plan`
    runs with a2a_overlap fb: `stage_memory` with `fb_inflight`'s micro-batches, and what
    that holds beyond the same plan with layer (the plain schedule's in-flight count)."""
    with_fb = stage_memory(cfg, plan.replace(a2a_overlap="fb"), None, precision, asm)
    plain = stage_memory(cfg, plan.replace(a2a_overlap="layer"), None, precision, asm)
    r = max(range(len(with_fb)), key=lambda i: with_fb[i].total)
    return with_fb[r].total, with_fb[r].activations - plain[r].activations


def resolve_overlap(cfg: ModelConfig, plan: ParallelPlan, pf: Platform,
                    precision: PrecisionPolicy = PUBLISHED_PRECISION,
                    asm: Assumptions = DEFAULT_ASSUMPTIONS
                    ) -> tuple[ParallelPlan, Assumptions, str]:
    """(plan, assumptions, why): a plan with a2a_overlap "auto" as the trainer's
    --comm.a2a_overlap=auto runs it (`trainer.layout.auto_overlap`, the same rule as
    `trainer.build.resolve_a2a`): the EP group's nodes from `place_groups` on `pf`, fb's
    memory from `fb_memory` against the platform's usable HBM; the chunks the trainer's
    auto runs (2) where `Assumptions.a2a_chunks` is 0 (auto). Other plans come back as
    they are, why "". """
    if plan.a2a_overlap != "auto":
        return plan, asm, ""
    nodes = place_groups(plan, pf.gpus_per_node, asm.attention)[0]["ep"].nodes \
        if plan.ep > 1 else 1
    peak = extra = None
    if plan.tp == 1 and nodes > 1 and not fb_problems(plan.microbatches, plan.pp, plan.schedule,
                                                      plan.checkpointing):
        peak, extra = fb_memory(cfg, plan, precision, asm)
    mode, chunks, why = auto_overlap(nodes, tp=plan.tp, microbatches=plan.microbatches,
                                     pp=plan.pp, schedule=plan.schedule,
                                     recompute=plan.checkpointing, fb_peak=peak,
                                     budget=pf.usable_hbm, fb_extra=extra)
    if mode != "none" and not asm.a2a_chunks:
        asm = dataclasses.replace(asm, a2a_chunks=chunks)
    return plan.replace(a2a_overlap=mode), asm, why


def _held_params(part: str, n: float, plan: ParallelPlan, asm: Assumptions,
                 shares: tuple[float, float]) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer state, updated) parameter counts of `n` parameters of
    `part` that one rank holds or updates under the plan's ZeRO level (module docstring);
    `shares`: the largest fraction of (non-expert, expert) state one rank of the group owns."""
    shard = n * (shares[1] if part in _EXPERT_PARTS else shares[0])
    if plan.zero == 0:
        return n, n, n, n
    if plan.zero == 3:
        return shard, shard, shard, shard
    grads_sharded = plan.zero == 2 and (plan.microbatches == 1 or asm.zero2_grad_sync == "each")
    return n, shard if grads_sharded else n, shard, shard


_EXPERT_PARTS = ("experts", "redundant_experts")  # replicated over DP only (expert group)
_TENSORS: dict[str, list[tuple[str, bool, int]]] = {}  # repr(cfg) -> the model's parameters


def _model_tensors(cfg: ModelConfig) -> list[tuple[str, bool, int]]:
    """(where, is_expert, numel) of every parameter of `model.MoETransformer(cfg)`, built on
    the meta device (no memory; ~1 s for DeepSeek-V3, once per config): where is "first"
    (embedding), "last" (final norm, lm_head) or the layer index as a string."""
    key = repr(cfg)
    if key not in _TENSORS:
        import torch

        from model import MoETransformer

        with torch.device("meta"):
            m = MoETransformer(cfg)
        out = []
        for name, p in m.named_parameters():
            where = name.split(".")[1] if name.startswith("layers.") else \
                "first" if name.startswith("embed") else "last"
            out.append((where, ".experts." in name, p.numel()))
        _TENSORS[key] = out
    return _TENSORS[key]


def _greedy_max_share(numels: list[float], n: int) -> float:
    """Largest load / total when whole tensors go, largest first, to the least-loaded of n
    ranks (ties: the lower rank): trainer/distributed/zero.py's ownership rule."""
    total = sum(numels)
    if n == 1 or total == 0:
        return 1.0
    heap = [(0.0, r) for r in range(n)]
    for x in sorted(numels, reverse=True):
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + x, r))
    return max(load for load, _ in heap) / total


@functools.lru_cache(maxsize=8192)
def _per_parameter_shares(key: str, layers: tuple[int, ...], first: bool, last: bool,
                          slots: float, g_rep: int, g_exp: int) -> tuple[float, float]:
    """`slots`: the share of a layer's E experts one EP rank holds, (E / EP + r) / E: its
    expert tensors (w1, w2, w3 of `GroupedExperts`) have that many rows."""
    where = {str(i) for i in layers} | ({"first"} if first else set()) | ({"last"} if last else set())
    rep: list[float] = []
    exp: list[float] = []
    for w, is_exp, n in _TENSORS[key]:
        if w in where:
            (exp if is_exp else rep).append(n * slots if is_exp else n)
    return _greedy_max_share(rep, g_rep), _greedy_max_share(exp, g_exp)


def _shares(cfg: ModelConfig, plan: ParallelPlan, asm: Assumptions, layers: tuple[int, ...],
            first: bool, last: bool) -> tuple[float, float]:
    """Largest fraction of a stage's (non-expert, expert) state one rank owns under ZeRO."""
    g_rep, g_exp = plan.replica_groups(asm.attention)
    if plan.zero in (0, 3) or asm.zero_sharding == "flat":  # ZeRO-3: FSDP's flat shards
        return 1.0 / g_rep, 1.0 / g_exp
    _model_tensors(cfg)
    E = cfg.n_routed_experts
    slots = (E // plan.ep + plan.redundant) / E if E else 1.0
    return _per_parameter_shares(repr(cfg), layers, first, last, slots, g_rep, g_exp)


@functools.lru_cache(maxsize=8192)
def _bcast_copy_params(key: str, layers: tuple[int, ...], first: bool, last: bool,
                       slots: float, g_rep: int, g_exp: int, wb: int,
                       cap: int) -> tuple[float, int]:
    """(parameters, calls): the parameters per-parameter ZeRO-1/2 copies on each rank of a
    stage around its weight broadcast, and the broadcasts it makes, as trainer/distributed/
    grad_sync.py builds and sends it (`_make_buckets`, `broadcast_params`): each parameter
    owned as `trainer.distributed.zero.assign_owners` assigns it within its kind (non-expert
    over `g_rep` ranks, expert over `g_exp`), buckets of one (kind, owner) filled in forward
    order up to `cap` bytes of `wb`-byte weights, one broadcast each; a bucket of several
    parameters is packed (torch.cat) on its owner and unpacked (copy_ per parameter) on
    every other rank, one pass over its weights on each rank; a bucket of one parameter is
    broadcast in place, and a group of one rank broadcasts nothing."""
    from trainer.distributed.zero import assign_owners

    where = {str(i) for i in layers} | ({"first"} if first else set()) | ({"last"} if last else set())
    tensors = [(is_exp, round(n * slots) if is_exp else n)
               for w, is_exp, n in _TENSORS[key] if w in where]
    owner: dict[int, int] = {}
    for kind, g in ((False, g_rep), (True, g_exp)):
        idx = [i for i, (e, _) in enumerate(tensors) if e == kind]
        owner.update(zip(idx, assign_owners([tensors[i][1] for i in idx], g), strict=True))
    buckets: list[list[float]] = []  # [parameters, numel, group size]
    open_: dict[tuple[bool, int], list[float]] = {}
    for i, (e, n) in enumerate(tensors):
        b = open_.get((e, owner[i]))
        if b is None or ((b[1] + n) * wb > cap and b[0]):
            b = [0, 0, g_exp if e else g_rep]
            buckets.append(b)
            open_[(e, owner[i])] = b
        b[0] += 1
        b[1] += n
    return (float(sum(n for k, n, g in buckets if k > 1 and g > 1)),
            sum(1 for _, _, g in buckets if g > 1))


def _bcast_copies(cfg: ModelConfig, plan: ParallelPlan, asm: Assumptions,
                  layers: tuple[int, ...], first: bool, last: bool,
                  wb: int) -> tuple[float, int]:
    """`_bcast_copy_params` of a stage under `plan` ((0, 0) unless per-parameter ZeRO-1/2)."""
    if plan.zero not in (1, 2) or asm.zero_sharding != "per-parameter":
        return 0.0, 0
    g_rep, g_exp = plan.replica_groups(asm.attention)
    _model_tensors(cfg)
    E = cfg.n_routed_experts
    slots = (E // plan.ep + plan.redundant) / E if E else 1.0
    return _bcast_copy_params(repr(cfg), layers, first, last, slots, g_rep, g_exp, wb,
                              asm.grad_bucket_bytes)


def _dp_sync(sm: StageMemory, plan: ParallelPlan, groups: dict[str, GroupPlacement],
             platform: Platform, precision: PrecisionPolicy, asm: Assumptions) -> dict[str, float]:
    """Seconds of each gradient-sync collective of one pipeline rank (module docstring)."""
    exp = sum(sm.params_by_part.get(p, 0.0) for p in _EXPERT_PARTS)
    rep = sum(sm.params_by_part.values()) - exp
    gb, wb = precision.grad_comm_bytes, precision.param_comm_bytes
    pairs = ((rep, groups["rep"]), (exp, groups["dp"]))
    out = {}
    if plan.redundant:
        out["replica_sum"] = _replica_sum_time(sm, plan, groups["ep"], platform, gb, asm)
    if plan.zero == 3:  # reduce-scattered per layer and micro-batch (`layer_collectives`)
        return out
    return {**_dp_collectives(plan, pairs, platform, gb, wb, asm, sm.bcast_copy_params,
                              sm.bcast_calls), **out}


def _replica_sum_time(sm: StageMemory, plan: ParallelPlan, group: GroupPlacement,
                      platform: Platform, gb: int, asm: Assumptions) -> float:
    """Seconds to sum replicated experts' gradients over their replicas on one pipeline rank,
    as trainer/distributed/replicas.py's `sum_replica_grads` does: per MoE layer one all-to-all in the EP
    group in which each rank sends r x c gradient rows to other ranks (c replicas per
    replicated expert, `Assumptions.replicas_per_expert`), timed with the all-to-all model of
    an even exchange of that many off-rank bytes."""
    if not sm.moe_layers or group.size == 1:
        return 0.0
    row = sm.params_by_part["redundant_experts"] / (plan.redundant * sm.moe_layers) * gb
    off_rank = plan.redundant * asm.replicas_per_expert * row
    n = group.size
    return sm.moe_layers * alltoall_time(off_rank * n / (n - 1), group, "flat", platform)


def _dp_collectives(plan: ParallelPlan, pairs: tuple, platform: Platform, gb: int, wb: int,
                    asm: Assumptions, copied: float = 0.0, bcast_calls: int = 0
                    ) -> dict[str, float]:
    """`copied`: parameters whose weights per-parameter ZeRO packs / unpacks around its
    broadcast on this rank (`StageMemory.bcast_copy_params`), one pass each at the
    platform's `zero_copy_rate` ("broadcast_copy"). The calls made after the backward pay
    the platform's `collective_tail` each (0 on every GPU file): ZeRO-0's all-reduce, one per
    group (the trainer reduces after the backward there on CPU: `--parallel.grad_overlap`
    auto), and ZeRO-1/2's `bcast_calls` weight broadcasts (`StageMemory.bcast_calls`).
    ZeRO-1/2's reductions, launched from the backward's hooks, pay none."""
    tail = platform.collective_tail
    if plan.zero == 0:
        calls = sum(1 for n, g in pairs if n > 0 and g.size > 1)
        return {"all_reduce": sum(allreduce_time(n * gb, g, platform) for n, g in pairs)
                + calls * tail}
    n_rs = plan.microbatches if plan.zero == 2 and asm.zero2_grad_sync == "each" else 1
    rs = n_rs * sum(reduce_scatter_time(n * gb, g, platform) for n, g in pairs)
    ag = sum(all_gather_time(n * wb, g, platform) for n, g in pairs)
    if asm.zero_sharding == "per-parameter":
        # owners' whole tensors: the backend's reduce and broadcast (measured fits where the
        # platform has them, `tuner.comms`; else the ring halves above)
        bc = {"broadcast": sum(broadcast_time(n * wb, g, platform) for n, g in pairs)
              + bcast_calls * tail}
        if copied:  # the owner's pack and the receivers' unpack of each bucket
            bc["broadcast_copy"] = copied * wb / platform.zero_copy_rate
        if plan.zero == 1:
            return {"all_reduce": sum(allreduce_time(n * gb, g, platform) for n, g in pairs),
                    **bc}
        return {"reduce": n_rs * sum(reduce_time(n * gb, g, platform) for n, g in pairs),
                **bc}
    return {"reduce_scatter": rs, "all_gather": ag}


def compute_imbalance(plan: ParallelPlan, pf: Platform, asm: Assumptions) -> float:
    """The routing imbalance the expert GEMMs' time takes: `Assumptions.routing_imbalance`
    (the busiest EP rank's rows / the mean), or, where the host's processes share its cores
    (a CPU platform, `Assumptions.shared_cores`), what processor sharing leaves of it
    (`tuner.sharing.shared_imbalance`: ranks done with their fewer rows give their core share
    to the busiest). The exchanged rows keep the routing imbalance."""
    imb = asm.routing_imbalance
    if not asm.shared_cores or not pf.cores_per_node or plan.ep == 1 or imb == 1.0:
        return imb
    return shared_imbalance(min(imb, plan.ep), plan.ep, pf.host_procs(plan.n_gpus),
                            pf.cores_per_node, pf.threads_per_process)


def skew_shared(plan: ParallelPlan, pf: Platform, asm: Assumptions) -> bool:
    """Whether the plan's compute takes `Platform.shared_rank_skew`: its processes share the
    host's cores (`Assumptions.shared_cores`, `Platform.shares_cores`), its stage holds
    several ranks, and neither the pipeline replay (PP > 1: `shared_pipeline_factor`) nor
    the EP path's constants (EP > 1: `ep_layer_overhead`, measured with every process
    computing) already hold the wait of the ranks for the slowest."""
    return (asm.shared_cores and plan.pp == 1 and plan.ep == 1 and plan.stage_size > 1
            and pf.shares_cores(plan.n_gpus))


def overlap_share(pf: Platform, ep: GroupPlacement, asm: Assumptions) -> float:
    """The `share` of an overlapped exchange that cannot hide (`tuner.costs.a2a_exposed`):
    `Assumptions.overlap_compute_share` (the communication kernels' share of a GPU), except
    on a CPU platform (`Platform.cores_per_node` stated) with the EP group inside one node,
    where the exchange is the processes' own copies through loopback on the cores the
    compute needs: 1, nothing hides (as train.py's `--comm.a2a_overlap=auto` runs none
    inside a node; measured: docs/planner.md, "The all-to-all overlap in the search")."""
    if pf.cores_per_node and ep.nodes == 1:
        return 1.0
    return asm.overlap_compute_share


def tail_saving(exposed: float, parts: dict[str, float], rc: float, plan: ParallelPlan,
                pf: Platform, ep: GroupPlacement, asm: Assumptions) -> float:
    """Seconds of one MoE layer's compute (one micro-batch) that run beside the exchange's
    tail where an emulated cluster's nodes share one host's cores (`Platform.host_nodes` > 1,
    the EP group on more than one of them, `Assumptions.shared_cores`): the busiest node's
    ranks wait `exposed` x (1 - 1 / imbalance) longer than the mean node's on the link
    (`Assumptions.exchange_imbalance`, else the routing imbalance, as the exchanged rows),
    and meanwhile the other ranks compute on the cores they leave (`tuner.sharing.
    exchange_tail_saving`). The layer's four exchanges (dispatch and combine, forward and
    backward; the recompute's with the backward) each take a quarter of the exposed time and
    are followed by the compute up to the next one: the experts' forward, the rest of the
    forward, the experts' backward, the rest of the backward and the recompute. 0 on every
    platform whose nodes have cores of their own (every GPU file)."""
    got = _tail_setting(plan, pf, ep, asm)
    if got is None or exposed <= 0.0:
        return 0.0
    procs, waiting, share = got
    tail = exposed * share / 4
    e = parts["experts"]
    rest = sum(parts.values()) - e
    return sum(exchange_tail_saving(w, tail, procs, waiting, pf.cores_per_node,
                                    pf.threads_per_process)
               for w in (e, rest, 2 * e, 2 * rest + rc))


def _tail_setting(plan: ParallelPlan, pf: Platform, ep: GroupPlacement,
                  asm: Assumptions) -> tuple[int, int, float] | None:
    """(processes on the host, processes of the busiest node, tail / exposed) where
    `tail_saving` applies, else None."""
    imb = asm.exchange_imbalance or asm.routing_imbalance
    if (not asm.shared_cores or pf.host_nodes < 2 or not pf.cores_per_node or ep.nodes < 2
            or imb <= 1.0):
        return None
    procs = pf.host_procs(plan.n_gpus)
    return procs, min(ep.per_node, procs), 1.0 - 1.0 / imb


def tail_bound_factor(plan: ParallelPlan, pf: Platform, ep: GroupPlacement,
                      asm: Assumptions) -> float:
    """k in [0, 1] with compute - tail_saving + exposed >= compute + k x exposed for every
    layer: each phase saves at most s1 (1 - 1 / s2) x its tail (`exchange_tail_saving`), and
    the tails sum to exposed x (1 - 1 / imbalance); 1 where `tail_saving` is 0. Scales the
    all-to-all term of `step_time_lower_bound` so that it stays a bound."""
    got = _tail_setting(plan, pf, ep, asm)
    if got is None:
        return 1.0
    procs, waiting, share = got
    if waiting == procs:
        return 1.0
    s1 = core_speed(procs - waiting, procs, pf.cores_per_node, pf.threads_per_process)
    s2 = core_speed(waiting, procs, pf.cores_per_node, pf.threads_per_process)
    return max(0.0, 1.0 - s1 * (1.0 - 1.0 / s2) * share)


def host_wait(device: float, f: float, rc: float, plan: ParallelPlan,
              asm: Assumptions) -> float:
    """Seconds one MoE layer (one micro-batch) waits for the host beyond its `device` time
    (forward f and recompute rc seconds of compute set how it splits over the passes):
    `Assumptions.host_floor` against the whole layer, or with `host_floor_scope="forward"`
    against each pass that dispatches after a host sync (the forward; the recompute where
    it reruns the MoE module)."""
    H = asm.host_floor
    if asm.host_floor_scope == "layer":
        return max(0.0, H - device)
    total = 3 * f + rc
    if total <= 0:
        return H
    wait = max(0.0, H - device * f / total)
    if rc and plan.checkpointing in ("full", "moe"):
        wait += max(0.0, H - device * rc / total)
    return wait


def step_time_lower_bound(cfg: ModelConfig, plan: ParallelPlan, platform: Platform,
                          precision: PrecisionPolicy = PUBLISHED_PRECISION,
                          assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                          stages: list[StageMemory] | None = None) -> float:
    """A lower bound of `estimate(...).step_time` that needs no communication model.

    Kept from the step time: each rank's compute (same formula), its all-to-all bytes at the
    fastest rate the closed form allows (intra-node share at the intra-node rate, off-node
    share, x the dedup factor for dedup and auto, at the NIC rate, whichever takes longer; no
    latency: flat, halo and dedup take at least that; 0 when overlapped), the pipeline bubble,
    and the optimizer. Dropped (all >= 0): the loss's elementwise work, latencies, P2P, DP sync, TP/CP/ETP/ZeRO-3
    collectives, the algorithm's extra phases, the host floor (`Assumptions.host_floor`). Valid for the closed-form all-to-all model
    only; the planner uses it to skip full evaluations of points that cannot beat its
    incumbent. `stages`: `stage_memory(...)` of the same arguments when the caller has it."""
    cfg_, asm, pf = cfg, assumptions, platform
    if asm.alltoall_model != "closed-form":
        raise ValueError("step_time_lower_bound holds for alltoall_model='closed-form' only")
    kinds = _kind_counts(cfg_, plan.ep, plan.seq_len, asm.flash_attention)
    t_attn = plan.attention_tokens(asm.attention)
    t_exp_c = plan.expert_tokens * compute_imbalance(plan, pf, asm)
    bubble, _ = schedule_stats(plan.schedule, plan.pp, plan.microbatches, plan.n_virtual,
                               zb_split(pf))
    g = place_groups(plan, pf.gpus_per_node, asm.attention)[0]["ep"]
    t_x = plan.expert_tokens * (asm.exchange_imbalance or asm.routing_imbalance)
    rows = cfg_.top_k * t_x * cfg_.d_model / g.size
    share = rows * (precision.dispatch_bytes + precision.combine_bytes)  # one pass
    f = 1.0
    if plan.alltoall in ("dedup", "auto") and g.nodes > 1:
        f = dedup_factor(g.nodes, cfg_.top_k)  # the independent-pick bound is the smaller
    a2a_lb = 0.0 if g.size == 1 else max(share * g.local_peers / pf.intra_node_bandwidth,
                                         f * share * g.remote_peers / pf.nic_bandwidth_per_gpu)
    a2a_lb *= (3 if recomputes_a2a(plan) else 2) * (1 - asm.alltoall_overlap)
    a2a_lb *= tail_bound_factor(plan, pf, g, asm)  # other ranks compute in the exchange's tail
    if plan.a2a_overlap != "none":
        a2a_lb = 0.0
    busiest = 0.0
    for r, chunks in enumerate(_rank_chunks(cfg_, plan, asm.mtp_layers)):
        busy = 0.0
        for s_local, c in enumerate(chunks):
            fwd = rec = 0.0
            for i in c:
                lc = kinds[cfg_.is_moe_layer(i)]
                parts = layer_parts(lc, t_attn, t_exp_c, pf, cfg_, plan, asm)
                fl, ffn = sum(parts.values()), parts["experts"] + parts["dense"]
                fwd += fl
                rec += recompute_time(plan, fl, ffn, moe_module_time(parts, lc.is_moe))
                busy += a2a_lb if lc.is_moe else 0.0
            if s_local * plan.pp + r == plan.pp * plan.n_virtual - 1:
                fwd += (1 + asm.mtp_layers) * head_fwd(cfg_, plan, pf, t_attn)
            busy += 3 * fwd + rec + len(c) * pf.layer_overhead
        busiest = max(busiest, busy * plan.microbatches)
    upd = max(st.update_bytes for st in stages or stage_memory(cfg_, plan, pf, precision, asm))
    if asm.shared_cores and plan.pp > 1 and pf.shares_cores(plan.n_gpus):
        # on shared cores no rank runs faster than with only its own stage computing; the
        # estimate scales the replay by the platform's measured factor (bound kept below 1)
        fast = core_speed(plan.n_gpus // plan.pp, plan.n_gpus, pf.cores_per_node,
                          pf.threads_per_process)
        return busiest / fast * min(1.0, pf.shared_pipeline_factor) + pf.optimizer_time(upd)
    return busiest / (1.0 - bubble) + pf.optimizer_time(upd)


def estimate(model_cfg: ModelConfig, parallel_cfg: ParallelPlan, platform: Platform,
             precision: PrecisionPolicy = PUBLISHED_PRECISION,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Estimate:
    """Memory, step time and MFU of `parallel_cfg` for `model_cfg` on `platform`.

    a2a_overlap "auto" is priced as the trainer runs it: the rule's mode
    (`resolve_overlap`), unless the trainer's trial (`trainer.a2a_trial`: the rule's mode
    against none over the first steps) would keep none, priced here as the rule's plan's
    step against the plain one's."""
    plan, asm, auto_why = resolve_overlap(model_cfg, parallel_cfg, platform, precision,
                                          assumptions)
    got = _estimate(model_cfg, plan, platform, precision, asm, auto_why)
    if parallel_cfg.a2a_overlap == "auto" and plan.a2a_overlap != "none":
        plain = _estimate(model_cfg, plan.replace(a2a_overlap="none"), platform, precision,
                          asm, "")
        if got.step_time >= plain.step_time:  # the plain estimate, with auto's note
            why = (f"{auto_why}; the trial would keep none: {plan.a2a_overlap} prices "
                   f"{got.step_time:.4g} s against none's {plain.step_time:.4g} s")
            return dataclasses.replace(plain, notes=_with_auto_note(
                plain.notes, _auto_note(plain.plan, asm, why)))
    return got


def _auto_note(plan: ParallelPlan, asm: Assumptions, why: str) -> str:
    """The estimate's note on what a2a_overlap "auto" resolved to, and why."""
    chunks = f" / {asm.a2a_chunks} chunks" if plan.a2a_overlap != "none" else ""
    return f"a2a_overlap auto: {plan.a2a_overlap}{chunks} ({why}; trainer.layout.auto_overlap)"


def _with_auto_note(notes: tuple[str, ...], note: str) -> tuple[str, ...]:
    """`notes` with auto's `note` after the precision note (where `_estimate` puts it)."""
    at = next(i for i, n in enumerate(notes) if n.startswith("precision: ")) + 1
    return notes[:at] + (note,) + notes[at:]


def _estimate(model_cfg: ModelConfig, plan: ParallelPlan, platform: Platform,
              precision: PrecisionPolicy, asm: Assumptions, auto_why: str) -> Estimate:
    """`estimate` of a plan whose overlap is decided (`resolve_overlap`'s)."""
    cfg, pf, pb = model_cfg, platform, precision
    stages = stage_memory(cfg, plan, pf, precision, asm)
    D = cfg.d_model
    kinds = _kind_counts(cfg, plan.ep, plan.seq_len, asm.flash_attention)
    t_attn = plan.attention_tokens(asm.attention)
    t_exp = plan.expert_tokens * asm.routing_imbalance
    # the expert GEMMs' busiest rank; on shared cores the idle ranks' share speeds it up
    t_exp_c = plan.expert_tokens * compute_imbalance(plan, pf, asm)
    bubble = run_bubble(plan, asm, zb_split(pf))
    groups, pp_inter = place_groups(plan, pf.gpus_per_node, asm.attention)
    gemm_peak(pf, plan, asm)  # an fp8 plan on a platform without an fp8 rate: refused here
    # the exchanged rows: bound by the busiest node's link (Assumptions.exchange_imbalance)
    rows = cfg.top_k * plan.expert_tokens * (asm.exchange_imbalance or asm.routing_imbalance) * D
    ab_a2a = (rows * pb.dispatch_bytes, rows * pb.combine_bytes)
    a2a = functools.partial(a2a_one, groups=groups, plan=plan, cfg=cfg, pf=pf, asm=asm)
    hop = p2p_time(t_attn * D * pb.p2p_bytes, pp_inter, pf) if plan.pp > 1 else 0.0
    w_layer = {moe: _layer_weights(kinds[moe], plan, cfg) for moe in kinds}
    # the activations' memory traffic per layer and micro-batch (seconds; 0 passes off CPU):
    # every activation of the layer is written and read, and so is its gradient, whether the
    # forward keeps it or the recompute writes it once more
    traffic = {moe: (asm.activation_traffic_passes * sum(
        _layer_act(lc, "none", t_attn, t_exp, D, asm.activation_set).values())
        + _rebuilt(lc, plan.checkpointing, t_attn, t_exp, D, asm.activation_set))
        * pb.activation_bytes / pf.traffic_bandwidth
        for moe, lc in kinds.items()} if asm.activation_traffic_passes else {}
    # fixed compute per layer and micro-batch: the platform's per-layer overhead and, under
    # ZeRO-3, FSDP2's own work (measured on CPU, else 0); compute, so it shares the cores
    # (the constant of FSDP groups of this size: a stage's ranks)
    fixed = pf.layer_overhead + (pf.zero3_overhead(plan.n_gpus // plan.pp)
                                 if plan.zero == 3 else 0.0)

    keys = ("compute", "alltoall", "p2p", "tp", "cp", "etp", "zero3", "host")
    skew = pf.rank_skew if plan.stage_size > 1 else 1.0
    shared_skew = skew_shared(plan, pf, asm)
    if shared_skew:
        skew = max(skew, pf.shared_rank_skew)
    per_rank = []
    # per rank: the seconds that use a core (compute, the EP path's fixed cost and the
    # pipeline runtime's per-action work)
    core_work = []
    hidden = 0.0
    for r, chunks in enumerate(_rank_chunks(cfg, plan, asm.mtp_layers)):
        acc = dict.fromkeys(keys, 0.0)
        host_work = 0.0
        a2a_total = 0.0
        for s_local, c in enumerate(chunks):
            fwd = rec = 0.0
            for i in c:
                lc = kinds[cfg.is_moe_layer(i)]
                parts = layer_parts(lc, t_attn, t_exp_c, pf, cfg, plan, asm)
                f = sum(parts.values())
                rc = recompute_time(plan, f, parts["experts"] + parts["dense"],
                                    moe_module_time(parts, lc.is_moe))
                fwd += f
                rec += rc
                device = 3 * f + rc + fixed  # this layer's device seconds
                cast = fp8_cast_time(lc, t_attn, t_exp_c, pf, cfg, plan, asm)  # 0 unless fp8
                acc["compute"] += cast
                device += cast
                if lc.is_moe:
                    exp_, tot = a2a_exposed(plan, parts, rc, ab_a2a, a2a, asm.a2a_chunks,
                                            overlap_share(pf, groups["ep"], asm))
                    acc["alltoall"] += exp_ * (1 - asm.alltoall_overlap)
                    device += exp_ * (1 - asm.alltoall_overlap)
                    a2a_total += tot
                    # the other nodes' ranks compute while the busiest node's wait on its link
                    acc["compute"] -= tail_saving(exp_ * (1 - asm.alltoall_overlap), parts, rc,
                                                  plan, pf, groups["ep"], asm)
                    if groups["ep"].size > 1:  # the EP path's fixed cost (platform, measured)
                        # for a forward and a backward; a recompute that re-runs the layer's
                        # exchanges runs the forward's half of it again, as it runs 2 of the
                        # 4 exchanges again
                        ep_fixed = pf.ep_layer_overhead * (1.5 if recomputes_a2a(plan) else 1.0)
                        acc["alltoall"] += ep_fixed
                        host_work += ep_fixed
                        device += ep_fixed
                for k, v in layer_collectives(lc, parts, rc, t_attn, t_exp, cfg, plan, pf, pb,
                                               groups, w_layer[lc.is_moe],
                                               asm.zero3_gather, asm.zero3_runs).items():
                    acc[k] += v
                    device += v
                if lc.is_moe and asm.host_floor:
                    # host-bound: the layer waits for the host to issue it (Assumptions)
                    acc["host"] += host_wait(device, f, rc, plan, asm)
            stage = s_local * plan.pp + r
            if stage == plan.pp * plan.n_virtual - 1:
                # each MTP module's logits: the shared output layer once more (Megatron-Core)
                fwd += (1 + asm.mtp_layers) * head_fwd(cfg, plan, pf, t_attn)
            chunk = 3 * fwd + rec + len(c) * fixed
            if plan.schedule == "zb-h1" and stage > 0:
                # the split backward (B, then W) runs slower than a plain one by the
                # platform's measured fraction (0 unless measured); the first stage, fed token
                # ids, has no input gradient and runs its backward plain
                chunk *= 1.0 + pf.split_backward_extra
            if stage == plan.pp * plan.n_virtual - 1:
                # the loss's log-softmax over the vocab, forward + backward, per output layer
                # (vocab-parallel under TP: t_attn x tp tokens x V / tp; measured on CPU, else 0)
                chunk += (1 + asm.mtp_layers) * pf.loss_time(t_attn, cfg.vocab_size)
            acc["compute"] += chunk
            if traffic:
                acc["compute"] += sum(traffic[cfg.is_moe_layer(i)] for i in c)
            acc["p2p"] += 2 * hop * (1 - asm.p2p_overlap)
            if plan.pp > 1:
                # the pipeline runtime's own work per action (the boundary batch, the
                # stage's autograd set-up and release), measured on CPU, else 0: each
                # (stage, micro-batch) runs F and B, and W under zb-h1
                runtime = (3 if plan.schedule == "zb-h1" else 2) * pf.pipeline_action_overhead
                acc["p2p"] += runtime
                host_work += runtime
        # ranks of a stage meet in a collective every layer (EP) or step (DP): each segment
        # ends with the slowest (the platform's measured spread; 1 off dedicated CPU cores)
        acc["compute"] *= skew
        per_rank.append({k: v * plan.microbatches for k, v in acc.items()})
        core_work.append((acc["compute"] + host_work) * plan.microbatches)
        hidden = max(hidden, (a2a_total - acc["alltoall"]) * plan.microbatches)
    busiest = max(range(plan.pp), key=lambda r: sum(per_rank[r].values()))
    busy = sum(per_rank[busiest].values())
    pipe = busy / (1.0 - bubble)
    shared = asm.shared_cores and plan.pp > 1 and pf.shares_cores(plan.n_gpus)
    if shared:
        # processes share the node's cores: replay the schedule with the waiting ranks' share
        # given to the busy ones (`tuner.sharing`); compute is the part that uses a core,
        # and so is the EP path's measured fixed cost (the dispatcher's work and the waits
        # for partner processes to get a core, measured with every process computing: with
        # fewer computing it shrinks like compute); the exchanges' own price waits without
        # one. Where more processes compute than the cores hold, the platform's measured
        # excess of a real pipeline over the replay (`shared_span`)
        pipe = busy * shared_span(plan, pf, core_work[busiest] / busy if busy else 1.0)

    dp_sync, dp_parts = -1.0, {}
    for sm in stages:
        parts_ = {k: v * (1 - asm.dp_overlap)
                  for k, v in _dp_sync(sm, plan, groups, pf, precision, asm).items()}
        if sum(parts_.values()) > dp_sync:
            dp_sync, dp_parts = sum(parts_.values()), parts_
    # measured or 2 x / HBM; ZeRO-3's AdamW over FSDP2's DTensor shards adds its measured
    # per-layer cost (CPU platforms; 0 elsewhere)
    optim = max(pf.optimizer_time(sm.update_bytes)
                + (len(sm.layers) * pf.zero3_optimizer_overhead if plan.zero == 3 else 0.0)
                for sm in stages)
    # the trainer's gradient passes and small all-reduces (measured on CPU platforms, else 0)
    # (each small all-reduce at its group's price, `Platform.sync_time`)
    post, t_clip, syncs = 0.0, 0.0, 0.0
    for sm in stages:
        held = sm.params * pb.grad_bytes
        owned = sm.grads if plan.zero == 2 else held
        clip_g, rest_g = step_sync_groups(plan, sm.moe_layers > 0)
        post = max(post, grad_post_time(held, owned, plan, pf))
        t_clip = max(t_clip, sum(pf.sync_time(g, plan.n_gpus) for g in clip_g))
        syncs = max(syncs, sum(pf.sync_time(g, plan.n_gpus) for g in rest_g))
    grad_post = post + t_clip
    step = pipe + dp_sync + optim + grad_post + syncs
    used = {"tp": plan.tp > 1, "cp": plan.cp > 1, "etp": plan.etp > 1, "zero3": plan.zero == 3,
            "host": asm.host_floor > 0}
    time = {**{k: v for k, v in per_rank[busiest].items() if used.get(k, True)},
            "bubble": pipe - busy, "dp_sync": dp_sync, "optimizer": optim,
            **({"grad_post": grad_post, "step_syncs": syncs} if grad_post or syncs else {})}
    flops = cfg.flops_per_token(plan.seq_len) * plan.global_batch * plan.seq_len
    tflops = flops / (step * plan.n_gpus)
    notes = (
        f"attention {asm.attention} over EP; flash attention {asm.flash_attention}",
        f"overlap: all-to-all {plan.a2a_overlap} (+ {asm.alltoall_overlap:.0%} of what is left"
        + (f"; its kernels take {asm.overlap_compute_share:.0%} of the device while overlapped"
           if plan.a2a_overlap != "none" else "")
        + f"), P2P {asm.p2p_overlap:.0%}, DP {asm.dp_overlap:.0%}; routing imbalance "
        f"{asm.routing_imbalance}"
        + (f"; host floor {1e3 * asm.host_floor:.3g} ms per MoE layer and micro-batch "
           f"(forward + backward: the layer takes max(device time, host time))"
           if asm.host_floor else ""),
        "bubble from the unit-cost schedule scaled to the slowest rank"
        + (f"; replayed on {pf.cores_per_node} shared cores ({plan.n_gpus} processes x "
           f"{pf.threads_per_process} threads): waiting ranks' share goes to the busy ones"
           if shared else ""),
        _zero_note(plan, asm),
        *((f"compute x {skew:.3f}: the slowest of a stage's {plan.stage_size} processes over "
           f"their mean on the same work (the platform's measured "
           f"{'shared_rank_skew: they share the cores' if shared_skew else 'rank_skew'})",)
          if skew != 1.0 else ()),
        f"precision: {pb.name or 'custom'} state ({pb.weight_bytes} B weights, {pb.grad_bytes} B "
        f"grads, {pb.master_bytes} B master, {pb.optimizer_bytes} B moments per parameter); "
        f"wire: grads {pb.grad_comm_bytes} B, weights {pb.param_comm_bytes} B, dispatch "
        f"{pb.dispatch_bytes} B, combine {pb.combine_bytes} B, pipeline {pb.p2p_bytes} B per "
        f"element; {plan.precision} GEMMs"
        + ("; ZeRO-3: the fp32 master shard is the weight held (FSDP2's mixed precision), "
           "layers gathered at the wire width" if plan.zero == 3 and pb.fsdp_master_shard
           else ""),
    ) + (("all-to-all dedup: closed form (comm.netsim has no dedup exchange)",)
         if asm.alltoall_model == "netsim" and plan.alltoall == "dedup" else ()) \
        + ((f"parallel folding: dense side tp={plan.tp} x cp={plan.cp} x dp={plan.attn_dp}, "
          f"expert side etp={plan.etp} x ep={plan.ep} x edp={plan.dp}; TP with sequence "
          f"parallel",) if plan.tp * plan.cp * plan.etp > 1 else ()) \
        + ((f"redundant expert slots: {plan.redundant} per MoE layer on each EP rank (weights, "
            f"gradients, optimizer state as the experts'); their gradients summed over the "
            f"replicas by one all-to-all per MoE layer in the EP group of {plan.ep}, each rank "
            f"sending {plan.redundant} x {asm.replicas_per_expert} rows",)
           if plan.redundant else ())
    if auto_why:
        notes = _with_auto_note(notes, _auto_note(plan, asm, auto_why))
    return Estimate(
        model=cfg.name, platform=pf.name, plan=plan, stages=tuple(stages), time=time,
        step_time=step, model_flops=flops, tflops_per_gpu=tflops / 1e12,
        mfu=tflops / pf.peak_flops, usable_hbm=pf.usable_hbm, notes=notes,
        dp_collectives=dp_parts, alltoall_hidden=hidden,
    )


def _zero_note(plan: ParallelPlan, asm: Assumptions) -> str:
    g_rep, g_exp = plan.replica_groups(asm.attention)
    if plan.zero == 0:
        return (f"ZeRO-0: state replicated; gradients all-reduced over DP x EP = {g_rep} "
                f"(non-expert) and DP = {g_exp} (experts)")
    what = "optimizer state" if plan.zero == 1 else "optimizer state and gradients"
    grads = ""
    if plan.zero == 2 and plan.microbatches > 1 and asm.zero2_grad_sync == "last":
        grads = (f"; gradients held whole while the {plan.microbatches} micro-batches accumulate "
                 "(reduced after the last)")
    if asm.zero_sharding == "per-parameter":
        how = ("whole parameters per owner; gradients " +
               ("all-reduced" if plan.zero == 1 else "reduced to owners") +
               ", updated weights broadcast from owners")
    else:
        how = "flat shards; gradients reduce-scattered, updated weights all-gathered"
    return (f"ZeRO-{plan.zero}: {what} sharded over {g_rep} ranks (non-expert) and {g_exp} "
            f"(experts){grads}; {how}")

"""What the analytic model is asked about: a parallel layout, a precision policy, assumptions.

`ParallelPlan` is one point of the planner's search space: the PP x DP x EP degrees, the
pipeline schedule and micro-batching, the all-to-all algorithm, activation checkpointing,
where EP groups sit, the ZeRO level (0 replicated state, 1 optimizer state sharded over
each parameter's data-parallel replicas, 2 gradients too; `trainer` `--parallel.zero`) and
the redundant expert slots per EP rank (`redundant`, the trainer's `--balance.redundant`:
each EP rank hosts E / EP + r slots per MoE layer, the r extra holding replicas of hot
experts; a fixed input, not searched).
`PrecisionPolicy` says how many bytes each parameter costs in training (the published default
is 16: bf16 weight and gradient, fp32 master copy and two Adam moments). `Assumptions`
collects the modelling choices that are not facts of the platform (overlap, routing balance,
flash attention, when ZeRO-2 reduces) so that each is visible and can be changed.

Batch algebra (b = global batch in sequences, M micro-batches, s sequence length):
    sequences per micro-batch of one EP group     b / (DP * M)
    attention tokens per rank per micro-batch     s * b / (DP * M * EP)   ("sharded", as trained)
                                                  s * b / (DP * M)        ("replicated", published)
    routed token copies per rank per micro-batch  k * s * b / (DP * M * EP)   (balanced routing)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model import CHECKPOINTING  # the modes model/checkpointing.py implements and train.py runs
from trainer.layout import (  # vocabularies of the one layout model, declared there once
    A2A_OVERLAP,
    ALLTOALL_ALGORITHMS,
    EP_PLACEMENTS,
    PRECISIONS,
    RECOMPUTE_MODES,  # + Megatron's "moe" module, priced, not runnable
    SCHEDULES,
    ZERO_LEVELS,
    Layout,
)

__all__ = [
    "ALLTOALL_ALGORITHMS",
    "Assumptions",
    "CPU_TRAFFIC_PASSES",
    "DEFAULT_ASSUMPTIONS",
    "FP32_TRAINER_PRECISION",
    "GPU_TRAINER_PRECISION",
    "MEGATRON_PRECISION",
    "PRECISION_POLICIES",
    "PUBLISHED_PRECISION",
    "CHECKPOINTING",
    "EP_PLACEMENTS",
    "FB_PAIRINGS",
    "HOST_FLOOR_SCOPES",
    "ParallelPlan",
    "PrecisionPolicy",
    "SCHEDULES",
    "ZERO3_GATHER",
    "ZERO_LEVELS",
    "check_zero_levels",
    "fold_degrees",
    "not_runnable",
    "trainer_layout",
    "plan_stage_layers",
    "precision_policy",
]

# The planner prices every all-to-all (flat, halo, dedup, auto) and ZeRO level (0-3) of the
# layout model; `not_runnable` says which of them train.py runs.
ATTENTION_MODES = ("sharded", "replicated")
ZERO2_GRAD_SYNC = ("last", "each")
ZERO_SHARDING = ("flat", "per-parameter")
ZERO3_GATHER = ("microbatch", "step")  # Assumptions.zero3_gather
HOST_FLOOR_SCOPES = ("layer", "forward")  # Assumptions.host_floor_scope
FB_PAIRINGS = ("trainer", "layer")  # Assumptions.fb_pairing


_ZERO_MEANING = {0: "replicated state", 1: "optimizer state sharded",
                 2: "optimizer state and gradients sharded",
                 3: "parameters sharded too, gathered per layer"}


def check_zero_levels(levels: object, what: str = "zero") -> tuple[int, ...]:
    """`levels` (one ZeRO level or several) as a tuple, or a ValueError naming the bad value."""
    seq = levels if isinstance(levels, (tuple, list)) else (levels,)
    valid = ", ".join(f"{z} ({_ZERO_MEANING.get(z, '')})" for z in ZERO_LEVELS)
    if not seq:
        raise ValueError(f"{what}: no ZeRO level given; valid: {valid}")
    for z in seq:
        if isinstance(z, bool) or z not in ZERO_LEVELS:
            raise ValueError(f"{what}={z!r}: the ZeRO level must be one of {valid}")
    return tuple(seq)


def fold_degrees(gpus: int, pp: int, tp: int = 1, cp: int = 1, ep: int = 1,
                 etp: int = 1) -> tuple[int, int]:
    """(dp, edp): the data-parallel degrees of the dense and the expert side of a layout.

    Parallel folding (Megatron-Core's MoE layout): the gpus / pp ranks of a pipeline stage
    are arranged twice over the same ranks,
        dense side   tp x cp x dp     (attention, norms, dense FFN, shared experts, head)
        expert side  etp x ep x edp   (routed experts)
    so gpus = pp x tp x cp x dp = pp x etp x ep x edp: EP groups are formed from the DP x TP x
    CP ranks of a stage, and ep x etp must divide tp x cp x dp. With tp = cp = etp = 1 this is
    the trainer's PP x DP x EP mesh: edp is its --parallel.dp and dp = edp x ep its stage
    group. `ParallelPlan.dp` is edp."""
    for name, v in (("gpus", gpus), ("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep),
                    ("etp", etp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if gpus % pp:
        raise ValueError(f"pp={pp} does not divide {gpus} GPUs; valid pp: "
                         f"{[d for d in range(1, gpus + 1) if gpus % d == 0]}")
    stage = gpus // pp
    valid = [d for d in range(1, stage + 1) if stage % d == 0]
    if stage % (tp * cp):
        raise ValueError(f"tp={tp} x cp={cp} = {tp * cp} does not divide the {stage} ranks of a "
                         f"pipeline stage ({gpus} GPUs / pp={pp}); tp x cp must be one of {valid}")
    if stage % (ep * etp):
        raise ValueError(f"ep={ep} x etp={etp} = {ep * etp} does not divide the {stage} ranks of "
                         f"a pipeline stage ({gpus} GPUs / pp={pp} = tp x cp x dp); ep x etp must "
                         f"be one of {valid}")
    # The checks above name the planner's flags; the degrees themselves are the layout model's.
    lay = Layout.infer(gpus, pp=pp, ep=ep, tp=tp, cp=cp, etp=etp)
    return lay.attn_dp, lay.dp


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter of each training-state part, bytes per saved activation element,
    and bytes per element of every collective, as a trainer allocates and sends them.

    `grad_comm_bytes`: gradient all-reduce / reduce-scatter / reduce (and ZeRO-3's per-layer
    reduce-scatter); `param_comm_bytes`: the weight broadcast / all-gather after the step (and
    ZeRO-3's per-layer gather); `dispatch_bytes` / `combine_bytes`: the rows the MoE
    all-to-all sends forward (their gradients go back at the same width);
    `p2p_bytes`: a pipeline activation and its gradient; TP, CP and ETP collectives move
    activations at `activation_bytes`. 0 = the matching state width (grad, weight) or the
    activation width."""

    weight_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4  # fp32 master weights (0 when training in fp32 without a copy)
    optimizer_bytes: int = 8  # Adam: two fp32 moments
    activation_bytes: int = 2
    grad_comm_bytes: int = 0
    param_comm_bytes: int = 0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    p2p_bytes: int = 0
    name: str = ""
    # ZeRO-3 as FSDP2's MixedPrecisionPolicy runs it (trainer/distributed/zero3.py): the fp32 shard is the
    # master and the only copy held (no separate low-precision weight shard), gathered per layer
    # at `param_comm_bytes`
    fsdp_master_shard: bool = False

    def __post_init__(self) -> None:
        for f in ("grad_comm_bytes", "param_comm_bytes", "dispatch_bytes", "combine_bytes",
                  "p2p_bytes"):
            v = getattr(self, f)
            if v == 0:
                base = {"grad_comm_bytes": self.grad_bytes,
                        "param_comm_bytes": self.weight_bytes}.get(f, self.activation_bytes)
                object.__setattr__(self, f, base)

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


# The published default (docs/reference.md 1.1, Piper's memory model): 16 B per parameter,
# bf16 weight and gradient, fp32 master copy and two Adam moments; bf16 everywhere on the wire.
PUBLISHED_PRECISION = PrecisionPolicy(name="published")
# What train.py holds on CPU (`--train.dtype=auto` -> fp32, torch.optim.AdamW): fp32 weights
# and gradients, no separate master copy, two fp32 moments (exp_avg, exp_avg_sq; the step
# counter is a 0-dim tensor, 4 bytes per parameter tensor, below 0.01 %), fp32 activations,
# and every collective in fp32.
FP32_TRAINER_PRECISION = PrecisionPolicy(weight_bytes=4, grad_bytes=4, master_bytes=0,
                                         optimizer_bytes=8, activation_bytes=4, name="trainer")
# What train.py holds and sends on GPUs (`--train.dtype=auto|bf16`: bf16 autocast over fp32
# parameters, trainer/loop.py): fp32 weights and gradients, no master copy, two fp32 moments;
# gradients reduced and weights broadcast in fp32 (trainer/distributed/grad_sync.py buckets by parameter
# dtype); the MoE dispatch sends the fp32 residual stream's normed rows (model/norm.py returns
# its input dtype, the router runs on them; autocast does not reach the dispatch) and the
# combine the experts' bf16 outputs (model/moe.py casts to the autocast dtype after the
# dispatch); pipeline hops carry bf16 (trainer/distributed/pipe.py's Stage.boundary_dtype under autocast
# casts what crosses a stage boundary, and its gradient, to bf16). Saved activations at 2 B
# (autocast's GEMM inputs; the fp32 norm inputs are a part this count does not split out).
GPU_TRAINER_PRECISION = PrecisionPolicy(weight_bytes=4, grad_bytes=4, master_bytes=0,
                                        optimizer_bytes=8, activation_bytes=2,
                                        grad_comm_bytes=4, param_comm_bytes=4, dispatch_bytes=4,
                                        combine_bytes=2, p2p_bytes=2, name="trainer")
# What train.py holds and sends with bf16 working weights (`--train.param_dtype=bf16`, the
# default on GPUs: trainer/distributed/precision.py): bf16 weights (2), an fp32 main_grad (4) each bf16
# gradient is added into, an fp32 master (4) and two moments (8) in the optimizer (on the
# owner under ZeRO-1/2); gradients reduced in fp32 (`--train.reduce_dtype=bf16`: 2), the
# updated bf16 weight broadcast (2); the dispatch sends the bf16 normed rows, the combine the
# bf16 expert outputs, pipeline hops bf16. Under ZeRO-3 the fp32 shard is the master
# (fsdp_master_shard): (4 + 4 + 8) / N held, layers gathered in bf16.
BF16_TRAINER_PRECISION = PrecisionPolicy(weight_bytes=2, grad_bytes=4, master_bytes=4,
                                         optimizer_bytes=8, activation_bytes=2,
                                         grad_comm_bytes=4, param_comm_bytes=2,
                                         dispatch_bytes=2, combine_bytes=2, p2p_bytes=2,
                                         fsdp_master_shard=True, name="trainer")
PARAM_DTYPES = ("auto", "bf16", "fp32")  # train.py's --train.param_dtype
REDUCE_DTYPES = ("fp32", "bf16")  # train.py's --train.reduce_dtype


def trainer_precision(backend: str, param_dtype: str = "auto",
                      reduce_dtype: str = "fp32") -> PrecisionPolicy:
    """What train.py holds and sends on `backend` ("gloo": CPU, else GPUs) with its
    `--train.param_dtype` and `--train.reduce_dtype` (and `--train.dtype=auto`: bf16 compute
    on GPUs, fp32 on CPU; bf16 weights compute in bf16 on either)."""
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
    if reduce_dtype not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}; valid: {', '.join(REDUCE_DTYPES)}")
    gpu = backend != "gloo"
    if param_dtype == "bf16" or (param_dtype == "auto" and gpu):
        pol = BF16_TRAINER_PRECISION
    else:
        pol = GPU_TRAINER_PRECISION if gpu else FP32_TRAINER_PRECISION
    if reduce_dtype == "bf16":
        pol = dataclasses.replace(pol, grad_comm_bytes=2)
    return pol


# Megatron-Core with --bf16 and its distributed optimizer (docs.nvidia.com/megatron-core,
# developer guide, "Distributed Optimizer": "bf16 parameters, fp32 gradients: 18 bytes per
# parameter, 6 + 12/d distributed"; "we always use fp32 main parameters for optimizer
# steps"): bf16 weights (2), fp32 main gradients (4, reduce-scattered in fp32), fp32 main
# parameters (4) and two moments (8) sharded over DP (our ZeRO-1), updated bf16 weights
# all-gathered (2); activations, all-to-all and pipeline hops in bf16.
MEGATRON_PRECISION = PrecisionPolicy(weight_bytes=2, grad_bytes=4, master_bytes=4,
                                     optimizer_bytes=8, activation_bytes=2, grad_comm_bytes=4,
                                     param_comm_bytes=2, name="megatron")
PRECISION_POLICIES = ("trainer", "published", "megatron")


def precision_policy(name: str, backend: str = "nccl", param_dtype: str = "auto",
                     reduce_dtype: str = "fp32") -> PrecisionPolicy:
    """The named policy: "trainer" (what train.py runs on this backend with these
    --train.param_dtype / --train.reduce_dtype: `trainer_precision`; by default fp32 on
    gloo/CPU, bf16 weights with fp32 masters on GPUs), "published" (16 B per parameter, the
    paper's model) or "megatron" (Megatron-Core's bf16 + distributed optimizer). The dtypes
    apply to "trainer" only: other values with another policy are refused."""
    if name == "trainer":
        return trainer_precision(backend, param_dtype, reduce_dtype)
    if (param_dtype, reduce_dtype) != ("auto", "fp32") and name in PRECISION_POLICIES:
        raise ValueError(f"param_dtype={param_dtype!r} / reduce_dtype={reduce_dtype!r} set the "
                         f"'trainer' policy's dtypes; the {name!r} policy fixes its own "
                         f"(use precision policy 'trainer', or leave them at auto / fp32)")
    if name == "published":
        return PUBLISHED_PRECISION
    if name == "megatron":
        return MEGATRON_PRECISION
    raise ValueError(f"precision policy {name!r}; valid: {', '.join(PRECISION_POLICIES)}")


# The activation traffic passes a CPU platform is priced with (`Assumptions.
# activation_traffic_passes`: each saved activation written and read, its gradient written and
# read); `tuner measure` states the platform's elementwise rate in bytes of these passes
# (`Platform.elementwise_bandwidth`), so both sides take this one constant.
CPU_TRAFFIC_PASSES = 4.0


@dataclass(frozen=True)
class Assumptions:
    """Modelling choices; each default is stated with its reason.

    flash_attention: the model calls scaled_dot_product_attention, whose fused kernels do not
        keep the s x s score matrix; False keeps 2 elements per score (the published 4bHs^2).
    alltoall_overlap, p2p_overlap, dp_overlap: share of that communication hidden behind
        compute. 0 by default: the trainer issues them between compute steps.
    routing_imbalance: tokens of the busiest EP rank / mean. 1.0 = balanced (the published
        lower bound); migration keeps it near 1 in practice.
    vendor_alltoall_efficiency: share of the link rates the vendor all-to-all reaches
        (unknown; HALO's published 1.2-9x gains say it can be well below 1 at scale).
    grad_bucket_bytes: DDP's default 25 MiB gradient bucket, held once per rank (also the
        bucket a ZeRO reduce-scatter fills as the backward produces gradients).
    zero2_grad_sync: with ZeRO-2 and M > 1 micro-batches, when gradients are reduce-scattered.
        "last" (default): micro-batches accumulate into full-size gradients and one
        reduce-scatter follows the last (the trainer's gradient accumulation: no
        synchronisation until the last micro-batch), so full gradients are held while
        micro-batches are in flight and ZeRO-2 saves gradient memory only with M = 1.
        "each": a reduce-scatter after every micro-batch into the gradient shard (DeepSpeed
        ZeRO-2's way): gradients stay sharded, the reduce-scatter is paid M times.
    zero_sharding: how ZeRO splits a replica group's state. "flat" (default): even shards
        of the flattened state (1/group of every part; Megatron's distributed optimizer,
        DeepSpeed, FSDP2), gradients reduce-scattered, updated weights all-gathered.
        "per-parameter": each parameter whole on one owner, assigned greedily by size to the
        least-loaded rank (this project's trainer, trainer/distributed/zero.py, like torch's
        ZeroRedundancyOptimizer): a rank holds its greedy load, at least the largest tensor
        (DeepSeek-V3's 0.93 B-parameter embedding sits whole on one rank); ZeRO-1 all-reduces
        the gradients, ZeRO-2 reduces each bucket to its owner (timed as a reduce-scatter),
        and owners broadcast the updated weights (timed as an all-gather: each rank receives
        what it does not own). The memory taken per stage is the sum of the dense and the
        expert group's largest loads (an upper bound: they may fall on different ranks).
    replicas_per_expert: how many replicas c a replicated expert has when the replica sum
        is priced (redundant expert slots; trainer/distributed/replicas.py swaps partial gradients between
        an expert's holders, (c - 1) rows per replica slot, so each EP rank sends r x c rows
        per MoE layer). 2 (pairs): the common case of one redundant slot per hot expert; a
        placement that gives one expert many replicas moves more.
    exchange_imbalance: the all-to-all's rows on the link that bounds it, the busiest
        node's inter-node rows / the mean node's (the trainer's `ep_node_imbalance`): a NIC
        carries its node's rows, so across nodes the exchange waits for the busiest node, not
        the busiest rank. None (default): `routing_imbalance`.
    activation_set: "published" (the per-layer tensors of the published formulas, see
        `tuner.counts`) or "trainer" (what our eager fp32 model really saves, incl. norms,
        router and permutation indices; with it the last stage keeps final norm, lm_head
        input and log-softmax (3D + 1 + V per token) and the first the token ids, for every
        micro-batch in flight). Validated against measured runs by
        benchmarks/bench_tuner_validate.py.
    activation_traffic_passes: memory-bound time outside the GEMMs, as passes over the saved
        activations at the platform's memory bandwidth, per micro-batch. An eager, unfused
        step writes each saved activation in the forward and reads it in the backward, and
        writes and reads its gradient: 4 passes (what the CPU trainer is predicted with).
        0 by default: on GPUs these elementwise kernels are fused or hidden, and the
        published formulas count FLOPs only.
    alltoall_model: "closed-form" (`tuner.comms.alltoall_time`, instant) or "netsim" (the
        flow-level `comm.netsim`, ~10-300 ms per distinct exchange, cached; it also sees the
        Frontier Infinity Fabric layout, where small in-node groups beat the 8-GCD average).
    a2a_chunks: with `ParallelPlan.a2a_overlap = "layer"`, the chunks c a MoE layer's rows
        are split into (issue 26: chunk i+1's dispatch, chunk i's expert GEMMs and chunk
        i-1's combine in flight together). 0 (default): the c of 1, 2, 4, 8 that the model
        prices fastest, as `--comm.a2a_chunks=auto` would choose it.
    zero3_prefetch: ZeRO-3 layers gathered ahead of the one computing (FSDP's default
        prefetches one): the memory of 1 + this many gathered layers is held.
    zero3_gather: when ZeRO-3 gathers weights and reduce-scatters gradients. "microbatch"
        (default, this trainer): every micro-batch gathers each layer in its forward and its
        backward and reduce-scatters its gradients (one layer gathered at a time).
        "step": once per step per pipeline stage, as FSDP2 under torch.distributed.pipelining
        runs it (torch 2.13 `stage.py`: every backward sets `set_reshard_after_backward(False)`
        and `set_requires_gradient_sync(False)`; the schedule's REDUCE_GRAD after the last
        micro-batch reduce-scatters): the first forward gathers the stage, which stays
        gathered with its whole unsharded gradient until the step's one reduce-scatter.
        For published FSDP2 + pipeline runs (NeMo AutoModel, torchtitan).
    zero3_runs: with zero3_gather="step", the pipeline-schedule runs per optimizer step
        (gradient accumulation over whole schedule runs: each run ends with its REDUCE_GRAD,
        which reshards, so every run gathers and reduce-scatters once). 1 by default; a
        published table's GA column where it accumulates over schedule runs.
    fp8_peak_factor: FP8 GEMM peak / bf16 peak, used for `precision="fp8"` on a platform
        whose file states no FP8 rate. None (default): such a platform refuses fp8. The
        dense FP8 peak of H100/H200 SXM is 2x their bf16 peak (NVIDIA's H100 datasheet:
        1979 vs 989 TFLOPS dense), so 2.0 is the stated parameter for them.
    fp8_cast_bytes: with `precision="fp8"`, HBM bytes moved per element cast to FP8: every
        FP8 GEMM's input (forward) and output gradient (backward) is quantized by a kernel of
        its own that reads it in bf16 (2 B) and writes it in FP8 twice, row- and
        column-wise (1 + 1 B: the forward's and the weight gradient's operand orientations),
        as Transformer Engine's cast-transpose does; weights are cast once per step (their
        FP8 copy kept across micro-batches) and not priced. Default 4.0 (those dtypes'
        sizes); 0 leaves casts out (fused into the neighbouring kernels).
    overlap_compute_share: share of the device's compute the all-to-all kernels take while
        they run beside compute (`a2a_overlap` "layer" or "fb"): an overlapped exchange of A
        seconds against compute X exposes max(A - X, share x A), the compute running on
        what the communication kernels leave. Default 20 / 132: DeepSeek-V3's overlap
        (DualPipe, its all-to-all kernels) holds 20 of the H800's 132 SMs for communication
        (DeepSeek-V3 technical report, arXiv:2412.19437, section 3.2.2). 0: overlap is free.
    host_floor: seconds below which one MoE layer's forward + backward of one micro-batch
        does not run on a rank, whatever its device time: the host's time to issue the
        layer's kernels when it cannot run ahead of the device. Dropless MoE in an eager
        framework syncs the host on every dispatch (the per-expert token counts size the
        grouped GEMM and the receive buffers), so the device waits for the host to launch the
        rest of the layer; the layer then takes max(device time, host time). 0 (default):
        not priced (the host always runs ahead). Framework and host CPU specific, not a
        property of the GPU: `--host-floor-ms`; the published-runs benchmark gives it to the
        Megatron-Core rows from a measured Megatron-Bridge run (docs/reference.md section 5,
        "host floor"). Dense layers and the lm_head are not floored.
    host_floor_scope: what the floor bounds. "layer" (default): the layer's forward +
        backward together, max(device, floor). "forward": only the passes that dispatch with
        a host sync, i.e. the forward and, under full or MoE recompute, the recomputed
        forward; the backward reuses the forward's splits, so the host runs ahead of it and
        it takes its device time: max(forward device, floor) + backward device (+ the same
        max for the recompute). Each pass's device share is the layer's device time split
        as its compute is (forward f, backward 2f, recompute rc of 3f + rc).
    fb_pairing: how a2a_overlap fb's paired forward and backward (two micro-batches) hold
        activations. "trainer" (default): this trainer's paired schedule
        (`pipeline.schedule.build_fb`), a pair's whole forward alive beside its backward:
        `fb_inflight` micro-batches. "layer": Megatron-Core's combined 1F1B
        (--overlap-moe-expert-parallel-comm), which interleaves the pair layer by layer, the
        forward of one layer beside the backward of another layer of the other micro-batch,
        so the backward frees a layer as the forward allocates one: the plain schedule's
        in-flight micro-batches plus one layer's activations (`--fb-pairing`; the published
        runs' Megatron-Core rows).
    mtp_layers: multi-token-prediction modules (DeepSeek-V3's MTP) the run trains, priced in
        the step time only: each is one more decoder layer of the last layer's kind (with its
        all-to-all, collectives and host floor) and one more pass of the shared output layer,
        on the last virtual stage (where Megatron-Core puts them). Not in the memory model;
        its norms and 2D -> D projection are left out. This trainer builds none: 0 (default).
    shared_cores: on a platform whose processes share the node's cores (`Platform.
        shares_cores`: a CPU platform from `tuner measure`, more processes x threads than
        cores), replay the pipeline schedule with processor sharing (`tuner.sharing`: a rank
        waiting on its neighbour gives its core share to the busy ones) instead of pricing
        the bubble as idle dedicated devices. No effect elsewhere (every GPU file). True by
        default; False prices the bubble as on dedicated devices (re-predicting the recorded
        runs of this project's 2-core machine: 16 of 17 rows within 15 % against 14 of 17,
        docs/planner.md, the local validation).
    """

    flash_attention: bool = True
    alltoall_overlap: float = 0.0
    p2p_overlap: float = 0.0
    dp_overlap: float = 0.0
    routing_imbalance: float = 1.0
    exchange_imbalance: float | None = None
    vendor_alltoall_efficiency: float = 1.0
    grad_bucket_bytes: int = 25 * 2**20
    attention: str = "sharded"  # "sharded" (EP ranks see different tokens) | "replicated"
    alltoall_model: str = "closed-form"
    activation_set: str = "published"
    activation_traffic_passes: float = 0.0
    zero2_grad_sync: str = "last"
    zero_sharding: str = "flat"
    replicas_per_expert: int = 2
    a2a_chunks: int = 0
    zero3_prefetch: int = 1
    zero3_gather: str = "microbatch"
    zero3_runs: int = 1
    fp8_peak_factor: float | None = None
    fp8_cast_bytes: float = 4.0
    overlap_compute_share: float = 20 / 132
    shared_cores: bool = True
    host_floor: float = 0.0
    host_floor_scope: str = "layer"
    fb_pairing: str = "trainer"
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int) \
                or self.mtp_layers < 0:
            raise ValueError(f"mtp_layers={self.mtp_layers!r} must be an int >= 0 (multi-token-"
                             f"prediction modules priced on the last stage; 0: none)")
        if self.fb_pairing not in FB_PAIRINGS:
            raise ValueError(f"fb_pairing={self.fb_pairing!r}; valid: {', '.join(FB_PAIRINGS)}")
        if self.host_floor_scope not in HOST_FLOOR_SCOPES:
            raise ValueError(f"host_floor_scope={self.host_floor_scope!r}; valid: "
                             f"{', '.join(HOST_FLOOR_SCOPES)}")
        if isinstance(self.host_floor, bool) or not isinstance(self.host_floor, int | float) \
                or not 0.0 <= self.host_floor < float("inf"):
            raise ValueError(f"host_floor={self.host_floor!r} must be a number of seconds >= 0 "
                             f"(0: not priced)")
        if not isinstance(self.shared_cores, bool):
            raise ValueError(f"shared_cores={self.shared_cores!r} must be True or False")
        if not 0.0 <= self.overlap_compute_share < 1.0:
            raise ValueError(f"overlap_compute_share={self.overlap_compute_share} must be in "
                             f"[0, 1)")
        if isinstance(self.a2a_chunks, bool) or self.a2a_chunks < 0:
            raise ValueError(f"a2a_chunks={self.a2a_chunks!r} must be an int >= 1, or 0 (auto)")
        if self.zero3_gather not in ZERO3_GATHER:
            raise ValueError(f"zero3_gather={self.zero3_gather!r}; valid: "
                             f"{', '.join(ZERO3_GATHER)}")
        if isinstance(self.zero3_runs, bool) or not isinstance(self.zero3_runs, int) \
                or self.zero3_runs < 1:
            raise ValueError(f"zero3_runs={self.zero3_runs!r} must be an int >= 1 (schedule "
                             f"runs per step)")
        if self.zero3_prefetch < 0:
            raise ValueError(f"zero3_prefetch={self.zero3_prefetch} must be >= 0 layers")
        if not self.fp8_cast_bytes >= 0:
            raise ValueError(f"fp8_cast_bytes={self.fp8_cast_bytes} must be >= 0 (bytes per "
                             f"element cast; 0 leaves FP8 casts out)")
        if self.fp8_peak_factor is not None and not self.fp8_peak_factor > 0:
            raise ValueError(f"fp8_peak_factor={self.fp8_peak_factor} must be > 0 (or None)")
        for f in ("alltoall_overlap", "p2p_overlap", "dp_overlap"):
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{f}={v} must be in [0, 1]")
        if self.exchange_imbalance is not None and not self.exchange_imbalance >= 1.0:
            raise ValueError(f"exchange_imbalance={self.exchange_imbalance} must be >= 1 "
                             f"(busiest node's inter-node rows / mean) or None")
        if self.routing_imbalance < 1.0:
            raise ValueError(f"routing_imbalance={self.routing_imbalance} must be >= 1 (max / mean)")
        if not 0.0 < self.vendor_alltoall_efficiency <= 1.0:
            raise ValueError(f"vendor_alltoall_efficiency={self.vendor_alltoall_efficiency} must be in (0, 1]")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention={self.attention!r}; valid: {', '.join(ATTENTION_MODES)}")
        if self.alltoall_model not in ("closed-form", "netsim"):
            raise ValueError(f"alltoall_model={self.alltoall_model!r}; valid: closed-form, netsim")
        if self.activation_traffic_passes < 0:
            raise ValueError(f"activation_traffic_passes={self.activation_traffic_passes} must be >= 0")
        if self.activation_set not in ("published", "trainer"):
            raise ValueError(f"activation_set={self.activation_set!r}; valid: published, trainer")
        if self.grad_bucket_bytes < 0:
            raise ValueError(f"grad_bucket_bytes={self.grad_bucket_bytes} must be >= 0")
        if self.replicas_per_expert < 2:
            raise ValueError(f"replicas_per_expert={self.replicas_per_expert} must be >= 2 "
                             f"(a replicated expert has at least two copies)")
        if self.zero_sharding not in ZERO_SHARDING:
            raise ValueError(f"zero_sharding={self.zero_sharding!r}; valid: "
                             f"{', '.join(ZERO_SHARDING)}")
        if self.zero2_grad_sync not in ZERO2_GRAD_SYNC:
            raise ValueError(f"zero2_grad_sync={self.zero2_grad_sync!r}; valid: "
                             f"{', '.join(ZERO2_GRAD_SYNC)}")


DEFAULT_ASSUMPTIONS = Assumptions()


@dataclass(frozen=True)
class ParallelPlan:
    """One layout: degrees, schedule, micro-batching and communication choices."""

    pp: int
    ep: int
    dp: int
    microbatches: int
    global_batch: int
    seq_len: int
    schedule: str = "1f1b"
    n_virtual: int = 1
    alltoall: str = "flat"
    checkpointing: str = "none"
    ep_placement: str = "local"
    zero: int = 0
    redundant: int = 0  # extra expert slots per MoE layer on every EP rank (r)
    tp: int = 1  # tensor parallel (with sequence parallel) of attention and dense weights
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention)
    etp: int = 1  # expert tensor parallel: each expert's F dimension split over etp ranks
    a2a_overlap: str = "none"  # none | layer | fb | auto (A2A_OVERLAP; `estimate` resolves auto)
    precision: str = "bf16"  # GEMM precision: bf16 | fp8 (PRECISIONS)

    def __post_init__(self) -> None:
        check_zero_levels(self.zero)
        r = self.redundant
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"redundant={r!r}: redundant expert slots per EP rank must be an "
                             f"int >= 0 (0 = one slot per expert)")
        if r and self.ep == 1:
            raise ValueError(f"redundant={r} needs ep > 1: with one EP rank every expert is "
                             f"already on it; valid with ep=1: 0")
        for f in ("pp", "ep", "dp", "microbatches", "global_batch", "seq_len", "n_virtual",
                  "tp", "cp", "etp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be an int >= 1")
        for f, valid in (("schedule", SCHEDULES), ("alltoall", ALLTOALL_ALGORITHMS),
                         ("checkpointing", RECOMPUTE_MODES), ("ep_placement", EP_PLACEMENTS),
                         ("a2a_overlap", A2A_OVERLAP), ("precision", PRECISIONS)):
            if getattr(self, f) not in valid:
                raise ValueError(f"{f}={getattr(self, f)!r}; valid: {', '.join(valid)}")
        if self.stage_size % (self.tp * self.cp):
            raise ValueError(
                f"tp={self.tp} x cp={self.cp} does not divide the {self.stage_size} ranks of a "
                f"stage (edp={self.dp} x ep={self.ep} x etp={self.etp}): parallel folding puts "
                f"both sides of a stage on the same ranks (fold_degrees)")
        if self.schedule == "interleaved-1f1b":
            if self.n_virtual < 2:
                raise ValueError(f"interleaved-1f1b needs n_virtual >= 2, got {self.n_virtual}")
            if self.microbatches % self.pp:
                raise ValueError(
                    f"interleaved-1f1b needs microbatches divisible by pp: microbatches="
                    f"{self.microbatches}, pp={self.pp}; valid: multiples of {self.pp}"
                )
        elif self.n_virtual != 1:
            raise ValueError(f"n_virtual={self.n_virtual} only applies to interleaved-1f1b; use 1")
        # whole sequences per micro-batch: of each EP group (the trainer's mesh), or with TP,
        # CP or ETP of each dense-side data-parallel rank (`tuner.estimate` checks the latter
        # for every plan with sharded attention)
        dp = self.dp if self.tp == self.cp == self.etp == 1 else self.attn_dp
        if self.global_batch % (dp * self.microbatches):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp={dp} x "
                f"microbatches={self.microbatches} = {dp * self.microbatches}"
            )

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: EDP x EP x ETP on the expert side, = DP x TP x CP on
        the dense side (parallel folding, `fold_degrees`)."""
        return self.dp * self.ep * self.etp

    @property
    def attn_dp(self) -> int:
        """Data-parallel degree of the dense side (attention, norms, dense FFN): the stage's
        ranks / (TP x CP). With tp = cp = etp = 1 this is DP x EP, the trainer's stage group."""
        return self.stage_size // (self.tp * self.cp)

    @property
    def n_gpus(self) -> int:
        return self.pp * self.stage_size

    def replica_groups(self, attention: str = "sharded") -> tuple[int, int]:
        """Ranks holding a copy of (a non-expert parameter, an expert parameter): the groups
        ZeRO shards over and gradients are reduced over. Non-expert parameters are replicated
        over the stage's ranks with the same TP index (DP x CP of the dense side; DP x EP of
        the trainer when tp = cp = etp = 1) when EP ranks see different tokens ("sharded"
        attention, as trained), over DP when they compute the same ("replicated"); experts over
        the expert data-parallel group (`dp`)."""
        return (self.attn_dp * self.cp if attention == "sharded" else self.dp), self.dp

    @property
    def group_sequences(self) -> float:
        """Sequences in one micro-batch of one EP group."""
        return self.global_batch / (self.dp * self.microbatches)

    def attention_tokens(self, attention: str = "sharded") -> float:
        """Tokens whose dense-side work (attention, norms, dense FFN) one rank does per
        micro-batch. "sharded": b s / (M x stage ranks): DP and CP split the tokens, TP (with
        sequence parallel) splits the work of the TP group's tokens tp ways, which costs one
        rank what 1/tp of those tokens would. "replicated" (published, tp = cp = etp = 1):
        every EP rank runs attention on its EP group's tokens."""
        if attention == "sharded":
            return self.global_batch * self.seq_len / (self.microbatches * self.stage_size)
        return self.group_sequences * self.seq_len

    @property
    def expert_tokens(self) -> float:
        """Tokens one rank routes per micro-batch (balanced routing: also the tokens whose k
        routed copies land on it, before x k): b s / (M x stage ranks)."""
        return self.global_batch * self.seq_len / (self.microbatches * self.stage_size)

    def replace(self, **changes: Any) -> ParallelPlan:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_stage_layers(n_layers: int, plan: ParallelPlan) -> list[list[int]]:
    """Layers of each pipeline stage s = 0..pp*v-1 (stage s on rank s % pp): the trainer's
    split (`trainer.layout.stage_layers`), the one the estimate prices."""
    from trainer.layout import stage_layers

    return stage_layers(n_layers, plan.pp, plan.n_virtual)


def trainer_layout(plan: ParallelPlan):  # noqa: ANN201 - trainer.layout.Layout
    """The plan's rank layout in the one layout model (`trainer.layout.Layout`: the same
    parallel folding, `ParallelPlan.dp` its expert-side dp)."""
    from trainer.layout import Layout

    return Layout(plan.n_gpus, pp=plan.pp, dp=plan.dp, ep=plan.ep, tp=plan.tp, cp=plan.cp,
                  etp=plan.etp, vpp=plan.n_virtual, placement=plan.ep_placement)


def not_runnable(plan: ParallelPlan) -> list[str]:
    """What train.py lacks to run `plan` ([] when it runs it): `trainer.layout`'s
    `not_runnable_because` of the plan's layout and choices, and with a2a_overlap fb its
    `fb_problems` (micro-batches, schedule, recompute)."""
    from trainer.layout import fb_problems, not_runnable_because

    out = not_runnable_because(trainer_layout(plan), zero=plan.zero, alltoall=plan.alltoall,
                               a2a_overlap=plan.a2a_overlap, recompute=plan.checkpointing,
                               precision=plan.precision)
    if plan.a2a_overlap == "fb":
        out += [f"a2a_overlap fb with {p}" for p in fb_problems(
            plan.microbatches, plan.pp, plan.schedule, plan.checkpointing)]
    return out

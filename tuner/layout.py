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
    EP_PLACEMENTS,
    SCHEDULES,
    TRAINER_ALLTOALL,
    TRAINER_ZERO_LEVELS,
)

__all__ = [
    "ALLTOALL_ALGORITHMS",
    "Assumptions",
    "DEFAULT_ASSUMPTIONS",
    "FP32_TRAINER_PRECISION",
    "PUBLISHED_PRECISION",
    "CHECKPOINTING",
    "EP_PLACEMENTS",
    "ParallelPlan",
    "PrecisionPolicy",
    "SCHEDULES",
    "ZERO_LEVELS",
    "check_zero_levels",
]

# What the planner prices so far (issue 33 item 3 widens both to trainer.layout's full
# ALLTOALL_ALGORITHMS and ZERO_LEVELS): the trainer's all-to-alls but "auto" (which picks flat
# or HALO at run time; the search compares the two itself) and the trainer's ZeRO levels.
ALLTOALL_ALGORITHMS = tuple(a for a in TRAINER_ALLTOALL if a != "auto")
ATTENTION_MODES = ("sharded", "replicated")
ZERO_LEVELS = TRAINER_ZERO_LEVELS  # trainer --parallel.zero: replicated, ZeRO-1, ZeRO-2
ZERO2_GRAD_SYNC = ("last", "each")
ZERO_SHARDING = ("flat", "per-parameter")


def check_zero_levels(levels: object, what: str = "zero") -> tuple[int, ...]:
    """`levels` (one ZeRO level or several) as a tuple, or a ValueError naming the bad value."""
    seq = levels if isinstance(levels, (tuple, list)) else (levels,)
    if not seq:
        raise ValueError(f"{what}: no ZeRO level given; valid: 0, 1, 2")
    for z in seq:
        if isinstance(z, bool) or z not in ZERO_LEVELS:
            raise ValueError(f"{what}={z!r}: the ZeRO level must be 0 (replicated state), 1 "
                             f"(optimizer state sharded) or 2 (optimizer state and gradients "
                             f"sharded)")
    return tuple(seq)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Bytes per parameter of each training-state part, and bytes per activation element."""

    weight_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4  # fp32 master weights (0 when training in fp32 without a copy)
    optimizer_bytes: int = 8  # Adam: two fp32 moments
    activation_bytes: int = 2

    @property
    def state_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.master_bytes + self.optimizer_bytes


PUBLISHED_PRECISION = PrecisionPolicy()
# What train.py holds on CPU (`--train.dtype=auto` -> fp32, torch.optim.AdamW): fp32 weights
# and gradients, no separate master copy, two fp32 moments (exp_avg, exp_avg_sq; the step
# counter is a 0-dim tensor, 4 bytes per parameter tensor, below 0.01 %), fp32 activations.
FP32_TRAINER_PRECISION = PrecisionPolicy(weight_bytes=4, grad_bytes=4, master_bytes=0,
                                         optimizer_bytes=8, activation_bytes=4)


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
        least-loaded rank (this project's trainer, trainer/zero.py, like torch's
        ZeroRedundancyOptimizer): a rank holds its greedy load, at least the largest tensor
        (DeepSeek-V3's 0.93 B-parameter embedding sits whole on one rank); ZeRO-1 all-reduces
        the gradients, ZeRO-2 reduces each bucket to its owner (timed as a reduce-scatter),
        and owners broadcast the updated weights (timed as an all-gather: each rank receives
        what it does not own). The memory taken per stage is the sum of the dense and the
        expert group's largest loads (an upper bound: they may fall on different ranks).
    replicas_per_expert: how many replicas c a replicated expert has when the replica sum
        is priced (redundant expert slots; trainer/replicas.py swaps partial gradients between
        an expert's holders, (c - 1) rows per replica slot, so each EP rank sends r x c rows
        per MoE layer). 2 (pairs): the common case of one redundant slot per hot expert; a
        placement that gives one expert many replicas moves more.
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
    """

    flash_attention: bool = True
    alltoall_overlap: float = 0.0
    p2p_overlap: float = 0.0
    dp_overlap: float = 0.0
    routing_imbalance: float = 1.0
    vendor_alltoall_efficiency: float = 1.0
    grad_bucket_bytes: int = 25 * 2**20
    attention: str = "sharded"  # "sharded" (EP ranks see different tokens) | "replicated"
    alltoall_model: str = "closed-form"
    activation_set: str = "published"
    activation_traffic_passes: float = 0.0
    zero2_grad_sync: str = "last"
    zero_sharding: str = "flat"
    replicas_per_expert: int = 2

    def __post_init__(self) -> None:
        for f in ("alltoall_overlap", "p2p_overlap", "dp_overlap"):
            v = getattr(self, f)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{f}={v} must be in [0, 1]")
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

    def __post_init__(self) -> None:
        check_zero_levels(self.zero)
        r = self.redundant
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"redundant={r!r}: redundant expert slots per EP rank must be an "
                             f"int >= 0 (0 = one slot per expert)")
        if r and self.ep == 1:
            raise ValueError(f"redundant={r} needs ep > 1: with one EP rank every expert is "
                             f"already on it; valid with ep=1: 0")
        for f in ("pp", "ep", "dp", "microbatches", "global_batch", "seq_len", "n_virtual"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}={v!r} must be an int >= 1")
        for f, valid in (("schedule", SCHEDULES), ("alltoall", ALLTOALL_ALGORITHMS),
                         ("checkpointing", CHECKPOINTING), ("ep_placement", EP_PLACEMENTS)):
            if getattr(self, f) not in valid:
                raise ValueError(f"{f}={getattr(self, f)!r}; valid: {', '.join(valid)}")
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
        if self.global_batch % (self.dp * self.microbatches):
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by dp={self.dp} x "
                f"microbatches={self.microbatches} = {self.dp * self.microbatches}"
            )

    @property
    def n_gpus(self) -> int:
        return self.pp * self.dp * self.ep

    def replica_groups(self, attention: str = "sharded") -> tuple[int, int]:
        """Ranks holding a copy of (a non-expert parameter, an expert parameter): the groups
        ZeRO shards over and gradients are reduced over. Non-expert parameters are replicated
        over DP x EP of a stage when EP ranks see different tokens ("sharded" attention, as
        trained), over DP when they compute the same ("replicated"); experts over DP."""
        return (self.dp * self.ep if attention == "sharded" else self.dp), self.dp

    @property
    def group_sequences(self) -> float:
        """Sequences in one micro-batch of one EP group."""
        return self.global_batch / (self.dp * self.microbatches)

    def attention_tokens(self, attention: str = "sharded") -> float:
        """Tokens each rank runs attention (and other replicated layers) on per micro-batch."""
        per_group = self.group_sequences * self.seq_len
        return per_group / self.ep if attention == "sharded" else per_group

    @property
    def expert_tokens(self) -> float:
        """Tokens whose routed copies land on one rank per micro-batch (balanced), before x k."""
        return self.group_sequences * self.seq_len / self.ep

    def replace(self, **changes: Any) -> ParallelPlan:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

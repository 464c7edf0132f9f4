"""The planner's search space, its constraints, and exhaustive enumeration.

A point is a dict of categorical choices: pp, ep, mbs (sequences per rank per micro-batch),
schedule ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b:v"), alltoall, checkpointing,
placement, zero (0, 1, 2: `ParallelPlan.zero`), a2a_overlap (none, layer, fb:
`ParallelPlan.a2a_overlap`, the trainer's --comm.a2a_overlap). DP and the micro-batch count
follow: DP = N / (PP * EP), M = b / (DP * EP * mbs).

The overlap modes and their chunks (`OVERLAP_CHOICES`, `overlap_chunks`): none; layer with 2
chunks; fb with 2 chunks (the layer pipeline inside each micro-batch, paired across them).
2 is what the trainer's --comm.a2a_overlap=auto runs with either mode
(`trainer.layout.AUTO_OVERLAP_CHUNKS`), and the measured best on the emulator: fb / 2 beat
fb / 1 and fb / 4, layer / 4 did not beat layer / 2 (docs/alltoall.md, "Measured: overlap on
the emulator"). One chunk count per mode, not a dimension of its own: the model weighs c
chunks' hidden share of the expert GEMMs ((c - 1) / c) against the latencies each chunk pays
again (`tuner.costs.a2a_exposed`), not the host work each chunk costs, so where it would pick
4 or 8 the runs measured (layer / 4, fb / 4 slower than / 2) do not back it. The plan file states the chunks (`comm.a2a_chunks`): with an explicit fb the
trainer's own `a2a_chunks=auto` would run 1 chunk, not the 2 priced. "auto" is not a point of
its own: it runs none, layer or fb, which the search compares (as for the all-to-all).

Constraints, checked before anything is evaluated. The layout's own feasibility is the one
layout model's (`trainer.layout.layout_problems`: the rules train.py checks, so no plan is
refused by one and accepted by the other):
    PP * EP divides N            EP divides E            PP * v <= L
    DP * EP data shards and the micro-batches divide b   interleaving needs M % PP == 0
    r redundant expert slots (fixed per request, not searched) need EP > 1 and
    r <= E - E / EP (a replica sits beside experts its rank does not hold): EP degrees that
    cannot host r are left out of the choices
then the planner's own (Piper's, docs/reference.md 1.5, and pruning of points that are the
same run):
    EP <= gpus_per_node * nodes_per_domain               DP * EP * mbs divides b
    an EP group's nodes (`Layout.node_span`, placement-dependent) <= nodes_per_domain
    PP = 1 runs 1f1b only (gradient accumulation)        peak memory <= usable HBM
    ZeRO > 0 needs a replica group of > 1 rank (DP x EP > 1; with DP = 1 only the
    non-expert state shards, over EP)
    EP = 1 has no exchange: a2a_overlap none only (layer and fb run as none there)
    a2a_overlap fb: the trainer's refusals, `trainer.layout.fb_problems` (M >= 2, with
    PP > 1 a schedule it pairs: 1f1b, interleaved-1f1b; no full recompute), the one list
    train.py and its auto obey; layer has no rule of its own beyond EP > 1. The pipelined
    expert path under TP (`trainer.layout.pipelined_expert_path`) is `not_runnable`'s: TP is
    not a dimension of this space.
The memory constraint needs the memory model but not the time model: it is checked by
`tuner.estimate.stage_memory` alone (with a2a_overlap fb, the paired schedule's in-flight
micro-batches, `tuner.estimate.fb_inflight`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from model import ModelConfig
from trainer.layout import (
    AUTO_OVERLAP_CHUNKS,
    Layout,
    LayoutError,
    divisors,
    fb_problems,
    layout_problems,
)
from trainer.layout import check_redundant as layout_check_redundant
from tuner.layout import (
    A2A_OVERLAP,
    ALLTOALL_ALGORITHMS,
    CHECKPOINTING,
    EP_PLACEMENTS,
    ZERO_LEVELS,
    ParallelPlan,
    check_zero_levels,
)
from tuner.platform import Platform

__all__ = ["SearchSpace", "Point", "divisors", "check_gpu_count", "check_redundant",
           "OVERLAP_CHOICES", "check_overlap_modes", "overlap_chunks"]

Point = dict[str, Any]
SCHEDULE_CHOICES = ("1f1b", "gpipe", "zb-h1", "interleaved-1f1b:2", "interleaved-1f1b:4")
# the trainer's overlap modes (A2A_OVERLAP) less auto, leanest first (fb holds more
# activations); each runs with `overlap_chunks` chunks
OVERLAP_CHOICES = tuple(m for m in A2A_OVERLAP if m != "auto")
_OVERLAP_MEANING = {"none": "every exchange exposed",
                    "layer": f"chunked inside the MoE layer, {AUTO_OVERLAP_CHUNKS} chunks",
                    "fb": f"across micro-batches, {AUTO_OVERLAP_CHUNKS} chunks"}


def overlap_chunks(mode: str) -> int:
    """The chunks of the layer pipeline a plan with a2a_overlap `mode` is priced and run with:
    `trainer.layout.AUTO_OVERLAP_CHUNKS` (2) for layer and fb, 0 (none: no pipeline) else
    (module docstring)."""
    return AUTO_OVERLAP_CHUNKS if mode in ("layer", "fb") else 0


def check_overlap_modes(modes: object, what: str = "a2a_overlap") -> tuple[str, ...]:
    """`modes` (one overlap mode or several) as a tuple, or a ValueError naming the bad value
    and the valid ones."""
    seq = modes if isinstance(modes, (tuple, list)) else (modes,)
    valid = ", ".join(f"{m} ({_OVERLAP_MEANING[m]})" for m in OVERLAP_CHOICES)
    if not seq:
        raise ValueError(f"{what}: no overlap mode given; valid: {valid}")
    for m in seq:
        if m == "auto":
            raise ValueError(f"{what}={m!r} is not searched: it runs none, layer or fb, which "
                             f"the search compares; valid: {valid}")
        if not isinstance(m, str) or m not in OVERLAP_CHOICES:
            raise ValueError(f"{what}={m!r}: the all-to-all overlap must be one of {valid}")
    return tuple(seq)


def _hosts(r: int, n_experts: int, ep: int) -> bool:
    """Whether an EP group of `ep` ranks can host r redundant slots per rank."""
    try:
        layout_check_redundant(r, n_experts, ep)
    except LayoutError:
        return False
    return True


def check_redundant(r: object, cfg: ModelConfig, eps: tuple[int, ...]) -> None:
    """Refuse a redundant-slot count no EP degree of `eps` can host, naming the valid range."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"--redundant {r!r}: redundant expert slots per EP rank must be an int "
                         f">= 0 (0 = one slot per expert)")
    if r == 0:
        return
    E = cfg.n_routed_experts
    top = max((E - E // d for d in eps if d > 1), default=0)
    if r > top:
        why = (f"{cfg.name} has no routed experts" if not E else
               "no EP degree > 1 fits these GPUs" if not top else
               f"an EP rank does not hold more than E - E/ep = {top} of {cfg.name}'s {E} experts "
               f"(ep={max(d for d in eps if E - E // d == top)})")
        raise ValueError(f"--redundant {r}: {why}; a redundant slot replicates one of them; "
                         f"valid: 0..{top}")


def check_gpu_count(n_gpus: int, platform: Platform) -> None:
    """A mesh fills whole nodes (or part of one node): anything else is refused clearly."""
    g = platform.gpus_per_node
    if n_gpus < 1:
        raise ValueError(f"--gpus {n_gpus}: need at least 1 GPU")
    if n_gpus > g and n_gpus % g:
        lo, hi = n_gpus // g * g, (n_gpus // g + 1) * g
        raise ValueError(
            f"--gpus {n_gpus} does not fill whole {platform.name} nodes of {g} GPUs; the mesh "
            f"needs a multiple of {g} above one node: use {lo} or {hi}"
        )


@dataclass(frozen=True)
class SearchSpace:
    """Categorical choices for one request (model, platform, N GPUs, batch, sequence)."""

    n_gpus: int
    global_batch: int
    seq_len: int
    n_layers: int
    n_experts: int
    max_ep: int
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    gpus_per_node: int = 8
    nodes_per_domain: int = 1
    redundant: int = 0  # ParallelPlan.redundant of every point (fixed, not a choice)

    @classmethod
    def default(cls, cfg: ModelConfig, platform: Platform, n_gpus: int, global_batch: int,
                seq_len: int, mbs: tuple[int, ...] = (1, 2, 4, 8),
                zero: tuple[int, ...] = ZERO_LEVELS, redundant: int = 0,
                a2a_overlap: tuple[str, ...] = OVERLAP_CHOICES) -> SearchSpace:
        """The full space; `zero` narrows the ZeRO levels searched (e.g. (0,) as published),
        `a2a_overlap` the overlap modes (e.g. ("none",): the plain exchange);
        `redundant` is every point's r (EP degrees that cannot host it are left out)."""
        check_gpu_count(n_gpus, platform)
        zero = tuple(sorted(set(check_zero_levels(zero))))
        overlap = tuple(m for m in OVERLAP_CHOICES if m in check_overlap_modes(a2a_overlap))
        E = max(cfg.n_routed_experts, 1)
        eps = tuple(d for d in divisors(n_gpus) if E % d == 0 and d <= platform.max_ep)
        check_redundant(redundant, cfg, eps)
        choices = {
            "pp": tuple(d for d in divisors(n_gpus) if d <= cfg.n_layers),
            "ep": tuple(d for d in eps if _hosts(redundant, cfg.n_routed_experts, d)),
            "mbs": tuple(mbs),
            "schedule": SCHEDULE_CHOICES,
            # "auto" is not a point of its own: it runs flat or HALO, which the search compares
            "alltoall": tuple(a for a in ALLTOALL_ALGORITHMS if a != "auto"),
            "checkpointing": CHECKPOINTING,
            "placement": EP_PLACEMENTS,
            "zero": zero,
            "a2a_overlap": overlap,
        }
        return cls(n_gpus, global_batch, seq_len, cfg.n_layers, E, platform.max_ep, choices,
                   platform.gpus_per_node, platform.nodes_per_domain, redundant)

    @property
    def size(self) -> int:
        n = 1
        for c in self.choices.values():
            n *= len(c)
        return n

    def points(self) -> Iterator[Point]:
        """Every combination, in a fixed order."""
        names = list(self.choices)
        for combo in itertools.product(*(self.choices[n] for n in names)):
            yield dict(zip(names, combo, strict=True))

    def layout(self, pt: Point) -> Layout:
        """The point's rank layout in the one layout model (`trainer.layout.Layout`); raises a
        LayoutError when pp x ep does not divide the GPUs."""
        _, _, v = pt["schedule"].partition(":")
        return Layout.infer(self.n_gpus, pp=pt["pp"], ep=pt["ep"], tp=pt.get("tp", 1),
                            cp=pt.get("cp", 1), etp=pt.get("etp", 1), vpp=int(v or 1),
                            placement=pt["placement"])

    def reject(self, pt: Point) -> str | None:
        """Why `pt` violates a constraint, or None if it satisfies them all: the layout's
        feasibility (`trainer.layout.layout_problems`, the rules train.py checks), then what
        only the planner asks (locality domains, redundant slots it can host, pruning of
        points that are the same run)."""
        pp, ep, mbs = pt["pp"], pt["ep"], pt["mbs"]
        name = pt["schedule"].partition(":")[0]
        try:
            lay = self.layout(pt)
        except LayoutError as e:
            return str(e)
        dp, shards = lay.dp, lay.n_data_shards * mbs
        m = self.global_batch // shards if self.global_batch % shards == 0 else None
        probs = layout_problems(lay, self.n_layers, self.n_experts, schedule=name,
                                microbatches=m, global_batch=self.global_batch,
                                redundant=self.redundant)
        if probs:
            return probs[0]
        if ep > self.max_ep:
            return f"ep={ep} exceeds one locality domain ({self.max_ep} GPUs)"
        if m is None:
            return (f"dp={dp} x ep={ep} x mbs={mbs} does not divide global batch "
                    f"{self.global_batch}")
        if pt["placement"] == "spread":
            nodes = lay.node_span("ep", self.gpus_per_node)[1]
            if nodes > self.nodes_per_domain:
                # One link joins two switches of a Dragonfly group: an EP group spread over
                # more than one switch's nodes congests it (comm.netsim: 9x slower at 8 nodes).
                return (f"spread ep={ep} spans {nodes} nodes, more than one locality domain "
                        f"({self.nodes_per_domain} nodes)")
        if pp == 1 and name != "1f1b":
            return "without a pipeline every schedule is 1f1b (gradient accumulation)"
        if ep == 1 and (pt["alltoall"] != "flat" or pt["placement"] != "local"):
            return "ep=1 has no all-to-all: only the flat/local variant is kept"
        overlap = pt.get("a2a_overlap", "none")
        if ep == 1 and overlap != "none":
            return f"ep=1 has no all-to-all to overlap: a2a_overlap {overlap} runs as none"
        if overlap == "fb":
            refused = fb_problems(m, pp, name, pt["checkpointing"])  # train.py's own rules
            if refused:
                return f"a2a_overlap fb with {refused[0]}"
        if pt.get("zero", 0) and dp * ep == 1:
            return (f"zero={pt['zero']} needs a replica group of > 1 rank; dp={dp} x ep={ep} "
                    f"holds one copy of each parameter")
        return None

    def canonical(self, pt: Point) -> Point:
        """The point of this space that is the same run as `pt`, where `reject` keeps one
        variant of several: without a pipeline (pp = 1) the schedule is 1f1b; without an
        exchange (ep = 1) the all-to-all is flat, local, not overlapped. `pt` itself
        otherwise (and where the kept value is not among the choices). The search's
        neighbour walk moves through these, so pp 2 -> 1 from a zb-h1 point or ep 2 -> 1 from
        an overlapped one is one step, not a rejected point."""
        keep: dict[str, Any] = {}
        if pt["pp"] == 1:
            keep["schedule"] = "1f1b"
        if pt["ep"] == 1:
            keep.update(alltoall="flat", placement="local")
            if "a2a_overlap" in pt:
                keep["a2a_overlap"] = "none"
        keep = {n: v for n, v in keep.items() if pt[n] != v and v in self.choices.get(n, ())}
        return dict(pt, **keep) if keep else pt

    def to_plan(self, pt: Point) -> ParallelPlan:
        """The layout of a point that passed `reject`."""
        name, _, v = pt["schedule"].partition(":")
        dp = self.n_gpus // (pt["pp"] * pt["ep"])
        return ParallelPlan(
            pp=pt["pp"], ep=pt["ep"], dp=dp,
            microbatches=self.global_batch // (dp * pt["ep"] * pt["mbs"]),
            global_batch=self.global_batch, seq_len=self.seq_len, schedule=name,
            n_virtual=int(v or 1), alltoall=pt["alltoall"], checkpointing=pt["checkpointing"],
            ep_placement=pt["placement"], zero=pt.get("zero", 0), redundant=self.redundant,
            a2a_overlap=pt.get("a2a_overlap", "none"),
        )

    @staticmethod
    def key(pt: Point) -> tuple:
        return tuple(sorted(pt.items()))

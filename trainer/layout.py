"""The one layout model: vocabularies, rank arithmetic, stage split and feasibility rules.

Pure functions and a frozen dataclass, no process groups: `trainer.distributed.mesh.Mesh` builds the
groups of a run from a `Layout`, and the planner (`tuner`) evaluates the very same layouts, so
what is planned is what runs (STYLE 13, 29). Everything else imports the vocabularies from here.

Parallel folding (Megatron-Core's MoE layout): the world is pp pipeline stages of
S = world / pp ranks each, and a stage's S ranks are arranged twice:

    expert side   dp x ep x etp       (routed experts; S = dp * ep * etp)
    dense side    attn_dp x cp x tp   (attention, norms, dense FFN, shared experts, head)

    pp       pipeline ranks; each runs vpp virtual stages (chunks): pp * vpp stages
    dp       data-parallel replicas of an expert shard (the trainer's --parallel.dp, "EDP")
    ep       expert-parallel ranks: the all-to-all group
    etp      expert tensor parallel: each expert's weights split over etp ranks
    tp       tensor parallel (with sequence parallel) of the dense side
    cp       context parallel: one sequence split over cp ranks
    attn_dp  = S / (tp * cp): the dense side's data-parallel degree, the data shards

so world = pp * dp * ep * etp and tp * cp must divide S. EP groups are formed from the dense
side's DP x TP x CP ranks, so experts are never replicated over TP. With tp = cp = etp = 1
this is the trainer's PP x DP x EP mesh: attn_dp = dp * ep data shards, and the stage group
averages non-expert gradients. The trainer runs that and tp > 1 (tensor and sequence
parallel, trainer/distributed/tensor_parallel.py); cp > 1 and etp > 1 are evaluated by the planner only
(`not_runnable_because`).

Rank layout. Expert-side indices, outermost first (the last varies fastest):

    local  (default)  rank = ((pp_idx * dp + dp_idx) * ep + ep_idx) * etp + etp_idx
    spread            rank = ((ep_idx * pp + pp_idx) * dp + dp_idx) * etp + etp_idx

With etp = 1 these are exactly the trainer's formulas. With "local" an EP group is `ep`
consecutive ranks (an all-to-all inside one node when ep <= GPUs per node) and a stage is a
block of S consecutive ranks; with "spread" an EP group takes one rank from each of `ep`
blocks of pp * dp * etp ranks and spans nodes, while pipeline and DP neighbours sit close.
ETP is innermost: its partial-output reduction runs in every expert GEMM.
Dense-side indices number a rank's position j among its stage's ranks in ascending order,
j = (attn_dp_idx * cp + cp_idx) * tp + tp_idx: TP groups are consecutive ranks, on the fastest
links (their collectives run twice per layer forward), CP next (ring attention's K/V exchange).

Groups (`Layout.group(kind, rank)`): the ranks of `rank`'s stage that share its other indices
on that side (the pp group: the same stage position on every stage).
    pp       differ in pp_idx: pipeline point-to-point
    dp       differ in dp_idx: expert gradients are averaged here
    ep       differ in ep_idx: the MoE all-to-all, expert migration
    etp      differ in etp_idx
    tp, cp   differ in tp_idx / cp_idx (dense side)
    attn_dp  differ in attn_dp_idx (dense side)
    stage    the stage's ranks with the same tp_idx: they hold the same non-expert weights and
             average their gradients (the whole stage when tp = 1)
Members are listed as `trainer.distributed.mesh` has always built them: the expert-side groups and the
stage group by the expert-side indices (dp, ep, etp), last fastest (spread stage groups are
therefore not ascending), dense groups ascending.

Stage split: stage s of pp * vpp runs on pipeline rank s % pp (Megatron's interleaved order,
what `pipeline.schedule` builds and `trainer.distributed.pipe.build_stages` keeps) and owns a contiguous
run of layers. The even split gives the middle stages the remainder first (stage 0 also holds
the embedding, the last stage the final norm and head, so they are the last to get an extra
layer); `parallel.layer_split` ("3,5,...") states the counts instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from comm.collectives.alltoall import ALGORITHMS as _COMM_ALGORITHMS
from model.checkpointing import CHECKPOINTING
from pipeline.schedule import FB_SCHEDULES, schedule_names

__all__ = [
    "A2A_OVERLAP", "ALLTOALL_ALGORITHMS", "AUTO_OVERLAP_CHUNKS", "DENSE_DIMS", "DIMS",
    "EP_PLACEMENTS", "EXPERT_DIMS", "GROUP_KINDS", "PRECISIONS", "RECOMPUTE", "RECOMPUTE_MODES",
    "SCHEDULES", "TRAINER_A2A_OVERLAP", "TRAINER_ALLTOALL", "TRAINER_PRECISIONS",
    "TRAINER_ZERO_LEVELS", "ZERO_LEVELS", "Coords", "Layout", "LayoutError", "auto_overlap",
    "check", "check_choice", "check_redundant", "divisors", "fb_problems", "layout_problems",
    "layer_split_spec", "not_runnable_because", "pipelined_expert_path", "rank_chunks",
    "stage_bounds", "stage_counts", "stage_layers", "stage_rank",
]

# ---- vocabularies (declared once; trainer config checks and the planner import these) -------

SCHEDULES = tuple(schedule_names())  # gpipe, 1f1b, interleaved-1f1b, zb-h1 (pipeline/schedule)
EP_PLACEMENTS = ("local", "spread")
# 0 replicated state, 1 optimizer state sharded, 2 + gradients, 3 + parameters
ZERO_LEVELS = (0, 1, 2, 3)
TRAINER_ZERO_LEVELS = (0, 1, 2, 3)  # --parallel.zero (3: FSDP2, trainer/distributed/zero3.py)
# dedup: a token crosses to a remote node once (DeepEP-style; issue 26)
ALLTOALL_ALGORITHMS = ("flat", "halo", "dedup", "auto")
# --comm.alltoall: what comm.all_to_all runs, and dedup (comm/collectives/dedup.py, comm/ep/pipeline.py)
TRAINER_ALLTOALL = (*(a for a in _COMM_ALGORITHMS if a != "auto"), "dedup", "auto")
# all-to-all overlapped with compute: none, inside the MoE layer, across micro-batches; auto:
# one of them by `auto_overlap` (the trainer's --comm.a2a_overlap=auto, priced by the planner)
A2A_OVERLAP = ("none", "layer", "fb", "auto")
TRAINER_A2A_OVERLAP = ("none", "layer", "fb", "auto")  # --comm.a2a_overlap
# Recompute modes are the model's activation checkpointing modes (model/checkpointing.py),
# the same names: none; selective = the FFN intermediates are recomputed; full = the whole
# block keeps only its input. --train.checkpointing takes them.
RECOMPUTE = CHECKPOINTING
# What the planner prices: the trainer's modes plus Megatron-Core's `moe` recompute module (the
# whole MoE layer, router, all-to-all and experts, re-run in the backward; published long-context
# recipes use it), which the trainer does not build
RECOMPUTE_MODES = (*CHECKPOINTING, "moe")
PRECISIONS = ("bf16", "fp8")  # GEMM precision; fp8 is a planner rate only
TRAINER_PRECISIONS = ("bf16",)  # bf16 GEMMs: bf16 weights + fp32 masters (trainer/distributed/precision.py)
EXPERT_DIMS = ("dp", "ep", "etp")  # a stage's expert side, outermost first
DENSE_DIMS = ("attn_dp", "cp", "tp")  # a stage's dense side, outermost first
DIMS = ("pp", *EXPERT_DIMS, *DENSE_DIMS)
GROUP_KINDS = ("pp", "dp", "ep", "etp", "attn_dp", "cp", "tp", "stage")


class LayoutError(ValueError):
    """The layout cannot be built or run; the message names the numbers and what would work."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_choice(what: str, value: object, valid: tuple) -> None:
    """A LayoutError naming `value` and the valid choices when `value` is not among them."""
    if isinstance(value, bool) or value not in valid:
        raise LayoutError(f"{what}={value!r}; valid: {', '.join(map(str, valid))}")


class Coords(NamedTuple):
    """A rank's indices on both sides of its stage (module docstring)."""

    pp: int
    dp: int
    ep: int
    etp: int
    attn_dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Parallel degrees and where each dimension's ranks sit; validated at construction."""

    world: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    etp: int = 1
    vpp: int = 1  # virtual stages (chunks) per pipeline rank
    placement: str = "local"

    def __post_init__(self) -> None:
        check_choice("ep_placement", self.placement, EP_PLACEMENTS)
        for name in ("world", "pp", "dp", "ep", "tp", "cp", "etp", "vpp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{name}={v!r} must be an int >= 1")
        if self.pp * self.stage_size != self.world:
            raise LayoutError(
                f"world size {self.world} does not match the mesh {self._degrees()} = "
                f"{self.pp * self.stage_size}; launch {self.pp * self.stage_size} processes "
                f"(torchrun --nproc-per-node {self.pp * self.stage_size}) or set "
                f"--parallel.dp=0 to infer dp")
        if self.stage_size % (self.tp * self.cp):
            raise LayoutError(
                f"tp={self.tp} x cp={self.cp} = {self.tp * self.cp} does not divide the "
                f"{self.stage_size} ranks of a pipeline stage ({self._degrees(pp=False)}); "
                f"tp x cp must be one of {divisors(self.stage_size)}")

    @classmethod
    def infer(cls, world: int, pp: int = 1, ep: int = 1, dp: int = 0, tp: int = 1, cp: int = 1,
              etp: int = 1, vpp: int = 1, placement: str = "local") -> Layout:
        """The layout with dp = world / (pp * ep * etp) when dp = 0 (the trainer's
        `--parallel.dp=0`), every degree named in an error."""
        check_choice("parallel.ep_placement", placement, EP_PLACEMENTS)
        for name, v in (("pp", pp), ("ep", ep), ("etp", etp), ("tp", tp), ("cp", cp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{name}={v} must be >= 1")
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 0:
            raise LayoutError(f"dp={dp} must be >= 1 (or 0 to infer it from the world size)")
        if dp == 0:
            rest = pp * ep * etp
            if world % rest:
                extra = f" x etp={etp}" if etp > 1 else ""
                raise LayoutError(
                    f"world size {world} is not divisible by pp={pp} x ep={ep}{extra} = {rest}; "
                    f"launch a multiple of {rest} processes, or pick pp x ep among the "
                    f"divisors of {world}: {divisors(world)}")
            dp = world // rest
        return cls(world, pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, etp=etp, vpp=vpp,
                   placement=placement)

    def _degrees(self, pp: bool = True) -> str:
        s = (f"pp={self.pp} x " if pp else "") + f"dp={self.dp} x ep={self.ep}"
        return s + (f" x etp={self.etp}" if self.etp > 1 else "")

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp x ep x etp = attn_dp x cp x tp."""
        return self.dp * self.ep * self.etp

    @property
    def attn_dp(self) -> int:
        """The dense side's data-parallel degree: stage ranks / (tp x cp)."""
        return self.stage_size // (self.tp * self.cp)

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def n_data_shards(self) -> int:
        """Ranks of a stage that read different sequences: attn_dp (= dp x ep in the
        trainer); TP ranks share their sequences, CP ranks split each."""
        return self.attn_dp

    def size(self, dim: str) -> int:
        check_choice("dimension", dim, DIMS)
        return int(getattr(self, dim))

    # ---- rank arithmetic -------------------------------------------------------------------
    def rank_of(self, pp: int = 0, dp: int = 0, ep: int = 0, etp: int = 0) -> int:
        """The rank at these expert-side indices (module docstring); inverse of `coords`."""
        for name, v in (("pp", pp), ("dp", dp), ("ep", ep), ("etp", etp)):
            if not 0 <= v < getattr(self, name):
                raise LayoutError(f"{name} index {v} is outside 0..{getattr(self, name) - 1}")
        if self.placement == "local":
            return ((pp * self.dp + dp) * self.ep + ep) * self.etp + etp
        return ((ep * self.pp + pp) * self.dp + dp) * self.etp + etp

    def dense_rank_of(self, pp: int = 0, attn_dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The rank at these dense-side indices."""
        for name, v in (("pp", pp), ("attn_dp", attn_dp), ("cp", cp), ("tp", tp)):
            if not 0 <= v < getattr(self, name):
                raise LayoutError(f"{name} index {v} is outside 0..{getattr(self, name) - 1}")
        return self.stage_ranks(pp)[(attn_dp * self.cp + cp) * self.tp + tp]

    def stage_ranks(self, pp: int) -> list[int]:
        """The ranks of pipeline stage `pp`, ascending (the dense side's positions)."""
        if self.placement == "local":
            return list(range(pp * self.stage_size, (pp + 1) * self.stage_size))
        block = self.dp * self.etp  # consecutive ranks of one (ep_idx, pp_idx)
        return [(e * self.pp + pp) * block + i for e in range(self.ep) for i in range(block)]

    def coords(self, rank: int) -> Coords:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank!r} is outside the world of {self.world}: "
                              f"valid 0..{self.world - 1}")
        r, t = divmod(rank, self.etp)
        if self.placement == "local":
            r, e = divmod(r, self.ep)
            p, d = divmod(r, self.dp)
            j = rank - p * self.stage_size
        else:
            r, d = divmod(r, self.dp)
            e, p = divmod(r, self.pp)
            j = (e * self.dp + d) * self.etp + t  # ascending order within the stage
        j, tp = divmod(j, self.tp)
        a, c = divmod(j, self.cp)
        return Coords(p, d, e, t, a, c, tp)

    def data_idx(self, rank: int) -> int:
        """Index of `rank`'s data shard, 0..n_data_shards-1: its attn_dp index, except in the
        trainer's spread layout (tp = cp = 1), which has always numbered the shards
        dp_idx * ep + ep_idx."""
        c = self.coords(rank)
        if self.placement == "spread" and self.tp == self.cp == 1:
            return (c.dp * self.ep + c.ep) * self.etp + c.etp
        return c.attn_dp

    def group(self, kind: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group of `kind` (see the module docstring), in member order."""
        check_choice("group", kind, GROUP_KINDS)
        c = self.coords(rank)
        ex = {"pp": c.pp, "dp": c.dp, "ep": c.ep, "etp": c.etp}
        if kind in ("pp", *EXPERT_DIMS):
            return [self.rank_of(**{**ex, kind: i}) for i in range(getattr(self, kind))]
        if kind == "stage":
            return [r for d in range(self.dp) for e in range(self.ep) for t in range(self.etp)
                    if self.coords(r := self.rank_of(c.pp, d, e, t)).tp == c.tp]
        de = {"pp": c.pp, "attn_dp": c.attn_dp, "cp": c.cp, "tp": c.tp}
        return [self.dense_rank_of(**{**de, kind: i}) for i in range(getattr(self, kind))]

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind`, a partition of the ranks, in the order `trainer.distributed.mesh` creates
        them: by the lowest-numbered stage, then by the members' first index on that side."""
        check_choice("group", kind, GROUP_KINDS)
        out: list[list[int]] = []
        seen: set[int] = set()
        if kind == "pp":
            firsts = [self.rank_of(0, d, e, t) for d in range(self.dp) for e in range(self.ep)
                      for t in range(self.etp)]
        elif kind in EXPERT_DIMS:
            firsts = [self.rank_of(p, d, e, t) for p in range(self.pp) for d in range(self.dp)
                      for e in range(self.ep) for t in range(self.etp)]
        else:
            firsts = [r for p in range(self.pp) for r in self.stage_ranks(p)]
            if kind == "stage":  # the expert-side order, as the trainer has always built them
                firsts = [self.rank_of(p, d, e, t) for p in range(self.pp)
                          for d in range(self.dp) for e in range(self.ep) for t in range(self.etp)]
        for r in firsts:
            if r not in seen:
                g = self.group(kind, r)
                seen.update(g)
                out.append(g)
        return out

    def stride(self, kind: str) -> int:
        """Rank distance between a group's first two members (1 for a group of one)."""
        g = self.group(kind, 0)
        return g[1] - g[0] if len(g) > 1 else 1

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - Layout is frozen; the planner asks often
    def node_span(self, kind: str, gpus_per_node: int) -> tuple[int, int]:
        """(most members of one group on one node, most nodes one group spans) with
        `gpus_per_node` consecutive ranks per node: how a group's collective meets the links."""
        if gpus_per_node < 1:
            raise LayoutError(f"gpus_per_node={gpus_per_node} must be >= 1")
        per_node = nodes = 0
        for g in self.groups(kind):
            on = [r // gpus_per_node for r in g]
            per_node = max(per_node, max(on.count(n) for n in set(on)))
            nodes = max(nodes, len(set(on)))
        return per_node, nodes


# ---- stage split -----------------------------------------------------------------------------

def stage_counts(n_layers: int, n_stages: int, spec: str = "") -> list[int]:
    """Layers of each stage s = 0..n_stages-1: `spec` ("3,5": comma-separated counts, the
    trainer's `parallel.layer_split`) or, with spec = "", as even as possible with the middle
    stages taking the remainder (module docstring)."""
    if spec:
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            raise LayoutError(f"parallel.layer_split={spec!r}: expected comma-separated "
                              f"integers") from None
        if len(counts) != n_stages or sum(counts) != n_layers or min(counts) < 1:
            raise LayoutError(
                f"parallel.layer_split={spec!r}: need {n_stages} positive counts (pp x n_virtual) "
                f"summing to n_layers={n_layers}")
        return counts
    if n_stages < 1:
        raise LayoutError(f"{n_stages} pipeline stages: need pp x n_virtual >= 1")
    if n_stages > n_layers:
        raise LayoutError(f"{n_stages} pipeline stages (pp x n_virtual) exceed the model's "
                          f"{n_layers} layers; use pp x n_virtual <= {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    order = list(range(1, n_stages - 1)) + [0, n_stages - 1] if n_stages > 2 \
        else list(range(n_stages))
    counts = [base] * n_stages
    for s in order[:extra]:
        counts[s] += 1
    return counts


def stage_bounds(n_layers: int, n_stages: int, spec: str = "") -> list[int]:
    """Stage boundaries [0, ..., n_layers] (len n_stages + 1): stage s owns [b[s], b[s+1])."""
    bounds = [0]
    for c in stage_counts(n_layers, n_stages, spec):
        bounds.append(bounds[-1] + c)
    return bounds


def stage_layers(n_layers: int, pp: int, vpp: int = 1, spec: str = "") -> list[list[int]]:
    """Layers of each stage s = 0..pp*vpp-1 (stage s runs on pipeline rank `stage_rank(s, pp)`)."""
    b = stage_bounds(n_layers, pp * vpp, spec)
    return [list(range(b[s], b[s + 1])) for s in range(pp * vpp)]


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank that runs `stage` (Megatron's interleaved order: s % pp)."""
    return stage % pp


def rank_chunks(n_layers: int, pp: int, vpp: int = 1, spec: str = "") -> list[list[list[int]]]:
    """For each pipeline rank, the layers of its stages in stage order."""
    st = stage_layers(n_layers, pp, vpp, spec)
    return [[st[s] for s in range(len(st)) if stage_rank(s, pp) == r] for r in range(pp)]


def layer_split_spec(stages: list[list[int]]) -> str:
    """The `parallel.layer_split` spec that runs this split ("3,5")."""
    return ",".join(str(len(s)) for s in stages)


# ---- feasibility -----------------------------------------------------------------------------

def check_redundant(r: int, n_experts: int, ep: int, what: str = "redundant") -> None:
    """r redundant expert slots per EP rank (`--balance.redundant`): each holds an expert the
    rank does not hold yet (so r <= E - E / ep), and only where there are ranks to spread
    load over (ep > 1)."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise LayoutError(f"{what}={r!r} must be an int >= 0 (redundant expert slots per EP "
                          f"rank)")
    if r and ep == 1:
        raise LayoutError(f"{what}={r} needs expert parallelism (parallel.ep > 1): with one EP "
                          f"rank a replica would sit beside its own expert")
    top = n_experts - n_experts // ep
    if r > top:
        raise LayoutError(f"{what}={r} exceeds the {top} experts an EP rank does not hold "
                          f"(E={n_experts}, ep={ep}); valid: 0..{top}")


def layout_problems(layout: Layout, n_layers: int, n_experts: int, *, schedule: str | None = None,
                    microbatches: int | None = None, global_batch: int | None = None,
                    layer_split: str = "", n_heads: int | None = None,
                    n_kv_heads: int | None = None, seq_len: int | None = None,
                    redundant: int = 0) -> list[str]:
    """Every rule `layout` breaks for a model of `n_layers` layers and `n_experts` routed
    experts (0 = dense), each naming its numbers and the valid choices; [] when it is feasible.
    The optional arguments add the rules that need them."""
    L, out = layout, []
    E = n_experts
    if E and E % L.ep:
        out.append(f"ep={L.ep} does not divide {E} experts; valid ep: {divisors(E)}")
    elif not E and L.ep > 1:
        out.append(f"ep={L.ep} needs routed experts; the model has none: valid ep: 1")
    if L.etp > 1 and not E:
        out.append(f"etp={L.etp} needs routed experts; the model has none: valid etp: 1")
    try:
        stage_counts(n_layers, L.n_stages, layer_split)
    except LayoutError as e:
        out.append(str(e))
    if schedule is not None:
        if schedule not in SCHEDULES:
            out.append(f"schedule={schedule!r}; valid: {', '.join(SCHEDULES)}")
        elif L.vpp > 1 and schedule != "interleaved-1f1b":
            out.append(f"vpp={L.vpp} virtual stages per rank need schedule 'interleaved-1f1b' "
                       f"(got {schedule!r})")
        elif schedule == "interleaved-1f1b" and microbatches is not None and microbatches % L.pp:
            out.append(f"interleaved-1f1b needs microbatches divisible by pp: microbatches="
                       f"{microbatches}, pp={L.pp}; valid: multiples of {L.pp}")
    if microbatches is not None and microbatches < 1:
        out.append(f"microbatches={microbatches} must be >= 1")
    if global_batch is not None:
        shards = L.n_data_shards
        if global_batch < 1 or global_batch % shards:
            how = f"dp={L.dp} x ep={L.ep}" if L.tp == L.cp == L.etp == 1 else \
                f"dp={L.dp} x ep={L.ep} x etp={L.etp} / (tp={L.tp} x cp={L.cp})"
            out.append(f"global_batch={global_batch} must be a positive multiple of the {shards} "
                       f"data shards ({how})")
        elif microbatches is not None and microbatches >= 1 and (global_batch // shards) % microbatches:
            per = global_batch // shards
            out.append(f"microbatches={microbatches} must divide the {per} sequences each data "
                       f"shard gets (global_batch={global_batch} / {shards} shards); valid: "
                       f"{divisors(per)}")
    for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if heads is not None and L.tp > 1 and heads % L.tp:
            out.append(f"tp={L.tp} does not divide the model's {name}={heads}; valid tp: "
                       f"{divisors(heads)}")
    # Causal context parallel splits a sequence into 2 x CP chunks, rank i taking chunks i and
    # 2 CP - 1 - i, so every rank gets the same share of the causal mask (Megatron-Core's
    # load-balanced CP).
    if seq_len is not None and L.cp > 1 and seq_len % (2 * L.cp):
        out.append(f"cp={L.cp} needs seq_len divisible by 2 x cp = {2 * L.cp} (causal load "
                   f"balance); seq_len={seq_len}")
    if redundant:
        try:
            check_redundant(redundant, E, L.ep)
        except LayoutError as e:
            out.append(str(e))
    return out


def check(layout: Layout, n_layers: int, n_experts: int, **kw: object) -> None:
    """Raise a LayoutError naming every broken rule of `layout_problems`."""
    probs = layout_problems(layout, n_layers, n_experts, **kw)  # type: ignore[arg-type]
    if probs:
        raise LayoutError("; ".join(probs))


def pipelined_expert_path(alltoall: str, a2a_overlap: str) -> bool:
    """Whether a MoE layer runs the pipelined expert path (comm/ep/pipeline.py: dedup, or the
    layer / fb overlap), which is not built with tensor parallel (trainer.setup refuses it,
    `not_runnable_because` reports it)."""
    return alltoall == "dedup" or a2a_overlap in ("layer", "fb")


def fb_problems(microbatches: int, pp: int, schedule: str, recompute: str) -> list[str]:
    """Why train.py refuses --comm.a2a_overlap=fb with these choices ([] when it runs it),
    each as the tail of `trainer.setup.check_fb`'s error ("comm.a2a_overlap=fb with ..."). fb
    pairs one micro-batch's backward with another's forward: it needs two micro-batches, a
    schedule `pipeline.schedule.build_fb` pairs with pp > 1, and no block recompute in the
    backward (a recomputed MoE forward would overwrite the routing outputs the paired forward
    reads; trainer/step.py). Tensor parallel is refused for every pipelined expert path
    (`pipelined_expert_path`), not here."""
    out = []
    if microbatches < 2:
        out.append(f"parallel.microbatches={microbatches}: it pairs one micro-batch's backward "
                   f"with another's forward; use parallel.microbatches >= 2 (or a2a_overlap "
                   f"layer)")
    if pp > 1 and schedule not in FB_SCHEDULES:
        out.append(f"parallel.schedule={schedule!r} (pp={pp}) is not built; it runs with "
                   f"{', '.join(FB_SCHEDULES)}")
    if recompute == "full":
        out.append("train.checkpointing='full' is not built (the backward's recomputed MoE "
                   "forward would run beside the paired forward); use train.checkpointing none "
                   "or selective")
    return out


AUTO_OVERLAP_CHUNKS = 2  # chunks of the layer pipeline under auto (layer / 2, fb / 2)


def auto_overlap(nodes: int, *, tp: int = 1, microbatches: int = 1, pp: int = 1,
                 schedule: str = "1f1b", recompute: str = "none", fb_peak: float | None = None,
                 budget: float | None = None,
                 fb_extra: float | None = None) -> tuple[str, int, str]:
    """What --comm.a2a_overlap=auto runs for an EP group over `nodes` nodes: (mode, chunks,
    why). The one rule of the trainer (`trainer.build.resolve_a2a`) and of the planner's
    price of a plan with a2a_overlap "auto" (`tuner.estimate.resolve_overlap`).

        tp > 1                      none (the pipelined expert path is not built with TP)
        nodes <= 1                  none (nothing crosses the network)
        fb refused (`fb_problems`)  layer / 2 (microbatches < 2, an unpaired schedule with
                                    pp > 1, full recompute)
        fb's memory not known       layer / 2 (`fb_peak` or `budget` None)
        fb_peak > budget            layer / 2
        else                        fb / 2

    `fb_peak`: the predicted peak bytes of the busiest rank when the run holds fb's
    activations (`pipeline.schedule.build_fb`'s in-flight micro-batches: with pp = 1 two
    instead of one, with 1F1B up to 2(p - r) on rank r instead of p - r; the planner's
    `tuner.estimate.stage_memory`); `budget`: the bytes a rank may use (the planner: the
    platform's usable HBM; the trainer: 0.9 of the device's free memory at start-up, of
    the host's available memory per local rank on CPU, the least over all ranks);
    `fb_extra`: fb's extra activation bytes, for the message only.

    Why fb where it runs and fits: on the emulated 2 x 2 cluster at 200 Mbit/s
    (docs/alltoall.md, "Measured: overlap on the emulator, with micro-batches") fb with 2
    chunks ran 0.757x the plain step at 4 micro-batches (layer / 2: 0.874x) and 0.813x at 2
    (layer / 2: 0.921x; fb / 1 0.872x); `tuner.costs.a2a_exposed` prices fb / 2 fastest
    there too. Not everywhere: at 1 Gbit/s (one repeat) layer / 2 ran 0.755x against fb / 2
    0.801x, and with 8 ranks on the 2 cores (4 x 2) both overlaps were slower than none (the
    paired threads compete for the cores); this rule does not price that. Chunks 2: the
    fewest that put one chunk's exchange beside another's GEMMs; fb / 2 beat fb / 1 at 2
    and 4 micro-batches and fb / 4 at 2 (2.39 s against 2.80 s), and layer keeps the 2 it
    had (layer / 4 took 2.78 s against layer / 2's 2.72 s, in separate runs)."""
    if tp > 1:
        return "none", 1, f"the pipelined expert path is not built with tensor parallel (tp={tp})"
    if nodes <= 1:
        return "none", 1, "EP group on 1 node: no exchange crosses the network"
    where = f"EP group on {nodes} nodes"
    c = AUTO_OVERLAP_CHUNKS
    refused = fb_problems(microbatches, pp, schedule, recompute)
    if refused:
        return "layer", c, f"{where}; not fb: {'; '.join(refused)}"
    if fb_peak is None or budget is None:
        return "layer", c, f"{where}; not fb: its activation memory is not known to fit"
    extra = f" (+{fb_extra / 1e9:.3g} GB of activations)" if fb_extra is not None else ""
    mem = (f"a rank's predicted peak with fb {fb_peak / 1e9:.3g} GB{extra}, budget "
           f"{budget / 1e9:.3g} GB")
    if fb_peak > budget:
        return "layer", c, f"{where}; not fb: {mem}"
    return "fb", c, f"{where}, {microbatches} micro-batches, {mem}"


def not_runnable_because(layout: Layout, *, zero: int = 0, alltoall: str = "flat",
                         a2a_overlap: str = "none", recompute: str = "none",
                         precision: str = "bf16") -> list[str]:
    """What `train.py` lacks to run this (feasible) layout and choices; [] when it can run it.
    Unknown choices raise a LayoutError naming the vocabulary."""
    check_choice("zero", zero, ZERO_LEVELS)
    check_choice("alltoall", alltoall, ALLTOALL_ALGORITHMS)
    check_choice("a2a_overlap", a2a_overlap, A2A_OVERLAP)
    check_choice("recompute", recompute, RECOMPUTE_MODES)
    check_choice("precision", precision, PRECISIONS)
    out = []
    if recompute not in RECOMPUTE:
        out.append(f"recompute {recompute!r} (Megatron-Core's whole-MoE-layer module) is not built "
                   f"in the trainer; it runs {', '.join(RECOMPUTE)}")
    # tensor parallel with or without sequence parallel runs (trainer/distributed/tensor_parallel.py);
    # its model rules (tp | heads, seq_len, untied embeddings) are `layout_problems`' and
    # `trainer.distributed.tensor_parallel.tp_problems`'
    if layout.cp > 1:
        out.append(f"context parallel (cp={layout.cp}) is not built in the trainer yet")
    if layout.etp > 1:
        out.append(f"expert tensor parallel (etp={layout.etp}) is not built in the trainer yet "
                   f"(issue 31)")
    if zero not in TRAINER_ZERO_LEVELS:
        out.append(f"ZeRO-{zero} (parameter sharding) is not built in the trainer yet (issue 32); "
                   f"it runs ZeRO {', '.join(map(str, TRAINER_ZERO_LEVELS))}")

    if alltoall not in TRAINER_ALLTOALL:
        out.append(f"the {alltoall!r} all-to-all is not built in the trainer yet (issue 26); it "
                   f"runs {', '.join(TRAINER_ALLTOALL)}")
    if a2a_overlap not in TRAINER_A2A_OVERLAP:
        out.append(f"all-to-all overlap {a2a_overlap!r} is not built in the trainer yet "
                   f"(issue 26)")
    if layout.tp > 1 and pipelined_expert_path(alltoall, a2a_overlap):
        out.append(f"tp={layout.tp} with alltoall {alltoall!r} / overlap {a2a_overlap!r}: the "
                   f"pipelined expert path (dedup, layer and fb overlap) is not built with tensor "
                   f"parallel yet")
    if precision not in TRAINER_PRECISIONS:
        out.append(f"{precision} GEMMs are not built in the trainer (it runs "
                   f"{', '.join(TRAINER_PRECISIONS)})")
    return out

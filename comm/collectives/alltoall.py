"""`comm.all_to_all`: the one entry point the MoE dispatcher calls.

Contract (R ranks in `group`; T_in = sum(in_splits), T_out = sum(out_splits)):
    x [T_in, ...] rows grouped by destination rank  ->  y [T_out, ...] grouped by source rank.
The result equals `torch.distributed.all_to_all_single` exactly for any splits, zeros and
ranks that send or receive nothing included, and it is differentiable: the backward is the
same exchange with the splits swapped. `algorithm` picks how the rows travel:
    "flat" one all_to_all_single (the vendor collective)
    "halo" hierarchical I (intra-node) || II (packed per remote node) -> III (redistribute)
    "auto" the cheaper of the two under `cost_model`, decided identically on every rank

"halo" first gathers every rank's split row, in two levels (`comm.collectives.halo.halo_gather_ints`:
(G - 1) + (N - 1) messages per rank instead of R - 1). "auto" (calibrated, concurrent flat
model) sends every peer the sender's row together with an O(R) summary of it
(`comm.cost.row_summary`), in one collective like flat's exchange of split sizes. The
summaries decide in O(R) steps per rank wherever the model's answer does not hinge on HALO's
relay hop, the usual case; otherwise the model is evaluated on the matrix (a few numpy
passes over its R^2 entries), as it always is for the mirrored exchange (`reverse()`).

`plan_all_to_all` makes that small exchange ahead of the rows and carries the caller's own
ints in it (the MoE dispatcher's per-expert counts); `all_to_all(..., plan=plan)` then moves
the rows only, and `plan.reverse()` settles the mirrored exchange (combine) without another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from comm.collectives.flat import (
    _split_device,
    exchange_int_array,
    exchange_ints,
    flat_all_to_all,
    normalize_splits,
)
from comm.collectives.halo import halo_all_to_all, halo_gather_array
from comm.collectives.halo_plan import SplitPlans
from comm.cost import (
    CostModel,
    choose_algorithm,
    decide_from_summaries,
    row_summary,
)
from comm.topology import Topology
from comm.topology.platform import platform_names

__all__ = ["ALGORITHMS", "AllToAllPlan", "all_to_all", "plan_all_to_all", "settle_plan"]

ALGORITHMS = ("flat", "halo", "auto")


@dataclass(frozen=True)
class AllToAllPlan:
    """Everything an exchange needs besides its rows, identical on every rank of the group
    (`plan_all_to_all`): this rank's splits, the algorithm that runs and, for HALO (and
    `auto`, which keeps it for the mirrored exchange), the whole split matrix with the rank
    plans built from it (`comm.collectives.halo_plan.SplitPlans`: each built once, shared with
    `reverse()` and the backward passes)."""

    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    algorithm: str  # "flat" or "halo": what runs
    splits: SplitPlans | None = field(default=None, compare=False, repr=False)
    requested: str = field(default="flat", compare=False)  # what the caller asked for
    topology: Topology | None = field(default=None, compare=False, repr=False)
    cost_model: CostModel | None = field(default=None, compare=False, repr=False)
    row_bytes: int = field(default=0, compare=False)

    @property
    def matrix(self) -> np.ndarray | None:
        """The split matrix S [R, R] (read-only), or None for a flat-only plan."""
        return None if self.splits is None else self.splits.matrix

    def reverse(self) -> AllToAllPlan:
        """The plan of the mirrored exchange (rows go back; the splits swap), decided the
        way its own call would decide it: `auto` runs the model on the transposed matrix
        here (a view, read in place), on every rank alike, instead of another exchange."""
        if self.splits is None:
            return dataclasses.replace(self, in_splits=self.out_splits,
                                       out_splits=self.in_splits)
        T = self.splits.transposed()
        algorithm = self.algorithm
        if self.requested == "auto":
            assert self.topology is not None and self.cost_model is not None
            algorithm = choose_algorithm(T.matrix, self.row_bytes, self.topology,
                                         self.cost_model)
        return dataclasses.replace(self, in_splits=self.out_splits, out_splits=self.in_splits,
                                   algorithm=algorithm, splits=T)


def plan_all_to_all(
    in_splits: Sequence[int] | torch.Tensor,
    group: dist.ProcessGroup | None,
    algorithm: str = "flat",
    topology: Topology | None = None,
    cost_model: CostModel | None = None,
    row_bytes: int = 4,
    payload: Sequence[Sequence[int]] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[AllToAllPlan, list[list[int]]]:
    """Settle an exchange before its rows exist, in one small exchange of ints that can
    carry the caller's own: `payload[d]` (k ints, the same k on every rank) goes to rank d.

    Returns (plan, received) with received[s] = rank s's payload for this rank. The plan
    goes to `all_to_all(..., plan=plan)` (which then exchanges nothing before the rows) and
    `plan.reverse()` to the mirrored exchange. The MoE dispatcher sends its per-expert
    counts as the payload, so `halo` and `auto` cost no more small exchanges than `flat`:
    flat sends each peer its split, HALO every rank's split row, `auto` also the row's
    summary (see `comm.cost.row_summary`). `row_bytes` is the bytes of one row (for `auto`);
    `device` that of the rows (NCCL exchanges on it, gloo on the CPU). `auto` across nodes
    needs `cost_model` (see `all_to_all`).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    world = dist.get_world_size(group)
    splits = normalize_splits(in_splits, world, "in_splits")
    rows = _payload_rows(payload, world)
    if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes < 1:
        raise ValueError(f"row_bytes must be a positive int, got {row_bytes!r}")
    device = _split_device(device, group)
    algorithm = _fixed_algorithm(algorithm, topology, cost_model, world)
    if algorithm == "flat":
        k = len(rows[0])
        ints = exchange_ints([v for d in range(world) for v in (*rows[d], splits[d])],
                             group, device)
        got = [ints[s * (k + 1):(s + 1) * (k + 1)] for s in range(world)]
        plan = AllToAllPlan(tuple(splits), tuple(g[k] for g in got), "flat")
        return plan, [g[:k] for g in got]
    assert topology is not None, "_fixed_algorithm returns 'flat' without a topology"
    values = _exchange_matrix(splits, group, algorithm, topology, cost_model, rows, device,
                              torch.int64)
    return settle_plan(values, splits, len(rows[0]), dist.get_rank(group), algorithm,
                       topology, cost_model, row_bytes)


def settle_plan(
    values: np.ndarray,
    in_splits: Sequence[int],
    k: int,
    rank: int,
    requested: str,
    topology: Topology,
    model: CostModel | None,
    row_bytes: int,
) -> tuple[AllToAllPlan, list[list[int]]]:
    """The host work between the small exchange and the rows (pure: no process group):
    `values` [R * stride] holds, per source rank, k payload ints, its split row and for
    `auto` its row summary. Decides the algorithm (auto: from the summaries where they
    decide, else the model on the matrix), wraps the matrix without copying it, and returns
    (plan, payload received). The rank plans are built on first use, once."""
    world = topology.world_size
    V = values.reshape(world, -1)
    stride = V.shape[1]
    choice: str | None = requested
    if requested == "auto":
        assert model is not None, "auto across nodes has a cost model (_fixed_algorithm)"
        choice = decide_from_summaries(values, k + world, stride, row_bytes, topology, model) \
            if stride > k + world else None
    # rows validated at the source; the matrix stays where the exchange put it (a
    # row-strided view when payload or summaries sit between the rows: copying it cost
    # 2-15 ms at R = 1024, in fresh pages, more than the model and the plans read of it)
    S = SplitPlans(V[:, k:k + world], topology, _checked=True)
    if choice is None:
        assert model is not None, "choice is None only for auto, which has a model (above)"
        choice = choose_algorithm(S.matrix, row_bytes, topology, model)
    plan = AllToAllPlan(tuple(in_splits), tuple(S.matrix[:, rank].tolist()), choice, S,
                        requested, topology, model, row_bytes)
    return plan, V[:, :k].tolist()


def all_to_all(
    x: torch.Tensor,
    in_splits: Sequence[int] | torch.Tensor,
    group: dist.ProcessGroup | None,
    algorithm: str = "flat",
    topology: Topology | None = None,
    out_splits: Sequence[int] | torch.Tensor | None = None,
    cost_model: CostModel | None = None,
    plan: AllToAllPlan | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Uneven all-to-all of the rows of `x`; returns (y, out_splits as list[int]).

    `group` is the process group (None means the default group, as in torch.distributed).
    `topology` describes the ranks of `group` in group-rank order (see `Topology.restrict`);
    "halo" needs it, "auto" falls back to "flat" without it. `out_splits`, when the caller
    already knows them, skips the split-size exchange of the flat path. `cost_model`
    drives "auto" and is required where auto spans nodes (`comm.calibrate`,
    `CostModel.from_platform`, `CostModel.emulator`: no silent default). `plan` (from
    `plan_all_to_all`, or its `reverse()`) settles sizes and algorithm: nothing is
    exchanged before the rows, and `algorithm` is not consulted.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    if x.dim() < 1:
        raise ValueError(f"x must have a row dimension, got a 0-d tensor of dtype {x.dtype}")
    world = dist.get_world_size(group)
    splits = normalize_splits(in_splits, world, "in_splits")
    if sum(splits) != x.shape[0]:
        raise ValueError(
            f"in_splits {splits} sum to {sum(splits)} but x has {x.shape[0]} rows"
        )
    known_out = None if out_splits is None else normalize_splits(out_splits, world, "out_splits")
    if plan is not None:
        if not isinstance(plan, AllToAllPlan):
            raise ValueError(f"plan must come from comm.plan_all_to_all, got {plan!r}")
        if tuple(splits) != plan.in_splits:
            raise ValueError(f"in_splits {splits} differ from the plan's {list(plan.in_splits)}")
        _check_out(known_out, list(plan.out_splits))
        return _run(x, plan, group)
    if _fixed_algorithm(algorithm, topology, cost_model, world) == "flat":
        return flat_all_to_all(x, splits, group, known_out)
    if x.shape[0] >= 2**31:  # every value sent is at most the rows of x
        raise ValueError(f"x has {x.shape[0]} rows; algorithm={algorithm!r} handles < 2**31")
    row_bytes = x.element_size() * _row_numel(x)
    assert topology is not None, "_fixed_algorithm returns 'flat' without a topology"
    # int32 halves the bytes of this exchange, which runs before every call's rows.
    values = _exchange_matrix(splits, group, algorithm, topology, cost_model, None,
                              _split_device(x.device, group), torch.int32)
    plan, _ = settle_plan(values, splits, 0, dist.get_rank(group), algorithm, topology,
                          cost_model, row_bytes)
    _check_out(known_out, list(plan.out_splits))
    return _run(x, plan, group)


def _run(x: torch.Tensor, plan: AllToAllPlan, group: dist.ProcessGroup | None
         ) -> tuple[torch.Tensor, list[int]]:
    if plan.algorithm == "flat":
        return flat_all_to_all(x, list(plan.in_splits), group, list(plan.out_splits))
    assert plan.splits is not None and plan.topology is not None
    return halo_all_to_all(x, plan.splits, plan.topology, group)


def _payload_rows(payload: Sequence[Sequence[int]] | None, world: int) -> list[list[int]]:
    if payload is None:
        return [[] for _ in range(world)]
    rows = [list(r) for r in payload]
    if len(rows) != world or len({len(r) for r in rows}) > 1:
        raise ValueError(f"payload must hold {world} lists of equal length (one per rank), "
                         f"got lengths {[len(r) for r in rows]}")
    for r in rows:
        for v in r:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"payload must hold ints, got {v!r}")
    return rows


def _fixed_algorithm(algorithm: str, topology: object, cost_model: object, world: int
                     ) -> str:
    """"flat" where the answer is known before any exchange (flat asked for, or auto without
    a topology or on one node: nothing to aggregate), else `algorithm`, after checking that
    the topology fits the group and the cost model is one (auto across nodes needs one)."""
    if algorithm == "flat" or (algorithm == "auto" and topology is None):
        return "flat"
    if not isinstance(topology, Topology):
        raise ValueError(
            f"algorithm={algorithm!r} needs topology=comm.Topology(...), got {topology!r}"
        )
    if topology.world_size != world:
        raise ValueError(
            f"topology describes {topology.world_size} ranks but the group has {world}; "
            "pass topology.restrict(dist.get_process_group_ranks(group))"
        )
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a comm.CostModel, got {cost_model!r}")
    if algorithm == "auto" and topology.num_nodes == 1:
        return "flat"
    if algorithm == "auto" and cost_model is None:
        raise ValueError(
            f"algorithm='auto' across {topology.num_nodes} nodes needs cost_model=: "
            "comm.calibrate(group, topology) measures one on this job's links (the trainer "
            "does), comm.CostModel.from_platform(name) reads a platform file's link rates "
            f"({', '.join(platform_names())}), "
            "comm.CostModel.emulator() is the namespace emulator's NIC. There is no default: "
            "placeholder numbers would decide for another machine"
        )
    return algorithm


def _exchange_matrix(
    splits: list[int],
    group: dist.ProcessGroup | None,
    algorithm: str,
    topology: Topology,
    model: CostModel | None,
    payload: list[list[int]] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> np.ndarray:
    """HALO or auto on more than one node: every rank sends each peer (payload for it, my
    row[, my row's summary]) in one exchange. Returns the values received, a read-only
    array [R * stride] in source order (see `settle_plan`): no Python int per entry of the
    R x R matrix."""
    world = dist.get_world_size(group)
    # auto with the concurrent model sends the summaries that decide in O(R) steps where
    # they can; HALO (and auto with the pairwise model) send the row alone.
    summary = row_summary(splits, dist.get_rank(group), topology) \
        if algorithm == "auto" and model is not None and not model.flat_pairwise else []
    k = len(payload[0]) if payload else 0
    mine = np.asarray(splits + summary, dtype=np.int64)
    # HALO without a payload: every peer gets the same ints, and the two-level all-gather
    # sends (G - 1) + (N - 1) messages per rank instead of R - 1 (None where it does not
    # apply). `auto` keeps flat's one collective: it must not cost more than flat where it
    # runs flat, and at 4 x 2 on 2 cores the two dependent steps took longer than it.
    values = halo_gather_array(mine, group, topology, device, dtype) \
        if algorithm == "halo" and not k else None
    if values is None:
        if payload is not None and k:
            send = np.empty((world, k + len(mine)), dtype=np.int64)
            send[:, :k] = payload
            send[:, k:] = mine
        else:
            send = np.broadcast_to(mine, (world, len(mine)))  # the same ints to every peer
        values = exchange_int_array(send, group, device, dtype)
    return values


def _check_out(known_out: list[int] | None, out: list[int]) -> None:
    if known_out is not None and known_out != out:
        raise ValueError(f"out_splits {known_out} disagree with what the peers send {out}")


def _row_numel(x: torch.Tensor) -> int:
    n = 1
    for size in x.shape[1:]:
        n *= size
    return n

"""`comm.all_to_all`: the one entry point the MoE dispatcher calls.

Contract (R ranks in `group`; T_in = sum(in_splits), T_out = sum(out_splits)):
    x [T_in, ...] rows grouped by destination rank  ->  y [T_out, ...] grouped by source rank.
The result equals `torch.distributed.all_to_all_single` exactly for any splits, zeros and
ranks that send or receive nothing included, and it is differentiable: the backward is the
same exchange with the splits swapped. `algorithm` picks how the rows travel:
    "flat" one all_to_all_single (the vendor collective)
    "halo" hierarchical I (intra-node) || II (packed per remote node) -> III (redistribute)
    "auto" the cheaper of the two under `cost_model`, decided identically on every rank

"auto" (calibrated, concurrent flat model) sends every peer the sender's row together with
an O(R) summary of it (`comm.cost.row_summary`), in the one small exchange that flat (split
sizes) and HALO (the split matrix) make anyway. The summaries decide in O(R) steps per rank
wherever the model's answer does not hinge on HALO's relay hop, the usual case; otherwise
the model is evaluated on the matrix (O(R^2) steps per rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from comm.cost import (
    CostModel,
    choose_algorithm,
    decide_from_summaries,
    row_summary,
)
from comm.flat import (
    _split_device,
    exchange_ints,
    flat_all_to_all,
    gather_split_matrix,
    normalize_splits,
)
from comm.halo import halo_all_to_all
from comm.topology import Topology

__all__ = ["ALGORITHMS", "all_to_all"]

ALGORITHMS = ("flat", "halo", "auto")


def all_to_all(
    x: torch.Tensor,
    in_splits: Sequence[int] | torch.Tensor,
    group: dist.ProcessGroup | None,
    algorithm: str = "flat",
    topology: Topology | None = None,
    out_splits: Sequence[int] | torch.Tensor | None = None,
    cost_model: CostModel | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Uneven all-to-all of the rows of `x`; returns (y, out_splits as list[int]).

    `group` is the process group (None means the default group, as in torch.distributed).
    `topology` describes the ranks of `group` in group-rank order (see `Topology.restrict`);
    "halo" needs it, "auto" falls back to "flat" without it. `out_splits`, when the caller
    already knows them, skips the split-size exchange of the flat path. `cost_model`
    drives "auto" (default: `CostModel.for_backend` of the group's backend).
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
    if algorithm == "flat" or (algorithm == "auto" and topology is None):
        return flat_all_to_all(x, splits, group, known_out)
    return _hierarchical_or_auto(
        x, splits, group, algorithm, topology, known_out, cost_model, _split_device(x, group)
    )


def _hierarchical_or_auto(
    x: torch.Tensor,
    splits: list[int],
    group: dist.ProcessGroup | None,
    algorithm: str,
    topology: object | None,
    known_out: list[int] | None,
    cost_model: object | None,
    device: torch.device,
) -> tuple[torch.Tensor, list[int]]:
    if not isinstance(topology, Topology):
        raise ValueError(
            f"algorithm={algorithm!r} needs topology=comm.Topology(...), got {topology!r}"
        )
    world = dist.get_world_size(group)
    if topology.world_size != world:
        raise ValueError(
            f"topology describes {topology.world_size} ranks but the group has {world}; "
            "pass topology.restrict(dist.get_process_group_ranks(group))"
        )
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a comm.CostModel, got {cost_model!r}")
    rank = dist.get_rank(group)
    if algorithm == "auto" and topology.num_nodes == 1:
        return flat_all_to_all(x, splits, group, known_out)  # nothing to aggregate
    row_bytes = x.element_size() * _row_numel(x)
    model = cost_model or CostModel.for_backend(dist.get_backend(group))
    choice = None if algorithm == "auto" else algorithm
    if algorithm == "auto" and not model.flat_pairwise:
        # My row and its summary to every peer: every rank gets the split matrix (HALO's
        # relays need it) and R summaries that decide in O(R) steps where they can.
        if x.shape[0] >= 2**31:  # every value sent is at most the rows of x
            raise ValueError(f"x has {x.shape[0]} rows; algorithm='auto' handles < 2**31")
        summary = row_summary(splits, rank, topology)
        stride = world + len(summary)
        # int32 halves the bytes of this exchange, which runs in R - 1 dependent steps on
        # gloo and before every call's rows.
        values = exchange_ints((splits + summary) * world, group, device, torch.int32)
        out = values[rank::stride]
        _check_out(known_out, out)
        choice = decide_from_summaries(values, world, stride, row_bytes, topology, model)
        if choice == "flat":
            return flat_all_to_all(x, splits, group, out)
        S = [values[s * stride:s * stride + world] for s in range(world)]
    else:
        # HALO's relays need every rank's splits: one all-gather of R*R ints replaces the
        # all_to_all of R ints that the flat path uses.
        S = gather_split_matrix(splits, group, device)
        out = [S[s][rank] for s in range(world)]
        _check_out(known_out, out)
    if choice is None:
        choice = choose_algorithm(S, row_bytes, topology, model)
    if choice == "flat":
        return flat_all_to_all(x, splits, group, out)
    return halo_all_to_all(x, S, topology, group)


def _check_out(known_out: list[int] | None, out: list[int]) -> None:
    if known_out is not None and known_out != out:
        raise ValueError(f"out_splits {known_out} disagree with what the peers send {out}")


def _row_numel(x: torch.Tensor) -> int:
    n = 1
    for size in x.shape[1:]:
        n *= size
    return n

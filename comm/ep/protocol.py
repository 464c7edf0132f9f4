"""What a MoE layer asks of its dispatcher, and what a dispatcher reports per step.

`model.MoELayer` routes its tokens, sorts the rows by expert slot and hands them to its
`dispatcher`; the dispatcher brings every row to the process holding its slot and the expert
outputs back. `Dispatcher` declares that seam: `model.LocalDispatcher` implements it for one
process (identities; the model package never imports comm, it satisfies the Protocol by
shape), `comm.ep.EPDispatcher` over an EP process group (all-to-all, or the chunked and
deduplicated expert path of `comm.ep.pipeline` when `pipelined`).

A dispatcher's per-step numbers are returned by `take_stats()` as an `ExchangeStats` (None for
a dispatcher that exchanges nothing), never read off attributes.

Shape legend: T tokens, K top-k, D model, E slots of the layer, M rows after dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Dispatcher", "ExchangeStats", "ExpertLayer"]


@dataclass
class ExchangeStats:
    """One dispatcher's forward exchanges since its last `take_stats()`."""

    # wall seconds this rank spent inside forward exchanges: with uneven expert loads it is
    # dominated by waiting for the most-loaded rank; in the chunk pipeline the seconds the
    # forward blocked waiting for rows (the exposed part)
    exchange_s: float = 0.0
    remote_rows: int = 0  # forward dispatch rows this rank sent to ranks on other nodes
    remote_bytes: int = 0  # their bytes
    flat_remote_rows: int = 0  # the rows a flat dispatch would have sent (one per token, slot)
    spans_nodes: bool = False  # the EP group spans nodes (the three counts above mean something)
    node: int = 0  # this rank's node in the EP group's topology
    num_nodes: int = 1


class ExpertLayer(Protocol):
    """What a pipelined dispatcher (`Dispatcher.moe_forward`) uses of its MoE layer
    (`model.MoELayer`)."""

    n_slots: int
    shared_experts: Any  # a module, or None

    def experts(self, x_MD: torch.Tensor, counts: torch.Tensor) -> torch.Tensor: ...

    def shared_forward(self, x_TD: torch.Tensor) -> torch.Tensor: ...

    def sort_rows(self, x_TD: torch.Tensor, slot_idx: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def unsort_rows(self, y_sorted: torch.Tensor, topk_w: torch.Tensor, meta: Any
                    ) -> torch.Tensor: ...


@runtime_checkable
class Dispatcher(Protocol):
    """The seam between a MoE layer and where its expert slots live."""

    @property
    def ep(self) -> int:
        """Processes the layer's slots are spread over (1: all here)."""
        ...

    @property
    def group(self) -> Any:
        """Their process group (None: one process)."""
        ...

    @property
    def topology(self) -> Any:
        """Where the group's ranks sit (a `comm.Topology`; None: one process or not known)."""
        ...

    @property
    def pipelined(self) -> bool:
        """True: the layer hands its whole expert path (shared experts included) to
        `moe_forward`; False: it calls dispatch -> its experts -> combine itself."""
        ...

    def dispatch(self, x_sorted: torch.Tensor, counts_E: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Rows x_sorted [T*K, D] grouped by global slot, counts [E] -> (rows [M, D] of this
        process's slots grouped by local slot, their counts [E_local], context for combine)."""
        ...

    def combine(self, y_loc: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The expert outputs [M, D] back to where their rows came from: [T*K, D]."""
        ...

    def moe_forward(self, layer: ExpertLayer, x_TD: torch.Tensor, slot_idx: torch.Tensor,
                    topk_w: torch.Tensor) -> torch.Tensor:
        """With `pipelined`: the routed plus shared experts' output [T, D]."""
        ...

    def take_stats(self) -> ExchangeStats | None:
        """The exchanges since the last call (and start counting afresh); None: none happen."""
        ...

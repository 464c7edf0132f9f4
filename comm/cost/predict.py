"""The one flat/HALO cost path: `predict(S, row_bytes, topo, model, method)`.

Inputs: the split matrix S [R, R] (rows), bytes per row, the Topology and a `CostModel`.
The model reads the loads off S (bytes through the busiest NIC, message counts, what each
relay forwards) and turns them into seconds with comm.cost.a2a_model's `flat_time`, `phase_time`
and `halo_time`. The implementations behind `predict` compute the same numbers:

    "loops"       the definition, plain loops per entry (comm/cost/reference.py)
    "one-pass"    one pass of plain Python over S, small groups (onepass.py)
    "vectorised"  numpy over [R, R], any topology, the pairwise flat model too (vectorised.py)
    "blocked"     numpy over S's [N, G, N, G] blocks, node-major equal nodes (blocked.py)
    "auto"        what `choose_algorithm` runs on a call: one-pass up to SMALL_GROUP ranks,
                  blocked where the topology allows, vectorised otherwise

tests/test_comm_cost.py checks each against "loops". Row summaries (comm/cost/summary.py)
bracket the same prediction from O(R) numbers per rank. The decision depends only on data
every rank holds identically (S, topology, parameters), so all ranks pick the same algorithm
without another collective.
"""

from __future__ import annotations

import numpy as np

from comm.cost.blocked import decide_blocked, predict_blocked
from comm.cost.layout import bytes_matrix, layout, nic_load
from comm.cost.model import CostModel
from comm.cost.onepass import one_pass
from comm.cost.reference import Prediction, decide, reference_predict
from comm.cost.vectorised import predict_vectorised, vectorised_flat, vectorised_halo
from comm.topology import Topology

__all__ = ["METHODS", "SMALL_GROUP", "busiest_nic_bytes", "choose_algorithm", "predict",
           "predict_flat", "predict_halo"]

SMALL_GROUP = 32  # up to this many ranks `auto` runs the one-pass implementation
METHODS = ("auto", "loops", "one-pass", "vectorised", "blocked")

Splits = list[list[int]] | np.ndarray


def _method(S: Splits, topo: Topology, model: CostModel, method: str) -> str:
    """The implementation `method` names, "auto" resolved; ValueError where it cannot run."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    concurrent = not model.flat_pairwise
    if method == "auto":
        if topo.world_size <= SMALL_GROUP and concurrent:
            return "one-pass"
        return "blocked" if concurrent and layout(topo).blocked is not None else "vectorised"
    if method in ("one-pass", "blocked") and not concurrent:
        raise ValueError(f"method={method!r} models the concurrent flat collective only "
                         "(model.flat_pairwise=False); use 'vectorised' or 'loops'")
    if method == "blocked" and layout(topo).blocked is None:
        raise ValueError("method='blocked' needs a node-major topology of equal nodes with "
                         "rail-aligned relays; use 'vectorised'")
    return method


def predict(S: Splits, row_bytes: int, topo: Topology, model: CostModel,
            method: str = "auto") -> Prediction:
    """Predicted seconds of flat and HALO for the split matrix S (lists or an integer array
    [R, R]) and the bytes through the busiest NIC direction, by implementation `method`
    (module docstring; every one equals "loops" up to float summation order)."""
    impl = _method(S, topo, model, method)
    if impl == "blocked":
        return predict_blocked(np.asarray(S), row_bytes, layout(topo), model)
    if impl == "vectorised":
        return predict_vectorised(S, row_bytes, topo, model)
    rows = S.tolist() if isinstance(S, np.ndarray) else S
    if impl == "one-pass":
        return one_pass(rows, row_bytes, layout(topo), model)
    return reference_predict(rows, row_bytes, topo, model)


def choose_algorithm(S: Splits, row_bytes: int, topo: Topology, model: CostModel) -> str:
    """"halo" when it is predicted strictly faster, else "flat" (the safe default):
    `decide(predict(S, ..., method="auto"), model)`, the predictions scaled by
    `model.correction` at the exchange's busiest-NIC bytes. One node is always flat
    (nothing to aggregate: HALO degenerates to flat plus overhead). On the blocked
    implementation HALO's relay fan-out is counted only where the decision hinges on it
    (`decide_blocked`: the same answer)."""
    if topo.num_nodes == 1:
        return "flat"
    impl = _method(S, topo, model, "auto")
    if impl == "blocked":
        return decide_blocked(np.asarray(S), row_bytes, layout(topo), model)
    return decide(predict(S, row_bytes, topo, model, impl), model)


def predict_flat(S: Splits, row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of the flat all-to-all (the slowest NIC / rank decides)."""
    return vectorised_flat(bytes_matrix(S, row_bytes), layout(topo), model)


def predict_halo(S: Splits, row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of HALO: max(phase I, phase II + phase III) + fixed overhead."""
    return vectorised_halo(bytes_matrix(S, row_bytes), layout(topo), model)


def busiest_nic_bytes(S: Splits, row_bytes: int, topo: Topology) -> float:
    """Bytes through the busiest NIC direction (sent or received off-node); both algorithms
    move the same."""
    L = layout(topo)
    return max(nic_load(L, bytes_matrix(S, row_bytes) * L.remote))

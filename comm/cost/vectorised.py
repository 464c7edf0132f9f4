"""The cost model vectorised with numpy over the whole split matrix: any topology, and the
pairwise flat collective (gloo's) too. `comm.cost.predict(..., method="vectorised")`."""

from __future__ import annotations

import numpy as np

from comm.cost.a2a_model import flat_time, halo_time, phase_time
from comm.cost.layout import Layout, bytes_matrix, layout, nic_load
from comm.cost.model import CostModel
from comm.cost.reference import Prediction
from comm.topology import Topology

__all__ = ["predict_vectorised", "vectorised_flat", "vectorised_halo"]


def predict_vectorised(S: list[list[int]] | np.ndarray, row_bytes: int, topo: Topology,
                       model: CostModel) -> Prediction:
    """Flat, HALO and busiest-NIC bytes of S, each a few numpy passes over [R, R]."""
    B, L = bytes_matrix(S, row_bytes), layout(topo)
    return Prediction(vectorised_flat(B, L, model), vectorised_halo(B, L, model),
                      max(nic_load(L, B * L.remote)))


def vectorised_flat(B: np.ndarray, L: Layout, model: CostModel) -> float:
    R = len(L.node)
    if model.flat_pairwise:
        ar = np.arange(R)
        steps = np.arange(1, R)[:, None]
        dst, src = (ar + steps) % R, (ar - steps) % R  # [R-1, R]
        send, recv = B[ar, dst], B[src, ar]
        send_remote, recv_remote = L.remote[ar, dst], L.remote[src, ar]

        def cost(nbytes: np.ndarray, far: np.ndarray) -> np.ndarray:
            bw = np.where(far, model.nic_bandwidth, model.local_bandwidth)
            alpha = np.where(far, model.alpha_net, model.alpha_local)
            if model.flat_empty_messages:
                return nbytes / bw + alpha
            return np.where(nbytes > 0, nbytes / bw + alpha, 0.0)

        rank_t = (cost(send, send_remote) + cost(recv, recv_remote)).max(axis=1)
        wire = (send * send_remote).ravel()
        base = (np.arange(R - 1)[:, None] * L.n_nics).repeat(R, 1)  # one NIC table per step
        size = (R - 1) * L.n_nics
        out = np.bincount((base + L.nic[None, :]).ravel(), wire, minlength=size)
        inn = np.bincount((base + L.nic[dst]).ravel(), wire, minlength=size)
        nic_t = np.maximum(out.reshape(R - 1, L.n_nics).max(axis=1),
                           inn.reshape(R - 1, L.n_nics).max(axis=1)) / model.nic_bandwidth
        return float(np.maximum(rank_t, nic_t).sum())
    nonzero = np.ones_like(B, dtype=bool) if model.flat_empty_messages else B > 0
    net_msgs = int((nonzero & L.remote).sum(axis=1).max())
    local_bytes = float((B * L.local).sum(axis=1).max())
    local_msgs = int((nonzero & L.local).sum(axis=1).max())
    return flat_time(max(nic_load(L, B * L.remote)), net_msgs, local_bytes, local_msgs, model)


def vectorised_halo(B: np.ndarray, L: Layout, model: CostModel) -> float:
    R = len(L.node)
    per_node = (B * L.remote) @ L.onehot  # [R, N] bytes s sends to node m
    out_b = float(np.bincount(L.nic, per_node.sum(axis=1), minlength=L.n_nics).max())
    in_b = float(np.bincount(L.relay_nic.ravel(), per_node.ravel(), minlength=L.n_nics).max())
    net_msgs = int((per_node > 0).sum(axis=1).max())
    t_inter = phase_time(max(out_b, in_b), net_msgs, model.nic_bandwidth, model.alpha_net)
    forwarded = L.forwarding & (B > 0)
    hops, dsts = L.hop[forwarded], np.nonzero(forwarded)[1]
    relayed = np.bincount(hops, B[forwarded], minlength=R)
    seen = np.zeros((R, R), dtype=bool)  # seen[r, d]: relay r forwards something to d
    seen[hops, dsts] = True
    t_relay = float(phase_time(relayed, seen.sum(axis=1), model.local_bandwidth,
                               model.alpha_local).max())
    t_intra = float(phase_time((B * L.local).sum(axis=1), ((B > 0) & L.local).sum(axis=1),
                               model.local_bandwidth, model.alpha_local).max())
    return halo_time(t_intra, t_inter, t_relay, model)

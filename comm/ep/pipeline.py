"""The MoE layer's expert exchanges as a pipeline of chunks (--comm.a2a_overlap=layer,
--comm.a2a_chunks=c) and the deduplicated dispatch (--comm.alltoall=dedup).

`moe_forward(disp, layer, x, slot_idx, topk_w)` replaces permute -> dispatch -> experts ->
combine -> unpermute (+ shared experts) of `model.moe.MoELayer.forward` when the EP
dispatcher asks for it (`EPDispatcher.pipelined`). What it uses of the layer is
`comm.ep.ExpertLayer` (its row sort and unsort, experts, shared experts): comm does not
import the model or its kernels. The tokens split into c contiguous chunks;
every chunk is a generator that runs one stage per `next()` and ends each stage by starting an
exchange (`comm.collectives.overlap.exchange_start`), whose rows the next stage waits for:

    flat / halo   S0 permute, start dispatch | S1 wait, expert GEMMs, start combine |
                  S2 wait, unpermute
    dedup         S0 items, start X1 | S1 wait, fan-out, start X2 | S2 wait, expert GEMMs,
                  start X2^T | S3 wait, weighted sum per item, start X1^T | S4 wait, add
                  (comm.collectives.dedup)

Tick tau runs stage 0 of chunk tau, then stage 1 of chunk tau - 1, and so on (newest chunk
first), so while chunk i's expert GEMMs run, chunk i+1's dispatch and chunk i-1's combine are
in flight. The shared experts run right after chunk 0's first dispatch started. Autograd runs
the backward in the mirrored order (comm/collectives/overlap.py): every gradient exchange is in flight
while the backward of what the forward ran beside it runs. With overlap "none" (dedup alone)
each chunk runs to its end before the next starts and the shared experts run last. With
overlap "fb" the layer runs as with "layer", and every start also hands the dispatcher's
`baton` (comm.collectives.overlap.Baton) to another micro-batch's work, if one is paired.

All splits are settled before any row moves, in one small exchange (flat, dedup) or one per
chunk (halo, auto: each needs the chunk's split matrix), so every rank starts the same
exchanges in the same order. The chunk count is the same on every rank (chunks may be empty).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from comm.collectives.alltoall import AllToAllPlan, plan_all_to_all
from comm.collectives.dedup import block_order, fanout, meta_columns, plan_dedup, source_items
from comm.collectives.overlap import ExchangeHandle, exchange_start, exchange_wait
from comm.ep.protocol import ExpertLayer

__all__ = ["moe_forward", "run_chunks", "slot_major_order"]

Chunk = Generator[None, None, torch.Tensor]


def run_chunks(chunks: list[Chunk], overlap: bool, side: Callable[[], Any] | None = None
               ) -> tuple[list[torch.Tensor], Any]:
    """Run the chunk generators on the skewed schedule (module docstring); `side` (the shared
    experts) runs after the first stage of chunk 0. Returns (chunk outputs, side's result)."""
    outs: list[Any] = [None] * len(chunks)
    side_out = None
    if not overlap:
        for i, g in enumerate(chunks):
            outs[i] = _finish(g)
        return outs, (side() if side is not None else None)
    waiting = list(enumerate(chunks))
    active: list[tuple[int, Chunk]] = []
    first = True
    while waiting or active:
        if waiting:
            active.insert(0, waiting.pop(0))
        for item in list(active):
            try:
                next(item[1])
            except StopIteration as stop:
                outs[item[0]] = stop.value
                active.remove(item)
        if first:
            first = False
            if side is not None:
                side_out = side()
    return outs, side_out


def _finish(g: Chunk) -> torch.Tensor:
    while True:
        try:
            next(g)
        except StopIteration as stop:
            return stop.value


def slot_major_order(recv_SE: list[list[int]], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows arrive source-major (block (s, j): recv_SE[s][j] rows for my local slot j);
    (order, counts_loc) regroup them slot-major for the grouped GEMM."""
    blocks = [(j, n) for row in recv_SE for j, n in enumerate(row)]
    order, counts = block_order(blocks, device)
    El = len(recv_SE[0]) if recv_SE else 0
    if counts.numel() < El:
        counts = torch.cat([counts, counts.new_zeros(El - counts.numel())])
    return order, counts


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def _exchange(x: torch.Tensor, plan: AllToAllPlan, group: Any, disp: Any, handles: list,
              reverse: AllToAllPlan | None = None) -> tuple[torch.Tensor, ExchangeHandle]:
    # only fb hands over (auto's trial may run another overlap on the fb schedule)
    h = ExchangeHandle(plan, group, reverse,
                       getattr(disp, "baton", None) if disp.overlap == "fb" else None)
    handles.append(h)
    return exchange_start(x, h), h


def moe_forward(disp: Any, layer: ExpertLayer, x_TD: torch.Tensor, slot_idx: torch.Tensor,
                topk_w: torch.Tensor, handles: list | None = None) -> torch.Tensor:
    """The routed experts' output plus the shared experts' for tokens x [T, D] routed to
    slots slot_idx [T, K] with weights topk_w [T, K] (module docstring); every exchange's
    `ExchangeHandle` is appended to `handles`."""
    handles = [] if handles is None else handles
    T = x_TD.shape[0]
    c = disp.chunks
    cuts = [T * i // c for i in range(c + 1)]
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    n_slots = layer.n_slots
    # every chunk's per-slot counts (and, for dedup, items per relay) in one device -> host copy
    chunk_of = torch.repeat_interleave(
        torch.arange(c, device=slot_idx.device),
        torch.tensor([b - a for a, b in spans], device=slot_idx.device))
    counts_cQ_t = torch.bincount((chunk_of[:, None] * n_slots + slot_idx).reshape(-1),
                                 minlength=c * n_slots).view(c, n_slots)
    row_bytes = x_TD.element_size() * x_TD.shape[1]
    if disp.algorithm == "dedup":
        items = [source_items(slot_idx[a:b], disp.local, disp.topology, disp.rank)
                 for a, b in spans]
        R = disp.ep
        items_cR_t = torch.stack([torch.bincount(it[2], minlength=R) for it in items]) \
            if c else counts_cQ_t.new_zeros(0, R)
        host = torch.cat([counts_cQ_t, items_cR_t], 1).tolist()
        counts_cQ = [r[:n_slots] for r in host]
        items_cR = [r[n_slots:] for r in host]
        plans = plan_dedup(counts_cQ, items_cR, disp.local, disp.topology, disp.group,
                           x_TD.device)
        K = slot_idx.shape[1]
        elt = x_TD.element_size()
        for p in plans:
            disp.stats.remote_rows += p.remote_items
            disp.stats.remote_bytes += p.remote_items * (x_TD.shape[1] + K
                                                         + meta_columns(K, x_TD.dtype)) * elt
            disp.stats.flat_remote_rows += p.remote_pairs
        gens = [_dedup_chunk(disp, handles, layer, x_TD[a:b], slot_idx[a:b], topk_w[a:b], it, p)
                for (a, b), it, p in zip(spans, items, plans, strict=True)]
    else:
        counts_cQ = counts_cQ_t.tolist()
        chunk_plans = _plan_chunks(disp, counts_cQ, row_bytes, x_TD.device)
        for cq in counts_cQ:
            remote = disp.remote_pair_rows(cq)
            disp.stats.remote_rows += remote
            disp.stats.remote_bytes += remote * row_bytes
            disp.stats.flat_remote_rows += remote
        gens = [_flat_chunk(disp, handles, layer, x_TD[a:b], slot_idx[a:b], topk_w[a:b], plan,
                           recv)
                for (a, b), (plan, recv) in zip(spans, chunk_plans, strict=True)]
    side = None
    if layer.shared_experts is not None:
        def side() -> torch.Tensor:
            return layer.shared_forward(x_TD)
    outs, shared = run_chunks(gens, disp.overlap in ("layer", "fb"), side)
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    if shared is not None:
        y = y + shared
    return y


def _plan_chunks(disp: Any, counts_cQ: list[list[int]], row_bytes: int, device: torch.device
                 ) -> list[tuple[AllToAllPlan, list[list[int]]]]:
    """(plan, recv_SE) of every chunk: flat in one exchange carrying every chunk's counts,
    halo / auto one `comm.plan_all_to_all` per chunk (each needs its split matrix)."""
    R, El = disp.ep, disp.local
    c = len(counts_cQ)

    def splits(cq: list[int]) -> list[int]:
        return [sum(cq[d * El:(d + 1) * El]) for d in range(R)]

    if disp.algorithm == "flat" or disp.topology is None:
        payload = [[v for cq in counts_cQ for v in cq[d * El:(d + 1) * El]] for d in range(R)]
        total = [sum(col) for col in zip(*(splits(cq) for cq in counts_cQ), strict=True)]
        _, recv = plan_all_to_all(total, disp.group, "flat", None, None, row_bytes,
                                       payload, device)
        out = []
        for i, cq in enumerate(counts_cQ):
            recv_SE = [r[i * El:(i + 1) * El] for r in recv]
            plan = AllToAllPlan(tuple(splits(cq)), tuple(sum(r) for r in recv_SE), "flat")
            out.append((plan, recv_SE))
        return out
    out = []
    for i in range(c):
        cq = counts_cQ[i]
        plan, recv = plan_all_to_all(splits(cq), disp.group, disp.algorithm,
                                          disp.topology, disp.cost_model, row_bytes,
                                          [cq[d * El:(d + 1) * El] for d in range(R)], device)
        out.append((plan, recv))
    return out


def _flat_chunk(disp: Any, handles: list, layer: ExpertLayer, x: torch.Tensor,
                slot: torch.Tensor, w: torch.Tensor,
                plan: AllToAllPlan, recv_SE: list[list[int]]) -> Chunk:
    x_sorted, _, meta = layer.sort_rows(x, slot)
    tok, h = _exchange(x_sorted, plan, disp.group, disp, handles)
    yield
    got = exchange_wait(tok, h)
    order, counts_loc = slot_major_order(recv_SE, got.device)
    y_loc = layer.experts(got.index_select(0, order), counts_loc.to(got.device))
    back_plan = h.reverse
    tok, h = _exchange(y_loc.index_select(0, _inverse(order)), back_plan, disp.group, disp,
                       handles, reverse=plan)
    yield
    back = exchange_wait(tok, h)
    return layer.unsort_rows(back, w.to(back.dtype), meta)


def _dedup_chunk(disp: Any, handles: list, layer: ExpertLayer, x: torch.Tensor,
                 slot: torch.Tensor, w: torch.Tensor,
                 items: tuple[torch.Tensor, torch.Tensor, torch.Tensor], p: Any) -> Chunk:
    item_tok, item_on, _ = items
    D, K = x.shape[1], slot.shape[1]
    El, R = disp.local, disp.ep
    # X1: one row per (token, node): x_t, the token's weights for that node's choices, and
    # its slots there (int32, -1 off the node) bit for bit in the last columns, so one
    # exchange carries the item (the slot columns' gradient is zero and never read)
    n32 = meta_columns(K, x.dtype) * x.element_size() // 4
    meta = torch.full((item_tok.numel(), n32), -1, dtype=torch.int32, device=x.device)
    meta[:, :K] = torch.where(item_on, slot.index_select(0, item_tok), -1)
    rows = torch.cat([x.index_select(0, item_tok),
                      w.to(x.dtype).index_select(0, item_tok) * item_on.to(x.dtype),
                      meta.view(x.dtype)], 1)
    tok_rows, h_rows = _exchange(rows, p.x1, disp.group, disp, handles)
    yield
    U = exchange_wait(tok_rows, h_rows)
    M = U.detach()[:, D + K:].contiguous().view(torch.int32)[:, :K]
    # X2: the relay fans each item out to its node's expert ranks
    pair_u, pair_j = fanout(M, list(p.x1.out_splits), El, R)
    # the pairs' weights: a gather from the flat [I * K] weight columns (its backward is an
    # index_add, where advanced indexing's is an accumulating index_put that sorts)
    W = U[:, D:D + K].reshape(-1).index_select(0, pair_u * K + pair_j)
    tok2, h2 = _exchange(U[:, :D].index_select(0, pair_u), p.x2, disp.group, disp, handles)
    yield
    got = exchange_wait(tok2, h2)
    order, counts_loc = block_order(p.arrival, got.device)
    if counts_loc.numel() < El:
        counts_loc = torch.cat([counts_loc, counts_loc.new_zeros(El - counts_loc.numel())])
    y_loc = layer.experts(got.index_select(0, order), counts_loc.to(got.device))
    tok2, h2 = _exchange(y_loc.index_select(0, _inverse(order)), h2.reverse, disp.group, disp,
                         handles, reverse=p.x2)
    yield
    y_pairs = exchange_wait(tok2, h2)
    # the relay weights its node's expert outputs and sums them per item: one row returns
    z = y_pairs * W.to(y_pairs.dtype)[:, None]
    Z = z.new_zeros((U.shape[0], z.shape[1])).index_add(0, pair_u, z)
    tok1, h1 = _exchange(Z, h_rows.reverse, disp.group, disp, handles, reverse=p.x1)
    yield
    back = exchange_wait(tok1, h1)
    return back.new_zeros((x.shape[0], back.shape[1])).index_add(0, item_tok, back)

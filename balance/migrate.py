"""Expert migration executor: carry out a swap plan inside one EP group.

Physical slots are numbered globally: rank r owns slots ``[r*S, (r+1)*S)`` and stores them as
dim 0 of every per-expert tensor (``w [S, ...]``, its ``.grad``, Adam ``exp_avg`` and
``exp_avg_sq``, ...). ``expert2slot [E]`` maps each logical expert to its global slot; the
dispatcher routes a token for logical expert e to rank ``expert2slot[e] // S``, local row
``expert2slot[e] % S``.

A plan is first composed into one permutation of the map, so an expert that takes part in
several swaps travels once, straight to its final slot. Then every rank packs the rows it
must send into one contiguous buffer per (peer, tensor), posts all receives, then all sends
(gloo matches a send only to an already posted receive without deadlock; NCCL gets the same
list through ``batch_isend_irecv`` so its group call pairs them), and finally writes the
received rows into place. Rows are read into buffers before any row is written, so chains
and cycles of moves are safe.

All ranks of the group must call :func:`migrate` with the same ``swaps`` and ``expert2slot``;
the returned map is then identical everywhere (checked by default with two tiny all-reduces).

Shape legend: E logical experts of one layer, R ranks in the EP group, S = E / R.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from balance.placement import Swap

__all__ = ["MigrationResult", "expert_state_tensors", "migrate", "permute_slots", "placement_of"]


@dataclass(frozen=True)
class MigrationResult:
    expert2slot: torch.Tensor  # [E] the new map, same dtype and device as the input map
    moved_experts: int  # logical experts whose slot changed (group-wide)
    bytes_sent: int  # bytes this rank sent
    bytes_received: int  # bytes this rank received
    seconds: float  # wall time of this rank's part, packing and unpacking included


def _check_map(expert2slot: Any) -> list[int]:
    m = torch.as_tensor(expert2slot).detach().cpu()
    if m.ndim != 1 or m.numel() == 0 or m.dtype.is_floating_point:
        raise ValueError(
            f"expert2slot must be a non-empty 1-D integer tensor [E], got {m.dtype} {list(m.shape)}"
        )
    vals = m.tolist()
    if sorted(vals) != list(range(len(vals))):
        raise ValueError(f"expert2slot must be a permutation of 0..{len(vals) - 1}, got {vals}")
    return vals


def placement_of(expert2slot: Any, n_ranks: int) -> list[int]:
    """``expert2rank [E]`` (what the planners take) from ``expert2slot [E]``."""
    vals = _check_map(expert2slot)
    if n_ranks < 1 or len(vals) % n_ranks != 0:
        raise ValueError(f"{len(vals)} slots cannot be split evenly over n_ranks={n_ranks}")
    slots = len(vals) // n_ranks
    return [s // slots for s in vals]


def permute_slots(expert2slot: Any, swaps: Sequence[Swap], n_ranks: int) -> list[int]:
    """The map after ``swaps`` (each exchanges two experts' slots); pure, no communication."""
    new = _check_map(expert2slot)
    n = len(new)
    if n_ranks < 1 or n % n_ranks != 0:
        raise ValueError(f"{n} slots cannot be split evenly over n_ranks={n_ranks}")
    slots = n // n_ranks
    for i, s in enumerate(swaps):
        if not isinstance(s, Swap):
            raise ValueError(f"swaps[{i}] is not a balance.Swap: {s!r}")
        a, b = s.expert_a, s.expert_b
        if a >= n or b >= n:
            raise ValueError(f"swap #{i} {s} names an expert outside [0, {n})")
        if new[a] // slots == new[b] // slots:
            raise ValueError(
                f"swap #{i} {s}: both experts are on rank {new[a] // slots}; a swap must "
                "join experts on different ranks"
            )
        new[a], new[b] = new[b], new[a]
    return new


def expert_state_tensors(
    params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor | None]:
    """Per-slot tensors of expert parameters: each param, its ``.grad``, its optimizer state.

    ``params`` are this rank's expert parameters, each ``[S, ...]`` (e.g. the w1/w2/w3 of one
    layer). For each, in order: the parameter, its grad (None if not allocated) and every
    state tensor of ``optimizer`` with the parameter's shape, sorted by state key (Adam:
    ``exp_avg``, ``exp_avg_sq``); scalars such as Adam's ``step`` are shared by all slots and
    stay. Ranks with identical models and optimizers get identical list structures, which
    :func:`migrate` relies on.
    """
    out: list[torch.Tensor | None] = []
    for p in params:
        out += [_local(p), _local(p.grad)]
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state, key=str):
            v = state[key]
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                out.append(_local(v))
    return out


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (ZeRO-3 shards expert stacks on a dim > 0, so the shard keeps
    every slot row: moving its rows moves this rank's columns of each expert), else t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _global_rank(group: Any, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def _check_consistent(new: list[int], group: Any, device: torch.device) -> None:
    t = torch.tensor(new, dtype=torch.int64, device=device)
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise ValueError(
            "ranks disagree on the migration (different swaps or expert2slot were passed); "
            "every rank of the EP group must call migrate with the same plan"
        )


def migrate(
    swaps: Sequence[Swap],
    expert2slot: torch.Tensor,
    slot_tensors: Sequence[torch.Tensor | None],
    group: Any = None,
    *,
    check: bool = True,
) -> MigrationResult:
    """Move experts between the ranks of ``group`` so that they follow ``swaps``.

    Args:
        swaps: the plan (same on every rank), e.g. from :func:`balance.plan_swaps` on
            ``placement_of(expert2slot, R)``.
        expert2slot: ``[E]`` logical expert -> global physical slot, before the migration.
        slot_tensors: this rank's per-slot tensors, each with dim 0 == S (weights, grads,
            optimizer moments ...), modified in place; ``None`` entries (a grad not yet
            allocated) are skipped. Every rank must pass the same list structure.
        group: the EP process group (None: the default group).
        check: verify with two all-reduces that all ranks computed the same new map.

    Returns:
        :class:`MigrationResult` with the new map and the measured cost.
    """
    t0 = time.perf_counter()
    rank, n_ranks = dist.get_rank(group), dist.get_world_size(group)
    old = _check_map(expert2slot)
    new = permute_slots(old, swaps, n_ranks)
    slots = len(old) // n_ranks
    tensors = list(slot_tensors)
    for i, t in enumerate(tensors):
        if t is not None and (t.ndim == 0 or t.shape[0] != slots):
            raise ValueError(
                f"slot_tensors[{i}] has shape {list(t.shape)}; dim 0 must be the {slots} local "
                f"slots (E={len(old)} experts over {n_ranks} ranks)"
            )
    live = [t for t in tensors if t is not None]
    device = live[0].device if live else torch.device("cpu")

    # Row lists per peer, in logical-expert order on both sides so they pair up.
    send_rows: dict[int, list[int]] = {}
    recv_rows: dict[int, list[int]] = {}
    local_src: list[int] = []
    local_dst: list[int] = []
    moved = 0
    for o, n in zip(old, new, strict=True):
        if o == n:
            continue
        moved += 1
        src, dst = o // slots, n // slots
        if src == rank and dst == rank:
            local_src.append(o % slots)
            local_dst.append(n % slots)
        elif src == rank:
            send_rows.setdefault(dst, []).append(o % slots)
        elif dst == rank:
            recv_rows.setdefault(src, []).append(n % slots)

    def idx(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=device)

    with torch.no_grad():
        # Read everything this rank gives away or shuffles before anything is overwritten.
        send_bufs = {p: [t.index_select(0, idx(r)) for t in live] for p, r in send_rows.items()}
        local_bufs = [t.index_select(0, idx(local_src)) for t in live] if local_src else []
        recv_bufs = {
            p: [t.new_empty((len(r), *t.shape[1:])) for t in live] for p, r in recv_rows.items()
        }
        backend = dist.get_backend(group)
        ops: list[dist.P2POp] = []
        for p in sorted(recv_bufs):
            for k, buf in enumerate(recv_bufs[p]):
                ops.append(dist.P2POp(dist.irecv, buf, _global_rank(group, p), group, tag=k))
        for p in sorted(send_bufs):
            for k, buf in enumerate(send_bufs[p]):
                ops.append(dist.P2POp(dist.isend, buf, _global_rank(group, p), group, tag=k))
        if ops:
            if backend == "nccl":
                works = dist.batch_isend_irecv(ops)
            else:
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
            for w in works:
                w.wait()
        if local_bufs:
            for t, buf in zip(live, local_bufs, strict=True):
                t.index_copy_(0, idx(local_dst), buf)
        for p, rows in recv_rows.items():
            for t, buf in zip(live, recv_bufs[p], strict=True):
                t.index_copy_(0, idx(rows), buf)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if check:
        _check_consistent(new, group, device)
    out = torch.as_tensor(expert2slot)
    return MigrationResult(
        expert2slot=out.new_tensor(new),
        moved_experts=moved,
        bytes_sent=sum(b.numel() * b.element_size() for v in send_bufs.values() for b in v),
        bytes_received=sum(b.numel() * b.element_size() for v in recv_bufs.values() for b in v),
        seconds=seconds,
    )

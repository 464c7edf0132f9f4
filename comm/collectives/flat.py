"""Flat (single-hop) uneven all-to-all: the vendor collective with split handling and autograd.

Layout (R ranks in `group`, rows of any trailing shape):
    x [sum(in_splits), ...]   rows grouped by destination rank, destination 0 first
    y [sum(out_splits), ...]  rows grouped by source rank, source 0 first
    in_splits[d]  rows this rank sends to rank d      (list[int] or 1-D tensor, length R)
    out_splits[s] rows this rank receives from rank s (= in_splits of rank s at index "me")

The split sizes are exchanged first with one tiny `all_to_all_single` on an int64 tensor
(skipped when the caller already knows `out_splits`), then the rows move with
`torch.distributed.all_to_all_single`. The backward is the same exchange with the two split
lists swapped, so gradients flow back to the rows that produced them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "FlatAllToAll",
    "exchange_int_array",
    "exchange_ints",
    "exchange_splits",
    "flat_all_to_all",
    "normalize_splits",
    "reference_all_to_all",
]

Splits = Sequence[int] | torch.Tensor


def normalize_splits(splits: Splits, world: int, name: str = "in_splits") -> list[int]:
    """Return `splits` as a list of `world` non-negative python ints, or raise ValueError."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1:
            raise ValueError(f"{name} must be a 1-D tensor, got shape {tuple(splits.shape)}")
        if splits.is_floating_point() or splits.is_complex():
            raise ValueError(f"{name} must hold integers, got dtype {splits.dtype}")
        values = [int(v) for v in splits.tolist()]
    else:
        values = []
        for v in splits:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must hold ints, got {v!r} in {list(splits)!r}")
            values.append(int(v))
    if len(values) != world:
        raise ValueError(f"{name} has {len(values)} entries but the group has {world} ranks")
    negative = [v for v in values if v < 0]
    if negative:
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values


def _split_device(
    rows_device: torch.device | str, group: dist.ProcessGroup | None
) -> torch.device:
    # NCCL only moves device tensors; gloo moves CPU tensors. The split exchange follows the
    # rows except when they live on a device the backend cannot serve (gloo with CUDA rows).
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return torch.device(rows_device)


def exchange_ints(
    values: list[int], group: dist.ProcessGroup | None, device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> list[int]:
    """One all_to_all_single of ints (`dtype`: int64 or int32, which the values must fit):
    equal chunks of `values` go to the ranks in order, and the chunks received come back in
    source order as python ints.

    The buffers are tensors that torch allocated, filled and read through numpy views
    (`torch.tensor(list)` and `.tolist()` cost ~3x more CPU when their code is cold in the
    cache, as it is between exchanges). They used to be Python `array`s seen through
    `torch.frombuffer`: a tensor whose memory a Python object owns needs the GIL when its
    last reference goes, and the backend's worker thread may drop that reference after the
    call has returned, up to interpreter shutdown, where a thread that takes the GIL is
    ended by pthread_exit (`terminate called without an active exception`).
    """
    n = len(values)
    send = torch.empty(n, dtype=dtype)
    send.numpy()[:] = values
    if device.type != "cpu":
        send = send.to(device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return (recv if device.type == "cpu" else recv.cpu()).numpy().tolist()


def exchange_int_array(
    send: np.ndarray, group: dist.ProcessGroup | None, device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> np.ndarray:
    """`exchange_ints` for HALO and `auto`, whose exchanges carry R x R ints: an array in
    (flattened in C order), a 1-D read-only array out (no Python int per value; `.tolist()` of 1M ints alone
    cost ~10 ms). Both buffers are tensors that torch allocated, seen from numpy without a
    copy, so the backend never holds memory that a Python object owns."""
    send_t = torch.empty(send.size, dtype=dtype)
    send_t.numpy().reshape(send.shape)[...] = send  # one copy, also from a broadcast view
    if device.type != "cpu":
        send_t = send_t.to(device)
    recv_t = torch.empty_like(send_t)
    dist.all_to_all_single(recv_t, send_t, group=group)
    out = recv_t.numpy() if device.type == "cpu" else recv_t.cpu().numpy()
    out.flags.writeable = False
    return out


def exchange_splits(
    in_splits: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> list[int]:
    """out_splits[s] = in_splits of rank s at my index: one int64 all_to_all_single."""
    return exchange_ints(in_splits, group, device)


def _exchange_rows(
    x: torch.Tensor,
    in_splits: list[int],
    out_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    x = x.contiguous()
    y = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(
        y, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return y


class FlatAllToAll(torch.autograd.Function):
    """y = all_to_all_single(x); dx = all_to_all_single(dy) with the splits swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        in_splits: list[int],
        out_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.in_splits = in_splits
        ctx.out_splits = out_splits
        ctx.group = group
        return _exchange_rows(x, in_splits, out_splits, group)

    @staticmethod
    def backward(
        ctx: Any, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        grad_x = _exchange_rows(grad_y, ctx.out_splits, ctx.in_splits, ctx.group)
        return grad_x, None, None, None


def flat_all_to_all(
    x: torch.Tensor,
    in_splits: list[int],
    group: dist.ProcessGroup | None,
    out_splits: list[int] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Flat uneven all-to-all on validated python split lists; see the module docstring."""
    if out_splits is None:
        out_splits = exchange_splits(in_splits, group, _split_device(x.device, group))
    return FlatAllToAll.apply(x, in_splits, out_splits, group), out_splits


def reference_all_to_all(xs: Sequence[torch.Tensor], S: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Plain-torch definition, one process: y_d = cat over s of x_s's rows for d.

    xs[s] is rank s's input, S[s][d] the rows it sends to d; returns every rank's output.
    """
    ys = []
    for d in range(len(xs)):
        parts = [x.narrow(0, sum(S[s][:d]), S[s][d]) for s, x in enumerate(xs)]
        ys.append(torch.cat(parts))
    return ys

"""Per-rank memory accounting that works on any device, CPU included (no allocator stats needed).

- `state_bytes(model, optim)`: parameters + gradients + optimizer state held by this rank.
- `SavedTensorMeter`: live and peak bytes of the tensors autograd keeps for backward (the
  activations), counted per storage (a storage saved by several ops counts once) and excluding
  parameter storages (weights saved for backward are not extra memory). A saved storage stops
  counting when autograd releases it (the graph node is freed after backward). Under
  activation checkpointing it counts what the forward keeps (each checkpointed region's
  input); the tensors a region saves again while it is recomputed in the backward are held
  by torch's checkpoint and are not counted (one region's worth at a time, on top).

These are the quantities the analytic model (`tuner.estimate`) predicts, so a run with
`--train.memory_report=true` can be compared with its plan.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["state_bytes", "tensor_bytes", "SavedTensorMeter", "rss_reset_peak", "rss_peak"]


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds: tensor parallel, ZeRO-3's sharded
    parameters and state), else t."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = _plain(t)
    return t.numel() * t.element_size()


def tensor_bytes(ts) -> int:
    """This rank's bytes of the tensors in `ts` (a DTensor counts its local shard; entries
    that are not tensors, e.g. None or an optimizer's step count, are skipped)."""
    return sum(_nbytes(t) for t in ts if isinstance(t, torch.Tensor))


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer | None) -> int:
    total = 0
    for p in model.parameters():
        total += _nbytes(p)
        for g in (p.grad, getattr(p, "main_grad", None)):  # bf16 weights: the fp32 main_grad
            if g is not None:
                total += _nbytes(g)
        if optim is not None:
            for v in optim.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    total += _nbytes(v)
    return total


class _Held:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedTensorMeter:
    """Context manager: track bytes of tensors saved for backward while it is active."""

    def __init__(self, model: nn.Module) -> None:
        self._param_ptrs = {_plain(p).untyped_storage().data_ptr() for p in model.parameters()}
        self._refs: dict[int, int] = {}  # storage ptr -> saved tensors referencing it
        self.live = 0
        self.peak = 0
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _release(self, ptr: int, nbytes: int) -> None:
        self._refs[ptr] -= 1
        if self._refs[ptr] == 0:
            del self._refs[ptr]
            self.live -= nbytes

    def _pack(self, t: torch.Tensor):
        # a parameter saved for backward is not an activation (under ZeRO-3 the per-layer
        # gathered weights are parameters too, their storage freed after the layer)
        if isinstance(t, nn.Parameter):
            return t
        storage = _plain(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_ptrs or storage.nbytes() == 0:
            return t
        if ptr not in self._refs:
            self._refs[ptr] = 0
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[ptr] += 1
        # Hold a detached alias (same storage, no grad_fn): holding `t` itself would make a
        # reference cycle whenever autograd saves an op's own output (tensor -> grad_fn ->
        # saved variable -> this holder -> tensor) that Python's GC cannot see through, so a
        # graph kept alive past its backward (the split backward's retain_graph) leaks.
        held = _Held(t.detach())
        weakref.finalize(held, self._release, ptr, storage.nbytes())
        return held

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def __enter__(self) -> SavedTensorMeter:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._ctx = ctx
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is None:
            raise RuntimeError("SavedTensorMeter.__exit__ without __enter__")
        self._ctx.__exit__(*exc)
        self._ctx = None


def _proc_status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def rss_reset_peak() -> int:
    """This process's resident memory in bytes after resetting its peak (VmHWM) where Linux
    allows it; -1 if unknown. With `rss_peak` after some work: the most that work held."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _proc_status_bytes("VmRSS")


def rss_peak() -> int:
    """Peak resident bytes (VmHWM) since the process started or the last `rss_reset_peak`."""
    return _proc_status_bytes("VmHWM")

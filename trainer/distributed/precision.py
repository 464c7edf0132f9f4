"""Mixed precision as large runs do it: bf16 working weights, fp32 masters, fp32 gradients.

    --train.dtype        compute dtype: auto (bf16 on GPUs, fp32 on CPU) | fp32 | bf16
    --train.param_dtype  working weights: auto (= the compute dtype) | bf16 | fp32
    --train.reduce_dtype gradient reduction on the wire: fp32 | bf16

With param_dtype=bf16 every parameter the forward reads is a bf16 tensor (nothing is cast per
forward; the router weight is the one exception, kept fp32 because the router computes in fp32,
model/router.py), and:
  - the optimizer (trainer/distributed/zero.py) keeps an fp32 master copy of each bf16 parameter it steps
    (its owned ones under ZeRO-1/2) next to the AdamW moments, in `optim.state[p]["master"]`,
    steps the master and writes it back rounded to bf16;
  - every backward's bf16 gradient is added into an fp32 `p.main_grad` at once (a post-
    accumulate-grad hook, trainer/distributed/grad_sync.py): accumulation over micro-batches, the
    reduction (in `reduce_dtype` on the wire), clipping and the step all see fp32;
  - checkpoints hold the fp32 masters under the keys an fp32 run writes (trainer/checkpoint.py).
Under ZeRO-3 FSDP2 does the same with its MixedPrecisionPolicy (trainer/distributed/zero3.py): the fp32
shards are the masters, gathered as bf16, gradients reduce-scattered in `reduce_dtype`.

bf16 on CPU: it runs (torch's CPU kernels and the project's CPU grouped GEMM take bf16), so
`--train.dtype=bf16` on CPU trains in bf16 and is never fp32; it is 4.0-4.8x slower than fp32
on the Zen 3 dev machine (no native bf16 GEMM; benchmarks/bench_zero.py), so `auto` stays fp32
on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ConfigError

__all__ = ["Precision", "check_precision", "resolve_precision", "grad_of", "set_grad",
           "to_working_dtype", "keeps_fp32", "DTYPES", "REDUCE_DTYPES"]

DTYPES = ("auto", "fp32", "bf16")
PARAM_DTYPES = ("auto", "fp32", "bf16")
REDUCE_DTYPES = ("fp32", "bf16")
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype  # autocast dtype (bf16) or fp32 (autocast off)
    param: torch.dtype  # working weights
    reduce: torch.dtype  # gradients on the wire

    @property
    def autocast(self) -> bool:
        return self.compute == torch.bfloat16

    def autocast_ctx(self, device_type: str):
        """bf16 autocast on `device_type` (CPU too), or nothing."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def describe(self) -> str:
        n = {torch.float32: "fp32", torch.bfloat16: "bf16"}
        return (f"compute {n[self.compute]}, weights {n[self.param]}"
                f"{' (fp32 masters in the optimizer)' if self.param != torch.float32 else ''}, "
                f"gradients fp32, reduced in {n[self.reduce]}")


def check_precision(t) -> None:
    """Validate train.dtype / param_dtype / reduce_dtype (before any work)."""
    if t.dtype not in DTYPES:
        raise ConfigError(f"train.dtype={t.dtype!r}; valid: {', '.join(DTYPES)}")
    if t.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"train.param_dtype={t.param_dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
    if t.reduce_dtype not in REDUCE_DTYPES:
        raise ConfigError(f"train.reduce_dtype={t.reduce_dtype!r}; valid: "
                          f"{', '.join(REDUCE_DTYPES)}")
    if t.dtype == "fp32" and t.param_dtype == "bf16":
        raise ConfigError("train.param_dtype='bf16' with train.dtype='fp32': bf16 weights need "
                          "bf16 compute; use train.dtype=bf16 (or auto on a GPU), or "
                          "param_dtype=fp32")


def resolve_precision(t, device_type: str) -> Precision:
    """The run's dtypes: auto compute = bf16 on CUDA, fp32 on CPU; auto weights = compute."""
    compute = t.dtype if t.dtype != "auto" else ("bf16" if device_type == "cuda" else "fp32")
    param = t.param_dtype if t.param_dtype != "auto" else compute
    if compute == "fp32" and param == "bf16":  # auto resolved on CPU against an explicit bf16
        raise ConfigError(f"train.param_dtype='bf16' needs bf16 compute; train.dtype="
                          f"{t.dtype!r} resolves to fp32 on {device_type}: set train.dtype=bf16")
    return Precision(_TORCH[compute], _TORCH[param], _TORCH[t.reduce_dtype])


def keeps_fp32(name: str) -> bool:
    """Parameters that stay fp32 under bf16 weights: the router's (it computes in fp32)."""
    return name.endswith("router.weight")


@torch.no_grad()
def to_working_dtype(model: nn.Module, dtype: torch.dtype) -> dict[nn.Parameter, torch.Tensor]:
    """Cast the parameters (not the buffers: router bias, RoPE tables stay fp32) to `dtype`,
    once, in place of a cast per forward; the router weight stays fp32 (`keeps_fp32`).
    Returns {parameter: its fp32 value before the cast}: the optimizer's masters start there
    (trainer/distributed/zero.py takes the ones it owns; the rest are freed when the dict goes)."""
    before: dict[nn.Parameter, torch.Tensor] = {}
    if dtype == torch.float32:
        return before
    for name, p in model.named_parameters():
        if not keeps_fp32(name) and p.dtype != dtype:
            before[p] = p.data
            p.data = p.data.to(dtype)
    return before


def has_main_grad(p: torch.Tensor) -> bool:
    """Whether p's gradient lives in an fp32 `p.main_grad` (p is a 16-bit weight; fp32 and
    fp64 parameters keep their own `.grad`)."""
    return p.dtype in (torch.bfloat16, torch.float16)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """p's gradient as the optimizer sees it: fp32 `main_grad` for bf16 weights, else .grad."""
    return getattr(p, "main_grad", None) if has_main_grad(p) else p.grad


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if has_main_grad(p):
        p.main_grad = g  # type: ignore[attr-defined]
    else:
        p.grad = g


def accumulate_main_grad(p: torch.Tensor) -> None:
    """Move a bf16 weight's fresh `.grad` into its fp32 `main_grad` (add; no-op without one)."""
    g = p.grad
    if g is None or not has_main_grad(p):
        return
    p.grad = None
    mg = getattr(p, "main_grad", None)
    if mg is None:
        p.main_grad = g.float()  # type: ignore[attr-defined]
    else:
        mg.add_(g)

"""Pipeline parallelism for `MoETransformer`: stage split, stage modules, the aux-loss hook
(training and evaluation both run on `pipeline.PipelineRuntime`: trainer/build.py).

Each rank builds the full model from the seed (so weights equal a 1-process run), shards its
experts (`parallelize`), then keeps only the layers of its stages: the others are replaced by
`RemovedLayer` placeholders so parameter names stay global (`layers.5.ffn.experts.w1`) and a
checkpoint loads under any PP degree. Stage s of S = pp * n_virtual stages runs on PP rank
s % pp; it owns layers [bounds[s], bounds[s+1]); the embedding sits on stage 0, the final norm
and the head on stage S-1.

MoE aux losses: each stage adds the aux loss of its own MoE layers to the micro-batch objective
through the runtime's `aux_fn`, so the objective equals the 1-process `ce + aux`.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..layout import LayoutError, stage_bounds, stage_rank

__all__ = ["split_layers", "RemovedLayer", "Stage", "build_stages", "moe_aux"]


def split_layers(n_layers: int, n_stages: int, spec: str = "") -> list[int]:
    """Stage boundaries [0, ..., n_layers] (len n_stages + 1): `trainer.layout.stage_bounds`,
    the one stage split (the planner's too). `spec` = `parallel.layer_split`, comma-separated
    layer counts per stage ("3,5"); default: as even as possible, the middle stages taking the
    remainder (stage 0 also holds the embedding, the last stage the head)."""
    try:
        return stage_bounds(n_layers, n_stages, spec)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


class RemovedLayer(nn.Module):
    """Placeholder for a layer that lives on another pipeline rank (keeps indices/names)."""

    ffn = None
    is_moe = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        raise RuntimeError("this layer lives on another pipeline stage")


class Stage(nn.Module):
    """Layers [lo, hi) of `model`, plus the embedding (first) and norm + head (last).

    `autocast`: run under bf16 autocast on the input's device (the trainer sets it on GPUs).
    What crosses a stage boundary (the activation, and its gradient coming back) is then
    bf16, `boundary_dtype`: half the P2P bytes of fp32, and the dtype the planner's P2P model
    (`tuner.estimate`: activation bytes of the precision policy) assumes. Inside a stage the
    residual stream stays fp32 as in the 1-process model (under autocast the embedding and
    every residual add are fp32): a received activation is upcast on entry, so the only
    difference from one process is one bf16 rounding per boundary. The last stage's logits
    are fp32 for the loss."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool,
                 autocast: bool = False, stream_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.lo, self.hi, self.first, self.last, self.autocast = lo, hi, first, last, autocast
        # the residual stream's dtype inside the stage: fp32, or bf16 with bf16 weights (the
        # dtype the embedding of a 1-process model with those weights produces)
        self.stream_dtype = stream_dtype
        self.embed: nn.Module | None = model.embed if first else None
        self.blocks = nn.ModuleList(model.layers[i] for i in range(lo, hi))
        self.norm: nn.Module | None = model.norm if last else None
        self.lm_head: nn.Module | None = model.lm_head if last else None
        # --data.doc_mask: the DocLayout of each coming forward, in micro-batch order (every
        # schedule runs a stage's forwards in micro-batch order; the trainer fills it per step)
        self.docs: collections.deque = collections.deque()

    @property
    def boundary_dtype(self) -> torch.dtype:
        """dtype of the activations and gradients this stage exchanges with its neighbours."""
        return torch.bfloat16 if self.autocast else torch.float32

    def moe_layers(self) -> list[Any]:
        """The stage's `model.MoELayer`s, in layer order."""
        return [b.ffn for b in self.blocks if getattr(b, "is_moe", False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if self.autocast \
            else contextlib.nullcontext()
        with ctx:
            h = self.embed(x) if self.embed is not None else x.to(self.stream_dtype)
            doc = self.docs.popleft() if self.docs else None
            for b in self.blocks:
                h = b(h, doc)
            if self.lm_head is not None and self.norm is not None:  # the last stage
                return self.lm_head(self.norm(h)).float()
            return h.to(self.boundary_dtype)


def build_stages(model: Any, pp: int, pp_idx: int, n_virtual: int, bounds: list[int],
                 autocast: bool = False,
                 stream_dtype: torch.dtype = torch.float32) -> dict[int, Stage]:
    """Keep this rank's stages; strip every other layer and the unused embedding / head.
    `model`: a `MoETransformer` (or any module with its `layers`, `embed`, `norm`, `lm_head`)."""
    S = pp * n_virtual
    mine = [s for s in range(S) if stage_rank(s, pp) == pp_idx]
    stages = {s: Stage(model, bounds[s], bounds[s + 1], s == 0, s == S - 1, autocast,
                       stream_dtype) for s in mine}
    owned = {i for s in mine for i in range(bounds[s], bounds[s + 1])}
    for i in range(len(model.layers)):
        if i not in owned:
            model.layers[i] = RemovedLayer()
    if 0 not in mine:
        model.embed = None
    if S - 1 not in mine:
        model.norm = None
        model.lm_head = None
    return stages


def moe_aux(stage: int, module: Stage, output: torch.Tensor) -> torch.Tensor | None:
    """The runtime's aux hook: the summed aux loss of the stage's MoE layers for this forward."""
    layers = module.moe_layers()
    if not layers:
        return None
    total = layers[0].last_aux_loss  # summed in layer order, as sum() did
    for layer in layers[1:]:
        total = total + layer.last_aux_loss
    return total

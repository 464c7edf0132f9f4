"""MoE transformer: config, presets, attention (GQA, MLA), router, experts, HF interop."""

from __future__ import annotations

from . import presets
from .attention import DocLayout
from .checkpointing import CHECKPOINTING, set_checkpointing
from .config import ModelConfig
from .moe import GroupedExperts, LocalDispatcher, MoELayer, SwiGLU
from .recompute import is_recomputing
from .router import Router
from .transformer import Block, MoETransformer, cross_entropy

__all__ = [
    "CHECKPOINTING",
    "Block",
    "DocLayout",
    "GroupedExperts",
    "LocalDispatcher",
    "ModelConfig",
    "MoELayer",
    "MoETransformer",
    "Router",
    "SwiGLU",
    "cross_entropy",
    "is_recomputing",
    "presets",
    "set_checkpointing",
]

"""--train.compile=true: each block's dense parts through `torch.compile`, the MoE seam eager.

Compiled, per block: attention (projections, RoPE, scaled-dot-product attention), both
RMSNorms, the dense SwiGLU FFN or, in an MoE layer, the router (`Router.route`: logits,
softmax / sigmoid, top-k, aux loss) and the shared expert; the final norm. Left eager: the
MoE permute, the dispatch / combine all-to-all (host-side split sizes, collectives), the grouped
expert GEMMs (a custom autograd op) and the unpermute: their shapes change with the routing
every step, so compiling them would recompile or need dynamic shapes, and the all-to-all
cannot be traced. Every compiled region sees the same shapes each step ([B, S, D] per micro-
batch; evaluation uses the same batch), so nothing recompiles after the first step:
`graph_count()` reads dynamo's count of compiled graphs, and the trainer logs it after the
warm-up and at the end (tests/test_compile.py checks it stays put).

Default off: on the CPU dev machine the compiled step measured slower than eager for the
small presets (docs/training.md, "Compiled blocks"); on GPUs the fused norms and attention
epilogues are where it pays.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["compile_blocks", "graph_count"]


def compile_blocks(model: nn.Module) -> int:
    """Compile the dense parts of every block this rank holds, in place (lazily: the first
    forward compiles); returns how many regions were wrapped."""
    from model.moe import MoELayer, SwiGLU
    from model.transformer import Block

    n = 0
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    for b in layers:
        if not isinstance(b, Block):  # a layer of another pipeline stage
            continue
        for m in (b.attn_norm, b.attn, b.ffn_norm):
            m.compile()
            n += 1
        if isinstance(b.ffn, SwiGLU):
            b.ffn.compile()
            n += 1
        elif isinstance(b.ffn, MoELayer):
            router = b.ffn.router
            router.route = torch.compile(router.route)  # type: ignore[method-assign]
            n += 1
            for extra in (b.ffn.shared_experts, b.ffn.shared_gate):
                if extra is not None:
                    extra.compile()
                    n += 1
    norm = getattr(model, "norm", None)
    if norm is not None:
        norm.compile()
        n += 1
    return n


def graph_count() -> int:
    """Graphs dynamo compiled in this process so far (a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

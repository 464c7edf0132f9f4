"""Split a stage's backward into B (input gradient) and W (weight gradients), zero-bubble style.

B runs `torch.autograd.grad(outputs, [x], retain_graph=True)`: autograd executes only the
nodes on paths to x. Each of those nodes that *also* feeds parameters through nodes off the x
path (a Linear's AddmmBackward feeds its weight and bias) is a *cut node*; a pre-hook on it
records the gradient flowing into it. W then starts autograd at every cut node
(`GradientEdge(node, i)` with the recorded gradient) and asks only for the parameters it
reaches off the x path, so the input-gradient chain is not run a second time: W costs the
weight-gradient GEMMs, not a second full backward.

Outputs whose graph never reaches x (an aux term built from parameters only, or a first
stage fed with token ids) go to W whole. If one cut node reaches the same parameter both on
and off the x path (weights tied inside one stage), cutting would count that path twice, so
the split falls back to the plain form: W = `autograd.backward(outputs, inputs=params)`.

Graph nodes are walked once per micro-batch in Python: cost grows with the node count, not
tensor sizes (a few hundred nodes per transformer stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs: (roots, grads, params) triples, or the whole outputs (fallback)."""

    # (cut-node edges with their recorded gradients, or an output off the x path with its
    # seed: None for a scalar loss), and the parameters W asks for
    roots: list[tuple[list[GradientEdge] | list[torch.Tensor], list[torch.Tensor | None],
                      list[torch.Tensor]]]
    plain: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None
    keep: list[torch.Tensor] = field(default_factory=list)  # holds the graph alive until W


def _children(n: Node) -> list[Node]:
    return [c for c, _ in n.next_functions if c is not None]


def _walk(roots: list[Node], x_node: Node, param_of: dict[Node, int]) -> tuple[dict, dict]:
    """Per node: does it reach x, and which parameter indices does it reach (memoised,
    iterative so deep graphs do not hit Python's recursion limit)."""
    reach_x: dict[Node, bool] = {}
    reach_p: dict[Node, frozenset[int]] = {}
    stack = [(r, False) for r in roots]
    while stack:
        n, expanded = stack.pop()
        if n in reach_x:
            continue
        kids = _children(n)
        if not expanded:
            stack.append((n, True))
            stack += [(c, False) for c in kids if c not in reach_x]
            continue
        reach_x[n] = n is x_node or any(reach_x[c] for c in kids)
        own = {param_of[n]} if n in param_of else set()
        reach_p[n] = frozenset(own.union(*(reach_p[c] for c in kids)))
    return reach_x, reach_p


def backward_input(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of `outputs` (seeded with `grads`) wrt `x`, plus what W needs."""
    params = [p for p in params if p.requires_grad]
    if not x.requires_grad:
        return None, WeightWork([], plain=(outputs, grads))
    x_node = get_gradient_edge(x).node
    param_of = {get_gradient_edge(p).node: i for i, p in enumerate(params)}
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    reach_x, reach_p = _walk(roots, x_node, param_of)

    cuts: list[tuple[Node, frozenset[int]]] = []
    for n, on_x in reach_x.items():
        if not on_x or n is x_node:
            continue
        off = [c for c in _children(n) if not reach_x[c]]
        off_params = frozenset().union(*(reach_p[c] for c in off)) if off else frozenset()
        if not off_params:
            continue
        on_params = frozenset().union(*(reach_p[c] for c in _children(n) if reach_x[c]))
        if off_params & on_params:
            (dx,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
            return dx, WeightWork([], plain=(outputs, grads))
        cuts.append((n, off_params))

    captured: dict[Node, tuple] = {}
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n, _ in cuts]
    try:
        (dx,) = torch.autograd.grad(outputs, [x], grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()

    work = WeightWork([], keep=list(outputs))
    for n, idx in cuts:
        g_out = captured.get(n)
        if g_out is None:  # autograd skipped the node: no gradient flows through it
            continue
        edges = [GradientEdge(n, i) for i, g in enumerate(g_out) if g is not None]
        gs = [g for g in g_out if g is not None]
        if edges:
            work.roots.append((edges, gs, [params[i] for i in sorted(idx)]))
    for o, g in zip(outputs, grads, strict=True):
        if o.grad_fn is not None and not reach_x[o.grad_fn] and reach_p[o.grad_fn]:
            work.roots.append(([o], [g], [params[i] for i in sorted(reach_p[o.grad_fn])]))
    return dx, work


def backward_weight(work: WeightWork, params: Sequence[torch.Tensor]) -> None:
    """W: accumulate the parameter gradients into `.grad` (like `Tensor.backward`)."""
    if work.plain is not None:
        outs, grads = work.plain
        params = [p for p in params if p.requires_grad]
        if params:
            torch.autograd.backward(outs, grads, inputs=params)
        return
    for roots, gs, ps in work.roots:
        # retain_graph: cut nodes can share weight-side nodes (a weight used twice); the
        # graph is freed when the stage drops its stash right after W.
        got = torch.autograd.grad(roots, ps, gs, retain_graph=True, allow_unused=True)
        for p, g in zip(ps, got, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone()
            else:
                p.grad.add_(g)

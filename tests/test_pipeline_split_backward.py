"""B/W split of a backward (pipeline.split_backward) against one plain autograd backward.

For every graph shape the input gradient from B and the parameter gradients after W must
equal `torch.autograd.backward` of the same outputs: bitwise for the cut path would be too
strict (W sums per-cut contributions in another order), so fp32 rtol 1e-6 / atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.split_backward import backward_input, backward_weight


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))


class _Tied(nn.Module):
    """One weight used by two layers: the same parameter on and off the input path."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _outputs(case: str, m: nn.Module, x: torch.Tensor) -> tuple[list, list]:
    y = m(x)
    outs, grads = [y], [torch.full_like(y, 0.3)]
    if case == "aux_params_only":  # a root that never reaches x
        outs.append(m[0].weight.pow(2).sum())
        grads.append(torch.tensor(0.1))
    if case == "scalar_loss":
        outs, grads = [y.pow(2).mean()], [None]
    return outs, grads


@pytest.mark.parametrize("case", ["plain", "aux_params_only", "scalar_loss", "tied"])
def test_split_matches_plain_backward(case: str) -> None:
    make = _Tied if case == "tied" else _mlp
    x0 = torch.randn(5, 8)
    ref_m, m = make(), make()

    x = x0.clone().requires_grad_()
    outs, grads = _outputs(case, ref_m, x)
    torch.autograd.backward(outs, grads)

    xs = x0.clone().requires_grad_()
    outs, grads = _outputs(case, m, xs)
    dx, work = backward_input(outs, grads, xs, list(m.parameters()))
    assert all(p.grad is None for p in m.parameters()), "B must not touch parameter grads"
    torch.testing.assert_close(dx, x.grad, rtol=1e-6, atol=1e-6)
    backward_weight(work, list(m.parameters()))
    for (name, p), q in zip(m.named_parameters(), ref_m.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6, msg=name)
    # The tied weight cannot be cut without double counting: W redoes the backward whole.
    assert (work.plain is not None) == (case == "tied")


def test_w_skips_the_input_chain() -> None:
    """W from the cut nodes must not run the input-gradient chain again: count how often
    the autograd nodes of the two activation functions execute."""
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    y = m(x)
    calls = []
    node = y.grad_fn.next_functions[1][0]  # TanhBackward of the second activation
    node.register_prehook(lambda g: calls.append("tanh"))
    dx, work = backward_input([y], [torch.ones_like(y)], x, list(m.parameters()))
    assert calls == ["tanh"]
    backward_weight(work, list(m.parameters()))
    assert calls == ["tanh"], "W re-ran the input-gradient chain"
    assert all(p.grad is not None for p in m.parameters())

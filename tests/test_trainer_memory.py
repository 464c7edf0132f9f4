"""Memory accounting against hand-computed byte counts."""

from __future__ import annotations

import torch
from torch import nn

from trainer.observe.memory import SavedTensorMeter, state_bytes


def test_saved_activation_bytes_by_hand():
    # y = relu(x @ W1) @ W2, x [64, 32] fp32 without grad, W1 [32, 128], W2 [128, 16] params.
    # Saved for backward: x (for dW1) = 64*32*4 = 8192 B; relu's output h [64, 128] = 32768 B,
    # saved by relu and again by the second matmul (one storage, counted once); W1 and W2 are
    # parameters (not extra memory). Total 40960 B, and nothing stays alive after backward.
    m = nn.ParameterDict({"w1": nn.Parameter(torch.randn(32, 128)),
                          "w2": nn.Parameter(torch.randn(128, 16))})
    x = torch.randn(64, 32)
    meter = SavedTensorMeter(m)
    with meter:
        y = torch.relu(x @ m["w1"]) @ m["w2"]
    assert meter.live == meter.peak == 64 * 32 * 4 + 64 * 128 * 4
    y.sum().backward()
    del y
    assert meter.live == 0 and meter.peak == 40960


def test_state_bytes_by_hand():
    lin = nn.Linear(10, 20)  # 220 params
    opt = torch.optim.AdamW(lin.parameters())
    assert state_bytes(lin, opt) == 220 * 4
    lin(torch.randn(3, 10)).sum().backward()
    opt.step()
    # weights + grads + exp_avg + exp_avg_sq (fp32) + one 0-dim fp32 `step` per parameter
    assert state_bytes(lin, opt) == 4 * 220 * 4 + 2 * 4


def test_meter_releases_graphs_of_the_split_backward():
    # zero-bubble B then W keeps the graph past the input-gradient pass (retain_graph); every
    # saved tensor must still be released once the stage drops the micro-batch, and the
    # gradients must equal a plain backward's.
    import gc

    from pipeline.split_backward import backward_input, backward_weight

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Tanh())
    params = list(m.parameters())
    x = torch.randn(16, 32, requires_grad=True)
    m(x).sum().backward()
    ref = [p.grad.clone() for p in params]
    m.zero_grad(set_to_none=True)
    meter = SavedTensorMeter(m)
    with meter:
        for _ in range(3):
            y = m(x)
            assert meter.live > 0
            dx, work = backward_input([y], [torch.ones_like(y)], x, params)
            backward_weight(work, params)
            del y, work, dx
            gc.collect()
            assert meter.live == 0
    for p, g in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, 3 * g)

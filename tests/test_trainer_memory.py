"""Memory accounting against hand-computed byte counts."""

from __future__ import annotations

import torch
from torch import nn

from trainer.memory import SavedTensorMeter, state_bytes


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

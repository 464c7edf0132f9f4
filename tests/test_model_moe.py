"""MoE layer, router and transformer against plain-torch per-token / per-expert references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, MoELayer, MoETransformer, presets

SOFTMAX = presets.get("tiny").replace(d_model=32, n_routed_experts=6, top_k=2, moe_ffn_dim=24)
GROUPED = SOFTMAX.replace(
    n_routed_experts=8,
    top_k=3,
    n_group=4,
    topk_group=2,
    group_score="top2_sum",
    router="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    shared_ffn_dim=16,
    n_shared_experts=1,
    bias_balancing=True,
)
QWEN2ISH = SOFTMAX.replace(norm_topk_prob=False, shared_ffn_dim=20, shared_expert_gate=True)


def reference_routing(
    cfg: ModelConfig, x_TD: torch.Tensor, w_ED: torch.Tensor, bias_E: torch.Tensor
) -> tuple[list[list[int]], torch.Tensor]:
    """Token-by-token routing written from the definitions (no batched top-k over groups)."""
    logits = x_TD @ w_ED.t()
    s = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
    E, per = cfg.n_routed_experts, cfg.n_routed_experts // cfg.n_group
    chosen, weights = [], []
    for t in range(x_TD.shape[0]):
        c = (s[t] + bias_E).tolist()

        def gscore(g: int, c: list[float] = c) -> float:
            vals = sorted(c[g * per : (g + 1) * per], reverse=True)
            return vals[0] if cfg.group_score == "max" else vals[0] + vals[1]

        groups = sorted(range(cfg.n_group), key=gscore, reverse=True)[: cfg.topk_group]
        allowed = [e for e in range(E) if e // per in groups]
        experts = sorted(allowed, key=lambda e: c[e], reverse=True)[: cfg.top_k]
        w = s[t, experts]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        chosen.append(experts)
        weights.append(w * cfg.routed_scaling_factor)
    return chosen, torch.stack(weights)


def reference_moe(layer: MoELayer, cfg: ModelConfig, x_BSD: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert: y += w * W2[e](silu(W1[e] x) * W3[e] x) (+ shared)."""
    B, S, D = x_BSD.shape
    x = x_BSD.reshape(-1, D)
    ex = layer.experts
    chosen, w = reference_routing(cfg, x, layer.router.weight, layer.router.e_score_correction_bias)
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(D)
        for j, e in enumerate(chosen[t]):
            slot = int(layer.expert2slot[e])
            h = F.silu(x[t] @ ex.w1[slot]) * (x[t] @ ex.w3[slot])
            y = y + w[t, j] * (h @ ex.w2[slot])
        rows.append(y)
    y = torch.stack(rows)
    if layer.shared_experts is not None:
        se = layer.shared_experts
        shared = se.w2(F.silu(se.w1(x)) * se.w3(x))
        if layer.shared_gate is not None:
            shared = torch.sigmoid(layer.shared_gate(x)) * shared
        y = y + shared
    return y.view(B, S, D)


def make_layer(cfg: ModelConfig) -> MoELayer:
    layer = MoELayer(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        layer.router.e_score_correction_bias.normal_(0, 0.05)
    return layer


@pytest.mark.parametrize("cfg", [SOFTMAX, GROUPED, QWEN2ISH], ids=["softmax", "grouped", "qwen2"])
def test_moe_layer_forward_and_grads_match_loop(cfg: ModelConfig) -> None:
    layer = make_layer(cfg)
    x = torch.randn(2, 5, cfg.d_model, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = layer(x)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad((y * torch.cos(y)).sum(), [x, *params])
    y_ref = reference_moe(layer, cfg, x_ref)
    grads_ref = torch.autograd.grad(
        (y_ref * torch.cos(y_ref)).sum(), [x_ref, *params], allow_unused=True
    )
    # fp32, same math in another order (grouped GEMM vs per-token vectors): errors are a few
    # ulps of the LARGEST terms summed, so entries that cancel to ~0 only have absolute
    # accuracy: tolerance 1e-5 relative to each tensor's largest entry.
    names = ["y", "x"] + [n for n, _ in layer.named_parameters()]
    for name, g, g_ref in zip(names, (y, *grads), (y_ref, *grads_ref), strict=True):
        scale = float(g_ref.detach().abs().max())
        torch.testing.assert_close(
            g, g_ref, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    counts = torch.bincount(
        torch.tensor(
            reference_routing(
                cfg,
                x.detach().reshape(-1, cfg.d_model),
                layer.router.weight.detach(),
                layer.router.e_score_correction_bias,
            )[0]
        ).flatten(),
        minlength=cfg.n_routed_experts,
    )
    assert torch.equal(layer.last_counts, counts)


def test_both_dispatchers_implement_the_declared_protocol() -> None:
    """model's LocalDispatcher (which cannot import comm) and comm.ep's EPDispatcher are both
    `comm.ep.Dispatcher`s, with the Protocol's method signatures; their per-step numbers come
    back from take_stats (None: nothing exchanged), restarted by each call."""
    import inspect

    from comm.ep import Dispatcher, EPDispatcher, ExchangeStats
    from model import LocalDispatcher

    local, ep = LocalDispatcher(), EPDispatcher(None, 2, 8)
    for d in (local, ep):
        assert isinstance(d, Dispatcher)
        for name in ("dispatch", "combine", "moe_forward", "take_stats"):
            want = list(inspect.signature(getattr(Dispatcher, name)).parameters)[1:]
            assert list(inspect.signature(getattr(d, name)).parameters) == want, name
    assert local.pipelined is False and local.take_stats() is None
    assert (local.ep, local.group, local.topology) == (1, None, None) and ep.ep == 2
    ep.stats.exchange_s, ep.stats.remote_rows = 0.5, 3
    assert ep.take_stats() == ExchangeStats(exchange_s=0.5, remote_rows=3)
    assert ep.take_stats() == ExchangeStats()


def test_expert2slot_remap_keeps_output() -> None:
    layer = make_layer(GROUPED)
    x = torch.randn(2, 6, GROUPED.d_model)
    want = layer(x)
    perm = torch.randperm(GROUPED.n_routed_experts)  # logical e now lives in slot perm[e]
    with torch.no_grad():
        for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
            moved = torch.empty_like(w)
            moved[perm] = w
            w.copy_(moved)
        slots = torch.empty_like(perm)
        slots[perm] = torch.arange(GROUPED.n_routed_experts)
        layer.set_slots(slots)  # the slot map: slot perm[e] holds expert e
    assert torch.equal(layer.expert2slot, perm)
    torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(reference_moe(layer, GROUPED, x), want, atol=1e-5, rtol=1e-5)


def reference_aux(cfg: ModelConfig, layer: MoELayer, x_BSD: torch.Tensor) -> torch.Tensor:
    B, S, _ = x_BSD.shape
    per_seq = []
    for b in range(B):
        x = x_BSD[b]
        s = x @ layer.router.weight.t()
        p = (
            s.softmax(-1)
            if cfg.router == "softmax"
            else s.sigmoid() / s.sigmoid().sum(-1, keepdim=True)
        )
        chosen, _ = reference_routing(
            cfg, x, layer.router.weight, layer.router.e_score_correction_bias
        )
        f = torch.zeros(cfg.n_routed_experts)
        for experts in chosen:
            f[experts] += 1.0 / (S * cfg.top_k)
        per_seq.append((f * p.mean(0)).sum())
    return cfg.aux_loss_coef * cfg.n_routed_experts * torch.stack(per_seq).mean()


@pytest.mark.parametrize("cfg", [SOFTMAX, GROUPED], ids=["softmax", "sigmoid"])
def test_aux_loss_per_sequence_and_split_invariant(cfg: ModelConfig) -> None:
    layer = make_layer(cfg.replace(aux_loss_coef=0.01))
    x = torch.randn(4, 7, cfg.d_model)
    layer(x)
    whole = layer.last_aux_loss
    torch.testing.assert_close(whole, reference_aux(cfg.replace(aux_loss_coef=0.01), layer, x))
    halves = []
    for part in (x[:2], x[2:]):  # two data-parallel ranks with 2 sequences each
        layer(part)
        halves.append(layer.last_aux_loss)
    torch.testing.assert_close((halves[0] + halves[1]) / 2, whole, atol=1e-7, rtol=1e-6)
    w = layer.router.weight
    (g,) = torch.autograd.grad(whole, w)
    assert g.abs().sum() > 0  # differentiable through P_e


def test_bias_steers_selection_only_and_updates_by_sign() -> None:
    cfg = GROUPED.replace(n_group=1, topk_group=1)
    layer = make_layer(cfg)
    router = layer.router
    router.e_score_correction_bias.zero_()
    x = torch.randn(10, cfg.d_model)
    s = (x @ router.weight.t()).sigmoid().detach()
    router.e_score_correction_bias[5] = 100.0  # every token must pick expert 5 ...
    idx, w = router(x.view(1, 10, -1))
    assert (idx == 5).any(dim=1).all()
    want = s.gather(1, idx)  # ... but its weight stays the unbiased score
    torch.testing.assert_close(w, want / want.sum(1, keepdim=True) * cfg.routed_scaling_factor)
    router.e_score_correction_bias.zero_()
    router.update_bias(torch.tensor([0, 10, 5, 5, 5, 5, 1, 9]))  # mean 5
    want_bias = cfg.bias_update_rate * torch.tensor([1.0, -1, 0, 0, 0, 0, 1, -1])
    torch.testing.assert_close(router.e_score_correction_bias, want_bias)
    with pytest.raises(ValueError, match=r"expected \(8,\)"):
        router.update_bias(torch.ones(3))


def test_transformer_loss_aux_and_determinism() -> None:
    cfg = presets.get("tiny").replace(n_layers=2, aux_loss_coef=0.01)
    torch.manual_seed(7)
    a = MoETransformer(cfg)
    torch.manual_seed(7)
    b = MoETransformer(cfg)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    tokens = torch.randint(0, 256, (2, 16))
    targets = torch.randint(0, 256, (2, 16))
    logits = a(tokens)
    assert logits.shape == (2, 16, 256)
    ce, aux = a(tokens, targets)
    torch.testing.assert_close(ce, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    layers = a.moe_layers()
    assert len(layers) == 2
    torch.testing.assert_close(aux, layers[0].last_aux_loss + layers[1].last_aux_loss)
    (ce + aux).backward()
    missing = [n for n, p in a.named_parameters() if p.grad is None]
    assert not missing, missing
    # the output's init scale follows init_std: logits std ~ init_std * sqrt(d) * |h|
    assert 0 < float(logits.detach().std()) < 1.0


def test_transformer_input_errors() -> None:
    model = MoETransformer(presets.get("tiny").replace(n_layers=1, max_seq_len=8))
    with pytest.raises(ValueError, match="sequence length 9 exceeds max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must be \[B, S\]"):
        model(torch.zeros(9, dtype=torch.long))

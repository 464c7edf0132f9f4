"""ModelConfig: every architecture field of the MoE transformers this project trains.

One flat dataclass covers Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, Kimi-K2 and Llama-4 (text).
Parameter counts are exact: they equal what the `transformers` implementation of the same
configuration allocates as `nn.Parameter`s (buffers such as DeepSeek-V3's
`e_score_correction_bias` and rotary tables are not parameters there, nor here). DeepSeek-V3's
multi-token-prediction (MTP) module is not part of the transformers model and is not counted.

Shape legend: V vocab, D d_model, H heads, G kv heads, hd head dim, E routed experts, K top-k,
F expert ffn width, S sequence length.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .hf_config import hf_config_fields

ATTENTION_KINDS = ("gqa", "mla")
ROUTER_KINDS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")
ROPE_SCALINGS = ("none", "yarn", "llama3")


@dataclass
class ModelConfig:
    """Architecture of a decoder-only MoE transformer (pre-norm, RMSNorm, RoPE, SwiGLU).

    Layer i is a MoE layer iff `n_routed_experts > 0`, `i >= first_k_dense`,
    `i not in dense_layers` and `(i + 1) % moe_every == 0` (the Qwen `decoder_sparse_step` and
    Llama-4 `interleave_moe_layer_step` rule: with moe_every=2 layers 1, 3, 5, ... are MoE).
    Every other layer is a dense SwiGLU of width `dense_ffn_dim`.
    """

    name: str = "custom"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None -> d_model // n_heads
    attention: str = "gqa"  # "gqa" (MHA when n_kv_heads == n_heads) or "mla"
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    attn_qkv_bias: bool = False  # bias on q/k/v (Qwen2) or on MLA's down-projections
    attn_out_bias: bool = False  # bias on the output projection (Qwen3 attention_bias)
    # MLA (DeepSeek-V2/V3): q_lora_rank None -> q is a plain projection
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # DeepSeek checkpoints store rope dims as (x0, x1) pairs
    # RoPE
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # "none" | "yarn" (DeepSeek/Kimi) | "llama3" (Llama-4)
    rope_factor: float = 1.0
    rope_original_max_seq_len: int = 0
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_mscale: float = 0.0  # yarn; 0 = absent
    rope_mscale_all_dim: float = 0.0  # yarn; 0 = absent
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    max_seq_len: int = 256
    rms_norm_eps: float = 1e-6
    # feed-forward
    dense_ffn_dim: int = 0
    first_k_dense: int = 0
    dense_layers: tuple[int, ...] = ()  # extra dense layers (Qwen mlp_only_layers)
    moe_every: int = 1
    n_routed_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 256
    n_shared_experts: int = 0
    shared_ffn_dim: int = 0  # total width of the fused shared expert(s); 0 = none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(Linear(D, 1)) scales the shared expert
    # router
    router: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # group-limited routing: experts split in n_group groups ...
    topk_group: int = 1  # ... of which topk_group may be chosen per token
    group_score: str = "max"  # score of a group: "max" (DeepSeek-V2) | "top2_sum" (V3)
    aux_loss_coef: float = 0.0
    bias_balancing: bool = False  # DeepSeek-V3 aux-loss-free e_score_correction_bias
    bias_update_rate: float = 1e-3
    # embeddings and init
    tie_embeddings: bool = False
    init_std: float = 0.02
    # informational (not built): DeepSeek-V3 MTP depth, kept so round trips are lossless
    n_mtp_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.dense_layers = tuple(int(i) for i in self.dense_layers)
        if self.head_dim is None:
            if self.n_heads > 0 and self.d_model % self.n_heads != 0:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly"
                )
            self.head_dim = self.d_model // max(self.n_heads, 1)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the bad field and what would be valid."""
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "moe_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 1")
        _choice("attention", self.attention, ATTENTION_KINDS)
        _choice("router", self.router, ROUTER_KINDS)
        _choice("group_score", self.group_score, GROUP_SCORES)
        _choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.attention == "gqa":
            if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads != 0:
                raise ValueError(
                    f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}; "
                    f"valid n_kv_heads: {_divisors(self.n_heads)}"
                )
            if self.rope_scaling == "none" and self._head_dim % 2:
                raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        else:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) < 1:
                    raise ValueError(f"attention='mla' needs {f} >= 1, got {getattr(self, f)}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
            if self.qk_norm:
                raise ValueError("qk_norm=True is only supported with attention='gqa'")
            if self.q_lora_rank is not None and self.q_lora_rank < 1:
                raise ValueError(f"q_lora_rank={self.q_lora_rank} must be None or >= 1")
        if self.rope_scaling != "none" and self.rope_original_max_seq_len < 1:
            raise ValueError(
                f"rope_scaling={self.rope_scaling!r} needs rope_original_max_seq_len >= 1, "
                f"got {self.rope_original_max_seq_len}"
            )
        if self.n_routed_experts < 0:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} must be >= 0")
        if self.n_routed_experts > 0:
            if not 1 <= self.top_k <= self.n_routed_experts:
                raise ValueError(
                    f"top_k={self.top_k} must be in 1..n_routed_experts={self.n_routed_experts}"
                )
            if self.moe_ffn_dim < 1:
                raise ValueError(f"moe_ffn_dim={self.moe_ffn_dim} must be >= 1")
            if self.n_group < 1 or self.n_routed_experts % self.n_group != 0:
                raise ValueError(
                    f"n_group={self.n_group} does not divide n_routed_experts="
                    f"{self.n_routed_experts}; valid: {_divisors(self.n_routed_experts)}"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}"
                )
            per_group = self.n_routed_experts // self.n_group
            if self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"top_k={self.top_k} exceeds the {self.topk_group} groups x {per_group} "
                    "experts a token may choose from"
                )
            if self.n_group > 1 and self.group_score == "top2_sum" and per_group < 2:
                raise ValueError(
                    f"group_score='top2_sum' needs >= 2 experts per group, got {per_group}"
                )
        if any(not self.is_moe_layer(i) for i in range(self.n_layers)) and self.dense_ffn_dim < 1:
            raise ValueError(
                f"layers {[i for i in range(self.n_layers) if not self.is_moe_layer(i)]} are "
                f"dense but dense_ffn_dim={self.dense_ffn_dim}; set dense_ffn_dim >= 1"
            )
        if self.shared_ffn_dim < 0 or (self.shared_expert_gate and self.shared_ffn_dim == 0):
            raise ValueError(
                f"shared_ffn_dim={self.shared_ffn_dim} must be >= 0 "
                "(and > 0 with shared_expert_gate)"
            )
        if self.init_std <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"init_std={self.init_std} and rms_norm_eps={self.rms_norm_eps} must be > 0"
            )

    # ------------------------------------------------------------------ structure
    def is_moe_layer(self, i: int) -> bool:
        """True when layer i (0-based) has routed experts; see the class docstring."""
        if not 0 <= i < self.n_layers:
            raise ValueError(f"layer index {i} out of range 0..{self.n_layers - 1}")
        return (
            self.n_routed_experts > 0
            and i >= self.first_k_dense
            and i not in self.dense_layers
            and (i + 1) % self.moe_every == 0
        )

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of q and k (MLA: nope + rope parts)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self._head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self._head_dim

    @property
    def _head_dim(self) -> int:
        """head_dim as __post_init__ fills it in (d_model // n_heads where it was None)."""
        if self.head_dim is None:
            raise ValueError("head_dim is None: set it, or let ModelConfig's __post_init__ "
                             "derive it from d_model // n_heads")
        return int(self.head_dim)

    # ------------------------------------------------------------------ counting
    def attention_params(self) -> int:
        D, H, hd = self.d_model, self.n_heads, self._head_dim
        if self.attention == "gqa":
            G = self.n_kv_heads
            n = D * H * hd + 2 * D * G * hd + H * hd * D
            n += (H * hd + 2 * G * hd) if self.attn_qkv_bias else 0
            n += 2 * hd if self.qk_norm else 0
        else:
            qk, b = self.qk_head_dim, self.attn_qkv_bias
            if self.q_lora_rank is None:
                n = D * H * qk
            else:
                r = self.q_lora_rank
                n = D * r + (r if b else 0) + r + r * H * qk  # down, bias, norm, up
            c = self.kv_lora_rank + self.qk_rope_head_dim
            n += D * c + (c if b else 0) + self.kv_lora_rank
            n += self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
            n += H * self.v_head_dim * D
        return n + (D if self.attn_out_bias else 0)

    def expert_params(self) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.d_model * self.moe_ffn_dim

    def moe_layer_params(self, active: bool = False) -> int:
        """Router + routed experts (all, or top_k when active) + shared expert(s)."""
        D = self.d_model
        n_exp = self.top_k if active else self.n_routed_experts
        n = self.n_routed_experts * D + n_exp * self.expert_params()
        n += 3 * D * self.shared_ffn_dim + (D if self.shared_expert_gate else 0)
        return n

    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)

    def num_params(self) -> int:
        """Exact parameter count: embeddings, lm_head (unless tied), norms, all experts."""
        return self._count(active=False)

    def num_active_params(self) -> int:
        """Parameters one token touches: everything except the E - top_k unchosen experts."""
        return self._count(active=True)

    def _count(self, active: bool) -> int:
        D = self.d_model
        n = self.embedding_params() + D  # + final norm
        for i in range(self.n_layers):
            n += 2 * D + self.attention_params()
            if self.is_moe_layer(i):
                n += self.moe_layer_params(active)
            else:
                n += 3 * D * self.dense_ffn_dim
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) for MFU.

        6 * (active parameters that multiply activations: every projection and the lm_head,
        not the embedding lookup, norms or biases) + the attention score/value products
        6 * L * S * H * (qk_head_dim + v_head_dim) (PaLM convention: no causal discount).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        D = self.d_model
        matmul = self.num_active_params() - self.vocab_size * D  # embedding lookup is free
        if self.tie_embeddings:
            matmul += self.vocab_size * D  # the tied table is still the lm_head matmul
        norms = D + self.n_layers * 2 * D
        if self.qk_norm:
            norms += self.n_layers * 2 * self._head_dim
        if self.attention == "mla":
            norms += self.n_layers * (self.kv_lora_rank + (self.q_lora_rank or 0))
        matmul -= norms + self.n_layers * self._bias_params()
        attn = (
            6 * self.n_layers * seq_len * self.n_heads * (self.qk_head_dim + self.attn_v_head_dim)
        )
        return float(6 * matmul + attn)

    def _bias_params(self) -> int:
        H, hd, D = self.n_heads, self._head_dim, self.d_model
        n = D if self.attn_out_bias else 0
        if self.attn_qkv_bias:
            if self.attention == "gqa":
                n += H * hd + 2 * self.n_kv_heads * hd
            else:
                n += (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim
        return n

    # ------------------------------------------------------------------ conversion
    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; valid: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | str | Path) -> ModelConfig:
        """Build from a transformers `config.json` (dict or path); the field maps are in
        `model.hf_config`."""
        if isinstance(cfg, (str, Path)):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"HF config path {str(path)!r} does not exist")
            return cls(**hf_config_fields(json.loads(path.read_text())))
        return cls(**hf_config_fields(cfg))


def _choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not supported; valid: {', '.join(valid)}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)

"""Building blocks for drafter heads: attention with any input width, SwiGLU MLP, decoder layer.

EAGLE, MTP and DFlash heads are Llama-style decoder layers with small twists
(EAGLE-3's attention reads a 2H-wide input, EAGLE-1's first layer has no input
norm, Qwen3-style heads normalise q and k per head). These modules cover those
twists with plain constructor options.

Invariants:
* parameter names are the Hugging Face Llama/Qwen3 ones (`self_attn.q_proj`,
  `mlp.gate_proj`, `input_layernorm`, ...), so a converter maps a checkpoint
  onto them by renaming keys only;
* attention takes any mlx-lm cache with `offset` / `update_and_fetch`
  (`KVCache` and friends), so a head's cache rolls back with `trim` like the
  target's (`mlx_spec.cache.rollback`).

Non-goals: sliding windows, MoE feed-forwards, tensor parallelism, batch > 1
(shapes are [1, T, ...] as everywhere in mlx-spec).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.rope_utils import initialize_rope


@dataclass
class LayerArgs:
    """Dimensions of one head decoder layer (HF config field names)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_traditional: bool = False
    max_position_embeddings: int | None = None
    attention_bias: bool = False  # bias on q/k/v (and o when `o_bias`)
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3 style: RMSNorm over each head of q and k

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def causal_mask(x: mx.array, cache) -> Any:
    """The causal mask for `x` [1, T, D] appended after `cache.offset` positions."""
    return create_attention_mask(x, cache)


class Attention(nn.Module):
    """Grouped-query attention with RoPE whose projections read `input_dims` features.

    `input_dims` defaults to `hidden_size`; EAGLE-3's first layer passes 2H
    (embedding and feature side by side). The output is always `hidden_size`.
    """

    def __init__(self, args: LayerArgs, input_dims: int | None = None):
        super().__init__()
        d_in = input_dims or args.hidden_size
        self.n_heads, self.n_kv = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = initialize_rope(
            self.head_dim, args.rope_theta, args.rope_traditional,
            args.rope_scaling, args.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask: Any = None, cache=None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, heads, L, d]
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer; `input_norm=False` drops the attention-input norm.

    x -> x + attn(input_layernorm(x)) -> h + mlp(post_attention_layernorm(h)).
    EAGLE-1's first layer has no `input_layernorm` (its input is already the
    fused `fc` output).
    """

    def __init__(self, args: LayerArgs, input_norm: bool = True):
        super().__init__()
        if input_norm:
            self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask: Any = None, cache=None) -> mx.array:
        a = self.input_layernorm(x) if "input_layernorm" in self else x
        h = x + self.self_attn(a, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def quantize_like(module: nn.Module, weights: dict, config: dict) -> None:
    """Quantize the Linear/Embedding layers of `module` that `weights` stores quantized.

    A head folder written with `-q` carries `<name>.scales` beside each
    quantized weight and `{"quantization": {"group_size", "bits"}}` in its config.
    """
    q = config.get("quantization")
    if not q:
        return
    nn.quantize(
        module, group_size=q["group_size"], bits=q["bits"],
        class_predicate=lambda path, m: f"{path}.scales" in weights,
    )

"""The DFlash block network: KV injection of target taps, one non-causal pass over a block.

One call drafts a whole block (Chen et al. 2026, "DFlash", arXiv 2602.06036):

    C = hidden_norm(fc([tap_1 ; ... ; tap_k]))    # [n, H] per committed position
    x = embed([anchor, mask, ..., mask])          # [B, H] at positions p .. p+B-1
    per layer:  u = input_layernorm(x)
        q       = RoPE(q_norm(Wq u))                       at the block positions
        K, V    = [RoPE(k_norm(Wk C)), Wv C] (context, at its own positions)
                  ++ [RoPE(k_norm(Wk u)), Wv u] (block)
        x = x + Wo softmax(q K^T / sqrt(d)) V ;  x = x + MLP(post_attention_layernorm(x))
    h = norm(x)                                   # [B, H]

The same context C feeds every layer ("KV injection"); C is NOT passed through
`input_layernorm`. Attention inside the block is bidirectional unless a layer is
causal; a sliding layer sees keys with |q - k| < window (q - k < window when
causal), as in the z-lab reference mask.

Invariant: a `BlockContext` holds K/V for exactly the committed positions
0 .. p-1 (p = the anchor's position); block K/V are written into spare buffer
rows for one call and never kept, so no rollback is ever needed. Sliding layers
keep only the last `window - 1` context rows, the only ones a future block can see.

DFlash2 adds grouped dynamic convolutions around each layer's attention and MLP and a
candidate selector (`dflash2.py`). Non-goals: attention sinks, batch > 1.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..layers import MLP
from .dflash2 import CandidateSelector, GroupedConv


@dataclass(frozen=True)
class BlockConfig:
    """What a converted DFlash/DSpark head folder says about its network."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_hidden_size: int
    num_taps: int
    layer_windows: tuple  # per layer: sliding window (int) or None (full attention)
    layer_causal: tuple  # per layer: causal inside the block?
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    # DFlash2 (dflash2.py): grouped dynamic convolutions and the candidate selector
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    vocab_size: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlockConfig":
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise ValueError(
                f"head config lacks {missing}; convert the checkpoint again with "
                "`mlx-spec convert head`"
            )
        kw = {k: v for k, v in d.items() if k in names}
        kw["layer_windows"] = tuple(kw["layer_windows"])
        kw["layer_causal"] = tuple(bool(c) for c in kw["layer_causal"])
        cfg = cls(**kw)
        if not (len(cfg.layer_windows) == len(cfg.layer_causal) == cfg.num_hidden_layers):
            raise ValueError("head config: layer_windows/layer_causal need one entry per layer")
        return cfg


class ContextCache:
    """Keys/values of the committed context for one layer, oldest first.

    Buffer rows `0 .. length-1` hold positions `start .. end-1`; `room` spare
    rows after them take a block's K/V for one call (`with_block`).
    """

    step = 256

    def __init__(self, window: int | None, room: int):
        self.window, self.room = window, room
        self.keys = self.values = None
        self.start = 0  # absolute position of buffer row 0
        self.length = 0  # rows holding context

    @property
    def end(self) -> int:
        return self.start + self.length

    def skip(self, n: int) -> int:
        """How many of `n` new rows no future block will ever see (sliding layers)."""
        return 0 if self.window is None else max(0, n - (self.window - 1))

    def append(self, keys: mx.array, values: mx.array, first: int) -> None:
        """Add rows for positions `first ..`; [1, nkv, n, d] each."""
        n = keys.shape[2]
        if first != self.end:  # rows were skipped: everything held is out of reach
            self.keys, self.start, self.length = None, first, 0
        stale = 0
        if self.window is not None:
            stale = max(0, min(self.length, self.end + n - (self.window - 1) - self.start))
        if self.keys is None or self.length + n + self.room > self.keys.shape[2]:
            self._compact(stale, n + self.room + self.step, keys)
        self.keys[..., self.length : self.length + n, :] = keys
        self.values[..., self.length : self.length + n, :] = values
        self.length += n

    def _compact(self, drop: int, extra: int, like: mx.array) -> None:
        """Fresh buffers holding the rows from `drop` on, with `extra` free rows."""
        keep = self.length - drop
        shape = (1, like.shape[1], keep + extra, like.shape[3])
        new_k, new_v = mx.zeros(shape, like.dtype), mx.zeros(shape, like.dtype)
        if keep:
            new_k[..., :keep, :] = self.keys[..., drop : self.length, :]
            new_v[..., :keep, :] = self.values[..., drop : self.length, :]
        self.keys, self.values = new_k, new_v
        self.start, self.length = self.start + drop, keep

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Context ++ block K/V for one call; the block rows are not kept."""
        n = keys.shape[2]
        if self.keys is None or self.length + n > self.keys.shape[2]:
            self._compact(0, n + self.step, keys)
        L = self.length
        self.keys[..., L : L + n, :] = keys
        self.values[..., L : L + n, :] = values
        return self.keys[..., : L + n, :], self.values[..., : L + n, :]

    def mask(self, n: int, causal: bool) -> mx.array | None:
        """Visibility [n, length + n] of context ++ block keys for the n block queries."""
        if self.window is None and not causal:
            return None
        q = mx.arange(self.end, self.end + n)[:, None]
        k = mx.arange(self.start, self.end + n)[None]
        seen = mx.ones((n, self.length + n), dtype=mx.bool_)
        if causal:
            seen = seen & (k <= q)
        if self.window is not None:
            seen = seen & (q - k < self.window)
            if not causal:
                seen = seen & (k - q < self.window)
        return seen


class BlockAttention(nn.Module):
    """Queries from the block; keys/values from the injected context and the block."""

    def __init__(self, cfg: BlockConfig, layer: int):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = d**-0.5
        self.causal = cfg.layer_causal[layer]
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, H, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(d, cfg.rope_theta, False, cfg.rope_scaling,
                                    cfg.max_position_embeddings)

    def _kv(self, x: mx.array, pos: int) -> tuple[mx.array, mx.array]:
        """x [1, T, H] at positions pos.. -> K, V [1, nkv, T, d]."""
        T = x.shape[1]
        k = self.k_norm(self.k_proj(x).reshape(1, T, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(1, T, self.n_kv, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=pos), v

    def extend(self, cache: ContextCache, c: mx.array) -> None:
        """Append the context rows c [1, n, H] (positions cache.end ..) to `cache`."""
        skip = cache.skip(c.shape[1])
        first = cache.end + skip
        k, v = self._kv(c[:, skip:], first)
        cache.append(k, v, first)

    def __call__(self, u: mx.array, cache: ContextCache) -> mx.array:
        B, p = u.shape[1], cache.end  # the block sits right after the context
        q = self.q_norm(self.q_proj(u).reshape(1, B, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=p)
        keys, values = cache.with_block(*self._kv(u, p))  # [1, nkv, ctx + B, d]
        mask = cache.mask(B, self.causal)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))


class BlockLayer(nn.Module):
    def __init__(self, cfg: BlockConfig, layer: int):
        super().__init__()
        self.self_attn = BlockAttention(cfg, layer)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.conv_kernel_size:  # DFlash2
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*conv), GroupedConv(*conv)

    def __call__(self, x: mx.array, cache: ContextCache) -> mx.array:
        if "attention_conv" not in self:
            h = x + self.self_attn(self.input_layernorm(x), cache)
            return h + self.mlp(self.post_attention_layernorm(h))
        u, coef = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(u, cache), coef)
        u, coef = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(u), coef)


class DFlashNet(nn.Module):
    """fc + hidden_norm (context fusion), the block layers and the final norm."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [BlockLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.selector_rank:  # DFlash2
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size,
                                                        cfg.selector_rank, cfg.selector_top_k)

    def extend(self, caches: list[ContextCache], taps: mx.array) -> None:
        """taps [n, k*H_t] for the next n committed positions -> context K/V per layer."""
        c = self.hidden_norm(self.fc(taps))[None]  # [1, n, H]
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.extend(cache, c)

    def __call__(self, x: mx.array, caches: list[ContextCache]) -> mx.array:
        """x [1, B, H] block embeddings -> normed hidden states [B, H]."""
        for layer, cache in zip(self.layers, caches):
            x = layer(x, cache)
        return self.norm(x)[0]


class BlockContext:
    """A DFlash network plus the committed context it attends to.

    `add(taps)` appends committed positions; `forward(x)` runs one block placed
    right after them. DFlash and DSpark drafters each own one (composition).
    """

    def __init__(self, net: DFlashNet, cfg: BlockConfig, tap_ids: Sequence):
        self.net, self.cfg, self.tap_ids = net, cfg, tuple(tap_ids)
        self.caches: list[ContextCache] = []
        self.reset()

    def reset(self) -> None:
        self.caches = [ContextCache(w, self.cfg.block_size) for w in self.cfg.layer_windows]

    @property
    def length(self) -> int:
        """Committed positions held: the position of the next block's anchor."""
        return self.caches[0].end

    def add(self, taps: dict | None, n: int) -> None:
        if taps is None or any(t not in taps for t in self.tap_ids):
            raise ValueError(
                f"this drafter needs target taps {list(self.tap_ids)}, got "
                f"{None if taps is None else list(taps)}; run it through mlx_spec.stream_generate"
            )
        rows = [taps[t] for t in self.tap_ids]  # each [n, H_t]
        bad = [tuple(r.shape) for r in rows if r.shape != (n, self.cfg.target_hidden_size)]
        if bad:
            raise ValueError(
                f"target taps have shape {bad[0]}, this head needs ({n}, "
                f"{self.cfg.target_hidden_size}): was it converted for another target?"
            )
        self.net.extend(self.caches, mx.concatenate(rows, axis=-1))

    def forward(self, x: mx.array) -> mx.array:
        """x [B, H] block embeddings -> h [B, H]."""
        return self.net(x[None], self.caches)

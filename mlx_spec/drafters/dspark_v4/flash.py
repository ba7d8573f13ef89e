"""The DeepSeek-V4-Flash-0731 stage arithmetic, where it differs from V4.1's.

A 0731 stage is built from the same mlx-lm modules as a V4.1 one (`DecoderLayer`:
`attn_hc`/`ffn_hc`, norms, `Attention`'s projections, `MoE`), so the weights load
the same way; only how they are composed differs (docs/dflash.md, "DSpark inside
DeepSeek-V4 checkpoints", lists the sources):

* mHC: each sublayer collapses the streams with the `pre` its own HyperConnection
  computes from those streams (attention: `attn_hc(streams)`, FFN: `ffn_hc` of the
  streams after attention). V4.1 instead carries `pre` one sublayer forward.
* attention: q gets a weightless per-head RMS normalisation after `wq_b`, before
  RoPE; K/V are FP8-rounded only on the non-RoPE dims, in blocks of 64 (V4.1:
  no q normalisation, the whole vector in blocks of 32).
* the streams leaving the last stage go through `hc_head` (`DSparkStages._hc_head`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as dsv4

KV_BLOCK = 64  # FP8 block of the non-RoPE K/V dims


def round_kv(kv: mx.array, rope_dim: int) -> mx.array:
    """FP8 round trip of the non-RoPE dims (blocks of 64); the RoPE dims are kept."""
    head, tail = kv[..., :-rope_dim], kv[..., -rope_dim:]
    if head.shape[-1] % KV_BLOCK:
        raise ValueError(f"DeepSeek-V4-Flash DSpark: the {head.shape[-1]} non-RoPE K/V dims "
                         f"are not a multiple of the FP8 block ({KV_BLOCK})")
    return mx.concatenate([dsv4._fake_quant_fp8(head, KV_BLOCK), tail], axis=-1)


def project_kv(attn: dsv4.Attention, x: mx.array, start: int) -> mx.array:
    """K/V rows [1, T, head_dim] of x [1, T, H] at positions start .."""
    kv = dsv4._apply_rope(attn.kv_norm(attn.kv_proj(x)), attn.rope, rope_dim=attn.rope_dim,
                          offset=start)
    return round_kv(kv, attn.rope_dim)


def attention(attn: dsv4.Attention, x: mx.array, context: mx.array | None, start: int,
              eps: float) -> mx.array:
    """Block rows x [1, B, H] attend to [context rows ; all block rows] (no mask), with sinks."""
    _, B, _ = x.shape
    q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).reshape(1, B, attn.num_heads, attn.head_dim)
    q = mx.fast.rms_norm(q.astype(mx.float32), weight=None, eps=eps).astype(q.dtype)
    q = dsv4._apply_rope(q, attn.rope, rope_dim=attn.rope_dim, offset=start)
    kv = project_kv(attn, x, start)
    keys = kv if context is None else mx.concatenate([context, kv], axis=1)
    keys = keys.astype(mx.float32)[:, None]  # [1, 1, n, D]: one latent head, read as K and V
    out = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32).transpose(0, 2, 1, 3), keys, keys, scale=attn.head_dim ** -0.5,
        sinks=attn.sinks.astype(mx.float32))
    out = out.transpose(0, 2, 1, 3).astype(q.dtype)  # [1, B, heads, D]
    out = dsv4._apply_rope(out, attn.rope, rope_dim=attn.rope_dim, offset=start, inverse=True)
    out = attn.o_a_proj(out.reshape(B, attn.o_groups, 1, -1), attn._group_ids)
    return attn.o_b_proj(out.reshape(1, B, -1))


def stage(layer: dsv4.DecoderLayer, streams: mx.array, context: mx.array | None, start: int,
          eps: float) -> mx.array:
    """One 0731 stage on the hc streams [1, B, hc, H]: each sublayer uses its own pre."""
    pre, post, comb = layer.attn_hc(streams)
    h = layer.input_layernorm(dsv4._collapse(streams, pre))
    h = attention(layer.self_attn, h, context, start, eps)
    streams = dsv4._expand(h, streams, post, comb)
    pre, post, comb = layer.ffn_hc(streams)
    h = layer.mlp(layer.post_attention_layernorm(dsv4._collapse(streams, pre)))
    return dsv4._expand(h, streams, post, comb)

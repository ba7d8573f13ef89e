"""The DSpark stages of a DeepSeek-V4 checkpoint (`mtp.{0..S-1}.*`) as one MLX module.

Per committed position t (DeepSeek's V4 reference `DSparkBlock` / `Transformer.forward_spec`
and vLLM's `deepseek_v4/nvidia/dspark.py`; taps are hc-stream means, see drafter.py):

    m_t      = main_norm(main_proj([mean_c tap_1(t) ; ... ; mean_c tap_n(t)]))   # [H], once
    ctx_s(t) = fp8(RoPE_t(kv_norm_s(kv_proj_s(m_t))))        # per stage s; last `window` kept

Per proposal, anchor y at position p (= the committed length), B block rows:

    streams = embed([y, noise x (B-1)]) copied to the hc streams
    stage s : mHC-wrapped attention (sinks) over [ctx_s ; the block's own K/V], every row
              visible to every block query (non-causal), queries at positions p .. p+B-1,
              then the mHC-wrapped MoE
    U = target lm_head(norm(x))  [B, V];  h = x (pre-norm) feeds the confidence head

Two variants, chosen by the tensors present (load.py):

* "v41" (DeepSeek-V4.1): each stage is mlx-lm's own `DecoderLayer` unchanged (the
  attention input collapsed with the pre-mix carried from the previous sublayer, a
  one-hot seed for the first; K/V FP8-rounded whole in blocks of 32, mlx-lm's
  `_fake_quant_fp8`), and x = collapse(streams, last stage's pre-mix). The stage's
  attention reads its window through `cache.update_window(kv)`, so the drafter passes
  a `_BlockWindow` holding the context rows, and indices that show every row.
* "0731" (DeepSeek-V4-Flash-0731): the same modules composed as in flash.py (own pre
  per sublayer, per-head q RMS norm, K/V non-RoPE dims rounded in blocks of 64), and
  x = hc_head(streams).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v41 as dsv4

from ..spark_chain import ConfidenceHead, MarkovHead
from . import flash

VARIANTS = ("0731", "v41")


def stage_args(target: dsv4.ModelArgs, stages: int, text: dict) -> dsv4.ModelArgs:
    """The target's args for the stages: no compressor/indexer, the dspark_* MoE size."""
    experts = text.get("dspark_n_routed_experts") or target.n_routed_experts
    active = (text.get("dspark_num_experts_per_tok") or text.get("dspark_n_activated_experts")
              or target.num_experts_per_tok)
    return replace(
        target, num_hidden_layers=stages, compress_ratios=(), kv_source_layer_ids=(),
        index_source_layer_ids=(), candidate_source_layer_id=-1,
        n_routed_experts=int(experts), num_experts_per_tok=int(active),
    )


class _BlockWindow:
    """What a stage's attention takes as its window: the context rows, then the block's."""

    def __init__(self, context: mx.array | None):
        self.context = context

    def update_window(self, kv: mx.array) -> mx.array:
        return kv if self.context is None else mx.concatenate([self.context, kv], axis=1)


class DSparkStages(nn.Module):
    """All stages plus the head parts; parameter names are the loader's (see load.py)."""

    def __init__(self, args: dsv4.ModelArgs, n_taps: int, markov_rank: int, *,
                 variant: str, confidence: bool, confidence_bias: bool):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"unknown DeepSeek-V4 DSpark variant {variant!r}; one of {VARIANTS}")
        H, hc = args.hidden_size, args.hc_mult
        self.args, self.variant = args, variant
        self.layers = [dsv4.DecoderLayer(args, s) for s in range(args.num_hidden_layers)]
        self.main_proj = nn.Linear(n_taps * H, H, bias=False)
        self.main_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if variant == "0731":
            self.hc_head_fn = mx.zeros((hc, hc * H), dtype=mx.float32)
            self.hc_head_base = mx.zeros((hc,), dtype=mx.float32)
            self.hc_head_scale = mx.ones((1,), dtype=mx.float32)
        if markov_rank:
            self.markov_head = MarkovHead(args.vocab_size, markov_rank)
        if confidence:
            self.confidence_head = ConfidenceHead(H + markov_rank, confidence_bias)

    def main_rows(self, feats: mx.array) -> mx.array:
        """Tap means [T, n_taps * H] -> the stages' shared context input m [1, T, H]."""
        return self.main_norm(self.main_proj(feats))[None]

    def context_rows(self, m: mx.array, start: int) -> list[mx.array]:
        """Per stage, the context K/V [1, T, head_dim] of m at positions start .."""
        out = []
        for layer in self.layers:
            a = layer.self_attn
            if self.variant == "0731":
                out.append(flash.project_kv(a, m, start))
                continue
            kv = dsv4._apply_rope(a.kv_norm(a.kv_proj(m)), a.rope, rope_dim=a.rope_dim, offset=start)
            out.append(dsv4._fake_quant_fp8(kv, 32))
        return out

    def _hc_head(self, streams: mx.array) -> mx.array:
        """Collapse the hc streams with the learned, input-dependent weights (V4-0731)."""
        flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
        flat = mx.fast.rms_norm(flat, weight=None, eps=self.args.rms_norm_eps)
        mix = (flat @ self.hc_head_fn.T) * self.hc_head_scale + self.hc_head_base
        return dsv4._collapse(streams, mx.sigmoid(mix) + self.args.hc_eps)

    def __call__(self, x: mx.array, contexts: list, start: int) -> tuple[mx.array, mx.array]:
        """Block embeddings x [1, B, H] at positions start .. -> (h [B, H] pre-norm, norm(h))."""
        B, hc = x.shape[1], self.args.hc_mult
        streams = mx.broadcast_to(x[:, :, None, :], (1, B, hc, x.shape[-1]))
        if self.variant == "0731":
            for layer, ctx in zip(self.layers, contexts, strict=True):
                streams = flash.stage(layer, streams, ctx, start, self.args.rms_norm_eps)
            h = self._hc_head(streams)
            return h[0], self.norm(h)[0]
        pre_mix = (mx.arange(hc) == 0).astype(mx.float32)
        pre_mix = mx.broadcast_to(pre_mix, (1, B, hc))
        for layer, ctx in zip(self.layers, contexts, strict=True):
            n = B + (0 if ctx is None else ctx.shape[1])
            seen = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (1, B, n))  # all rows, no mask
            streams, pre_mix = layer(streams, pre_mix, start_pos=start, window_idx=seen,
                                     cache=_BlockWindow(ctx), shared={})
        h = dsv4._collapse(streams, pre_mix)  # V4.1: the last stage's pre-mix
        return h[0], self.norm(h)[0]


class StageContext:
    """Each stage's context K/V for the last `window` committed positions."""

    def __init__(self, net: DSparkStages, window: int):
        self.net, self.window = net, window
        self.reset()

    def reset(self) -> None:
        self.rows: list = [None] * len(self.net.layers)
        self.end = 0  # committed positions seen

    def add(self, feats: mx.array) -> None:
        """Tap means of the next committed positions [T, n_taps * H]."""
        T = feats.shape[0]
        skip = max(0, T - self.window)  # rows no future block can reach
        if T > skip:
            new = self.net.context_rows(self.net.main_rows(feats[skip:]), self.end + skip)
            self.rows = [n if r is None else mx.concatenate([r, n], axis=1)[:, -self.window:]
                         for r, n in zip(self.rows, new)]
        self.end += T

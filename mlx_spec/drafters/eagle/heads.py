"""The EAGLE-1/2 and EAGLE-3 head networks, as MLX modules.

Written from the EAGLE reference (github.com/SafeAILab/EAGLE): `eagle/model/cnets1.py`
for EAGLE-1/2, `eagle/model/cnets.py` for EAGLE-3 (with vLLM's `llama_eagle3.py`).

Both heads map one position at a time to the next: position t reads the
embedding of token x_{t+1} and a feature of position t, and returns the
feature to feed back at position t+1 plus the hidden state the logits are
read from. What differs is the feature and the logits:

* EAGLE-1/2: feature = the target's final-norm output (`FINAL_NORM` tap);
  `z = fc([emb ; feature])` (HASS `add_para_norm`: each RMS-normed first,
  vLLM `llama_eagle.py`), decoder layers (layer 0 has no input norm), and
  the output `g` is both the next feature and what the TARGET's LM head reads.
* EAGLE-3: feature = `fc(concat(three target taps))` (width H); layer 0
  attends over `[input_layernorm(emb) ; hidden_norm(g)]` (2H wide) with `g`
  as the residual, later layers are ordinary; logits =
  `lm_head(norm(o))` over the head's own draft vocabulary; the next feature is
  `o` (or `norm(o)` with `norm_output`).

Invariant: parameter names equal the converted folder's tensor names (the
converter renames checkpoints onto them), and every call appends its T
positions to the head's own KV cache at the cache's offset (= the target
position of the first row). Tree attention (EAGLE-2's dynamic tree) goes through
the cache's `make_mask` and the ropes (`mlx_spec.tree.call_block`), not through the
heads. Non-goals: training-time options that do not change inference.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...taps import FINAL_NORM
from ..layers import MLP, Attention, DecoderLayer, LayerArgs, causal_mask


class Eagle1Head(nn.Module):
    """EAGLE-1/2 head: `fc` [H, 2H] (+ bias) and `num_layers` decoder layers."""

    def __init__(self, config: dict):
        super().__init__()
        args = LayerArgs.from_dict(config)
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=bool(config.get("fc_bias", False)))
        if config.get("add_para_norm"):  # HASS
            self.embedding_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
            self.hidden_states_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        # The reference's first layer drops its input norm: fc's output goes straight in
        # (HASS heads converted with skip_prenorm: false keep it).
        first = bool(config.get("first_input_norm", False))
        self.layers = [DecoderLayer(args, input_norm=i > 0 or first) for i in range(config["num_layers"])]

    def features(self, taps: dict, tap_ids: tuple) -> mx.array:
        """[T, H]: the target's final-norm output at the tapped positions."""
        return taps[FINAL_NORM]

    def __call__(self, emb: mx.array, feat: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """emb, feat [1, T, H] -> (next feature, hidden for the target LM head), both [1, T, H]."""
        if "embedding_layernorm" in self:
            emb, feat = self.embedding_layernorm(emb), self.hidden_states_layernorm(feat)
        h = self.fc(mx.concatenate([emb, feat], axis=-1))  # embedding first
        mask = causal_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return h, h


class Eagle3FirstLayer(nn.Module):
    """EAGLE-3 layer 0: attention over `[input_layernorm(emb) ; hidden_norm(g)]`, residual g."""

    def __init__(self, args: LayerArgs, norm_before_residual: bool):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = nn.RMSNorm(H, eps=eps)  # on the token embedding
        self.hidden_norm = nn.RMSNorm(H, eps=eps)  # on the feature
        self.self_attn = Attention(args, input_dims=2 * H)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=eps)
        self.mlp = MLP(H, args.intermediate_size)

    def __call__(self, emb: mx.array, g: mx.array, mask, cache) -> mx.array:
        g_n = self.hidden_norm(g)
        u = mx.concatenate([self.input_layernorm(emb), g_n], axis=-1)  # [1, T, 2H], embedding first
        h = (g_n if self.norm_before_residual else g) + self.self_attn(u, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 head: fuse taps with `fc`, one 2H-input layer (+ ordinary layers), own LM head."""

    def __init__(self, config: dict):
        super().__init__()
        args = LayerArgs.from_dict(config)
        H, eps = args.hidden_size, args.rms_norm_eps
        k, fc_in = config["num_taps"], config["fc_input_size"]
        self.norm_output = bool(config.get("norm_output", False))
        if config.get("norm_before_fc"):
            self.input_norm = nn.RMSNorm(fc_in, eps=eps)  # one norm over the whole concat
        if config.get("fc_norm"):
            self.fc_norm = [nn.RMSNorm(fc_in // k, eps=eps) for _ in range(k)]  # one per tap
        self.fc = nn.Linear(fc_in, H, bias=bool(config.get("fc_bias", False)))
        first = Eagle3FirstLayer(args, bool(config.get("norm_before_residual", False)))
        self.layers = [first] + [DecoderLayer(args) for _ in range(config["num_layers"] - 1)]
        self.norm = nn.RMSNorm(H, eps=eps)
        if config.get("own_lm_head", True):
            self.lm_head = nn.Linear(H, config["draft_vocab_size"], bias=False)
        if config.get("own_embedding", False):
            self.embed_tokens = nn.Embedding(config["vocab_size"], H)

    def features(self, taps: dict, tap_ids: tuple) -> mx.array:
        """[T, H]: the taps (in checkpoint order, low to high) fused by `fc`."""
        parts = [taps[t] for t in tap_ids]  # each [T, H_t]
        if "fc_norm" in self:
            parts = [norm(p) for norm, p in zip(self.fc_norm, parts)]
        a = mx.concatenate(parts, axis=-1)  # [T, k * H_t]
        if "input_norm" in self:
            a = self.input_norm(a)
        return self.fc(a)

    def __call__(self, emb: mx.array, g: mx.array, cache: list, mask=None) -> tuple[mx.array, mx.array]:
        """emb, g [1, T, H] -> (next feature, normed hidden for `lm_head`), both [1, T, H].

        `mask` (default: causal after the cache's offset) lets the trainer's
        training-time test run this very forward with its own attention pattern
        (mlx_spec.train.ttt)."""
        if mask is None:
            mask = causal_mask(emb, cache[0])
        h = self.layers[0](emb, g, mask, cache[0])
        for layer, c in zip(self.layers[1:], cache[1:]):
            h = layer(h, mask, c)
        out = self.norm(h)
        return (out if self.norm_output else h), out

"""Gemma 4 assistant drafters (`google/gemma-4-*-it-assistant`: `Gemma4AssistantForCausalLM`,
and the 12B's `Gemma4UnifiedAssistantForCausalLM`), drafting for a Gemma 4 target.

The assistant is a small Gemma 4 text model whose attention layers have queries only:
they attend to the TARGET's keys and values (Hugging Face transformers'
`modeling_gemma4_assistant.py`, its `SinglePositionMultiTokenCandidateGenerator`; ported
by mlx-vlm as `speculative/drafters/gemma4_assistant`). One draft step, for the newest
committed position P-1 and the token t to draft after (t = y first, then each draft):

    x = pre_projection([target_embed(t) * sqrt(H_target) ; h])     # h: see below
    per layer (type sliding or full): Gemma 4 decoder layer whose attention takes
        q = RoPE(q_norm(q_proj(input_layernorm(x))))  at position P-1 (the same every step)
        K, V = the target's keys/values of its last layer of that type, positions 0 .. P-1
              (a sliding layer sees the last `sliding_window` of them)
    g = norm(x);  logits = embed_tokens^T g  (tied; or lm_head; or the centroid-routed
        `masked_embedding` of E2B/E4B: only the tokens of the top-k clusters keep their
        logits, the rest get min - 1)
    h <- post_projection(g)  for the next step

The first h is the target's final-norm output at P-1. The target's K/V are recomputed
here from its own layers (the input of layer L through L's `input_layernorm`, `k_proj`,
`k_norm`, `v_proj`, `v_norm`, RoPE), the same operations its attention runs, from the
taps of the committed positions: the drafter never reads the target's cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text as g4

from ..sampling import Sampling
from ..taps import EMBED, FINAL_NORM, decoder_stack, embedding, embedding_scale
from .base import MAX_DRAFT, Draft, SavesState, check_target, pick

TYPES = ("sliding_attention", "full_attention")


def assistant_args(config: dict) -> g4.ModelArgs:
    """The assistant's own Gemma 4 text arguments: every layer reads shared K/V."""
    text = dict(config["text_config"])
    args = g4.ModelArgs.from_dict({**text, "hidden_size_per_layer_input": 0})
    return replace(args, num_kv_shared_layers=args.num_hidden_layers, enable_moe_block=False)


class MaskedEmbedding(nn.Module):
    """E2B/E4B: score `num_centroids` token clusters, keep the top-k clusters' tokens."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int):
        super().__init__()
        self.top_k, self.per = top_k, vocab // centroids
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)

    def __call__(self, g: mx.array, embed: nn.Module) -> mx.array:
        """g [H] -> logits [V]: the selected tokens' h . E[t], every other token min - 1
        (`embed`: the token embedding, float or quantized: only the selected rows are read)."""
        clusters = mx.argpartition(-self.centroids(g), kth=self.top_k - 1)[: self.top_k]
        ids = self.token_ordering.reshape(-1, self.per)[clusters].reshape(-1)
        sel = embed(ids) @ g
        out = mx.full(self.token_ordering.shape, sel.min() - 1, dtype=sel.dtype)
        out[ids] = sel
        return out


class AssistantNet(nn.Module):
    """Parameter names as the converted folder stores them (`converters/gemma4.py`)."""

    def __init__(self, config: dict):
        super().__init__()
        a, Hb = assistant_args(config), int(config["backbone_hidden_size"])
        self.args = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [g4.DecoderLayer(a, i) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * Hb, a.hidden_size, bias=False)
        self.post_projection = nn.Linear(a.hidden_size, Hb, bias=False)
        if not config.get("tie_word_embeddings", True):
            self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedding(a.hidden_size, a.vocab_size,
                                                    int(config["num_centroids"]),
                                                    int(config["centroid_intermediate_top_k"]))

    def step(self, x: mx.array, kv: dict, pos: int) -> tuple[mx.array, mx.array]:
        """x [2 H_target] -> (logits [V], the next step's h [H_target])."""
        h = self.pre_projection(x)[None, None]
        for layer in self.layers:
            h, _, _ = layer(h, None, None, shared_kv=kv[layer.layer_type], offset=pos)
        g = self.norm(h)[0, 0]
        if "masked_embedding" in self:
            logits = self.masked_embedding(g, self.embed_tokens)
        else:
            logits = (self.lm_head if "lm_head" in self else self.embed_tokens.as_linear)(g)
        return logits, self.post_projection(g)


def source_layers(args) -> dict:
    """type -> the target layer whose K/V the assistant reads: the last of that type
    among the layers that compute their own K/V (KV-shared layers reuse exactly those)."""
    own = args.num_hidden_layers - (args.num_kv_shared_layers or 0)
    found = {t: max((i for i in range(own) if args.layer_types[i] == t), default=None) for t in TYPES}
    return {t: i for t, i in found.items() if i is not None}


class Gemma4AssistantDrafter(SavesState):
    """Chains k assistant steps; keeps the target's K/V of two layers for the committed positions."""

    STATE = ("_kv", "_h", "_n")  # committed state (SavesState)
    max_draft = MAX_DRAFT

    def __init__(self, net: AssistantNet, config: dict):
        self.net, self.config = net, config
        self.taps: tuple = (FINAL_NORM,)
        self._src: dict = {}
        self._kv: dict = {}
        self._h, self._n = None, 0

    def bind(self, model, tokenizer) -> None:
        stack = decoder_stack(model)
        args = getattr(getattr(model, "language_model", model), "args", None)
        if not isinstance(args, g4.ModelArgs):
            raise ValueError("this Gemma 4 assistant drafts for Gemma 4 targets (mlx-lm gemma4 / "
                             f"gemma4_text), not {type(model).__name__}")
        check_target(model, "this Gemma 4 assistant", hidden_size=self.net.post_projection.weight.shape[0],
                     vocab=self.net.args.vocab_size)
        self._src = source_layers(args)
        missing = [t for t in {layer.layer_type for layer in self.net.layers} if t not in self._src]
        if missing:
            raise ValueError(f"this Gemma 4 assistant reads the target's {missing} K/V, which this "
                             "target has no layer for")
        self._attn = {t: stack.layers[i] for t, i in self._src.items()}
        self._embed, self._scale = embedding(stack), embedding_scale(stack)
        self._window = args.sliding_window
        # the input of layer L is the output of layer L-1 (the scaled embedding for L = 0)
        self.taps = (FINAL_NORM, *(EMBED if i == 0 else i - 1 for i in self._src.values()))
        self._kv, self._h, self._n = {t: None for t in self._src}, None, 0

    def _append(self, taps: dict, n: int) -> None:
        for t, i in self._src.items():
            x = taps[EMBED if i == 0 else i - 1][None]  # [1, n, H]
            layer = self._attn[t]
            a = layer.self_attn
            u = layer.input_layernorm(x)
            k = a.k_proj(u).reshape(1, n, a.n_kv_heads, a.head_dim)
            v = k if a.use_k_eq_v else a.v_proj(u).reshape(1, n, a.n_kv_heads, a.head_dim)
            k = a.rope(a.k_norm(k).transpose(0, 2, 1, 3), offset=self._n)
            v = a.v_norm(v).transpose(0, 2, 1, 3)
            old = self._kv[t]
            if old is not None:
                k, v = mx.concatenate([old[0], k], axis=2), mx.concatenate([old[1], v], axis=2)
            if t == "sliding_attention":
                k, v = k[:, :, -self._window :], v[:, :, -self._window :]
            self._kv[t] = (k, v)
        self._h = taps[FINAL_NORM][-1]
        self._n += n

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        self._append(taps, len(tokens))

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        self._append(taps, len(tokens))

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        h, tok, pos = self._h, mx.array([y], dtype=mx.uint32), self._n - 1
        tokens, qs = [], []
        for _ in range(min(k, self.max_draft)):
            e = self._embed(tok)[0] * self._scale  # (a quantized target's embedding gives floats too)
            x = mx.concatenate([e, h.astype(e.dtype)])
            logits, h = self.net.step(x, self._kv, pos)
            t, q = pick(logits, sampling)
            tokens.append(t)
            if q is not None:
                qs.append(q)
            tok = t.reshape(1).astype(mx.uint32)
        return Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(qs) if qs else None)


def load(folder, config: dict, model) -> Gemma4AssistantDrafter:
    """The assistant in a converted head folder (LOADERS["gemma4_assistant"])."""
    from pathlib import Path

    from .dflash import assign

    net = AssistantNet(config)
    weights = mx.load(str(Path(folder) / "model.safetensors"))
    assign(net, weights, config, f"Gemma 4 assistant {folder}")
    return Gemma4AssistantDrafter(net, config)

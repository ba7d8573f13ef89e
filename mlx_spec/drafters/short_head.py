"""A draft model's LM head over part of the vocabulary.

A small draft model with a large vocabulary spends much of each forward in its LM head:
Qwen2.5-0.5B's tied 151,936 x 896 head is a quarter of its weights, read once per drafted
token. Most of those rows are tokens a draft almost never proposes. FR-Spec (Zhao et al.,
2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling", arXiv:2502.14856) drafts from the most frequent tokens only; the
target still verifies over the whole vocabulary, so the output is unchanged (greedy: the
target's own tokens; sampled: rejection sampling is exact for any draft distribution q, and
q is zero outside the subset) and only acceptance can fall, when the target's token is one
the draft could not propose.

Without corpus counts the rank here is the tokenizer's own: byte-level BPE vocabularies
(GPT-2, Llama 3, Qwen2, SmolLM2) number their tokens in merge order, most frequent pairs
first, so the first `n` ids stand in for the most frequent ones. Tokens of the text so far
(the prompt and what was generated) join the subset too: a request's own rare words and
the chat formatting a tokenizer's corpus ranked low (Qwen's "```") are the ones it repeats.

`ShortHead(model, n, v)` computes the head from the model's decoder stack
(`model.model(...)`, then the tied embedding or `lm_head` rows of the subset: float or
quantized), and `layout` puts each row's logits at their token ids in a [..., V] row of
-inf elsewhere. `short_head` returns None where the model's own forward is not exactly
that (a final soft-cap or scale, an unknown layout): checked once per model, numerically.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..identity import IdentityMap

log = logging.getLogger("mlx_spec")
HEAD_VOCAB = 49152  # the default subset: the first 48k token ids (+ the text's own tokens)
_CACHED = 16  # gathered row blocks and layout maps kept per head

_HEADS = IdentityMap()  # draft model -> {(n, v): ShortHead | None}


def short_head(model, n: int | None, v: int) -> "ShortHead | None":
    """The subset head of `model` over ids < `n` (+ extras) for a target vocabulary of `v`
    ids, or None: `n` is None, not below the vocabulary, or the model's forward is not its
    decoder stack then its LM head."""
    layer = _head_layer(model)
    if n is None or layer is None or n >= min(v, layer["weight"].shape[0]):
        return None
    v = min(v, layer["weight"].shape[0])
    heads = _HEADS.setdefault(model, dict)
    if (n, v) not in heads:
        head = ShortHead(model, n, v)
        heads[(n, v)] = head if head.matches_model() else None
    return heads[(n, v)]


def _head_layer(model):
    """The LM head's layer (`lm_head`, or the tied input embedding), or None: another layout."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module):
        return None
    layer = getattr(model, "lm_head", None)
    if layer is None:
        layer = getattr(inner, "embed_tokens", None)
    if not isinstance(layer, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return None
    return None if "bias" in layer else layer


class ShortHead:
    """`model`'s LM head over ids < n and the `extra` ids a call names (ids below `v` only);
    the gathered rows of recent extras and the layout maps are kept for the next calls."""

    def __init__(self, model, n: int, v: int):
        self.model, self.n, self.v = model, n, v
        self._layer = _head_layer(model)
        self._quant = isinstance(self._layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        self._base = self._gather(slice(0, n))
        self._blocks: dict[tuple, tuple] = {}  # extras -> their gathered rows
        self._maps: dict[tuple, mx.array] = {}  # (extras computed, a row's extras) -> [v] gather map

    def _gather(self, rows) -> tuple:
        """The head's weights (and quantization scales, biases) of `rows`."""
        lay = self._layer
        if not self._quant:
            return (lay["weight"][rows],)
        biases = lay.get("biases")
        return (lay["weight"][rows], lay["scales"][rows], None if biases is None else biases[rows])

    def _project(self, h: mx.array, block: tuple) -> mx.array:
        if not self._quant:
            return h @ block[0].T
        lay = self._layer
        return mx.quantized_matmul(h, block[0], scales=block[1], biases=block[2], transpose=True,
                                   group_size=lay.group_size, bits=lay.bits,
                                   mode=getattr(lay, "mode", "affine"))

    def extras(self, tokens, known: tuple = ()) -> tuple:
        """`known` with the tokens of `tokens` the base subset lacks, sorted."""
        new = {t for t in tokens if self.n <= t < self.v}
        return known if new <= set(known) else tuple(sorted(new.union(known)))

    def __call__(self, inputs: mx.array, cache=None, extra: tuple = (), last: int | None = None) -> mx.array:
        """Logits [..., n + len(extra)] of the subset (the base ids, then `extra`), of the
        last `last` positions (None: all)."""
        h = self.model.model(inputs, cache=cache)
        if last is not None:
            h = h[..., -last:, :]
        logits = self._project(h, self._base)
        if extra:
            block = self._blocks.get(extra)
            if block is None:
                if len(self._blocks) >= _CACHED:
                    self._blocks.clear()
                block = self._blocks[extra] = self._gather(mx.array(extra, mx.int32))
            logits = mx.concatenate([logits, self._project(h, block)], axis=-1)
        return logits

    def layout(self, logits: mx.array, extra: tuple, own: tuple | None = None, width: int | None = None) -> mx.array:
        """Subset logits [..., n + len(extra)] placed at their token ids in rows of `width`
        (default: v) with -inf elsewhere; with `own` (a subset of `extra`: a batch row's own
        extras among the batch's), the other extras are -inf too."""
        width = self.v if width is None else width
        key = (extra, own, width)
        idx = self._maps.get(key)
        if idx is None:
            size = self.n + len(extra)
            m = np.full(width, size, np.int32)  # the -inf column
            m[: self.n] = np.arange(self.n)
            ids = np.array(extra if own is None else own, np.int64)
            if ids.size:
                m[ids] = self.n + np.searchsorted(np.array(extra, np.int64), ids)
            if len(self._maps) >= _CACHED:
                self._maps.clear()
            idx = self._maps[key] = mx.array(m)
        ninf = mx.full((*logits.shape[:-1], 1), -mx.inf, logits.dtype)
        return mx.take(mx.concatenate([logits, ninf], axis=-1), idx, axis=-1)

    def matches_model(self) -> bool:
        """Whether the model's own logits at the subset's ids are this head's (one forward of
        a few tokens, no cache)."""
        try:
            x = mx.array([[1, 2, 3]], mx.uint32)
            full = self.model(x)[0, :, : self.n]
            mine = self(x)[0]
            ok = bool(mx.allclose(full, mine, rtol=1e-3, atol=1e-3 * float(mx.abs(full).max()) + 1e-5))
        except Exception as e:  # an unusual forward signature or layout: the full head
            log.debug("short draft head unavailable: %s", e)
            return False
        if not ok:
            log.info("this draft model's forward is not its decoder stack then its LM head "
                     "(a soft-cap or scale?): it drafts over its whole vocabulary")
        return ok

"""The EAGLE chain drafter: k head steps per proposal, over the head's own KV cache.

Position t of the head pairs the target's feature at t with the token x_{t+1}
and predicts x_{t+2}; head positions equal target positions. The drafter keeps

* `cache`: the head's KV cache over every position whose feature came from the
  target (committed context only);
* `_feats` / `_toks`: committed features the head has not consumed yet and the
  tokens that follow them, `len(_toks) == len(_feats) - 1` (the last feature
  waits for the next y).

`propose(y, k)` feeds the waiting pairs (the last one with y), then chains
k - 1 steps that feed back the head's own feature and drafted token. `commit`
trims those chained positions (their features were the head's guesses) and
queues the target's real features of the kept tokens. The proposal stays
lazy: nothing is read to the host.

With `tree_budget=N` it grows an EAGLE-2 dynamic tree instead (`mlx_spec.dynamic_tree`):
each depth's frontier is fed in one head forward, every row pairing its token with the
feature its parent's row produced, under a tree mask over the head's cache; `commit`
drops all those rows as it drops a chain's, since only the target's features are kept.

EAGLE-3 drafts over its own vocabulary: a draft id i is target id
`draft_to_target[i]`, and `q` is the draft distribution scattered into a zero
vector over the target vocabulary (tokens outside the draft vocabulary get 0).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ... import dynamic_tree, tree
from ...cache import rollback
from ...sampling import Sampling
from ...taps import decoder_stack, embedding
from ..base import (
    EMPTY, MAX_DRAFT, PREFILL_CHUNK, Draft, PlansTrees, SavesState, chain, check_target, target_lm_head, vocab_size,
)


class EagleDrafter(SavesState, PlansTrees):
    """Chain drafter around an `Eagle1Head` or `Eagle3Head` (see mlx_spec.drafters.eagle.heads)."""

    STATE = ("cache", "_feats", "_toks")  # committed state (SavesState)

    max_draft = MAX_DRAFT

    def __init__(self, head, taps: Sequence, config: dict, draft_to_target: mx.array | None = None,
                 tree_budget: int | None = None, tree_width: int = 4):
        dynamic_tree.check_settings(tree_budget, tree_width)
        self.tree_budget, self.tree_width = tree_budget, tree_width
        self.head = head
        self.taps = tuple(taps)
        self.config = config  # the head folder's config (dimensions, target identity)
        self._d2t = draft_to_target  # [V_d] target ids, or None when the head speaks the target vocab
        self.cache: list = []
        self._reset()

    def _reset(self) -> None:
        self._feats: mx.array | None = None  # [m, H] committed features not yet consumed
        self._toks: list[int] = []  # the m - 1 tokens following them
        self._y_fed = False  # propose consumed the pending pairs (y included)
        self._chained = 0  # head positions fed with its own guesses, to trim at commit

    def bind(self, model, tokenizer) -> None:
        d2t = self._d2t is not None and self._d2t.size
        check_target(model, "this EAGLE head", made_for=self.config.get("mlx_spec", {}).get("target", {}),
                     layers=self.taps,
                     token_ids={"largest draft_to_target id": int(self._d2t.max())} if d2t else None)
        stack = decoder_stack(model)
        self._embed = self.head.embed_tokens if "embed_tokens" in self.head else embedding(stack)
        self._lm = self.head.lm_head if "lm_head" in self.head else target_lm_head(model)
        self._v_target = vocab_size(model)
        self.cache = [KVCache() for _ in self.head.layers]
        self._reset()

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        if taps is None:
            raise ValueError("an EAGLE drafter needs target taps; run it through mlx_spec.stream_generate")
        tokens = [int(t) for t in tokens]
        feats = self.head.features(taps, self.taps)  # [P, H]
        # Features and the tokens following them; a restored state's waiting pairs come first.
        if self._feats is None:
            nxt = tokens[1:]
        else:
            feats, nxt = mx.concatenate([self._feats, feats]), self._toks + tokens
        # Pairs (f_t, x_{t+1}) are complete but for the last feature: consume them in chunks.
        for s in range(0, len(nxt), PREFILL_CHUNK):
            e = min(s + PREFILL_CHUNK, len(nxt))
            emb = self._embed(mx.array(nxt[s:e], mx.uint32)[None])
            self.head(emb, feats[None, s:e], self.cache)
            mx.eval([c.state for c in self.cache])
        self._feats, self._toks = feats[len(nxt) :], []

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        k = min(k, self.max_draft)
        if k <= 0:
            return EMPTY
        if self._feats is None:
            raise ValueError("propose() called again before commit(): the drafter has no committed features")
        toks = mx.array(self._toks + [int(y)], mx.uint32)
        feat, out = self.head(self._embed(toks[None]), self._feats[None], self.cache)
        self._feats, self._toks, self._y_fed = None, [], True
        feat = feat[:, -1:]  # [1, 1, H]
        shape = self.step_tree()
        if shape is not None:
            return self._grow(feat[0], self._lm(out[0, -1]), k, *shape, sampling)

        def step(t: mx.array) -> mx.array:  # chain: the head's own feature at the next position
            nonlocal feat
            feat, out = self.head(self._embed(t[None]), feat, self.cache)
            return self._lm(out[0, -1])

        self._chained = k - 1
        return chain(self._lm(out[0, -1]), k, sampling, step, self._pick)

    def _grow(self, feat: mx.array, logits: mx.array, k: int, budget: int, width: int, sampling: Sampling) -> Draft:
        """An EAGLE-2 dynamic tree from the root's feature [1, H] and logits."""
        base, fed = self.cache[0].offset, [feat]  # fed[-1]: the features the last depth produced

        def step(tokens: mx.array, slots, mask: mx.array, shift: int) -> mx.array:
            w = tokens.shape[0]
            parent = mx.broadcast_to(fed[-1], (w, fed[-1].shape[-1])) if slots is None else fed[-1][slots]
            emb = self._embed(tokens[None])
            nxt, out = tree.call_block(self.head, self.cache, mask, [shift] * w,
                                       lambda cache: self.head(emb, parent[None], cache))
            fed.append(nxt[0])
            return self._lm(out[0])

        draft, _ = dynamic_tree.grow(logits, step, depth=min(k, budget), width=width, budget=budget,
                                     sampling=sampling, token_ids=self._d2t, vocab=self._v_target)
        self._chained = self.cache[0].offset - base  # every tree row: commit drops them all
        return draft

    def _pick(self, logits: mx.array, sampling: Sampling) -> tuple[mx.array, mx.array | None]:
        """Draft token (a target id) from head logits [V'], and q [V_target] when sampling."""
        if sampling.greedy:
            i, q = mx.argmax(logits), None
        else:
            q = sampling.probs(logits)  # [V'] filtered like the target's p
            i = mx.random.categorical(mx.log(q))
            if self._d2t is not None:  # scatter into the target vocabulary
                q = mx.zeros((self._v_target,), q.dtype).at[self._d2t].add(q)
        t = i if self._d2t is None else self._d2t[i]
        return t.astype(mx.uint32), q

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        """Drop the chained guesses; queue the target's features of the kept tokens."""
        if self._chained:
            rollback(self.cache, self._chained)
            self._chained = 0
        feats = self.head.features(taps, self.taps)  # [n + 1, H]
        tokens = [int(t) for t in tokens]
        if self._y_fed:  # tokens[0] = y already completed the previous feature's pair
            self._feats, self._toks = feats, tokens[1:]
        else:  # nothing was proposed this step: tokens continue the waiting pairs
            self._feats = feats if self._feats is None else mx.concatenate([self._feats, feats])
            self._toks = self._toks + tokens
        self._y_fed = False

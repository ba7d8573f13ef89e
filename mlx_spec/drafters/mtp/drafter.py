"""MTP drafter: the target's own multi-token-prediction module, chained k deep.

State: the module's KV cache holds exactly the committed MTP positions, each
built from a real target hidden state; `_hidden` / `_tokens` queue what is not
fed yet (`len(_tokens) == len(_hidden) - 1`: the newest hidden state waits for
its next token, which is the y of the next proposal). `propose(y, k)` feeds the
queue plus y (committed positions), then chains k-1 steps on the module's own
output; `commit` trims those k-1 drafted positions off again and queues the
target's hidden states for the tokens it kept. Everything in `propose` is lazy.

With `tree_budget` the proposal is an EAGLE-2 dynamic tree (`mlx_spec.dynamic_tree`)
instead of a chain: each depth's frontier is fed through the module at once, each
node seeing the committed positions and its own ancestors, and every tree row is
trimmed at commit like a chain's drafted positions. Modules whose cache is not one
plain KV layer (DSA's indexer keys, multi-block Nemotron-H, DeepSeek-V4) draft chains.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mlx_lm.models.cache import KVCache

from ... import dynamic_tree, tree
from ...cache import rollback
from ...sampling import Sampling
from ...taps import FINAL_NORM, decoder_stack, embedding, layer_count
from ..base import EMPTY, MAX_DRAFT, PREFILL_CHUNK, Draft, PlansTrees, SavesState, chain, check_target, target_lm_head
from .head import MTPConfig, MTPHead

SAME_MTP = ("Use the MTP weights of this very model: its own checkpoint folder, or a head "
            "converted with --target pointing at it.")


class MTPDrafter(SavesState, PlansTrees):
    """Draft with an `MTPHead`; the head's weights are already loaded."""

    STATE = ("cache", "_hidden", "_tokens")  # committed state (SavesState)

    max_draft = MAX_DRAFT

    def __init__(self, head: MTPHead, config: MTPConfig, tree_budget: int | None = None, tree_width: int = 4):
        dynamic_tree.check_settings(tree_budget, tree_width)
        if tree_budget is not None and type(head.make_cache()) is not KVCache:
            raise ValueError(f"{config.family} MTP modules draft chains only (their cache is not one plain "
                             "KV layer, so tree rows cannot be masked per node): leave tree_budget out")
        self.head, self.config = head, config
        self.tree_budget, self.tree_width = tree_budget, tree_width
        self.taps: tuple = (FINAL_NORM,)
        self._bound = False
        self._reset()

    def _reset(self) -> None:
        self.cache = [self.head.make_cache()]
        self._hidden: list[mx.array] = []  # [n_i, H] blocks of target hidden states not fed yet
        self._tokens: list[int] = []
        self._drafted = 0  # positions the last proposal appended past the committed ones

    def bind(self, model, tokenizer) -> None:
        check_target(model, "this MTP head", SAME_MTP, hidden_size=self.head.enorm.weight.shape[0],
                     vocab=self.head.head.weight.shape[0] if "head" in self.head else None)
        stack = decoder_stack(model)
        self._embed = embedding(stack)
        self._lm_head = target_lm_head(model)
        # All ranks' layers: on a pipeline split `stack.layers` is this rank's part only.
        last = layer_count(model) - 1
        self.taps = (FINAL_NORM,) if self.config.hidden_state == "final_norm" else (last,)
        self._bound = True
        self._reset()

    def _run(self, hidden: mx.array, tokens: mx.array):
        """(logits [T, V], the hidden states a chained step feeds back [T, H])."""
        return self._run_on(self.cache[0], hidden, tokens)

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        if not self._bound:
            raise RuntimeError("MTPDrafter.bind(model, tokenizer) must come first")
        h = taps[self.taps[0]]  # [T, H]
        tokens = [int(t) for t in tokens]
        # Hidden states and the tokens following them; a restored state's queue comes first.
        if not self._hidden:
            nxt = tokens[1:]
        else:
            h, nxt = mx.concatenate([*self._hidden, h]), self._tokens + tokens
        # Every h_t but the last pairs with its known next token x_{t+1}.
        for i in range(0, len(nxt), PREFILL_CHUNK):
            j = min(i + PREFILL_CHUNK, len(nxt))
            self._run(h[i:j], mx.array(nxt[i:j], mx.uint32))
            mx.eval([c.state for c in self.cache])
        self._hidden, self._tokens = [h[len(nxt) :]], []

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        if k <= 0:
            return EMPTY
        hidden = mx.concatenate(self._hidden) if len(self._hidden) > 1 else self._hidden[0]
        logits, fed = self._run(hidden, mx.array(self._tokens + [int(y)], mx.uint32))
        logits, fed = logits[-1], fed[-1:]  # [V], [1, H]: the committed prefix is fed
        self._hidden, self._tokens = [], []
        shape = self.step_tree()
        if shape is not None:
            return self._grow(fed, logits, k, *shape, sampling)

        def step(t: mx.array) -> mx.array:  # chain: the module's own output stands in for h
            nonlocal fed
            step_logits, fed = self._run(fed, t)
            return step_logits[-1]

        self._drafted = k - 1
        return chain(logits, k, sampling, step)

    def _grow(self, fed: mx.array, logits: mx.array, k: int, budget: int, width: int, sampling: Sampling) -> Draft:
        """An EAGLE-2 dynamic tree from the root's fed-back hidden state [1, H] and logits."""
        base, feds = self.cache[0].offset, [fed]  # feds[-1]: what the last depth feeds back

        def step(tokens: mx.array, slots, mask: mx.array, shift: int) -> mx.array:
            w = tokens.shape[0]
            parent = mx.broadcast_to(feds[-1], (w, feds[-1].shape[-1])) if slots is None else feds[-1][slots]
            logits, nxt = tree.call_block(self.head, self.cache, mask, [shift] * w,
                                          lambda cache: self._run_on(cache[0], parent, tokens))
            feds.append(nxt)
            return logits

        draft, _ = dynamic_tree.grow(logits, step, depth=min(k, budget), width=width, budget=budget,
                                     sampling=sampling)
        self._drafted = self.cache[0].offset - base  # every tree row: commit drops them all
        return draft

    def _run_on(self, cache, hidden: mx.array, tokens: mx.array):
        logits, o, g = self.head(hidden, tokens, cache, self._embed, self._lm_head)
        return logits, (g if self.config.hidden_state == "final_norm" else o)

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        rows = taps[self.taps[0]]  # [n + 1, H] at the kept inputs [y, d0 .. d(n-1)]
        tokens = [int(t) for t in tokens]
        if self._drafted:
            rollback(self.cache, self._drafted)  # drafted positions used the head's own h
            self._drafted = 0
        if self._hidden:  # no proposal this step: y pairs with the newest queued h
            self._tokens += tokens
        else:  # y was fed by propose
            self._tokens = tokens[1:]
        self._hidden.append(rows)

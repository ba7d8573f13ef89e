"""The target side of the loop: prefill, then one verify forward per drafted block.

`Verifier.step` builds the target forward over `[y, d0 .. d(k-1)]` and the
acceptance as one lazy graph and reads its result once (the step's host
sync). The cache is then rolled back to the kept tokens; a step that fails
half-way leaves the cache as it was before the step (`Checkpoint`).

Logits processors (mlx-lm's `logits_processors`: repetition penalties, logit
bias) are applied to every verified row with that row's own history (the
tokens before it, the drafted ones included), so acceptance sees the
distribution plain decoding would have used: lossless for any processor
that depends only on the history and the logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from . import acceptance
from .cache import Checkpoint
from .drafters.base import Draft
from .request import PREFILL_STEP, Request
from .taps import Taps


@dataclass
class Verdict:
    proposed: list[int]  # the drafts the target examined (a confidence cut may shorten the draft)
    n: int  # how many of them the target kept
    token: int  # the target's own next token (correction or bonus): the new y
    taps: dict | None  # target hidden states at the kept inputs [y, d0 .. d(n-1)]
    logprobs: mx.array  # [n + 1, V] the target's log-probabilities of the emitted tokens (lazy)
    size: int  # rows drafted and verified (>= len(proposed))

    @property
    def emitted(self) -> list[int]:
        return self.proposed[: self.n] + [self.token]


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Verifier:
    """Prefill and verify steps of one generation on `model` with `cache`.

    With `tap_ids` it also returns the target hidden states the drafter reads,
    for exactly the positions the target keeps.
    """

    def __init__(self, model, cache: list, request: Request, tap_ids: tuple = ()):
        self.model, self.cache, self.request = model, cache, request
        self.sampling = request.sampling
        self.processors = request.logits_processors
        self.taps = Taps(model, tap_ids) if tap_ids else None
        self.consumed = 0  # tokens this generation fed into the cache
        self.sync_seconds = 0.0  # time spent waiting for MLX to evaluate the steps
        self._start = Checkpoint(model, cache)  # the cache before this generation
        self._last: tuple[Checkpoint, list[int]] | None = None
        self._history = mx.zeros((0,), mx.uint32)  # tokens fed before the current forward

    def _read_taps(self, keep: int) -> dict | None:
        return None if self.taps is None else {i: h[:keep] for i, h in self.taps.read().items()}

    def _logits(self, inputs: mx.array) -> mx.array:
        """The target's logits [T, V] after each of `inputs` [T], processed as mlx-lm would."""
        logits = self.model(inputs[None], cache=self.cache)[0]
        if not self.processors:
            return logits
        rows = []
        for i in range(logits.shape[0]):
            seen = mx.concatenate([self._history, inputs[: i + 1]])
            row = logits[i : i + 1]
            for process in self.processors:
                row = process(seen, row)
            rows.append(row)
        return mx.concatenate(rows)

    def _fed(self, tokens: Sequence[int]) -> None:
        self.consumed += len(tokens)
        if self.processors:
            self._history = mx.concatenate([self._history, mx.array(list(tokens), mx.uint32)])

    def prefill(self, tokens: Sequence[int]) -> tuple[int, mx.array, dict | None]:
        """Consume the prompt; return the target's first token y, its log-probs and the prompt's taps.

        All but the last token go through in chunks of `prefill_step_size`
        whose logits are never computed; the LM head runs for the last position
        only, as in mlx-lm.
        """
        req, total, taps = self.request, len(tokens), []
        progress: Callable = req.prompt_progress_callback or (lambda *_: None)
        progress(0, total)
        step = req.prefill_step_size or PREFILL_STEP
        for i in range(0, total - 1, step):
            chunk = list(tokens[i : min(i + step, total - 1)])
            self.model(mx.array(chunk, mx.uint32)[None], cache=self.cache)
            taps.append(self._read_taps(len(chunk)))
            req.quantize_cache(self.cache)
            mx.eval([c.state for c in self.cache], taps[-1])
            self._fed(chunk)
            progress(self.consumed, total)
            mx.clear_cache()
        logits = self._logits(mx.array(list(tokens[-1:]), mx.uint32))
        taps.append(self._read_taps(1))
        y = self.sampling.sample(logits[-1]).item()
        self._fed(tokens[-1:])
        progress(total, total)
        if self.taps is None:
            return y, log_softmax(logits[-1]), None
        return y, log_softmax(logits[-1]), {i: mx.concatenate([t[i] for t in taps]) for i in taps[0]}

    def step(self, y: int, draft: Draft) -> Verdict:
        """Verify `draft` after y: one target forward, acceptance, rollback."""
        self.request.quantize_cache(self.cache)  # between steps, never inside a checkpoint
        ckpt = Checkpoint(self.model, self.cache)
        try:
            inputs = mx.concatenate([mx.array([y], mx.uint32), draft.tokens])
            logits = self._logits(inputs)  # [k+1, V]
            n, nxt = acceptance.accept(logits, draft.tokens, draft.q, self.sampling, draft.length)
            length = mx.array(draft.size) if draft.length is None else draft.length
            tail = mx.stack([nxt, n, length]).astype(mx.uint32)
            tic = time.perf_counter()
            *proposed, nxt, n, length = mx.concatenate([draft.tokens, tail]).tolist()  # the one sync
            self.sync_seconds += time.perf_counter() - tic
            # The verify forward's own rows, read before a replay (recurrent targets) records others.
            taps = self._read_taps(n + 1)
        except BaseException:
            ckpt.keep([])  # leave the cache as it was before the step
            raise
        proposed = proposed[:length]  # a confidence cut verifies only this prefix
        kept = [y] + proposed[:n]
        ckpt.keep(kept, 1 + draft.size)
        self._last = (ckpt, kept)
        self._fed(kept)
        return Verdict(proposed, n, nxt, taps, log_softmax(logits[: n + 1]), draft.size)

    def restore(self) -> None:
        """Leave the cache exactly as it was before this generation."""
        self._start.keep([])
        self.consumed, self._last = 0, None

    def finish(self, want: int, last: int) -> dict | None:
        """Leave the cache holding the first `want` tokens this generation saw (prompt and
        emitted), as mlx-lm's does: the last emitted token `last` is fed if it is not yet
        (then its taps are returned)."""
        taps = None
        if self.consumed > want and self._last is not None:
            ckpt, kept = self._last
            ckpt.keep(kept[: len(kept) - (self.consumed - want)])
        elif self.consumed == want - 1:
            self.model(mx.array([[last]], mx.uint32), cache=self.cache)
            taps = self._read_taps(1)
        mx.eval([c.state for c in self.cache], taps)
        self.consumed, self._last = want, None
        return taps

    def close(self) -> None:
        if self.taps is not None:
            self.taps.remove()
            self.taps = None

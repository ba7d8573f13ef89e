"""The decode loop: prefill, then propose -> verify -> accept -> roll back -> commit.

Each step builds one lazy MLX graph (the drafter's proposal, one target forward
over `[y, d0 .. d(k-1)]`, the acceptance) and evaluates it once; reading its
result is the step's only host sync. `drafter=None` runs the same loop with
k = 0, which is plain decoding: the baseline goes through the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptance import accept
from .cache import MAX_DRAFT, Checkpoint, is_recurrent, prepare_cache
from .drafters.base import EMPTY, Draft, Drafter
from .sampling import Sampling
from .stats import SpecStats
from .taps import Taps

DEFAULT_NUM_DRAFT_TOKENS = "auto"
PREFILL_STEP = 2048


@dataclass
class Response:
    text: str  # the new text segment
    token: int
    from_draft: bool
    finish_reason: str | None  # None, "stop" (EOS) or "length" (max_tokens)
    prompt_tokens: int
    generation_tokens: int
    stats: SpecStats | None = None  # on the last response only


@dataclass
class Verdict:
    proposed: list[int]  # the draft d[0..k)
    n: int  # how many of it the target kept
    token: int  # the target's own next token (correction or bonus): the new y
    taps: dict | None  # target hidden states at the kept inputs [y, d0 .. d(n-1)]

    @property
    def emitted(self) -> list[int]:
        return self.proposed[: self.n] + [self.token]


class Verifier:
    """The target side of a step: prefill, then one verify forward per block.

    With `tap_ids` it also returns the target hidden states the drafter reads,
    for exactly the positions the target keeps.
    """

    def __init__(self, model, cache: list, sampling: Sampling, tap_ids: tuple = ()):
        self.model, self.cache, self.sampling = model, cache, sampling
        self.taps = Taps(model, tap_ids) if tap_ids else None
        self.consumed = 0  # tokens the target's cache holds from this call
        self.sync_seconds = 0.0  # time spent waiting for MLX to evaluate the steps
        self._last: tuple[Checkpoint, list[int]] | None = None

    def _read_taps(self, keep: int) -> dict | None:
        return None if self.taps is None else {i: h[:keep] for i, h in self.taps.read().items()}

    def prefill(self, tokens: Sequence[int]) -> tuple[int, dict | None]:
        """Consume the prompt; return the target's first token y and the prompt's taps."""
        chunks = [tokens[i : i + PREFILL_STEP] for i in range(0, len(tokens), PREFILL_STEP)]
        taps = []
        for chunk in chunks:
            logits = self.model(mx.array(chunk)[None], cache=self.cache)
            taps.append(self._read_taps(len(chunk)))
            if chunk is not chunks[-1]:
                mx.eval([c.state for c in self.cache], taps[-1])
        y = self.sampling.sample(logits[0, -1]).item()
        self.consumed = len(tokens)
        if self.taps is None:
            return y, None
        return y, {i: mx.concatenate([t[i] for t in taps]) for i in taps[0]}

    def step(self, y: int, draft: Draft) -> Verdict:
        """Verify `draft` after y: one target forward, acceptance, rollback."""
        ckpt = Checkpoint(self.model, self.cache)
        fed = 1 + draft.size
        try:
            inputs = mx.concatenate([mx.array([y], mx.uint32), draft.tokens])
            logits = self.model(inputs[None], cache=self.cache)[0]  # [k+1, V]
            n, nxt = accept(logits, draft.tokens, draft.q, self.sampling, draft.length)
            length = mx.array(draft.size) if draft.length is None else draft.length
            tail = mx.stack([nxt, n, length]).astype(mx.uint32)
            tic = time.perf_counter()
            *proposed, nxt, n, length = mx.concatenate([draft.tokens, tail]).tolist()  # the one sync
            self.sync_seconds += time.perf_counter() - tic
        except BaseException:
            ckpt.keep([], fed)  # leave the cache as it was before the step
            raise
        proposed = proposed[:length]  # a confidence cut verifies only this prefix
        kept = [y] + proposed[:n]
        ckpt.keep(kept, fed)
        self._last, self.consumed = (ckpt, kept), self.consumed + len(kept)
        return Verdict(proposed, n, nxt, self._read_taps(n + 1))

    def truncate(self, drop: int) -> None:
        """Forget the last `drop` (<= the last step's) consumed tokens."""
        if drop > 0 and self._last is not None:
            ckpt, kept = self._last
            ckpt.keep(kept[: len(kept) - drop], len(kept))
            self.consumed -= drop
            self._last = None

    def close(self) -> None:
        if self.taps is not None:
            self.taps.remove()


def stream_generate(
    model,
    tokenizer,
    prompt: str | Sequence[int],
    drafter: Drafter | None = None,
    *,
    max_tokens: int = 256,
    num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    prompt_cache: list | None = None,
    trace: bool = False,
) -> Iterator[Response]:
    """Yield the target's own continuation of `prompt`, sped up by `drafter`.

    Greedy output is token for token the target's; sampled output has exactly
    the target's distribution. Bad input raises ValueError here, before any
    model work. `num_draft_tokens` is 1..16 or "auto" (chosen per step from the
    measured verify cost and the acceptance so far; see `mlx_spec.adaptive`).
    `prompt_cache` (from `mlx_spec.make_cache`) holds exactly the committed
    tokens when the generator ends or is closed early.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = _encode(tokenizer, prompt)
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    _check_num_draft(num_draft_tokens)
    sampling = Sampling(temp, top_p, top_k, min_p)
    cache = prepare_cache(model, prompt_cache)
    if drafter is not None:
        drafter.bind(model, tokenizer)
    lengths = _draft_lengths(model, drafter, num_draft_tokens, is_recurrent(cache))
    return _decode(model, tokenizer, ids, drafter, lengths, sampling, cache, max_tokens, seed, trace)


def _decode(model, tokenizer, ids, drafter, lengths, sampling, cache, max_tokens, seed, trace):
    if seed is not None:
        mx.random.seed(seed)
    stats = SpecStats(prompt_tokens=len(ids))
    detok, eos = tokenizer.detokenizer, tokenizer.eos_token_ids
    detok.reset()
    verifier = Verifier(model, cache, sampling, drafter.taps if drafter is not None else ())
    tic = time.perf_counter()
    y, taps = verifier.prefill(ids)
    if drafter is not None:
        drafter.prefill(ids, taps)
    stats.prompt_tps = len(ids) / (time.perf_counter() - tic)
    tic = time.perf_counter()
    block, emitted = [(y, False)], 0
    try:
        while True:
            for token, from_draft in block:
                emitted += 1
                finish = "stop" if token in eos else None
                if finish is None:
                    detok.add_token(token)
                    finish = "length" if emitted == max_tokens else None
                if finish is None:
                    yield Response(detok.last_segment, token, from_draft, None, len(ids), emitted)
                    continue
                detok.finalize()
                _finish_stats(stats, emitted, tic)
                yield Response(detok.last_segment, token, from_draft, finish, len(ids), emitted, stats)
                return
            k, gain = lengths.choose()
            k = min(k, max_tokens - emitted - 1)  # the block's last token must fit too
            t0 = time.perf_counter()
            draft = drafter.propose(y, k, sampling) if k > 0 else EMPTY
            v = verifier.step(y, draft)
            lengths.observe(len(v.proposed), v.n, time.perf_counter() - t0)
            stats.observe(v.proposed, v.n, trace, k, gain)
            if drafter is not None:
                drafter.commit([y] + v.proposed[: v.n], v.taps)
            stats.step_seconds += time.perf_counter() - t0
            stats.sync_seconds = verifier.sync_seconds
            block, y = [(t, i < v.n) for i, t in enumerate(v.emitted)], v.token
    finally:
        verifier.close()
        # The cache keeps what the caller saw: the prompt and all emitted tokens but the last.
        if emitted:
            verifier.truncate(verifier.consumed - (len(ids) + emitted - 1))


def _finish_stats(stats: SpecStats, emitted: int, tic: float) -> None:
    stats.generation_tokens = emitted
    stats.generation_tps = emitted / max(time.perf_counter() - tic, 1e-9)
    stats.peak_memory = mx.get_peak_memory() / 1e9


def generate(model, tokenizer, prompt, drafter=None, *, verbose: bool = False, **kwargs) -> str:
    """Like `stream_generate`, but return the text; `verbose` prints it as it streams."""
    text, last = "", None
    for last in stream_generate(model, tokenizer, prompt, drafter, **kwargs):
        text += last.text
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        print("\n" + "=" * 10 + "\n" + last.stats.summary())
    return text


def _encode(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    return ids


def _check_num_draft(num_draft_tokens) -> None:
    if num_draft_tokens == "auto":
        return
    if not (isinstance(num_draft_tokens, int) and 1 <= num_draft_tokens <= MAX_DRAFT):
        raise ValueError(
            f'num_draft_tokens must be "auto" or an integer in 1..{MAX_DRAFT}, '
            f"got {num_draft_tokens!r}"
        )


class FixedK:
    """The same draft length every step (0: plain decoding)."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> tuple[int, None]:
        return self.k, None

    def observe(self, proposed: int, accepted: int, seconds: float) -> None:
        pass


def _draft_lengths(model, drafter, num_draft_tokens, recurrent: bool):
    if drafter is None:
        return FixedK(0)
    k_max = min(drafter.max_draft, MAX_DRAFT)
    if num_draft_tokens == "auto":
        from .adaptive import policy_for

        return policy_for(model, drafter, k_max, replays=recurrent)
    return FixedK(min(num_draft_tokens, k_max))

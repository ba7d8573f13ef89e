"""The decode loop: prefill, then propose -> verify -> accept -> roll back -> commit.

Each step builds one lazy MLX graph (the drafter's proposal, one target forward
over `[y, d0 .. d(k-1)]`, the acceptance) and evaluates it once; reading its
result is the step's only host sync (`mlx_spec.verify`). `drafter=None` runs
the same loop with k = 0, which is plain decoding: the baseline goes through
the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import prompt_cache
from .cache import MAX_DRAFT, is_recurrent, prepare_cache
from .drafters.base import EMPTY, Drafter
from .identity import Claims
from .request import Request, make_request, refuse_unsupported, resolve_drafter
from .stats import SpecStats
from .verify import Verifier

DEFAULT_NUM_DRAFT_TOKENS = "auto"
CLAIMS = Claims()  # drafters and prompt caches in use by a live generator


@dataclass
class Response:
    """One generated token, with mlx-lm's `GenerationResponse` fields (and `stats` on the last)."""

    text: str  # the new text segment
    token: int
    logprobs: mx.array  # [V] the target's log-probabilities at this position (never the drafter's)
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # None, "stop" (EOS) or "length" (max_tokens)
    # The run's statistics so far: one object, updated in place as generation goes on and
    # final on the last response; a caller that stops early (a stop string, a cancelled
    # request) reads the figures of exactly the steps that ran.
    stats: SpecStats | None = None


def stream_generate(model, tokenizer, prompt: str | Sequence[int] | mx.array,
                    drafter: Drafter | None = None, *, draft_model=None, prompt_cache: list | None = None,
                    **options) -> Iterator[Response]:
    """Yield the target's own continuation of `prompt`, sped up by `drafter`.

    Greedy output is token for token the target's; sampled output has exactly
    the target's distribution (see "What lossless means here" in the README).
    `options`: max_tokens (-1: no limit), num_draft_tokens (1..16 or "auto",
    chosen per step from the measured verify cost and the acceptance so far),
    temp, top_p, top_k, min_p, seed, logits_processors,
    prompt_progress_callback, prefill_step_size, max_kv_size, kv_bits,
    kv_group_size, quantized_kv_start (as in mlx-lm), trace. Bad input raises
    here, before any model work. `prompt_cache` (from `mlx_spec.make_cache` or
    mlx-lm) holds the prompt and every token the caller saw when the generator
    ends or is closed early, as mlx-lm's does.
    """
    refuse_unsupported({k: v for k, v in options.items() if k not in _OPTIONS})
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    request = make_request(model, tokenizer, prompt, **options)
    drafter = resolve_drafter(drafter, draft_model, CLAIMS)
    claimed = [(obj, what) for obj, what in ((drafter, "drafter"), (prompt_cache, "prompt cache"))
               if obj is not None]
    for obj, what in claimed:
        CLAIMS.check(obj, what)
    if prompt_cache is None:
        cache = prepare_cache(model, make_prompt_cache(model, request.max_kv_size))
    else:
        cache = prepare_cache(model, prompt_cache)
    if drafter is not None:
        drafter.bind(model, tokenizer)  # checks the pair, resets the drafter; nobody else uses it
    gen = _generate(model, tokenizer, request, drafter, cache, prompt_cache is not None)
    for obj, _ in claimed:
        CLAIMS.take(obj, gen)
    return gen


_OPTIONS = {"max_tokens", "num_draft_tokens", "temp", "top_p", "top_k", "min_p", "seed",
            "logits_processors", "prompt_progress_callback", "prefill_step_size", "max_kv_size",
            "kv_bits", "kv_group_size", "quantized_kv_start", "trace"}


def _generate(model, tokenizer, request, drafter, cache, keep_cache):
    with wired_limit(model, [generation_stream]):
        yield from _decode(model, tokenizer, request, drafter, cache, keep_cache)


def _decode(model, tokenizer, req: Request, drafter, cache, keep_cache: bool):
    if req.seed is not None:
        mx.random.seed(req.seed)
    stats = SpecStats(prompt_tokens=len(req.prompt))
    detok, eos = tokenizer.detokenizer, tokenizer.eos_token_ids
    detok.reset()
    hist = prompt_cache.history_of(cache) if keep_cache else None  # what the cache holds
    verifier = Verifier(model, cache, req, drafter.taps if drafter is not None else ())
    out: list[int] = []  # every token yielded
    emitted = seen = 0
    later = None  # the last step's kept (tokens, taps): told to the drafter when the caller goes on
    try:
        tic = time.perf_counter()
        with mx.stream(generation_stream):
            y, logprobs, taps = verifier.prefill(req.prompt)
            if drafter is not None:
                prompt_cache.prefill_drafter(drafter, hist, req.prompt, taps)
        stats.prompt_tps = len(req.prompt) / (time.perf_counter() - tic)
        lengths = _draft_lengths(model, drafter, req, is_recurrent(cache))
        block, tic = [(y, False, logprobs)], time.perf_counter()
        while True:
            for seen, (token, from_draft, lp) in enumerate(block, 1):
                out.append(token)
                emitted = len(out)
                finish = "stop" if token in eos else "length" if emitted == req.max_tokens else None
                if token not in eos:
                    detok.add_token(token)
                if finish is not None:
                    detok.finalize()
                _finish_stats(stats, emitted, tic)
                yield Response(detok.last_segment, token, lp, from_draft, len(req.prompt),
                               stats.prompt_tps, emitted, stats.generation_tps, stats.peak_memory,
                               finish, stats)
                if finish is not None:
                    return
            k, gain = lengths.choose()
            if req.max_tokens is not None:
                k = min(k, req.max_tokens - emitted - 1)  # the block's last token must fit too
            t0 = time.perf_counter()
            with mx.stream(generation_stream):
                if later is not None:
                    drafter.commit(*later)
                    later = None
                draft = drafter.propose(y, k, req.sampling) if k > 0 else EMPTY
                v = verifier.step(y, draft)
            if drafter is not None:
                later = ([y] + v.proposed[: v.n], v.taps)
            lengths.observe(v.size, v.n, time.perf_counter() - t0)
            stats.observe(v.proposed, v.n, req.trace, k, gain, v.size)
            stats.step_seconds += time.perf_counter() - t0
            stats.sync_seconds = verifier.sync_seconds
            block, y = list(zip(v.emitted, [True] * v.n + [False], v.logprobs)), v.token
    finally:
        try:
            if emitted == 0:  # failed before the first token: the cache as before the call
                verifier.restore()
            elif keep_cache:  # the prompt and every token the caller saw, as in mlx-lm
                with mx.stream(generation_stream):
                    taps = verifier.finish(len(req.prompt) + emitted, out[-1])
                    held = None if hist is None else hist.tokens + req.prompt + tuple(out)
                    prompt_cache.settle(cache, held, drafter, later, seen, out[-1], taps)
        finally:
            verifier.close()


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


class FixedK:
    """The same draft length every step (0: plain decoding)."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> tuple[int, None]:
        return self.k, None

    def observe(self, proposed: int, accepted: int, seconds: float) -> None:
        pass


def _draft_lengths(model, drafter, req: Request, recurrent: bool):
    if drafter is None:
        return FixedK(0)
    k_max = min(drafter.max_draft, MAX_DRAFT)
    if req.num_draft_tokens == "auto":
        from .adaptive import policy_for

        return policy_for(model, drafter, k_max, replays=recurrent, sampling=req.sampling,
                          seeded=req.seed is not None)
    return FixedK(min(req.num_draft_tokens, k_max))

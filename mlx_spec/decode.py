"""The decode loop: prefill, then propose -> verify -> accept -> roll back -> commit.

Each step builds one lazy MLX graph (the drafter's proposal, one target forward
over `[y, d0 .. d(k-1)]`, the acceptance) and evaluates it once; reading its
result is the step's only host sync (`mlx_spec.verify`). `drafter=None` runs
the same loop with k = 0, which is plain decoding: the baseline goes through
the same code.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .batch import BatchDecoder
from .cache import prepare_cache
from .drafters.base import Drafter
from .identity import Claims
from .request import make_request, refuse_unsupported, resolve_drafter
from .rows import Response, Row

DEFAULT_NUM_DRAFT_TOKENS = "auto"
CLAIMS = Claims()  # drafters and prompt caches in use by a live generator


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
    gen = _generate(model, tokenizer, request, drafter, cache, prompt_cache)
    for obj, _ in claimed:
        CLAIMS.take(obj, gen)
    return gen


_OPTIONS = {"max_tokens", "num_draft_tokens", "temp", "top_p", "top_k", "min_p", "seed",
            "logits_processors", "prompt_progress_callback", "prefill_step_size", "max_kv_size",
            "kv_bits", "kv_group_size", "quantized_kv_start", "trace"}


def _generate(model, tokenizer, request, drafter, cache, user_cache):
    """The loop with one row: each step's block is yielded token by token."""
    decoder = BatchDecoder(model, tokenizer, max_batch=1)
    uid = decoder.add_row(lambda uid: Row(uid, model, tokenizer, request, drafter, cache, user_cache))
    seen = None
    try:
        with wired_limit(model, [generation_stream]):
            while decoder.busy:
                for _, block in decoder.step():
                    for seen, response in enumerate(block, 1):
                        yield response
    finally:
        decoder.release(uid, seen)


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

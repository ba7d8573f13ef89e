"""The decode loop: prefill, then propose -> verify -> accept -> roll back -> commit.

Each step builds one lazy MLX graph (the drafter's proposal, one target forward
over `[y, d0 .. d(k-1)]`, the acceptance) and evaluates it once; reading its
result is the step's only host sync (`mlx_spec.verify`). `drafter=None` runs
the same loop with k = 0, which is plain decoding: the baseline goes through
the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream, wired_limit

from .batch import BatchDecoder
from .drafters.base import Drafter
from .request import whole
from .rows import Response
from .stats import SpecStats

DEFAULT_NUM_DRAFT_TOKENS = "auto"


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

    This is `BatchDecoder` with one row: the same loop as batched decoding.
    """
    decoder = BatchDecoder(model, tokenizer, max_batch=1)
    uid = decoder.add(prompt, drafter, draft_model=draft_model, prompt_cache=prompt_cache,
                      **options)
    gen = _generate(decoder, uid)
    decoder.hand_over(uid, gen)  # the drafter and prompt cache are in use while `gen` lives
    return gen


def _generate(decoder: BatchDecoder, uid: int):
    """Each step's block is yielded token by token."""
    # (The prompt's clock starts when its reading does, `Row.start_reading`: after the caller's
    # first read, as mlx-lm's generator's, not when the generator was made.)
    seen = None
    try:
        with wired_limit(decoder.model, [generation_stream]):
            while decoder.busy:
                for _, block in decoder.step():
                    for seen, response in enumerate(block, 1):
                        yield response
    finally:
        decoder.release(uid, seen)


@dataclass
class BatchResult:
    texts: list[str]  # one per prompt, in order
    tokens: list[list[int]]
    stats: list[SpecStats]


def batch_generate(model, tokenizer, prompts: Sequence, drafter=None, *, max_batch: int = 8,
                   **options) -> BatchResult:
    """Generate for several prompts at once: rows verified in one forward, each keeping its
    own accepted prefix (`BatchDecoder`). `drafter` is None, a function (or drafter class) returning a new
    drafter for each prompt, or a drafter whose `fork()` gives each prompt its own state.
    `options` as `stream_generate`'s, for every prompt; `seed` and `max_tokens` may also be
    lists, one value per prompt (one seed for all gives identical prompts identical samples)."""
    if drafter is None or not isinstance(drafter, type) and hasattr(drafter, "propose"):  # (a class: a maker)
        make = (lambda: None) if drafter is None else drafter.fork
    elif callable(drafter):
        make = drafter
    else:
        raise TypeError(f"drafter must be None, a drafter or a function making one, got "
                        f"{type(drafter).__name__}")
    if isinstance(prompts, mx.array) and prompts.ndim == 2:  # one prompt a row, as a NumPy array's
        prompts = prompts.tolist()
    if isinstance(prompts, (str, mx.array)) or (len(prompts) and all(whole(p) for p in prompts)):
        raise TypeError("prompts must be a list of prompts (each a string or a list of token ids), got "
                        f"{'one string' if isinstance(prompts, str) else 'one prompt'}: pass [prompt], or use "
                        "generate / stream_generate for a single prompt")
    each = {}  # options given one value per prompt
    for name, value in options.items():
        if isinstance(value, (list, tuple)) and name not in ("seed", "max_tokens", "logits_processors"):
            raise ValueError(f"{name} takes one value for every prompt, got a list (only seed and "
                             "max_tokens take one value per prompt)")
    for name in ("seed", "max_tokens"):
        if isinstance(options.get(name), (list, tuple)):
            each[name] = options.pop(name)
            if len(each[name]) != len(prompts):
                raise ValueError(f"{name} is a list of {len(each[name])} values for {len(prompts)} prompts; "
                                 "give one per prompt, or one value for all")
    decoder = BatchDecoder(model, tokenizer, max_batch=max_batch)
    uids, texts, tokens, stats = [], {}, {}, {}
    try:
        for i, p in enumerate(prompts):
            try:
                uids.append(decoder.add(p, make(), **options, **{k: v[i] for k, v in each.items()}))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            texts[uids[-1]], tokens[uids[-1]] = "", []
        with wired_limit(model, [generation_stream]):
            while decoder.busy:
                for uid, block in decoder.step():
                    for r in block:
                        texts[uid] += r.text
                        tokens[uid].append(r.token)
                        if r.finish_reason is not None:
                            stats[uid] = r.stats
                            decoder.release(uid)
    finally:
        for uid in uids:
            decoder.release(uid)
    return BatchResult([texts[u] for u in uids], [tokens[u] for u in uids], [stats[u] for u in uids])


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

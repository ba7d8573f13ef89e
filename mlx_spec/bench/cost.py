"""The verify cost curve: how much a target forward over n tokens costs relative to n = 1.

Speculative decoding pays one forward over `[y, d0 .. d(k-1)]` (n = k + 1
tokens) per step. If that forward cost as much as a one-token step, every
accepted token would be free; on real hardware it grows with n (compute-bound
CPUs more than bandwidth-bound GPUs), and the best k is where the extra
accepted tokens stop paying for the wider forward. `verify_cost_curve` measures
T(n)/T(1) with a realistic cache behind the block; the benchmark reports it
and the adaptive-k policy can reuse it for its calibration.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence


def verify_times(
    model,
    n_max: int = 16,
    context: int = 256,
    repeats: int = 3,
    tokens: Sequence[int] | None = None,
) -> list[float]:
    """Median seconds of one target forward over n = 1..n_max tokens.

    Args:
        model: an mlx-lm model (called as `model(ids[None], cache=cache)`).
        n_max: the widest block measured.
        context: tokens already in the cache when each block is run.
        repeats: timed passes over all n (after one untimed warm-up pass).
        tokens: token ids to fill the context and blocks with (repeated as
            needed); defaults to a fixed pseudo-random sequence.

    Returns:
        `times[n - 1]` = median seconds for a block of n tokens.
    """
    import mlx.core as mx

    from ..cache import make_cache, rollback

    if n_max < 1 or context < 1 or repeats < 1:
        raise ValueError("n_max, context and repeats must all be >= 1")
    ids = _fill(tokens, context + n_max, _vocab(model))
    cache = make_cache(model)
    model(mx.array(ids[:context])[None], cache=cache)
    mx.eval([c.state for c in cache])
    block = mx.array(ids[context : context + n_max])
    samples: list[list[float]] = [[] for _ in range(n_max)]
    for rep in range(repeats + 1):
        for n in range(1, n_max + 1):
            tic = time.perf_counter()
            # The logits of every position are needed by verify, so evaluate all.
            mx.eval(model(block[None, :n], cache=cache))
            elapsed = time.perf_counter() - tic
            rollback(cache, n)  # every block sees the same `context` tokens
            if rep:  # pass 0 warms up kernels and allocations
                samples[n - 1].append(elapsed)
    return [statistics.median(s) for s in samples]


def verify_cost_curve(model, n_max: int = 16, context: int = 256, repeats: int = 3,
                      tokens: Sequence[int] | None = None) -> list[float]:
    """T(n)/T(1) for n = 1..n_max (`curve[0] == 1.0`); see `verify_times` for the arguments."""
    times = verify_times(model, n_max, context, repeats, tokens)
    return relative(times)


def relative(times: Sequence[float]) -> list[float]:
    """Times divided by the first one."""
    return [t / times[0] for t in times]


def _vocab(model) -> int:
    from ..drafters.base import vocab_size

    return vocab_size(model)


def _fill(tokens: Sequence[int] | None, length: int, vocab: int) -> list[int]:
    if tokens:
        base = [int(t) for t in tokens]
    else:
        # A fixed LCG: reproducible, no global RNG state touched.
        x, base = 12345, []
        for _ in range(length):
            x = (1103515245 * x + 12345) % 2**31
            base.append(x % vocab)
    return (base * (length // len(base) + 1))[:length]

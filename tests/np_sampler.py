"""mlx-lm's sampling distribution, re-implemented in float64 NumPy as an independent reference.

What mlx-lm 0.32.2 does (`mlx_lm/sample_utils.py`, `make_sampler` with temp > 0): the
sampler receives log-probabilities `logits - logsumexp(logits)` and applies, in this
order and each only when enabled,

1. top-p (0 < top_p < 1): sort ascending; a token is dropped when the mass of the
   tokens sorted above it already reaches `top_p` of the total; every token whose
   log-prob is >= the lowest kept one survives (so ties at the edge all stay);
2. min-p (min_p != 0): drop tokens with log-prob < max + log(min_p), except the
   `min_tokens_to_keep` largest (ties at that edge go to the higher token id);
3. top-k (top_k > 0, must be < V): keep the k largest; ties at the edge are broken
   towards the lower token id (mlx's argpartition on the CPU, checked in
   tests/test_np_sampler.py);

then draws from softmax(filtered log-probs / temp). The end-to-end losslessness
tests take their reference distribution from here, not from `mlx_spec.Sampling`,
so a bug in `Sampling.probs` cannot cancel out of them.
"""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _top_p(lp: np.ndarray, top_p: float) -> np.ndarray:
    out = lp.copy()
    for row in out.reshape(-1, lp.shape[-1]):
        desc = np.sort(row)[::-1]
        mass = np.exp(desc)
        before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])  # mass ranked strictly above
        kept = before < top_p * mass.sum()  # a prefix of the descending order
        lowest = desc[kept][-1]
        row[row < lowest] = -np.inf
    return out


def _min_p(lp: np.ndarray, min_p: float, min_tokens_to_keep: int) -> np.ndarray:
    out = lp.copy()
    for row in out.reshape(-1, lp.shape[-1]):
        drop = row < row.max() + np.log(min_p)
        if min_tokens_to_keep > 1:
            drop[_largest(row, min_tokens_to_keep, lower_ids_first=False)] = False
        row[drop] = -np.inf
    return out


def _largest(row: np.ndarray, k: int, lower_ids_first: bool = True) -> np.ndarray:
    """Ids of the k largest entries; among equal values the lower (or higher) ids rank first.

    (mlx's CPU argpartition orders equal values by id, as a stable sort would: top-k
    takes the first k of the order by -logprob, min-p's keep-list the last m of the
    order by logprob.)
    """
    ids = np.arange(row.size)
    return np.lexsort((ids if lower_ids_first else -ids, -row))[:k]


def _top_k(lp: np.ndarray, top_k: int) -> np.ndarray:
    out = np.full_like(lp, -np.inf)
    flat_in, flat_out = lp.reshape(-1, lp.shape[-1]), out.reshape(-1, lp.shape[-1])
    for src, dst in zip(flat_in, flat_out):
        keep = _largest(src, top_k)
        dst[keep] = src[keep]
    return out


def filtered_logprobs(logits, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                      min_tokens_to_keep: int = 1) -> np.ndarray:
    """mlx-lm's filter chain on log-probabilities (before the temperature)."""
    lp = log_softmax(logits)
    V = lp.shape[-1]
    if 0 < top_p < 1.0:
        lp = _top_p(lp, top_p)
    if min_p != 0.0:
        lp = _min_p(lp, min_p, min_tokens_to_keep)
    if 0 < top_k < V:
        lp = _top_k(lp, top_k)
    return lp


def probs(logits, temp: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
          min_tokens_to_keep: int = 1) -> np.ndarray:
    """The distribution mlx-lm's `make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)`
    draws from, for each row of `logits` [..., V] (float64)."""
    if not temp > 0:
        raise ValueError("the sampled distribution needs temp > 0")
    z = filtered_logprobs(logits, top_p, top_k, min_p, min_tokens_to_keep) / temp
    z = z - np.max(z, axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def support_is_stable(logits, rel: float = 1e-4, **kw) -> bool:
    """Whether the kept tokens stay the same when top_p / min_p move by a relative `rel`.

    float32 (mlx) and float64 (here) may decide a token that sits right at a
    threshold differently; tests that compare the two draw rows where none does.
    """
    base = np.isfinite(filtered_logprobs(logits, **kw))
    for f in (1 - rel, 1 + rel):
        moved = dict(kw)
        if 0 < kw.get("top_p", 1.0) < 1.0:
            moved["top_p"] = min(kw["top_p"] * f, 1.0 - 1e-12)
        if kw.get("min_p", 0.0):
            moved["min_p"] = min(kw["min_p"] * f, 1.0)
        if not np.array_equal(np.isfinite(filtered_logprobs(logits, **moved)), base):
            return False
    return True

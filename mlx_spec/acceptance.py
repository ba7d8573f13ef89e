"""Acceptance: which drafted tokens the target keeps, and the token it adds.

Letters follow Leviathan et al. 2023 / Chen et al. 2023: `p` is the target's
distribution, `q` the drafter's. For a draft `d[0..k)` the verify forward gives
target logits at k+1 positions; position i scores d[i], position k the bonus.

* Greedy: n = number of leading i with argmax(p_i) == d_i; the next token is
  argmax(p_n).
* Sampling: accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the
  first rejection draw from normalize(max(p_i - q_i, 0)); if all k are
  accepted, draw the bonus from p_k. `q is None` is a point mass on d_i, so the
  residual is p_i with d_i removed. The output is distributed exactly as p.

A drafter may also return a lazy `length` (e.g. DSpark's confidence cut): only
the first `length` drafts are verified, n <= length, and when all of those are
accepted the next token comes from p_length (the later drafts are ignored; causal
attention makes row `length` independent of them).

Everything is vectorised MLX ops with no host sync: the result stays part of the
step's single lazy graph.
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import Sampling, greedy_tokens


def greedy_accept(
    logits: mx.array, draft: mx.array, length: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """logits [k+1, V], draft [k] -> (n, next token), both scalars."""
    target = greedy_tokens(logits)  # [k+1]
    k = draft.shape[0]
    n = mx.cumprod(target[:k] == draft).sum() if k else mx.array(0)
    if length is not None:
        n = mx.minimum(n, length)
    return n, target[n]


def rejection_accept(
    p: mx.array, q: mx.array | None, draft: mx.array, length: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """p [k+1, V] target probs, q [k, V] draft probs or None, draft [k] -> (n, token)."""
    k = draft.shape[0]
    if k == 0:
        return mx.array(0), mx.random.categorical(mx.log(p[0]))
    rows = mx.arange(k)
    p_d = p[rows, draft]  # [k] target probability of each drafted token
    if q is None:
        q_d = mx.ones_like(p_d)
        residual = p[:k] * (mx.arange(p.shape[-1])[None] != draft[:, None])
    else:
        q_d = q[rows, draft]
        residual = mx.maximum(p[:k] - q, 0)
    # u * q < p  <=>  u < p / q: accept with probability min(1, p/q).
    accepted = mx.random.uniform(shape=(k,)) * q_d < p_d
    if length is not None:
        accepted = accepted & (rows < length)
    n = mx.cumprod(accepted).sum()
    row = mx.concatenate([residual, p[k:]])[n]  # residual at the rejection, or p_k
    if length is not None:  # all verified drafts accepted: the bonus comes from p_length
        row = mx.where(n >= length, p[n], row)
    # A residual with no mass only arises from rounding when p == q; fall back to p_n.
    row = mx.where(row.sum() > 0, row, p[n])
    return n, mx.random.categorical(mx.log(row))


def accept(
    logits: mx.array, draft: mx.array, q: mx.array | None, sampling: Sampling,
    length: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Dispatch on the sampling mode. logits [k+1, V]; returns lazy (n, next token)."""
    if sampling.greedy:
        return greedy_accept(logits, draft, length)
    return rejection_accept(sampling.probs(logits), q, draft, length)

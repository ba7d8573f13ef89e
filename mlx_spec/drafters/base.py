"""The one protocol every drafter speaks, and what a proposal looks like.

The decode loop never branches on drafter kind. Per step it calls
`propose(y, k, sampling)` and, once the target has verified the block,
`commit(tokens, taps)` with exactly the tokens the target consumed and kept
(`[y, d0 .. d(n-1)]`). A drafter never hears about rejected tokens: it trims its
own state back to what was committed.

`taps` is how heads (MTP, EAGLE, DFlash, DSpark) receive the target's hidden
states: a drafter lists the tap ids it needs in `.taps` (see `mlx_spec.taps`:
k = the output of decoder layer k, `EMBED`, `FINAL_NORM`) and gets
`{id: [T, H]}` for exactly the committed positions. N-gram and draft-model
drafters ask for nothing and get None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import mlx.core as mx

from ..cache import MAX_DRAFT  # noqa: F401 (re-exported: the drafters cap max_draft at it)
from ..sampling import Sampling
from ..taps import decoder_stack

PREFILL_CHUNK = 512  # prompt positions a drafter consumes per forward in prefill (bounds its peak memory)


@dataclass(frozen=True)
class Draft:
    """Proposed tokens `d[0..k)` and, when the drafter has them, their `q`."""

    tokens: mx.array  # [k] token ids; may still be lazy
    q: mx.array | None = None  # [k, V] draft probabilities; None = point mass
    length: mx.array | None = None  # lazy count of leading tokens to verify (None: all k)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


EMPTY = Draft(mx.zeros((0,), mx.uint32))


class Drafter(Protocol):
    taps: tuple  # tap ids this drafter reads (mlx_spec.taps); () for none
    max_draft: int  # the most tokens one propose() can return (<= MAX_DRAFT)

    def bind(self, model, tokenizer) -> None:
        """Check compatibility with the target (raise ValueError) and reset state."""

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed the prompt `tokens`."""

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        """Up to k tokens to follow the committed context and `y` (not yet consumed)."""

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed and kept `tokens` (`[y, accepted drafts...]`)."""


def pick(logits: mx.array, sampling: Sampling) -> tuple[mx.array, mx.array | None]:
    """One draft token from logits [V]: argmax when greedy, else a draw from q (returned)."""
    if sampling.greedy:
        return mx.argmax(logits), None
    q = sampling.probs(logits)
    return mx.random.categorical(mx.log(q)), q


def chain(
    logits: mx.array,
    k: int,
    sampling: Sampling,
    step: Callable[[mx.array], mx.array],
    choose: Callable = pick,
) -> Draft:
    """k chained draft steps, all lazy: take a token from `logits`, then `logits = step(token)`.

    `choose(logits, sampling) -> (token id, q over the target vocabulary | None)`.
    """
    tokens, qs = [], []
    for i in range(k):
        t, q = choose(logits, sampling)
        tokens.append(t)
        if q is not None:
            qs.append(q)
        if i < k - 1:
            logits = step(t.reshape(1).astype(mx.uint32))
    return Draft(mx.stack(tokens).astype(mx.uint32), mx.stack(qs) if qs else None)


def target_lm_head(model):
    """The target's output projection: its own `lm_head`, or the tied embedding."""
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner["lm_head"]
    return decoder_stack(model).embed_tokens.as_linear


def vocab_size(model) -> int:
    """Size of the model's output vocabulary (its logits' last dimension)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        size = model.model.embed_tokens.weight.shape[0]
    return int(size)

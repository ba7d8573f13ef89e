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
from typing import Protocol, Sequence

import mlx.core as mx

from ..sampling import Sampling


MAX_DRAFT_DEFAULT = 16  # the verifier checks at most 16 drafted tokens per step


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
    max_draft: int  # the most tokens one propose() can return (<= 16)

    def bind(self, model, tokenizer) -> None:
        """Check compatibility with the target (raise ValueError) and reset state."""

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed the prompt `tokens`."""

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        """Up to k tokens to follow the committed context and `y` (not yet consumed)."""

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        """The target consumed and kept `tokens` (`[y, accepted drafts...]`)."""


def vocab_size(model) -> int:
    """Size of the model's output vocabulary (its logits' last dimension)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        size = model.model.embed_tokens.weight.shape[0]
    return int(size)

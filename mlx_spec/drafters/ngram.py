"""Prompt lookup: propose what followed the last occurrence of the context's suffix.

With `branches` > 1, the continuations of several earlier occurrences (most
recent first, merged on common prefixes) form a draft tree (`mlx_spec.tree`).

The longest suffix of the context (n from `max_n` down to `min_n`) that occurred
before wins, and its most recent earlier occurrence supplies up to k tokens.
The index maps each n-gram to the positions where it last ended (a few, for
trees) and is updated per committed token, so a lookup costs O(max_n) whatever the context length.
An optional static corpus (like llama.cpp's lookup-cache-static) is consulted
when the context has no match.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from .. import tree
from ..request import whole
from ..sampling import Sampling
from .base import EMPTY, MAX_DRAFT, Draft, SavesState




class NGramIndex:
    """Tokens plus, for each n in [min_n, max_n], n-gram -> its last `KEEP` end positions."""

    KEEP = 4  # earlier occurrences kept per n-gram: the branches of a tree draft

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], tuple[int, ...]] = {}  # (replaced, never changed in place)
        self.matched = 0  # the last lookup's first match: tokens it shares with the context

    def __deepcopy__(self, memo) -> "NGramIndex":
        """A copy for a saved drafter state: keys and end tuples are immutable, so shared (a
        generic deep copy walks every tuple: 0.6 s for a 50k-token context, 13 s at max_n 32)."""
        new = copy.copy(self)
        new.tokens, new.ends = list(self.tokens), dict(self.ends)
        return new

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(self.tokens[end - n :])
                self.ends[key] = (*self.ends.get(key, ()), end - 1)[-self.KEEP :]

    def lookup(self, context: list[int], y: int, k: int, branches: int = 1) -> list[list[int]]:
        """Up to `branches` continuations (most recent match first, distinct) of the longest
        suffixes of `context + [y]` seen in these tokens, each up to k tokens.

        When `context` is these tokens themselves, a continuation that runs into
        the end goes on with y and then with itself (the context continues with y,
        then with the draft): a match `p` tokens back proposes the last `p` tokens
        repeated, so a run of one token or a repeating line drafts k tokens, not one.
        """
        toks, found = self.tokens, []
        self.matched = 0
        for n in range(self.max_n, self.min_n - 1, -1):
            if n - 1 > len(context):
                continue
            key = tuple(context[len(context) - (n - 1) :]) + (y,)
            for end in reversed(self.ends.get(key, ())):
                cont = toks[end + 1 : end + 1 + k]
                if context is toks and len(cont) < k:
                    cont.append(y)
                    while len(cont) < k:  # toks + [y] + cont, read from end + 1 on
                        cont.append(cont[len(cont) - (len(toks) - end)])
                if cont and cont not in found:
                    if not found:
                        self.matched = _matched(toks, end, context)
                    found.append(cont)
                if len(found) == branches:
                    return found
        return found


MATCH_CAP = 32  # a match is measured back this far at most


def _matched(toks: list[int], end: int, context: list[int]) -> int:
    """How many tokens the occurrence ending at `end` shares with `context + [y]` (y included)."""
    n = 1
    while n < MATCH_CAP and n <= min(end, len(context)) and toks[end - n] == context[-n]:
        n += 1
    return n


class NGramDrafter(SavesState):
    """Prompt-lookup drafter (no model, no probabilities: proposals are point masses)."""

    STATE = ("_index",)  # committed state (SavesState)

    taps: tuple[int, ...] = ()
    max_draft = MAX_DRAFT

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        corpus: str | Path | Sequence[int] | None = None,
        branches: int = 1,
    ):
        if not (whole(min_n) and whole(max_n) and 1 <= min_n <= max_n):
            raise ValueError(f"need integers 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        if not (whole(branches) and 1 <= branches <= NGramIndex.KEEP):
            raise ValueError(f"branches must be an integer in 1..{NGramIndex.KEEP}, got {branches!r}")
        self.min_n, self.max_n, self.branches = min_n, max_n, branches
        self.corpus = corpus
        self._corpus_index: NGramIndex | None = None
        self._index = NGramIndex(min_n, max_n)
        self.matched = 0  # the last proposal's match length (`NGramIndex.lookup`)

    def bind(self, model, tokenizer) -> None:
        self._index = NGramIndex(self.min_n, self.max_n)
        if self.corpus is not None and self._corpus_index is None:
            self._corpus_index = NGramIndex(self.min_n, self.max_n)
            self._corpus_index.extend(self._corpus_tokens(tokenizer))

    def _corpus_tokens(self, tokenizer) -> list[int]:
        if isinstance(self.corpus, (str, Path)):
            path = Path(self.corpus)
            if not path.is_file():
                raise ValueError(f"n-gram corpus file not found: {path}")
            return tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
        return [int(t) for t in self.corpus]

    def prefill(self, tokens: Sequence[int], taps) -> None:
        self._index.extend(tokens)

    def lookup(self, y: int, k: int, branches: int | None = None) -> list[list[int]]:
        """The continuations `propose` drafts from, as host tokens (`matched` set too)."""
        context, index = self._index.tokens, self._index
        branches = self.branches if branches is None else branches
        found = index.lookup(context, y, k, branches)
        if not found and self._corpus_index is not None:
            index = self._corpus_index
            found = index.lookup(context, y, k, branches)
        self.matched = index.matched  # the first continuation's match length (0: none)
        return found

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        found = self.lookup(y, k)
        if len(found) <= 1:
            return Draft(mx.array(found[0], mx.uint32)) if found else EMPTY
        tokens, parents = tree.trie(found, k)  # several matches: a tree of their continuations
        return Draft(mx.array(tokens, mx.uint32), parents=parents)

    def commit(self, tokens: Sequence[int], taps) -> None:
        self._index.extend(tokens)

    def context(self) -> list[int]:
        """The tokens committed so far (prompt included), oldest first; not to be modified."""
        return self._index.tokens

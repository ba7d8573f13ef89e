"""Several drafters as one: their proposals merged into one draft tree per step.

    MixedDrafter(NGramDrafter(), DraftModelDrafter(draft))   # CLI: --draft ngram+model --draft-model D

Every member proposes up to k tokens; the proposals are merged on common
prefixes into one tree of at most k nodes, the first member's branch first
(`mlx_spec.tree.trie`), and the target verifies them all in one forward. Merging
needs the proposals' tokens on the host, so `propose` reads them (one extra
sync when a member drafts with a model). When
a single member has something to propose, its own draft is used as is (with
its `q`). Every member is told what the target kept, whichever branch that was:
each trims its own state back to what was committed, as the protocol requires.

With `num_draft_tokens="auto"` and a free member (prompt lookup), a request
decoded alone drafts from one source a step instead: the free member or the
others, whichever its policy expects to pay most (`mlx_spec.sources`); it sets
`only` before asking.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .. import tree
from ..sampling import Sampling
from .base import EMPTY, MAX_DRAFT, Draft


class MixedDrafter:
    def __init__(self, *drafters):
        if len(drafters) < 2:
            raise ValueError("MixedDrafter needs two drafters or more")
        self.drafters = list(drafters)
        self.proposing = list(drafters)  # the members that propose (all, unless `shed`)
        self.only: str | None = None  # this step's source ("free" or "paid"; None: all merged)
        self.read = False  # whether the paid members drafted in this request (read their backlog)

    @property
    def taps(self) -> tuple:
        out: list = []
        for d in self.drafters:
            out += [t for t in d.taps if t not in out]
        return tuple(out)

    @property
    def max_draft(self) -> int:
        return min(MAX_DRAFT, max(d.max_draft for d in self.drafters))

    @property
    def model(self):  # the adaptive policy charges a draft model's per-token cost
        return next((d.model for d in self.drafters if getattr(d, "model", None) is not None), None)

    @property
    def backlog(self) -> int:  # tokens its members must read before they draft (`DraftModelDrafter`)
        if self.only == "free":  # this step: none
            return 0
        return sum(getattr(d, "backlog", 0) for d in self.proposing)

    @property
    def paid_off(self) -> bool:
        """Whether `shed` left this request only the members with nothing to read."""
        return len(self.proposing) < len(self.drafters)

    @property
    def free_member(self):
        """The first member that drafts without a model or the target's features (prompt
        lookup), when another one does: the source `mlx_spec.sources` weighs against the rest."""
        free = [d for d in self.drafters if getattr(d, "model", None) is None and not d.taps
                and hasattr(d, "context") and hasattr(d, "lookup")]
        return free[0] if free and len(free) < len(self.drafters) else None

    @property
    def paid_member(self):
        """The one member besides the free one (a draft model), if there is exactly one."""
        free = self.free_member
        rest = [d for d in self.drafters if d is not free]
        return rest[0] if free is not None and len(rest) == 1 else None

    def peek(self, y: int, k: int) -> tuple[list[int], int]:
        """The free member's draft for input `y` (its first branch) as host tokens, and how
        many tokens its match shares with the context (`NGramDrafter.matched`)."""
        free = self.free_member
        found = free.lookup(y, k, branches=1)  # host lists: no MLX array made and read back
        return (found[0], free.matched) if found else ([], 0)

    def context(self) -> list[int]:
        """The committed tokens, as the free member holds them."""
        return self.free_member.context()

    def shed(self):
        """Stop proposing with the members that have a backlog to read (the loop found the
        read does not pay, `Row.drafting_pays`); they are still told what is committed. Returns
        the one member left proposing (its policy is the request's from here), or None when
        no member or several are left."""
        rest = [d for d in self.proposing if not getattr(d, "backlog", 0)]
        if len(rest) != 1:
            return None
        self.proposing = rest
        return rest[0]

    def _taps_for(self, drafter, taps: dict | None) -> dict | None:
        return None if taps is None or not drafter.taps else {t: taps[t] for t in drafter.taps}

    def bind(self, model, tokenizer) -> None:
        self.proposing, self.read = list(self.drafters), False
        for d in self.drafters:
            d.bind(model, tokenizer)

    def prefill(self, tokens: Sequence[int], taps: dict | None) -> None:
        for d in self.drafters:
            d.prefill(tokens, self._taps_for(d, taps))

    def propose(self, y: int, k: int, sampling: Sampling) -> Draft:
        members, (only, self.only) = self.proposing, (self.only, None)
        if only is not None and not self.paid_off:
            free = self.free_member
            members = [free] if only == "free" else [d for d in members if d is not free]
        self.read = self.read or any(getattr(d, "backlog", None) is not None for d in members)
        drafts = [d.propose(y, min(k, d.max_draft), sampling) for d in members]
        found = [d for d in drafts if d.size]
        if not found:
            return EMPTY
        if len(found) == 1:
            return found[0]
        sequences = []
        for d in found:  # host tokens: n-gram's are, a model's are evaluated here (one sync)
            tokens = d.tokens.tolist()
            if d.parents is None:
                sequences.append(tokens)
            else:
                sequences += _paths(tokens, d.parents)
        tokens, parents = tree.trie(sequences, k)
        return Draft(mx.array(tokens, mx.uint32), parents=parents)

    def commit(self, tokens: Sequence[int], taps: dict | None) -> None:
        for d in self.drafters:
            d.commit(tokens, self._taps_for(d, taps))

    # ---- SavesState, member by member ------------------------------------------------------
    def save_state(self) -> list:
        return [d.save_state() for d in self.drafters]

    def restore_state(self, state: list) -> None:
        for d, s in zip(self.drafters, state):
            d.restore_state(s)

    def keep_learned(self, target) -> None:
        """After a request on `target`: what each member learned for itself (a draft model's
        tree calibration)."""
        for d in self.drafters:
            keep = getattr(d, "keep_learned", None)
            if keep is not None:
                keep(target)

    def fork(self) -> MixedDrafter:
        import weakref

        new = MixedDrafter(*[d.fork() for d in self.drafters])
        new.forked_from = weakref.ref(self)
        return new


def _paths(tokens: list[int], parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf token paths of a tree, in the order of its leaves."""
    kids = tree.children(parents)
    out = []
    for j in range(len(tokens)):
        if not kids[j + 1]:
            path, i = [], j
            while i >= 0:
                path.insert(0, tokens[i])
                i = parents[i]
            out.append(path)
    return out

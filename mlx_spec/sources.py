"""`auto` for a mixed drafter: each step, the one source the cost model expects to pay most.

A `MixedDrafter` with a free member (prompt lookup: no model, no forward) has two
sources of drafts: the free member, whose draft costs only the target's verify,
and the others (a draft model), whose k forwards cost `draft_per_token` each.
`SourceChoice` keeps one `AdaptiveK` per source (itself for the paid members,
`free` for the free one). Before each step it looks up the free member's draft
(a dictionary lookup, no MLX work); when there is one, it compares the two
policies' best long-run rates and asks only the better source to propose. The
member left out is still told what the target kept (a draft model queues it and
reads it with its next proposal).

The free source is scored on the steps it does not win too: its draft, compared
with the tokens the target went on to emit, shows how much of it would have been
kept (exactly, up to the tokens emitted; positions beyond them stay unobserved).
Its acceptance is therefore always current, and it never has to win a step to show
that it would pay: on code edits, where a lookup copies long runs, it takes over
as soon as the copying starts; on chat, where its matches are short and wrong, the
draft model keeps drafting. The comparison is fair under sampling too: a point-mass
draft token is kept with the target's probability of it, which is also the chance
that the (exactly distributed) emitted token equals it.

A draft model that has not read the request's prompt yet (it reads it when it first
drafts) is asked instead of a free draft only when what it saves over the free
source in the tokens left repays the read (`Row.drafting_pays`): on a short code
edit the read would cost more than the whole answer gains from it. When the free
source has nothing, the read is weighed against plain decoding, at the gain the
paid source adds on the share of steps the free one leaves it (learned too).

In a batch the rows' lengths are chosen together from the paid source's policy
(`mlx_spec.batch_policy`), and the drafter merges both sources' drafts into one
tree, as with a fixed k.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from .adaptive import EMA, AdaptiveK, CostModel

FREE, PAID = "free", "paid"


@dataclass
class SourceChoice(AdaptiveK):
    free: AdaptiveK | None = None  # the free member's own policy (costs: the verify alone)
    source: str | None = None  # this step's source (None: not chosen alone, e.g. in a batch)
    guess: tuple[int, list[int]] | None = None  # (where it starts, tokens): a free draft not verified
    row: object = None  # weak reference to the row this policy serves now
    picks: dict = None  # steps each source drafted alone, over the policy's life
    free_share: float = 0.0  # running share of steps the free source drafts

    def __post_init__(self):
        super().__post_init__()
        if self.free is None:
            self.free = AdaptiveK(CostModel(self.costs.verify, 0.0), self.k_max, replays=self.replays,
                                  timed=self.timed)
        self.picks = self.picks or {FREE: 0, PAID: 0}

    def serve(self, row) -> None:
        """From now on this policy chooses for `row` (a new request: nothing pending)."""
        self.row, self.guess, self.source = weakref.ref(row), None, None

    def choose(self) -> tuple[int, float]:
        row = self.row() if self.row is not None else None
        if row is None or row.y is None:
            return super().choose()
        drafter = row.drafter
        context = drafter.context()
        self._score(context, row.y)
        ahead = drafter.peek(row.y, self.free.k_max)
        k, gain = super().choose()
        if ahead:
            k_free, gain_free = self.free.choose()
            if k_free and (gain_free >= gain or not drafter.read and not row.drafting_pays(gain, over=gain_free)):
                return self._pick(drafter, FREE, k_free, gain_free)
            self.guess = (len(context) + 1, ahead)  # scored against the target's tokens next step
        if gain > 1.0:  # what paying saves, on the share of steps the free source leaves it
            gain = 1.0 / (1.0 - (1.0 - self.free_share) * (1.0 - 1.0 / gain))
        return self._pick(drafter, PAID, k, gain)

    def _pick(self, drafter, source: str, k: int, gain: float) -> tuple[int, float]:
        self.source = drafter.only = source
        self.picks[source] += k > 0
        self.free_share += EMA * ((source == FREE) - self.free_share)
        return k, gain

    def _score(self, context: list[int], y: int) -> None:
        """What the free draft not verified last time would have kept: it continued the input
        then at `start`; the target's tokens since are the committed ones after it, then `y`."""
        if self.guess is None:
            return
        (start, tokens), self.guess = self.guess, None
        known = list(context[start:]) + [y]
        seen = min(len(tokens), len(known))
        kept = next((i for i in range(seen) if tokens[i] != known[i]), seen)
        self.free.observe(seen, kept)  # all `seen` kept: the rest is unknown, not rejected

    def offered(self, asked: int, proposed: int) -> None:
        if self.source == FREE:
            self.free.offered(asked, proposed)
        else:
            super().offered(asked, proposed)

    def observe(self, proposed: int, accepted: int, seconds: float | None = None,
                plain_by_choice: bool = False) -> None:
        source, self.source = self.source, None
        row = self.row() if self.row is not None else None
        if row is not None:
            row.drafter.only = None  # (a step cut to k = 0 never asked the drafter)
        if source == FREE:
            self.free.observe(proposed, accepted, seconds, plain_by_choice)
        else:
            super().observe(proposed, accepted, seconds, plain_by_choice)

    def parked_next(self) -> bool:
        """Plain next only if neither source would draft (the free one, should it match)."""
        return super().parked_next() and max(range(self.k_max + 1), key=self.free.rates().__getitem__) == 0

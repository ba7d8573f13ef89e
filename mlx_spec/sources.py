"""`auto` for a mixed drafter: each step, the one source the cost model expects to pay most.

A `MixedDrafter` with a free member (prompt lookup: no model, no forward) has two
sources of drafts: the free member, whose draft costs only the target's verify,
and the others (a draft model), whose k forwards cost `draft_per_token` each.
`SourceChoice` keeps `AdaptiveK` policies per source: itself for the paid
members, `frees` for the free one, one for each class of match length (a lookup
whose match shares 8 or more tokens with the context is a copy in progress; one
that shares 2 is often a coincidence). Before each step it looks up the free
member's draft (a dictionary lookup, no MLX work); when there is one, it compares
the paid policy's best long-run rate with that of the free policy for the match's
class and asks only the better source to propose. The
member left out is still told what the target kept (a draft model queues it and
reads it with its next proposal).

The paid policy's two tables are kept as a draft model's own are (after a step that kept
its first draft token, and otherwise), except that a step after a free step that kept
tokens counts as a fresh start: lookup drafts until the copy ends, where the model's next
token is hardest, and taught to the table of runs those steps would make the model look
poor within a run, also on chat and JSON, where it drafts alone. A free draft lost at its
first token says nothing about the model: its state stays that of its own last step (else
on JSON, where short lookups are often wrong, each one would leave the model drafting from
its cautious table, where lookup wins again).

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
drafts) is not asked while the free source has a draft from a match of 4 tokens or
more (a copy under way): a free step costs about what a plain one does, while the
read costs a forward of the draft model over the whole prompt, more than a short code
edit gains from it. A shorter match is weighed as on any step: at a request's first
steps it is mostly the answer's opening tokens matched by chance (a code edit opens
with a sentence, then the fence), and a lookup that loses there costs a step the draft
model would mostly have kept, while the read it saved comes a step later anyway. At the
first step the free source has nothing, the read is weighed against plain decoding
(`Row.drafting_pays`), at the gain the paid source adds on the share of steps the
free one leaves it in this request so far (hopeful: the running share over earlier
requests, which may have been code edits, would shut the draft model out of a JSON
answer it drafts well). A code edit that lookup has been copying does not pay for the
read at its first miss; it goes on with lookup alone (`MixedDrafter.shed`), still
weighed by this policy's tables for lookup when it decodes alone, which learned from
every step this drafter had a match for.

In a batch the rows' lengths are chosen together from the paid source's policy
(`mlx_spec.batch_policy`), and the drafter merges both sources' drafts into one
tree, as with a fixed k.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

from .adaptive import EMA, AdaptiveK, CostModel
from .rows import CATCH_UP_MIN

FREE, PAID = "free", "paid"
# Classes of a lookup's match (tokens it shares with the context): shorter than 4, 4-7, 8 or
# more. A long match is a copy in progress and a short one often a coincidence, so each class
# has its own acceptance estimates.
MATCHED = (4, 8)
SHARE_WEIGHT = 4  # steps the running share of free steps counts as in a new request's


@dataclass
class SourceChoice(AdaptiveK):
    frees: list | None = None  # the free member's policies, one a match class (costs: the verify alone)
    free: AdaptiveK | None = None  # this step's (its match's class)
    source: str | None = None  # this step's source (None: not chosen alone, e.g. in a batch)
    guess: tuple | None = None  # (where it starts, tokens, its policy): a free draft not verified
    row: object = None  # weak reference to the row this policy serves now
    picks: dict = None  # steps each source drafted alone, over the policy's life
    free_share: float = 0.0  # running share of steps the free source drafts
    here: tuple[int, int] = (0, 0)  # this request's steps the free source drafted, and all its steps

    def __post_init__(self):
        super().__post_init__()
        if self.frees is None:
            self.frees = [AdaptiveK(CostModel(self.costs.verify, 0.0), self.k_max, replays=self.replays,
                                    timed=self.timed) for _ in range(len(MATCHED) + 1)]
        self.free = self.free or self.frees[0]
        self.picks = self.picks or {FREE: 0, PAID: 0}

    def serve(self, row) -> None:
        """From now on this policy chooses for `row` (a new request: nothing pending)."""
        self.row, self.guess, self.source, self.here = weakref.ref(row), None, None, (0, 0)

    def start_request(self) -> None:
        super().start_request()
        for policy in self.frees:
            policy.start_request()

    def choose(self) -> tuple[int, float]:
        row = self.row() if self.row is not None else None
        if row is None or row.y is None:
            return super().choose()
        drafter = row.drafter
        context = drafter.context()
        self._score(context, row.y)
        ahead, matched = drafter.peek(row.y, self.k_max)
        self.free = self.frees[bisect.bisect_right(MATCHED, matched)]
        if drafter.paid_off:  # its read does not pay (`Row.drafting_pays`): lookup, else plain
            k_free, gain_free = self.free.choose(len(ahead)) if ahead else (0, 1.0)
            return self._pick(drafter, FREE, k_free, gain_free)
        k, gain = super().choose()
        if ahead:
            k_free, gain_free = self.free.choose(len(ahead))
            unread = not drafter.read and drafter.backlog >= CATCH_UP_MIN
            if k_free and (gain_free >= gain or unread and matched >= MATCHED[0]):
                return self._pick(drafter, FREE, k_free, gain_free)
            self.guess = (len(context) + 1, ahead, self.free)  # scored against the target's next tokens
        return self._pick(drafter, PAID, k, self._left(gain))

    def _left(self, gain: float, earlier: bool = True) -> float:
        """What paying saves, on the share of steps the free source leaves it: this request's
        share, from the running one over `earlier` requests (worth 4 steps)."""
        weight = SHARE_WEIGHT if earlier else 0
        free, steps = self.here
        if gain <= 1.0 or not steps + weight:
            return gain
        share = (free + weight * self.free_share) / (steps + weight)
        return 1.0 / (1.0 - (1.0 - share) * (1.0 - 1.0 / gain))

    def hopeful_gain(self) -> float:
        """Hopeful also about the share: this request's own alone. After code edits, where
        lookup drafts most steps, the running share would leave a JSON answer's draft model
        too little to repay its read, and the read never happens (the request goes on with
        lookup alone, which barely drafts there)."""
        return self._left(super().hopeful_gain(), earlier=False)

    def _pick(self, drafter, source: str, k: int, gain: float) -> tuple[int, float]:
        self.source = drafter.only = source
        self.picks[source] += k > 0
        self.free_share += EMA * ((source == FREE) - self.free_share)
        self.here = (self.here[0] + (source == FREE), self.here[1] + 1)
        return k, gain

    def _score(self, context: list[int], y: int) -> None:
        """What the free draft not verified last time would have kept: it continued the input
        then at `start`; the target's tokens since are the committed ones after it, then `y`."""
        if self.guess is None:
            return
        (start, tokens, policy), self.guess = self.guess, None
        known = list(context[start:]) + [y]
        seen = min(len(tokens), len(known))
        kept = next((i for i in range(seen) if tokens[i] != known[i]), seen)
        policy.observe(seen, kept)  # all `seen` kept: the rest is unknown, not rejected

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
            if accepted:  # a copy ran, then ended: the model's next step starts afresh
                self.state = 0
        else:
            super().observe(proposed, accepted, seconds, plain_by_choice)

    def parked_next(self) -> bool:
        """Plain next only if neither source would draft (the free one, whatever its match)."""
        row = self.row() if self.row is not None else None
        paid_off = row is not None and row.drafter.paid_off
        return (paid_off or super().parked_next()) and all(
            max(range(self.k_max + 1), key=p.rates().__getitem__) == 0 for p in self.frees)

"""Adaptive draft length: choose k per step to maximise expected tokens per second.

Before each step the policy picks k in 0..k_max maximising the expected tokens
per second, from the expected tokens and seconds of a step at k,

    E(k) = 1 + sum_{j=1..k} prod_{i<j} a_i,   T(k) = V(k+1) + D(k)

in each of two states: 1 after a step that kept its first drafted token, 0
after a step that drafted and lost its first token or whose drafter had nothing
to propose; a plain step the policy (or a batch) chose leaves the state as it
was: it says nothing about the drafter, and parking must not pass for a way
into the other state's estimates. Acceptance comes in runs (an n-gram match that is a real
copy, an easy stretch for a draft model), so each state has its own `a_i`, and
the rate maximised is the long-run one, sum(pi E) / sum(pi T) with pi the share
of steps each state gets under that choice (`AdaptiveK.rates`): a cheap draft
after a rejection can pay because, kept, it leads into a run.

* `a_i`: the acceptance rate at draft position i given the earlier ones were
  accepted, tracked online per state (running mean, then an exponential moving
  average);
* `V(n)`: the target's time to verify n tokens: the calibrated curve
  T(n)/T(1) of this model on this device (measured once, cached on disk per
  model, dtype, device and BLAS: `mlx_spec.calibration`), corrected online by the
  step times observed at each n;
* `D(k)`: the drafter's time to propose k tokens (zero for n-gram; k single-
  token forwards of a draft model, measured the same way);
* on targets with recurrent layers, the expected replay after a rejection
  (`mlx_spec.cache.Checkpoint`): sum_j P(n = j) V(j + 1).

k = 0 ("park") is plain decoding, chosen when no draft length pays; while
parked the policy probes with a short draft now and then (at growing
intervals), so it recovers when the text becomes predictable again. The
decision is pure Python arithmetic on a handful of floats: no host sync. Any k
is lossless, so the choice affects only speed.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("mlx_spec")

LOADED_WEIGHT = 4  # observations a loaded acceptance estimate counts as

# Acceptance assumed before observing, worth 2 observations. Cautious: a cold start drafts
# short until acceptance proves itself; what a policy learned is kept on disk, so only the
# first run of a model, drafter kind and sampling mode starts cold.
PRIOR, PRIOR_WEIGHT = 0.4, 2
EMA = 0.1  # weight of a new observation once the running mean's is smaller
PROBE_FIRST, PROBE_MAX = 4, 64  # parked steps before a probe; doubles up to PROBE_MAX
EXPLORE = 16  # every EXPLORE-th drafting step tries k-1 or k+1, so the curve's shape is measured
# A position beyond every step's draft is never observed: learned low (early, or on other text)
# it would hold k below it for good. So after a step that kept all it drafted, while the next
# position has been seen fewer than CURIOUS times, the next step drafts one token deeper (timed
# policies, whose tables carry over between requests; a seeded row's starts afresh each time).
CURIOUS = 8
STATES = 2  # acceptance tables: 1 after a step that kept its first draft token, else 0


PAD_SAVING = 0.9  # a block runs wider only where that width costs at most this share of its own


@dataclass
class CostModel:
    """Seconds to verify n = 1..N_MAX tokens, and to draft one token."""

    verify: list[float]  # verify[n - 1] = seconds for a forward over n tokens
    draft_per_token: float = 0.0
    widths: list[int] | None = None  # widths[n - 1]: the width a block of n tokens runs at (`padded`)
    measured: list[float] | None = None  # each width's own cost, when `verify` is padded's

    @property
    def unpadded(self) -> list[float]:
        """Seconds of a forward over exactly n tokens (what a batch's verify, never padded, pays)."""
        return self.verify if self.measured is None else self.measured

    @classmethod
    def padded(cls, measured: list[float], draft_per_token: float = 0.0) -> CostModel:
        """Costs for a loop that runs a block of n >= 2 tokens at the cheapest width m >= n when
        that saves at least a tenth (`PAD_SAVING`): the extra rows are filler whose logits
        are never read, and the cache keeps only the accepted prefix, as always. A wider
        forward can cost less than a narrower one (the matmul library's kernels: see
        `mlx_spec.calibration`); `verify[n - 1]` is then the width's cost."""
        widths = [1]  # a plain step is never padded
        for n in range(2, len(measured) + 1):
            m = min(range(n, len(measured) + 1), key=lambda w: measured[w - 1])  # (the narrowest of ties)
            widths.append(m if measured[m - 1] <= PAD_SAVING * measured[n - 1] else n)
        return cls([measured[m - 1] for m in widths], draft_per_token, widths, list(measured))

    def step_seconds(self, k: int) -> float:
        return self.verify[k] + self.draft_per_token * k


@dataclass
class AdaptiveK:
    """The per-step draft-length policy (see the module docstring)."""

    costs: CostModel
    k_max: int
    accept: list[list[float]] = field(default_factory=list)  # accept[state][i] = a_i
    seen: list[list[int]] = field(default_factory=list)  # observations at position i
    state: int = 0  # 1 when the last step kept its first drafted token
    replays: bool = False  # recurrent target: a rejection costs a forward over the kept tokens
    timed: bool = True  # learn from step timings (False: choices depend only on tokens)
    scale: float | None = None  # observed / calibrated step time, over all k
    shape: dict[int, float] = field(default_factory=dict)  # k -> its own deviation from `scale`
    parked: int = 0
    probe_every: int = PROBE_FIRST
    steps: int = 0
    # offers[state]: how often the drafter proposes anything when asked (an n-gram drafter
    # misses on most chat steps); seen by a batch, which assumes each row drafts K otherwise
    offers: list[float] = field(default_factory=lambda: [1.0] * STATES)
    asked: list[int] = field(default_factory=lambda: [0] * STATES)
    together: object = None  # rows whose policies share this key draft in one forward per depth
    kept_all: bool = False  # the last step drafted and the target kept every token of it
    solo: bool = False  # a seeded sampled request's: in a batch too, its own lengths (its draws repeat)
    shapes: object = None  # tree_shape.ShapeChoice: how much of a draft tree pays (kept across requests)
    # k -> [timed steps at k, sum of their seconds / the target's calibrated forward alone]
    # (`calibration.suspect`: a curve measured while the machine was busier; this process only)
    witness: dict = field(default_factory=dict)

    def __post_init__(self):
        self.k_max = min(self.k_max, len(self.costs.verify) - 1)
        self.accept = [[PRIOR] * self.k_max for _ in range(STATES)]
        self.seen = [[0] * self.k_max for _ in range(STATES)]

    def estimates(self, state: int | None = None) -> list[float]:
        """Acceptance per position (in the current state by default); a position
        never reached inherits the one before it.

        Optimism about deeper positions is what makes the policy try a longer draft
        once the shallow ones prove reliable; it then measures them.
        """
        state = self.state if state is None else state
        if not self.seen[state][0]:  # a state never met is taken to be like the other
            state = 1 - state
        out, prev = [], PRIOR
        for a, n in zip(self.accept[state], self.seen[state]):
            prev = a if n else prev
            out.append(prev)
        return out

    def expected_tokens(self, k: int, state: int | None = None) -> float:
        return self._tokens(self.state if state is None else state)[k]

    def seconds(self, k: int, state: int | None = None) -> float:
        """Predicted step time at k, up to the common `scale` (which cannot change the best k)."""
        return self.calibrated_seconds(k, state) * self.shape.get(k, 1.0)

    def calibrated_seconds(self, k: int, state: int | None = None) -> float:
        base = self.costs.step_seconds(k)
        if self.replays:
            survive = 1.0
            for j, a in enumerate(self.estimates(state)[:k]):  # P(n = j) V(j + 1): j + 1 kept
                base += survive * (1 - a) * self.costs.verify[j]
                survive *= a
        return base

    def _tokens(self, state: int, estimates: list[float] | None = None) -> list[float]:
        """Expected tokens of a step at k = 0..k_max in `state` (a batch asks for these for
        every row and every K it weighs: without the seconds, which it takes from elsewhere)."""
        tokens, total, survive = [1.0], 1.0, 1.0
        for a in self.estimates(state) if estimates is None else estimates:
            survive *= a
            total += survive
            tokens.append(total)
        return tokens

    def _curves(self, state: int) -> tuple[list[float], list[float], list[float]]:
        """For k = 0..k_max in `state`: expected tokens, seconds, P(next state is 1)."""
        estimates = self.estimates(state)
        to_one = [float(state)] + estimates[:1] * self.k_max  # k = 0 stays; else the first token kept
        return self._tokens(state, estimates), [self.seconds(k, state) for k in range(self.k_max + 1)], to_one

    def rates(self, most: int | None = None) -> list[float]:
        """Long-run expected tokens per second for each k of the current state (each k up to
        `most`, in both states, when the drafter cannot propose more).

        A step moves the policy between the two states (to 1 when its first draft
        token is kept, to 0 otherwise), so what k earns now depends also on the
        state it leads to: after a rejection, a draft that barely pays for itself
        can be worth it because, kept, it leads into a run; parking never does.
        For each pair (k here, k in the other state), the chain's stationary
        share pi of each state gives the rate sum(pi E) / sum(pi T); the other
        state's k is the best one for each k here.
        """
        top = self.k_max if most is None else min(most, self.k_max)
        here, there = (np.array(c)[:, : top + 1] for c in (self._curves(self.state), self._curves(1 - self.state)))
        # probability that a step leaves its state, for each k
        leave_here = here[2] if self.state == 0 else 1.0 - here[2]
        leave_there = there[2] if self.state == 1 else 1.0 - there[2]
        # all (k here, j there) pairs at once (a pair that never leaves either state is
        # replaced below: only k = "stays" can have one)
        pi = leave_there[None, :] / np.maximum(leave_here[:, None] + leave_there[None, :], 1e-300)
        pairs = ((pi * here[0][:, None] + (1 - pi) * there[0][None, :])
                 / (pi * here[1][:, None] + (1 - pi) * there[1][None, :]))
        stays = leave_here == 0  # this k never leaves the state
        best = np.where(stays, here[0] / here[1], pairs.max(axis=1))
        return best.tolist()

    def choose(self, most: int | None = None) -> tuple[int, float]:
        """(k, its expected gain over plain decoding); k <= `most` when the drafter is known to
        have no more (a lookup already made: a longer k would count tokens it cannot propose)."""
        rates = self.rates(most)
        top = len(rates) - 1
        k = max(range(len(rates)), key=rates.__getitem__)
        if k == 0 and top > 0:
            self.parked += 1
            if self.parked >= self.probe_every:  # look again, cheaply
                self.parked, self.probe_every = 0, min(2 * self.probe_every, PROBE_MAX)
                k = 1
        else:
            self.parked, self.probe_every = 0, PROBE_FIRST
            self.steps += 1
            if self.steps % EXPLORE == 0:  # measure a neighbour now and then
                k = max(1, min(top, k + (1 if self.steps // EXPLORE % 2 else -1)))
            elif k < top and self.curious(k):
                k += 1
        return k, rates[k] * self.seconds(0)  # over plain decoding's 1 token per seconds(0)

    def hopeful_gain(self) -> float:
        """The best expected gain over plain decoding if what is still uncertain goes well:
        each acceptance seen taken as a new process takes what an earlier one learned, then
        raised toward 1 as if `PRIOR_WEIGHT` more drafts had been kept (`_hoped`; positions
        never reached inherit, as in `estimates`). For a choice that cannot be
        revisited and that decides whether anything more is learned (a draft model's prompt
        read): weighed at the plain estimates, a policy that once learned low acceptance would
        never draft again, so never learn otherwise, in this request or, its tables kept, in
        any later one."""
        hopeful = copy.copy(self)
        hopeful.accept = [[_hoped(a, n) if n else a for a, n in zip(row, seen)]
                          for row, seen in zip(self.accept, self.seen)]
        return max(hopeful.rates()) * self.seconds(0)

    def start_request(self) -> None:
        """A new request (timed policies): its text may differ from the ones this policy learned
        on, so each estimate counts as at most `LOADED_WEIGHT` observations, as a kept file's
        does in a new process. The request's own steps then move the estimates quickly, and
        positions already seen often are looked at again (`curious`): in a long process (a
        server, a benchmark) the counts otherwise grew with every request, and after a chat
        story a JSON answer drafted 1-2 tokens a step with every token kept. A parked policy
        probes soon."""
        if self.timed:
            self.seen = [[min(n, LOADED_WEIGHT) for n in row] for row in self.seen]
            self.parked, self.probe_every = 0, PROBE_FIRST
        self.state, self.kept_all = 0, False  # the last request's last step says nothing about this one's first

    def curious(self, k: int) -> bool:
        """Whether this step, whose best length is k, drafts k + 1 instead (see CURIOUS)."""
        return self.timed and self.kept_all and self.state == 1 and k < self.k_max and self.seen[1][k] < CURIOUS

    def offered(self, asked: int, proposed: int) -> None:
        """The drafter, asked for `asked` tokens, proposed `proposed` (before any trimming)."""
        if asked > 0:
            n = self.asked[self.state] = self.asked[self.state] + 1
            w = max(1.0 / (n + PRIOR_WEIGHT), EMA)
            self.offers[self.state] += w * ((proposed > 0) - self.offers[self.state])

    def expected_offered(self, k: int) -> float:
        """Expected tokens of a step asking for k, counting the steps the drafter proposes nothing."""
        return self.offered_curve()[k]

    def offered_curve(self) -> list[float]:
        """`expected_offered` at k = 0..k_max."""
        offers = self.offers[self.state]
        return [1.0 + offers * (t - 1.0) for t in self._tokens(self.state)]

    def parked_next(self) -> bool:
        """Whether the next `choose` stays parked if this step is plain: no probe due by then,
        and k = 0 still best (a plain step queued ahead and then taken back wastes a forward)."""
        if self.parked + 1 >= self.probe_every:
            return False
        rates = self.rates()
        return max(range(len(rates)), key=rates.__getitem__) == 0

    def observe(self, proposed: int, accepted: int, seconds: float | None = None,
                plain_by_choice: bool = False) -> None:
        """A verify step with `proposed` drafted tokens kept `accepted` of them
        (`plain_by_choice`: no draft because none was asked for or a batch cut it away, not
        because the drafter had none: the state stays as it was)."""
        estimates = self.estimates()
        accept, seen = self.accept[self.state], self.seen[self.state]
        for i in range(min(proposed, self.k_max)):
            if i > accepted:  # never reached: position i-1 was rejected
                break
            if not seen[i]:  # start from what it inherited, not from the prior
                accept[i] = estimates[i]
            seen[i] += 1
            w = max(1.0 / (seen[i] + PRIOR_WEIGHT), EMA)
            accept[i] += w * ((i < accepted) - accept[i])
        if seconds is not None and self.timed and proposed <= self.k_max:
            # Observed / calibrated time = scale * shape[k]. The scale follows
            # whatever slows every k alike (other processes, a stale calibration);
            # shape[k] learns, from steps at several k (n-gram misses, probes,
            # exploration), how this k really compares with the others.
            ratio = seconds / self.calibrated_seconds(proposed)
            seen_k = self.witness.setdefault(proposed, [0, 0.0])
            seen_k[0] += 1
            seen_k[1] += seconds / self.costs.verify[proposed]  # drafting left out: a lower bound
            shape = self.shape.get(proposed, 1.0)
            self.scale = ratio / shape if self.scale is None else self.scale + 2 * EMA * (ratio / shape - self.scale)
            self.shape[proposed] = shape + EMA * (ratio / self.scale - shape)
        if proposed or not plain_by_choice:
            self.state = int(proposed > 0 and accepted > 0)
        self.kept_all = 0 < proposed <= accepted  # (see CURIOUS)
        if proposed and accepted:  # a kept draft (after a probe: the text may have turned
            self.probe_every = PROBE_FIRST  # predictable, so the next probe comes soon)


def _hoped(a: float, n: int) -> float:
    """An acceptance seen `n` times, hoped for: counted as a new process counts a kept one
    (`_apply_learned`: another request's text may differ), then raised toward 1 as if
    `PRIOR_WEIGHT` more drafts had been kept."""
    a, n = _carried(a, n)
    return a + (1.0 - a) * PRIOR_WEIGHT / (n + PRIOR_WEIGHT)


def _carried(a: float, n: int) -> tuple[float, int]:
    """An acceptance and its count as another request or process starts from them: never more
    pessimistic than a cold start, and worth a few observations (its text may differ)."""
    return max(float(a), PRIOR), min(int(n), LOADED_WEIGHT)


class FixedK:
    """The same draft length every step (0: plain decoding)."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> tuple[int, None]:
        return self.k, None

    def observe(self, proposed: int, accepted: int, seconds: float | None, plain_by_choice: bool = False) -> None:
        pass

    def offered(self, asked: int, proposed: int) -> None:
        pass

"""The draft length of a batch: one K for the batch's auto rows, from what B rows x T tokens cost.

A batch's verify forward costs the same for every row up to the longest draft,
so the rows' own policies (`mlx_spec.adaptive.AdaptiveK`: acceptance per position)
are combined into one choice that maximises the batch's expected tokens per
second. The cost of B rows x T tokens is taken from the model's calibrated
curve (a forward over B * T tokens, the matmuls dominating) and corrected
online by what batched steps of each shape really took.

The rows' drafters then propose, and the batch verifies only what pays given what
they actually proposed (`trim_drafts`): rows whose drafter has nothing to propose
(an n-gram miss) add no tokens, so a step where few rows have a draft decodes
plainly. While drafting does not pay, the batch probes with one token now and then, at
intervals that grow while probes keep nothing (and shrink when they keep tokens),
and only on a step where some row has something to propose.

Each row's own policy and this step's lengths for every row are in `mlx_spec.row_lengths`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from . import calibration, learned
from .adaptive import EMA, EXPLORE, PROBE_FIRST, PROBE_MAX, AdaptiveK, FixedK
from .calibration import _read_curve, _write_curve, measure_verify_seconds, model_key, write_json
from .identity import IdentityMap
from .learned import TIMING_VERSION

log = logging.getLogger("mlx_spec")

SAVE_EVERY = 32  # batch steps observed between saves of their costs
RATIO_BOUND = 4.0  # observed step times are taken within 4x of the calibrated curve's
WIDE = (17, 24, 34, 48, 68, 96, 136)  # verify widths calibrated for batches (rows x tokens)


def wide_verify_seconds(model) -> list[float]:
    """Seconds of forwards over `WIDE` tokens: the cost of a batch's verify, B rows x T tokens,
    is taken to be that of one row of B * T tokens (the matmuls dominate). Cached as the curve."""
    from .agreed import agreed_curve

    key, curves = model_key(model) + ":wide", calibration._CURVES  # (looked up late: tests swap them)
    known = curves.get(key) or _read_curve(calibration.cache_dir() / f"{key}.json")
    known = known if known is not None and len(known) == len(WIDE) else None

    def measure() -> list[float]:
        log.info("calibrating batched verify costs of this model (once per model and device)")
        every = measure_verify_seconds(model, WIDE[-1], repeats=1)
        return [every[w - 1] for w in WIDE]

    if key in curves:
        return curves[key]
    # A sharded target's ranks measure together and take rank 0's curve. They must all get
    # here at the same step: a sharded server calls this in its warm-up (engine.py), since
    # later calls depend on each rank's own timings.
    times = agreed_curve(model, known, measure)
    if times is not known:
        _write_curve(calibration.cache_dir() / f"{key}.json", times)
    curves[key] = times
    return times


def batch_seconds(model, narrow: list[float], rows: int, width: int) -> float:
    """Predicted seconds of one verify forward over `rows` rows of `width` tokens each."""
    w = rows * width
    if w <= len(narrow):
        return narrow[w - 1]
    costs = _costs(model)
    if costs.wide is None:  # once per model object: finding the curve walks its parameters
        costs.wide = wide_verify_seconds(model)
    wide = costs.wide
    for (w0, t0), (w1, t1) in zip(zip(WIDE, wide), zip(WIDE[1:], wide[1:])):
        if w <= w1:
            return t0 + (t1 - t0) * (w - w0) / (w1 - w0)
    return wide[-1] * w / WIDE[-1]


class BatchCosts:
    """What a model's batched steps cost, learned online: observed over predicted seconds for
    each (rows, tokens per row), an exponential moving average starting at 1."""

    def __init__(self, path: Path | None = None):
        self.ratio: dict[tuple[int, int], float] = {}
        self.path, self.unsaved = path, 0  # where the ratios are kept for the next process
        self.parked = 0  # steps since the batch last verified a draft
        self.probe_every = PROBE_FIRST  # parked steps before a probe (PROBE_FIRST..PROBE_MAX)
        self.steps = 0
        self.plan: str | None = None  # this step: "probe", "explore" or None
        self.probed = False  # the last step verified a probe
        self.wide: list[float] | None = None  # the model's `wide_verify_seconds`, once looked up

    def observe(self, rows: int, width: int, predicted: float, seconds: float) -> None:
        r, seen = self.ratio.get((rows, width)), _bounded(seconds / predicted)
        self.ratio[(rows, width)] = seen if r is None else r + EMA * (seen - r)
        self.unsaved += 1
        if self.unsaved >= SAVE_EVERY:
            self.save()

    def save(self) -> None:
        """Keep the ratios for the next process (never raises: they are only a warm start)."""
        self.unsaved = 0
        if self.path is not None:
            try:
                write_json(self.path, {"timing": TIMING_VERSION,
                                       "ratio": [[r, w, v] for (r, w), v in self.ratio.items()]})
            except OSError:
                pass

    def load(self) -> None:
        """What an earlier process measured: a cold start knows what verifying in a batch
        really costs on this machine (its overheads), not only the calibrated forwards."""
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("timing") != TIMING_VERSION:
                return  # timed by an older mlx-spec (`learned.TIMING_VERSION`)
            self.ratio = {(int(r), int(w)): _bounded(float(v)) for r, w, v in data["ratio"]
                          if math.isfinite(float(v)) and float(v) > 0}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or damaged: learned again

    def correction(self, rows: int, width: int) -> float:
        """Observed over predicted seconds at this shape; a shape never observed takes that of
        the nearest width observed with as many rows (whatever slows those steps, load or
        overhead, is assumed to slow it alike), else 1. Plain steps (width 1) and verifies
        (width > 1) never stand in for each other: a verify's time includes its drafters', which
        is predicted less well, and a plain step priced at a verify's ratio makes drafting look
        cheaper than it is."""
        if (rows, width) in self.ratio:
            return self.ratio[(rows, width)]
        near = [(abs(w - width), w) for r, w in self.ratio if r == rows and (w > 1) == (width > 1)]
        return self.ratio[(rows, min(near)[1])] if near else 1.0


def _bounded(ratio: float) -> float:
    """An observed-over-predicted ratio within [1/RATIO_BOUND, RATIO_BOUND]: one step stalled by
    something else (a calibration, the machine swapping) must not price a shape out for good
    (a shape priced out is never tried again, so its ratio would never come back)."""
    return min(max(ratio, 1 / RATIO_BOUND), RATIO_BOUND)


_BATCH = IdentityMap()  # model -> BatchCosts


def _costs(model) -> BatchCosts:
    """The model's batch costs, starting from what an earlier process kept (per model, dtype
    and device, next to the adaptive policies)."""
    def make() -> BatchCosts:
        costs = BatchCosts(learned.policy_dir() / f"{model_key(model)}-batch.json")
        costs.load()
        return costs

    return _BATCH.setdefault(model, make)


def choose_for_batch(model, policies: list) -> list[tuple[int, float | None]]:
    """Draft lengths for a batch verified in one forward, maximising the batch's tokens/s.

    The forward costs the same for every row up to the longest draft, so rows on
    `auto` all draft up to one K (each capped at its own k_max), chosen for
    sum over rows of E_i(k_i) / (T(B rows x (K + 1)) + drafting) (rows drafting together with
    one draft model pay one forward per depth between them), where E_i counts
    how often row i's drafter proposes at all (`AdaptiveK.offered`); fixed-k rows
    keep their k. T comes from the calibrated curve, corrected by what batched
    steps of that shape really cost (`observe_batch`); a neighbouring K is tried
    now and then to measure it. K = 0 decodes plainly, with a 1-token probe now
    and then, so drafting resumes when load drops or text becomes predictable.
    """
    own = {i: p.choose() for i, p in enumerate(policies) if _repeatable(p)}  # seeded rows: as alone
    if own:
        view = [FixedK(own[i][0]) if i in own else p for i, p in enumerate(policies)]
        return [own.get(i, c) for i, c in enumerate(choose_for_batch(model, view))]
    auto = [p for p in policies if isinstance(p, AdaptiveK)]
    fixed = [p.k for p in policies if not isinstance(p, AdaptiveK)]
    if not auto:
        return [(k, None) for k in fixed]
    costs, curves = _costs(model), _offered_curves(policies)
    rates = [expected_rate(model, policies, K, costs, curves)[0] for K in range(max(p.k_max for p in auto) + 1)]
    K = max(range(len(rates)), key=rates.__getitem__)
    costs.plan = None
    if costs.probed:  # a probe whose outcome would pay if it held is followed up sooner; else later
        costs.probed = False
        kept = sum(p.state == 1 for p in auto)  # rows whose probe token the target kept
        paid = (len(policies) + kept) / _seconds(model, policies, [1] * len(policies), costs) \
            > len(policies) / _seconds(model, policies, [0] * len(policies), costs)
        grow = 0.5 if paid else 2
        costs.probe_every = max(PROBE_FIRST, min(int(costs.probe_every * grow), PROBE_MAX))
    if K == 0:
        costs.parked += 1
        if costs.parked >= costs.probe_every:  # look again, cheaply (`trim_drafts` ends it)
            K, costs.plan = 1, "probe"
    else:
        costs.steps += 1
        if costs.steps % EXPLORE == 0:
            K = max(1, min(len(rates) - 1, K + (1 if costs.steps // EXPLORE % 2 else -1)))
            costs.plan = "explore"
        elif K < len(rates) - 1 and any(p.curious(K) for p in auto):  # as one row's policy does
            K, costs.plan = K + 1, "explore"
    gain = rates[K] / rates[0]
    return [(min(K, p.k_max), gain) if isinstance(p, AdaptiveK) else (p.k, None) for p in policies]


def plain_next(model, policies: list) -> bool:
    """Whether the batch's next step will be plain if this one is (so it can be queued ahead):
    no row drafts, or drafting is parked with no probe due by then (a plain step leaves the
    rows' states as they are)."""
    auto = [p for p in policies if isinstance(p, AdaptiveK)]
    if not auto:
        return True
    costs = _BATCH.get(model)
    if costs is None or costs.parked + 1 >= costs.probe_every:
        return costs is None
    curves = _offered_curves(policies)
    rates = [expected_rate(model, policies, K, costs, curves)[0] for K in range(max(p.k_max for p in auto) + 1)]
    return max(range(len(rates)), key=rates.__getitem__) == 0


def trim_drafts(model, policies: list, drafts: list, asked: list[int]) -> list[int]:
    """How many of its proposed tokens each row verifies, now that the drafts are known.

    `choose_for_batch` assumed every auto row would propose K tokens; a row whose drafter
    found nothing (or less) adds fewer expected tokens, while the forward still costs
    B rows x (longest draft + 1). The auto rows' drafts are cut to the one length W
    (0: a plain step) maximising sum_i E_i(min(W, len_i)) / T(B x (W + 1)); fixed-k rows keep
    theirs. A probe keeps W >= 1 when some row proposed (else it waits for a step where one
    does); an exploring step keeps its length when drafting pays at all.

    A draft drawn from the drafter's q (`Draft.q`: rejection-sampled) is weighed at the length
    it was `asked` for, not the one it has: a chain can end on its own last token (after a token
    the draft model was unsure of), so a W read from its length would decide whether that token
    is verified from the token itself, which the target's law does not survive. Its length only
    caps the cut (min(W, length) depends on the tokens before each position).
    """
    costs = _costs(model)
    policies = [FixedK(0) if _repeatable(p) else p for p in policies]  # a seeded row's draft: as alone
    sizes = [d.size for d in drafts]
    weighed = [a if d.q is not None else s for a, d, s in zip(asked, drafts, sizes)]
    auto = [s for p, s in zip(policies, weighed) if isinstance(p, AdaptiveK)]
    if not auto:
        return sizes
    cut = lambda W, lengths: [min(W, s) if isinstance(p, AdaptiveK) else s  # noqa: E731
                              for p, s in zip(policies, lengths)]
    rates = [_rate(model, policies, cut(W, weighed), costs) for W in range(max(auto) + 1)]
    W = max(range(len(rates)), key=rates.__getitem__)
    if costs.plan == "probe" and max(auto) > 0:
        W = max(W, 1)
        costs.parked, costs.probed = 0, True
    elif costs.plan == "explore" and W > 0:
        W = max(auto)  # the neighbouring K asked for, as far as the drafts reach
    elif W > 0:  # drafting pays on its merits
        costs.parked, costs.probe_every = 0, PROBE_FIRST
    costs.plan = None  # a probe nobody could answer is asked again next step (still due)
    return cut(W, sizes)


def _repeatable(policy) -> bool:
    """A seeded sampled row's policy: its draft lengths, and with them its random draws, must be
    what they would be alone, whatever else the batch holds."""
    return isinstance(policy, AdaptiveK) and policy.solo


def expected_rate(model, policies: list, K: int, costs: BatchCosts | None = None,
                  curves: list | None = None) -> tuple[float, float]:
    """(expected tokens per second, predicted seconds) of a batch step where auto rows draft K
    (`curves`: the rows' `_offered_curves`, when the caller weighs several K)."""
    ks = [min(K, p.k_max) if isinstance(p, AdaptiveK) else p.k for p in policies]
    seconds = _seconds(model, policies, ks, costs)
    curves = curves or _offered_curves(policies)
    return sum(k + 1 if c is None else c[k] for c, k in zip(curves, ks)) / seconds, seconds


def _offered_curves(policies: list) -> list:
    """Each auto row's expected tokens at k = 0..k_max before the drafts exist, counting its
    drafter's misses (a row that rarely has anything to propose adds little); None: fixed k."""
    return [p.offered_curve() if isinstance(p, AdaptiveK) else None for p in policies]


def _tokens(policies: list, ks: list[int]) -> float:
    """Expected tokens of the rows verifying drafts of `ks` tokens."""
    return sum(p.expected_tokens(k) if isinstance(p, AdaptiveK) else k + 1 for p, k in zip(policies, ks))


def _seconds(model, policies: list, ks: list[int], costs: BatchCosts | None, drafting: bool = True) -> float:
    """Predicted seconds of a batch step with draft lengths `ks` (`drafting`: with the drafters' time)."""
    auto = next(p for p in policies if isinstance(p, AdaptiveK))
    width = 1 + max(ks)
    narrow = auto.costs.verify if len(policies) == 1 else auto.costs.unpadded  # (a lone row's chain is padded)
    seconds = batch_seconds(model, narrow, len(policies), width)
    if drafting:
        seconds += _drafting_seconds(policies, ks)
    # Seeded sampled rows choose from the calibration and the tokens alone (a seeded run repeats).
    timed = costs is not None and all(p.timed for p in policies if isinstance(p, AdaptiveK))
    return seconds * (costs.correction(len(policies), width) if timed else 1.0)


def _drafting_seconds(policies: list, ks: list[int]) -> float:
    """The auto rows' drafting time: k draft forwards a row, except that rows drafting together
    (the same `together` key: forks of one draft model) share one forward per depth, taken to
    cost what one row's does (a few rows more are cheap while reading the weights dominates;
    the online correction takes up the rest)."""
    groups: dict = {}
    for i, (p, k) in enumerate(zip(policies, ks)):
        if isinstance(p, AdaptiveK) and k:
            key = p.together or ("alone", i)
            per, deep = groups.get(key, (0.0, 0))
            groups[key] = (max(per, p.costs.draft_per_token), max(deep, k))
    return sum(per * deep for per, deep in groups.values())


def _rate(model, policies: list, ks: list[int], costs: BatchCosts) -> float:
    """Expected tokens per second of verifying drafts already made (their drafting is spent)."""
    return _tokens(policies, ks) / _seconds(model, policies, ks, costs, drafting=False)


def observe_batch(model, policies: list, ks: list[int], seconds: float) -> None:
    """A batched step with draft lengths `ks` took `seconds`: learn its shape's real cost."""
    if not any(isinstance(p, AdaptiveK) for p in policies):
        return
    costs = _costs(model)
    width = 1 + max(ks)
    costs.observe(len(policies), width, _seconds(model, policies, ks, None), seconds)


def probe_soon(model) -> None:
    """A batch parked on this model probes again soon (a new request starts)."""
    costs = _BATCH.get(model)
    if costs is not None:
        costs.parked, costs.probe_every = 0, PROBE_FIRST

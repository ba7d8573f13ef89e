"""The draft length of a batch: one K for the batch's auto rows, from what B rows x T tokens cost.

A batch's verify forward costs the same for every row up to the longest draft,
so the rows' own policies (`mlx_spec.adaptive.AdaptiveK`: acceptance per position)
are combined into one choice that maximises the batch's expected tokens per
second. The cost of B rows x T tokens is taken from the model's calibrated
curve (a forward over B * T tokens, the matmuls dominating) and corrected
online by what batched steps of each shape really took.
"""

from __future__ import annotations

import logging

from .adaptive import (
    EMA, EXPLORE, AdaptiveK, _CURVES, _read_curve, _write_curve, cache_dir, measure_verify_seconds,
    model_key,
)
from .identity import IdentityMap

log = logging.getLogger("mlx_spec")

WIDE = (17, 24, 34, 48, 68, 96, 136)  # verify widths calibrated for batches (rows x tokens)
PROBE_BATCH = 8  # parked batch steps before a 1-token probe


def wide_verify_seconds(model) -> list[float]:
    """Seconds of forwards over `WIDE` tokens: the cost of a batch's verify, B rows x T tokens,
    is taken to be that of one row of B * T tokens (the matmuls dominate). Cached as the curve."""
    from .distributed import agreed_curve

    key = model_key(model) + ":wide"
    known = _CURVES.get(key) or _read_curve(cache_dir() / f"{key}.json")
    known = known if known is not None and len(known) == len(WIDE) else None

    def measure() -> list[float]:
        log.info("calibrating batched verify costs of this model (once per model and device)")
        every = measure_verify_seconds(model, WIDE[-1], repeats=1)
        return [every[w - 1] for w in WIDE]

    if key in _CURVES:
        return _CURVES[key]
    # A sharded target's ranks measure together and take rank 0's curve. They must all get
    # here at the same step: a sharded server calls this in its warm-up (engine.py), since
    # later calls depend on each rank's own timings.
    times = agreed_curve(model, known, measure)
    if times is not known:
        _write_curve(cache_dir() / f"{key}.json", times)
    _CURVES[key] = times
    return times


def batch_seconds(model, narrow: list[float], rows: int, width: int) -> float:
    """Predicted seconds of one verify forward over `rows` rows of `width` tokens each."""
    w = rows * width
    if w <= len(narrow):
        return narrow[w - 1]
    wide = wide_verify_seconds(model)
    for (w0, t0), (w1, t1) in zip(zip(WIDE, wide), zip(WIDE[1:], wide[1:])):
        if w <= w1:
            return t0 + (t1 - t0) * (w - w0) / (w1 - w0)
    return wide[-1] * w / WIDE[-1]


class BatchCosts:
    """What a model's batched steps cost, learned online: observed over predicted seconds for
    each (rows, tokens per row), an exponential moving average starting at 1."""

    def __init__(self):
        self.ratio: dict[tuple[int, int], float] = {}
        self.parked = 0  # steps parked in a row
        self.steps = 0

    def observe(self, rows: int, width: int, predicted: float, seconds: float) -> None:
        r = self.ratio.get((rows, width))
        self.ratio[(rows, width)] = seconds / predicted if r is None else r + EMA * (seconds / predicted - r)


_BATCH = IdentityMap()  # model -> BatchCosts


def choose_for_batch(model, policies: list) -> list[tuple[int, float | None]]:
    """Draft lengths for a batch verified in one forward, maximising the batch's tokens/s.

    The forward costs the same for every row up to the longest draft, so rows on
    `auto` all draft up to one K (each capped at its own k_max), chosen for
    sum over rows of E_i(k_i) / (T(B rows x (K + 1)) + drafting); fixed-k rows
    keep their k. T comes from the calibrated curve, corrected by what batched
    steps of that shape really cost (`observe_batch`); a neighbouring K is tried
    now and then to measure it. K = 0 decodes plainly, with a 1-token probe now
    and then, so drafting resumes when load drops or text becomes predictable.
    """
    auto = [p for p in policies if isinstance(p, AdaptiveK)]
    fixed = [p.k for p in policies if not isinstance(p, AdaptiveK)]
    if not auto:
        return [(k, None) for k in fixed]
    costs = _BATCH.setdefault(model, BatchCosts)
    rates = [expected_rate(model, policies, K, costs)[0] for K in range(max(p.k_max for p in auto) + 1)]
    K = max(range(len(rates)), key=rates.__getitem__)
    if K == 0:
        costs.parked += 1
        if costs.parked >= PROBE_BATCH:
            costs.parked, K = 0, 1
    else:
        costs.parked, costs.steps = 0, costs.steps + 1
        if costs.steps % EXPLORE == 0:
            K = max(1, min(len(rates) - 1, K + (1 if costs.steps // EXPLORE % 2 else -1)))
    gain = rates[K] / rates[0]
    return [(min(K, p.k_max), gain) if isinstance(p, AdaptiveK) else (p.k, None) for p in policies]


def expected_rate(model, policies: list, K: int, costs: BatchCosts | None = None) -> tuple[float, float]:
    """(expected tokens per second, predicted seconds) of a batch step where auto rows draft K."""
    auto = [p for p in policies if isinstance(p, AdaptiveK)]
    ks = [min(K, p.k_max) if isinstance(p, AdaptiveK) else p.k for p in policies]
    tokens = sum(p.expected_tokens(k) if isinstance(p, AdaptiveK) else k + 1 for p, k in zip(policies, ks))
    width = 1 + max(ks)
    seconds = batch_seconds(model, auto[0].costs.verify, len(policies), width)
    seconds += sum(p.costs.draft_per_token * k for p, k in zip(policies, ks) if isinstance(p, AdaptiveK))
    if costs is not None:
        seconds *= costs.ratio.get((len(policies), width), 1.0)
    return tokens / seconds, seconds


def observe_batch(model, policies: list, ks: list[int], seconds: float) -> None:
    """A batched step with draft lengths `ks` took `seconds`: learn its shape's real cost."""
    if not any(isinstance(p, AdaptiveK) for p in policies):
        return
    costs = _BATCH.setdefault(model, BatchCosts)
    auto = next(p for p in policies if isinstance(p, AdaptiveK))
    width = 1 + max(ks)
    predicted = batch_seconds(model, auto.costs.verify, len(policies), width)
    predicted += sum(p.costs.draft_per_token * k for p, k in zip(policies, ks) if isinstance(p, AdaptiveK))
    costs.observe(len(policies), width, predicted, seconds)

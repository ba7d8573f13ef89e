"""Acceptance rules on literal arrays: greedy prefix matching and rejection sampling."""

import mlx.core as mx
import numpy as np
import pytest

from lossless import wrong_rule
from mlx_spec.acceptance import accept, greedy_accept, rejection_accept
from mlx_spec.sampling import Sampling
from stats_utils import chi2_pvalue


def logits_for(argmaxes, vocab=6):
    out = np.zeros((len(argmaxes), vocab), np.float32)
    out[np.arange(len(argmaxes)), argmaxes] = 5.0
    return mx.array(out)


@pytest.mark.parametrize(
    "target, draft, n",
    [
        ([1, 2, 3, 4], [1, 2, 3], 3),  # all accepted: bonus is the target's 4th
        ([1, 2, 3, 4], [1, 5, 3], 1),  # stops at the first mismatch, even if later ones match
        ([1, 2, 3, 4], [0, 2, 3], 0),
        ([3], [], 0),  # no draft: plain decoding
    ],
)
def test_greedy_accept(target, draft, n):
    got_n, nxt = greedy_accept(logits_for(target), mx.array(draft, mx.uint32))
    assert got_n.item() == n
    assert nxt.item() == target[n]


P = np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.2, 0.4, 0.1, 0.1]], np.float32)
Q = np.array([[0.1, 0.6, 0.1, 0.1, 0.05, 0.05], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]], np.float32)
P_BONUS = np.array([0.2, 0.2, 0.2, 0.2, 0.1, 0.1], np.float32)


def run_rule(rule, trials=6000, point_mass=False, seed=0):
    """First emitted token, and the second one when the first draft was accepted."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    p = mx.array(np.concatenate([P, P_BONUS[None]]))
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(trials):
        if point_mass:  # an n-gram-like drafter always proposes [1, 4]
            d, q = [1, 4], None
        else:
            d = [rng.choice(6, p=Q[0] / Q[0].sum()), rng.choice(6, p=Q[1] / Q[1].sum())]
            q = mx.array(Q)
        n, nxt = rule(p, q, mx.array(d, mx.uint32))
        n, nxt = n.item(), nxt.item()
        emitted = d[:n] + [nxt]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    return first, second


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_reproduces_the_target_distribution(point_mass):
    first, second = run_rule(rejection_accept, point_mass=point_mass)
    assert chi2_pvalue(first, P[0]) > 1e-4
    assert chi2_pvalue(second, P[1]) > 1e-4


def sampler_free_wrong_rule(p, q, d):
    """A plausible-looking but wrong rule: accept d_i with probability p_i(d_i) ignoring q."""
    k = d.shape[0]
    p_d = p[mx.arange(k), d]
    n = mx.cumprod(mx.random.uniform(shape=(k,)) < p_d).sum()
    return n, mx.random.categorical(mx.log(p[n]))


def test_the_statistical_check_has_power_against_a_wrong_rule():
    first, _ = run_rule(sampler_free_wrong_rule)
    assert chi2_pvalue(first, P[0]) < 1e-6


def test_rejection_with_identical_distributions_accepts_everything():
    p = mx.array(np.concatenate([P, P_BONUS[None]]))
    mx.random.seed(3)
    for d in ([0, 3], [5, 1], [2, 2]):
        n, _ = rejection_accept(p, mx.array(P), mx.array(d, mx.uint32))
        assert n.item() == 2


def test_rejection_never_emits_a_zero_probability_token():
    p = mx.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    mx.random.seed(0)
    for _ in range(50):
        n, nxt = rejection_accept(p, None, mx.array([0], mx.uint32))
        assert (n.item(), nxt.item()) == (0, 1)


# ---- edge cases of the rule: a residual with no mass, q(d) = 0, the greedy dispatch ---------


def outcome_counts(rule, p, q, d, trials=3000, seed=0):
    """Counts of (n, token) over `trials` calls of `rule`, as a [k+1, V] array."""
    mx.random.seed(seed)
    p, q, d = mx.array(np.array(p, np.float32)), mx.array(np.array(q, np.float32)), mx.array(d, mx.uint32)
    counts = np.zeros((d.size + 1, p.shape[-1]))
    for _ in range(trials):
        n, t = rule(p, q, d)
        counts[n.item(), t.item()] += 1
    return counts


# Row 1 has p <= q everywhere but p(d1) < q(d1): max(p - q, 0) has no mass (what rounding
# can give when p ~ q, exaggerated). Row 0 always accepts d0 = 1 (p >= q there).
ZERO_MASS = dict(p=[[0.1, 0.6, 0.2, 0.1], [0.1, 0.2, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1]],
                 q=[[0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2]], d=[1, 0])


def zero_mass_law():
    p = np.array(ZERO_MASS["p"])
    law = np.zeros((3, 4))
    law[1] = 0.75 * p[1] / p[1].sum()  # d1 rejected (1 - 0.1 / 0.4): the fallback is p_1
    law[2] = 0.25 * p[2]  # d1 accepted: the bonus from p_2
    return law


@pytest.mark.parametrize("rule,ok", [
    (rejection_accept, True),
    (wrong_rule(fallback="first"), False),  # falls back to p_0
    (wrong_rule(fallback=None), False),  # no fallback: categorical(log 0) silently gives token 0
], ids=["library", "wrong-fallback-row", "no-fallback"])
def test_a_residual_without_mass_falls_back_to_the_targets_row(rule, ok):
    counts = outcome_counts(rule, **ZERO_MASS)
    pvalue = chi2_pvalue(counts.ravel(), zero_mass_law().ravel())
    assert pvalue > 1e-4 if ok else pvalue < 1e-4


# d0 = 2 has q0(d0) = 0 < p0(d0): p / q is infinite, so d0 is always accepted.
# d1 = 3 has q1(d1) = 0 = p1(d1): never accepted, never emitted; the residual is max(p1 - q1, 0).
Q_ZERO = dict(p=[[0.3, 0.3, 0.4, 0.0], [0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]],
              q=[[0.5, 0.5, 0.0, 0.0], [0.2, 0.1, 0.7, 0.0]], d=[2, 3])


@pytest.mark.parametrize("rule,ok", [(rejection_accept, True), (wrong_rule(residual="p"), False)],
                         ids=["library", "residual-from-p"])
def test_a_draft_its_own_q_gives_probability_zero(rule, ok):
    counts = outcome_counts(rule, **Q_ZERO)
    assert counts[0].sum() == counts[2].sum() == 0  # d0 always kept, d1 never
    assert counts[1, 3] == 0  # nor emitted as the correction
    p1, q1 = np.array(Q_ZERO["p"][1]), np.array(Q_ZERO["q"][1])
    residual = np.maximum(p1 - q1, 0) / np.maximum(p1 - q1, 0).sum()  # [0.6, 0.4, 0, 0]
    pvalue = chi2_pvalue(counts[1], residual)
    assert pvalue > 1e-4 if ok else pvalue < 1e-4


def matches_anywhere(logits, draft, q, sampling, length=None):
    """Wrong on purpose: counts every draft that matches the argmax, not the leading run,
    and ignores `length`."""
    target = mx.argmax(logits, axis=-1)
    n = (target[: draft.shape[0]] == draft).sum()
    return n, target[n]


@pytest.mark.parametrize("dispatch,ok", [(accept, True), (matches_anywhere, False)],
                         ids=["library", "matches-anywhere"])
def test_greedy_dispatch_is_argmax_matching_whatever_q_and_the_seed(dispatch, ok):
    logits = logits_for([1, 2, 3, 4])
    q = mx.array(np.full((3, 6), 1 / 6, np.float32))
    want = [(2, 3), (3, 4), (1, 2), (0, 1)]
    for seed in range(5):
        mx.random.seed(seed)
        got = [tuple(int(x.item()) for x in dispatch(logits, mx.array(d, mx.uint32), q, Sampling(), length))
               for d, length in [([1, 2, 0], None), ([1, 2, 3], None), ([1, 2, 3], mx.array(1)),
                                 ([0, 2, 3], None)]]
        assert (got == want) == ok, got

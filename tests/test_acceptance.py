"""Acceptance rules on literal arrays: greedy prefix matching and rejection sampling."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.acceptance import greedy_accept, rejection_accept
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

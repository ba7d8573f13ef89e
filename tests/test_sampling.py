"""The filtered distribution `Sampling.probs` is the one mlx-lm's sampler draws from."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

import np_sampler
from mlx_spec.sampling import Sampling
from stats_utils import chi2_pvalue

LOGITS = mx.array([2.0, 1.5, 1.0, 0.8, 0.5, 0.1, -0.5, -1.0, -2.0, -3.0])


@pytest.mark.parametrize(
    "kw",
    [
        dict(temp=1.0),
        dict(temp=0.7, top_p=0.8),
        dict(temp=1.3, top_k=4),
        dict(temp=0.9, min_p=0.2),
        dict(temp=0.7, top_p=0.9, top_k=5, min_p=0.05),
    ],
)
def test_probs_match_mlx_lm_sampler_statistically(kw):
    s = Sampling(**kw)
    probs = np.array(s.probs(LOGITS[None])[0])
    sampler = make_sampler(**kw)
    logprobs = LOGITS - mx.logsumexp(LOGITS)
    mx.random.seed(1)
    draws = np.array(sampler(mx.broadcast_to(logprobs, (20000, LOGITS.size))))
    counts = np.bincount(draws, minlength=LOGITS.size)
    assert chi2_pvalue(counts, probs) > 1e-4
    # And the filtered-out tokens are never drawn by mlx-lm either.
    assert counts[probs == 0].sum() == 0


REFERENCE_SETTINGS = [
    dict(temp=1.0), dict(temp=0.6), dict(temp=0.8, top_p=0.7), dict(temp=1.3, top_k=3),
    dict(temp=0.9, min_p=0.15), dict(temp=0.7, top_p=0.9, top_k=5, min_p=0.05),
    dict(temp=1.0, top_k=60),  # top_k >= V: no filter
]


def stable_rows(rng, shape, kw, ties=False):
    """float32 logits [..., V] whose rows' filtered supports sit on no threshold."""
    filters = {k: v for k, v in kw.items() if k != "temp"}
    out = np.empty(shape, np.float32)
    for row in out.reshape(-1, shape[-1]):
        while True:
            if ties:
                row[:] = rng.integers(-3, 3, shape[-1]) * 0.7
            else:
                row[:] = rng.standard_normal(shape[-1]) * rng.uniform(0.5, 3.0)
            if np_sampler.support_is_stable(row, **filters):
                break
    return out


def probs_error(probs_fn, kw, seed=0) -> float:
    """Largest |probs_fn - np_sampler.probs| over [k, V] batches, 1-D rows and ties."""
    rng, err = np.random.default_rng(seed), 0.0
    for shape, ties in [((5, 50), False), ((3, 17), False), ((50,), False), ((4, 12), True),
                        ((2, 3, 9), False)]:
        logits = stable_rows(rng, shape, kw, ties)
        got = np.array(probs_fn(mx.array(logits)), np.float64)
        assert got.shape == logits.shape
        err = max(err, float(np.abs(got - np_sampler.probs(logits, **kw)).max()))
    return err


@pytest.mark.parametrize("kw", REFERENCE_SETTINGS, ids=str)
def test_probs_equal_the_numpy_reference_for_batches_and_single_rows(kw):
    # Drafters call probs on [k, V] blocks and on single [V] rows; the verifier on [k+1, V].
    assert probs_error(Sampling(**kw).probs, kw) < 2e-6


def test_the_reference_comparison_catches_tempering_before_filtering():
    kw = dict(temp=0.5, top_p=0.8, min_p=0.1)
    wrong = lambda logits: Sampling(1.0, 0.8, 0, 0.1).probs(logits / 0.5)  # noqa: E731
    assert probs_error(wrong, kw) > 1e-2


def test_probs_sum_to_one_and_filter():
    p = np.array(Sampling(temp=1.0, top_k=3).probs(LOGITS))
    assert abs(p.sum() - 1) < 1e-6
    assert (p > 0).sum() == 3


def test_greedy_sample_is_argmax():
    assert Sampling().sample(LOGITS).item() == 0


@pytest.mark.parametrize(
    "kw", [dict(temp=-1.0), dict(top_p=-0.1), dict(top_p=1.5), dict(top_k=-1), dict(min_p=2.0)]
)
def test_bad_sampling_settings_are_refused(kw):
    with pytest.raises(ValueError):
        Sampling(**kw)

"""The filtered distribution `Sampling.probs` is the one mlx-lm's sampler draws from."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

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

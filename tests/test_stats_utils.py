import numpy as np

from stats_utils import chi2_pvalue, chi2_sf


def test_chi2_sf_matches_known_quantiles():
    # Critical values from standard chi-square tables.
    assert abs(chi2_sf(3.841, 1) - 0.05) < 1e-3
    assert abs(chi2_sf(24.322, 7) - 0.001) < 1e-4
    assert abs(chi2_sf(18.307, 10) - 0.05) < 1e-3
    assert abs(chi2_sf(124.342, 100) - 0.05) < 1e-3


def test_chi2_pvalue_accepts_fair_and_rejects_biased_samples():
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    fair = np.bincount(rng.choice(4, 5000, p=p), minlength=4)
    biased = np.bincount(rng.choice(4, 5000, p=[0.45, 0.35, 0.15, 0.05]), minlength=4)
    assert chi2_pvalue(fair, p) > 1e-3
    assert chi2_pvalue(biased, p) < 1e-6
    assert chi2_pvalue([10, 0, 1], [0.5, 0.5, 0.0]) == 0.0

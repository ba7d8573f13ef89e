"""The NumPy reference sampler (tests/np_sampler.py) draws from what mlx-lm's sampler draws from.

The end-to-end losslessness tests take their exact laws from `np_sampler`, so it
is checked here against mlx-lm's own `make_sampler` by chi-square: many random
logit rows of several widths per setting, each setting's rows pooled into one
statistic, including min-p, every filter at once, `min_tokens_to_keep` and rows
full of ties. The same check rejects a sampler that applies the temperature
before the filters, which shows it has power.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

import np_sampler
from stats_utils import chi2_sf, chi2_stat

DRAWS = 3000  # per row
ROWS = 24
WIDTHS = (5, 8, 17, 40)  # few distinct widths: mlx-lm's compiled filters retrace per shape


def random_rows(rng, settings, ties=False, rows=ROWS):
    """Logit rows of random widths whose filtered support does not sit on a threshold."""
    out = []
    while len(out) < rows:
        V = int(rng.choice(WIDTHS))
        if ties:  # a few distinct values: ties inside and at the edge of every filter
            row = rng.integers(-3, 3, V) * 0.7
        else:
            row = rng.standard_normal(V) * rng.uniform(0.5, 3.0)
        row = row.astype(np.float32)
        if settings.get("top_k", 0) >= V:
            continue  # mlx-lm refuses top_k >= V
        filters = {k: v for k, v in settings.items() if k != "temp"}
        if np_sampler.support_is_stable(row, **filters):
            out.append(row)
    return out


def pooled_pvalue(rows, settings, sample_probs):
    """One chi-square over all rows: mlx-lm's draws against `sample_probs(row)`."""
    sampler = make_sampler(**settings)
    stat, dof = 0.0, 0
    for row in rows:
        lp = mx.array(row) - mx.logsumexp(mx.array(row))
        draws = np.array(sampler(mx.broadcast_to(lp, (DRAWS, row.size))))
        s, d = chi2_stat(np.bincount(draws, minlength=row.size), sample_probs(row))
        if s == np.inf:
            return 0.0  # mlx-lm drew a token the reference gives probability 0
        stat, dof = stat + s, dof + d
    return 1.0 if dof == 0 else chi2_sf(stat, dof)


SETTINGS = {
    "temp1": dict(temp=1.0),
    "temp0.6": dict(temp=0.6),
    "top_p": dict(temp=0.8, top_p=0.7),
    "top_k": dict(temp=1.3, top_k=3),
    "min_p": dict(temp=0.9, min_p=0.15),
    "min_p-keep3": dict(temp=1.0, min_p=0.5, min_tokens_to_keep=3),
    "all": dict(temp=0.7, top_p=0.9, top_k=5, min_p=0.05),
}
TIES = {
    "ties-top_p": dict(temp=1.0, top_p=0.6),
    "ties-top_k": dict(temp=1.0, top_k=4),
    "ties-min_p": dict(temp=0.8, min_p=0.45),
    "ties-min_p-keep3": dict(temp=1.0, min_p=1.0, min_tokens_to_keep=3),
    "ties-all": dict(temp=0.9, top_p=0.8, top_k=3, min_p=0.2),
}


@pytest.mark.parametrize("name", list(SETTINGS) + list(TIES))
def test_np_sampler_draws_what_make_sampler_draws(name):
    settings = {**SETTINGS, **TIES}[name]
    rng = np.random.default_rng(sorted({**SETTINGS, **TIES}).index(name))
    rows = random_rows(rng, settings, ties=name in TIES)
    mx.random.seed(7)
    p = pooled_pvalue(rows, settings, lambda row: np_sampler.probs(row, **settings))
    assert p > 1e-4, p
    # (a draw where np_sampler says 0 makes pooled_pvalue 0)


def temperature_first(row, temp, **filters):
    """Wrong on purpose: the temperature applied before the filters, not after."""
    return np_sampler.probs(np.asarray(row, np.float64) / temp, 1.0, **filters)


def test_the_comparison_catches_a_sampler_that_tempers_first():
    settings = dict(temp=0.5, top_p=0.8)
    rows = random_rows(np.random.default_rng(0), settings)
    mx.random.seed(7)
    assert pooled_pvalue(rows, settings, lambda row: temperature_first(row, **settings)) < 1e-4


def test_filters_on_literal_rows():
    lp = np.log(np.array([0.5, 0.2, 0.2, 0.06, 0.04]))
    keep = lambda **kw: np.isfinite(np_sampler.filtered_logprobs(lp, **kw)).astype(int).tolist()  # noqa: E731
    assert keep(top_p=0.45) == [1, 0, 0, 0, 0]  # 0.5 already reaches 0.45
    assert keep(top_p=0.6) == [1, 1, 1, 0, 0]  # the tie at the edge stays whole
    assert keep(min_p=0.1) == [1, 1, 1, 1, 0]  # 0.04 < 0.1 * 0.5
    assert keep(min_p=1.0, min_tokens_to_keep=2) == [1, 0, 1, 0, 0]  # the tie goes to the higher id
    assert keep(top_k=2) == [1, 1, 0, 0, 0]  # the tie goes to the lower id
    assert keep(top_p=0.9, min_p=0.1, top_k=3) == [1, 1, 1, 0, 0]
    p = np_sampler.probs(lp, temp=2.0, top_k=2)
    np.testing.assert_allclose(p[:2], np.array([0.5, 0.2]) ** 0.5 / (0.5**0.5 + 0.2**0.5))

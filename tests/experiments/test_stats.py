"""The statistical building blocks against independent computations (statsmodels, explicit algebra)."""

import math

import numpy as np
import pytest
import statsmodels.api as sm
from hypothesis import given
from hypothesis import strategies as st

from affdiv.experiments.analysis import stats


def sweep(rng, *, n_seeds=5, batch_sizes=(16, 32, 64, 128, 256), slope=-0.01, seed_sd=0.01, noise_sd=0.005,
          drop=0):
    """Flat arrays (log2 B, metric, seed) of a simulated sweep; ``drop`` random runs removed (unbalanced)."""
    x = np.tile(np.log2(batch_sizes), n_seeds)
    seeds = np.repeat(np.arange(n_seeds), len(batch_sizes))
    y = 0.9 + slope * x + rng.normal(0, seed_sd, n_seeds)[seeds] + rng.normal(0, noise_sd, x.size)
    keep = np.sort(rng.permutation(x.size)[: x.size - drop])
    return x[keep], y[keep], seeds[keep]


# Tolerances: the sandwich and OLS are a handful of float64 operations on O(1) numbers; 1e-10
# relative bounds their rounding error with margin (statsmodels uses pinv, we use lstsq + inv).
@pytest.mark.parametrize("drop", [0, 4])
def test_clustered_slope_matches_statsmodels_cluster_cr1(drop):
    x, y, seeds = sweep(np.random.default_rng(drop), drop=drop)
    ours = stats.clustered_slope(x, y, seeds)
    fit = sm.OLS(y, sm.add_constant(x)).fit(cov_type="cluster", cov_kwds={"groups": seeds}, use_t=True)
    assert ours.estimate == pytest.approx(fit.params[1], rel=1e-10)
    assert ours.se == pytest.approx(fit.bse[1], rel=1e-10)
    assert ours.df == 4  # G - 1
    assert ours.p_two_sided() == pytest.approx(fit.pvalues[1], rel=1e-8)
    low, high = ours.ci(0.95)
    assert (low, high) == pytest.approx(tuple(fit.conf_int(0.05)[1]), rel=1e-9)


def test_clustered_slope_hand_computed_small_example():
    # Two seeds × three batch sizes, x = 0, 1, 2. Seed 0: y = 0, 1, 3; seed 1: y = 1, 1, 2.
    # OLS on all six points: xbar = 1, ybar = 4/3, Sxx = 4,
    # Sxy = sum (x - 1)(y - 4/3) = (-1)(-4/3) + 0 + (1)(5/3) + (-1)(-1/3) + 0 + (1)(2/3) = 4 -> b = 1, a = 1/3.
    # Residuals: seed 0: -1/3, -1/3, 2/3; seed 1: 2/3, -1/3, -1/3.
    # Centred-x scores per seed (slope row of the sandwich): seed 0: (-1)(-1/3) + (1)(2/3) = 1;
    # seed 1: (-1)(2/3) + (1)(-1/3) = -1. Meat = 1 + 1 = 2, bread = 1/Sxx = 1/4:
    # V = c · 2 / 16, c = G/(G-1) · (N-1)/(N-2) = 2 · 5/4 = 5/2  ->  V = 5/16, se = sqrt(5)/4.
    x = np.array([0, 1, 2, 0, 1, 2.0])
    y = np.array([0, 1, 3, 1, 1, 2.0])
    fit = stats.clustered_slope(x, y, [0, 0, 0, 1, 1, 1])
    assert fit.estimate == pytest.approx(1.0, rel=1e-14)
    assert fit.se == pytest.approx(math.sqrt(5) / 4, rel=1e-14)
    assert fit.df == 1


def test_balanced_clustered_se_is_the_per_seed_slope_t_inflated_by_cr1():
    # Balanced design (same x per seed): the OLS slope is the mean of the per-seed slopes and the
    # CR1 variance is var(slopes)/G · (N-1)/(N-2): derived by centring x in each cluster score.
    x, y, seeds = sweep(np.random.default_rng(3))
    slopes = np.array(list(stats.per_cluster_slopes(x, y, seeds).values()))
    fit = stats.clustered_slope(x, y, seeds)
    n = x.size
    assert fit.estimate == pytest.approx(slopes.mean(), rel=1e-12)
    assert fit.se == pytest.approx(slopes.std(ddof=1) / math.sqrt(slopes.size) * math.sqrt((n - 1) / (n - 2)),
                                   rel=1e-12)


@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(0.01, 100), shift=st.floats(-10, 10),
       n_seeds=st.integers(2, 8), n_batches=st.integers(2, 6))
def test_clustered_slope_equivariance_and_label_invariance(seed, scale, shift, n_seeds, n_batches):
    rng = np.random.default_rng(seed)
    x, y, seeds = sweep(rng, n_seeds=n_seeds, batch_sizes=tuple(2 ** np.arange(3, 3 + n_batches)))
    base = stats.clustered_slope(x, y, seeds)
    moved = stats.clustered_slope(x, shift + scale * y, seeds)
    relabelled = stats.clustered_slope(x, y, rng.permutation(n_seeds)[seeds] + 100)
    per_seed_shift = stats.clustered_slope(x, y + rng.normal(0, 1, n_seeds)[seeds], seeds)
    # Rounding of O(10) sums of O(1) numbers, amplified at most by 1/scale: 1e-9 relative is ample.
    assert moved.estimate == pytest.approx(scale * base.estimate, rel=1e-9, abs=1e-12)
    assert moved.se == pytest.approx(scale * base.se, rel=1e-9, abs=1e-12)
    assert (relabelled.estimate, relabelled.se) == pytest.approx((base.estimate, base.se), rel=1e-9, abs=1e-12)
    # Balanced design: a constant per seed changes neither the slope nor its clustered SE.
    assert (per_seed_shift.estimate, per_seed_shift.se) == pytest.approx((base.estimate, base.se), rel=1e-7, abs=1e-10)


def test_holm_hand_computed():
    # Sorted 0.005, 0.01, 0.03, 0.04 -> 4·0.005 = 0.02, 3·0.01 = 0.03, 2·0.03 = 0.06, max(1·0.04, 0.06) = 0.06.
    adjusted = stats.holm([0.01, 0.04, 0.03, 0.005])
    np.testing.assert_allclose(adjusted, [0.03, 0.06, 0.06, 0.02], rtol=1e-15)
    np.testing.assert_allclose(stats.holm([0.5, np.nan, 0.6]), [1.0, np.nan, 1.0])  # m = 2 valid tests
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.holm([0.2, 1.5])


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_holm_matches_its_definition_written_out(p_values):
    # Holm (1979): reject H_(i) iff p_(j) <= alpha / (m - j + 1) for all j <= i; the adjusted p-value
    # is the smallest alpha at which H_(i) is rejected: max over j <= i of min(1, (m - j + 1) p_(j)).
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    expected = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        expected[i] = running
    adjusted = stats.holm(p_values)
    # Ties may be ordered differently, but tied p-values get equal adjusted values either way.
    np.testing.assert_allclose(adjusted, expected, rtol=1e-15)
    assert np.all(adjusted >= np.asarray(p_values)) and np.all(adjusted <= 1.0)


def test_estimate_tests_and_tost():
    est = stats.Estimate(-0.002, 0.001, 4.0)
    from scipy import stats as st_

    assert est.p_less() == pytest.approx(st_.t(4).cdf(-2.0), rel=1e-12)
    assert est.p_greater() == pytest.approx(st_.t(4).sf(-2.0), rel=1e-12)
    assert est.p_two_sided() == pytest.approx(2 * st_.t(4).cdf(-2.0), rel=1e-12)
    # TOST with margin 0.005: max(P(T > 3), P(T < -7)) under t(4).
    assert est.p_equivalent(0.005) == pytest.approx(st_.t(4).sf(3.0), rel=1e-12)
    # TOST rejects at alpha exactly when the 1 - 2 alpha CI lies inside the margin.
    low, high = est.ci(0.90)
    assert (est.p_equivalent(0.005) < 0.05) == (-0.005 < low and high < 0.005)
    noiseless = stats.Estimate(-0.002, 0.0, 4.0)
    assert (noiseless.p_less(), noiseless.p_greater(), noiseless.p_equivalent(0.005)) == (0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="margin"):
        est.p_equivalent(0.0)


def test_page_trend_exact_extreme_and_direction():
    # Every block strictly decreasing in 3 columns: the exact one-sided p is (1/3!)^m, m = 2 blocks.
    table = np.array([[3.0, 2.0, 1.0], [0.3, 0.2, 0.1]])
    page = stats.page_trend(table)
    assert page.p_decreasing == pytest.approx(1 / 36, rel=1e-12)
    assert page.p_increasing == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        stats.page_trend(table[:, :2])


def test_cluster_bootstrap_is_the_ols_slope_of_resampled_seeds():
    x, y, seeds = sweep(np.random.default_rng(11), drop=3)
    slopes = stats.cluster_bootstrap(x, y, seeds, n_boot=300, rng=np.random.default_rng(5))  # > one block of 256
    # The same resamples rebuilt explicitly: whole seeds repeated by their multiplicities, then polyfit.
    # Each resample is 5 seeds drawn uniformly with replacement, as rng.integers draws them.
    draws = np.random.default_rng(5).integers(0, 5, size=(300, 5))
    weights = np.array([np.bincount(row, minlength=5) for row in draws])
    assert slopes.size == 300
    for w, slope in zip(weights, slopes):
        pick = np.concatenate([np.flatnonzero(seeds == s) for s in range(5) for _ in range(w[s])])
        assert slope == pytest.approx(np.polyfit(x[pick], y[pick], 1)[0], rel=1e-9)


def test_cluster_bootstrap_of_identical_seed_slopes_is_degenerate():
    x = np.tile(np.arange(4.0), 3)
    seeds = np.repeat(np.arange(3), 4)
    y = np.array([0.1, 0.5, -0.2])[seeds] - 0.01 * x  # the same slope in every seed
    boot = stats.cluster_bootstrap(x, y, seeds, n_boot=500, rng=np.random.default_rng(0))
    np.testing.assert_allclose(boot, -0.01, rtol=1e-10)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="two distinct values"):
        stats.clustered_slope([3.0, 3.0], [1.0, 2.0], [0, 1])
    with pytest.raises(ValueError, match=">= 2 clusters"):
        stats.clustered_slope([1.0, 2.0], [1.0, 2.0], [0, 0])
    with pytest.raises(ValueError, match="equal length"):
        stats.clustered_slope([1.0, 2.0], [1.0], [0, 1])
    # Two runs in two seeds: CR1's (N-1)/(N-2) would divide by zero.
    with pytest.raises(ValueError, match=">= 3 observations .*got 2 clusters and 2 observations"):
        stats.clustered_slope([1.0, 2.0], [1.0, 2.0], [0, 1])
    with pytest.raises(ValueError, match=">= 2 values"):
        stats.mean_estimate([1.0])


# ------------------------------------------------- statsmodels inside, the hand-written formulas pinned
def _cr1_by_hand(x, y, clusters):
    """The CR1 sandwich written out: V = c (X'X)^-1 (sum_g X_g' u_g u_g' X_g) (X'X)^-1,
    c = G/(G-1) (N-1)/(N-2), X = [1, x]; the slope, its se and the G-1 df."""
    design = np.column_stack([np.ones_like(x), x])
    bread = np.linalg.inv(design.T @ design)
    beta = bread @ design.T @ y
    residuals = y - design @ beta
    labels = np.unique(clusters)
    meat = sum(np.outer(s, s) for s in (design[clusters == g].T @ residuals[clusters == g] for g in labels))
    n, g = x.size, labels.size
    covariance = g / (g - 1) * (n - 1) / (n - 2) * bread @ meat @ bread
    return beta[1], math.sqrt(covariance[1, 1]), g - 1


@pytest.mark.parametrize("seed, drop", [(0, 0), (1, 7), (2, 13)])
def test_clustered_slope_from_statsmodels_equals_the_written_out_cr1(seed, drop):
    x, y, seeds = sweep(np.random.default_rng(seed), n_seeds=9, drop=drop)
    slope, se, df = _cr1_by_hand(x, y, seeds)
    fit = stats.clustered_slope(x, y, seeds)
    # The same sums in a different order (statsmodels: pinv; here inv): rounding only.
    assert fit.estimate == pytest.approx(slope, rel=1e-10)
    assert fit.se == pytest.approx(se, rel=1e-10)
    assert fit.df == df == 8  # statsmodels' df_resid_inference with use_t and clusters: G - 1
    t = slope / se
    assert fit.p_two_sided() == pytest.approx(2 * _st_t_sf(abs(t), df), rel=1e-9)


def _st_t_sf(t, df):
    from scipy import stats as scipy_stats

    return scipy_stats.t.sf(t, df)


def test_a_constant_metric_has_exactly_no_slope():
    x, _, seeds = sweep(np.random.default_rng(0))
    fit = stats.clustered_slope(x, np.full(x.size, 0.7), seeds)
    assert (fit.estimate, fit.se) == (0.0, 0.0) and fit.p_two_sided() == 1.0


def test_overflowing_values_raise_instead_of_returning_a_nan_slope():
    x, _, seeds = sweep(np.random.default_rng(0))
    y = np.where(np.arange(x.size) % 2, 1e308, -1e308)
    y[:3] = 1e308  # an unequal split: the mean's sum overflows
    with pytest.raises(stats.NonFiniteError, match="non-finite arithmetic"):
        stats.clustered_slope(x, y, seeds)
    nan = stats.Estimate(math.nan, math.nan, 4.0)  # no estimate: every p-value NaN, never 0
    assert all(math.isnan(p) for p in (nan.p_less(), nan.p_greater(), nan.p_two_sided(), nan.p_equivalent(0.1)))


# ----------------------------------------------------- large inputs: vectorised = the plain loops
def test_per_cluster_slopes_on_thousands_of_clusters_equal_a_loop_of_fits():
    rng = np.random.default_rng(4)
    x, y, seeds = sweep(rng, n_seeds=3000, drop=4000)
    seeds = np.array([int(s) * 7919 + 2**64 for s in seeds], dtype=object)  # labels beyond uint64, not 0..G-1
    got = stats.per_cluster_slopes(x, y, seeds)
    expected = {}
    for label in np.unique(seeds):
        xs, ys = x[seeds == label], y[seeds == label]
        if np.ptp(xs) > 0:
            expected[label] = np.polyfit(xs, ys, 1)[0]
    assert list(got) == list(expected)  # same seeds, same (sorted) order; single-x seeds left out
    np.testing.assert_allclose(list(got.values()), list(expected.values()), rtol=1e-9, atol=1e-12)


def test_cluster_bootstrap_on_thousands_of_clusters_equals_refitting_the_resamples():
    rng = np.random.default_rng(6)
    x, y, seeds = sweep(rng, n_seeds=2000, drop=1000)
    slopes = stats.cluster_bootstrap(x, y, seeds, n_boot=300, rng=np.random.default_rng(1))
    draws = np.random.default_rng(1).integers(0, 2000, size=(300, 2000))
    by_seed = [np.flatnonzero(seeds == s) for s in range(2000)]
    for row in (0, 255, 256, 299):  # both sides of the 256-resample blocks
        pick = np.concatenate([by_seed[s] for s in draws[row]])
        assert slopes[row] == pytest.approx(np.polyfit(x[pick], y[pick], 1)[0], rel=1e-8)


def test_page_ties_detected_row_by_row_on_a_large_table():
    table = np.random.default_rng(0).normal(size=(5000, 5))
    assert stats.page_trend(table).method != "asymptotic" or table.shape[0] > 0
    tied = table.copy()
    tied[4321, 3] = tied[4321, 1]
    assert stats.page_trend(tied).method == "asymptotic"


def test_jackknife_se_of_the_mean_is_the_standard_error():
    # Leave-one-out means t_(-s) = (n mean - x_s) / (n - 1): the jackknife s.e. is exactly s / sqrt(n).
    x = np.random.default_rng(3).normal(0.9, 0.01, 25)
    replicates = (x.sum() - x) / (x.size - 1)
    assert stats.jackknife_se(replicates) == pytest.approx(x.std(ddof=1) / math.sqrt(x.size), rel=1e-12)


def test_scale_margin_follows_the_metric_and_names_what_to_pass():
    kwargs = dict(accuracy=0.005, fraction=0.01, per="per doubling", name="a margin", argument="margin")
    assert stats.scale_margin([0.2, 0.9], True, **kwargs) == (
        0.005, "0.5 percentage points of accuracy (metric in [0, 1]) per doubling")
    assert stats.scale_margin([0.2, 0.9], True, **{**kwargs, "accuracy": 0.01})[1].startswith("1 percentage point ")
    margin, why = stats.scale_margin([0.2, 0.9], False, **kwargs)  # a loss: 1% of the median
    assert margin == pytest.approx(0.0055) and why == "1% of the median |metric| (0.55) per doubling"
    with pytest.raises(ValueError, match="cannot derive a margin from a metric whose median is 0; pass margin="):
        stats.scale_margin([0.0, 0.0, 3.0], False, **kwargs)


def test_bootstrap_means_drawn_block_by_block_equal_one_draw():
    values = np.random.default_rng(0).normal(size=999)
    whole = values[np.random.default_rng(1).integers(0, values.size, size=(700, values.size))].mean(axis=1)
    np.testing.assert_array_equal(stats.bootstrap_means(values, 700, np.random.default_rng(1), chunk=64), whole)


def test_t_interval_is_the_one_sample_t_interval():
    values = [0.2, 0.6, 0.5, 0.45]
    mean, low, high = stats.t_interval(values, 0.95)
    assert mean == sum(values) / 4
    assert (low, high) == pytest.approx(stats.mean_estimate(values).ci(0.95), rel=1e-15)
    half = 3.182446305284263 * float(np.std(values, ddof=1)) / 2  # t(0.975, 3)·sd/√4
    assert (low, high) == pytest.approx((mean - half, mean + half), rel=1e-14)
    with pytest.raises(ValueError, match="needs >= 2 values, got 1"):
        stats.t_interval([1.0])
    with pytest.raises(ValueError, match="level must be in"):
        stats.t_interval(values, 95)

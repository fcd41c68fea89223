"""Calibration: false-positive rates at a planted slope of 0 are alpha within Monte-Carlo error."""

import numpy as np
import pytest
from scipy.stats import binomtest

from affdiv.experiments.analysis.calibration import (
    Layout,
    calibrate,
    calibrate_for,
    layout_of,
    simulate_records,
    simulate_table,
    verdict_rates,
)
from affdiv.experiments.analysis.decision import analyse

ALPHA = 0.05
N_SIMS = 2000  # Monte-Carlo s.e. of a rate near 0.05: sqrt(0.05 · 0.95 / 2000) = 0.0049


def test_false_positive_rates_are_alpha_within_monte_carlo_error():
    calibration = calibrate([0.0], n_sims=N_SIMS, alpha=ALPHA, tests=("falls", "differential", "page"))
    for test, (rate,) in calibration.rates.items():
        hits = round(rate * N_SIMS)
        # Exact binomial test of "the rejection rate is alpha": a calibrated test fails this with
        # probability 1e-3 (the simulation is seeded, so the outcome is fixed, not flaky). The
        # clustered test is conservative by design — its CR1 factor inflates the s.e. by
        # sqrt((N-1)/(N-2)) = 1.02, so its size is ~0.047 — well inside this bound.
        assert binomtest(hits, N_SIMS, ALPHA).pvalue > 1e-3, (test, rate)
        print(f"false-positive rate {test}: {rate:.4f} ± {calibration.mc_se(rate):.4f}")


def test_tost_size_at_the_margin_and_power_at_zero():
    margin = 0.005
    calibration = calibrate([-margin, 0.0, margin], n_sims=1000, alpha=ALPHA, margin=margin, tests=("flat",))
    for edge in (-margin, margin):
        rate = calibration.rate("flat", edge)
        # At the boundary of H0 the TOST size is at most alpha: one-sided binomial bound.
        assert binomtest(round(rate * 1000), 1000, ALPHA, alternative="greater").pvalue > 1e-3, (edge, rate)
        print(f"TOST rejection rate at slope {edge}: {rate:.3f}")
    assert calibration.rate("flat", 0.0) > 0.95  # noise s.d. 0.5 pp, 5 seeds: flat is concluded
    print(f"TOST power at slope 0: {calibration.rate('flat', 0.0):.3f}")


def test_power_at_the_stated_effect_size():
    # Stated effect: a fall of half a percentage point of accuracy per doubling (= the default
    # margin), in the default layout (5 seeds × B = 16..256, seed s.d. 1 pp, run s.d. 0.5 pp).
    planted = (-0.005, -0.0025, 0.0)
    calibration = calibrate(planted, n_sims=500, alpha=ALPHA, tests=("falls", "differential", "page"))
    for test, rates in calibration.rates.items():
        assert rates[0] >= rates[1] >= rates[2], (test, rates)  # power grows with the effect
        print(f"power of {test} at slope -0.005: {rates[0]:.3f}, at -0.0025: {rates[1]:.3f}")
    assert calibration.rate("falls", -0.005) > 0.9


def test_rates_do_not_depend_on_which_tests_or_slopes_run():
    one = calibrate([0.0], n_sims=50, tests=("falls",))
    more = calibrate([-0.01, 0.0], n_sims=50, tests=("page", "falls", "bootstrap"))
    assert one.rate("falls", 0.0) == more.rate("falls", 0.0)


def test_simulated_sweep_layout_and_bad_layouts():
    rng = np.random.default_rng(0)
    layout = Layout(batch_sizes=(8, 16, 32), n_seeds=3, seed_sd=0.0, noise_sd=0.0, base=0.5)
    table = simulate_table(layout, -0.01, rng)
    np.testing.assert_allclose(table, 0.5 - 0.01 * np.log2([[8, 16, 32]] * 3), rtol=1e-15)
    records = simulate_records(layout, {"affine": 0.0, "norm_l2": -0.01}, rng, lr_rule="linear")
    assert len(records) == 18 and {r["lr_rule"] for r in records} == {"linear"}
    assert analyse(records, margin=0.001).methods["norm_l2"]["slope"] == pytest.approx(-0.01, rel=1e-9)
    with pytest.raises(ValueError, match="3 distinct"):
        Layout(batch_sizes=(8, 16))
    with pytest.raises(ValueError, match="seeds"):
        Layout(n_seeds=1)
    with pytest.raises(ValueError, match="unknown test"):
        calibrate([0.0], n_sims=1, tests=("anova",))


def test_calibration_in_the_layout_of_a_real_sweep():
    layout = Layout(batch_sizes=(8, 32, 128), n_seeds=4, seed_sd=0.02, noise_sd=0.01, base=0.7)
    records = simulate_records(layout, {"affine": 0.0, "norm_l2": -0.01}, np.random.default_rng(3))
    analysis = analyse(records)
    found = layout_of(analysis)
    assert found.batch_sizes == (8, 32, 128) and found.n_seeds == 4
    # REML estimates from 2 methods × 12 runs: within a factor 2 of the planted s.d.s.
    assert 0.5 < found.noise_sd / 0.01 < 2 and found.base == pytest.approx(0.7, abs=0.05)
    calibration = calibrate_for(analysis, n_sims=20, verdict_sims=3)
    assert calibration.planted == tuple(k * 0.005 for k in (-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0))
    assert calibration.layout == found and calibration.alpha == 0.05
    totals = np.sum([rates for rates in calibration.verdicts.values()], axis=0)
    np.testing.assert_allclose(totals, 1.0, rtol=1e-12)  # every simulated study gets exactly one verdict


def test_the_whole_decision_rule_rarely_supports_a_prediction_that_is_false():
    # Slope 0 in every group: "supported" needs a significant fall and significant differentials
    # after Holm over the whole family, so its rate must not exceed alpha (one-sided binomial bound).
    null = verdict_rates([0.0], n_sims=60)
    assert binomtest(round(null["supported"][0] * 60), 60, ALPHA, alternative="greater").pvalue > 1e-3
    assert null["contradicted"][0] > 0.5  # the truth (flat) is mostly recognised as such
    strong = verdict_rates([-0.02], n_sims=20)
    assert strong["supported"][0] == 1.0

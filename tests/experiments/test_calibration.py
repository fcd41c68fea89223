"""Calibration: the slope tests' false-positive rates, and the decision rules' verdict rates in the
layout of a real study (fixed budget and steps to target)."""

import numpy as np
import pytest
from scipy.stats import binomtest

from affdiv.experiments.analysis.calibration import (
    Layout,
    MethodModel,
    StudyLayout,
    calibrate,
    calibrate_for,
    fixed_budget_layout,
    simulate_records,
    simulate_study,
    simulate_table,
    target_layout,
)
from affdiv.experiments.analysis.critical_batch import analyse_target, simulate_target_records
from affdiv.experiments.analysis.decision import analyse

ALPHA = 0.05
N_SIMS = 2000  # Monte-Carlo s.e. of a rate near 0.05: sqrt(0.05 · 0.95 / 2000) = 0.0049


# ------------------------------------------------------------------------ slope tests (descriptive)
def test_false_positive_rates_of_the_slope_tests_are_alpha_within_monte_carlo_error():
    calibration = calibrate([0.0], n_sims=N_SIMS, alpha=ALPHA, tests=("falls", "differential", "page"))
    for test, (rate,) in calibration.rates.items():
        hits = round(rate * N_SIMS)
        # Exact binomial test of "the rejection rate is alpha": a calibrated test fails this with
        # probability 1e-3 (the simulation is seeded, so the outcome is fixed, not flaky).
        assert binomtest(hits, N_SIMS, ALPHA).pvalue > 1e-3, (test, rate)
        print(f"false-positive rate {test}: {rate:.4f} ± {calibration.mc_se(rate):.4f}")


def test_tost_size_at_the_margin_and_power_at_zero():
    # At slope 0 the 'flat' rate is the TOST's power (the truth is flat), not a false positive; its
    # size is read at slope = ±margin, the boundary of its null.
    margin = 0.005
    calibration = calibrate([-margin, 0.0, margin], n_sims=1000, alpha=ALPHA, margin=margin, tests=("flat",))
    for edge in (-margin, margin):
        rate = calibration.rate("flat", edge)
        assert binomtest(round(rate * 1000), 1000, ALPHA, alternative="greater").pvalue > 1e-3, (edge, rate)
    assert calibration.rate("flat", 0.0) > 0.95


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
        calibrate([0.0], n_sims=1, tests=("mixed",))  # the mixed model is gone


# ------------------------------------------------------------------------------- verdict level
def fixed_study(seed=3, effect=0.0):
    methods = {"affine_like": MethodModel("corrected", 0.006, 0.004, 0.001),
               "affine": MethodModel("baseline", 0.004, 0.002, 0.0),
               "batchnorm": MethodModel("baseline", 0.005, 0.0, 0.002)}
    layout = StudyLayout((16, 64, 256, 1024), 8, (-0.004, 0.0, -0.01, -0.035), methods, 0.01, False)
    rows = simulate_study(layout, effect, np.random.default_rng(seed))
    return [{**r, "metric": 0.85 + r["metric"], "budget": "epochs", "lr_rule": "tuned"}
            for rs in rows.values() for r in rs], layout


def test_the_layout_of_a_real_analysis_is_its_own():
    records, planted = fixed_study()
    analysis = analyse(records)
    layout = fixed_budget_layout(analysis)
    assert layout.batch_sizes == (16, 64, 256, 1024) and layout.n_seeds == 8 and layout.test_baselines is False
    assert layout.margin == analysis.settings["contrast_margin"] == 0.01
    assert set(layout.methods) == {"affine_like", "affine", "batchnorm"}
    # Each method keeps its own noise (moments from 8 seeds x 4 batch sizes: within a factor 2).
    for name, model in planted.methods.items():
        assert 0.5 < layout.methods[name].noise_sd / model.noise_sd < 2, name
    # The shape is the baselines' mean curve, its maximum at 0; its curvature is the study's.
    assert np.argmax(layout.shape) == 1 and max(layout.shape) == 0.0
    assert layout.shape[-1] == pytest.approx(-0.035, abs=0.01)


def test_fixed_budget_verdict_calibration_in_the_studys_layout():
    records, _ = fixed_study()
    calibration = calibrate_for(analyse(records), n_sims=40)
    assert calibration.design == "fixed budget"
    assert calibration.effects == (0.0, 0.01, 0.02, 0.03) and calibration.null_effect == 0.0
    totals = np.sum([rates for rates in calibration.joint.values()], axis=0)
    np.testing.assert_allclose(totals, 1.0, rtol=1e-12)  # every simulated study gets exactly one verdict
    assert calibration.joint["supported"][0] <= 0.1 and calibration.joint["supported"][-1] > 0.5
    assert list(calibration.scenarios) and "shared batch-size shocks" in next(iter(calibration.scenarios))
    summary = calibration.to_dict()
    assert summary["layout"]["methods"]["affine_like"]["role"] == "corrected"


def test_target_verdict_calibration_in_the_studys_layout():
    rng = np.random.default_rng(0)
    records = simulate_target_records({"affine_like": (300, 128), "affine": (200, 256), "batchnorm": (150, 512)},
                                      batch_sizes=(16, 64, 256, 1024), seeds=range(6), sigma=0.15, seed_sd=0.05,
                                      max_steps=5000, rng=rng)
    analysis = analyse_target(records, n_boot=0)
    layout = target_layout(analysis)
    assert layout.reference_b_crit == pytest.approx(np.sqrt(analysis.primary["critical_batch"]["affine"]["b_crit"] *
                                                            analysis.primary["critical_batch"]["batchnorm"]["b_crit"]))
    fits = analysis.primary["critical_batch"]
    assert layout.methods["affine_like"].s_min == pytest.approx(fits["affine_like"]["s_min"])
    calibration = calibrate_for(analysis, n_sims=30)
    assert calibration.design == "steps_to_target" and calibration.effects == (1.0, 0.5, 0.25)
    assert calibration.joint["supported"][0] <= 0.15 and calibration.joint["supported"][2] > 0.8
    assert set(calibration.pairs) == {"affine_like vs affine", "affine_like vs batchnorm"}


def test_layouts_without_a_corrected_method_are_refused():
    records, _ = fixed_study()
    analysis = analyse([r for r in records if r["method"] != "affine_like"])
    with pytest.raises(ValueError, match="no corrected method"):
        fixed_budget_layout(analysis)

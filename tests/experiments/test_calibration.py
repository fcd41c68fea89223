"""Calibration: the slope tests' false-positive rates, and the decision rules' verdict rates in the
layout of a real study (fixed budget and steps to target)."""

import numpy as np
import pytest
from scipy.stats import binomtest

from affdiv.experiments.analysis.calibration import (
    TARGET_RATIOS,
    CalibrationOptions,
    Layout,
    MethodModel,
    StudyLayout,
    TargetLayout,
    TargetMethod,
    calibrate,
    calibrate_for,
    fixed_budget_layout,
    simulate_records,
    simulate_study,
    simulate_table,
    simulate_target_study,
    target_calibration,
    target_layout,
)
from affdiv.experiments.analysis.critical_batch import (
    analyse_group,
    analyse_target,
    simulate_target_records,
)
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.vocabulary import RATIO_CLASSES, TARGET_METRIC

#: The fixed-budget analysis by learning-rate rule (its settings otherwise at their defaults).
BY_RULE = AnalysisSettings(group_by="lr_rule")
#: The steps-to-target analysis (its settings otherwise at their defaults).
TARGET = AnalysisSettings(metric=TARGET_METRIC)

ALPHA = 0.05
N_SIMS = 2000  # Monte-Carlo s.e. of a rate near 0.05: sqrt(0.05 · 0.95 / 2000) = 0.0049


# ------------------------------------------------------------------------ slope tests (descriptive)
def test_false_positive_rates_of_the_slope_tests_are_alpha_within_monte_carlo_error():
    calibration = calibrate([0.0], CalibrationOptions(n_sims=N_SIMS, alpha=ALPHA,
                                                   tests=("falls", "differential", "page")))
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
    calibration = calibrate([-margin, 0.0, margin],
                            CalibrationOptions(n_sims=1000, alpha=ALPHA, margin=margin, tests=("flat",)))
    for edge in (-margin, margin):
        rate = calibration.rate("flat", edge)
        assert binomtest(round(rate * 1000), 1000, ALPHA, alternative="greater").pvalue > 1e-3, (edge, rate)
    assert calibration.rate("flat", 0.0) > 0.95


def test_rates_do_not_depend_on_which_tests_or_slopes_run():
    one = calibrate([0.0], CalibrationOptions(n_sims=50, tests=("falls",)))
    more = calibrate([-0.01, 0.0], CalibrationOptions(n_sims=50, tests=("page", "falls", "bootstrap")))
    assert one.rate("falls", 0.0) == more.rate("falls", 0.0)


def test_simulated_sweep_layout_and_bad_layouts():
    rng = np.random.default_rng(0)
    layout = Layout(batch_sizes=(8, 16, 32), n_seeds=3, seed_sd=0.0, noise_sd=0.0, base=0.5)
    table = simulate_table(layout, -0.01, rng)
    np.testing.assert_allclose(table, 0.5 - 0.01 * np.log2([[8, 16, 32]] * 3), rtol=1e-15)
    records = simulate_records(layout, {"affine": 0.0, "norm_l2": -0.01}, rng, lr_rule="linear")
    assert len(records) == 18 and {r["lr_rule"] for r in records} == {"linear"}
    assert analyse(records, BY_RULE.replace(margin=0.001)).methods["norm_l2"]["slope"] == pytest.approx(-0.01, rel=1e-9)
    with pytest.raises(ValueError, match="3 distinct"):
        Layout(batch_sizes=(8, 16))
    with pytest.raises(ValueError, match="seeds"):
        Layout(n_seeds=1)
    with pytest.raises(ValueError, match="unknown test"):
        calibrate([0.0], CalibrationOptions(n_sims=1, tests=("mixed",)))  # the mixed model is gone


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
    analysis = analyse(records, BY_RULE)
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
    calibration = calibrate_for(analyse(records, BY_RULE), n_sims=40)
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
    analysis = analyse_target(records, TARGET.replace(n_boot=0))
    layout = target_layout(analysis)
    assert layout.reference_b_crit == pytest.approx(np.sqrt(analysis.primary["critical_batch"]["affine"]["b_crit"] *
                                                            analysis.primary["critical_batch"]["batchnorm"]["b_crit"]))
    fits = analysis.primary["critical_batch"]
    assert layout.methods["affine_like"].s_min == pytest.approx(fits["affine_like"]["s_min"])
    calibration = calibrate_for(analysis, n_sims=30)
    ratios = analysis.primary["ratios"]["affine_like"]
    measured = {f"affine_like vs {b}": ratios[b]["ratio"] for b in ("affine", "batchnorm")}
    assert calibration.design == "steps_to_target"
    # The planted ratios: the default ones and each pair's measured one, from no effect downwards.
    assert calibration.effects == tuple(sorted({*TARGET_RATIOS, *measured.values()}, reverse=True))
    assert calibration.joint["supported"][0] <= 0.15 and calibration.rate("supported", 0.5) > 0.6
    assert set(calibration.pairs) == set(calibration.classes) == set(measured)
    # Each pair's power at its own measured ratio: the rate of its test at that planted point.
    for pair, ratio in measured.items():
        assert calibration.measured[pair] == {"ratio": ratio,
                                              "power": calibration.pairs[pair][calibration.effects.index(ratio)]}
    summary = calibration.to_dict()
    assert {"effects", "joint", "methods", "pairs", "pair_event", "n_sims", "layout"} <= set(summary)
    assert summary["measured"] == calibration.measured and set(summary["classes"]) == set(measured)


LADDER_LAYOUT = TargetLayout((16, 64, 256, 1024), 6, 20000, {
    "affine_like": TargetMethod("corrected", 200.0, 128.0, 0.15, 0.05),
    "affine": TargetMethod("baseline", 150.0, 128.0, 0.15, 0.05),
    "batchnorm": TargetMethod("baseline", 100.0, 128.0, 0.2, 0.0)}, 128.0)


def test_the_rate_of_every_pair_outcome_at_each_planted_ratio():
    # 600 studies per ratio: Monte-Carlo s.e. of a rate near 0.05 is sqrt(0.05 · 0.95 / 600) = 0.0089.
    n = 600
    calibration = target_calibration(LADDER_LAYOUT, (1.0, 0.707, 0.5), n_sims=n, alpha=ALPHA, seed=5)
    for pair, classes in calibration.classes.items():
        assert set(classes) == set(RATIO_CLASSES)
        totals = np.sum([rates for rates in classes.values()], axis=0)
        np.testing.assert_allclose(totals, 1.0, rtol=1e-12)  # one class per pair and study, at every ratio
        # Under the rule the test comes first: a pair is smaller (either kind) exactly when p < alpha.
        np.testing.assert_allclose(np.add(classes["smaller"], classes["smaller_within_margin"]),
                                   calibration.pairs[pair], rtol=1e-12)
        # Planted ratio 1: calling the pair smaller is a false positive; its rate is at most alpha
        # (exact one-sided binomial test at 1e-3; the run is seeded, so not flaky).
        hits = round((classes["smaller"][0] + classes["smaller_within_margin"][0]) * n)
        assert binomtest(hits, n, ALPHA, alternative="greater").pvalue > 1e-3, (pair, hits / n)
        # ... and a real halving is almost never called equivalent or larger.
        assert classes["equivalent"][2] + classes["larger"][2] < 0.03, pair
        print(pair, {k: [round(v, 3) for v in rates] for k, rates in classes.items()})


def test_precise_studies_tell_a_small_effect_from_one_beyond_the_margin():
    # Nearly noise-free runs: a planted 0.9 lies inside the band [2^-1/2, 2^1/2] and is shown smaller
    # within the margin; a planted 0.5 lies beyond it and is shown smaller.
    layout = TargetLayout(LADDER_LAYOUT.batch_sizes, 4, 20000,
                          {m: TargetMethod(t.role, t.s_min, t.b_crit, 0.01) for m, t in LADDER_LAYOUT.methods.items()},
                          128.0)
    calibration = target_calibration(layout, (0.9, 0.5), n_sims=40, alpha=ALPHA)
    for pair, classes in calibration.classes.items():
        assert classes["smaller_within_margin"][0] > 0.9 and classes["smaller"][1] > 0.9, (pair, classes)


def test_the_calibration_decides_each_study_as_the_analysis_does():
    # Runs censored at small batch sizes and a B_crit near the top of the batch sizes (some fits end on
    # the search range's edge): each simulated study's outcomes from the calibration's shortcut must
    # be those of analyse_group on the same study's records (the same stream: (seed, ratio)).
    layout = TargetLayout((16, 64, 256), 4, 3000, {
        "affine_like": TargetMethod("corrected", 100.0, 400.0, 0.3, 0.1),
        "affine": TargetMethod("baseline", 100.0, 400.0, 0.3, 0.1),
        "batchnorm": TargetMethod("baseline", 80.0, 400.0, 0.4, 0.0)}, 400.0)
    n, seed = 60, 2
    for ratio in (1.0, 0.3):
        calibration = target_calibration(layout, (ratio,), n_sims=n, alpha=ALPHA, seed=seed)
        rng = np.random.default_rng([seed, int(np.float64(ratio).view(np.uint64)), 4])
        joint, classes, censored = {}, {}, 0
        for _ in range(n):
            study = simulate_target_study(layout, ratio, rng)
            censored += any(r["censored"] for r in study)
            result = analyse_group(study, TARGET.replace(corrected=["affine_like"], baselines=["affine", "batchnorm"],
                                                         alpha=ALPHA, n_boot=0, seed=0))
            joint[result["prediction"]["verdict"]] = joint.get(result["prediction"]["verdict"], 0) + 1
            for b, pair in result["ratios"]["affine_like"].items():
                classes.setdefault(f"affine_like vs {b}", {}).setdefault(pair["class"], 0)
                classes[f"affine_like vs {b}"][pair["class"]] += 1
        assert censored > 0
        assert {v: round(r[0] * n) for v, r in calibration.joint.items() if r[0]} == joint, ratio
        assert {p: {k: round(r[0] * n) for k, r in c.items() if r[0]} for p, c in calibration.classes.items()} == \
            classes, ratio
    assert any(c["unclear"][0] > 0 for c in calibration.classes.values())  # the unresolved path was taken


def test_layouts_without_a_corrected_method_are_refused():
    records, _ = fixed_study()
    analysis = analyse([r for r in records if r["method"] != "affine_like"], BY_RULE)
    with pytest.raises(ValueError, match="no corrected method"):
        fixed_budget_layout(analysis)

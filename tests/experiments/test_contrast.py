"""The fixed-budget primary estimand: the cross-fitted largest-minus-best contrast, its difference in
differences, the lack-of-fit test, the noise decomposition and the verdicts, on data with a known truth."""

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from affdiv.experiments.analysis import contrast
from affdiv.experiments.analysis.calibration import MethodModel, StudyLayout, simulate_study, verdict_calibration
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.analysis.settings import AnalysisSettings

#: The fixed-budget analysis by learning-rate rule (its settings otherwise at their defaults).
BY_RULE = AnalysisSettings(group_by="lr_rule")

ALPHA = 0.05
BATCH_SIZES = (16, 32, 64, 128, 256, 512)
# An inverted U in accuracy (peak at B = 64, -3.6 points at 512): the shape that made the slope say
# "contradicted" for a corrected layer that does fall.
INVERTED_U = (-0.012, -0.004, 0.0, -0.008, -0.02, -0.036)


def layout(*, shape=INVERTED_U, noise=0.005, n_seeds=8, test_baselines=True, shock=0.0, seed_slope=0.001):
    methods = {"affine_like": MethodModel("corrected", noise, 0.01, seed_slope),
               "norm_l2": MethodModel("corrected", noise * 1.5, 0.01, seed_slope),
               "affine": MethodModel("baseline", noise, 0.01, seed_slope),
               "batchnorm": MethodModel("baseline", noise, 0.01, seed_slope)}
    return StudyLayout(BATCH_SIZES, n_seeds, tuple(shape), methods, 0.01, test_baselines, shock)


def records(study_layout, effect, seed=0, **columns):
    rows = simulate_study(study_layout, effect, np.random.default_rng(seed))
    return [{**r, "metric": 0.8 + r["metric"], **columns} for rs in rows.values() for r in rs]


def test_cross_fitting_removes_the_selection_bias_of_the_best_batch_size():
    # A flat curve, noise 0.5 points: the in-sample "best" is the luckiest batch size, so the in-sample
    # contrast is negative on average (about -noise * E[max of 6 normals] / sqrt(seeds)); the cross-
    # fitted one is not (its mean error is within 3 Monte-Carlo s.e. of 0) over 300 studies.
    flat = layout(shape=(0.0,) * 6)
    in_sample, crossed = [], []
    for k in range(300):
        rows = [r for r in records(flat, 0.0, seed=k) if r["method"] == "affine"]
        c = contrast.method_contrast(rows, metric="metric", sign=1.0, alpha=ALPHA, margin=0.01)
        in_sample.append(c["in_sample"])
        crossed.append(c["estimate"])
    in_sample, crossed = np.array(in_sample), np.array(crossed)
    se = crossed.std(ddof=1) / math.sqrt(crossed.size)
    print(f"mean contrast on a flat curve: in-sample {in_sample.mean():+.5f}, cross-fitted {crossed.mean():+.5f} "
          f"(s.e. {se:.5f})")
    assert in_sample.mean() < -0.002
    assert abs(crossed.mean()) < 3 * se


def test_planted_inverted_u_with_and_without_the_predicted_fall():
    # Every method shares the inverted U. With no extra fall the corrected layers are "equivalent" to
    # the baselines (contradicted), not supported; with an extra fall of 3 points at B = 512 they are
    # supported, and the estimate of each DiD covers -0.03 (curvature does not bias the contrast).
    clear = layout(noise=0.002)  # clear-cut verdicts; the calibration tests below use realistic noise
    none = analyse(records(clear, 0.0, seed=1), BY_RULE.replace(contrast_margin=0.01))
    assert none.prediction["verdict"] == "contradicted"
    assert {none.methods[m]["verdict"] for m in ("affine_like", "norm_l2")} == {"contradicted"}
    planted = analyse(records(clear, 0.03, seed=2), BY_RULE.replace(contrast_margin=0.01))
    assert planted.prediction["verdict"] == "contradicted"  # the baselines' own fall: stage 2 of the rule
    for m in ("affine_like", "norm_l2"):
        assert planted.methods[m]["verdict"] == "supported", planted.methods[m]["reason"]
        for d in planted.methods[m]["did"].values():
            assert d["ci_low"] < -0.03 < d["ci_high"], d
    for b in ("affine", "batchnorm"):
        assert planted.methods[b]["verdict"] == "contradicted"  # they fall 3.6 points from their peak
    # The slope, for comparison: the baselines' curvature makes it a poor summary.
    assert planted.methods["affine"]["lack_of_fit"]["p"] < 0.001


def test_stage_two_reads_flat_baselines_as_supported():
    # The prediction's world: baselines flat after their peak, corrected layers fall 3 points more.
    peaked = tuple(min(v, 0.0) if i < 2 else 0.0 for i, v in enumerate(INVERTED_U))
    analysis = analyse(records(layout(shape=peaked, noise=0.002), 0.03, seed=3), BY_RULE.replace(contrast_margin=0.01))
    assert analysis.prediction["verdict"] == "supported", analysis.prediction
    assert analysis.prediction["stage2"] == ["supported", "supported"]


def test_an_epoch_budget_does_not_test_the_baselines():
    rows = records(layout(), 0.03, seed=2, budget="epochs")
    analysis = analyse(rows, BY_RULE.replace(contrast_margin=0.01))
    assert analysis.settings["test_baselines"] is False
    assert analysis.methods["affine"]["verdict"] == "not tested"
    assert analysis.prediction["verdict"] == "supported" and analysis.prediction["stage2"] is None
    assert "Baselines: not tested" in analysis.decision_rule
    steps = analyse(records(layout(), 0.03, seed=2, budget="steps"), BY_RULE.replace(contrast_margin=0.01))
    assert steps.settings["test_baselines"] is True


@pytest.mark.parametrize("shape", [(0.0,) * 6, INVERTED_U], ids=["flat", "inverted-U"])
def test_difference_in_differences_size_at_no_effect(shape):
    # 400 simulated studies, every method the same curve (no effect), 8 seeds: each pair's one-sided
    # test of DiD < 0 rejects at most alpha (one-sided exact binomial test at 1e-3, i.e. a rate above
    # ~0.085 fails). The flat curve is the hard case for the selection of the best batch size: the
    # naive one-sample t on the per-seed contrasts rejected 11-12% there (the seeds' selections
    # overlap); the jackknife of the whole estimator is conservative (about 0.02-0.045). The joint
    # verdict's false "supported" rate is below each pair's.
    calibration = verdict_calibration(layout(shape=shape), (0.0,), n_sims=400, alpha=ALPHA, seed=11)
    for pair, (rate,) in calibration.pairs.items():
        print(f"size of the DiD test {pair}: {rate:.4f} +- {calibration.mc_se(rate):.4f}")
        assert binomtest(round(rate * 400), 400, ALPHA, alternative="greater").pvalue > 1e-3, (pair, rate)
    assert calibration.rate("supported", 0.0) <= min(r[0] for r in calibration.pairs.values())


def test_power_grows_with_the_planted_fall():
    calibration = verdict_calibration(layout(), (0.0, 0.01, 0.03), n_sims=60, alpha=ALPHA, seed=5)
    rates = calibration.methods["affine_like"]
    print(f"affine_like supported at 0, 1, 3 margins: {rates}")
    assert rates[0] <= rates[1] <= rates[2] and rates[2] > 0.9


def test_shared_batch_size_shocks_break_the_seed_level_test():
    # One shock per (method, batch size) shared by every seed (a data split shared by the seeds) is
    # invisible to a test whose units are the seeds: at no effect the DiD test rejects well above
    # alpha. With each seed on its own split, the shock is part of each run's noise instead.
    shocked = verdict_calibration(layout(shock=0.01), (0.0,), n_sims=150, alpha=ALPHA, seed=2)
    rate = np.mean([r[0] for r in shocked.pairs.values()])
    print(f"DiD test rejection rate at no effect with shared shocks of s.d. 0.01: {rate:.3f}")
    assert rate > 0.15


def test_lack_of_fit_size_on_straight_lines_and_power_on_curves():
    # Straight line + seed intercepts + seed slopes + noise: the nonlinear contrasts see only the
    # noise, so the F test is exact: rejection rate alpha within binomial error over 500 lines.
    rng = np.random.default_rng(0)
    x = np.log2(BATCH_SIZES)
    hits = 0
    for _ in range(500):
        table = 0.8 - 0.01 * x + rng.normal(0, 0.01, (6, 1)) + rng.normal(0, 0.003, (6, 1)) * (x - x.mean()) \
            + rng.normal(0, 0.005, (6, x.size))
        rows = [{"seed": s, "batch_size": b, "metric": table[s, j]}
                for s in range(6) for j, b in enumerate(BATCH_SIZES)]
        hits += contrast.lack_of_fit(rows, metric="metric")["p"] < ALPHA
    print(f"lack-of-fit size: {hits / 500:.3f}")
    assert binomtest(hits, 500, ALPHA).pvalue > 1e-3
    rows = records(layout(), 0.0, seed=4)
    curved = contrast.lack_of_fit([r for r in rows if r["method"] == "affine"], metric="metric")
    assert curved["p"] < 1e-3 and curved["curvature_sign"].startswith("concave")


def test_noise_decomposition_recovers_the_planted_components():
    # 40 seeds so the moments settle: each s.d. within 25% of the planted value.
    model = MethodModel("baseline", 0.005, 0.01, 0.004)
    big = StudyLayout(BATCH_SIZES, 40, INVERTED_U, {"affine": model, "affine_like": MethodModel("corrected", 0.005)},
                      0.01, True)
    rows = simulate_study(big, 0.0, np.random.default_rng(8))["affine"]
    noise = contrast.noise_components(rows, metric="metric")
    for name, planted in (("noise_sd", 0.005), ("seed_sd", 0.01), ("slope_sd", 0.004)):
        assert noise[name] == pytest.approx(planted, rel=0.25), (name, noise[name])
    np.testing.assert_allclose(noise["cell_means"], INVERTED_U, atol=0.006)


def test_an_lr_on_the_grid_edge_counts_like_a_diverged_run():
    rows = records(layout(), 0.03, seed=2)
    rows = [{**r, "lr_at_grid_edge": int(r["method"] == "affine" and r["batch_size"] == 16 and r["seed"] == 0)}
            for r in rows]
    analysis = analyse(rows, BY_RULE.replace(contrast_margin=0.01))
    assert analysis.methods["affine"]["verdict"] == "inconclusive"
    assert "chose a learning rate on the edge of the grid" in analysis.methods["affine"]["reason"]
    for m in ("affine_like", "norm_l2"):
        assert analysis.methods[m]["verdict"] == "inconclusive"
        assert "baseline affine: 1 of 48 runs chose a learning rate" in analysis.methods[m]["reason"]
    assert analysis.prediction["verdict"] == "inconclusive"


def test_too_few_seeds_for_the_contrast():
    rows = [r for r in records(layout(), 0.03, seed=2) if r["seed"] < 2]
    analysis = analyse(rows, BY_RULE.replace(contrast_margin=0.01))
    for m in ("affine_like", "affine"):
        assert analysis.methods[m]["contrast"]["status"].startswith("insufficient data: needs >= 3 seeds")
    assert analysis.methods["affine_like"]["verdict"] == "inconclusive"


def _replicates_by_refitting(table):
    """The jackknife's definition: the cross-fit redone on the table without each seed in turn."""
    out = []
    for t in range(table.shape[0]):
        d, _ = contrast._cross_fit(np.delete(table, t, axis=0))
        out.append(float(np.mean(d[np.isfinite(d)])) if np.isfinite(d).any() else math.nan)
    return np.array(out)


@pytest.mark.parametrize("kind", ["falls", "flat", "near tie", "accuracies with ties", "missing runs"])
def test_vectorised_jackknife_equals_refitting_without_each_seed(kind):
    # The replicates for every left-out seed at once (most seeds keep their choice; the others get
    # their leave-two-out means exactly) against the definition, on tables that exercise each path:
    # clear choices, flat curves, a near tie between two batch sizes (every seed's choice can flip),
    # accuracies in steps of 1e-4 (exact decimal ties) and seeds that skipped batch sizes.
    # Float64 sums in another order: 1e-13 relative to the O(1) performances bounds the rounding.
    rng = np.random.default_rng(["falls", "flat", "near tie", "accuracies with ties", "missing runs"].index(kind))
    tables = []
    for _ in range(40):
        g, j = int(rng.integers(3, 80)), int(rng.integers(2, 7))  # both sides of _ALL_PAIRS_UP_TO
        table = 0.9 + rng.normal(0, 0.01, (g, 1)) + rng.normal(0, 0.005, (g, j))
        if kind == "falls":
            table -= 0.01 * np.arange(j)
        elif kind == "near tie":
            table[:, :2] += 0.02  # the best two, 1e-6 apart
            table[:, 1] += table[:, 0].mean() - table[:, 1].mean() + 1e-6
        elif kind == "accuracies with ties":
            table = np.round(table, 4)
        elif kind == "missing runs":
            table[rng.random((g, j)) < 0.3] = np.nan
        tables.append(table)
    for table in tables:
        d, _ = contrast._cross_fit(table)
        np.testing.assert_allclose(contrast._jackknife_replicates(table, d), _replicates_by_refitting(table),
                                   rtol=0, atol=1e-13)


def test_vectorised_jackknife_on_thousands_of_seeds_near_a_tie():
    # The best two batch sizes' means differ by 1e-5 over 2000 seeds: every seed's choice can flip,
    # so all of them take the blockwise leave-two-out path; it must still equal the definition.
    rng = np.random.default_rng(5)
    table = 0.9 + rng.normal(0, 0.01, (2000, 1)) + rng.normal(0, 0.005, (2000, 4))
    table[:, 1:3] += 0.01
    table[:, 2] += table[:, 1].mean() - table[:, 2].mean() + 1e-5
    d, _ = contrast._cross_fit(table)
    np.testing.assert_allclose(contrast._jackknife_replicates(table, d), _replicates_by_refitting(table),
                               rtol=0, atol=1e-13)


def test_batch_sizes_tied_in_decimal_choose_the_smaller():
    # Seeds 0 and 1 average 0.85365 at both B = 32 and B = 64 (0.8551 + 0.8522 = 0.8534 + 0.8539); in
    # binary the B = 64 mean rounds one unit higher, and a plain argmax picked it. The rule says the
    # smaller batch size, whatever the rounding.
    table = np.array([[0.849, 0.8551, 0.8534, 0.8461],
                      [0.854, 0.8522, 0.8539, 0.8513],
                      [0.8448, 0.8489, 0.8429, 0.8459]])
    rows = [{"seed": s, "batch_size": b, "metric": table[s, j]}
            for s in range(3) for j, b in enumerate((16, 32, 64, 128))]
    result = contrast.method_contrast(rows, metric="metric", sign=1.0, alpha=ALPHA, margin=0.01)
    assert result["chosen"]["2"] == 32
    assert result["per_seed"]["2"] == pytest.approx(0.8459 - 0.8489, abs=1e-15)

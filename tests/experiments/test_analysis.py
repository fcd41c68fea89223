"""The decision logic on data whose answer is known, the CSV reader, and bad input."""

import json
import random

import numpy as np
import pytest

from affdiv.experiments.analysis.calibration import Layout, simulate_records
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.experiments.records import read_csv, write_csv

#: The fixed-budget analysis by learning-rate rule (its settings otherwise at their defaults).
BY_RULE = AnalysisSettings(group_by="lr_rule")

# Slopes per doubling of B in accuracy units; 8 seeds, seed s.d. 1 pp, run s.d. 0.3 pp: the s.e. of a
# slope is ~0.3 pp / sqrt(10 · 8) ~ 3.4e-4, so a planted -2 pp per doubling has t ~ 60 and a flat
# method's TOST (margin 0.5 pp) clears even a 32-test Holm family (t quantile ~4) with room to spare.
LAYOUT = Layout(n_seeds=8, noise_sd=0.003, base=0.75)  # accuracies stay inside [0, 1]
STRONG = -0.02


def records_with(slopes, *, rules=("linear", "sqrt"), seed=0, layout=LAYOUT):
    rng = np.random.default_rng(seed)
    return [r for rule in rules for r in simulate_records(layout, slopes, rng, lr_rule=rule)]


def verdicts(analysis):
    return {(g, m): r["verdict"] for g, c in analysis.groups.items() for m, r in c["methods"].items()}


def test_planted_prediction_is_supported_in_every_group():
    analysis = analyse(records_with({"affine_like": STRONG, "norm_l2": STRONG, "affine": 0.0, "batchnorm": 0.0,
                                     "layernorm": STRONG}), BY_RULE)
    assert set(analysis.groups) == {"linear", "sqrt"}
    for (group, method), verdict in verdicts(analysis).items():
        assert verdict == ("no prediction" if method == "layernorm" else "supported"), (group, method)
    for method in ("affine", "batchnorm"):
        assert analysis.methods[method]["trend"] == "flat"  # TOST concludes flat, not just "not significant"
    assert analysis.methods["layernorm"]["trend"] == "falls"
    assert analysis.overall == {"affine_like": "supported", "norm_l2": "supported", "affine": "supported",
                                "batchnorm": "supported", "layernorm": "no prediction"}


def test_flat_corrected_layer_and_falling_baseline_contradict():
    analysis = analyse(records_with({"affine_like": 0.0, "norm_l2": -STRONG, "affine": STRONG, "batchnorm": 0.0}),
                       BY_RULE)
    assert analysis.methods["affine_like"]["trend"] == "flat"
    assert analysis.methods["affine_like"]["verdict"] == "contradicted"
    assert analysis.methods["norm_l2"]["trend"] == "rises"
    assert analysis.methods["norm_l2"]["verdict"] == "contradicted"
    assert analysis.methods["affine"]["verdict"] == "contradicted"
    assert analysis.methods["batchnorm"]["verdict"] == "supported"


def test_corrected_falling_no_faster_than_a_baseline_is_contradicted():
    # affine_like falls, but exactly as much as affine: the DiD against affine is equivalent to 0
    # (TOST within the contrast margin), so the layer does not fall *because* it is corrected.
    analysis = analyse(records_with({"affine_like": STRONG, "affine": STRONG, "batchnorm": 0.0}), BY_RULE)
    result = analysis.methods["affine_like"]
    assert result["trend"] == "falls" and result["verdict"] == "contradicted"
    assert result["did"]["affine"]["class"] == "equivalent" and result["did"]["batchnorm"]["class"] == "falls faster"
    assert "vs affine: equivalent" in result["reason"]
    assert result["differential"]["batchnorm"]["test"]["p_holm"] < 0.05
    assert result["differential"]["affine"]["test"]["p_holm"] > 0.05


def test_without_baselines_a_fall_cannot_support_the_comparative_prediction():
    analysis = analyse(records_with({"norm_l2": STRONG}, rules=("constant",)), BY_RULE)
    assert analysis.methods["norm_l2"]["verdict"] == "inconclusive"
    assert "no baseline" in analysis.methods["norm_l2"]["reason"]


def test_noise_only_data_gives_no_directional_claim():
    noisy = Layout(seed_sd=0.05, noise_sd=0.05, base=0.5)
    analysis = analyse(records_with({"affine_like": 0.0, "affine": 0.0}, layout=noisy, seed=4), BY_RULE)
    for result in analysis.methods.values():
        assert result["trend"] == "unclear" and result["verdict"] == "inconclusive"


def test_a_loss_that_rises_is_a_performance_that_falls():
    rows = records_with({"affine_like": -STRONG, "affine": 0.0}, rules=("linear",))
    analysis = analyse(rows, BY_RULE.replace(higher_is_better=False, margin=0.005))
    assert analysis.methods["affine_like"]["slope"] > 0
    assert analysis.methods["affine_like"]["verdict"] == "supported"
    assert analysis.methods["affine"]["verdict"] == "supported"


def test_holm_adjusts_over_the_prediction_family_only():
    analysis = analyse(records_with({"affine_like": STRONG, "affine": 0.0, "layernorm": 0.0}), BY_RULE)
    # prediction family: 2 groups × (affine_like: 3 tests + 1 differential, affine: 3 tests) = 14.
    assert analysis.family_sizes == {"prediction": 14, "exploratory": 6}
    for content in analysis.groups.values():
        for result in content["methods"].values():
            for test in result["tests"].values():
                assert test["p"] <= test["p_holm"] <= 1.0


def test_summary_is_json_with_the_documented_keys_and_deterministic():
    rows = records_with({"affine_like": STRONG, "norm_l2": -0.004, "affine": 0.0, "batchnorm": 0.001, "rmsnorm": 0.0})
    summary = analyse(rows, BY_RULE).to_dict()
    text = json.dumps(summary, allow_nan=False)
    assert summary["schema_version"] == 2 and summary["primary_group"] == "linear"
    assert summary["decision_rule"].startswith("Performance P is")
    # One verdict per level: the study's (joint, primary group), per method across groups, per group.
    assert summary["prediction"]["verdict"] == summary["groups"]["linear"]["prediction"]["verdict"]
    assert summary["prediction"]["group"] == "linear"
    for name, method in summary["methods"].items():
        assert set(method) == {"role", "verdict", "groups"}, name  # no numbers of one group posing as the method's
        assert method["verdict"] == summary["overall"][name]
        assert method["groups"] == {g: c["methods"][name]["verdict"] for g, c in summary["groups"].items()}
    for group in summary["groups"].values():
        for name, method in group["methods"].items():
            assert {"slope", "ci_low", "ci_high", "p_value", "verdict", "contrast"} <= set(method), name
            assert method["ci_low"] < method["slope"] < method["ci_high"]
            c = method["contrast"]
            assert c["ci_low"] < c["estimate"] < c["ci_high"]
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)  # a resumed sweep may hand the records over in another order
    assert json.dumps(analyse(shuffled, BY_RULE).to_dict(), allow_nan=False) == text
    assert analyse(rows, BY_RULE.replace(primary_group="sqrt")).to_dict()["primary_group"] == "sqrt"


def test_unbalanced_and_insufficient_data():
    rows = records_with({"affine_like": STRONG, "affine": 0.0}, rules=("linear",))
    rows = [r for r in rows if not (r["method"] == "affine_like" and r["seed"] == 0 and r["batch_size"] == 64)]
    rows.append({"method": "batchnorm", "batch_size": 32, "seed": 0, "metric": 0.9, "lr_rule": "linear"})
    analysis = analyse(rows, BY_RULE)
    assert analysis.methods["affine_like"]["n_runs"] == 39  # 8 seeds × 5 batch sizes - 1
    assert analysis.methods["affine_like"]["page"]["n_blocks"] == 7  # Page's L uses complete seeds only
    assert analysis.methods["batchnorm"]["status"].startswith("insufficient data")
    assert analysis.methods["batchnorm"]["verdict"] == "inconclusive"
    assert analysis.methods["affine_like"]["differential"]["batchnorm"]["status"].startswith("insufficient data")


def test_without_a_group_column_everything_is_one_group():
    rows = [{k: v for k, v in r.items() if k != "lr_rule"} for r in records_with({"affine": 0.0}, rules=("x",))]
    analysis = analyse(rows, BY_RULE)
    assert list(analysis.groups) == ["all"] and analysis.settings["group_by"] is None


@pytest.mark.parametrize("mutate, message", [
    (lambda rows: rows + [dict(rows[0])], "a second run"),
    (lambda rows: rows[:-1] + [{**rows[-1], "lr_rule": ""}], "no value for the group column"),
    (lambda rows: rows + [{**rows[0], "seed": 99, "batch_size": -4}], "batch_size must be > 0"),
    (lambda rows: rows + [{**rows[0], "seed": 99, "metric": float("nan")}], "finite number"),
])
def test_bad_records_are_named(mutate, message):
    rows = records_with({"affine": 0.0}, rules=("linear",))
    with pytest.raises(ValueError, match=message):
        analyse(mutate(rows), BY_RULE)


def test_bad_settings_are_named():
    rows = records_with({"affine": 0.0}, rules=("linear",))
    with pytest.raises(ValueError, match="both corrected and baseline"):
        analyse(rows, BY_RULE.replace(corrected=("affine",)))
    with pytest.raises(ValueError, match="alpha"):
        analyse(rows, BY_RULE.replace(alpha=0.7))
    with pytest.raises(ValueError, match="margin"):
        analyse(rows, BY_RULE.replace(margin=-1.0))
    with pytest.raises(ValueError, match="primary_group"):
        analyse(rows, BY_RULE.replace(primary_group="tuned"))


def test_default_margin_follows_the_metric_scale():
    rows = records_with({"affine": 0.0}, rules=("linear",))
    assert analyse(rows, BY_RULE).settings["margin"] == 0.005
    for scaled in ([{**r, "metric": 100 * r["metric"]} for r in rows],  # a percentage
                   [{**r, "metric": 2.0 + r["metric"]} for r in rows]):  # a loss
        median = np.median([r["metric"] for r in scaled])
        lower = BY_RULE.replace(higher_is_better=False)
        assert analyse(scaled, lower).settings["margin"] == pytest.approx(0.01 * median, rel=1e-15)
        assert analyse(scaled, BY_RULE.replace(margin=0.25)).settings["margin_source"] == "given"


def test_csv_round_trip_is_exact(tmp_path):
    rows = records_with({"affine_like": STRONG, "affine": 0.0})
    path = write_csv(tmp_path / "runs.csv", rows)
    back = read_csv(path)
    assert back == rows  # floats written with repr come back bit for bit; lr_rule stays text
    assert json.dumps(analyse(back, BY_RULE).to_dict()) == json.dumps(analyse(rows, BY_RULE).to_dict())


@pytest.mark.parametrize("text, message", [
    ("method,batch_size,metric\naffine,16,0.9\n", r"missing column\(s\) \['seed'\]"),
    ("method,batch_size,seed,metric\n", "no data rows"),
    ("method,batch_size,seed,metric\naffine,sixteen,0,0.9\n",
     "line 2: column 'batch_size' must be an integer, got 'sixteen'"),
    ("method,batch_size,seed,metric\naffine,16,0,0.9\naffine,0,1,0.9\n", "line 3: batch_size must be > 0"),
    ("method,batch_size,seed,metric\naffine,16,1.5,0.9\n", "column 'seed' must be an integer, got '1.5'"),
    ("method,batch_size,seed,metric\naffine,16,0,inf\n", "column 'metric' must be a finite number, got 'inf'"),
    ("method,batch_size,seed,metric\naffine,16,0,\n", r"missing value for column\(s\) \['metric'\]"),
])
def test_bad_csv_is_named(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_csv(path)


def test_csv_with_another_metric_column(tmp_path):
    path = tmp_path / "loss.csv"
    path.write_text("method,batch_size,seed,test_loss,lr_rule\naffine,16,0,0.31,sqrt\naffine,32,0,0.30,sqrt\n")
    assert read_csv(path, metric="test_loss")[1] == {"method": "affine", "batch_size": 32, "seed": 0,
                                                     "test_loss": 0.30, "lr_rule": "sqrt"}


def test_sensitivity_analyses_do_not_change_the_verdicts():
    rows = records_with({"affine_like": STRONG, "affine": 0.0, "layernorm": 0.0}, rules=("linear",))
    full, lean = analyse(rows, BY_RULE), analyse(rows, BY_RULE.replace(sensitivity=False))
    assert {m: r["verdict"] for m, r in full.methods.items()} == {m: r["verdict"] for m, r in lean.methods.items()}
    assert "page" in full.methods["affine"] and "page" not in lean.methods["affine"]
    assert "mixed" not in full.methods["affine"]  # no mixed model: the contrasts decide
    assert full.methods["affine"]["tests"] == lean.methods["affine"]["tests"]


def plant_divergence(rows, method, batch_sizes, chance=0.1):
    """Runs of ``method`` at ``batch_sizes`` diverged: metric at chance, diverged = 1 (as the harness records)."""
    out = []
    for r in rows:
        hit = r["method"] == method and r["batch_size"] in batch_sizes
        out.append({**r, "metric": chance if hit else r["metric"], "diverged": int(hit)})
    return out


def test_divergence_cannot_drive_a_verdict():
    # affine_like is truly flat; its runs at the two largest batch sizes diverge (as under lr_rule=linear).
    rows = records_with({"affine_like": 0.0, "affine": 0.0, "batchnorm": 0.0}, rules=("linear",))
    planted = plant_divergence(rows, "affine_like", {128, 256})
    # Without the diverged flag the chance-level runs look like a steep fall and the prediction "holds":
    # exactly what the rule must prevent.
    blind = analyse([{k: v for k, v in r.items() if k != "diverged"} for r in planted], BY_RULE)
    assert blind.methods["affine_like"]["verdict"] == "supported"

    analysis = analyse(planted, BY_RULE)
    result = analysis.methods["affine_like"]
    assert result["n_diverged"] == 16 and result["diverged_batch_sizes"] == [128, 256]  # 8 seeds × 2 sizes
    assert result["status"] == "ok" and result["trend"] == "falls" and result["slope"] < 0  # still reported
    assert result["verdict"] == "inconclusive"
    assert result["reason"].startswith("16 of 40 runs diverged (batch sizes 128, 256)")
    assert analysis.overall["affine_like"] == "inconclusive"
    assert analysis.methods["affine"]["verdict"] == "supported" and analysis.methods["affine"]["n_diverged"] == 0
    assert "diverged run in a group is inconclusive" in analysis.decision_rule


def test_a_diverged_baseline_makes_the_comparison_inconclusive(tmp_path):
    rows = records_with({"affine_like": STRONG, "affine": 0.0, "batchnorm": 0.0}, rules=("linear",))
    planted = plant_divergence(rows, "batchnorm", {256})
    path = write_csv(tmp_path / "records.csv", planted)
    analysis = analyse(read_csv(path), BY_RULE)  # the flag survives the CSV round trip (as text "0"/"1")
    assert analysis.methods["batchnorm"]["verdict"] == "inconclusive"
    assert analysis.methods["affine_like"]["verdict"] == "inconclusive"
    assert "baseline batchnorm: 8 of 40 runs diverged (batch sizes 256)" in analysis.methods["affine_like"]["reason"]
    assert analysis.methods["affine"]["verdict"] == "supported"
    with pytest.raises(ValueError, match="record 1: column 'diverged' must be 0 or 1, got 2"):
        analyse([{**planted[0], "diverged": 2}, *planted[1:]], BY_RULE)


def test_two_runs_are_too_few_for_a_clustered_slope():
    rows = [{"method": "affine", "batch_size": b, "seed": s, "metric": m}
            for b, s, m in [(32, 0, 0.9), (64, 1, 0.8)]]
    assert analyse(rows, BY_RULE).methods["affine"]["status"] == ("insufficient data: needs >= 2 batch sizes, >= 2 "
                                                                  "seeds and >= 3 runs, got 2, 2 and 2")

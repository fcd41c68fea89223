"""One analysis shape for both designs: the settings (defaults and checks defined once), the
registry of the designs, the shape their results share, and the refusals between them."""

import csv
import dataclasses

import numpy as np
import pytest

from affdiv.cli import main
from affdiv.experiments.analysis import calibration, critical_batch, decision
from affdiv.experiments.analysis.calibration import CalibrationOptions, Layout, calibrate, simulate_records
from affdiv.experiments.analysis.design import StudyAnalysis, analyse_study, design_of, designs, joint, overall
from affdiv.experiments.analysis.settings import FIXED_BUDGET_ONLY, AnalysisSettings
from affdiv.vocabulary import FIXED_BUDGET, STEPS_TO_TARGET, TARGET_METRIC


def fixed_records():
    return simulate_records(Layout(n_seeds=4, noise_sd=0.003, base=0.75),
                            {"affine_like": -0.02, "affine": 0.0}, np.random.default_rng(0), lr_rule="sqrt")


def target_records(seeds=4):
    return critical_batch.simulate_target_records({"affine_like": (200, 100), "affine": (200, 400)},
                                                  batch_sizes=(16, 64, 256, 1024), seeds=range(seeds), sigma=0.1,
                                                  max_steps=10**5, rng=np.random.default_rng(0))


def test_the_defaults_are_defined_once_and_every_key_has_one():
    default = AnalysisSettings()
    assert AnalysisSettings.from_mapping({}) == default
    assert default.design == FIXED_BUDGET and default.given() == []
    assert AnalysisSettings(metric=TARGET_METRIC).design == STEPS_TO_TARGET
    assert set(FIXED_BUDGET_ONLY) <= set(AnalysisSettings.keys())
    table = {"metric": "test_accuracy", "corrected": ["norm_l2"], "baselines": ["affine"], "margin": 0.01,
             "n_boot": 500, "primary_target": 0.84, "test_baselines": False}
    settings = AnalysisSettings.from_mapping(table)
    assert settings.corrected == ("norm_l2",) and settings.n_boot == 500  # lists become tuples: hashable
    assert sorted(settings.given()) == sorted(table)
    assert settings.replace(alpha=0.01).alpha == 0.01 and settings.alpha == 0.05  # frozen: replace copies
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.alpha = 0.1


@pytest.mark.parametrize("table, message", [
    ({"margins": 0.01}, "preset: unknown setting(s) ['margins']; expected among ['metric', "),
    ({"alpha": 0.5}, "preset: alpha must lie in (0, 0.5), got 0.5"),
    ({"margin": 0.0}, "preset: margin must be a finite number > 0, got 0.0"),
    ({"contrast_margin": float("inf")}, "preset: contrast_margin must be a finite number > 0, got inf"),
    ({"sensitivity": "yes"}, "preset: sensitivity must be true or false (a TOML boolean, unquoted), got 'yes'"),
    ({"group_by": ""}, "preset: group_by must be a non-empty name (a string), got ''"),
    ({"n_boot": 50}, "preset: n_boot (draws of a percentile CI) must be 0 (no bootstrap) or >= 100, got 50"),
    ({"seed": -1}, "preset: seed (of the bootstrap) must be an integer >= 0, got -1"),
    ({"corrected": "norm_l2"}, "preset: corrected must be a list of method names, got 'norm_l2'"),
    ({"corrected": ["affine"]}, "preset: a method cannot be both corrected and baseline: ['affine']"),
    ({"primary_target": 1.5}, "preset: primary_target must be a validation accuracy in (0, 1], got 1.5"),
])
def test_bad_settings_are_one_line_naming_the_key(table, message):
    with pytest.raises(ValueError) as error:
        AnalysisSettings.from_mapping(table, where="preset")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    if set(table) <= set(AnalysisSettings.keys()):
        with pytest.raises(ValueError):  # the constructor and replace check the same
            AnalysisSettings().replace(**table)


def test_names_of_the_roles_are_checked_against_the_methods():
    with pytest.raises(ValueError, match=r"^x: baselines: unknown method\(s\) \['afine'\]; the methods are"):
        AnalysisSettings.from_mapping({"baselines": ["afine"]}, methods=["affine", "norm_l2"], where="x")
    AnalysisSettings.from_mapping({"baselines": ["affine"]}, methods=["affine", "norm_l2"], where="x")


def test_both_results_have_the_shape_of_a_study_analysis():
    fixed = decision.analyse(fixed_records(), AnalysisSettings(group_by="lr_rule"))
    target = critical_batch.analyse_target(target_records(), AnalysisSettings(metric=TARGET_METRIC, n_boot=0))
    for analysis, design in ((fixed, FIXED_BUDGET), (target, STEPS_TO_TARGET)):
        assert isinstance(analysis, StudyAnalysis)
        assert analysis.design == design and analysis.to_dict()["design"] == design
        assert analysis.prediction == analysis.groups[analysis.primary_group]["prediction"]
        assert analysis.to_dict()["prediction"]["verdict"] == analysis.prediction["verdict"]
    assert fixed.primary_target is None


def test_the_registry_maps_each_design_to_its_functions():
    assert set(designs()) == {FIXED_BUDGET, STEPS_TO_TARGET}
    assert design_of(FIXED_BUDGET).analyse is decision.analyse
    assert design_of(STEPS_TO_TARGET).analyse is critical_batch.analyse_target
    assert design_of(STEPS_TO_TARGET).calibrate is calibration.calibrate_target
    with pytest.raises(ValueError, match="design must be one of"):
        design_of("fixed")
    settings = AnalysisSettings(metric=TARGET_METRIC, n_boot=0)
    assert analyse_study(target_records(), settings).to_dict() == \
        critical_batch.analyse_target(target_records(), settings).to_dict()


def test_each_design_refuses_the_others_settings():
    with pytest.raises(ValueError, match="analyse it with critical_batch.analyse_target"):
        decision.analyse(target_records(), AnalysisSettings(metric=TARGET_METRIC))
    with pytest.raises(ValueError, match="analyse it with decision.analyse"):
        critical_batch.analyse_target(fixed_records(), AnalysisSettings())
    with pytest.raises(ValueError, match=r"n_boot .* must be >= 100 for a fixed budget, got 0"):
        decision.analyse(fixed_records(), AnalysisSettings(n_boot=0))
    # with the metric known, the settings refuse it themselves (a preset's, before any run trains)
    with pytest.raises(ValueError,
                       match=r"^n_boot .* must be >= 100 for a fixed budget \(metric 'test_accuracy'\), got 0$"):
        AnalysisSettings(metric="test_accuracy", n_boot=0)
    AnalysisSettings(metric=TARGET_METRIC, n_boot=0)  # steps to a target: no bootstrap is allowed


def test_the_verdict_across_groups_is_one_rule_for_both_designs():
    assert overall(["reference", "reference"]) == "reference"
    assert overall(["no prediction"]) == "no prediction"
    assert overall(["supported", "inconclusive"]) == "inconclusive"
    assert overall(["supported", "contradicted"]) == joint(["supported", "contradicted"]) == "mixed"
    assert overall(["inconclusive", "contradicted"]) == "contradicted"
    assert joint([]) == "inconclusive"


def test_the_default_primary_group_of_steps_to_target_counts_each_groups_seeds():
    records = [{**r, "lr_rule": "linear"} for r in target_records(seeds=6)]
    records += [{**r, "lr_rule": "tuned"} for r in target_records(seeds=4)]
    analysis = critical_batch.analyse_target(records, AnalysisSettings(metric=TARGET_METRIC, n_boot=0,
                                                                       group_by="lr_rule"))
    assert analysis.primary_group == "linear"  # more seeds decide, not the name "tuned"


def test_calibrate_takes_one_options_value():
    options = CalibrationOptions(n_sims=20, tests=["falls"])
    assert options.tests == ("falls",)
    assert calibrate([0.0], options).n_sims == 20
    with pytest.raises(ValueError, match=r"^tests: unknown test\(s\) \['mixed'\]"):
        CalibrationOptions(tests=("mixed",))


@pytest.mark.parametrize("option", ["--margin", "--contrast-margin"])
def test_affdiv_analyse_refuses_a_fixed_budget_option_on_steps_to_target(tmp_path, capsys, option):
    path = tmp_path / "target.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, ["method", "batch_size", "seed", "steps_to_target", "max_steps"])
        writer.writeheader()
        for r in target_records():
            writer.writerow({k: "" if r[k] is None else r[k] for k in writer.fieldnames})
    out = tmp_path / "out"
    assert main(["analyse", "--input", str(path), "--out", str(out), option, "0.01", "--calibration-sims", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"affdiv analyse: error: {option} applies to the fixed-budget analysis only; input {path} holds "
                   "steps to a target (fewer steps are better; no slopes or margins): leave it out"]
    assert not out.exists()

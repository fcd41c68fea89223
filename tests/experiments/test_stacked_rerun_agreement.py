"""benchmarks/stacked_rerun_agreement.py: the paired comparison of a rerun with committed runs.
Expected numbers are worked out by hand from the planted differences, not by the script."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_agreement", ROOT / "benchmarks" /
                                               "stacked_rerun_agreement.py")
agreement_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agreement_script)

BASE = [0.80, 0.82, 0.81, 0.83]  # the committed accuracy of seeds 0-3 in every cell


def _write(path, shift, methods=("affine", "l2"), rules=("sqrt", "tuned"), lr_of=lambda m, s: 0.1):
    lines = ["method,batch_size,seed,lr_rule,test_accuracy,lr,config_hash"]
    for m in methods:
        for rule in rules:
            for s, base in enumerate(BASE):
                lines.append(f"{m},16,{s},{rule},{base + shift(m, rule, s)!r},{lr_of(m, s)},h{m}{rule}{s}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _compare(tmp_path, shift, **kwargs):
    committed = agreement_script.read_runs(_write(tmp_path / "c.csv", lambda *a: 0.0), "test_accuracy")
    rerun = agreement_script.read_runs(_write(tmp_path / "r.csv", shift, **kwargs), "test_accuracy")
    return agreement_script.agreement(committed, rerun, "test_accuracy", 0.01)


def test_identical_runs_agree_exactly(tmp_path):
    result = _compare(tmp_path, lambda *a: 0.0)
    assert result["identical"] == result["pairs"] == 16 and result["same_key"] == 16
    assert all(r["interval"] == (0.0, 0.0) for r in result["rows"])
    assert result["judged"] == 0 and math.isnan(result["binomial_p"])  # no cell can exclude 0 by chance
    assert result["equivalent"] and result["same_lr"] == result["tuned"] == 8


def test_a_shifted_cell_excludes_zero_and_a_shift_beyond_the_margin_is_not_equivalent(tmp_path):
    # d = 0.05 + (0, 0.001, -0.001, 0.002) in the affine/sqrt cell, 0 elsewhere
    jitter = [0.0, 0.001, -0.001, 0.002]
    result = _compare(tmp_path, lambda m, rule, s: 0.05 + jitter[s] if (m, rule) == ("affine", "sqrt") else 0.0)
    row = next(r for r in result["rows"] if (r["method"], r["lr_rule"]) == ("affine", "sqrt"))
    assert row["mean"] == pytest.approx(0.0505, abs=1e-12)
    assert row["interval"][0] > 0 and result["judged"] == 1 and result["outside"] == 1
    # each seed's mean d is a quarter of its affine/sqrt difference: 0.0125 + jitter/4, all above 0.01
    assert result["overall_mean"] == pytest.approx(0.0505 / 4, abs=1e-12) and not result["equivalent"]


def test_methods_renamed_since_are_paired_and_keys_are_compared(tmp_path):
    committed = agreement_script.read_runs(_write(tmp_path / "c.csv", lambda *a: 0.0), "test_accuracy")
    assert {k[0] for k in committed} == {"affine", "norm_l2"}  # "l2" read as today's name


def test_other_learning_rate_choices_are_counted_apart(tmp_path):
    result = _compare(tmp_path, lambda m, rule, s: 0.02 if (rule == "tuned" and s == 0) else 0.0,
                      lr_of=lambda m, s: 0.2 if s == 0 else 0.1)
    assert result["tuned"] == 8 and result["same_lr"] == 6
    assert result["mean_abs_other_lr"] == pytest.approx(0.02) and result["mean_abs_same_lr"] == 0


def test_one_seed_cells_have_no_interval_and_runs_without_tuned_rules_are_fine(tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("method,batch_size,seed,lr_rule,test_accuracy\naffine,16,0,sqrt,0.8\n")
    runs = agreement_script.read_runs(str(path), "test_accuracy")
    result = agreement_script.agreement(runs, runs, "test_accuracy", 0.01)
    assert result["rows"][0]["interval"] is None and result["judged"] == 0 and result["tuned"] == 0
    assert result["overall"] is None and result["same_key"] == 0


def test_a_missing_rerun_is_refused(tmp_path):
    committed = agreement_script.read_runs(_write(tmp_path / "c.csv", lambda *a: 0.0), "test_accuracy")
    rerun = dict(list(committed.items())[1:])
    with pytest.raises(SystemExit, match="1 committed runs have no rerun"):
        agreement_script.agreement(committed, rerun, "test_accuracy", 0.01)

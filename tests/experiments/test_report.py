"""The written report: every file, the documented summary schema, self-contained HTML, determinism."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from affdiv.experiments.analysis.calibration import Layout, calibrate, simulate_records, verdict_rates
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.records import read_csv
from affdiv.experiments.report import figures
from affdiv.experiments.report.writer import latex_table, write_report

PNG = b"\x89PNG\r\n\x1a\n"
PROVENANCE = {"command": "affdiv analyse --input x.csv", "seeds": [0, 1, 2, 3, 4], "config_hash": "abc"}


@pytest.fixture(scope="module")
def study():
    rng = np.random.default_rng(0)
    layout = Layout(base=0.75)
    records = [r for rule in ("linear", "sqrt") for r in simulate_records(
        layout, {"affine_like": -0.02, "affine": 0.0, "batchnorm": 0.0, "rmsnorm": -0.01}, rng, lr_rule=rule)]
    curves = [{**{k: r[k] for k in ("method", "batch_size", "seed", "lr_rule")}, "epoch": e,
               "train_loss": np.exp(-e / r["batch_size"]), "val_metric": r["metric"] * (1 - np.exp(-e))}
              for r in records for e in (1, 2, 3)]
    calibration = replace(calibrate([-0.005, 0.0], n_sims=30, n_boot=200),
                          verdicts=verdict_rates([-0.005, 0.0], n_sims=4))
    return records, curves, analyse(records, n_boot=500), calibration


@pytest.fixture(scope="module")
def written(study, tmp_path_factory):
    records, curves, analysis, calibration = study
    out = tmp_path_factory.mktemp("report")
    return out, write_report(out, analysis, records=records, curves=curves, provenance=PROVENANCE,
                             calibration=calibration)


def test_every_file_is_written_and_the_summary_follows_its_schema(study, written):
    records = study[0]
    out, paths = written
    assert set(paths) == {"records", "metric_vs_batch", "slope_forest", "training_curves", "calibration",
                          "summary_json", "summary_tex", "report_md", "report_html"}
    for name in ("metric_vs_batch", "slope_forest", "training_curves", "calibration"):
        assert paths[name].read_bytes().startswith(PNG), name
    assert not list(out.glob(".*.tmp"))  # no temporary left behind

    summary = json.loads(paths["summary_json"].read_text())
    assert {"schema_version", "decision_rule", "provenance", "settings", "groups", "methods", "overall",
            "primary_group", "family_sizes", "calibration", "files"} <= set(summary)
    assert summary["provenance"] == PROVENANCE
    assert set(summary["groups"]) == {"linear", "sqrt"}
    for name, method in summary["methods"].items():
        assert {"slope", "ci_low", "ci_high", "p_value", "verdict", "overall_verdict", "trend", "tests",
                "mixed", "page", "boot_ci_low", "boot_ci_high"} <= set(method), name
    assert set(summary["methods"]["affine_like"]["differential"]) == {"affine", "batchnorm"}
    assert summary["methods"]["rmsnorm"]["verdict"] == "no prediction"
    assert summary["calibration"]["n_sims"] == 30
    assert set(summary["calibration"]["verdicts"]) == {"supported", "contradicted", "mixed", "inconclusive"}
    assert read_csv(paths["records"]) == records  # the analysed data travel with the report


def test_markdown_states_the_rule_before_the_numbers(written):
    text = written[1]["report_md"].read_text()
    rule, verdicts = text.index("## Decision rule"), text.index("## Verdicts")
    first_table = text.index("\n| ")
    # The rule names only settings (alpha, margin); every estimate sits in a table after it.
    assert rule < verdicts < first_table
    for heading in ("## Group lr_rule = linear", "## Group lr_rule = sqrt", "## Calibration", "## Provenance"):
        assert heading in text
    assert "The whole decision rule on simulated studies" in text
    assert "| affine_like | corrected | supported | supported | supported |" in text


def test_html_is_self_contained(written):
    html = written[1]["report_html"].read_text()
    sources = re.findall(r'src="([^"]*)"', html)
    assert len(sources) == 4 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "href=" not in html and "<script" not in html
    assert html.count("<table>") == html.count("</table>") >= 6
    assert "<strong>supported</strong>" in html and "&lt;" not in html.split("<body>")[0]


def test_optional_parts_are_left_out_and_output_is_deterministic(tmp_path, study):
    records, _curves, analysis, _calibration = study
    first = write_report(tmp_path / "a", analysis, records=records, provenance=PROVENANCE)
    again = write_report(tmp_path / "b", analysis, records=records, provenance=PROVENANCE)
    assert "training_curves" not in first and "calibration" not in first
    assert "## Calibration" not in first["report_md"].read_text()
    for name in ("summary_json", "summary_tex", "report_md", "records"):
        assert first[name].read_bytes() == again[name].read_bytes(), name


def test_latex_table_escapes_and_lists_every_method(study):
    _records, _curves, analysis, _calibration = study
    tex = latex_table(analysis.to_dict())
    assert tex.startswith(r"\begin{tabular}") and tex.rstrip().endswith(r"\end{tabular}")
    assert r"affine\_like" in tex and "affine_like" not in tex
    assert tex.count(r"\\") == 1 + 2 * 4  # header + 2 groups × 4 methods
    assert r"95\% CI" in tex


def test_training_curves_need_a_metric(tmp_path):
    with pytest.raises(ValueError, match="no training-curve points"):
        figures.training_curves([{"method": "affine", "batch_size": 8, "seed": 0, "epoch": 1, "acc": 0.5}],
                                tmp_path / "c.png")


def test_forest_plot_without_sensitivity_analyses(tmp_path, study):
    records = study[0]
    path = figures.slope_forest(analyse(records, sensitivity=False), tmp_path / "forest.png")
    assert path.read_bytes().startswith(PNG)


def test_a_diverged_method_is_reported_inconclusive_under_the_stated_rule(tmp_path):
    rng = np.random.default_rng(1)
    records = simulate_records(Layout(base=0.75), {"affine_like": 0.0, "affine": 0.0}, rng, lr_rule="linear")
    for r in records:  # the largest batches blew up (the harness records chance accuracy and diverged = 1)
        r["diverged"] = int(r["method"] == "affine_like" and r["batch_size"] == 256)
        r["metric"] = 0.1 if r["diverged"] else r["metric"]
    paths = write_report(tmp_path, analyse(records, n_boot=200, sensitivity=False), records=records,
                         provenance=PROVENANCE)
    text = paths["report_md"].read_text()
    rule_line = text.index("a method with a diverged run in a group is inconclusive there")
    assert text.index("## Decision rule") < rule_line < text.index("## Verdicts")
    assert "| affine_like | corrected | inconclusive | inconclusive |" in text
    assert "5 of 25 runs diverged (batch sizes 256)" in text  # Layout: 5 seeds × 5 batch sizes
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["settings"]["sensitivity"] is False
    assert summary["methods"]["affine_like"]["n_diverged"] == 5
    assert summary["methods"]["affine_like"]["diverged_batch_sizes"] == [256]

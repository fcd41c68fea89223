"""The written report: every file, the documented summary schema (one verdict per level), caveats
first, self-contained HTML, honest calibration wording, determinism; both designs."""

import json
import re

import numpy as np
import pytest

from affdiv.experiments.analysis.calibration import (
    Layout,
    MethodModel,
    StudyLayout,
    calibrate_for,
    simulate_records,
    simulate_study,
    verdict_calibration,
)
from affdiv.experiments.analysis.critical_batch import analyse_target, simulate_target_records
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.experiments.records import read_csv
from affdiv.experiments.report import figures
from affdiv.experiments.report.writer import reads_sentence, summary_tex, verdict_table, write_report
from affdiv.vocabulary import RATIO_CLASSES, TARGET_METRIC

#: The fixed-budget analysis by learning-rate rule (its settings otherwise at their defaults).
BY_RULE = AnalysisSettings(group_by="lr_rule")
#: The steps-to-target analysis (its settings otherwise at their defaults).
TARGET = AnalysisSettings(metric=TARGET_METRIC)

PNG = b"\x89PNG\r\n\x1a\n"
PROVENANCE = {"command": "affdiv analyse --input x.csv", "seeds": [0, 1, 2, 3, 4], "config_hash": "abc",
              "preset": "smoke", "preset_settings": {"caveats": ["Too small to settle the prediction."]}}
LAYOUT = StudyLayout((16, 32, 64, 128, 256), 5, (-0.01, 0.0, -0.005, -0.015, -0.03),
                     {"affine_like": MethodModel("corrected", 0.004, 0.01),
                      "affine": MethodModel("baseline", 0.004, 0.01),
                      "batchnorm": MethodModel("baseline", 0.004, 0.01), "rmsnorm": MethodModel("other", 0.004)},
                     0.01, True)


@pytest.fixture(scope="module")
def study():
    rng = np.random.default_rng(0)
    records = []
    for rule, effect in (("sqrt", 0.04), ("tuned", 0.04)):
        for rows in simulate_study(LAYOUT, effect, rng).values():
            records += [{**r, "metric": 0.8 + r["metric"], "lr_rule": rule, "budget": "steps"} for r in rows]
    curves = [{**{k: r[k] for k in ("method", "batch_size", "seed", "lr_rule")}, "epoch": e,
               "train_loss": np.exp(-e / r["batch_size"]), "val_metric": r["metric"] * (1 - np.exp(-e))}
              for r in records for e in (1, 2, 3)]
    calibration = verdict_calibration(LAYOUT, (0.0, 0.01), n_sims=4)
    return records, curves, analyse(records, BY_RULE.replace(n_boot=500)), calibration


@pytest.fixture(scope="module")
def written(study, tmp_path_factory):
    records, curves, analysis, calibration = study
    out = tmp_path_factory.mktemp("report")
    return out, write_report(out, analysis, records=records, curves=curves, provenance=PROVENANCE,
                             calibration=calibration)


def test_every_file_is_written_and_the_summary_follows_its_schema(study, written):
    records = study[0]
    out, paths = written
    assert set(paths) == {"records", "metric_vs_batch", "contrast_forest", "slope_forest", "training_curves",
                          "calibration", "summary_json", "summary_tex", "report_md", "report_html"}
    for name in ("metric_vs_batch", "contrast_forest", "slope_forest", "training_curves", "calibration"):
        assert paths[name].read_bytes().startswith(PNG), name
    assert not list(out.glob(".*.tmp"))  # no temporary left behind

    summary = json.loads(paths["summary_json"].read_text())
    assert {"schema_version", "design", "decision_rule", "provenance", "settings", "groups", "methods", "overall",
            "prediction", "primary_group", "family_sizes", "calibration", "files"} <= set(summary)
    assert summary["design"] == "fixed budget" and summary["primary_group"] == "tuned"
    # One verdict per level, each where it belongs.
    assert summary["prediction"]["verdict"] == summary["groups"]["tuned"]["prediction"]["verdict"]
    assert summary["prediction"]["rule"] == summary["decision_rule"]
    for name, method in summary["methods"].items():
        assert set(method) == {"role", "verdict", "groups"}
        assert method["groups"] == {g: c["methods"][name]["verdict"] for g, c in summary["groups"].items()}
    group = summary["groups"]["tuned"]["methods"]
    assert set(group["affine_like"]["did"]) == {"affine", "batchnorm"}
    assert {"estimate", "ci_low", "ci_high", "per_seed", "jackknife", "in_sample"} <= set(group["affine"]["contrast"])
    assert {"F", "p"} <= set(group["affine"]["lack_of_fit"]) and "noise_sd" in group["affine"]["noise"]
    assert group["rmsnorm"]["verdict"] == "no prediction"
    assert summary["calibration"]["n_sims"] == 4 and summary["calibration"]["design"] == "fixed budget"
    assert read_csv(paths["records"]) == records  # the analysed data travel with the report


def test_markdown_states_caveats_and_rule_before_the_numbers(written):
    text = written[1]["report_md"].read_text()
    caveats, rule, verdict = text.index("## Read this first"), text.index("## Decision rule"), text.index("## Verdict")
    assert caveats < rule < verdict < text.index("\n| ")
    assert "Too small to settle the prediction." in text[caveats:rule]
    assert "**The prediction: " in text[verdict:]
    for heading in ("## Group lr_rule = sqrt (sensitivity)", "## Group lr_rule = tuned (primary)",
                    "## Calibration of the decision rule", "## Provenance"):
        assert heading in text


def test_calibration_text_does_not_call_every_rate_a_false_positive(written):
    text = written[1]["report_md"].read_text()
    section = text[text.index("## Calibration"):text.index("## Provenance")]
    assert "a 'supported' there is a false positive" in section
    assert "'contradicted' there is the right answer, not an error" in section
    assert "false-positive rate" not in section  # no rate is called that wholesale


def test_html_is_self_contained_and_readable(written):
    html = written[1]["report_html"].read_text()
    sources = re.findall(r'src="([^"]*)"', html)
    assert len(sources) == 5 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "href=" not in html and "<script" not in html
    assert html.count("<table>") == html.count("</table>") >= 6
    assert 'class="table-scroll"' in html and '<details class="provenance">' in html
    assert "<strong>" in html and "Too small to settle the prediction." in html


def test_optional_parts_are_left_out_and_output_is_deterministic(tmp_path, study):
    records, _curves, analysis, _calibration = study
    first = write_report(tmp_path / "a", analysis, records=records, provenance=PROVENANCE)
    again = write_report(tmp_path / "b", analysis, records=records, provenance=PROVENANCE)
    assert "training_curves" not in first and "calibration" not in first
    assert "## Calibration" not in first["report_md"].read_text()
    for name in ("summary_json", "summary_tex", "report_md", "records"):
        assert first[name].read_bytes() == again[name].read_bytes(), name


def test_summary_tex_escapes_and_lists_every_method(study):
    _records, _curves, analysis, _calibration = study
    tex = summary_tex(analysis.to_dict(PROVENANCE))
    assert tex.startswith("% affdiv falsification report") and r"\end{tabularx}" in tex
    assert r"affine\_like" in tex and " affine_like" not in tex
    assert tex.count(r"\\") - tex.count(r"\\ \\") >= 1 + 2 * 4  # header + 2 groups × 4 methods (+ note)
    assert r"95\% CI" in tex and "Joint verdict of the prediction" in tex


def test_training_curves_need_a_metric(tmp_path):
    with pytest.raises(ValueError, match="no training-curve points"):
        figures.training_curves([{"method": "affine", "batch_size": 8, "seed": 0, "epoch": 1, "acc": 0.5}],
                                tmp_path / "c.png")


def test_forest_plots_without_sensitivity_analyses(tmp_path, study):
    analysis = analyse(study[0], BY_RULE.replace(sensitivity=False))
    assert figures.slope_forest(analysis, tmp_path / "forest.png").read_bytes().startswith(PNG)
    assert figures.contrast_forest(analysis, tmp_path / "contrast.png").read_bytes().startswith(PNG)


def test_a_diverged_method_is_reported_inconclusive_under_the_stated_rule(tmp_path):
    rng = np.random.default_rng(1)
    records = simulate_records(Layout(base=0.75), {"affine_like": 0.0, "affine": 0.0}, rng, lr_rule="linear")
    for r in records:  # the largest batches blew up (the harness records chance accuracy and diverged = 1)
        r["diverged"] = int(r["method"] == "affine_like" and r["batch_size"] == 256)
        r["metric"] = 0.1 if r["diverged"] else r["metric"]
    paths = write_report(tmp_path, analyse(records, BY_RULE.replace(n_boot=200, sensitivity=False)), records=records,
                         provenance={"command": "x"})
    text = paths["report_md"].read_text()
    rule_line = text.index("a method with a diverged run in a group is inconclusive there")
    assert text.index("## Decision rule") < rule_line < text.index("## Verdict")
    assert "| affine_like | corrected | inconclusive | inconclusive |" in text
    assert "5 of 25 runs diverged (batch sizes 256)" in text  # Layout: 5 seeds × 5 batch sizes
    assert "## Read this first" not in text  # no preset, no caveats: nothing to put first
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["settings"]["sensitivity"] is False
    assert summary["groups"]["linear"]["methods"]["affine_like"]["n_diverged"] == 5


def test_steps_to_target_report(tmp_path):
    rng = np.random.default_rng(2)
    records = simulate_target_records({"affine_like": (300, 100), "affine": (200, 400), "batchnorm": (150, 400)},
                                      batch_sizes=(16, 64, 256, 1024), seeds=range(5), sigma=0.1, max_steps=5000,
                                      rng=rng)
    for r in records:
        r["b_simple"] = 50.0 + r["batch_size"] / 10
    analysis = analyse_target(records, TARGET.replace(n_boot=200))
    paths = write_report(tmp_path, analysis, records=records, provenance=PROVENANCE)
    assert {"steps_vs_batch", "examples_vs_steps"} <= set(paths) and "metric_vs_batch" not in paths
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["design"] == "steps_to_target"
    assert summary["critical_batch"]["affine"]["cells"][0]["b_simple"] == 51.6
    text = paths["report_md"].read_text()
    assert text.index("## Read this first") < text.index("## Decision rule") < text.index("## Verdict")
    assert "B_simple (last)" in text and "| affine_like | affine | smaller |" in text
    # One target (no target column): no ladder section, no ladder figures.
    assert "Along the target ladder" not in text and not {"bcrit_vs_target", "ratio_vs_target"} & set(paths)
    tex = paths["summary_tex"].read_text()
    assert r"$B_\mathrm{crit}$" in tex and r"affine\_like" in tex
    for b, pair in summary["ratios"]["affine_like"].items():  # each verdict beside its deciding ratio and p
        p = f"{pair['p']:.4f}" if pair["p"] >= 1e-4 else r"\textless{}1e-4"
        assert (f"ratio vs {b} {pair['ratio']:.3g} [{pair['ci_low']:.3g}, {pair['ci_high']:.3g}], p = {p}: "
                f"{pair['class']}") in tex
    assert "Off-diagonal share" not in text  # the runs did not measure it: no table


def test_a_target_report_gives_the_measured_off_diagonal_share_beside_each_b_crit(tmp_path):
    rng = np.random.default_rng(3)
    records = simulate_target_records({"affine_like": (300, 100), "affine": (200, 400)}, batch_sizes=(16, 64, 256),
                                      seeds=range(5), sigma=0.1, max_steps=5000, rng=rng)
    for r in records:  # seed s adds s/1000: the median over seeds 0-4 is the seed-2 value
        if r["method"] == "affine" and r["batch_size"] == 256 and r["seed"] == 4:
            continue  # a run without the measurement counts for nothing
        r["off_diagonal_share_init"] = r["batch_size"] / 100 + r["seed"] / 1000
        r["off_diagonal_share_last"] = 2 * r["batch_size"] / 100 + r["seed"] / 1000
    paths = write_report(tmp_path, analyse_target(records, TARGET.replace(n_boot=0)), records=records,
                         provenance=PROVENANCE)
    cells = {c["batch_size"]: c for c in json.loads(paths["summary_json"].read_text())
             ["critical_batch"]["affine"]["cells"]}
    assert cells[64]["off_diagonal_share_init"] == pytest.approx(0.642) and cells[64]["off_diagonal_share_init_n"] == 5
    assert cells[256]["off_diagonal_share_last"] == pytest.approx((5.121 + 5.122) / 2)  # seeds 0-3
    text = paths["report_md"].read_text()
    assert "| method | role | B_crit | B = 16 | B = 64 | B = 256 |" in text
    row = next(line for line in text.splitlines() if line.startswith("| affine_like | corrected |")
               and "0.162 / 0.322" in line)
    assert row.endswith("| 0.162 / 0.322 | 0.642 / 1.28 | 2.56 / 5.12 |")


LADDER = (0.8, 0.85, 0.9)


@pytest.fixture(scope="module")
def ladder():
    """A study read at three targets (0.9 the primary one): the corrected layer's B_crit a quarter of
    the baselines' at every target, S_min rising with the target; geometric reads."""
    rng = np.random.default_rng(4)
    records = []
    for k, target in enumerate(LADDER):
        rows = simulate_target_records({"affine_like": (100 * 1.5 ** k, 100), "affine": (80 * 1.5 ** k, 400),
                                        "batchnorm": (60 * 1.5 ** k, 400)}, batch_sizes=(16, 64, 256, 1024),
                                       seeds=range(5), sigma=0.1, max_steps=20000, rng=rng)
        records += [{**r, "target": target, "primary_target": 0.9, "read_spacing": 0.05, "lr_rule": "tuned"}
                    for r in rows]
    analysis = analyse_target(records, TARGET.replace(n_boot=0, group_by="lr_rule"))
    return records, analysis, calibrate_for(analysis, n_sims=20)


@pytest.fixture(scope="module")
def ladder_written(ladder, tmp_path_factory):
    records, analysis, calibration = ladder
    out = tmp_path_factory.mktemp("ladder")
    return write_report(out, analysis, records=records, provenance=PROVENANCE, calibration=calibration)


def test_a_ladder_report_shows_every_target(ladder, ladder_written):
    paths = ladder_written
    assert {"bcrit_vs_target", "ratio_vs_target"} <= set(paths)
    summary = json.loads(paths["summary_json"].read_text())
    assert summary["settings"]["targets"] == list(LADDER) and summary["primary_target"] == 0.9
    text = paths["report_md"].read_text()
    section = text[text.index("## Along the target ladder"):text.index("## Figures")]
    assert text.index("## Group lr_rule = tuned") < text.index("## Along the target ladder")
    assert "| pair | 0.8 | 0.85 | 0.9 (primary) |" in section  # the primary target marked
    assert "targets 0.8, 0.85, 0.9" in section and "--primary-target" in section
    assert "geometric reads, spacing r = 0.05" in section and "interpolated" in section
    for c, b in (("affine_like", "affine"), ("affine_like", "batchnorm")):
        cells = []
        for t in LADDER:
            r = summary["by_target"][repr(t)]["ratios"][c][b]
            assert r["class"] == "smaller"  # a planted ratio of 1/4 at every target
            cells.append(f"{r['ratio']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}] smaller")
        assert f"| {c} vs {b} | " + " | ".join(cells) + " |" in section
        tr = summary["trends"][c][b]
        assert tr["status"] == "ok" and tr["factor_ci_low"] < 1 < tr["factor_ci_high"]  # no planted trend
        assert f"| {c} vs {b} | 0.8, 0.85, 0.9 | {tr['factor']:.3g} | [{tr['factor_ci_low']:.3g}, " in section
    fits = [summary["by_target"][repr(t)]["critical_batch"]["affine"] for t in LADDER]
    assert "| affine | baseline | " + " | ".join(f"{r['b_crit']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}]"
                                                 for r in fits) + " |" in section
    for name in ("bcrit_vs_target.png", "ratio_vs_target.png"):
        assert f"]({name})" in text and paths[name.removesuffix(".png")].read_bytes().startswith(PNG)
    html = paths["report_html"].read_text()
    assert "<h2>Along the target ladder</h2>" in html and len(re.findall(r'src="data:image/png', html)) == 7


def test_a_ladder_report_gives_every_outcome_rate_and_the_power_at_the_measured_ratio(ladder, ladder_written):
    calibration = ladder[2]
    text = ladder_written["report_md"].read_text()
    section = text[text.index("## Calibration"):text.index("## Provenance")]
    assert "| pair | planted ratio | " + " | ".join(RATIO_CLASSES) + " | p < α |" in section
    for pair, classes in calibration.classes.items():
        for i, ratio in enumerate(calibration.effects):
            mark = " (measured)" if calibration.measured[pair]["ratio"] == ratio else ""
            row = f"| {pair} | {ratio:.4g}{mark} | " + " | ".join(f"{classes[k][i]:.3f}" for k in RATIO_CLASSES)
            assert row in section, row
    assert set(calibration.measured) == {"affine_like vs affine", "affine_like vs batchnorm"}
    for pair, m in calibration.measured.items():
        assert f"| {pair} | {m['ratio']:.4g} | {m['power']:.3f} |" in section
        assert f"| {pair} | {m['ratio']:.4g} (measured) | " in section


def test_the_verdict_and_latex_tables_name_each_pair_class(ladder):
    summary = ladder[1].to_dict(PROVENANCE)
    lines = verdict_table(summary).splitlines()
    pairs = summary["ratios"]["affine_like"]
    for b, pair in pairs.items():
        row = next(line for line in lines if f"ratio vs {b}" in line)
        assert row.rstrip().endswith(pair["class"]) and f"{pair['ratio']:.3g}" in row
        assert f" {pair['p']:.4f} " in row or " <1e-4 " in row  # the ratio test's p beside its ratio
    # A baseline's verdict ('reference') was decided by no test: no B_crit posing as one.
    baseline = next(line for line in lines if line.split()[:2] == ["tuned", "affine"]).split()
    assert baseline[3:6] == ["reference", "none", "—"]
    assert "p (ratio < 1)" in lines[0]
    tex = summary_tex(summary)
    assert "Deciding test: estimate [CI], p, class" in tex
    assert all(f"ratio vs {b} {pair['ratio']:.3g} " in tex for b, pair in pairs.items())


def test_how_steps_are_read_comes_from_the_records():
    assert "a read every 10 steps" in reads_sentence([{"eval_every": 10, "read_spacing": ""}])
    assert "spacing r = 0.1" in reads_sentence([{"eval_every": "10", "read_spacing": "0.1"}])
    assert "a read every" not in reads_sentence([{"eval_every": 10, "read_spacing": 0.1}])  # idle eval_every
    assert "do not say" in reads_sentence([{"method": "affine"}])


def test_verdict_table_names_the_deciding_test_of_every_method(study):
    summary = study[2].to_dict(PROVENANCE)
    table = verdict_table(summary)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["group", "method", "role", "verdict", "deciding"]
    assert set(lines[1]) <= {"-", " "}
    for group, content in summary["groups"].items():
        for method, r in content["methods"].items():
            row = next(line for line in lines if line.split()[:2] == [group, method])
            assert r["verdict"] in row
            if r["role"] == "corrected":
                assert "DiD vs " in row
            for b, d in r.get("did", {}).items():  # each DiD with the p-values its class came from
                did = next(line for line in lines if f"DiD vs {b}" in line and lines.index(line) >= lines.index(row))
                assert f"{d['estimate']:+.3g}" in did and f"{d['p_less']:.4f} / " in did.replace("<1e-4", "0.0000")
    assert "DiD vs batchnorm" in table and "[" in table and "95% CI" in lines[0] and lines[0].endswith("class")
    assert lines[-1] == f"Joint verdict of the prediction (group tuned): {summary['prediction']['verdict']}"


def test_the_per_batch_table_comes_collapsed_after_the_figures_without_its_empty_columns(tmp_path):
    rng = np.random.default_rng(3)
    records = simulate_target_records({"affine_like": (300, 100), "affine": (200, 400)}, batch_sizes=(16, 64, 256),
                                      seeds=range(4), sigma=0.1, max_steps=5000, rng=rng)
    paths = write_report(tmp_path, analyse_target(records, TARGET.replace(n_boot=0)), records=records,
                         provenance=PROVENANCE)
    text = paths["report_md"].read_text()
    table = text.index("| method | batch size | runs | censored | median steps | max_steps | B_crit (fit) |")
    opened = text.index("<details><summary>Runs per method and batch size, group all</summary>")
    assert text.index("## Figures") < text.index("![") < opened < table < text.index("</details>", table)
    assert "B_simple" not in text[table:]  # no run measured it: the columns ("—" in every row) are left out
    html = paths["report_html"].read_text()
    opened = html.index("<details><summary>Runs per method and batch size, group all</summary>")
    assert html.index("<h2>Figures</h2>") < html.rindex("<figure>") < opened < html.index("median steps", opened)
    table = html[html.index("<table>", opened):html.index("</details>", opened)]
    assert "B_simple" not in table and '<th scope="col">B_crit (fit)</th>' in table

"""`affdiv falsify` and `affdiv analyse` end to end on tiny grids, kill -9 and resume, bad input."""

import csv
import json
import os
import signal
import subprocess
import sys

import pytest

from affdiv.cli import main

# A tiny grid: 2 methods x 2 batch sizes x 3 seeds x 2 LR rules (sqrt, tuned) = 24 runs of one epoch
# (the smoke preset's steps-to-target design set back to a fixed epoch budget on one data split).
TINY = ["--preset", "smoke", "--methods", "affine", "norm_l2", "--batch-sizes", "32", "128",
        "--seeds", "3", "--set", "budget=epochs", "--set", "data_seed=0", "--set", "lr_rule=['sqrt', 'tuned']",
        "--set", "length=1", "--set", "width=16", "--set", "lr_grid=[0.1, 0.4]"]


def _summary_without_provenance(path):
    summary = json.loads(path.read_text())
    summary.pop("provenance")
    return summary


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    assert main(["falsify", *TINY, "--out", str(out), "--workers", "1"]) == 0
    return out


def test_falsify_writes_the_report_and_the_database(tiny_report, sweep_util):
    summary = json.loads((tiny_report / "summary.json").read_text())
    assert set(summary["methods"]) == {"affine", "norm_l2"}
    for result in summary["groups"]["tuned"]["methods"].values():
        assert {"slope", "ci_low", "ci_high", "p_value", "verdict", "contrast"} <= set(result)
    assert set(summary["groups"]) == {"sqrt", "tuned"}
    provenance = summary["provenance"]
    assert provenance["seeds"] == [0, 1, 2] and provenance["runs"] == 24
    assert list(provenance["data_fingerprint"]) == ["digits"] and len(provenance["data_fingerprint"]["digits"]) == 1
    assert len(provenance["config_hash"]) == 64
    assert {"command", "version", "git_commit", "libraries", "hardware", "wall_time_s"} <= set(provenance)
    for name in ("report.md", "report.html", "summary.tex", "records.csv", "metric_vs_batch.png"):
        assert (tiny_report / name).is_file(), name
    assert len(sweep_util.rows(tiny_report / "results.sqlite")) == 24
    with open(tiny_report / "records.csv", newline="") as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 24 and {r["lr_rule"] for r in records} == {"sqrt", "tuned"}
    assert {float(r["lr"]) for r in records if r["lr_rule"] == "tuned"} <= {0.1, 0.4}
    assert all(r["metric"] == r["test_accuracy"] for r in records)


def test_analyse_reproduces_falsify_from_the_csv_and_the_database(tiny_report, tmp_path):
    expected = _summary_without_provenance(tiny_report / "summary.json")
    for source in ("records.csv", "results.sqlite"):
        out = tmp_path / source
        assert main(["analyse", "--input", str(tiny_report / source), "--out", str(out)]) == 0
        got = _summary_without_provenance(out / "summary.json")
        assert got["methods"] == expected["methods"], source
        assert got["groups"] == expected["groups"], source


def test_groups_are_named_by_every_varying_setting_but_method_batch_and_seed():
    from affdiv.experiments.analysis.groups import label_groups

    records = [{"method": m, "batch_size": b, "seed": 0, "lr_rule": r, "width": 8}
               for m in ("affine", "norm_l2") for b in (16, 32) for r in ("sqrt", "tuned")]
    assert label_groups(records) == "lr_rule" and "group" not in records[0]
    records[0]["width"] = 16
    assert label_groups(records) == "group"
    assert [r["group"] for r in records[:2]] == ["lr_rule=sqrt, width=16", "lr_rule=tuned, width=8"]


def test_settings_a_run_ignores_name_no_group():
    from affdiv.experiments.analysis.groups import label_groups

    # As stored: the scaling rule uses ref_batch_size 64; the tuned rule ignores it (stored at its default).
    records = [{"method": "affine", "batch_size": b, "seed": 0, "lr_rule": r, "lr_grid": [0.1, 1.0] if r == "tuned"
                else [], "ref_batch_size": 32 if r == "tuned" else 64} for b in (16, 32) for r in ("sqrt", "tuned")]
    assert label_groups(records) == "lr_rule"
    records.append({**records[0], "ref_batch_size": 128})  # a second reference batch size: a second sqrt group
    assert label_groups(records) == "group"
    assert sorted({r["group"] for r in records}) == ["lr_rule=sqrt, ref_batch_size=128",
                                                     "lr_rule=sqrt, ref_batch_size=64", "lr_rule=tuned"]


def test_a_method_with_its_own_learning_rate_search_stays_in_its_group():
    from affdiv.experiments.analysis.groups import label_groups

    # A preset's [method.patchnorm] table: patchnorm searches its own grid, the baselines the [run] one.
    def record(method, batch, width=8):
        own = method == "patchnorm"
        return {"method": method, "batch_size": batch, "seed": 0, "lr_rule": "tuned", "budget": "target",
                "lr_grid": [1.6, 3.2, 6.4] if own else [0.2, 0.4, 0.8], "grid_extensions": 4 if own else 3,
                "width": width}

    records = [record(m, b) for m in ("conv", "conv+batchnorm", "patchnorm") for b in (32, 64)]
    assert label_groups(records) == "lr_rule" and "group" not in records[0]
    # A per-method rate under a scaling rule is the method's too, as are its reference batch size and momentum.
    scaled = [{**r, "lr_rule": "sqrt", "base_lr": 0.4 if r["method"] == "patchnorm" else 0.05} for r in records]
    assert label_groups(scaled) == "lr_rule"
    scaled = [{**r, "ref_batch_size": 64 if r["method"] == "patchnorm" else 32} for r in scaled]
    assert label_groups(scaled) == "lr_rule"
    with_momentum = [{**r, "optimizer": "momentum", "momentum": 0.5 if r["method"] == "patchnorm" else 0.9}
                     for r in scaled]
    assert label_groups(with_momentum) == "lr_rule"
    # Per width, each method still has one grid (patchnorm another at width 16): width alone names groups.
    records += [{**record(m, b, width=16), **({"grid_extensions": 5} if m == "patchnorm" else {})}
                for m in ("conv", "patchnorm") for b in (32, 64)]
    assert label_groups(records) == "group"
    assert {r["group"] for r in records} == {"lr_rule=tuned, width=8", "lr_rule=tuned, width=16"}


def test_a_split_per_seed_names_no_group_in_a_records_csv(tmp_path):
    from affdiv.experiments.analysis.groups import label_groups
    from affdiv.experiments.records import read_csv, write_csv

    # data_seed = "seed": as falsify writes records.csv (both typed on reading)
    records = [{"method": m, "batch_size": b, "seed": s, "data_seed": s, "metric": 0.5, "lr_rule": "tuned"}
               for m in ("conv", "patchnorm") for b in (32, 64) for s in (0, 1, 2)]
    assert label_groups(records) == "lr_rule"
    back = read_csv(write_csv(tmp_path / "records.csv", records))
    assert back[1]["data_seed"] == 1 == back[1]["seed"]
    assert label_groups(back) == "lr_rule" and "group" not in back[0]
    as_floats = read_csv(write_csv(tmp_path / "floats.csv", [{**r, "seed": float(r["seed"]),
                                                               "data_seed": float(r["data_seed"])} for r in records]))
    assert label_groups(as_floats) == "lr_rule"  # "1.0", as pandas writes an integer column with gaps
    back[1]["data_seed"] = 0  # one seed on another's split: data_seed names groups again
    assert label_groups(back) == "group"


def test_curve_points_take_their_runs_group():
    from affdiv.experiments.analysis.groups import label_curves, label_groups

    records = [{"method": m, "batch_size": 32, "seed": 0, "lr_rule": "tuned", "budget": "target",
                "grid_extensions": g, "config_hash": f"{m}{g}"} for m, g in (("conv", 3), ("pn", 3), ("pn", 4))]
    assert label_groups(records) == "group"
    # Only one run per method has curve points (conv's on grid 3, patchnorm's on grid 4): alone they would
    # hold one grid per method and name no group.
    curves = [{**records[i], "epoch": e} for i in (0, 2) for e in (1, 2)]
    for point in curves:
        point.pop("group")
    label_curves(curves, records)
    assert [p["group"] for p in curves] == [records[0]["group"]] * 2 + [records[2]["group"]] * 2
    assert records[0]["group"] != records[2]["group"]
    with pytest.raises(ValueError, match="curve point of run 'other' has no record among the records analysed"):
        label_curves([{**curves[0], "config_hash": "other"}], records)


def test_two_searches_of_one_method_name_groups():
    from affdiv.experiments.analysis.groups import label_groups

    # One store holding two studies' patchnorm runs (a narrower grid, then a wider one): each grid a group.
    records = [{"method": m, "batch_size": b, "seed": 0, "lr_rule": "tuned", "budget": "target",
                "lr_grid": [0.2, 0.4, 0.8], "grid_extensions": 3} for m in ("conv", "patchnorm") for b in (32, 64)]
    records += [{**r, "grid_extensions": 4} for r in records if r["method"] == "patchnorm"]
    assert label_groups(records) == "group"
    narrow, wide = "lr_rule=tuned, grid_extensions=3", "lr_rule=tuned, grid_extensions=4"
    assert [r["group"] for r in records] == [narrow] * 4 + [wide] * 2
    # Named once, a search setting splits every method: a method's own third search stands alone.
    records.append({**records[-1], "grid_extensions": 5})
    assert label_groups(records) == "group" and records[-1]["group"] == "lr_rule=tuned, grid_extensions=5"
    assert {r["method"] for r in records if r["group"] == wide} == {"patchnorm"}
    # A search setting the runs ignore (no target budget: no grid extensions) names no group.
    for r in records:
        r["budget"] = "epochs"
    assert label_groups(records) == "lr_rule"


def test_analyse_a_minimal_csv(tmp_path):
    # Any CSV with columns method, batch_size, seed, metric; here a planted fall of 0.1 per doubling.
    path = tmp_path / "mine.csv"
    rows = ["method,batch_size,seed,metric"]
    rows += [f"{m},{b},{s},{0.9 - (0.1 if m == 'norm_l2' else 0.0) * (b.bit_length() - 1) + 0.01 * ((s * 7 + b) % 3)}"
             for m in ("affine", "norm_l2") for b in (16, 32, 64, 128) for s in range(4)]
    path.write_text("\n".join(rows) + "\n")
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out")]) == 0
    methods = json.loads((tmp_path / "out" / "summary.json").read_text())["groups"]["all"]["methods"]
    assert methods["norm_l2"]["slope"] == pytest.approx(-0.1, abs=0.01)
    assert methods["affine"]["slope"] == pytest.approx(0.0, abs=0.01)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["falsify", "--preset", "smok"], "unknown preset 'smok'; expected one of: cnn-ladder, fashion, "
                                            "fashion-cnn, fashion-ladder, fashion-steps, fashion-target, fashion-vit, "
                                            "paper, smoke"),
        (["falsify", "--preset", "smoke", "--methods", "bn"], "unknown method 'bn'; expected one of: affine"),
        (["falsify", "--preset", "smoke", "--batch-sizes", "0"], "batch sizes must be integers >= 1, got 0"),
        (["falsify", "--preset", "smoke", "--batch-sizes", "100000", "--methods", "affine", "--seeds", "1"],
         "batch_size 100000 exceeds the 1294 training samples of digits"),
        (["falsify", "--preset", "smoke", "--set", "lenght=2"], "unknown run setting(s) ['lenght']"),
        (["falsify", "--preset", "smoke", "--set", "length"], "--set expects KEY=VALUE, got 'length'"),
        (["analyse", "--input", "nowhere.csv"], "--input nowhere.csv: no such file"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.sqlite").exists()  # refused before any run


def test_analyse_a_csv_without_the_metric_column(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("method,batch_size,seed,accuracy\naffine,32,0,0.5\n")
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "missing column(s) ['metric']" in capsys.readouterr().err


def test_the_defaults_analyses_help_states_are_the_analysis_defaults(capsys):
    from affdiv.experiments.analysis import contrast, decision
    from affdiv.experiments.analysis.settings import AnalysisSettings

    with pytest.raises(SystemExit):
        main(["analyse", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for role in ("corrected", "baselines"):
        default = getattr(AnalysisSettings(), role)
        assert f"(default: {' '.join(default)})" in text, (role, default)
    # --help: 0.005 per doubling and a contrast margin of 0.01 for a score in [0, 1]; 1% and 2% of the median else
    assert decision.default_margin([0.5, 0.9], True)[0] == 0.005
    assert contrast.default_contrast_margin([0.5, 0.9], True)[0] == 0.01
    assert decision.default_margin([10.0, 30.0], True)[0] == pytest.approx(0.2)
    assert contrast.default_contrast_margin([10.0, 30.0], True)[0] == pytest.approx(0.4)

def test_kill_minus_9_loses_no_finished_run_and_resume_matches_an_uninterrupted_sweep(tmp_path, sweep_util):
    # Slow enough runs (batch 8, 3 epochs: ~0.5 s each) that the kill lands mid-sweep.
    grid = ["--preset", "smoke", "--methods", "affine", "batchnorm", "--batch-sizes", "8", "64",
            "--seeds", "3", "--set", "lr_rule=['constant']", "--set", "budget=epochs", "--set", "data_seed=0",
            "--set", "length=3", "--set", "width=16"]
    interrupted = tmp_path / "interrupted"
    command = [sys.executable, "-m", "affdiv", "falsify", *grid, "--out", str(interrupted), "--workers", "2"]
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    db = interrupted / "results.sqlite"
    try:
        sweep_util.wait(lambda: len(sweep_util.rows(db)) >= 3 or process.poll() is not None, 120)
        assert process.poll() is None, "the sweep finished before it could be killed: " + process.stderr.read().decode()
        os.killpg(process.pid, signal.SIGKILL)  # the parent and its workers, mid-sweep
    finally:
        process.wait()
        process.stderr.close()
    before = sweep_util.rows(db)
    assert 3 <= len(before) < 12 and not (interrupted / "summary.json").exists()

    # Resume (and the reference sweep) in this process: one torch thread per run whatever the
    # number of workers, so the numbers cannot depend on it.
    assert main(["falsify", *grid, "--out", str(interrupted), "--workers", "1"]) == 0
    after = sweep_util.rows(db)
    assert len(after) == 12
    assert all(after[key] == row for key, row in before.items())  # finished runs kept, untouched

    fresh = tmp_path / "fresh"
    assert main(["falsify", *grid, "--out", str(fresh), "--workers", "1"]) == 0
    assert (interrupted / "records.csv").read_text() == (fresh / "records.csv").read_text()
    resumed = _summary_without_provenance(interrupted / "summary.json")
    assert resumed == _summary_without_provenance(fresh / "summary.json")

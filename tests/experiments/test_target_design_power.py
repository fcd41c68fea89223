"""benchmarks/target_design_power.py: its layout argument and a run on a hand-written layout."""

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_design_power", ROOT / "benchmarks" /
                                               "target_design_power.py")
power_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(power_script)


def test_a_layout_is_the_powers_of_two_between_its_ends():
    assert power_script.layout_argument("8-64:5") == ((8, 16, 32, 64), 5)


@pytest.mark.parametrize("text", ["8-64", "8-60:5", "64-8:5", "8-64:2", "0-64:5", "a-b:c"])
def test_a_bad_layout_is_refused_in_one_line(text):
    with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}"):
        power_script.layout_argument(text)


def test_the_rates_come_from_the_summary_layout(tmp_path):
    # Nearly noise-free runs with a B_crit well inside the batch sizes: the pair test rejects at ratio
    # 0.25 and 0.5 in every study; at ratio 1 the interval sits inside the equivalence band, so the
    # joint verdict is "contradicted" unless the pair test rejects (at about alpha; the test comes
    # first: then the pair is smaller within the margin and the verdict "supported").
    model = {"role": None, "s_min": 100.0, "b_crit": 64.0, "noise_sd": 1e-3, "seed_sd": 0.0}
    summary = {"calibration": {"layout": {"batch_sizes": [8, 16], "n_seeds": 4, "max_steps": 100000,
                                          "reference_b_crit": 64.0,
                                          "methods": {"c": {**model, "role": "corrected"},
                                                      "b": {**model, "role": "baseline"}}}}}
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "target_design_power.py"), str(path),
                           "--layout", "8-1024:4", "--sims", "4", "--json", str(tmp_path / "rates.json")],
                          capture_output=True, text=True, check=True)
    assert "B 8-1024, 4 seeds" in done.stdout
    written = json.loads((tmp_path / "rates.json").read_text())
    assert written["summary_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    rates = written["rows"][0]
    assert rates["batch_sizes"] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert rates["pairs"]["c vs b"][1:] == [1.0, 1.0]
    size = rates["pairs"]["c vs b"][0]
    assert rates["joint"]["supported"] == [size, 1.0, 1.0] and rates["joint"]["contradicted"] == [1 - size, 0.0, 0.0]


def test_a_layout_reads_back_from_its_description():
    from affdiv.experiments.analysis.calibration import TargetLayout, TargetMethod

    layout = TargetLayout((8, 16, 32), 4, 900, {"c": TargetMethod("corrected", 100.0, 20.0, 0.2, 0.05),
                                                "b": TargetMethod("baseline", 90.0, 20.0, 0.1)}, 20.0)
    assert TargetLayout.from_description(json.loads(json.dumps(layout.describe()))) == layout


def test_a_summary_without_a_target_layout_is_refused(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{}")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "target_design_power.py"), str(path),
                           "--layout", "8-64:4"], capture_output=True, text=True)
    assert done.returncode == 2 and "has no steps-to-target calibration layout" in done.stderr

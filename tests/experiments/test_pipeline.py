"""`affdiv falsify` and `affdiv analyse` under bad input, foreign and damaged files, altered data, and
overflowing numbers: one line, exit 2, before any work, and inputs never written."""

import csv
import gzip
import hashlib
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from affdiv.cli import main
from affdiv.experiments.plan import REPORT_FILES

# A grid that trains in a few seconds (tests/presets/quick.toml).
PRESET = (Path(__file__).parents[1] / "presets" / "quick.toml").read_text()


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("preset") / "quick.toml"
    path.write_text(PRESET)
    return path


@pytest.fixture(scope="module")
def quick(preset):
    """The falsify options of the quick grid."""
    return ["--preset", str(preset), "--calibration-sims", "0", "--workers", "1"]


def refused(capsys, argv, *fragments) -> str:
    """Run the CLI; assert exit 2 with exactly one error line (the last), no traceback, naming every
    fragment; return the line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(f"affdiv {argv[0]}: error: ")]
    assert len(lines) == 1 and err.rstrip().splitlines()[-1] == lines[0], err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def execute_sql(path, *statements) -> None:
    """Run ``statements`` on the SQLite file ``path`` (created if missing) and commit."""
    connection = sqlite3.connect(path)
    try:
        for statement in statements:
            connection.execute(statement)
        connection.commit()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, quick):
    """A finished quick sweep: its folder (report, results.sqlite and records.csv)."""
    out = tmp_path_factory.mktemp("quick")
    assert main(["falsify", *quick, "--out", str(out)]) == 0
    return out


def planted_csv(path, rows=None, *, encoding="utf-8", delimiter=","):
    """A CSV with a planted fall of 0.02 per doubling for norm_l2 and none for affine."""
    if rows is None:
        rows = [{"method": m, "batch_size": b, "seed": s,
                 "metric": 0.9 - (0.02 if m == "norm_l2" else 0.0) * (b.bit_length() - 1) + 0.003 * ((s * 7 + b) % 5)}
                for m in ("affine", "norm_l2") for b in (16, 32, 64, 128) for s in range(5)]
    lines = [delimiter.join(rows[0])] + [delimiter.join(str(v) for v in r.values()) for r in rows]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode(encoding))
    return path


# --------------------------------------------------------------------------------- falsify: bad input
FALSIFY_REFUSALS = [
    (["--device", "bogus"], "device 'bogus' (--device or --set device=...): not a torch device"),
    (["--set", "data_options=5"], "data_options must be a table of dataset options"),
    (["--seed", str(2**70)], "--seed must be in [0, 2**64 - 1]"),
    (["--seed", str(2**64 - 1), "--seeds", "2"], "beyond torch's seed range"),
    (["--seed", "-1", "--seeds", "2"], "--seed must be in [0, 2**64 - 1]"),
    # a --set value is named as a setting, not as the option --seed that was not given
    (["--set", f"seed={2**64}"],
     f"error: run setting seed (torch's seed range) must be an integer in [0, {2**64 - 1}], got {2**64}"),
    (["--set", "optimizer='momentum'", "--set", "momentum=-0.5"], "momentum must be a number in [0, 1), got -0.5"),
    (["--set", "seed=[0, -1]"],
     f"error: run setting seed (torch's seed range) must be an integer in [0, {2**64 - 1}], got -1"),
    (["--set", "momentum=nan"], "--set momentum: nan is not a finite number"),
    (["--set", "base_lr=inf"], "--set base_lr: inf is not a finite number"),
    (["--set", "base_lr=1e400"], "--set base_lr: inf is not a finite number"),
    (["--set", "data_options={standardize='none', noise=[1, nan]}"], "--set data_options.noise[1]: nan is not"),
    (["--set", "base_lr='fast'"], "a run setting has the wrong type"),
    (["--calibration-sims", "-1"], "--calibration-sims must be an integer >= 0, got -1"),
    (["--workers", "0"], "--workers must be an integer >= 1, got 0"),
    (["--set", 'activation="relu"\nwidth=3'], "--set takes one KEY=VALUE without a line break, got "
                                              "'activation=\"relu\"\\nwidth=3'; give each setting its own --set"),
]


@pytest.mark.parametrize("extra, message", FALSIFY_REFUSALS)
def test_falsify_refuses_bad_settings_before_creating_the_store(quick, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    refused(capsys, ["falsify", *quick, *extra, "--out", str(out)], message)
    assert not (out / "results.sqlite").exists()


ANALYSIS_REFUSALS = [
    ('group_by = ["lr_rule"]', "group_by must be a non-empty name (a string), got ['lr_rule']"),
    ('group_by = "nosuch"', "group_by 'nosuch' is not a run setting"),
    ('metric = "nosuch"', "metric 'nosuch' is not recorded by the study's runs; they record "),
    ('metric = "steps_to_target"', "metric 'steps_to_target' is not recorded by the study's runs"),
    ('primary_group = "nosuch"', "primary_group 'nosuch' is none of the study's groups ['constant']"),
    ('higher_is_better = "no"', "higher_is_better must be true or false (a TOML boolean, unquoted), got 'no'"),
    ('sensitivity = "true"', "sensitivity must be true or false (a TOML boolean, unquoted), got 'true'"),
    ("seed = -1", "seed (of the bootstrap) must be an integer >= 0, got -1"),
]


@pytest.mark.parametrize("line, message", ANALYSIS_REFUSALS)
def test_falsify_refuses_analysis_settings_before_the_first_run(tmp_path, capsys, line, message):
    preset = tmp_path / "bad.toml"
    preset.write_text(PRESET.replace('metric = "test_accuracy"', line))
    out = tmp_path / "out"
    refused(capsys, ["falsify", "--preset", str(preset), "--calibration-sims", "0", "--out", str(out)],
            "preset 'bad' [analysis] of study 'bad': ", message)
    assert not (out / "results.sqlite").exists()


def test_a_group_by_that_leaves_two_runs_in_a_cell_is_refused_before_the_first_run(tmp_path, capsys):
    preset = tmp_path / "widths.toml"
    preset.write_text(PRESET.replace("seed = [0, 1]", "seed = [0, 1]\nwidth = [8, 16]")
                      .replace('metric = "test_accuracy"', 'group_by = "lr_rule"'))
    refused(capsys, ["falsify", "--preset", str(preset), "--calibration-sims", "0", "--out", str(tmp_path / "out")],
            "group_by 'lr_rule' puts two runs in one cell (lr_rule=constant, method affine, batch size 16, seed 0; "
            "they differ in width)")


def test_a_preset_group_by_is_the_analysis_grouping(tmp_path):
    preset = tmp_path / "grouped.toml"
    preset.write_text(PRESET + 'group_by = "lr_rule"\n')
    assert main(["falsify", "--preset", str(preset), "--calibration-sims", "0", "--workers", "1",
                 "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["group_by"] == "lr_rule" and list(summary["groups"]) == ["constant"]


def test_falsify_refuses_cuda_without_cuda(quick, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(capsys, ["falsify", *quick, "--device", "cuda", "--out", str(tmp_path / "out")],
            "device 'cuda': CUDA is not available on this machine")
    assert not (tmp_path / "out" / "results.sqlite").exists()


def test_falsify_refuses_an_unknown_method_in_the_preset_analysis(tmp_path, capsys):
    preset = tmp_path / "typo.toml"
    preset.write_text('[run]\ndataset = "digits"\nlength = 1\nwidth = 8\n[grid]\nmethod = ["affine", "norm_l2"]\n'
                      'batch_size = [16, 32]\nseed = [0, 1]\n[analysis]\ncorrected = ["norm_12"]\n')
    refused(capsys, ["falsify", "--preset", str(preset), "--out", str(tmp_path / "out")],
            "[analysis] of study 'typo': corrected: unknown method(s) ['norm_12']")
    assert not (tmp_path / "out" / "results.sqlite").exists()


def test_falsify_refuses_unusable_output_paths(quick, tmp_path, capsys, unwritable):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(capsys, ["falsify", *quick, "--out", str(a_file)], f"--out {a_file}: exists and is not a folder")
    locked = unwritable(tmp_path / "locked")
    refused(capsys, ["falsify", *quick, "--out", str(locked)], f"--out {locked}: cannot write in the folder")
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "o1"), "--db", str(tmp_path)],
            f"--db {tmp_path}: is a folder")
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "o2"), "--db", str(a_file)],
            f"--db {a_file}: not an SQLite database")
    clash = tmp_path / "o3" / "summary.json"
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "o3"), "--db", str(clash)],
            f"--db {clash} would be overwritten by the report")
    assert not clash.exists() and a_file.read_text() == "x"


def test_falsify_refuses_a_foreign_database_and_leaves_it_alone(quick, tmp_path, capsys):
    db = tmp_path / "shop.sqlite"
    execute_sql(db, "CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    before = sha256(db)
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "out"), "--db", str(db)],
            f"--db {db}: not an affdiv results store", "tables ['orders']")
    assert sha256(db) == before and listing(tmp_path) == ["shop.sqlite"]  # no empty --out left


# --------------------------------------------------------------- falsify: resume on altered data
def _fashion_copy(folder):
    """Fashion-MNIST as four raw IDX files in ``folder`` (the test images decompressed: a byte of
    them can change without breaking a gzip checksum)."""
    from affdiv.experiments.data.fashion_mnist import FILES, find_fashion_mnist

    try:
        found = find_fashion_mnist(None)
    except (FileNotFoundError, ValueError) as error:
        pytest.skip(f"Fashion-MNIST not installed: {error}")
    folder.mkdir()
    for stem in FILES.values():
        source = next(p for p in found.values() if p.name.startswith(stem))
        target = folder / stem
        if source.suffix == ".gz":
            with gzip.open(source) as raw:
                target.write_bytes(raw.read())
        else:
            shutil.copyfile(source, target)
    return folder


def test_resuming_on_data_that_differs_in_one_byte_is_refused(quick, tmp_path, capsys):
    data = _fashion_copy(tmp_path / "fashion")
    out = tmp_path / "out"
    argv = ["falsify", *quick, "--batch-sizes", "256", "512", "--set", "dataset='fashion-mnist'",
            "--set", "budget='steps'", "--set", "length=2", "--data-dir", str(data), "--out", str(out)]
    assert main(argv) == 0
    db = out / "results.sqlite"
    stored = json.loads((out / "summary.json").read_text())["provenance"]["data_fingerprint"]["fashion-mnist"]
    before = sha256(db)
    capsys.readouterr()

    images = data / "t10k-images-idx3-ubyte"
    altered = bytearray(images.read_bytes())
    altered[16 + 400] ^= 0x01  # one pixel of the first test image, one bit
    images.write_bytes(bytes(altered))
    # Resume (with one more seed) in a new process, as a user would: this one caches the data it loaded.
    done = subprocess.run([sys.executable, "-m", "affdiv", *argv, "--seeds", "3"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr and line.startswith("affdiv falsify: error: ")
    assert f"--db {db} holds runs on dataset 'fashion-mnist'" in line
    assert f"with data fingerprint {stored[0]}, but the data now gives " in line
    now = line.rsplit("the data now gives ", 1)[1].split(":")[0]
    assert len(now) == 64 and now != stored[0]
    assert sha256(db) == before  # nothing trained, nothing written


def test_a_new_seed_on_changed_raw_data_is_refused(quick, tmp_path, capsys, monkeypatch):
    # Each seed draws its own split (data_seed = "seed"), so the data fingerprints of seeds 0-1 and
    # seed 2 differ anyway: only the raw data's hash, recorded by the store, tells the change.
    from affdiv.experiments.runs import sweep

    data = _fashion_copy(tmp_path / "fashion")
    out = tmp_path / "out"
    argv = ["falsify", *quick, "--batch-sizes", "256", "--set", "dataset='fashion-mnist'", "--set", "budget='steps'",
            "--set", "length=1", "--set", "data_seed='seed'", "--data-dir", str(data), "--out", str(out)]
    assert main([*argv, "--seed", "0", "--seeds", "2"]) == 0
    db = out / "results.sqlite"
    before = sha256(db)
    labels = data / "train-labels-idx1-ubyte"
    altered = bytearray(labels.read_bytes())
    altered[8] = (altered[8] + 1) % 10  # the first training label
    labels.write_bytes(bytes(altered))
    monkeypatch.setattr(sweep, "_DATASETS", {})  # load the files again, as a new process would
    refused(capsys, ["falsify", *argv[1:], "--seed", "2", "--seeds", "1"],
            f"--db {db} holds runs trained on dataset 'fashion-mnist' whose raw data had SHA-256 ",
            "the data files changed since those runs")
    assert sha256(db) == before  # nothing trained, nothing written


@pytest.mark.parametrize("older", ["UPDATE run_code SET version = '0.0.1', git_commit = NULL, git_dirty = NULL, "
                                   "cpu = '{\"torch_blas\":\"open\",\"vendor\":\"AuthenticAMD\"}'",
                                   "DROP TABLE run_code"])
def test_a_resumed_store_names_the_code_that_trained_its_runs(quick, quick_run, tmp_path, older):
    from affdiv.provenance import code_identity

    db = tmp_path / "old.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", db)
    execute_sql(db, older)  # runs of another version, or of one that did not record it
    assert main(["falsify", *quick, "--db", str(db), "--out", str(tmp_path / "out")]) == 0
    provenance = json.loads((tmp_path / "out" / "summary.json").read_text())["provenance"]
    assert provenance["runs_resumed_from_db"] == 4 and provenance["version"] == code_identity()["version"]
    version, cpu, shown = ("0.0.1", {"torch_blas": "open", "vendor": "AuthenticAMD"},
                           "affdiv 0.0.1 (no git commit; AuthenticAMD, BLAS open): 4 run(s)") \
        if older.startswith("UPDATE") else (None, None, "not recorded (stored before affdiv recorded it): 4 run(s)")
    assert provenance["run_code"] == [{"version": version, "git_commit": None, "git_dirty": None, "cpu": cpu,
                                       "runs": 4}]
    report = " ".join((tmp_path / "out" / "report.md").read_text().split())
    assert f"The runs were trained by other code than the command that wrote this report ({shown})" in report


def test_a_store_of_one_known_version_has_no_version_caveat(quick_run):
    from affdiv.provenance import code_identity, cpu_identity

    provenance = json.loads((quick_run / "summary.json").read_text())["provenance"]
    assert provenance["run_code"] == [{**code_identity(), "cpu": cpu_identity(), "runs": 4}]
    assert "The runs were trained by" not in (quick_run / "report.md").read_text()


def test_the_report_states_the_share_of_the_runs_time_in_checks(quick_run, tmp_path):
    provenance = json.loads((quick_run / "summary.json").read_text())["provenance"]
    rows = sqlite3.connect(quick_run / "results.sqlite").execute("SELECT seconds, check_seconds FROM runs").fetchall()
    assert len(rows) == 4 and all(0 < checks < seconds for seconds, checks in rows), rows
    share = sum(c for _s, c in rows) / sum(s for s, _c in rows)
    assert provenance["checks"] == {"check_s": round(sum(c for _s, c in rows), 1), "runs_recorded": 4, "runs": 4,
                                    "share": round(share, 4)}
    # the provenance keeps the runs' seconds to 0.1 s and the report states them in whole seconds (from
    # that figure: a total of 0.54 s reads "0 s", not the "1 s" of the raw sum)
    seconds = round(sum(s for s, _c in rows), 1)
    assert provenance["compute_time_s"] == seconds
    report = " ".join((quick_run / "report.md").read_text().split())
    stated = re.search(r"The 4 runs took ([\d,]+) s in all; their checks \(validation reads\) took "
                       r"(\d+\.\d)% of it\.", report)
    assert stated, report
    # the percentage of the share the provenance keeps (to 4 places, checked above against the
    # runs' own seconds), to 0.1: from the exact share it may differ by a rounding
    # (0.021541 -> 0.0215 -> "2.1%", where the exact share reads "2.2%")
    assert stated[1] == f"{seconds:,.0f}" and stated[2] == f"{100 * round(share, 4):.1f}", (stated[0], share)
    report = _analysed_copy(quick_run, tmp_path, "UPDATE runs SET check_seconds = NULL WHERE config_hash IN "
                                                 "(SELECT config_hash FROM runs LIMIT 3)")
    assert "% of it (over the 1 of 4 runs that recorded it; the others were stored before affdiv did)." in report


def _analysed_copy(quick_run, tmp_path, statement: str) -> str:
    """The report (its words) of ``affdiv analyse`` on a copy of the quick sweep's store changed by
    the SQL ``statement``."""
    db = tmp_path / "changed.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", db)
    execute_sql(db, statement)
    assert main(["analyse", "--input", str(db), "--out", str(tmp_path / "out"), "--calibration-sims", "0"]) == 0
    return " ".join((tmp_path / "out" / "report.md").read_text().split())


def test_a_store_of_several_versions_lists_them(quick_run, tmp_path):
    report = _analysed_copy(quick_run, tmp_path,
                            "DELETE FROM run_code WHERE config_hash IN (SELECT config_hash FROM run_code LIMIT 1)")
    assert "The runs were trained by 2 version(s) of affdiv on 1 recorded machine(s) (affdiv " in report
    assert "; not recorded (stored before affdiv recorded it): 1 run(s)): numbers of different versions may " \
           "differ. Rerun" in report

    def one_run_on(folder: str, machine: dict) -> str:  # the report with one run's machine record replaced
        (tmp_path / folder).mkdir()
        return _analysed_copy(quick_run, tmp_path / folder,
                              f"UPDATE run_code SET cpu = '{json.dumps(machine)}' "
                              "WHERE config_hash IN (SELECT config_hash FROM run_code LIMIT 1)")

    # the same code on a machine of another vendor: named, with what differs (a vendor no host has)
    report = one_run_on("machine", {"onednn": False, "torch_blas": "open", "vendor": "SomeVendor"})
    assert "The runs were trained by 1 version(s) of affdiv on 2 recorded machine(s) (affdiv " in report
    assert "; SomeVendor, BLAS open, oneDNN off): 1 run(s)" in report
    assert "so runs of different machines may differ too. Rerun" in report
    # a run on a GPU: the GPU, CUDA and cuDNN are named too
    report = one_run_on("gpu", {"vendor": "SomeVendor", "gpu": "SomeGPU", "gpu_capability": "8.6", "cuda": "12.8",
                                "cudnn": 91002})
    assert "; SomeVendor, GPU SomeGPU (8.6), CUDA 12.8, cuDNN 91002): 1 run(s)" in report
    assert "on a CUDA GPU, by the GPU and CUDA" in report


# --------------------------------------------------------------------------------- analyse: inputs
@pytest.mark.parametrize("margin, shown", [("inf", "inf"), ("nan", "nan"), ("-0.01", "-0.01"), ("0", "0.0")])
def test_analyse_refuses_a_margin_that_is_not_finite_and_positive(tmp_path, capsys, margin, shown):
    path = planted_csv(tmp_path / "runs.csv")
    refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--margin", margin],
            f"margin must be a finite number > 0, got {shown}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--corrected", "--baselines"])
def test_analyse_refuses_method_names_not_in_the_records(tmp_path, capsys, option):
    path = planted_csv(tmp_path / "runs.csv")
    refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / "out"), option, "norm_12", "norm_l2"]
            if option == "--corrected" else
            ["analyse", "--input", str(path), "--out", str(tmp_path / "out"), option, "afine"],
            f"{option}: unknown method(s) ['{'norm_12' if option == '--corrected' else 'afine'}']",
            "the methods in", "are ['affine', 'norm_l2']")


def test_analyse_refuses_named_method_names_even_when_they_are_the_defaults(tmp_path, capsys):
    path = planted_csv(tmp_path / "runs.csv")  # methods affine and norm_l2: no affine_like, no patchnorm
    refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--corrected", "affine_like",
                     "norm_l2", "patchnorm"],
            "--corrected: unknown method(s) ['affine_like', 'patchnorm']", "are ['affine', 'norm_l2']")


def test_analyse_refuses_to_overwrite_its_input(tmp_path, capsys):
    folder = tmp_path / "report"
    folder.mkdir()
    path = planted_csv(folder / "records.csv")
    before = sha256(path)
    refused(capsys, ["analyse", "--input", str(path), "--out", str(folder)],
            f"--input {path} would be overwritten by the report written to {folder} (its records.csv)")
    (folder / "sub").mkdir()
    refused(capsys, ["analyse", "--input", str(path), "--out", str(folder / "sub" / "..")], "would be overwritten")
    link = tmp_path / "link.csv"
    link.symlink_to(path)
    refused(capsys, ["analyse", "--input", str(link), "--out", str(folder)], "would be overwritten")
    assert sha256(path) == before and listing(folder) == ["records.csv", "sub"]


def test_report_files_lists_every_file_the_report_writes(quick_run):
    written = {p.name for p in quick_run.iterdir()} - {"results.sqlite", "results.sqlite-wal", "results.sqlite-shm"}
    assert written <= set(REPORT_FILES), written - set(REPORT_FILES)


def test_analyse_refuses_unusable_paths(tmp_path, capsys, unwritable):
    path = planted_csv(tmp_path / "runs.csv")
    refused(capsys, ["analyse", "--input", str(tmp_path), "--out", str(tmp_path / "o")], "is a folder")
    refused(capsys, ["analyse", "--input", str(path), "--out", str(path)], f"--out {path}: exists and is not a folder")
    locked = unwritable(tmp_path / "locked")
    refused(capsys, ["analyse", "--input", str(path), "--out", str(locked)], f"--out {locked}: cannot write")


def test_a_csv_field_over_the_csv_modules_limit_is_one_line(tmp_path, capsys):
    path = tmp_path / "long.csv"
    path.write_text("method,batch_size,seed,metric,note\naffine,16,0,0.5," + "x" * 131073 + "\n")
    refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / "out")],
            f"{path} line 2: field larger than field limit (131072)")


def test_analyse_reads_csvs_as_spreadsheets_write_them(tmp_path, capsys):
    reference = planted_csv(tmp_path / "plain.csv")
    assert main(["analyse", "--input", str(reference), "--out", str(tmp_path / "plain"),
                 "--calibration-sims", "0"]) == 0
    expected = json.loads((tmp_path / "plain" / "summary.json").read_text())["groups"]
    variants = {
        "bom.csv": dict(encoding="utf-8-sig"),
        "utf16.csv": dict(encoding="utf-16"),  # with its BOM, as Excel's "Unicode text" writes it
        "utf16be.txt": dict(encoding="utf-16-be"),
        "excel.txt": dict(encoding="utf-16", delimiter="\t"),
        "semicolon.csv": dict(encoding="utf-8-sig", delimiter=";"),
    }
    for name, options in variants.items():
        path = planted_csv(tmp_path / name, **options)
        if name == "utf16be.txt":  # no BOM: named, not guessed
            refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / name[:-4])],
                    f"{path}: not UTF-8 text", "it looks like UTF-16 (big-endian) without a byte-order mark")
            continue
        assert main(["analyse", "--input", str(path), "--out", str(tmp_path / name[:-4]),
                     "--calibration-sims", "0"]) == 0, name
        assert json.loads((tmp_path / name[:-4] / "summary.json").read_text())["groups"] == expected, name
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("method,batch_size,seed,metric,note\naffine,16,0,0.5,café\n".encode("latin-1"))
    refused(capsys, ["analyse", "--input", str(latin), "--out", str(tmp_path / "latin")],
            f"{latin}: not valid utf-8 text (byte 0xe9 at offset")


def test_seeds_beyond_int64_stay_distinct(tmp_path):
    # 2**64 - 1 and 2**64 - 2 are distinct seeds; a float64 detour would merge them.
    rows = [{"method": m, "batch_size": b, "seed": 2**64 - 1 - s, "metric": 0.9 - 0.01 * b.bit_length() + 0.001 * s}
            for m in ("affine", "norm_l2") for b in (16, 32, 64) for s in range(4)]
    path = planted_csv(tmp_path / "big.csv", rows)
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--calibration-sims", "0"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    method = summary["groups"]["all"]["methods"]["affine"]
    assert method["n_seeds"] == 4 and method["n_runs"] == 12
    with open(tmp_path / "out" / "records.csv", newline="") as handle:
        assert {int(r["seed"]) for r in csv.DictReader(handle)} == {2**64 - 1 - s for s in range(4)}


def test_overflowing_metrics_make_the_method_inconclusive_with_the_reason(tmp_path):
    # Finite values whose sums overflow: the fit's arithmetic is non-finite. The verdict must say so,
    # never read a NaN slope as a p-value of 0 (which made it "contradicted").
    rows = [{"method": m, "batch_size": b, "seed": s,
             "metric": (1e308 if (s + b.bit_length()) % 2 else -1e308) if m == "norm_l2" else 0.9 - 0.001 * s}
            for m in ("affine", "norm_l2") for b in (16, 32, 64, 128) for s in range(5)]
    path = planted_csv(tmp_path / "huge.csv", rows)
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--calibration-sims", "0",
                 "--margin", "0.01", "--lower-is-better"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    result = summary["groups"]["all"]["methods"]["norm_l2"]
    assert result["verdict"] == "inconclusive"
    assert "non-finite arithmetic" in result["reason"]
    assert result["status"].startswith("non-finite arithmetic")
    assert all(t.get("p") is None or 0 < t["p"] for t in result.get("tests", {}).values())


# ------------------------------------------------------------------ analyse: steps to target, imports
def target_csv(path, budgets=("target",)):
    """A CSV of steps-to-target runs (S = 100 (1 + B_crit/B), B_crit 64 for affine, 32 for norm_l2,
    one run censored at max_steps); ``budgets`` cycles over the rows' budget column."""
    lines = ["method,batch_size,seed,steps_to_target,max_steps,budget"]
    for i, (m, b, s) in enumerate((m, b, s) for m in ("affine", "norm_l2") for b in (16, 64, 256) for s in range(3)):
        steps = "" if (m, b, s) == ("affine", 16, 2) else round(100 * (1 + (64 if m == "affine" else 32) / b) *
                                                                (1 + 0.05 * ((s * 7 + b) % 3)))
        lines.append(f"{m},{b},{s},{steps},600,{budgets[i % len(budgets)]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_analyse_defaults_to_steps_to_target_on_target_runs(tmp_path):
    path = target_csv(tmp_path / "target.csv")
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--calibration-sims", "0"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["design"] == "steps_to_target"
    assert summary["provenance"]["metric"] == "steps_to_target"
    assert set(summary["critical_batch"]) == {"affine", "norm_l2"}


def test_analyse_refuses_target_runs_mixed_with_others_without_a_metric(tmp_path, capsys):
    path = target_csv(tmp_path / "mixed.csv", budgets=("target", "steps"))
    refused(capsys, ["analyse", "--input", str(path), "--out", str(tmp_path / "out")],
            f"--input {path}: records of budget 'target' mixed with budget(s) ['steps']; pass --metric")
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--metric", "steps_to_target",
                 "--calibration-sims", "0"]) == 0


ANALYSE_A_CSV = """
import json, sys
from affdiv.experiments.pipeline import analyse_file
analyse_file(sys.argv[1], sys.argv[2], calibration_sims=0)
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("affdiv.experiments.runs."))))
"""


def _modules_after_analysing_a_csv(tmp_path) -> list[str]:
    path = planted_csv(tmp_path / "runs.csv")
    done = subprocess.run([sys.executable, "-c", ANALYSE_A_CSV, str(path), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_analysing_a_csv_imports_none_of_the_sweeps_modules(tmp_path):
    imported = _modules_after_analysing_a_csv(tmp_path)
    assert not {f"affdiv.experiments.runs.{m}" for m in ("sweep", "store", "training", "presets", "ensembles")} & \
        set(imported), imported


def test_analysing_a_csv_does_not_import_torch(tmp_path):
    assert "torch" not in _modules_after_analysing_a_csv(tmp_path)


# ------------------------------------------------------------------------- analyse: a store, read-only
def test_analyse_reads_a_read_only_store_without_changing_it(quick_run, tmp_path, capsys, unwritable):
    folder = tmp_path / "frozen"
    folder.mkdir()
    store = folder / "results.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", store)
    before = sha256(store)
    unwritable(store)
    unwritable(folder)
    out = tmp_path / "out"
    assert main(["analyse", "--input", str(store), "--out", str(out), "--calibration-sims", "0"]) == 0
    assert sha256(store) == before and listing(folder) == ["results.sqlite"]  # no -wal, no -shm
    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["input_sha256"] == before
    stored = json.loads((quick_run / "summary.json").read_text())["provenance"]["data_fingerprint"]
    assert summary["provenance"]["data_fingerprint"] == stored  # the data the runs trained on
    expected = json.loads((quick_run / "summary.json").read_text())
    assert summary["groups"] == expected["groups"]


def test_analyse_reads_a_store_written_before_the_application_id(quick_run, tmp_path):
    legacy = tmp_path / "old.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", legacy)
    execute_sql(legacy, "PRAGMA application_id = 0", "PRAGMA journal_mode = DELETE", "DROP TABLE raw_data",
                "DROP TABLE run_code")  # the runs table alone, as such a store has it
    before = sha256(legacy)
    assert main(["analyse", "--input", str(legacy), "--out", str(tmp_path / "out"), "--calibration-sims", "0"]) == 0
    assert sha256(legacy) == before and listing(tmp_path) == ["old.sqlite", "out"]  # no WAL switch, no mark


def test_analyse_refuses_a_foreign_database_and_leaves_it_alone(tmp_path, capsys):
    db = tmp_path / "shop.sqlite"
    execute_sql(db, "CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    before = sha256(db)
    refused(capsys, ["analyse", "--input", str(db), "--out", str(tmp_path / "out")],
            f"--input {db}: not an affdiv results store (SQLite application_id 0x0, tables ['orders'])")
    assert sha256(db) == before and listing(tmp_path) == ["shop.sqlite"]  # no empty --out left
    connection = sqlite3.connect(db)
    assert connection.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # no WAL switch
    assert [r[0] for r in connection.execute("SELECT name FROM sqlite_master")] == ["orders"]  # no runs table
    connection.close()


def test_truncated_and_tampered_stores_are_one_line_errors(quick_run, tmp_path, capsys):
    data = (quick_run / "results.sqlite").read_bytes()
    store = tmp_path / "damaged.sqlite"
    for size in (len(data) // 2, 4096, 150):
        store.write_bytes(data[:size])
        refused(capsys, ["analyse", "--input", str(store), "--out", str(tmp_path / "out"), "--calibration-sims", "0"],
                f"--input {store}: ", "damaged")
    # Bytes flipped across the file: each run ends in a report or in one error line, never a traceback.
    outcomes = {0: 0, 2: 0}
    for position in range(0, len(data), max(1, len(data) // 12)):
        tampered = bytearray(data)
        tampered[position] ^= 0xFF
        store.write_bytes(bytes(tampered))
        code = main(["analyse", "--input", str(store), "--out", str(tmp_path / "out"), "--calibration-sims", "0"])
        err = capsys.readouterr().err
        assert code in outcomes and "Traceback" not in err, err
        if code == 2:
            assert err.rstrip().splitlines()[-1].startswith("affdiv analyse: error: ")
        outcomes[code] += 1
    assert outcomes[2] > 0


# --------------------------------------------------------------------------- the other commands
def test_bench_checks_its_json_path_and_backend_before_timing(tmp_path, capsys, monkeypatch, unwritable):
    from affdiv.layers import benchmark

    def no_timing(**_kwargs):
        raise AssertionError("timing started before the settings were checked")

    monkeypatch.setattr(benchmark, "run", no_timing)
    locked = unwritable(tmp_path / "locked")
    refused(capsys, ["bench", "layers", "--quick", "--json", str(locked / "b.json")],
            f"--json {locked / 'b.json'}: cannot write in its folder {locked}")
    refused(capsys, ["bench", "layers", "--quick", "--json", str(tmp_path)], f"--json {tmp_path}: is a folder")
    refused(capsys, ["bench", "layers", "--quick", "--compile-backend", "inductr"],
            "--compile-backend 'inductr': not a torch.compile backend; expected one of:", "inductor")


def test_verify_checks_its_report_paths_before_the_checks(tmp_path, capsys, monkeypatch, unwritable):
    def no_checks(*_args, **_kwargs):
        raise AssertionError("the checks ran before the report paths were checked")

    monkeypatch.setattr("affdiv.verify.checks.run_checks", no_checks)
    locked = unwritable(tmp_path / "locked")
    for option in ("--json", "--markdown", "--latex"):
        refused(capsys, ["verify", "--only", "affine", option, str(locked / "v.out")],
                f"{option} {locked / 'v.out'}: cannot write in its folder {locked}")
    read_only = tmp_path / "v.json"
    read_only.write_text("{}")
    unwritable(read_only)
    refused(capsys, ["verify", "--only", "affine", "--json", str(read_only)], "the file is read-only")


def test_bad_input_has_no_traceback_in_a_real_process(tmp_path):
    # The whole path a user takes: python -m affdiv, stderr as a terminal would show it.
    path = planted_csv(tmp_path / "runs.csv")
    done = subprocess.run([sys.executable, "-m", "affdiv", "analyse", "--input", str(path), "--out",
                           str(tmp_path / "out"), "--margin", "inf"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["affdiv analyse: error: --margin must be a finite number > 0, "
                                                "got inf"]


def test_falsify_refuses_a_damaged_store_before_training(quick, quick_run, tmp_path, capsys):
    store = tmp_path / "results.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", store)
    execute_sql(store, "UPDATE runs SET config = replace(config, '\"width\":8', '\"width\":9')")
    before = sha256(store)
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "out"), "--db", str(store)],
            f"--db {store}: run ", "its config does not hash to its key")
    assert sha256(store) == before
    store.write_bytes(store.read_bytes()[:3000])
    refused(capsys, ["falsify", *quick, "--out", str(tmp_path / "out"), "--db", str(store)], f"--db {store}: ",
            "damaged")


# ---------------------------------------------------------------------------- falsify --probe-every
def test_falsify_probe_every_keeps_divergence_measurements_and_their_record_columns(tmp_path, quick, capsys):
    from affdiv.experiments.runs.store import ResultStore

    plain, probed = tmp_path / "plain", tmp_path / "probed"
    refused(capsys, ["falsify", *quick, "--out", str(probed), "--probe-every", "0"], "--probe-every must be")
    assert not probed.exists() or "results.sqlite" not in listing(probed)
    # one seed first, to resume below
    assert main(["falsify", *quick, "--seeds", "1", "--out", str(probed), "--probe-every", "5"]) == 0
    refused(capsys, ["falsify", *quick, "--out", str(probed), "--probe-every", "7"],
            "measured with --probe-every 5", "resuming with --probe-every 7")
    assert main(["falsify", *quick, "--out", str(probed), "--probe-every", "5"]) == 0
    assert main(["falsify", *quick, "--seeds", "1", "--out", str(plain)]) == 0
    capsys.readouterr()
    with ResultStore(probed / "results.sqlite", read_only=True) as store:
        measured = store.measurements()
        assert len(store.finished()) == 4 and set(measured) == store.finished()
        for runs in measured.values():
            steps = [m["step"] for m in runs]
            assert steps[:2] == [0, 5] and all(m["measurement"] == "divergence" for m in runs)
    with ResultStore(plain / "results.sqlite", read_only=True) as store:
        assert store.measurements() == {}
        assert store.finished() < set(measured)  # the probe does not change a run's key
    with open(probed / "records.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4
    for column in ("off_diagonal_share_init", "off_diagonal_share_last", "cosine_init", "cosine_last",
                   "diagonal_scale_cv_last", "divergence_last_step"):
        assert all(row[column] not in ("", None) for row in rows), column
    assert json.loads((probed / "summary.json").read_text())["provenance"]["probe_every"] == 5


@pytest.mark.parametrize("setting, value", [("contrast_margin", 0.0), ("contrast_margin", float("inf")),
                                            ("test_baselines", "yes")])
def test_bad_contrast_settings_are_refused_before_work(setting, value):
    from affdiv.experiments.analysis.settings import AnalysisSettings

    with pytest.raises(ValueError, match=f"analyse: {setting} must be"):
        AnalysisSettings.from_mapping({setting: value}, where="analyse")


def test_a_preset_path_that_is_missing_or_not_toml_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("a = [\n")
    assert main(["falsify", "--preset", str(tmp_path / "nope.toml"), "--out", str(tmp_path / "o1")]) == 2
    assert f"--preset {tmp_path / 'nope.toml'}: no such file" in capsys.readouterr().err
    assert main(["falsify", "--preset", str(bad), "--out", str(tmp_path / "o2")]) == 2
    assert f"preset {bad}: not valid TOML" in capsys.readouterr().err


def test_a_model_factory_that_raises_is_a_one_line_error(tmp_path, capsys):
    assert main(["probe", "--model", "json:loads", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["affdiv probe: error: --model 'json:loads': the factory failed: TypeError: "
                   "loads() missing 1 required positional argument: 's'"]


# ------------------------------------------------------------------- refused commands leave nothing
def test_refused_commands_leave_no_output_folder(quick, tmp_path, capsys):
    long_csv = tmp_path / "long.csv"
    long_csv.write_text("method,batch_size,seed,metric,note\naffine,16,0,0.5," + "x" * 131073 + "\n")
    (tmp_path / "folder.sqlite").mkdir()
    out = tmp_path / "new" / "out"  # two folders that do not exist yet
    for argv, message in [
        (["falsify", *quick, "--set", "data_options={nosuch=1}"], "unknown option(s) nosuch"),
        (["falsify", *quick, "--db", str(tmp_path / "folder.sqlite")], "is a folder"),
        (["analyse", "--input", str(planted_csv(tmp_path / "runs.csv")), "--corrected", "nosuch"],
         "--corrected: unknown method(s) ['nosuch']"),
        (["analyse", "--input", str(long_csv)], "field larger than field limit"),
    ]:
        refused(capsys, [*argv, "--out", str(out)], message)
        assert not (tmp_path / "new").exists(), argv
    existing = tmp_path / "existing"
    existing.mkdir()
    refused(capsys, ["analyse", "--input", str(long_csv), "--out", str(existing / "out")], "field larger")
    assert listing(existing) == []  # the folder that was there stays, the one made for the report goes


@pytest.mark.parametrize("content, message", [
    (b"", "preset 'bad': run setting(s) ['dataset', 'method', 'batch_size', 'seed'] missing; every run needs"),
    (b'description = "caf\xe9"\n', "bad.toml: not UTF-8 text (byte 0xe9 at offset 18); a TOML preset is UTF-8"),
])
def test_a_preset_without_runs_or_not_utf8_is_named(tmp_path, capsys, content, message):
    preset = tmp_path / "bad.toml"
    preset.write_bytes(content)
    refused(capsys, ["falsify", "--preset", str(preset), "--out", str(tmp_path / "out")], message)


def test_a_store_whose_runs_table_has_other_columns_is_not_called_damaged(quick_run, tmp_path, capsys):
    db = tmp_path / "other.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", db)
    execute_sql(db, "ALTER TABLE runs ADD COLUMN later TEXT")  # as a later version might
    line = refused(capsys, ["analyse", "--input", str(db), "--out", str(tmp_path / "out")],
                   "whose runs table has columns ['config_hash', ", "'later']", "a store of another version of affdiv")
    assert "damaged" not in line


def test_a_target_csv_without_a_budget_column_is_told_by_its_columns(tmp_path):
    path = target_csv(tmp_path / "target.csv")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(line.rsplit(",", 1)[0] + ("," + ("censored" if i == 0 else "0" if line.split(",")[3]
                                                                else "1"))
                              for i, line in enumerate(lines)) + "\n")  # budget column out, censored in
    assert "budget" not in path.read_text() and "censored" in path.read_text()
    assert main(["analyse", "--input", str(path), "--out", str(tmp_path / "out"), "--calibration-sims", "0"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["design"] == "steps_to_target" and summary["provenance"]["metric"] == "steps_to_target"


def test_a_group_with_fewer_seeds_does_not_decide_for_the_study(tmp_path):
    # Two groups told apart by a width column (no lr_rule column): width 16 run with 5 seeds, width 8
    # with 1. The first in sorted order ("width=16") is also the one with most seeds in one layout,
    # so each layout is tried: the 5-seed group decides in both.
    for few, many in ((8, 16), (16, 8)):
        rows = [{"method": m, "batch_size": b, "seed": s, "width": w,
                 "metric": 0.9 - (0.02 if m == "norm_l2" else 0.0) * (b.bit_length() - 1) + 0.003 * ((s * 7 + b) % 5)}
                for w, seeds in ((few, 1), (many, 5)) for m in ("affine", "norm_l2") for b in (16, 32, 64, 128)
                for s in range(seeds)]
        path = planted_csv(tmp_path / f"groups{few}.csv", rows)
        out = tmp_path / f"out{few}"
        assert main(["analyse", "--input", str(path), "--out", str(out), "--calibration-sims", "0"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert sorted(summary["groups"]) == sorted([f"width={few}", f"width={many}"])  # no "lr_rule=None"
        assert summary["primary_group"] == f"width={many}"


# --------------------------------------------------------- the machine: locks, a full disk, links, Ctrl-C
def test_a_second_sweep_on_a_store_being_written_trains_nothing(quick, quick_run, tmp_path, capsys):
    from affdiv.experiments.runs.store import ResultStore

    db = tmp_path / "results.sqlite"
    shutil.copyfile(quick_run / "results.sqlite", db)
    execute_sql(db, "DELETE FROM runs WHERE config_hash IN (SELECT config_hash FROM runs LIMIT 2)")
    with ResultStore(db) as first:  # a sweep of the same runs, writing
        before = first.finished()
        refused(capsys, ["falsify", *quick, "--out", str(tmp_path)],
                f"--db {db}: another process is writing this results store", "or use another results store")
        assert first.finished() == before and len(before) == 2  # the second sweep trained nothing


def test_a_full_disk_under_the_report_is_one_line_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    import errno

    from affdiv import atomic

    def full(_handle):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    out = tmp_path / "out"
    refused(capsys, ["analyse", "--input", str(planted_csv(tmp_path / "runs.csv")), "--out", str(out),
                     "--calibration-sims", "0"], "No space left on device (free some space, then run the same command")
    assert not out.exists()


@pytest.mark.parametrize("target, reason", [("loop", "a symbolic link that points back to itself (a loop)"),
                                            ("elsewhere", "a symbolic link to ")])
def test_an_out_folder_that_is_a_broken_link_is_named(tmp_path, capsys, target, reason):
    link = tmp_path / "link"
    link.symlink_to(link if target == "loop" else tmp_path / target)
    refused(capsys, ["analyse", "--input", str(planted_csv(tmp_path / "runs.csv")), "--out", str(link)],
            f"--out {link}: the folder is {reason}", "remove the link or point it at a folder")


def test_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    from affdiv.experiments import pipeline

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "analyse_file", interrupted)
    out = tmp_path / "out"
    assert main(["analyse", "--input", str(planted_csv(tmp_path / "runs.csv")), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "affdiv analyse: interrupted (what was finished is kept: a results store resumes with the " \
                          "same command)"
    assert not out.exists()


def test_a_model_whose_forward_raises_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_model.py").write_text(
        "import torch\n\n\nclass Broken(torch.nn.Linear):\n    def forward(self, x):\n"
        "        raise RuntimeError('shapes do not match')\n\n\ndef make():\n    return Broken(64, 10)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refused(capsys, ["probe", "--model", "broken_model:make", "--out", str(tmp_path / "p")],
            "model 'broken_model:make': its forward failed on a batch of shape (2, 1, 8, 8): RuntimeError: shapes do "
            "not match")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("line, named", [("sensitivity = true", "sensitivity"), ("margin = 0.01", "margin"),
                                         ("higher_is_better = true", "higher_is_better")])
def test_fixed_budget_settings_of_a_target_study_are_refused_not_ignored(tmp_path, capsys, line, named):
    preset = tmp_path / "target.toml"
    preset.write_text(PRESET.replace('budget = "epochs"', 'budget = "target"\ntarget = 0.5')
                      .replace('metric = "test_accuracy"', line))
    out = tmp_path / "out"
    refused(capsys, ["falsify", "--preset", str(preset), "--calibration-sims", "0", "--out", str(out)],
            f"[analysis] of study 'target': {named} do(es) not apply to the steps-to-target analysis")
    assert not out.exists()

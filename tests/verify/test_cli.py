"""`affdiv verify` end to end: rows, exit status, the three report files."""

import dataclasses
import json

import pytest

from affdiv import cli
from affdiv.theory import derivation as derivation_module
from affdiv.theory import registry


def test_verify_writes_three_reports_and_passes(tmp_path, capsys):
    paths = {k: tmp_path / f"v.{k}" for k in ("json", "md", "tex")}
    status = cli.main(
        ["verify", "-v", "--only", "affine", "affine_like", "--seeds", "1",
         "--json", str(paths["json"]), "--markdown", str(paths["md"]), "--latex", str(paths["tex"])]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "PASS  affine_like/update" in out and "FAIL" not in out
    record = json.loads(paths["json"].read_text())
    assert {"name", "passed", "max_rel_err", "tol"} <= set(record["checks"][0])
    assert {"version", "git_commit", "libraries", "seeds", "time_utc", "platform"} <= set(record["provenance"])
    assert record["summary"]["failed"] == 0 and record["summary"]["total"] == len(record["checks"])
    assert "| `affine_like/update`" in paths["md"].read_text()
    assert r"\begin{tabularx}" in paths["tex"].read_text() and r"affine\_\allowbreak{}like" in paths["tex"].read_text()


def test_verify_exits_nonzero_when_a_check_fails(monkeypatch, capsys):
    good = registry()["affine"]
    wrong = dataclasses.replace(good, name="planted_wrong", predict=lambda case, g, lr: -lr * g)  # K = 1
    monkeypatch.setitem(derivation_module._REGISTRY, "planted_wrong", wrong)
    status = cli.main(["verify", "--only", "planted_wrong", "--seeds", "1"])
    assert status == 1
    assert "FAIL  planted_wrong/update" in capsys.readouterr().out


def test_unknown_derivation_is_named(capsys):
    assert cli.main(["verify", "--only", "nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("affdiv verify: error: --only: unknown derivation(s) ['nonexistent']")
    assert "affine_like" in err


def test_misspelled_command_module_raises(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "verify", ("affdiv.verify.clii", "misspelled"))
    with pytest.raises(ModuleNotFoundError, match="affdiv.verify.clii"):
        cli.build_parser("verify")


def test_verify_progress_leaves_no_carriage_returns_in_a_log_and_summarises_proofs():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "affdiv.cli", "verify", "--only", "affine", "--seeds", "1"],
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    assert b"\r" not in done.stderr and b"\r" not in done.stdout
    last = done.stdout.decode().splitlines()[-1]
    assert "derivations: " in last and "derivations proven" not in last
    assert "PROOF STEP FAILS" not in done.stderr.decode()


def test_verify_list_aligns_names(capsys):
    assert cli.main(["verify", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    width = max(len(name) for name in registry())
    assert lines and all(line[width:width + 2] == "  " and line[width + 2] != " " for line in lines)


def test_verify_prints_one_line_per_derivation_unless_verbose(tmp_path, capsys):
    outputs, records = {}, {}
    for mode in ("default", "--verbose"):
        path = tmp_path / f"{mode}.json"
        argv = ["verify", "--only", "affine_like", "--seeds", "1", "--json", str(path)]
        assert cli.main(argv + ([mode] if mode != "default" else [])) == 0
        outputs[mode] = capsys.readouterr().out.splitlines()
        records[mode] = {k: v for k, v in json.loads(path.read_text()).items() if k != "provenance"}
    line, summary = outputs["default"]  # the derivation's line and the summary: nothing else
    assert line.startswith("PASS  affine_like ") and "proof: 3/3 steps hold; checks: 12/12 passed" in line
    assert summary.startswith("12 passed, 0 failed")
    verbose = outputs["--verbose"]
    assert sum(row.startswith("PASS  affine_like/proof") for row in verbose) == 3
    assert sum(row.startswith("PASS  affine_like/") for row in verbose) == 3 + 12
    assert line in verbose and verbose[-1].startswith("12 passed, 0 failed")
    assert records["default"] == records["--verbose"]  # the reports do not depend on what is printed

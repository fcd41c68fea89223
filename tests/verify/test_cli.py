"""`affdiv verify` end to end: rows, exit status, the three report files."""

import dataclasses
import json
import subprocess

import pytest

from affdiv import cli, provenance
from affdiv.theory import derivation as derivation_module
from affdiv.theory import registry


def test_verify_writes_three_reports_and_passes(tmp_path, capsys):
    paths = {k: tmp_path / f"v.{k}" for k in ("json", "md", "tex")}
    status = cli.main(
        ["verify", "--only", "affine", "affine_like", "--seeds", "1",
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
    assert r"\begin{tabular}" in paths["tex"].read_text() and r"affine\_like" in paths["tex"].read_text()


def test_verify_exits_nonzero_when_a_check_fails(monkeypatch, capsys):
    good = registry()["affine"]
    wrong = dataclasses.replace(good, name="planted_wrong", predict=lambda case, g, lr: -lr * g)  # K = 1
    monkeypatch.setitem(derivation_module._REGISTRY, "planted_wrong", wrong)
    status = cli.main(["verify", "--only", "planted_wrong", "--seeds", "1"])
    assert status == 1
    assert "FAIL  planted_wrong/update" in capsys.readouterr().out


def test_unknown_derivation_is_named(capsys):
    try:
        cli.main(["verify", "--only", "nonexistent"])
    except SystemExit as exit:
        assert "nonexistent" in str(exit.code) and "affine_like" in str(exit.code)
    else:
        raise AssertionError("expected SystemExit")


def test_latex_table_escapes_and_prints_the_tolerance(tmp_path):
    path = tmp_path / "v.tex"
    assert cli.main(["verify", "--only", "affine", "--seeds", "1", "--latex", str(path)]) == 0
    text = path.read_text()
    assert r"Min.\ tol." in text
    row = next(line for line in text.splitlines() if line.startswith("affine & ") and "linearity" in line)
    assert row.count("&") == 6 and r"\times10^{-10}" in row  # the linearity tolerance TOL + rounding ≈ 1e-10


def test_latex_escape_covers_every_special_character():
    from affdiv.verify.latex import escape

    assert escape(r"a_b%c&d$e#f{g}h~i^j\k") == (
        r"a\_b\%c\&d\$e\#f\{g\}h\textasciitilde{}i\textasciicircum{}j\textbackslash{}k"
    )


def test_misspelled_command_module_raises(monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", cli.COMMAND_MODULES + ("affdiv.verify.clii",))
    with pytest.raises(ModuleNotFoundError, match="affdiv.verify.clii"):
        cli.build_parser()


def test_git_commit_tries_the_next_place_then_the_environment(monkeypatch):
    """An OSError (no git, vanished directory) moves on instead of giving up."""
    calls = []

    def no_git(*args, **kwargs):
        calls.append(kwargs["cwd"])
        raise OSError("git not found")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.setenv("AFFDIV_GIT_COMMIT", "abc123")
    assert provenance.git_commit() == "abc123"
    assert len(calls) == 2

"""The README's worked example of adding a derivation is real: its code block, run as written,
registers a derivation that `affdiv verify --only` proves and checks, and a wrong closed form fails."""

import dataclasses
import re
from pathlib import Path

import pytest

from affdiv import cli
from affdiv.theory import derivation as derivation_module

README = Path(__file__).resolve().parents[2] / "README.md"


def _example_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("### Adding your own derivation", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in the README's 'Adding your own derivation' section"
    return match.group(1)


@pytest.fixture
def example(monkeypatch):
    """Run the README block against a copy of the registry (restored afterwards)."""
    monkeypatch.setattr(derivation_module, "_REGISTRY", dict(derivation_module._REGISTRY))
    exec(compile(_example_code(), "README.md (Adding your own derivation)", "exec"), {"__name__": "my_derivation"})
    return derivation_module.registry()["linear_no_bias"]


def test_the_example_is_proven_and_passes_every_check(example, tmp_path, capsys):
    status = cli.main(["verify", "-v", "--only", "linear_no_bias", "--seeds", "1", "--markdown",
                       str(tmp_path / "v.md")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "PASS  linear_no_bias/proof" in out and "FAIL" not in out
    for check in ("update", "diagonal", "linearity"):
        assert f"PASS  linear_no_bias/{check}" in out
    assert "### `linear_no_bias` — proven" in (tmp_path / "v.md").read_text()


def test_a_wrong_closed_form_fails(example, monkeypatch, capsys):
    wrong = dataclasses.replace(example, predict=lambda case, grad_output, lr: -lr * grad_output)
    monkeypatch.setitem(derivation_module._REGISTRY, "linear_no_bias", wrong)
    assert cli.main(["verify", "-v", "--only", "linear_no_bias", "--seeds", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  linear_no_bias/update" in out and "PASS  linear_no_bias/diagonal" in out

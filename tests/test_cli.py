"""The root command line's conventions: lazy imports, one error format, exit codes, `python -m affdiv`."""

import subprocess
import sys

import pytest

from affdiv import __version__
from affdiv.cli import COMMANDS, build_parser, main

# Runs `python -m affdiv ARGV` with every import outside the standard library and affdiv refused (as in an
# environment with nothing but affdiv installed: no extra, not even numpy or torch), then names on stderr the
# top-level modules outside those that the run imported.
_BARE = """\
import runpy, sys
allowed = set(sys.stdlib_module_names) | {"affdiv"}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in allowed:
            raise ModuleNotFoundError(f"No module named {name!r} (refused)", name=name)
sys.meta_path.insert(0, Refuse())
before = set(sys.modules)
sys.argv = ["affdiv", *sys.argv[1:]]
try:
    runpy.run_module("affdiv", run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    code = exit_.code
else:
    code = 0
print("OUTSIDE", sorted({m.partition(".")[0] for m in set(sys.modules) - before} - allowed), file=sys.stderr)
sys.exit(code)
"""

HELP_ARGVS = [["--help"], ["--version"], *([name, "--help"] for name in COMMANDS), ["bench", "layers", "--help"]]


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=" ".join)
def test_help_needs_nothing_outside_the_standard_library(argv):
    """`affdiv [CMD] --help` and `--version`, each in a fresh process, answer (exit 0) with every module outside
    the standard library refused: no extra and no torch, numpy or sympy is imported before the options are parsed."""
    done = subprocess.run([sys.executable, "-c", _BARE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "OUTSIDE []"
    if argv == ["--version"]:
        assert done.stdout.strip() == f"affdiv {__version__}"
    else:
        assert done.stdout.startswith(f"usage: affdiv {' '.join(argv[:-1])}".rstrip())
    if argv[0] == "probe":
        assert "factory(input_shape=" in done.stdout  # the probe's help says how to pass one's own model


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_python_dash_m_affdiv_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "affdiv", "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"affdiv {__version__}"


def test_every_command_module_registers_what_the_table_says():
    parser = build_parser("all")
    registered = parser._subparsers._group_actions[0].choices  # argparse keeps no public accessor
    assert set(registered) == set(COMMANDS)


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_bad_input_is_one_line_exit_2_without_traceback():
    done = subprocess.run([sys.executable, "-m", "affdiv", "verify", "--only", "no_such_derivation"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("affdiv verify: error: --only: unknown derivation(s)")
    assert "Traceback" not in done.stderr

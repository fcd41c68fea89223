"""The root command line's conventions: lazy imports, one error format, exit codes, `python -m affdiv`."""

import subprocess
import sys

import pytest

from affdiv import __version__
from affdiv.cli import COMMANDS, build_parser, main


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version_import_neither_torch_nor_sympy(argv):
    done = _python(
        "import sys\nfrom affdiv.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'sympy', 'numpy', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy)"
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout


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


def test_every_command_help_is_light_and_needs_no_extra():
    """Every `affdiv CMD --help` with every extra blocked: exit 0, and neither torch nor sympy imported."""
    commands = [[name, "--help"] for name in COMMANDS] + [["bench", "layers", "--help"]]
    done = _python(
        "import sys\n"
        "for m in ('sympy', 'scipy', 'matplotlib', 'sklearn', 'statsmodels', 'tqdm', 'dask', 'distributed'):\n"
        "    sys.modules[m] = None\n"
        "from affdiv.cli import main\n"
        f"for argv in {commands!r}:\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
        "    else:\n        raise AssertionError(argv)\n"
        "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy)"
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout and "factory(input_shape=" in done.stdout  # the probe's help says how

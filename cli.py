"""The `affdiv` command line and its conventions.

Every subcommand lives in the module that owns its work (``COMMANDS``); that module's
``register(subparsers)`` adds its parsers and sets ``func(args) -> int``. Only the module of the
command being run is loaded, from its file and without its package's ``__init__`` (which imports
torch, or checks for an extra): the module's top level imports the standard library and the
light root modules only, and its commands import their work when they run. So ``affdiv --help``,
``affdiv --version`` and every ``affdiv CMD --help`` answer without importing torch or sympy, and
without any extra installed.

Exit status, the same for every command: 0 success; 1 a check or test failed (the command says
which); 2 bad input — an argparse usage error, a missing optional dependency group
(:class:`affdiv._extras.MissingExtra`, naming the extra to install), or a ``ValueError`` or missing,
unreadable or unwritable file raised by the command, printed as one line
``affdiv CMD: error: ...`` without a traceback; so is an OSError the machine raises (a full disk, a
read-only file system, a symbolic-link loop: ``_MACHINE``), with what to do. Ctrl-C prints one
line and exits with 130. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from affdiv import __version__
from affdiv._extras import MissingExtra

# command -> (module that registers it, one-line help shown by `affdiv --help`)
COMMANDS = {
    "verify": ("affdiv.verify.cli", "check every derivation: its proof steps, autograd and a real SGD step"),
    "falsify": ("affdiv.experiments.cli", "run (or resume) a preset's sweep and write its falsification report"),
    "analyse": ("affdiv.experiments.cli", "analyse a CSV (method, batch_size, seed, metric) or a results database"),
    "probe": ("affdiv.experiments.cli", "measure the update alignment behind the batch-size prediction"),
    "map": ("affdiv.experiments.cli", "the verdict map: every pair's B_crit ratio at every target of ladder studies"),
    "bench": ("affdiv.layers.cli", "timing benchmarks of the corrected layers"),
}

# Errors that mean "the input is bad", not "the program is wrong".
_BAD_INPUT = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
              PermissionError)
# What the machine refuses (an OSError with one of these errno values), with what to do about it.
_MACHINE = {errno.ENOSPC: "free some space, then run the same command again",
            errno.EDQUOT: "free some space within the quota, then run the same command again",
            errno.EROFS: "choose a writable location",
            errno.ELOOP: "a symbolic link in the path points back to itself; fix or remove it",
            errno.ENAMETOOLONG: "choose a shorter path"}


def _machine_error(error: OSError) -> str:
    """One line for an OSError of :data:`_MACHINE`: the file, the system's reason and the fix."""
    where = f"{error.filename}: " if error.filename else ""
    return f"{where}{error.strerror or error} ({_MACHINE[error.errno]})"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s module registered in full and the other commands as entries
    of the help list only (every module in full when ``command`` is ``"all"``)."""
    parser = argparse.ArgumentParser(
        prog="affdiv",
        description="The affine divergence under numerical test (arXiv 2512.22247).",
    )
    parser.add_argument("--version", action="version", version=f"affdiv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    if command == "all":
        modules = {module for module, _ in COMMANDS.values()}
    else:
        modules = {COMMANDS[command][0]} if command in COMMANDS else set()
    for module in sorted(modules):
        command_module(module).register(subparsers)
    registered = set(subparsers.choices)
    for name, (_, text) in COMMANDS.items():
        if name not in registered:
            subparsers.add_parser(name, help=text)
    return parser


def command_module(name: str) -> ModuleType:
    """The module ``name`` (``affdiv.<package>.cli``), loaded from its file without importing its
    package first (see the module docstring); the one already imported where there is one."""
    if name in sys.modules:
        return sys.modules[name]
    if name.rpartition(".")[0] in sys.modules:  # its package is imported already: the usual way
        return importlib.import_module(name)
    path = Path(__file__).resolve().parent.joinpath(*name.split(".")[1:]).with_suffix(".py")
    if not path.is_file():
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def options_of(parser: argparse.ArgumentParser, command: str | None) -> dict[str, str]:
    """``{parameter: option}`` of ``command``'s options: each option's ``dest`` (the name of the
    library parameter it sets) and its long spelling, e.g. ``calibration_sims: --calibration-sims``."""
    for action in parser._actions:  # argparse keeps the subcommands' parsers in its subparsers action only
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return {option.dest: max(option.option_strings, key=len)
                    for option in action.choices[command]._actions if option.option_strings}
    return {}


def flag_named(message: str, options: dict[str, str]) -> str:
    """A library message led by a parameter's name (``workers must be ...``, ``input x.csv: no
    records``) as the command line says it, led by the option that sets it (``--workers must be
    ...``); any other message as it is. The library names its parameters; this is where the
    command line's names replace them, once for every command."""
    name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", message)
    if name and name.group() in options and message[name.end():name.end() + 1] in (" ", ":", ""):
        return options[name.group()] + message[name.end():]
    return message


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = None
    try:
        parser = build_parser(command)
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except MissingExtra as error:  # an optional dependency group is not installed
        print(f"affdiv {command}: error: {error}", file=sys.stderr)
        return 2
    except _BAD_INPUT as error:
        # a ValueError's message is its first argument (UnicodeDecodeError's is the encoding: str() says it all)
        plain = isinstance(error, ValueError) and not isinstance(error, UnicodeError) and error.args
        message = str(error.args[0] if plain else error)
        if parser is not None:
            message = flag_named(message, options_of(parser, command))
        print(f"affdiv {command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.errno not in _MACHINE:
            raise
        print(f"affdiv {command}: error: {_machine_error(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\naffdiv {command}: interrupted (what was finished is kept: a results store resumes with the same "
              "command)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

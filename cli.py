"""The `affdiv` command line: one subcommand family per subpackage.

Each module in COMMAND_MODULES exposes ``register(subparsers)``, which adds its subcommands
and sets ``func`` (called with the parsed namespace, returning the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from affdiv import __version__

COMMAND_MODULES = (
    "affdiv.verify.cli",
    "affdiv.experiments.cli",
    "affdiv.layers.cli",
    "affdiv.experiments.probe",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="affdiv",
        description="The affine divergence under numerical test (arXiv 2512.22247).",
    )
    parser.add_argument("--version", action="version", version=f"affdiv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)  # a misspelled name raises here
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

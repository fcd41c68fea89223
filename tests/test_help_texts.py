"""The guide: every command's --help states each option's default (once), carries no Sphinx/reST
markup, and the README's synopsis of the command lists every one of its options."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from affdiv.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
MARKUP = re.compile(r"``|:(func|class|mod|meth|attr|data|ref):`")
# Commands whose help texts do not follow the rule yet (strict xfails: a fix makes their test
# fail, so the entry is removed with it).
PENDING: dict[str, str] = {}


def _commands() -> dict[str, argparse.ArgumentParser]:
    def walk(parser, prefix):
        found = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found.update(walk(sub, f"{prefix} {name}".strip()))
        return found or {prefix: parser}

    return walk(build_parser("all"), "")


COMMANDS = _commands()


def _options(parser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _param(name):
    marks = [pytest.mark.xfail(reason=PENDING[name], strict=True)] if name in PENDING else []
    return pytest.param(name, marks=marks, id=name.replace(" ", "-"))


def test_every_command_is_checked():
    assert set(COMMANDS) == {"verify", "falsify", "analyse", "probe", "map", "bench layers"}


@pytest.mark.parametrize("name", [_param(n) for n in sorted(COMMANDS)])
def test_help_states_every_default_once(name):
    parser = COMMANDS[name]
    text = parser.format_help()
    assert "(default: None)" not in text, name
    for action in _options(parser):
        if action.required or action.nargs == 0:  # a required option or a flag has no default to state
            continue
        shown = parser._get_formatter()._expand_help(action) if action.help else ""
        assert len(re.findall(r"\bdefault", shown)) == 1, (name, action.option_strings, shown)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_has_no_sphinx_markup(name):
    text = COMMANDS[name].format_help()
    assert not MARKUP.search(text), (name, MARKUP.search(text).group(0))


def _synopsis(name: str) -> str:
    """The README's first indented synopsis of ``affdiv NAME`` with its continuation lines."""
    lines = README.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"    affdiv {re.escape(name)}\s", line + " ") and ("[" in line or "--" in line):
            block = [line]
            for more in lines[i + 1:]:
                if not re.match(r"\s{8,}[\[-]", more):
                    break
                block.append(more)
            return "\n".join(block)
    raise AssertionError(f"no synopsis of 'affdiv {name}' in the README")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_readme_synopsis_lists_every_option(name):
    synopsis = _synopsis(name)
    missing = [a.option_strings[-1] for a in _options(COMMANDS[name])
               if not any(re.search(rf"{re.escape(o)}(?![\w-])", synopsis) for o in a.option_strings)]
    assert not missing, (name, missing)


def test_the_checks_fail_on_a_bad_help_text():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--size", type=int, default=3, help="the size, see :func:`f` and ``g``")
    assert MARKUP.search(parser.format_help())
    shown = parser._get_formatter()._expand_help(parser._actions[-1])
    assert len(re.findall(r"\bdefault", shown)) == 0  # what test_help_states_every_default_once refuses

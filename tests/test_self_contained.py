"""The repository speaks of itself alone: no committed text file names how or where it was
developed (a ticket number, a working session, the absolute paths or the host name of a machine
that wrote it). Results and reports record paths relative to their folder or the checkout
(``affdiv.provenance``), so a checkout moved anywhere reads the same."""

import re
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What may not appear, case-insensitively. The patterns are written so that this file does not
# match them itself.
FORBIDDEN = {
    "a ticket number": r"\bissues?\s*#?\d+|(?<![&\w/=\"'])#\d{1,4}\b",
    "a working session": r"\bsessions?\b",
    "a machine's absolute path": r"/(?:work|root|home)/|/tmp/",
    "the machine's tooling": r"\blent\s+(?:a\s+)?(?:machine|device)\b|\bdevice\s+tool\b",
}

# (path, pattern name, the text allowed there): each a legitimate use, none today. An entry
# needs its reason beside it, e.g. ("x.py", "a working session", "requests.Session"),  # an HTTP session
ALLOWED: list[tuple[str, str, str]] = []
# This file is not searched: it spells out what it forbids, and its examples must match.
SKIPPED = {Path(__file__).resolve().relative_to(ROOT).as_posix()}


def _host_names() -> list[str]:
    """This machine's host name, where it is distinctive enough to search for: eight characters or
    more with a digit in them (a name such as "vm", "debian" or "worker" is an ordinary word in the
    text; generated host names, "ip-10-0-0-12" or "runner-4f2a9c", carry digits)."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0]}
    return sorted(n for n in names if len(n) >= 8 and any(c.isdigit() for c in n))


def offences(text: str, patterns: dict[str, str]) -> list[tuple[int, str, str]]:
    """``(line number, pattern name, matched text)`` of every forbidden match in ``text``."""
    compiled = {name: re.compile(pattern, re.IGNORECASE) for name, pattern in patterns.items()}
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in compiled.items():
            found += [(number, name, match.group()) for match in pattern.finditer(line)]
    return found


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed but deleted in the working tree
        return None
    if b"\0" in data[:8192]:
        return None  # binary: a results store, an image
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_tracked_text_file_names_its_development_or_its_machine():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    patterns = dict(FORBIDDEN)
    for host in _host_names():
        patterns[f"the host name {host}"] = rf"\b{re.escape(host)}\b"
    allowed = {(path, name, text.lower()) for path, name, text in ALLOWED}
    bad = []
    for path in _tracked_text_files():
        text = _text(path)
        if text is None:
            continue
        relative = path.relative_to(ROOT).as_posix()
        if relative in SKIPPED:
            continue
        bad += [f"{relative}:{number}: {name}: {matched!r}" for number, name, matched in offences(text, patterns)
                if (relative, name, matched.lower()) not in allowed]
    assert not bad, "committed files name their development or machine:\n" + "\n".join(bad[:50])


@pytest.mark.parametrize(("line", "name"), [
    ("fixed in issue 23", "a ticket number"),
    ("see #23", "a ticket number"),
    ("Issues 12, 17", "a ticket number"),
    ("measured in session 9", "a working session"),
    ("--out /work/main/docs/results", "a machine's absolute path"),
    ("/tmp/bash_jobs.0/x", "a machine's absolute path"),
    ("/root/.cache", "a machine's absolute path"),
    ("no device was lent", None),  # "lent" alone is ordinary English
    ("the lent machine", "the machine's tooling"),
])
def test_each_pattern_catches_what_it_names(line, name):
    names = [found for _, found, _ in offences(line, FORBIDDEN)]
    assert names == ([name] if name else [])


@pytest.mark.parametrize("line", [
    "&#39;quoted&#39; in HTML",  # an HTML character reference
    "colour #fff",
    "issue a warning",  # the verb
    "a standard-issue layer",
    "docs/results/fashion/records.csv",
    "affdiv falsify --out docs/results/fashion-cnn",
])
def test_ordinary_text_passes(line):
    assert offences(line, FORBIDDEN) == []

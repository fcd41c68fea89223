"""Provenance of a result: what produced it, where and when, so that a reader can reproduce it."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from affdiv import __version__

_LIBRARIES = ("torch", "numpy", "scipy", "sympy", "matplotlib", "scikit-learn", "statsmodels")


def git_commit() -> str | None:
    """The commit of the checkout this package runs from, else of the working directory, else
    $AFFDIV_GIT_COMMIT (set it where there is no git, e.g. an installed copy), else None."""
    for where in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5
            )
        except (OSError, subprocess.SubprocessError):  # no git, or no such directory: try the next
            continue
        if out.returncode == 0:
            return out.stdout.strip()
    return os.environ.get("AFFDIV_GIT_COMMIT")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(**extra) -> dict:
    """A JSON-ready provenance record; ``extra`` (seed, config hash, ...) is merged in."""
    record = {
        "package": "affdiv",
        "version": __version__,
        "git_commit": git_commit(),
        "libraries": library_versions(),
        "command": " ".join(sys.argv),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    record.update(extra)
    return record

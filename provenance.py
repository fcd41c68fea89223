"""Provenance of a result: what produced it, where and when, so that a reader can reproduce it.

The code that produced a result is named by the package ``version`` always, and by a git commit
only when one is known for *this package's own source*:

* ``git_source = "checkout"``: the package runs from a git checkout whose top level is the folder
  holding the package's ``__init__.py`` (a development or editable install): ``git_commit`` is its
  HEAD and ``git_dirty`` whether tracked or untracked, not ignored, files differ from it;
* ``git_source = "build"``: the package was installed from a wheel built from a checkout
  (``setup.py`` records the commit and dirty flag in ``affdiv/_build_info.py`` at build time);
* otherwise ``git_commit``, ``git_dirty`` and ``git_source`` are null.

The working directory is never consulted: run from a user's own project, a result does not carry
that project's commit.

Paths: a record names no absolute path of the machine that wrote it. The command is written as
``affdiv ARGS`` with every absolute path among its arguments relative to the working directory
(as if typed there, like its relative ones), and callers write the paths they record relative to
the result's folder (:func:`relative_path`), so that a result folder moved or committed elsewhere
still reads the same.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from affdiv import __version__

_LIBRARIES = ("torch", "numpy", "scipy", "sympy", "matplotlib", "scikit-learn", "statsmodels")

PACKAGE_ROOT = Path(__file__).resolve().parent  # the folder holding affdiv/__init__.py


def _git(root: Path, *args: str) -> str | None:
    """stdout of ``git -C root args``, or None when git is missing or fails."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_state(root: Path | str = PACKAGE_ROOT) -> dict:
    """``{"git_commit", "git_dirty"}`` of the git checkout whose top level is exactly ``root``;
    both None when ``root`` is not the top of a checkout (not in one, or inside another project's)."""
    root = Path(root).resolve()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return {"git_commit": None, "git_dirty": None}
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain")
    return {"git_commit": commit, "git_dirty": None if commit is None or status is None else bool(status)}


def source_state() -> dict:
    """``{"git_commit", "git_dirty", "git_source"}`` of this package's own source (module docstring)."""
    state = checkout_state(PACKAGE_ROOT)
    if state["git_commit"] is not None:
        return {**state, "git_source": "checkout"}
    try:  # import_module, not ``from affdiv import``: it consults sys.modules, not a cached attribute
        _build_info = importlib.import_module("affdiv._build_info")  # written by setup.py into wheels only
    except ImportError:
        return {"git_commit": None, "git_dirty": None, "git_source": None}
    if getattr(_build_info, "GIT_COMMIT", None) is None:
        return {"git_commit": None, "git_dirty": None, "git_source": None}
    return {"git_commit": _build_info.GIT_COMMIT, "git_dirty": _build_info.GIT_DIRTY, "git_source": "build"}


@functools.cache
def code_identity() -> dict:
    """``{"version", "git_commit", "git_dirty"}`` of the code running in this process (read once
    per process): what a results store records with each run it keeps."""
    state = source_state()
    return {"version": __version__, "git_commit": state["git_commit"], "git_dirty": state["git_dirty"]}


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def relative_path(path: str | os.PathLike, root: str | os.PathLike | None) -> str:
    """``path`` as a record writes it: relative to ``root`` when absolute (``os.path.relpath``:
    "." for root itself, "../x" beside it); a relative path, any path when ``root`` is None, and
    one that no relative path reaches (another drive) as given."""
    path = os.fspath(path)
    if root is None or not os.path.isabs(path):
        return path
    try:
        return os.path.relpath(path, os.path.abspath(root))
    except ValueError:  # another drive (Windows): no relative path leads there
        return path


def command_line(argv: list[str], root: str | os.PathLike | None = None) -> str:
    """``argv`` as a record writes it: ``affdiv ARGS`` for the command line (``python -m affdiv``
    included), ``python SCRIPT ARGS`` for a script (a benchmark); absolute paths (also in
    ``--option=PATH`` and ``--set KEY=PATH``) relative to ``root``, and a path outside ``root`` as
    its file name alone (where it lay on the machine that wrote the record says nothing to a reader);
    quoted as a POSIX shell reads it (``shlex.join``), so that the line runs as written."""
    def portable(token: str) -> str:
        option, sep, value = token.partition("=")
        if sep and not os.path.isabs(token):  # --option=PATH, or a --set KEY=PATH value
            return f"{option}={portable(value)}"
        if not os.path.isabs(token):
            return token
        shown = relative_path(token, root)
        return os.path.basename(token) if shown == ".." or shown.startswith(".." + os.sep) else shown

    program = os.path.basename(argv[0]) if argv else "affdiv"
    head = ["affdiv"] if program in ("affdiv", "__main__.py", "-m", "") else ["python", portable(argv[0])]
    return shlex.join([*head, *(portable(token) for token in argv[1:])])


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's vendor as its cpuid names it ("GenuineIntel", "AuthenticAMD", …), read from
    Linux's ``cpuinfo`` file; None where that is not to be read or names none."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None


def torch_blas(config: str | None = None) -> str | None:
    """The BLAS torch multiplies with, as its build configuration (``config``, default
    ``torch.__config__.show()``) names it in ``BLAS_INFO=`` ("mkl", "open", …); None where it
    names none."""
    if config is None:
        import torch

        config = torch.__config__.show()
    found = re.search(r"\bBLAS_INFO=([^,\s]*)", config)
    return found.group(1) or None if found else None


def cpu_identity() -> dict:
    """What of this process's machine and libraries decides the stacked engine's float32 CPU
    numbers, beside the package's code: ``{"vendor", "torch_blas", "onednn", "torch",
    "cpu_capability"}``, the processor's vendor and torch's BLAS (which pick the products' and
    tanh's library, ``experiments.runs.stacked_matmul.ONEDNN_PREFERRED``), whether the package's
    oneDNN matmul runs here (``affdiv.layers._native.onednn_enabled``), torch's version and the
    instruction set its kernels take (``torch.backends.cpu.get_cpu_capability``); the whole of
    :func:`machine_identity` for a run on the CPU. Read once per process; a fresh dict each call."""
    return dict(_cpu_identity())


def machine_identity(device: str = "cpu") -> dict:
    """What of the machine decides a run's numbers on ``device`` (a torch device string) beside the
    package's code, as a results store records it with each run: :func:`cpu_identity`, and on a
    CUDA device also the GPU's name and compute capability and the versions of CUDA (or, on ROCm,
    HIP) and cuDNN torch was built with (``"gpu"``, ``"gpu_capability"``, ``"cuda"`` or ``"hip"``,
    ``"cudnn"``), whose kernels follow the GPU. (Other devices, such as Apple's ``mps``, record
    the processor's alone.) A CUDA device where CUDA is not available is a ValueError: the record
    is of the machine that trains."""
    import torch

    identity = cpu_identity()
    where = torch.device(device)
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here, so no run on it was trained here "
                             "(record the machine that trained it)")
        major, minor = torch.cuda.get_device_capability(where)
        identity.update(gpu=torch.cuda.get_device_name(where), gpu_capability=f"{major}.{minor}",
                        **({"hip": torch.version.hip} if torch.version.hip else {"cuda": torch.version.cuda}),
                        cudnn=torch.backends.cudnn.version())
    return identity


def machine_key(cpu: dict | None) -> tuple | None:
    """A recorded :func:`machine_identity` as a hashable key (its items in order of name; None
    where none was recorded), to count the runs of each machine."""
    return None if cpu is None else tuple(sorted(cpu.items()))


@functools.cache
def _cpu_identity() -> dict:
    import torch

    from affdiv.layers import _native

    return {"vendor": cpu_vendor(), "torch_blas": torch_blas(), "onednn": _native.onednn_enabled(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def provenance(**extra) -> dict:
    """A JSON-ready provenance record; ``extra`` (seed, config hash, ...) is merged in; absolute
    paths in the command are written relative to the working directory.

    Keys: package, version, git_commit, git_dirty, git_source (module docstring), libraries,
    command, platform, machine, processor, cpu_vendor (:func:`cpu_vendor`: which library the
    stacked engine's products take follows it), cpu_count, time_utc, then ``extra``."""
    record = {
        "package": "affdiv",
        "version": __version__,
        **source_state(),
        "libraries": library_versions(),
        "command": command_line(sys.argv, os.getcwd()),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_vendor": cpu_vendor(),
        "cpu_count": os.cpu_count(),
        "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    record.update(extra)
    return record

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# One intra-op thread: results do not depend on it, and on 2 shared cores extra threads cost more
# in synchronisation than they gain on the suite's small tensors.
torch.set_num_threads(1)
settings.register_profile("affdiv", deadline=None, max_examples=25, derandomize=False)
settings.load_profile("affdiv")


@pytest.fixture
def unwritable():
    """``unwritable(path)`` makes a file or folder (created if missing) impossible to write for this
    process, and returns it; undone after the test.

    chmod a-w, and for root (whom permission bits do not stop) also the immutable attribute
    (``chattr +i``); the test is skipped where neither works.
    """
    locked = []

    def make(path):
        if not path.exists():
            path.mkdir(parents=True)
        path.chmod(0o555 if path.is_dir() else 0o444)
        locked.append(path)
        if os.geteuid() == 0:
            if shutil.which("chattr") is None or subprocess.run(
                ["chattr", "+i", str(path)], capture_output=True
            ).returncode != 0:
                pytest.skip("running as root and cannot set the immutable attribute: nothing is read-only")
        return path

    yield make
    for path in reversed(locked):
        if os.geteuid() == 0 and shutil.which("chattr"):
            subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture
def latex_page():
    """``latex_page(tex, workdir, font=r"\\small")``: compile a generated LaTeX table with pdflatex in a
    one-column plain article and measure it (tests/latex_util.py: ``.fits``, ``.width_pt``,
    ``.linewidth_pt``, ``.overfull``, ``.describe()``). Skips the test when pdflatex is not installed."""
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex is not installed (CI installs texlive-latex-base and -recommended)")
    return _helper_module("latex_util").measure_table


@pytest.fixture
def sweep_util():
    """tests/sweep_util.py: ``rows(db)``, ``records(store)``, ``counts(store)`` of a results store,
    ``alive(pid)``, ``wait(condition, timeout)`` and ``exited(pids, timeout)`` for the processes a sweep starts."""
    return _helper_module("sweep_util")


@pytest.fixture
def function_checks():
    """tests/function_checks.py: ``second_order_paths(function, composite, inputs, g, close)``, the
    double backward, batched gradients and tangents of a fused autograd Function."""
    return _helper_module("function_checks")


def _helper_module(name: str):
    """tests/NAME.py, imported once as ``affdiv_tests_NAME`` (the suite runs with
    --import-mode=importlib: a test module cannot import a helper module beside it)."""
    qualified = f"affdiv_tests_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).with_name(f"{name}.py"))
        sys.modules[qualified] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[qualified])
    return sys.modules[qualified]

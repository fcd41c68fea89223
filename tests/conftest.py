import os
import shutil
import subprocess

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
    import importlib.util
    from pathlib import Path

    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex is not installed (CI installs texlive-latex-base and -recommended)")
    import sys

    name = "affdiv_tests_latex_util"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("latex_util.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].measure_table

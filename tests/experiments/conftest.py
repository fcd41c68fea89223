import ctypes
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests, as in a sweep's workers (see affdiv.experiments.runs.sweep),
    whatever an earlier test set: a reduction split over threads may round differently. Used by
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits():
    """The digits dataset, loaded once per test module."""
    from affdiv.experiments.data.dataset import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="module")
def library_without_shuffles(tmp_path_factory):
    """The fused library built as a compiler without ``__builtin_shufflevector`` builds it
    (``-DAFFDIV_NO_SHUFFLE``: the generic attention items and torch's softmax, the LayerNorm's
    rows of 32 summed row by row), loaded and declared; skipped where no C compiler with OpenMP is
    here (the package then has no compiled passes at all)."""
    from affdiv.layers import _fused

    compiler = shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
    if compiler is None or not _fused.available():
        pytest.skip("no C compiler here, or no compiled passes to compare with")
    source = Path(__file__).resolve().parents[2] / "layers" / "_fused_cpu.c"
    library = tmp_path_factory.mktemp("fallback") / "fused_without_shuffles.so"
    subprocess.run([compiler, "-O2", "-fno-math-errno", "-fopenmp", "-std=gnu11", "-shared", "-fPIC",
                    "-DAFFDIV_NO_SHUFFLE", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(library)],
                   check=True, capture_output=True)
    return _fused._declared(ctypes.CDLL(str(library)))


@pytest.fixture
def without_shuffles(library_without_shuffles, monkeypatch):
    """The fused passes taken from ``library_without_shuffles`` for one test."""
    from affdiv.layers import _fused

    monkeypatch.setattr(_fused, "_LIB", library_without_shuffles)
    _fused.attention_probabilities_built.cache_clear()
    assert not _fused.attention_probabilities_built()  # (the library built so has no softmax pass)
    yield
    _fused.attention_probabilities_built.cache_clear()

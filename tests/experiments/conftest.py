import ctypes
import os
import shlex
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


@pytest.fixture
def small_products_on_onednn(monkeypatch):
    """oneDNN's products at every size (``stacked_matmul.ONEDNN_MIN_FLOPS`` = 0) and on every
    processor (``stacked_matmul.ONEDNN_PREFERRED``), for tests that exercise them on small models,
    which the engine would otherwise multiply with torch's ops. Used by
    ``pytestmark = pytest.mark.usefixtures("small_products_on_onednn")``."""
    from affdiv.experiments.runs import stacked_matmul

    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", 0)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", True)


@pytest.fixture(scope="module")
def digits():
    """The digits dataset, loaded once per test module."""
    from affdiv.experiments.data.dataset import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="module")
def generic_library(tmp_path_factory):
    """The fused library built with its generic code: as a compiler without
    ``__builtin_shufflevector`` builds it (``-DAFFDIV_NO_SHUFFLE``: the generic attention items and
    torch's softmax, the LayerNorm's rows of 32 summed by row_totals' loop, the first block's window
    positions narrowed lane by lane) and with the first block's passes at their kernel's runtime
    size (``-DAFFDIV_GENERIC_TAPS``), with setup.py's flags, by the compiler ``$CC`` names (else
    ``cc``), loaded and declared; refused if its interface version is not the loader's. Skipped
    where there is no compiler (the package then has no compiled passes either), unless
    AFFDIV_REQUIRE_CPU_KERNELS is set; a failed build fails with the compiler's message."""
    from affdiv.layers import _fused

    command = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(command[0]) is None:
        if os.environ.get("AFFDIV_REQUIRE_CPU_KERNELS"):
            pytest.fail(f"no C compiler {command[0]!r} here, and AFFDIV_REQUIRE_CPU_KERNELS is set")
        pytest.skip(f"no C compiler {command[0]!r} here")
    source = Path(__file__).resolve().parents[2] / "layers" / "_fused_cpu.c"
    library = tmp_path_factory.mktemp("fallback") / "fused_generic.so"
    done = subprocess.run([*command, "-O3", "-fno-math-errno", "-fopenmp", "-std=gnu11", "-shared", "-fPIC",
                           "-DAFFDIV_NO_SHUFFLE", "-DAFFDIV_GENERIC_TAPS", f"-I{sysconfig.get_paths()['include']}",
                           str(source), "-o",
                           str(library)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"building the fused library's generic code failed:\n{done.stderr}")
    lib = ctypes.CDLL(str(library))
    lib.affdiv_fused_abi.restype = ctypes.c_int
    assert lib.affdiv_fused_abi() == _fused.FUSED_ABI, "the checkout's C source is not the loaded package's"
    return _fused._declared(lib)


@pytest.fixture
def generic_passes(generic_library, monkeypatch):
    """The fused passes taken from ``generic_library`` for one test."""
    from affdiv.layers import _fused

    monkeypatch.setattr(_fused, "_LIB", generic_library)
    assert not _fused.attention_probabilities_built()  # (the library built so has no softmax pass)

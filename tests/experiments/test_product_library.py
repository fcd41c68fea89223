"""Which library the stacked engine's products take (affdiv.experiments.runs.stacked_matmul):
oneDNN everywhere but where torch's BLAS is MKL on an Intel processor."""

import pytest
import torch

from affdiv.experiments.runs import stacked_matmul
from affdiv.provenance import cpu_vendor


@pytest.mark.parametrize(("vendor", "mkl", "preferred"), [("GenuineIntel", True, False), ("GenuineIntel", False, True),
                                                          ("AuthenticAMD", True, True), (None, True, True)])
def test_onednn_is_preferred_everywhere_but_mkl_on_an_intel_processor(vendor, mkl, preferred):
    assert stacked_matmul.onednn_preferred(vendor, mkl) is preferred


def test_torchs_blas_is_read_from_its_build_configuration():
    assert stacked_matmul.blas_is_mkl("  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, ")
    assert not stacked_matmul.blas_is_mkl("  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release, ")
    assert stacked_matmul.blas_is_mkl() == ("BLAS_INFO=mkl" in torch.__config__.show())


def test_the_engine_follows_the_rule_on_the_processor_it_runs_on():
    rule = stacked_matmul.onednn_preferred(cpu_vendor(), stacked_matmul.blas_is_mkl())
    assert stacked_matmul.ONEDNN_PREFERRED is rule

"""The stacked engine's tanh activation on the fused pass in float32, where it pays.

torch's float32 tanh on the CPU is, in a build with MKL (torch's CPU wheels), MKL's vector math
(VML), which picks its code by the processor's vendor, as MKL's products do
(:mod:`~affdiv.experiments.runs.stacked_matmul`). On an AMD processor with AVX-512 it took about
2.4 ns an element on one core (``benchmarks/results/cpu_tanh_accuracy.json``), which in the
stacked MLP arms is about a seventh of a training step at B = 256 (three tanh layers against
their matrix products). The pass ``_fused.tanh`` computes each element in double from a reduced
``expm1`` (within 1e-15 of tanh(x), relative) and rounds it once to float (its derivation in
``_fused_cpu.c``): the correctly rounded tanh on each of the 2³¹ non-negative float32 inputs, and
so on the negative ones (it is odd by construction, and rounding to nearest is symmetric), where
torch's float32 tanh misrounded 82,383 of them on that processor (``benchmarks/tanh_accuracy.py``);
and 2.4× as fast there (0.98 against 2.36 ns an element in that run, one thread). On an Intel
processor MKL runs its own AVX-512 code: on one core of an Intel Xeon processor torch's tanh took
1.85 ns an element against the pass's 2.31 over the accuracy benchmark's 64 MiB chunks
(``benchmarks/results/cpu_tanh_accuracy_intel_xeon.json``), and the MLP arms' step with torch's
tanh took 0.89–1.00 of the time of the step with the pass (12 and 48 models at B = 16 to 1024,
paired rounds, the pass "tanh" run before this rule:
``benchmarks/results/cpu_fused_passes_tanh_mkl_on_intel.json``; the pass "torch's tanh on Intel"
now measures the same, as its reciprocal). The engine therefore takes the
pass everywhere but where torch's BLAS is MKL on an Intel processor, the rule of the products'
library (``stacked_matmul.ONEDNN_PREFERRED`` false): a rule of the machine, never a timing. There
its float32 numbers are torch's tanh's, which there misrounded 803,349 of the 2³¹ non-negative
inputs (the same benchmark), each by one unit in the last place.

The backward is torch's own, ``tanh_backward(g, y) = g·(1 − y²)`` on the saved output, which
autograd differentiates again (a double backward) and runs on batched gradients. :func:`tanh`
takes :class:`Tanh` where :func:`takes_pass`, else ``torch.tanh``, which torch.func, forward-mode
AD, torch.compile, dispatch modes (but one that only observes) and other dtypes get.
"""

from __future__ import annotations

import torch
from torch import Tensor

from affdiv.experiments.runs import stacked_matmul
from affdiv.layers import _fused


def takes_pass(x: Tensor) -> bool:
    """Whether :func:`tanh` takes the pass for x: where it pays, everywhere but where torch's BLAS
    is MKL on an Intel processor (``stacked_matmul.ONEDNN_PREFERRED``; module docstring), and
    :func:`usable`."""
    return stacked_matmul.ONEDNN_PREFERRED and usable(x)


def usable(x: Tensor) -> bool:
    """Whether :class:`Tanh` may take x: ``_fused.functions_usable``, float32 and
    ``_fused.non_overlapping_and_dense``."""
    return _fused.functions_usable(x) and x.dtype == torch.float32 and _fused.non_overlapping_and_dense(x)


def tanh(x: Tensor) -> Tensor:
    """tanh(x), in x's layout (module docstring)."""
    return Tanh.apply(x) if takes_pass(x) else torch.tanh(x)


class Tanh(torch.autograd.Function):
    """:func:`tanh` on the fused pass (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = _fused.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(g, y)

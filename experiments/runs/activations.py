"""The stacked engine's tanh activation on the fused pass in float32.

torch's float32 tanh on the CPU is not vectorised: about 2 ns an element on one core, whatever
vector width the processor has (its ATEN_CPU_CAPABILITY), which in the stacked MLP arms is
about a seventh of a training step at B = 256 (three tanh layers against their matrix products).
The pass ``_fused.tanh`` computes each element in double from a reduced ``expm1`` (within 1e-15 of
tanh(x), relative) and rounds it once to float (its derivation in ``_fused_cpu.c``): the correctly
rounded tanh on each of the 2³¹ non-negative float32 inputs, and so on the negative ones (it is odd
by construction, and rounding to nearest is symmetric), where torch's float32 tanh misrounds 82,383 of
them (``benchmarks/tanh_accuracy.py``); and about 2.4× faster with AVX-512 (0.98 against 2.36 ns
an element in that run, one thread).

The backward is torch's own, ``tanh_backward(g, y) = g·(1 − y²)`` on the saved output, which
autograd differentiates again (a double backward) and runs on batched gradients. :func:`tanh`
takes :class:`Tanh` where :func:`usable` (``_fused.functions_usable``, a float32 tensor stored
densely in some order of its dimensions), else ``torch.tanh``, which torch.func, forward-mode AD,
torch.compile, dispatch modes (but one that only observes) and other dtypes get.
"""

from __future__ import annotations

import torch
from torch import Tensor

from affdiv.layers import _fused


def usable(x: Tensor) -> bool:
    """Whether :class:`Tanh` may take x: ``_fused.functions_usable``, float32 and
    ``_fused.non_overlapping_and_dense``."""
    return _fused.functions_usable(x) and x.dtype == torch.float32 and _fused.non_overlapping_and_dense(x)


def tanh(x: Tensor) -> Tensor:
    """tanh(x), in x's layout (module docstring)."""
    return Tanh.apply(x) if usable(x) else torch.tanh(x)


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

"""Overflow-safe rescaling, shared by every corrected layer.

Each layer needs ‖v‖ of a slice v of its input (a row, or a whole sample for the convolutions)
and feeds v into a GEMM/convolution whose output the correction then bounds. Computed naively,
‖v‖² overflows once ‖v‖ > √max (fp32: 1.8e19), underflows once ‖v‖ < √tiny (fp32: 1.1e-19), and
the GEMM itself overflows for |v| near the dtype's maximum although z is bounded. So every layer
first brings each slice to unit scale:

    c = 1/max(‖v‖, floor)   where that norm is finite,   c = 2^-K where it overflowed,

with K = ⌊3·maxexp/4⌋ of v's dtype (fp32/bf16: 96, fp64: 768, fp16: 12), and works on v' = c·v
(|v'| ≤ 1, or ≤ 2^(maxexp/4)·√n in the overflow branch: nothing can overflow any more). Every
formula below is then written in (v', c); c multiplies back out analytically. Norms are
accumulated in float32 for half inputs (``accumulation_dtype``), in the input dtype otherwise.
NaN or ±Inf in a slice stays non-finite through c·v (c is finite and non-zero), never a finite
wrong number.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision inputs (bf16, fp16), the input dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def safe_exponent(dtype: torch.dtype) -> int:
    """K: 2^±K is representable in ``dtype`` and leaves a margin of 2^(maxexp/4) both ways."""
    max_exponent = math.floor(math.log2(torch.finfo(dtype).max)) + 1  # 128 for fp32, 16 for fp16
    return 3 * max_exponent // 4


def rescale(x: Tensor, dims: tuple[int, ...], floor: float) -> tuple[Tensor, Tensor]:
    """(x·c, c) with c = 1/max(‖x‖, floor) over ``dims`` (keepdim), c = 2^-K where ‖x‖ overflows.

    One pass reads x for its norm, one writes x·c (in x's dtype); c is in the accumulation dtype.
    """
    acc = accumulation_dtype(x.dtype)
    norm = torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=acc)
    overflow_scale = 2.0 ** -safe_exponent(x.dtype)
    c = torch.where(torch.isfinite(norm), 1.0 / norm.clamp_min(floor), overflow_scale)
    return x * c.to(x.dtype), c


def norm_of(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """‖x‖ over ``dims`` (keepdim), accumulated in the accumulation dtype."""
    return torch.linalg.vector_norm(x, dim=dims, keepdim=True, dtype=accumulation_dtype(x.dtype))


def rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_last a·b (keepdim), accumulated in the accumulation dtype."""
    return (a * b).sum(-1, keepdim=True, dtype=accumulation_dtype(a.dtype))

"""The stacked engine's AffineLike and NormLike layers: the batched product and the layers' own
fused row passes around it, in one autograd Function each.

For K models' rows x (K, M, L), weights W (K, N, L) and biases b (K, N), model by model and row
by row (the layers' formulas, :mod:`affdiv.layers._autograd`):

    AffineLike   z = r·(x Wᵀ + b),   r = 1/√(‖x‖² + 1)
    NormLike     z = q·(x Wᵀ) + b,   q = c/max(‖x‖, eps),   c = 1 (l2) or √L (rms)

and for the gradient g of z, with the row scale s (r or q) and gy = s·g,

    ∂W = gyᵀ x,   ∂b = Σ_rows gy (AffineLike) or Σ_rows g (NormLike),   u = gy W,
    AffineLike   ∂x = u − r²·(⟨u, x⟩ + ⟨gy, b⟩)·x
    NormLike     ∂x = u − ⟨u, x⟩/‖x‖²·x  where ‖x‖ > eps,   u where q = c/eps is constant.

Written in torch operations (square, sum, sqrt, a broadcast division and their backwards) a
layer makes a dozen passes over its (K, M, N) output; in a profile of the vit-affine_like step
they took more time than its matrix products. Here the product is
:func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`'s (oneDNN in float32 where it may run and
the product is large enough),
the scale is one pass (``_fused.scale_outputs``), and the backward is one pass that scales g
(``_fused.scale_grad``), the two products and one pass that takes off the radial part
(``_fused.minus_radial_``), each row's arithmetic that of the layer alone.

:func:`affine_like` and :func:`norm_like` take the Functions where :func:`usable`, else the
torch operations (:func:`affine_like_composite`, :func:`norm_like_composite`), which torch.func,
forward-mode AD, torch.compile and dispatch modes differentiate or trace. A Function's backward
runs its formulas in torch operations (differentiable, so a double backward, tangents and batched
gradients keep working) where it records a graph or the passes may not run; so does a forward whose
norms overflow or underflow (the passes' ``safe`` flag), on the composite formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from affdiv.experiments.runs import composite, stacked_matmul
from affdiv.layers import _fused
from affdiv.layers._scale import small_norm

#: x Wᵀ + b for rows x (K, M, L), weight (K, N, L), bias (K, N) or None: (K, M, N).
Product = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def usable(*tensors: Tensor | None) -> bool:
    """Whether the dense Functions may take these tensors (None entries ignored):
    ``_fused.functions_usable``. (The layers' routing, on its own so that a benchmark can route
    them off alone.)"""
    return _fused.functions_usable(*tensors)


def _passes_may_run(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor, g: Tensor) -> bool:
    """Whether a backward may take the fused passes: no graph recorded and the row operands (x, the
    scale, g) as ``_fused.usable`` takes them; weight and bias enter only the products, which take
    any strides."""
    return _fused.usable(x, scale, g) and all(t is None or (_fused.plain(t) and t.dtype == x.dtype)
                                              for t in (weight, bias))


def row_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x Wᵀ + b for rows x (K, M, L), contiguous (K, M, N)
    (:func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`)."""
    return stacked_matmul.baddbmm(None if bias is None else bias.unsqueeze(1), x, weight.transpose(1, 2))


def affine_like(x: Tensor, weight: Tensor, bias: Tensor | None, product: Product = row_product) -> Tensor:
    """z = (x Wᵀ + b)/√(‖x‖² + 1) per row, for rows x (K, M, L), weight (K, N, L), bias (K, N)
    or None: (K, M, N) (module docstring); x Wᵀ + b by ``product`` where it runs in torch
    operations (default: :func:`row_product`)."""
    if usable(x, weight, bias):
        return StackedAffineLike.apply(x.contiguous(), weight, bias)
    return affine_like_composite(x, weight, bias, product)


def norm_like(x: Tensor, weight: Tensor, bias: Tensor | None, c: float, eps: float,
              product: Product = row_product) -> Tensor:
    """z = c·(x/max(‖x‖, eps)) Wᵀ + b per row, shapes and ``product`` as :func:`affine_like`."""
    if usable(x, weight, bias):
        return StackedNormLike.apply(x.contiguous(), weight, bias, c, eps)
    return norm_like_composite(x, weight, bias, c, eps, product)


def affine_like_composite(x: Tensor, weight: Tensor, bias: Tensor | None, product: Product = row_product) -> Tensor:
    """:func:`affine_like` in torch operations."""
    return product(x, weight, bias) / (x.square().sum(2, keepdim=True) + 1).sqrt()


def norm_like_composite(x: Tensor, weight: Tensor, bias: Tensor | None, c: float, eps: float,
                        product: Product = row_product) -> Tensor:
    """:func:`norm_like` in torch operations."""
    return product(c * x / torch.linalg.vector_norm(x, dim=2, keepdim=True).clamp_min(eps), weight, bias)


def _rows(t: Tensor) -> Tensor:
    """(K, M, F) contiguous as (K·M, F), the fused passes' rows."""
    return t.view(-1, t.shape[2])


class StackedAffineLike(torch.autograd.Function):
    """:func:`affine_like` on the fused passes (module docstring); x contiguous."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        z = row_product(x, weight, bias)
        r, safe = _fused.scale_outputs(_rows(z), _rows(x), "affine_like")
        ctx.fused = safe
        if not safe:  # some ‖x‖² overflowed (or is NaN): the composite's numbers
            z = affine_like_composite(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, r)
        return z

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, r = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g = g.contiguous()
        if not (ctx.fused and _passes_may_run(x, weight, bias, r, g)):
            return composite.composite_grads(affine_like_composite, (x, weight, bias), g, ctx.needs_input_grad)
        gy = _fused.scale_grad(_rows(g), r)[0].view(g.shape)
        dx = None
        if need_x:
            # ⟨gy, b⟩ per row, as (K, 1, M) (a row vector times gyᵀ: several times faster than gy b)
            offset = None if bias is None else stacked_matmul.product(bias.unsqueeze(1), gy.transpose(1, 2)).view(-1, 1)
            dx = _fused.minus_radial_(_rows(stacked_matmul.product(gy, weight)), _rows(x), r, c=offset)
        return (None if dx is None else dx.view(x.shape),
                stacked_matmul.product(gy.transpose(1, 2), x) if need_w else None,
                gy.sum(1) if need_b and bias is not None else None)


class StackedNormLike(torch.autograd.Function):
    """:func:`norm_like` on the fused passes (module docstring); x contiguous."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, c: float, eps: float) -> Tensor:
        z = row_product(x, weight, None)
        small = 0.0 if eps >= small_norm(x.dtype) else small_norm(x.dtype)  # eps too small to hide underflow
        q, safe = _fused.scale_outputs(_rows(z), _rows(x), "norm_like", k=c, eps=eps, small=small)
        ctx.fused, ctx.c, ctx.eps = safe, c, eps
        if not safe:  # some ‖x‖² overflowed, is NaN or underflowed: the composite's numbers
            z = norm_like_composite(x, weight, bias, c, eps)
        elif bias is not None:
            z.add_(bias.unsqueeze(1))
        ctx.save_for_backward(x, weight, bias, q)
        return z

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, q = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.contiguous()
        if not (ctx.fused and _passes_may_run(x, weight, bias, q, g)):
            return *composite.composite_grads(lambda *inputs: norm_like_composite(*inputs, ctx.c, ctx.eps),
                                              (x, weight, bias), g, ctx.needs_input_grad[:3]), None, None
        gy = _fused.scale_grad(_rows(g), q)[0].view(g.shape)
        dx = None
        if need_x:  # ∂x = u − a·⟨u, x⟩·x, a = (q/c)² = 1/‖x‖² where q < c/eps, else 0
            dx = _fused.minus_radial_(_rows(stacked_matmul.product(gy, weight)), _rows(x), q, 1 / ctx.c,
                                      ctx.c / ctx.eps)
        return (None if dx is None else dx.view(x.shape),
                stacked_matmul.product(gy.transpose(1, 2), x) if need_w else None,
                g.sum(1) if need_b and bias is not None else None, None, None)

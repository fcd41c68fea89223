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
:func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`'s (oneDNN in float32 where it is preferred, may run
and the product is large enough),
the scale is one pass (``_fused.scale_outputs``), and the backward is one pass that scales g
(``_fused.scale_grad``), the two products and one pass that takes off the radial part
(``_fused.minus_radial_``), each row's arithmetic that of the layer alone.

:func:`affine_like` and :func:`norm_like` take the Functions where :func:`usable`, else the
torch operations (:func:`affine_like_composite`, :func:`norm_like_composite`), which torch.func,
forward-mode AD, torch.compile and dispatch modes differentiate or trace. A Function's backward
runs its formulas in torch operations (differentiable, so a double backward, tangents and batched
gradients keep working) where it records a graph or the passes may not run; so does a forward whose
norms overflow or underflow (the passes' ``safe`` flag), on the composite formula.

With ``step`` (the per-model −η, (K, 1, 1)) a layer's backward makes plain SGD's step of its weight
in place instead of returning the weight's gradient, W ← W − η ∂W, after ∂x has read W: one product
that adds into W where it pays, else the optimiser's update of ∂W
(:func:`~affdiv.experiments.runs.stacked_matmul.sgd_step_`; the composite's product makes it the
same way: :func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`; the conditions:
:func:`~affdiv.experiments.runs.stacked_matmul.check_step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from affdiv.experiments.runs import composite, stacked_matmul
from affdiv.layers import _fused
from affdiv.layers._scale import small_norm

#: x Wᵀ + b for rows x (K, M, L), weight (K, N, L), bias (K, N) or None: (K, M, N); called as
#: ``product(x, weight, bias, step=None)``, ``step`` as :func:`row_product`'s.
Product = Callable[..., Tensor]


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


def row_product(x: Tensor, weight: Tensor, bias: Tensor | None, step: Tensor | None = None) -> Tensor:
    """x Wᵀ + b for rows x (K, M, L), contiguous (K, M, N)
    (:func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`; with ``step``, the per-model −η, its
    backward makes the weight's SGD step)."""
    return stacked_matmul.baddbmm(None if bias is None else bias.unsqueeze(1), x, weight.transpose(1, 2), step, "b")


def affine_like(x: Tensor, weight: Tensor, bias: Tensor | None, product: Product = row_product,
                step: Tensor | None = None) -> Tensor:
    """z = (x Wᵀ + b)/√(‖x‖² + 1) per row, for rows x (K, M, L), weight (K, N, L), bias (K, N)
    or None: (K, M, N) (module docstring); x Wᵀ + b by ``product`` where it runs in torch
    operations (default: :func:`row_product`); with ``step`` the backward makes the weight's SGD
    step (module docstring)."""
    if step is not None:
        stacked_matmul.check_step(weight, step)
    if usable(x, weight, bias):
        return StackedAffineLike.apply(x.contiguous(), weight, bias, step)
    return affine_like_composite(x, weight, bias, _stepped(product, step))


def norm_like(x: Tensor, weight: Tensor, bias: Tensor | None, c: float, eps: float,
              product: Product = row_product, step: Tensor | None = None) -> Tensor:
    """z = c·(x/max(‖x‖, eps)) Wᵀ + b per row, shapes, ``product`` and ``step`` as :func:`affine_like`."""
    if step is not None:
        stacked_matmul.check_step(weight, step)
    if usable(x, weight, bias):
        return StackedNormLike.apply(x.contiguous(), weight, bias, c, eps, step)
    return norm_like_composite(x, weight, bias, c, eps, _stepped(product, step))


def _stepped(product: Product, step: Tensor | None) -> Product:
    """``product`` making the weight's SGD step ``step`` in its backward (as it is without one)."""
    return product if step is None else functools.partial(product, step=step)


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
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, step: Tensor | None) -> Tensor:
        z = row_product(x, weight, bias)
        r, safe = _fused.scale_outputs(_rows(z), _rows(x), "affine_like")
        ctx.fused = safe
        if not safe:  # some ‖x‖² overflowed (or is NaN): the composite's numbers
            z = affine_like_composite(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, r, step)
        return z

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, r, step = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.contiguous()
        if not (ctx.fused and _passes_may_run(x, weight, bias, r, g)):
            return (*_composite_grads(affine_like_composite, (x, weight, bias), g, ctx.needs_input_grad[:3], step),
                    _step_gradient(step))
        gy = _fused.scale_grad(_rows(g), r)[0].view(g.shape)
        dx = None
        if need_x:
            # ⟨gy, b⟩ per row, as (K, 1, M) (a row vector times gyᵀ: several times faster than gy b)
            offset = None if bias is None else stacked_matmul.product(bias.unsqueeze(1), gy.transpose(1, 2)).view(-1, 1)
            dx = _fused.minus_radial_(_rows(stacked_matmul.product(gy, weight)), _rows(x), r, c=offset)
        return (None if dx is None else dx.view(x.shape), _weight_gradient(weight, step, gy, x, need_w),
                gy.sum(1) if need_b and bias is not None else None, _step_gradient(step))


class StackedNormLike(torch.autograd.Function):
    """:func:`norm_like` on the fused passes (module docstring); x contiguous."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, c: float, eps: float,
                step: Tensor | None) -> Tensor:
        z = row_product(x, weight, None)
        small = 0.0 if eps >= small_norm(x.dtype) else small_norm(x.dtype)  # eps too small to hide underflow
        q, safe = _fused.scale_outputs(_rows(z), _rows(x), "norm_like", k=c, eps=eps, small=small)
        ctx.fused, ctx.c, ctx.eps = safe, c, eps
        if not safe:  # some ‖x‖² overflowed, is NaN or underflowed: the composite's numbers
            z = norm_like_composite(x, weight, bias, c, eps)
        elif bias is not None:
            z.add_(bias.unsqueeze(1))
        ctx.save_for_backward(x, weight, bias, q, step)
        return z

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, q, step = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        g = g.contiguous()
        if not (ctx.fused and _passes_may_run(x, weight, bias, q, g)):
            return (*_composite_grads(lambda *inputs: norm_like_composite(*inputs, ctx.c, ctx.eps),
                                      (x, weight, bias), g, ctx.needs_input_grad[:3], step),
                    None, None, _step_gradient(step))
        gy = _fused.scale_grad(_rows(g), q)[0].view(g.shape)
        dx = None
        if need_x:  # ∂x = u − a·⟨u, x⟩·x, a = (q/c)² = 1/‖x‖² where q < c/eps, else 0
            dx = _fused.minus_radial_(_rows(stacked_matmul.product(gy, weight)), _rows(x), q, 1 / ctx.c,
                                      ctx.c / ctx.eps)
        return (None if dx is None else dx.view(x.shape), _weight_gradient(weight, step, gy, x, need_w),
                g.sum(1) if need_b and bias is not None else None, None, None, _step_gradient(step))


def _step_gradient(step: Tensor | None) -> Tensor | None:
    """The output's gradient with respect to the SGD step
    (:func:`~affdiv.experiments.runs.stacked_matmul.step_gradient`)."""
    return None if step is None else stacked_matmul.step_gradient(step)


def _weight_gradient(weight: Tensor, step: Tensor | None, gy: Tensor, x: Tensor, needed: bool) -> Tensor | None:
    """∂W = gyᵀ x if ``needed``; with ``step``, the SGD step W ← W + step ⊙ ∂W made in place
    instead (after ∂x, which reads W), and None."""
    if step is not None:
        stacked_matmul.check_plain_backward()
        stacked_matmul.sgd_step_(weight, step, gy.transpose(1, 2), x)
        return None
    return stacked_matmul.product(gy.transpose(1, 2), x) if needed else None


def _composite_grads(composite_fn: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], g: Tensor, needs,
                     step: Tensor | None) -> tuple[Tensor | None, ...]:
    """:func:`~affdiv.experiments.runs.composite.composite_grads` of x, the weight and the bias;
    with ``step``, the weight's gradient is taken too and the SGD step made with it, W ← W +
    step ⊙ ∂W in place, its gradient returned as None."""
    if step is None:
        return composite.composite_grads(composite_fn, inputs, g, needs)
    stacked_matmul.check_plain_backward()
    dx, dw, db = composite.composite_grads(composite_fn, inputs, g, (needs[0], True, needs[2]))
    inputs[1].addcmul_(dw, step)
    return dx, None, db

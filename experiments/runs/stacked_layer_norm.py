"""The stacked engine's LayerNorm with each model's affine, one pass forward and one backward.

For K models' rows x (K, M, d) (a transformer's tokens), each row normalised over its d entries
and then scaled and shifted by its model's γ_k, β_k (d,):

    x̂ = (x − mean)·rstd,   rstd = 1/√(var + eps)   (var the biased variance over the row),
    y = x̂ ⊙ γ_k + β_k,

and for the gradient gy of y, with g = gy ⊙ γ_k and ⟨·⟩ the mean over the row,

    ∂x = rstd·(g − ⟨g⟩ − x̂·⟨g ⊙ x̂⟩),   ∂γ_k = Σ_rows gy ⊙ x̂,   ∂β_k = Σ_rows gy.

In torch operations (:func:`layer_norm_composite`: ``F.layer_norm`` without an affine, then
``addcmul`` with the stacked γ and β, as nn.LayerNorm computes it per model) that is a pass for the
normalisation and one for the affine, and in backward the affine's two products, their sums and
the normalisation's backward, each over the (K, M, d) activations: at the vit's width of 32 these
passes over memory, not arithmetic, set their cost. Here the forward is one pass
(``_fused.layer_norm``: y, and each row's mean and rstd) and the backward one
(``_fused.layer_norm_backward``): 2.9 ms against 5.0 for the composite's forward and backward at
the vit's B = 64 (48 models, 1024 rows of 32; a quick measurement, one thread). The row sums run
in 16 partial sums in the dtype combined pairwise, their tails in float64, and ∂γ, ∂β in the dtype
over blocks of 64 rows and in float64 over the blocks, so the numbers are the formula's up to
rounding.

:func:`layer_norm` takes :class:`StackedLayerNorm` where :func:`usable`, else the composite, which
torch.func, forward-mode AD, torch.compile and dispatch modes differentiate or trace; the Function's
backward runs the composite's autograd where it records a graph (a double backward) or the pass may
not run (tangents, batched gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from affdiv.experiments.runs import composite
from affdiv.layers import _fused


def usable(x: Tensor, weight: Tensor, bias: Tensor) -> bool:
    """Whether :class:`StackedLayerNorm` may take the call: ``_fused.functions_usable``."""
    return _fused.functions_usable(x, weight, bias)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """x̂ ⊙ γ_k + β_k for rows x (K, M, d), weight γ and bias β (K, d): (K, M, d) (module
    docstring). Other shapes are a ValueError."""
    if x.dim() != 3 or weight.shape != (x.shape[0], x.shape[2]) or bias.shape != weight.shape:
        raise ValueError(f"layer_norm: needs rows (K, M, d) and a weight and bias (K, d), got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    if usable(x, weight, bias):
        return StackedLayerNorm.apply(x.contiguous(), weight.contiguous(), bias.contiguous(), eps)
    return layer_norm_composite(x, weight, bias, eps)


def layer_norm_composite(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """:func:`layer_norm` in torch operations."""
    return torch.addcmul(bias.unsqueeze(1), F.layer_norm(x, x.shape[2:], eps=eps), weight.unsqueeze(1))


class StackedLayerNorm(torch.autograd.Function):
    """:func:`layer_norm` on the fused passes (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        # the pass reads dense rows; the inputs themselves are saved (a backward that cannot take
        # the pass differentiates the composite with respect to them)
        y, mean, rstd = _fused.layer_norm(x.contiguous(), weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        gy = gy.contiguous()
        if not _fused.usable(x, gy, weight, mean, rstd):  # a graph recorded, tangents, batched gradients, strides
            grads = composite.composite_grads(lambda *inputs: layer_norm_composite(*inputs, ctx.eps),
                                              (x, weight, bias), gy, ctx.needs_input_grad[:3])
            return *grads, None
        grads = _fused.layer_norm_backward(x, gy, weight, mean, rstd)
        return *(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None

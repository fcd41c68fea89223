"""Measuring the effective activation update of any torch module under one SGD step.

For a module z = f(x; θ), output gradients g = ∂L/∂z and learning rate η:

    ideal   = −η g                                   steepest descent taken in activation space
    linear  = J_θ f · (−η ∇θ L),  ∇θ L = J_θ fᵀ g    jvp after vjp (a vjp, then a jvp): no NTK is built
    finite  = f(x; θ − η ∇θ L) − f(x; θ)             the real step, applied to a copy of θ

``linear`` is the first-order effective update −η Σ_j Θ(x_i, x_j) g_j; ``finite − linear`` is the
Taylor remainder, O(η²), and exactly 0 for modules linear in θ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp

REDUCTIONS = ("sum", "mean")


@dataclass(frozen=True)
class EffectiveUpdate:
    """The three activation updates of one step, each shaped like the module's output."""

    ideal: Tensor
    linear: Tensor
    finite: Tensor
    output: Tensor
    grad_output: Tensor
    lr: float

    @property
    def remainder(self) -> Tensor:
        """finite − linear: the part of the real step that first order misses."""
        return self.finite - self.linear


def as_inputs(inputs: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    if isinstance(inputs, Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs):
        return tuple(inputs)
    raise TypeError(f"inputs must be a Tensor or a tuple of Tensors, got {type(inputs).__name__}")


def parameters_of(module: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters, detached: the θ that the step moves."""
    params = {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters: there is no step to take")
    return params


def check_lr(lr: float) -> float:
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    return float(lr)


def output_gradient(
    output: Tensor,
    loss: Callable[[Tensor], Tensor],
    reduction: str | None,
) -> Tensor:
    """g = ∂L/∂z for L = reduction(per-sample losses) (or a scalar loss, reduction=None)."""
    z = output.detach().requires_grad_(True)
    with torch.enable_grad():
        value = loss(z)
        if value.dim() == 0:
            if reduction is not None:
                raise ValueError(
                    f"the loss returned a scalar, so reduction must be None (it is applied already), got {reduction!r}"
                )
            total = value
        else:
            if reduction not in REDUCTIONS:
                raise ValueError(
                    f"the loss returned per-sample values of shape {tuple(value.shape)}: "
                    f"reduction must be one of {REDUCTIONS}, got {reduction!r}"
                )
            total = value.sum() if reduction == "sum" else value.mean()
        (grad,) = torch.autograd.grad(total, z)
    return grad


def effective_update(
    module: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    grad_output: Tensor | None = None,
    *,
    lr: float,
    loss: Callable[[Tensor], Tensor] | None = None,
    reduction: str | None = None,
) -> EffectiveUpdate:
    """The ideal, first-order and real activation updates of one SGD step of ``module``.

    Give either ``grad_output`` (g = ∂L/∂z, any reduction already in it) or ``loss``: a function of
    the output returning per-sample losses (then ``reduction`` is "sum" or "mean") or a scalar.
    The module's parameters and buffers are never modified: every forward gets fresh copies of the
    buffers (a BatchNorm in train mode updates those copies, not the module's running statistics),
    and the forward runs in the module's current mode (train or eval).
    """
    lr = check_lr(lr)
    if (grad_output is None) == (loss is None):
        raise ValueError("give exactly one of grad_output and loss")
    if grad_output is not None and reduction is not None:
        raise ValueError("reduction applies to a loss function; grad_output already includes it")
    args = as_inputs(inputs)
    params = parameters_of(module)
    buffers = {name: b.detach() for name, b in module.named_buffers()}

    def f(p: dict[str, Tensor]) -> Tensor:
        return functional_call(module, {**p, **{k: b.clone() for k, b in buffers.items()}}, args)

    output, pullback = vjp(f, params)
    if loss is not None:
        grad_output = output_gradient(output, loss, reduction)
    if grad_output.shape != output.shape:
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}, the module output has {tuple(output.shape)}"
        )
    if grad_output.dtype != output.dtype or grad_output.device != output.device:
        raise ValueError(
            f"grad_output is {grad_output.dtype} on {grad_output.device}, "
            f"the output is {output.dtype} on {output.device}"
        )
    (grad,) = pullback(grad_output)
    step = {name: -lr * grad[name] for name in params}
    _, linear = jvp(f, (params,), (step,))
    stepped = {name: params[name] + step[name] for name in params}
    finite = f(stepped) - output
    return EffectiveUpdate(
        ideal=-lr * grad_output,
        linear=linear.detach(),
        finite=finite.detach(),
        output=output.detach(),
        grad_output=grad_output.detach(),
        lr=lr,
    )

"""Measuring the effective activation update of any torch module under one SGD step.

For a module z = f(x; θ), output gradients g = ∂L/∂z and learning rate η:

    ideal   = −η g                                   steepest descent taken in activation space
    linear  = J_θ f · (−η ∇θ L),  ∇θ L = J_θ fᵀ g    jvp after vjp (a vjp, then a jvp): no NTK is built
    finite  = f(x; θ − η ∇θ L) − f(x; θ)             the real step, applied to a copy of θ

``linear`` is the first-order effective update −η Σ_j Θ(x_i, x_j) g_j; ``finite − linear`` is the
Taylor remainder, O(η²), and exactly 0 for modules linear in θ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import jvp, vjp

from affdiv.verify.functional import ModuleFunction, as_inputs, check_lr

REDUCTIONS = ("sum", "mean")


@dataclass(frozen=True)
class EffectiveUpdate:
    r"""The activation updates of one SGD step: ideal −ηg, linear J_θ·(−η∇θL), finite
    z(θ − η∇θL) − z(θ); what :func:`effective_update` returns.

    Args:
        ideal: −η g, the step taken directly in activation space.
        linear: the first-order effective update −η Σ_j Θ(x_i, x_j) g_j (jvp after vjp).
        finite: the real step's change of the output.
        output: z(θ), the output before the step.
        grad_output: g = ∂L/∂z.
        lr: η.

    Shape:
        every tensor: the module output's shape, e.g. :math:`(B, *)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import EffectiveUpdate
        >>> z, g = torch.zeros(2, 3), torch.ones(2, 3)
        >>> u = EffectiveUpdate(ideal=-0.5 * g, linear=-g, finite=-1.25 * g, output=z, grad_output=g, lr=0.5)
        >>> u.remainder[0]  # finite − linear: what first order misses
        tensor([-0.2500, -0.2500, -0.2500])
    """

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


def _check_gradient_source(grad_output: Tensor | None, loss, reduction: str | None) -> None:
    """Refuse anything but exactly one of ``grad_output`` and ``loss`` (``reduction`` with ``loss`` only)."""
    if (grad_output is None) == (loss is None):
        raise ValueError("give exactly one of grad_output and loss")
    if grad_output is not None and reduction is not None:
        raise ValueError("reduction applies to a loss function; grad_output already includes it")


def _check_like_output(grad_output: Tensor, output: Tensor) -> None:
    """Refuse a g = ∂L/∂z whose shape, dtype or device differs from the output's (ValueError)."""
    if grad_output.shape != output.shape:
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}, the module output has {tuple(output.shape)}"
        )
    if grad_output.dtype != output.dtype or grad_output.device != output.device:
        raise ValueError(
            f"grad_output is {grad_output.dtype} on {grad_output.device}, "
            f"the output is {output.dtype} on {output.device}"
        )


def effective_update(
    module: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    grad_output: Tensor | None = None,
    *,
    lr: float,
    loss: Callable[[Tensor], Tensor] | None = None,
    reduction: str | None = None,
) -> EffectiveUpdate:
    r"""The ideal −ηg, first-order J_θ(−η∇θL) and real z(θ − η∇θL) − z(θ) activation updates of
    one SGD step of ``module``.

    The gradient comes from one vjp, the first-order update from one jvp, the real step from a
    forward with the stepped parameters. The module is never modified: every Parameter and
    buffer is the same object with the same value afterwards, for modules used twice and tied
    weights too; a BatchNorm in train mode updates copies of its running statistics; the three
    forward passes run from one RNG state (a Dropout draws one mask for all of them) and leave
    the global RNG state as it was. The forward runs in the module's current mode (train or
    eval). Any module that torch.func differentiates in reverse and forward mode can be
    measured, the layers of :mod:`affdiv.layers` included.

    Args:
        module: the layer or model z = f(x; θ); θ is its parameters with ``requires_grad``.
        inputs: its positional input: a Tensor, or a tuple of Tensors.
        grad_output: g = ∂L/∂z, the output's shape, dtype and device, any loss reduction
            already in it. Default: ``None`` (then ``loss`` is required).
        lr: the step size η > 0 (keyword only, required).
        loss: instead of ``grad_output``, a function of the output returning per-sample losses
            (then ``reduction`` is ``"sum"`` or ``"mean"``) or a scalar. Default: ``None``.
        reduction: ``"sum"`` or ``"mean"`` over per-sample losses; ``None`` for a scalar loss.
            Default: ``None``.

    Returns:
        :class:`EffectiveUpdate` with ``ideal``, ``linear``, ``finite``, ``output``,
        ``grad_output`` (detached) and ``lr``.

    Shape:
        - inputs: what ``module`` takes, e.g. :math:`(B, *)`.
        - grad_output and every update: the output's shape, e.g. :math:`(B, *)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import effective_update
        >>> _ = torch.manual_seed(0)
        >>> layer = torch.nn.Linear(3, 2, dtype=torch.float64)
        >>> x = torch.tensor([[1.0, 2.0, 2.0]], dtype=torch.float64)  # ‖x‖² + 1 = 10
        >>> g = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
        >>> u = effective_update(layer, x, g, lr=0.1)
        >>> (u.linear / u.ideal).round(decimals=12)  # the affine divergence of one sample
        tensor([[10., 10.]], dtype=torch.float64)
        >>> float(u.remainder.abs().max()) < 1e-15  # linear in θ: the real step is first order
        True
    """
    lr = check_lr(lr)
    _check_gradient_source(grad_output, loss, reduction)
    args = as_inputs(inputs)
    function = ModuleFunction(module, args)
    params = function.params

    def f(p: dict[str, Tensor]) -> Tensor:
        return function(p, args)

    output, pullback = vjp(f, params)
    grad_output = output_gradient(output, loss, reduction) if loss is not None else grad_output
    _check_like_output(grad_output, output)
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

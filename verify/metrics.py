"""Alignment of the effective update with the ideal one, per sample.

With ideal update u*_i = −η g_i and effective update u_i (first order, −η Σ_j Θ_ij g_j):

    scale_i            = ⟨u_i, u*_i⟩ / ‖u*_i‖²        the least-squares factor u_i ≈ scale_i u*_i
    diagonal_scale_i   = the same for −η Θ_ii g_i      the sample's own factor (K_ii for the affine family)
    cosine_i           = ⟨u_i, u*_i⟩ / (‖u_i‖ ‖u*_i‖)
    off_diagonal_share = ‖Σ_{j≠i} Θ_ij g_j‖ / ‖Θ_ii g_i‖

For a single sample of an affine layer scale = ‖x‖² + 1 and cosine = 1; the corrections make the
scale uniform; the off-diagonal share is what batch size adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import jvp, vjp, vmap

from affdiv.verify.functional import ModuleFunction, as_inputs, check_lr


def _per_sample(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


def scale_factor(effective: Tensor, ideal: Tensor) -> Tensor:
    r"""The least-squares factor of each sample's update: :math:`⟨u_i, u^*_i⟩ / \|u^*_i\|^2`.

    NaN (or ±inf) for a sample whose ideal update is 0 (g_i = 0), where no factor is defined;
    not guarded, so such samples show up rather than read as 0.

    Args:
        effective: u, the measured update (e.g. ``EffectiveUpdate.linear``).
        ideal: u* = −η g.

    Shape:
        - effective, ideal: :math:`(B, *)`.
        - Output: :math:`(B,)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import scale_factor
        >>> scale_factor(torch.tensor([[2.0, 4.0], [1.0, 0.0]]), torch.tensor([[1.0, 2.0], [0.0, 0.0]]))
        tensor([2., nan])
    """
    u, v = _per_sample(effective), _per_sample(ideal)
    return (u * v).sum(-1) / (v * v).sum(-1)


def cosine(effective: Tensor, ideal: Tensor) -> Tensor:
    r"""The cosine between each sample's update and its ideal one: :math:`⟨u_i, u^*_i⟩ / (\|u_i\| \|u^*_i\|)`.

    Args:
        effective: u, the measured update.
        ideal: u* = −η g.

    Shape:
        - effective, ideal: :math:`(B, *)`.
        - Output: :math:`(B,)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import cosine
        >>> cosine(torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0], [0.0, -3.0]]))
        tensor([ 1., -1.])
    """
    return torch.nn.functional.cosine_similarity(_per_sample(effective), _per_sample(ideal), dim=-1)


def _update(f: Callable, params: dict[str, Tensor], pullback: Callable, g: Tensor, lr: float) -> Tensor:
    """The first-order update of ``f`` from the output gradient ``g`` alone: the gradient
    ``pullback(g)`` (the vjp of ``f`` at ``params``), then the jvp along −η times it."""
    (grad,) = pullback(g)
    _, out = jvp(f, (params,), ({k: -lr * v for k, v in grad.items()},))
    return out


def diagonal_update(module: nn.Module, inputs: Tensor | tuple[Tensor, ...], grad_output: Tensor, lr: float) -> Tensor:
    r"""Each sample's first-order update from its own gradient alone: :math:`-\eta\,\Theta_{ii}\, g_i`.

    One vjp and one jvp per sample, vmapped; the module is left untouched as by
    :func:`effective_update`. It must treat the samples of a batch independently.

    Args:
        module: the layer or model.
        inputs: its positional input(s), batched along the first dimension.
        grad_output: g = ∂L/∂z.
        lr: η > 0.

    Shape:
        - inputs: :math:`(B, *)`; grad_output and the output: the module output's, :math:`(B, *)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import diagonal_update
        >>> layer = torch.nn.Linear(2, 1, dtype=torch.float64)
        >>> x = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
        >>> diagonal_update(layer, x, torch.ones(2, 1, dtype=torch.float64), lr=0.1)  # −η(‖x_i‖² + 1)g_i
        tensor([[-0.2000],
                [-2.6000]], dtype=torch.float64)
    """
    lr = check_lr(lr)
    args = as_inputs(inputs)
    function = ModuleFunction(module, args)
    params = function.params

    def one(g: Tensor, *sample: Tensor) -> Tensor:
        def f(p):
            return function(p, tuple(t.unsqueeze(0) for t in sample))

        _, pullback = vjp(f, params)
        return _update(f, params, pullback, g.unsqueeze(0), lr).squeeze(0)

    return vmap(one)(grad_output, *args)


def off_diagonal_share(linear: Tensor, diagonal: Tensor) -> Tensor:
    r"""What the other samples add to each sample's update, relative to its own:
    :math:`\|u_i - u^{\mathrm{own}}_i\| / \|u^{\mathrm{own}}_i\|`; NaN or inf where the own update is 0.

    Args:
        linear: the first-order update of the whole batch (``EffectiveUpdate.linear``).
        diagonal: each sample's update from its own gradient (:func:`diagonal_update`).

    Shape:
        - linear, diagonal: :math:`(B, *)`.
        - Output: :math:`(B,)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import off_diagonal_share
        >>> off_diagonal_share(torch.tensor([[3.0, 4.0]]), torch.tensor([[3.0, 0.0]]))
        tensor([1.3333])
    """
    off = _per_sample(linear - diagonal).norm(dim=-1)
    return off / _per_sample(diagonal).norm(dim=-1)


@dataclass(frozen=True)
class Alignment:
    r"""The alignment of a measured update with the ideal one, per sample (or per site): what
    :func:`alignment` returns.

    Args:
        scale: :func:`scale_factor` of the batch's update.
        diagonal_scale: :func:`scale_factor` of each sample's own update (K_ii for the affine family).
        cosine: :func:`cosine` of the batch's update.
        off_diagonal_share: :func:`off_diagonal_share`.

    Shape:
        every field: :math:`(B,)` (or one entry per site).

    Example::

        >>> import torch
        >>> from affdiv.verify import Alignment
        >>> one = torch.ones(3)
        >>> Alignment(scale=2 * one, diagonal_scale=one, cosine=one, off_diagonal_share=0 * one).summary()["scale_max"]
        2.0
    """

    scale: Tensor
    diagonal_scale: Tensor
    cosine: Tensor
    off_diagonal_share: Tensor

    def summary(self) -> dict[str, float]:
        """min and max of the scales, mean and min of the cosine, mean off-diagonal share."""
        return {
            "scale_min": float(self.scale.min()),
            "scale_max": float(self.scale.max()),
            "diagonal_scale_min": float(self.diagonal_scale.min()),
            "diagonal_scale_max": float(self.diagonal_scale.max()),
            "cosine_mean": float(self.cosine.mean()),
            "cosine_min": float(self.cosine.min()),
            "off_diagonal_share_mean": float(self.off_diagonal_share.mean()),
        }


def alignment(module: nn.Module, inputs, grad_output: Tensor, lr: float, linear: Tensor) -> Alignment:
    r"""The scale factors, cosine and off-diagonal share of a measured first-order update
    ``linear`` against the ideal :math:`-\eta g`, per sample.

    Args:
        module: the layer or model measured.
        inputs: its positional input(s).
        grad_output: g = ∂L/∂z.
        lr: η > 0.
        linear: the measured first-order update (``EffectiveUpdate.linear``).

    Shape:
        - inputs: :math:`(B, *)`; grad_output and linear: the output's, :math:`(B, *)`.
        - every field of the result: :math:`(B,)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import alignment, effective_update
        >>> layer = torch.nn.Linear(2, 1, dtype=torch.float64)
        >>> x, g = torch.tensor([[3.0, 4.0]], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
        >>> a = alignment(layer, x, g, 0.1, effective_update(layer, x, g, lr=0.1).linear)
        >>> round(a.scale.item(), 12), round(a.cosine.item(), 12)  # one sample: ‖x‖² + 1, aligned
        (26.0, 1.0)
    """
    return _alignment(linear, diagonal_update(module, inputs, grad_output, lr), -lr * grad_output)


def _alignment(effective: Tensor, diagonal: Tensor, ideal: Tensor) -> Alignment:
    """The metrics of an update ``effective``, whose own part is ``diagonal``, against ``ideal``,
    row by row (per sample or per site)."""
    return Alignment(
        scale=scale_factor(effective, ideal),
        diagonal_scale=scale_factor(diagonal, ideal),
        cosine=cosine(effective, ideal),
        off_diagonal_share=off_diagonal_share(effective, diagonal),
    )


# ---------------------------------------------------------------------------------------------
# per site (position of a sample, token of a sequence): the same three metrics one level down.
# ``sites`` maps an output-shaped tensor to (n_sites, features), one row per site.


def site_diagonal_update(
    module: nn.Module, inputs, grad_output: Tensor, lr: float, sites: Callable[[Tensor], Tensor]
) -> Tensor:
    """−η Θ_ss g_s for every site s, as (n_sites, features): each site's update from its own
    gradient alone (all other sites' gradients, in every sample, set to zero).

    Cost: one vjp and one jvp of the whole batch per site, vmapped (memory n_sites × output size):
    a measurement for small problems, like the NTK."""
    lr = check_lr(lr)
    args = as_inputs(inputs)
    function = ModuleFunction(module, args)
    params = function.params
    index = sites(torch.arange(grad_output.numel(), device=grad_output.device).reshape(grad_output.shape))
    masks = torch.zeros(index.shape[0], grad_output.numel(), dtype=grad_output.dtype, device=grad_output.device)
    masks.scatter_(1, index, 1.0)

    def f(p):
        return function(p, args)

    _, pullback = vjp(f, params)

    def one(mask: Tensor, rows: Tensor) -> Tensor:
        out = _update(f, params, pullback, grad_output * mask.reshape(grad_output.shape), lr)
        return out.reshape(-1).gather(0, rows)

    return vmap(one)(masks, index)


def site_alignment(
    module: nn.Module, inputs, grad_output: Tensor, lr: float, linear: Tensor, sites: Callable[[Tensor], Tensor]
) -> Alignment:
    """The alignment metrics per site; "off-diagonal" is every other site, of the same sample and of
    the others."""
    diagonal = site_diagonal_update(module, inputs, grad_output, lr, sites)
    return _alignment(sites(linear), diagonal, sites(-lr * grad_output))

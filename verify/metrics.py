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
from torch.func import functional_call, jvp, vjp, vmap

from affdiv.verify.engine import as_inputs, check_lr, parameters_of


def _per_sample(t: Tensor) -> Tensor:
    return t.reshape(t.shape[0], -1)


def scale_factor(effective: Tensor, ideal: Tensor) -> Tensor:
    """⟨u_i, u*_i⟩ / ‖u*_i‖² per sample: NaN (or ±inf) for a sample whose ideal update is 0 (g_i = 0),
    where no factor is defined; not guarded, so such samples show up rather than read as 0."""
    u, v = _per_sample(effective), _per_sample(ideal)
    return (u * v).sum(-1) / (v * v).sum(-1)


def cosine(effective: Tensor, ideal: Tensor) -> Tensor:
    return torch.nn.functional.cosine_similarity(_per_sample(effective), _per_sample(ideal), dim=-1)


def diagonal_update(module: nn.Module, inputs: Tensor | tuple[Tensor, ...], grad_output: Tensor, lr: float) -> Tensor:
    """−η Θ_ii g_i for every sample i: each sample's update from its own gradient alone."""
    lr = check_lr(lr)
    args = as_inputs(inputs)
    params = parameters_of(module)

    def one(g: Tensor, *sample: Tensor) -> Tensor:
        def f(p):
            return functional_call(module, p, tuple(t.unsqueeze(0) for t in sample))

        _, pullback = vjp(f, params)
        (grad,) = pullback(g.unsqueeze(0))
        _, out = jvp(f, (params,), ({k: -lr * v for k, v in grad.items()},))
        return out.squeeze(0)

    return vmap(one)(grad_output, *args)


def off_diagonal_share(linear: Tensor, diagonal: Tensor) -> Tensor:
    """‖linear_i − diagonal_i‖ / ‖diagonal_i‖ per sample: NaN or inf where the own update is 0."""
    off = _per_sample(linear - diagonal).norm(dim=-1)
    return off / _per_sample(diagonal).norm(dim=-1)


@dataclass(frozen=True)
class Alignment:
    scale: Tensor
    diagonal_scale: Tensor
    cosine: Tensor
    off_diagonal_share: Tensor

    def summary(self) -> dict[str, float]:
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
    """All three metrics for a measured first-order update ``linear``."""
    ideal = -lr * grad_output
    diagonal = diagonal_update(module, inputs, grad_output, lr)
    return Alignment(
        scale=scale_factor(linear, ideal),
        diagonal_scale=scale_factor(diagonal, ideal),
        cosine=cosine(linear, ideal),
        off_diagonal_share=off_diagonal_share(linear, diagonal),
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
    params = parameters_of(module)
    index = sites(torch.arange(grad_output.numel(), device=grad_output.device).reshape(grad_output.shape))
    masks = torch.zeros(index.shape[0], grad_output.numel(), dtype=grad_output.dtype, device=grad_output.device)
    masks.scatter_(1, index, 1.0)

    def f(p):
        return functional_call(module, p, args)

    _, pullback = vjp(f, params)

    def one(mask: Tensor, rows: Tensor) -> Tensor:
        (grad,) = pullback(grad_output * mask.reshape(grad_output.shape))
        _, out = jvp(f, (params,), ({k: -lr * v for k, v in grad.items()},))
        return out.reshape(-1).gather(0, rows)

    return vmap(one)(masks, index)


def site_alignment(
    module: nn.Module, inputs, grad_output: Tensor, lr: float, linear: Tensor, sites: Callable[[Tensor], Tensor]
) -> Alignment:
    """The alignment metrics per site; "off-diagonal" is every other site, of the same sample and of
    the others."""
    ideal = sites(-lr * grad_output)
    diagonal = site_diagonal_update(module, inputs, grad_output, lr, sites)
    effective = sites(linear)
    return Alignment(
        scale=scale_factor(effective, ideal),
        diagonal_scale=scale_factor(diagonal, ideal),
        cosine=cosine(effective, ideal),
        off_diagonal_share=off_diagonal_share(effective, diagonal),
    )

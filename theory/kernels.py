"""Shared pieces of the conv, residual and attention derivations.

A *site* is one output vector that the theory treats as a unit: one spatial position of one
sample (conv: all output channels there), one token of one sequence (attention). ``ExtendedDerivation``
adds to a derivation, each optional:

    sites(t)          an output-shaped tensor as (n_sites, features), one row per site;
    site_diagonal(c)  the predicted factor k_ss of every output entry (broadcastable to the output),
                      when the site's own block Θ_ss is k_ss·I (per conv group): a site's update from
                      its own gradient alone is then −η k_ss g_s;
    taylor_lrs        the step sizes of the Taylor-remainder check, when the default window
                      (10⁻¹ … 10⁻⁴) reaches past the layer's asymptotic regime.

so that `affdiv verify` can measure per-site scale, cosine and off-diagonal share, and check k_ss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy as sp
import torch
from torch import Tensor

from affdiv.theory.derivation import Case, Derivation


@dataclass(frozen=True)
class ExtendedDerivation(Derivation):
    """A derivation with a per-site view of its output and/or its own Taylor window."""

    sites: Callable[[Tensor], Tensor] | None = None
    site_diagonal: Callable[[Case], Tensor] | None = None
    taylor_lrs: tuple[float, ...] | None = None


def channels_first_sites(t: Tensor) -> Tensor:
    """(B, C, *spatial) -> (B·∏spatial, C): one row per position of each sample."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


def channels_last_sites(t: Tensor) -> Tensor:
    """(B, T, C) -> (B·T, C): one row per token of each sequence."""
    return t.reshape(-1, t.shape[-1])


def seed_from(generator: torch.Generator) -> int:
    """A torch seed drawn from ``generator`` (so module initialisation follows the case seed)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def correlated_rows(shape: tuple[int, ...], generator: torch.Generator, spread: float = 1.0) -> Tensor:
    """Float64 samples sharing a common offset (so kernels are far from diagonal), with per-sample
    norms spread over exp(±spread) (so diagonal factors vary)."""
    batch = shape[0]
    scale = torch.exp(torch.empty(batch, dtype=torch.float64).uniform_(-spread, spread, generator=generator))
    offset = torch.randn((1,) + shape[1:], dtype=torch.float64, generator=generator)
    noise = torch.randn(shape, dtype=torch.float64, generator=generator)
    return scale.reshape((batch,) + (1,) * (len(shape) - 1)) * (0.7 * noise + 0.5 * offset)


def require(sizes: Mapping[str, int], *keys: str) -> None:
    """Bad sizes name what was expected and what was given."""
    missing = [k for k in keys if k not in sizes]
    if missing:
        raise ValueError(f"sizes must give {keys}; missing {missing} in {dict(sizes)}")


def is_zero_expression(residual) -> bool:
    """True when a sympy (matrix) expression, after .doit() and expansion, is identically zero."""
    residual = sp.expand(residual.doit())
    return residual == 0 or isinstance(residual, sp.ZeroMatrix)


def exact_first_order(forward, params: Mapping[str, sp.Matrix], grad_output: sp.Matrix, eta: sp.Expr) -> sp.Matrix:
    """J Δθ = Σ_k ∂z/∂θ_k Δθ_k, Δθ = −η ∂(Σ g·z)/∂θ, exactly at ``params`` (no simplification).

    The first-order half of theory.exact.exact_effective_update, for layers whose real step has
    no closed form worth simplifying (softmax, tanh, nested radicals)."""
    symbols = {
        name: sp.Matrix(value.rows, value.cols, lambda i, j, n=name: sp.Symbol(f"{n}_{i}_{j}"))
        for name, value in params.items()
    }
    at_params = {symbols[n][k]: params[n][k] for n in params for k in range(len(params[n]))}
    z = forward(symbols)
    if z.shape != grad_output.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, the output has {z.shape}")
    flat = [s for n in symbols for s in symbols[n]]
    jac = [z.diff(s).subs(at_params) for s in flat]
    step = [-eta * sum((g * d for g, d in zip(grad_output, j)), sp.Integer(0)) for j in jac]
    return sum((j * s for j, s in zip(jac, step)), sp.zeros(*z.shape))


def is_zero_exactly(matrix: sp.Matrix) -> bool:
    """Every entry expands to 0 (sympy canonicalises products of rational radicals and keeps
    undefined functions as atoms, so expansion suffices for the expressions built here)."""
    return all(sp.expand(entry) == 0 for entry in matrix)

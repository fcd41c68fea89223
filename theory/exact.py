"""Exact (rational / algebraic) effective updates at concrete sizes, by explicit differentiation.

For a layer given as a sympy function of its parameter matrices, this computes with no rounding

    Δθ      = −η ∂L/∂θ,             L = Σ_i g_i · z_i   (g fixed: the cotangent at θ)
    finite  = z(θ + Δθ) − z(θ)        (the real step, η left symbolic)
    linear  = Σ_k ∂z/∂θ_k Δθ_k        (the first-order effective update, J Δθ)

so that a closed form can be proven equal to them as an identity in η at that size.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy as sp

ETA = sp.Symbol("eta", positive=True)

Forward = Callable[[Mapping[str, sp.Matrix]], sp.Matrix]


@dataclass(frozen=True)
class ExactUpdate:
    finite: sp.Matrix
    linear: sp.Matrix


def random_rational_matrix(rows: int, cols: int, rng: random.Random, *, nonzero: bool = False) -> sp.Matrix:
    """Small random rationals p/q with |p| ≤ 5, 1 ≤ q ≤ 4 (exact, reproducible from rng)."""

    def entry() -> sp.Rational:
        while True:
            value = sp.Rational(rng.randint(-5, 5), rng.randint(1, 4))
            if value != 0 or not nonzero:
                return value

    return sp.Matrix(rows, cols, lambda i, j: entry())


def _symbolic(params: Mapping[str, sp.Matrix]):
    """Parameter matrices of fresh symbols, and the substitution that puts ``params`` back."""
    symbols = {
        name: sp.Matrix(value.rows, value.cols, lambda i, j, n=name: sp.Symbol(f"{n}_{i}_{j}"))
        for name, value in params.items()
    }
    at_params = {symbols[n][k]: params[n][k] for n in params for k in range(len(params[n]))}
    return symbols, at_params


def _jacobian_and_step(forward: Forward, params, grad_output: sp.Matrix, eta: sp.Expr):
    """(symbols, ∂z/∂θ_k at params for each θ_k, Δθ_k = −η Σ g·∂z/∂θ_k) for every scalar θ_k."""
    symbols, at_params = _symbolic(params)
    z = forward(symbols)
    if z.shape != grad_output.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, the output has {z.shape}")
    flat = [s for n in symbols for s in symbols[n]]
    jacobian = {s: z.diff(s).subs(at_params) for s in flat}
    step = {s: -eta * sum((g * d for g, d in zip(grad_output, jacobian[s])), sp.Integer(0)) for s in flat}
    return symbols, jacobian, step


def exact_first_order(forward: Forward, params: Mapping[str, sp.Matrix], grad_output: sp.Matrix, eta=ETA) -> sp.Matrix:
    """J Δθ exactly at ``params``, unsimplified: for layers whose real step has no closed form worth
    simplifying (softmax, tanh, nested radicals)."""
    _, jacobian, step = _jacobian_and_step(forward, params, grad_output, eta)
    return sum((jacobian[s] * step[s] for s in jacobian), sp.zeros(*grad_output.shape))


def exact_effective_update(
    forward: Forward,
    params: Mapping[str, sp.Matrix],
    grad_output: sp.Matrix,
    eta: sp.Expr = ETA,
) -> ExactUpdate:
    """The finite and first-order effective updates of ``forward`` at ``params``, exactly."""
    symbols, jacobian, step = _jacobian_and_step(forward, params, grad_output, eta)
    stepped = {
        n: params[n] + sp.Matrix(params[n].rows, params[n].cols, lambda i, j, n=n: step[symbols[n][i, j]])
        for n in params
    }
    finite = (forward(stepped) - forward(params)).applyfunc(sp.simplify)
    linear = sum((jacobian[s] * step[s] for s in jacobian), sp.zeros(*grad_output.shape))
    return ExactUpdate(finite=finite, linear=linear.applyfunc(sp.simplify))


def is_zero_matrix(matrix: sp.Matrix) -> bool:
    """True when every entry simplifies to exactly 0 (radicals included)."""
    return all(sp.simplify(sp.radsimp(entry)) == 0 for entry in matrix)


def is_zero_exactly(matrix: sp.Matrix) -> bool:
    """Every entry expands to 0 (sympy canonicalises products of rational radicals and keeps
    undefined functions as atoms, so expansion suffices where simplify would be slow)."""
    return all(sp.expand(entry) == 0 for entry in matrix)


def is_zero_expression(residual) -> bool:
    """True when a sympy matrix expression, after .doit() and expansion, is identically zero."""
    residual = sp.expand(residual.doit())
    return residual == 0 or isinstance(residual, sp.ZeroMatrix)

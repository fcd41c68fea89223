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


def exact_effective_update(
    forward: Forward,
    params: Mapping[str, sp.Matrix],
    grad_output: sp.Matrix,
    eta: sp.Expr = ETA,
) -> ExactUpdate:
    """The finite and first-order effective updates of ``forward`` at ``params``, exactly."""
    symbols = {
        name: sp.Matrix(value.rows, value.cols, lambda i, j, n=name: sp.Symbol(f"{n}_{i}_{j}"))
        for name, value in params.items()
    }
    at_params = {symbols[n][k]: params[n][k] for n in params for k in range(len(params[n]))}
    z = forward(symbols)
    if z.shape != grad_output.shape:
        raise ValueError(f"grad_output has shape {grad_output.shape}, the output has {z.shape}")
    loss = sum((g * zz for g, zz in zip(grad_output, z)), sp.Integer(0))
    flat = [s for n in symbols for s in symbols[n]]
    step = {s: -eta * sp.diff(loss, s).subs(at_params) for s in flat}
    stepped = {
        n: params[n] + sp.Matrix(params[n].rows, params[n].cols, lambda i, j, n=n: step[symbols[n][i, j]])
        for n in params
    }
    finite = (forward(stepped) - forward(params)).applyfunc(sp.simplify)
    linear = sp.zeros(*z.shape)
    for s in flat:
        linear += z.diff(s).subs(at_params) * step[s]
    return ExactUpdate(finite=finite, linear=linear.applyfunc(sp.simplify))


def is_zero_matrix(matrix: sp.Matrix) -> bool:
    """True when every entry simplifies to exactly 0 (radicals included)."""
    return all(sp.simplify(sp.radsimp(entry)) == 0 for entry in matrix)

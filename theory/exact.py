"""Exact (rational / algebraic) effective updates at concrete sizes, by explicit differentiation.

For a layer given as a sympy function of its parameter matrices, this computes with no rounding

    Δθ      = −η ∂L/∂θ,             L = Σ_i g_i · z_i   (g fixed: the cotangent at θ)
    finite  = z(θ + Δθ) − z(θ)        (the real step, η left symbolic)
    linear  = Σ_k ∂z/∂θ_k Δθ_k        (the first-order effective update, J Δθ)

so that a closed form can be proven equal to them as an identity in η at that size. ``is_zero``
is the one zero test of every proof (explicit matrices and sympy matrix expressions alike);
``symbolic_identity`` turns a general-size matrix-calculus residual into a proof step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy as sp

from affdiv.theory.derivation import Proof, ProofKind

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


def is_zero(value: sp.Basic | sp.MatrixBase) -> bool:
    """True when ``value`` is identically 0: the one zero test of every proof.

    * a matrix expression of sympy's matrix calculus (MatrixSymbol …): ``.doit()``, then expansion
      to 0 or to the ZeroMatrix (matrix-calculus identities are polynomial in their symbols);
    * an explicit matrix: every entry, with each exp(r) replaced by an independent positive symbol,
      cancels to 0 as a rational function, or else expands to 0 (radicals multiply out), or else
      simplifies to 0 after rationalising its radicals. Cheapest test first; replacing exps by free symbols is sound (a
      rational function that vanishes for all values of the symbols vanishes at the true values;
      sympy's own merging of exp products can only add relations, never create a false zero), so
      a True is a proof, a False only says that these normal forms did not reach 0.
    """
    if not isinstance(value, sp.MatrixBase):
        return _vanishes(_expand(value))
    atoms = sorted(set().union(*(e.atoms(sp.exp) for e in value)), key=sp.default_sort_key)
    free = {a: sp.Symbol(f"E{i}", positive=True) for i, a in enumerate(atoms)}
    return all(_entry_is_zero(entry.xreplace(free)) for entry in value)


def _expand(expression):
    return sp.expand(expression.doit())


def _vanishes(expanded) -> bool:
    return expanded == 0 or isinstance(expanded, sp.ZeroMatrix)


def _entry_is_zero(entry: sp.Expr) -> bool:
    return (
        sp.cancel(sp.together(entry)) == 0
        or sp.expand(entry) == 0
        or sp.simplify(sp.radsimp(entry)) == 0
    )


def symbolic_identity(claim: str, residual) -> Proof:
    """The proof step "``residual`` (a sympy matrix expression at general size) is identically 0"."""
    expanded = _expand(residual)
    return Proof(
        claim=claim,
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=bool(_vanishes(expanded)),
        detail=f"sympy matrix calculus, residual expands to {expanded}",
    )

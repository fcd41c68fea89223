"""Exact (rational / algebraic) effective updates at concrete sizes, by explicit differentiation.

For a layer given as a sympy function of its parameter matrices, this computes with no rounding

    Δθ      = −η ∂L/∂θ,             L = Σ_i g_i · z_i   (g fixed: the cotangent at θ)
    finite  = z(θ + Δθ) − z(θ)        (the real step, η left symbolic)
    linear  = Σ_k ∂z/∂θ_k Δθ_k        (the first-order effective update, J Δθ)

so that a closed form can be proven equal to them as an identity in η at that size. ``is_zero``
is the one zero test of every proof (explicit matrices and sympy matrix expressions alike);
``symbolic_identity`` turns a general-size residual into a proof step: a matrix-calculus
expression, or an index expression (finite sums over symbolic ranges, ``differentiate_entry``
summing the Kronecker deltas of a derivative, ``sum_normal_form`` the normal form of the sums).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
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


def differentiate_entry(expr: sp.Expr, entry: sp.Indexed, sizes: Sequence[sp.Symbol]) -> sp.Expr:
    """∂expr/∂entry for an index expression (finite sums), with the Kronecker-delta sums done.

    ``entry`` = X[i_1, …, i_r] with nonnegative integer symbols i_a, index a ranging over
    [0, sizes[a]). sympy sums δ(i, j) over j ∈ [0, n − 1] to a Piecewise on i ≤ n − 1; writing
    n = i + 1 + r with r ≥ 0 (the statement that the entry exists) makes each delta sum
    unconditional, and n is put back afterwards. A delta or Piecewise that is left means the
    derivative was not summed in closed form; the zero test then fails rather than guesses.
    """
    if len(sizes) != len(entry.indices):
        raise ValueError(f"sizes must give one size per index of {entry}, got {len(sizes)}")
    slack = [sp.Dummy(f"r{a}", integer=True, nonnegative=True) for a in range(len(sizes))]
    into = {size: index + 1 + r for size, index, r in zip(sizes, entry.indices, slack)}
    back = {r: size - index - 1 for size, index, r in zip(sizes, entry.indices, slack)}
    return sp.diff(expr.subs(into), entry).doit().subs(back)


def sum_normal_form(expr: sp.Expr) -> sp.Expr:
    """``expr`` with every finite sum flattened, distributed and gathered by its ranges.

    Each rewrite is an identity of finite sums whose bounds do not depend on one another (checked):
    a sum of a sum is one sum over the product range, in any order of its indices (sorted here);
    a sum distributes over +; a product of sums over distinct indices is one sum of the product.
    Summands with the same ranges are added and expanded, so a residual that cancels term by term
    under these rules comes out as 0. The summation indices must be distinct symbols throughout.
    """
    gathered: dict[tuple, sp.Expr] = {}
    for summand, limits in _sum_terms(sp.expand(expr)):
        indices = [limit[0] for limit in limits]
        bounds = set().union(*(limit[1].free_symbols | limit[2].free_symbols for limit in limits)) if limits else set()
        if len(set(indices)) != len(indices) or bounds & set(indices):
            raise ValueError(f"sum_normal_form needs distinct indices over independent ranges, got {limits}")
        key = tuple(sorted(limits, key=lambda limit: sp.default_sort_key(limit[0])))
        gathered[key] = gathered.get(key, sp.Integer(0)) + summand
    summands = {limits: sp.expand(f) for limits, f in gathered.items()}
    return sp.Add(*[sp.Sum(f, *limits) if limits else f for limits, f in summands.items() if f != 0])


def _sum_terms(expr: sp.Expr) -> list[tuple[sp.Expr, tuple]]:
    """expr as a list of (summand, ranges): Σ over the ranges of the summand, added up."""
    if isinstance(expr, sp.Add):
        return [term for arg in expr.args for term in _sum_terms(arg)]
    if isinstance(expr, sp.Sum):
        return [(f, limits + tuple(expr.limits)) for f, limits in _sum_terms(sp.expand(expr.function))]
    if isinstance(expr, sp.Mul):
        terms = [(sp.Integer(1), ())]
        for factor in expr.args:
            terms = [(f * h, a + b) for f, a in terms for h, b in _sum_terms(factor)]
        return terms
    if isinstance(expr, sp.Pow) and expr.base.has(sp.Sum) and expr.exp.is_Integer and expr.exp > 0:
        return _sum_terms(sp.Mul(*[expr.base] * int(expr.exp), evaluate=False))
    if expr.has(sp.Sum):
        raise ValueError(f"sum_normal_form cannot bring {expr} to sums of products")
    return [(expr, ())]


def linear_sums(expr: sp.Expr) -> sp.Expr:
    """``expr`` with every finite sum distributed over + and its index-free factors pulled out
    (Σ_l (c f_l + h_l) = c Σ_l f_l + Σ_l h_l), innermost sums first."""
    if not expr.args:
        return expr
    expr = expr.func(*[linear_sums(arg) for arg in expr.args])
    if not isinstance(expr, sp.Sum):
        return expr
    indices = {limit[0] for limit in expr.limits}
    total = sp.Integer(0)
    for term in sp.Add.make_args(sp.expand(expr.function)):
        factors = sp.Mul.make_args(term)
        outside = [f for f in factors if not f.free_symbols & indices]
        inside = [f for f in factors if f.free_symbols & indices]
        total += sp.Mul(*outside) * sp.Sum(sp.Mul(*inside), *expr.limits)
    return total


def sums_as_atoms(expr: sp.Expr) -> sp.Expr:
    """Every distinct finite sum replaced by a fresh symbol (positive when the sum is of exps).

    Each one-index sum is first written with one shared index name (renaming a bound index changes
    nothing), so Σ_k a_k u_k and Σ_l a_l u_l become one symbol. Sound for zero tests: a rational
    identity in independent symbols holds at any values they take, the sums' values included."""
    sums = sorted({_one_index_name(term) for term in expr.atoms(sp.Sum)}, key=sp.default_sort_key)
    expr = expr.xreplace({term: _one_index_name(term) for term in expr.atoms(sp.Sum)})
    atoms = {
        term: sp.Dummy(f"sum{i}", positive=bool(term.function.is_positive)) for i, term in enumerate(sums)
    }
    return expr.xreplace(atoms)


_INDEX = sp.Dummy("l", integer=True)


def _one_index_name(term: sp.Sum) -> sp.Sum:
    if len(term.limits) != 1 or term.function.has(sp.Sum):
        return term
    (index, low, high), = term.limits
    return sp.Sum(term.function.xreplace({index: _INDEX}), (_INDEX, low, high))


def symbolic_identity(claim: str, residual) -> Proof:
    """The proof step "``residual`` is identically 0" at general size: a sympy matrix expression
    (expanded by matrix calculus) or an index expression with finite sums (``sum_normal_form``)."""
    if isinstance(residual, sp.Expr) and residual.has(sp.Sum):
        expanded, how = sum_normal_form(residual), "sympy index calculus (finite sums, Kronecker deltas)"
    else:
        expanded, how = _expand(residual), "sympy matrix calculus"
    return Proof(
        claim=claim,
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=bool(_vanishes(expanded)),
        detail=f"{how}, residual expands to {expanded}",
    )

"""The index-calculus helpers of the general-size proofs: delta sums, the normal form of finite sums,
sums as atoms. Each must prove true identities and refuse false ones."""

import pytest
import sympy as sp

from affdiv.theory.exact import differentiate_entry, is_zero, linear_sums, sum_normal_form, sums_as_atoms

n = sp.Symbol("n", integer=True, positive=True)
i, j, a = sp.symbols("i j a", integer=True, nonnegative=True)
w, x, y = sp.IndexedBase("w"), sp.IndexedBase("x"), sp.IndexedBase("y")


def test_delta_sum_of_a_derivative_is_unconditional():
    """∂/∂w[a] Σ_{i<n} w[i] x[i] = x[a], with no Piecewise on a < n left."""
    got = differentiate_entry(sp.Sum(w[i] * x[i], (i, 0, n - 1)), w[a], (n,))
    assert got == x[a]
    with pytest.raises(ValueError, match="one size per index"):
        differentiate_entry(sp.Sum(w[i], (i, 0, n - 1)), w[a], (n, n))


def test_sum_normal_form_exchanges_and_distributes_and_refuses_false_identities():
    swapped = sp.Sum(sp.Sum(x[i] * y[j], (i, 0, n - 1)), (j, 0, n - 1)) - sp.Sum(x[i], (i, 0, n - 1)) * sp.Sum(
        y[j], (j, 0, n - 1)
    )
    assert sum_normal_form(swapped) == 0
    assert sum_normal_form(sp.Sum(x[i] + y[i], (i, 0, n - 1)) - sp.Sum(x[i], (i, 0, n - 1))) != 0
    with pytest.raises(ValueError, match="independent ranges"):
        sum_normal_form(sp.Sum(x[i] * y[j], (i, 0, j), (j, 0, n - 1)))


def test_sums_as_atoms_rename_bound_indices_only():
    """Σ_i x_i and Σ_j x_j are one atom; Σ_i x_i y_i and Σ_i x_i are not."""
    same = linear_sums(sp.Sum(2 * x[i], (i, 0, n - 1)) - 2 * sp.Sum(x[j], (j, 0, n - 1)))
    assert is_zero(sp.Matrix([sums_as_atoms(same)]))
    different = sp.Sum(x[i] * y[i], (i, 0, n - 1)) - sp.Sum(x[i], (i, 0, n - 1))
    assert not is_zero(sp.Matrix([sums_as_atoms(different)]))

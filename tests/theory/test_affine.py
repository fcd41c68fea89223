"""The affine-family derivations: proofs hold, and the closed form matches measurements."""

import dataclasses

import pytest
import sympy as sp
import torch
from hypothesis import given
from hypothesis import strategies as st

from affdiv.theory import ProofKind, affine, registry
from affdiv.theory.exact import ETA, exact_effective_update, is_zero
from affdiv.verify.checks import TOL, check_diagonal, check_linearity, check_update
from affdiv.verify.engine import effective_update
from affdiv.verify.ntk import empirical_ntk, ntk_update

MEMBERS = ("affine", "norm_l2", "norm_rms", "affine_like")


def test_every_member_is_registered_and_proven_at_general_dimension():
    derivations = registry()
    for name in MEMBERS:
        d = derivations[name]
        assert d.proven, [p for p in d.proof_steps() if not p.holds]
        assert d.proof_kind is ProofKind.SYMBOLIC_GENERAL
        assert any(p.kind is ProofKind.EXACT_CONCRETE and p.corroborates for p in d.proof_steps())


@pytest.mark.parametrize(
    "name, expected",
    [("affine", affine.S + 1), ("norm_l2", 2), ("norm_rms", affine.M + 1), ("affine_like", 1)],
)
def test_diagonal_factors_are_those_of_the_paper(name, expected):
    member = affine.member(name)
    assert sp.simplify(member.diagonal_factor - expected) == 0


def test_exact_machinery_sees_a_second_order_term():
    """z = w² x is not linear in w: the exact real step differs from J Δθ by η² terms."""
    x = sp.Rational(3, 2)

    def forward(p):
        return sp.Matrix([[p["w"][0] ** 2 * x]])

    exact = exact_effective_update(forward, {"w": sp.Matrix([[sp.Rational(1, 3)]])}, sp.Matrix([[1]]))
    remainder = sp.expand(exact.finite[0] - exact.linear[0])
    assert not is_zero(exact.finite - exact.linear)
    assert sp.degree(remainder, ETA) == 2


def test_member_lookup_names_the_choices():
    assert affine.member("norm_rms").name == "norm_rms"
    with pytest.raises(ValueError, match="member must be one of"):
        affine.member("norm_l3")


def test_zero_test_is_exact_on_radicals_exponentials_and_matrix_expressions():
    """is_zero: True only for identities — radicals (√2·√8 = 4), exps as free symbols, MatrixSymbol calculus."""
    assert is_zero(sp.Matrix([[sp.sqrt(2) * sp.sqrt(8) - 4, 1 / (1 + sp.sqrt(2)) - (sp.sqrt(2) - 1)]]))
    assert not is_zero(sp.Matrix([[sp.sqrt(2) - sp.Rational(141421, 100000)]]))
    e = sp.exp(sp.Rational(1, 3))
    assert is_zero(sp.Matrix([[e / (e + 1) - 1 + 1 / (e + 1)]]))
    assert not is_zero(sp.Matrix([[e / (e + 1) - sp.Rational(1, 2)]]))
    a = sp.MatrixSymbol("A", 2, 2)
    assert is_zero(a * (a + a) - 2 * a * a) and not is_zero(a * a.T - a.T * a)


sizes = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 12),
        "in_features": st.integers(1, 20),
        "out_features": st.integers(1, 6),
    }
)


@given(name=st.sampled_from(MEMBERS), sizes=sizes, seed=st.integers(0, 2**16), lr=st.floats(1e-4, 10.0))
def test_closed_form_matches_autograd_and_real_step(name, sizes, seed, lr):
    result = check_update(registry()[name], sizes, seed, lr=lr)
    assert result.passed, result


@given(name=st.sampled_from(MEMBERS), sizes=sizes, seed=st.integers(0, 2**16))
def test_diagonal_factor_matches_single_sample_steps(name, sizes, seed):
    result = check_diagonal(registry()[name], sizes, seed)
    assert result.passed, result


@pytest.mark.parametrize("name", MEMBERS)
def test_closed_form_matches_a_torch_optim_sgd_step(name):
    """An independent real step: torch.optim.SGD on the module itself, not the engine's."""
    d = registry()[name]
    generator = torch.Generator().manual_seed(7)
    case = d.build({"batch": 6, "in_features": 9, "out_features": 4}, generator)
    x = case.inputs[0]
    target = torch.randn(6, 4, dtype=torch.float64, generator=generator)
    before = case.module(x).detach()
    out = case.module(x)
    loss = 0.5 * ((out - target) ** 2).sum(-1).mean()
    grad_output = torch.autograd.grad(loss, out, retain_graph=True)[0]
    optimizer = torch.optim.SGD(case.module.parameters(), lr=0.05)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    after = case.module(x).detach()
    predicted = d.predict(case, grad_output, 0.05)
    assert torch.allclose(after - before, predicted, rtol=0, atol=TOL * predicted.abs().max())


def test_mean_reduction_divides_by_batch():
    """loss=mean: g_j = (1/B) ∂ℓ_j/∂z_j, so the update is the sum-reduction update over B."""
    d = registry()["affine_like"]
    case = d.build({"batch": 5, "in_features": 4, "out_features": 3}, torch.Generator().manual_seed(1))
    target = torch.zeros(5, 3, dtype=torch.float64)

    def per_sample(z):
        return ((z - target) ** 2).sum(-1)

    summed = effective_update(case.module, case.inputs, loss=per_sample, reduction="sum", lr=0.1)
    mean = effective_update(case.module, case.inputs, loss=per_sample, reduction="mean", lr=0.1)
    assert torch.allclose(mean.finite * 5, summed.finite, rtol=1e-12, atol=0)
    assert torch.allclose(summed.linear, d.predict(case, summed.grad_output, 0.1), rtol=1e-12, atol=1e-15)


def test_ntk_of_affine_layer_is_augmented_gram_times_identity():
    layer = torch.nn.Linear(3, 2, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    theta = empirical_ntk(layer, x)
    expected = (x @ x.T + 1)[:, :, None, None] * torch.eye(2, dtype=torch.float64)
    assert theta.shape == (4, 4, 2, 2)
    assert torch.allclose(theta, expected, rtol=1e-14, atol=1e-14)
    g = torch.randn(4, 2, dtype=torch.float64)
    assert torch.allclose(ntk_update(theta, g, 0.3), -0.3 * (x @ x.T + 1) @ g, rtol=1e-13, atol=1e-14)


# --- the checks can fail ------------------------------------------------------------------------


def planted(name: str, **changes):
    return dataclasses.replace(registry()[name], **changes)


def test_kernel_without_the_bias_term_fails():
    wrong = affine.Member("affine", "z = W x + b (K without +1)", sp.Integer(1), sp.Integer(1), sp.Integer(0), affine.S)
    derivation = planted("affine", predict=lambda case, g, lr: affine.predict_update(wrong, case.inputs[0], g, lr))
    result = check_update(derivation, {"batch": 8, "in_features": 6, "out_features": 3}, seed=0)
    assert not result.passed
    assert result.max_rel_err > 1e5 * result.tol  # misses by orders of magnitude, not rounding


def test_wrong_diagonal_factor_fails():
    def doubled(case):
        return torch.full((case.inputs[0].shape[0],), 2.0, dtype=torch.float64)

    derivation = planted("affine_like", diagonal=doubled)
    result = check_diagonal(derivation, {"batch": 4, "in_features": 5, "out_features": 2}, seed=0)
    assert not result.passed
    assert result.max_rel_err > 0.4


def test_claiming_linearity_for_a_nonlinear_layer_fails():
    class Tanh(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3, dtype=torch.float64)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    def build(sizes, generator):
        return affine.Case(Tanh(), (affine.sample_inputs(sizes["batch"], 4, generator),))

    derivation = planted("affine", build=build)
    result = check_linearity(derivation, {"batch": 3}, seed=0)
    assert not result.passed
    assert result.max_rel_err > 1e-3

"""Residual blocks: proofs hold, first order matches autograd, the Taylor remainder is O(η²), the
affine block's η² term is exact, and what the affine-like correction leaves inside the block."""

import dataclasses
import math

import pytest
import sympy as sp
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from affdiv.theory import ProofKind, registry, residual
from affdiv.theory.exact import ETA
from affdiv.verify.checks import SLOPE_TOL, TOL, check_taylor, check_update, rel_err
from affdiv.verify.engine import effective_update
from affdiv.verify.metrics import cosine, diagonal_update

NAMES = tuple(d.name for d in residual.DERIVATIONS)


def _case(name, sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    case = registry()[name].build(sizes, generator)
    with torch.no_grad():
        g = torch.randn(case.module(*case.inputs).shape, dtype=torch.float64, generator=generator)
    return case, g


def test_registered_and_proven_at_general_size():
    """Every block has a general-size theorem; the exact first order at concrete sizes corroborates."""
    for name in NAMES:
        d = registry()[name]
        assert d.proven, [p for p in d.proof_steps() if not p.holds]
        assert d.proof_kind is ProofKind.SYMBOLIC_GENERAL
        exact = [p for p in d.proof_steps() if p.kind is ProofKind.EXACT_CONCRETE]
        assert len(exact) == 1 and exact[0].corroborates and exact[0].holds


def _block_closed_form(block, *, transpose_m_j=True, d_j=True, both_rho=True, plus_one=True):
    """The closed form of BlockCalculus with one planted change at a time."""
    g, i, j = block.grad, block.sample("i"), block.sample("j")
    x_i, x_j = block.x("i"), block.x("j")
    if block.branch == "two_layer":
        w_2 = block.params["W_2"]
        outer = w_2 * i["D"] * (j["D"] if d_j else sp.Identity(block.sizes[2])) * w_2.T * g
        branch = g * (j["h"].T * i["h"]) + g + outer * (x_j.T * x_i) + outer
    else:
        branch = i["rho"] * (j["rho"] if both_rho else 1) * (g * (x_j.T * x_i) + g)
    m_j = block.jacobian("j")
    upstream = block.jacobian("i") * (m_j.T if transpose_m_j else m_j) * g
    k_h = upstream * (j["u"].T * i["u"]) + (upstream if plus_one else sp.ZeroMatrix(*upstream.shape))
    return -ETA * (branch + i["alpha"] * j["alpha"] * k_h)


@pytest.mark.parametrize("branch", ["two_layer", "affine_like"])
def test_planted_wrong_general_first_order_fails(branch):
    """The helper rebuilds the closed form (it holds), and each planted change fails: M_j for M_jᵀ, the
    upstream kernel without +1, and D_j dropped (two-layer) or ρ_i ρ_j taken as ρ_i (affine-like)."""
    assert residual.first_order_theorem(branch, _block_closed_form).holds
    wrongs = [dict(transpose_m_j=False), dict(plus_one=False)]
    wrongs.append(dict(d_j=False) if branch == "two_layer" else dict(both_rho=False))
    for change in wrongs:
        planted = residual.first_order_theorem(branch, lambda block, change=change: _block_closed_form(block, **change))
        assert not planted.holds, change


def test_normaliser_derivative_is_proven():
    step = residual.normaliser_derivative()
    assert step.holds and step.kind is ProofKind.SYMBOLIC_GENERAL


sizes = st.fixed_dictionaries(
    {"batch": st.integers(1, 6), "in_features": st.integers(1, 6), "width": st.integers(1, 5),
     "hidden": st.integers(1, 6)}
)


@settings(max_examples=15)
@given(name=st.sampled_from(NAMES), sizes=sizes, seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0))
def test_first_order_matches_autograd_and_ntk(name, sizes, seed, lr):
    result = check_update(registry()[name], sizes, seed, lr=lr)
    assert result.passed, result


@settings(max_examples=6)
@given(name=st.sampled_from(NAMES[1:]), sizes=sizes, seed=st.integers(0, 2**16))
# (a remainder whose η³ term outweighs its η² term at the largest η: 2.10 over all of them)
@example(name="residual_tanh", sizes={"batch": 6, "in_features": 1, "width": 5, "hidden": 5}, seed=221)
def test_taylor_remainder_is_second_order(name, sizes, seed):
    d = registry()[name]
    result = check_taylor(d, sizes, seed, lrs=d.taylor_lrs)
    assert abs(result.errors["slope_first_order"] - 2) <= SLOPE_TOL, result


@given(sizes=sizes, seed=st.integers(0, 2**16), lr=st.floats(1e-3, 3.0))
def test_affine_block_second_order_term_makes_the_step_exact(sizes, seed, lr):
    """Affine branch on an affine upstream: first order + ΔW Δx_i is the real step at any η."""
    case, g = _case("residual_affine", sizes, seed)
    measured = effective_update(case.module, case.inputs, g, lr=lr)
    predicted = residual.predict_residual_second_order(case, g, lr)
    # rounding of the real step's difference z(θ+Δθ) − z(θ): 16 u ‖z‖/‖Δz‖ on top of TOL (checks.py)
    bound = TOL + 16 * 2**-53 * float(measured.output.abs().max() / measured.finite.abs().max())
    assert rel_err(predicted, measured.finite) <= bound
    # ... and without the η² term it is not exact at a large step
    if lr > 0.5:
        assert rel_err(residual.predict_residual(case, g, lr), measured.finite) > 1e-6


@pytest.mark.parametrize("sizes", registry()["residual_affine"].sizes)
def test_affine_block_taylor_check_needs_the_exact_second_order(sizes):
    """With the exact η² term the remainder is at rounding at every η (pass); with half of it the
    remainder is an η² term again and the check fails."""
    d = registry()["residual_affine"]
    result = check_taylor(d, sizes, 0, lrs=d.taylor_lrs)
    assert result.passed and "slope_second_order" not in result.errors, result
    assert result.errors["second_order_remainder_over_floor"] <= 1

    def half(case, g, lr):
        return (residual.predict_residual(case, g, lr) + residual.predict_residual_second_order(case, g, lr)) / 2

    wrong = check_taylor(dataclasses.replace(d, predict_second_order=half), sizes, 0, lrs=d.taylor_lrs)
    assert not wrong.passed and abs(wrong.errors["slope_second_order"] - 2) <= SLOPE_TOL
    # a second order that is not finite leaves no point above the floor: it fails, not "exact"
    nan = check_taylor(dataclasses.replace(d, predict_second_order=lambda case, g, lr: half(case, g, lr) * math.nan),
                       sizes, 0, lrs=d.taylor_lrs)
    assert not nan.passed and nan.errors == {"nonfinite_remainders": len(d.taylor_lrs)}


@settings(max_examples=10)
@given(name=st.sampled_from(NAMES), sizes=sizes, seed=st.integers(0, 2**16))
def test_own_sample_block_matches_single_sample_steps(name, sizes, seed):
    """Each sample's update from its own gradient alone is −η K_ii g_i with the derived matrix K_ii."""
    case, g = _case(name, sizes, seed)
    lr = 0.1
    measured = diagonal_update(case.module, case.inputs, g, lr)
    predicted = -lr * torch.einsum("bnm,bm->bn", residual.diagonal_blocks(case), g)
    assert rel_err(predicted, measured) <= TOL


def test_correction_makes_the_scalars_one_but_leaves_the_matrix():
    """Affine-like H and F: K_ii − M_i M_iᵀ = I exactly (the scalar factors are 1), yet K_ii is not
    a multiple of I, so one sample's update is not along −g_i (cosine < 1)."""
    sizes = {"batch": 6, "in_features": 4, "width": 5}
    case, g = _case("residual_affine_like_on_affine_like", sizes, 0)
    blocks = residual.diagonal_blocks(case)
    _, _, m, _ = residual._pieces(case.module, case.inputs[0])
    eye = torch.eye(5, dtype=torch.float64).expand_as(blocks)
    torch.testing.assert_close(blocks - m @ m.transpose(1, 2), eye, rtol=0, atol=1e-13)
    assert float(residual.matrix_share(blocks).min()) > 0.05
    single = diagonal_update(case.module, case.inputs, g, 0.1)
    assert float(cosine(single, -0.1 * g).max()) < 0.999
    # the uncorrected block carries the scalars: K_ii − (‖u_i‖²+1) M Mᵀ = (‖x_i‖²+1) I
    plain, g = _case("residual_affine", sizes, 0)
    x, k_h, m, _ = residual._pieces(plain.module, plain.inputs[0])
    rest = residual.diagonal_blocks(plain) - torch.diagonal(k_h)[:, None, None] * m @ m.transpose(1, 2)
    torch.testing.assert_close(rest, ((x * x).sum(-1) + 1)[:, None, None] * eye, rtol=1e-12, atol=0)


def _drop_skip_matrix(case, g, lr):
    """Planted: the upstream kernel taken as a scalar (M = I), as if the skip path did not exist."""
    x, k_h, _, two_layer = residual._pieces(case.module, case.inputs[0])
    return -lr * (residual.branch_update(case.module, x, two_layer, g) + k_h @ g)


def _drop_inner_layer(case, g, lr):
    """Planted: the two-layer branch without its W₁ path (only (h·h+1) I)."""
    x, k_h, m, (h, _) = residual._pieces(case.module, case.inputs[0])
    upstream = torch.einsum("ink,ik->in", m, k_h @ torch.einsum("jnk,jn->jk", m, g))
    return -lr * ((h @ h.T + 1) @ g + upstream)


@pytest.mark.parametrize(
    "name, wrong",
    [("residual_affine", _drop_skip_matrix), ("residual_tanh", _drop_skip_matrix),
     ("residual_gelu", _drop_inner_layer)],
)
def test_planted_wrong_formula_fails(name, wrong):
    d = registry()[name]
    result = check_update(dataclasses.replace(d, predict=wrong), d.sizes[1], seed=0)
    assert not result.passed
    assert result.errors["linear"] > 1e-2


def test_activation_derivative_is_derived_not_typed():
    """φ' comes from sympy's derivative of φ; it matches autograd on a grid."""
    a = torch.linspace(-4, 4, 101, dtype=torch.float64, requires_grad=True)
    for name in residual.ACTIVATIONS:
        phi, dphi = residual.activation(name)
        (auto,) = torch.autograd.grad(phi(a).sum(), a)
        torch.testing.assert_close(dphi(a.detach()), auto, rtol=1e-13, atol=1e-15)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="branch must be in"):
        residual.ReferenceResidualBlock(2, 2, "relu6")
    with pytest.raises(ValueError, match="hidden ≥ 1"):
        residual.ReferenceResidualBlock(2, 2, "tanh")
    with pytest.raises(ValueError, match="activation must be one of"):
        residual.activation("swish")
    with pytest.raises(ValueError, match="missing"):
        residual.build_case({"batch": 2}, torch.Generator(), "affine", "affine")
    case, g = _case("residual_tanh", {"batch": 2, "in_features": 2, "width": 2, "hidden": 2}, 0)
    with pytest.raises(ValueError, match="affine/affine block"):
        residual.predict_residual_second_order(case, g, 0.1)

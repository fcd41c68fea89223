"""Attention: proofs hold, each path's first-order update matches autograd, the η² term equals the
one measured by nested forward-mode AD, the Taylor remainder falls as η² (η³ with the η² term),
and planted wrong formulas fail."""

import dataclasses

import pytest
import sympy as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, jvp, vjp

from affdiv.theory import ProofKind, attention, registry
from affdiv.theory.exact import ETA
from affdiv.verify.checks import SLOPE_TOL, TOL, check_taylor, check_update, rel_err
from affdiv.verify.engine import effective_update

D = attention.DERIVATION

shapes = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 3),
        "tokens": st.integers(1, 5),
        "d_model": st.integers(1, 4),
        "heads": st.integers(1, 3),
        "d_head": st.integers(1, 3),
        "d_out": st.sampled_from([0, 1, 3]),
        "causal": st.sampled_from([0, 1]),
    }
)


def _case(sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    case = D.build(sizes, generator)
    with torch.no_grad():
        g = torch.randn(case.module(*case.inputs).shape, dtype=torch.float64, generator=generator)
    return case, g


def test_registered_and_each_step_holds_with_its_kind():
    """Five general-size steps (V path, scores, row softmax, the two assemblies) make it proven; the
    exact first order at concrete sizes and the nested-AD η² check stay as corroboration."""
    assert registry()["attention"] is D
    steps = D.proof_steps()
    assert all(p.holds for p in steps), [p for p in steps if not p.holds]
    essential = [p.kind for p in steps if not p.corroborates]
    assert essential == [ProofKind.SYMBOLIC_GENERAL] * 5
    assert [p.kind for p in steps if p.corroborates] == [ProofKind.EXACT_CONCRETE, ProofKind.NUMERIC_ONLY]
    assert D.proof_kind is ProofKind.SYMBOLIC_GENERAL


def _jvp_without_mean(row, k, direction):
    """Planted: J(U) = A ⊙ U (the − ū dropped)."""
    return row.a(k) * direction(k)


def _curvature_without_variance(row, k, direction):
    """Planted: C(U) = A ⊙ (U − ū)² (the − Σ A (U − ū)² dropped)."""
    mean = row.row_sum(lambda j: row.a(j) * direction(j))
    return row.a(k) * (direction(k) - mean) ** 2


def _curvature_not_squared(row, k, direction):
    """Planted: (U − ū) for (U − ū)² in C."""
    mean = row.row_sum(lambda j: row.a(j) * direction(j))
    return row.a(k) * ((direction(k) - mean) - row.row_sum(lambda j: row.a(j) * (direction(j) - mean)))


def test_planted_wrong_softmax_derivatives_fail():
    assert attention.softmax_row_theorem().holds
    assert not attention.softmax_row_theorem(jvp=_jvp_without_mean).holds
    assert not attention.softmax_row_theorem(curvature=_curvature_without_variance).holds
    assert not attention.softmax_row_theorem(curvature=_curvature_not_squared).holds


def _first_order_variant(calc, *, power=2, transpose_d=False, o_path=True):
    """AttentionCalculus.first_order rebuilt with one planted change."""
    x, g, c = calc.x, calc.grad, calc.scale
    scores, rest = [], []
    for h in calc.heads:
        p = calc.head(h)
        q, k, ax = x * p["Q"], x * p["K"], p["A"] * x
        d = p["D"].T if transpose_d else p["D"]
        scores.append(-ETA * c**power * (x * x.T * d * k * k.T + q * q.T * d * x * x.T))
        y = ax * p["V"]
        rest += [-ETA * ax * ax.T * g * p["O"].T * p["O"]] + ([-ETA * y * y.T * g] if o_path else [])
    return scores, sp.Add(*rest)


def test_planted_wrong_first_order_assembly_fails():
    """The rebuilt closed form holds; c for c², Dᵀ for D, and the O path dropped each fail."""
    assert attention.first_order_assembly(_first_order_variant).holds
    for change in (dict(power=1), dict(transpose_d=True), dict(o_path=False)):
        planted = attention.first_order_assembly(lambda calc, change=change: _first_order_variant(calc, **change))
        assert not planted.holds, change


def _second_order_variant(calc, step, *, score_value=True, y1_value=True):
    x, terms = calc.x, []
    for h in calc.heads:
        p = calc.head(h)
        dv, do = step[f"W_V{h}"], step[f"W_O{h}"]
        y1 = p["A1"] * x * p["V"] + (p["A"] * x * dv if y1_value else sp.ZeroMatrix(*p["A"].shape) * x * dv)
        terms += [p["A2"] * x * p["V"] * p["O"], y1 * do]
        if score_value:
            terms.append(p["A1"] * x * dv * p["O"])
    return sp.Add(*terms)


def test_planted_wrong_second_order_assembly_fails():
    """Without J(S1) X ΔW_V W_O, or with Y1 missing A X ΔW_V, the η² coefficient is not Z2."""
    assert attention.second_order_assembly(_second_order_variant).holds
    for change in (dict(score_value=False), dict(y1_value=False)):
        planted = attention.second_order_assembly(lambda calc, step, change=change: _second_order_variant(
            calc, step, **change))
        assert not planted.holds, change


@settings(max_examples=15)
@given(sizes=shapes, seed=st.integers(0, 2**16), lr=st.floats(1e-4, 1.0))
def test_first_order_matches_autograd_and_ntk(sizes, seed, lr):
    result = check_update(D, sizes, seed, lr=lr)
    assert result.passed, result


@settings(max_examples=10)
@given(sizes=shapes, seed=st.integers(0, 2**16), path=st.sampled_from(attention.PATHS))
def test_each_path_alone_matches_autograd(sizes, seed, path):
    """Only one weight trainable: its path's closed form is the whole first-order update."""
    case, g = _case(sizes, seed)
    if path == "o" and case.module.w_o is None:
        return
    for name, p in case.module.named_parameters():
        p.requires_grad_(name == f"w_{path}")
    measured = effective_update(case.module, case.inputs, g, lr=0.1)
    predicted = attention.predict_attention(case, g, 0.1, paths={path})
    assert rel_err(predicted, measured.linear) <= TOL


@settings(max_examples=10)
@given(sizes=shapes, seed=st.integers(0, 2**16))
def test_value_path_is_the_token_gram_kernel(sizes, seed):
    """W_V alone: ΔZ = −η Σ_h K_h G_Y,h W_O,h with K_h = (A X)(A X)ᵀ over all tokens of the batch."""
    case, g = _case(sizes, seed)
    for name, p in case.module.named_parameters():
        p.requires_grad_(name == "w_v")
    lr = 0.1
    measured = effective_update(case.module, case.inputs, g, lr=lr)
    p = attention.parts(case.module, case.inputs[0])
    rows = g.reshape(p.x.shape[0], -1)
    g_y = p.split(rows @ p.w_o.T if p.w_o is not None else rows)
    predicted = p.project(-lr * attention.value_kernel(case) @ g_y).reshape(g.shape)
    assert rel_err(predicted, measured.linear) <= TOL
    assert rel_err(predicted, measured.finite) <= TOL + 16 * 2**-53 * float(
        measured.output.abs().max() / measured.finite.abs().max()
    )  # the V path alone is linear in W_V: the real step equals it


@settings(max_examples=10)
@given(sizes=shapes, seed=st.integers(0, 2**16))
def test_second_order_term_is_the_measured_eta_squared_coefficient(sizes, seed):
    """Z2 = ½ d²/dt² Z(θ + tΔθ)|₀, measured by forward-over-forward AD (independent of the closed form)."""
    case, g = _case(sizes, seed)
    lr = 0.1
    params = {name: p.detach() for name, p in case.module.named_parameters()}

    def f(p):
        return functional_call(case.module, p, case.inputs)

    _, pullback = vjp(f, params)
    (grad,) = pullback(g)
    step = {k: -lr * v for k, v in grad.items()}
    _, curvature = jvp(lambda p: jvp(f, (p,), (step,))[1], (params,), (step,))
    predicted = sum(attention.second_order_terms(case, g, lr).values())
    # both sum O(10³) products of O(1) terms in different orders; 1e-10 relative as in checks.TOL
    assert rel_err(predicted, 0.5 * curvature) <= TOL or float(curvature.abs().max()) < 1e-300


@pytest.mark.parametrize("sizes", D.sizes)
def test_taylor_slopes_two_then_three(sizes):
    """First-order remainder ∝ η² over η from 10⁻¹ to 10⁻⁴ and, with the η² term, ∝ η³ (fitted by
    check_taylor where that remainder is above float64 rounding of the real step; here that leaves
    at least one decade for every instance)."""
    for seed in range(3):
        result = check_taylor(D, sizes, seed)
        assert abs(result.errors["slope_first_order"] - 2) <= SLOPE_TOL, result
        assert abs(result.errors["slope_second_order"] - 3) <= SLOPE_TOL, result


def test_second_order_term_removes_almost_all_of_the_remainder_at_small_steps():
    """At η = 10⁻³ what first order misses is removed to ≥ 99% by Z2 (the rest is O(η³))."""
    for sizes in D.sizes:
        case, g = _case(sizes, 0)
        lr = 1e-3
        finite = effective_update(case.module, case.inputs, g, lr=lr).finite
        first = (finite - attention.predict_attention(case, g, lr)).abs().max()
        second = (finite - attention.predict_attention_second_order(case, g, lr)).abs().max()
        assert second < 0.01 * first


def test_qk_bilinear_term_alone_is_not_the_second_order():
    """The Q·K product is one of the η² sources; alone it leaves an η² remainder (slope 2)."""
    planted = dataclasses.replace(
        D,
        predict_second_order=lambda case, g, lr: attention.predict_attention(case, g, lr)
        + attention.second_order_terms(case, g, lr)["qk_bilinear"],
    )
    result = check_taylor(planted, D.sizes[1], seed=0)
    assert abs(result.errors["slope_second_order"] - 2) <= SLOPE_TOL
    assert not result.passed  # the check fails on the second-order slope


@pytest.mark.parametrize(
    "paths, what",
    [(("k", "v", "o"), "the Q path dropped"), (("q", "k", "o"), "the V path dropped"),
     (("q", "v", "o"), "the K path dropped")],
)
def test_planted_wrong_formula_fails(paths, what):
    planted = dataclasses.replace(D, predict=lambda case, g, lr: attention.predict_attention(case, g, lr, paths))
    result = check_update(planted, D.sizes[1], seed=0)
    assert not result.passed, what
    assert result.errors["linear"] > 1e-3, what


def test_planted_wrong_second_order_fails():
    """Without the softmax curvature the remainder after 'second order' still falls only as η²."""
    def incomplete(case, g, lr):
        terms = attention.second_order_terms(case, g, lr)
        return attention.predict_attention(case, g, lr) + sum(v for k, v in terms.items() if k != "softmax_curvature")

    result = check_taylor(dataclasses.replace(D, predict_second_order=incomplete), D.sizes[0], seed=1)
    assert abs(result.errors["slope_second_order"] - 3) > SLOPE_TOL
    assert not result.passed


def test_second_order_proof_step_compares_with_nested_ad_and_can_fail(monkeypatch):
    """The numeric proof step of Z2 holds, and fails when a term of Z2 is dropped."""
    step = attention.second_order_step()
    assert step.holds and step.kind is ProofKind.NUMERIC_ONLY and "rel. error" in step.detail
    full = attention.second_order_terms

    def without_output_term(case, g, lr):
        return {k: v for k, v in full(case, g, lr).items() if k != "output"}

    monkeypatch.setattr(attention, "second_order_terms", without_output_term)
    assert not attention.second_order_step.__wrapped__(0).holds


def test_causal_first_token_sees_only_itself():
    """Under the mask token 0 attends to itself only: its Q and K paths give no update (A row = e₀,
    J(U) row = 0), so its first-order change comes from V and O alone."""
    sizes = {"batch": 2, "tokens": 4, "d_model": 3, "heads": 2, "d_head": 2, "d_out": 3, "causal": 1}
    case, g = _case(sizes, 0)
    terms = attention.first_order(case, g, 0.1).paths
    assert float(terms["q"][:, 0].abs().max()) == 0.0 and float(terms["k"][:, 0].abs().max()) == 0.0
    assert float(terms["v"][:, 0].abs().max()) > 0


def test_bad_input_is_named():
    module = attention.ReferenceAttention(3, 1, 2)
    with pytest.raises(ValueError, match=r"expected input \(B, T, 3\)"):
        module(torch.zeros(2, 4, dtype=torch.float64))
    case, g = _case(D.sizes[0], 0)
    with pytest.raises(ValueError, match="paths must be among"):
        attention.predict_attention(case, g, 0.1, paths={"x"})
    with pytest.raises(ValueError, match="missing"):
        attention.build_case({"batch": 1}, torch.Generator())

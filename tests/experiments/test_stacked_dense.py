"""The stacked engine's AffineLike and NormLike Functions (``affdiv.experiments.runs.stacked_dense``)
against autograd of the same formulas in torch operations (the ``*_composite`` functions, which
the engine ran before).

Both sides evaluate one formula in float64 with sums of at most L + N + 2 ≤ 64 terms per output,
in other orders: each is within γ_64·Σ|terms| ≈ 7e-15·Σ|terms| of the exact value. The draws are
O(1) and the scaled rows s·x have norm below √L (r‖x‖ < 1, q‖x‖ ≤ c ≤ √L), so at these sizes Σ|terms|
is taken to be at most 10² times the result's largest entry (or, for ∂x, whose parts cancel, the
largest |u|): the two differ by at most 2 · 7e-15 · 100 ≈ 1.4e-12 of it, the tolerance RTOL below.
A dropped term (the bias's part of the radial correction, the unscaled NormLike bias gradient, the
bias itself) moves entries by O(1) of that scale.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import stacked_dense
from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.layers import _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused passes are not built here")]

RTOL = 1.4e-12
EPS = 1e-12


def _layers(kind: str):
    """(the engine's function, its composite) for AffineLike or NormLike (l2, rms: c = √L)."""
    if kind == "affine_like":
        return stacked_dense.affine_like, stacked_dense.affine_like_composite

    def c(x):
        return 1.0 if kind == "norm_l2" else x.shape[2] ** 0.5
    return (lambda x, w, b: stacked_dense.norm_like(x, w, b, c(x), EPS),
            lambda x, w, b: stacked_dense.norm_like_composite(x, w, b, c(x), EPS))


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values contiguous, as a transposed view (the MLP's activations), or strided."""
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        return torch.stack([t, torch.zeros_like(t)], dim=3)[..., 0]
    return t


def _inputs(k, m, length, n, bias, layout, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = _laid_out(torch.randn(k, m, length, generator=g, dtype=dtype), layout).requires_grad_()
    w = torch.randn(k, n, length, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(k, n, generator=g, dtype=dtype).requires_grad_() if bias else None
    return x, w, b, torch.randn(k, m, n, generator=g, dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, scale: float = 0.0) -> None:
    """|got − want| ≤ rtol · (the largest |want|, or ``scale`` where larger)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.detach(), want.detach()
    assert (got - want).abs().max() <= rtol * max(float(want.abs().max()), scale, 1e-300), (got, want)


def _u_scale(kind: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> float:
    """The largest |u| = |(s·g) W|, the part of ∂x before its radial correction, which is at
    most |u| (+ r|gy||b| for AffineLike's bias): the scale of ∂x's terms where they cancel (NormLike's
    ∂x is 0 at L = 1)."""
    x = x.detach()
    s = 1 / (x.square().sum(2, keepdim=True) + 1).sqrt() if kind == "affine_like" else \
        (1.0 if kind == "norm_l2" else x.shape[2] ** 0.5) / torch.linalg.vector_norm(x, dim=2, keepdim=True)
    return float(torch.bmm(g * s, w.detach()).abs().max())


def _value_and_grads(layer, x, w, b, g):
    inputs = [t for t in (x, w, b) if t is not None]
    z = layer(x, w, b)
    return z, z.grad_fn, torch.autograd.grad(z, inputs, g)


@given(kind=st.sampled_from(["affine_like", "norm_l2", "norm_rms"]), k=st.integers(1, 3), m=st.integers(1, 12),
       length=st.integers(1, 30), n=st.integers(1, 30), bias=st.booleans(),
       layout=st.sampled_from(["contiguous", "transposed", "strided"]), seed=st.integers(0, 2**16))
def test_the_functions_equal_autograd_of_the_formulas(kind, k, m, length, n, bias, layout, seed):
    layer, composite = _layers(kind)
    x, w, b, g = _inputs(k, m, length, n, bias, layout, seed)
    with unittest.mock.patch.object(_fused, "minus_radial_", wraps=_fused.minus_radial_) as radial:
        z, node, grads = _value_and_grads(layer, x, w, b, g)
    assert radial.call_count == 1  # the backward ran the passes, not the torch operations
    want_z, _, want_grads = _value_and_grads(composite, x, w, b, g)
    assert type(node).__name__ == ("StackedAffineLikeBackward" if kind == "affine_like" else "StackedNormLikeBackward")
    _close(z, want_z)
    _close(grads[0], want_grads[0], scale=_u_scale(kind, x, w, g))
    for got, want in zip(grads[1:], want_grads[1:]):
        _close(got, want)


@pytest.mark.usefixtures("small_products_on_onednn")  # (these small products too)
@pytest.mark.parametrize("kind", ["affine_like", "norm_l2", "norm_rms"])
def test_float32_is_the_float64_formula_within_float32_rounding(kind):
    # float32 (products on oneDNN where bound): L + N + 2 = 66 terms at u = 6e-8 and the same
    # conditioning of at most 10²: 2 · 66 · 6e-8 · 100 ≈ 8e-4 of the largest entry
    layer, composite = _layers(kind)
    x, w, b, g = _inputs(4, 16, 32, 32, True, "contiguous", 7, torch.float32)
    z, _, grads = _value_and_grads(layer, x, w, b, g)
    exact = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want_z, _, want_grads = _value_and_grads(composite, *exact, g.double())
    _close(z.double(), want_z, 8e-4)
    for got, want in zip(grads, want_grads):
        _close(got.double(), want, 8e-4)


@pytest.mark.parametrize("kind", ["affine_like", "norm_rms"])
def test_a_wrong_radial_correction_fails_the_tolerance(kind, monkeypatch):
    # mutation checks: the radial pass without the bias's part (AffineLike) or with the scale's
    # c left out of a = (q/c)² (NormLike, rms: c = √L) moves ∂x out of RTOL
    x, w, b, g = _inputs(2, 5, 6, 4, True, "contiguous", 3)
    layer, composite = _layers(kind)
    real = _fused.minus_radial_
    if kind == "affine_like":
        monkeypatch.setattr(_fused, "minus_radial_", lambda u, x, s, m=1.0, limit=float("inf"), c=None:
                            real(u, x, s, m, limit, None))
    else:
        monkeypatch.setattr(_fused, "minus_radial_", lambda u, x, s, m=1.0, limit=float("inf"), c=None:
                            real(u, x, s, 1.0, limit, c))
    _, _, (dx, *_) = _value_and_grads(layer, x, w, b, g)
    _, _, (want, *_) = _value_and_grads(composite, x, w, b, g)
    with pytest.raises(AssertionError):
        _close(dx, want)


@pytest.mark.parametrize("kind", ["affine_like", "norm_l2"])
def test_second_derivatives_and_tangents_go_through_the_formulas(kind, function_checks):
    layer, composite = _layers(kind)
    x, w, b, g = _inputs(2, 3, 4, 5, True, "contiguous", 1)
    function_checks.second_order_paths(layer, composite, (x, w, b), g, _close)


def test_calls_a_pass_cannot_serve_take_the_torch_operations():
    x, w, b, _ = _inputs(2, 3, 4, 5, True, "contiguous", 2)
    layer = stacked_dense.affine_like
    with unittest.mock.patch.object(stacked_dense.StackedAffineLike, "apply",
                                    wraps=stacked_dense.StackedAffineLike.apply) as spy:
        layer(x, w, b)
        assert spy.call_count == 1
        with _fused.disabled():
            layer(x, w, b)
        torch.func.vmap(layer)(x[None], w[None], b[None])
        with FlopCounterMode(display=False) as counter:  # a dispatch mode sees torch's ops
            layer(x, w, b)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones_like(x))
            tangent = torch.autograd.forward_ad.unpack_dual(layer(dual, w, b)).tangent
        layer(x.half(), w.half(), b.half())
        assert spy.call_count == 1
    assert counter.get_total_flops() == 2 * 2 * 3 * 4 * 5
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones_like(x))
        want = torch.autograd.forward_ad.unpack_dual(stacked_dense.affine_like_composite(dual, w, b)).tangent
    assert torch.equal(tangent, want)


def test_autocast_empty_features_and_a_strided_weight_are_routed_as_they_must_be():
    # CPU autocast: the torch operations, whose products autocast casts (the passes would read
    # bfloat16 products as float32); no feature: the torch operations; a weight stored transposed:
    # the passes, in the backward too (the products take any strides)
    x, w, b, g = _inputs(2, 3, 4, 5, True, "contiguous", 6, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z, want = stacked_dense.affine_like(x, w, b), stacked_dense.affine_like_composite(x, w, b)
    assert type(z.grad_fn).__name__ == "DivBackward0" and torch.equal(z, want)
    for empty_x, empty_w in ((x[..., :0], w[..., :0]), (x, w[:, :0])):
        z = stacked_dense.affine_like(empty_x, empty_w, b[:, : empty_w.shape[1]])
        assert z.shape == (2, 3, empty_w.shape[1]) and type(z.grad_fn).__name__ != "StackedAffineLikeBackward"
    w_t = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    with unittest.mock.patch.object(_fused, "minus_radial_", wraps=_fused.minus_radial_) as radial:
        _, _, grads = _value_and_grads(stacked_dense.affine_like, x, w_t, b, g)
    assert radial.call_count == 1
    _, _, want = _value_and_grads(stacked_dense.affine_like_composite, x, w_t, b, g)
    for got, wanted in zip(grads, want):
        _close(got, wanted, 8e-4)


@pytest.mark.parametrize("kind", ["norm_l2", "norm_rms"])
def test_a_row_below_eps_has_the_constant_scales_gradient(kind):
    # NormLike's q = c/eps is constant where ‖x‖ ≤ eps: ∂x = u there, no radial part (a row of norm
    # 2e-14 < eps here, whose radial part, were it taken, would move ∂x by 2e-4 of itself)
    layer, composite = _layers(kind)
    x, w, b, g = _inputs(2, 3, 4, 5, True, "contiguous", 5)
    with torch.no_grad():
        x[0, 1] = 1e-14
    _, _, (dx, *_) = _value_and_grads(layer, x, w, b, g)
    _, _, (want, *_) = _value_and_grads(composite, x, w, b, g)
    assert float(want[0, 1].abs().max()) > 1e10  # (c/eps)·g W: the constant branch's gradient
    _close(dx, want)


@pytest.mark.parametrize("kind, row, eps", [("affine_like", 1e25, EPS), ("norm_l2", 1e25, EPS),
                                            ("norm_l2", 1e-20, 1e-30)])
def test_rows_whose_norms_overflow_or_underflow_take_the_composite(kind, row, eps):
    # float32: ‖x‖² overflows for a row of 1e25; a row of 1e-20 has a norm below what the pass trusts
    # (small_norm, 2.8e-17) and above eps = 1e-30, where its ‖x‖² has underflowed. The Function then
    # gives the composite's numbers and gradients.
    if kind == "affine_like":
        layer, composite = stacked_dense.affine_like, stacked_dense.affine_like_composite
    else:
        def layer(x, w, b):
            return stacked_dense.norm_like(x, w, b, 1.0, eps)

        def composite(x, w, b):
            return stacked_dense.norm_like_composite(x, w, b, 1.0, eps)
    x, w, b, g = _inputs(2, 3, 4, 5, True, "contiguous", 4, torch.float32)
    with torch.no_grad():
        x[1, 2] = row
    z, node, grads = _value_and_grads(layer, x, w, b, g)
    want_z, _, want_grads = _value_and_grads(composite, x, w, b, g)
    assert type(node).__name__.startswith("Stacked")
    assert torch.equal(z.isnan(), want_z.isnan()) and torch.equal(z.nan_to_num(), want_z.nan_to_num())
    for got, want in zip(grads, want_grads):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("method", ["affine_like", "norm_l2", "vit-affine_like"])
def test_the_stacked_engine_takes_the_functions(digits, method):
    config = RunConfig(dataset="digits", method=method, depth=1 if method.startswith("vit") else 2, width=16,
                       batch_size=8, seed=0, dtype="float64")
    models = [build_member(config, digits, seed) for seed in (0, 1)]
    split = (torch.as_tensor(digits.train.x).double(), torch.as_tensor(digits.train.y))
    engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
    function = stacked_dense.StackedAffineLike if "affine_like" in method else stacked_dense.StackedNormLike
    with unittest.mock.patch.object(function, "apply", wraps=function.apply) as spy:
        engine.step(torch.arange(16).reshape(2, 8))
    # the vit's q, k, v, o and two MLP projections; the MLP's two hidden layers (its read-out is nn.Linear)
    assert spy.call_count == (6 if method.startswith("vit") else 2)

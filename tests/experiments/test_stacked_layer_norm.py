"""The stacked engine's LayerNorm (``affdiv.experiments.runs.stacked_layer_norm``) against autograd
of nn.LayerNorm's formula in torch operations (``layer_norm_composite``, which the engine ran
before).

Tolerance. Both sides evaluate the same formula in float64 in other orders. A row's mean and
variance sum d terms; x − mean then carries an error of at most γ_{2d}·(|x| + |mean|), which x̂
scales by rstd: relative to x̂'s entries that is γ_{2d}·(1 + |mean|·rstd). The backward's row sums
have d terms and ∂γ, ∂β sum M rows (in blocks on one side, pairwise on the other): γ_M of their
terms. So each output differs from the other side's by at most RTOL·S, RTOL = 8·γ_{2d+M}·(1 +
|mean|·rstd) (the two sides' bounds, with a margin of 4), with S the magnitude of its terms:
|γ|·|x̂| + |β| for y, rstd·|gy|·|γ|·(2 + |x̂|²) for ∂x, M·|gy|·|x̂| for ∂γ and M·|gy| for ∂β (|·| the largest
entry). A dropped or exchanged term (⟨g⟩, x̂·⟨g x̂⟩, ∂γ for ∂β) moves entries by O(1) of S.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import stacked_layer_norm
from affdiv.layers import _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused passes are not built here")]

U = 2.0 ** -53
EPS = 1e-5


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _inputs(k, rows, d, offset, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(k, rows, d, generator=g, dtype=dtype) + offset).requires_grad_()
    w, b = (torch.randn(k, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    return x, w, b, torch.randn(k, rows, d, generator=g, dtype=dtype)


def _bounds(x, w, b, gy) -> dict[str, float]:
    """Per output, the largest difference the module docstring allows between two float64
    evaluations."""
    x, w, b = x.detach(), w.detach(), b.detach()
    k, rows, d = x.shape
    mean = x.mean(2)
    rstd = (x.var(2, unbiased=False) + EPS).rsqrt()
    x_hat = float(((x - mean.unsqueeze(2)) * rstd.unsqueeze(2)).abs().max())
    rtol = 8 * _gamma(2 * d + rows) * (1 + float((mean.abs() * rstd).max()))
    g, w_max = float(gy.abs().max()), float(w.abs().max())
    return {"y": rtol * (w_max * x_hat + float(b.abs().max())),
            "x": rtol * float(rstd.max()) * g * w_max * (2 + x_hat ** 2),
            "weight": rtol * rows * g * x_hat, "bias": rtol * rows * g}


def _value_and_grads(function, x, w, b, gy):
    y = function(x, w, b, EPS)
    return y, y.grad_fn, torch.autograd.grad(y, (x, w, b), gy)


def _within(got, want, bound):
    assert got.shape == want.shape and got.dtype == want.dtype
    difference = float((got.detach() - want.detach()).abs().max())
    assert difference <= bound, (difference, bound)


def _check(x, w, b, gy):
    with unittest.mock.patch.object(_fused, "layer_norm_backward", wraps=_fused.layer_norm_backward) as spy:
        y, node, grads = _value_and_grads(stacked_layer_norm.layer_norm, x, w, b, gy)
    assert type(node).__name__ == "StackedLayerNormBackward" and spy.call_count == 1
    want_y, _, want_grads = _value_and_grads(stacked_layer_norm.layer_norm_composite, x, w, b, gy)
    bound = _bounds(x, w, b, gy)
    _within(y, want_y, bound["y"])
    for name, got, want in zip(("x", "weight", "bias"), grads, want_grads):
        _within(got, want, bound[name])


@given(k=st.integers(1, 3), rows=st.integers(1, 150), d=st.integers(1, 40),
       offset=st.floats(-3, 3), seed=st.integers(0, 2**16))
def test_the_function_equals_autograd_of_the_formula(k, rows, d, offset, seed):
    # rows up to 150: the column sums' blocks of 64, the last one partial
    _check(*_inputs(k, rows, d, offset, seed))


@given(k=st.integers(1, 3), rows=st.integers(1, 150), offset=st.floats(-3, 3), seed=st.integers(0, 2**16))
def test_rows_of_32_entries_equal_autograd_of_the_formula(k, rows, offset, seed):
    # d = 32 (the vit's width) takes the pass's blocks of 16 rows, the last one padded
    _check(*_inputs(k, rows, 32, offset, seed))


@pytest.mark.parametrize("library", ["as built", "generic build"])
@pytest.mark.parametrize("rows", [1024, 1000])
def test_float32_is_the_float64_formula_within_float32_rounding(rows, library, request):
    # the same bound at float32's unit roundoff for d = 32, M = 1024 (the vit's rows at B = 64; 1000:
    # the last group of 16 rows holds 8, padded): 8·γ_1088 ≈ 5.2e-4 in place of the float64 factor, times
    # (1 + |mean|·rstd)·S as there; 3e-3 taken in its place (a margin of about 6); also with the
    # library a compiler without the shuffle builtin builds (rows of 32 summed by row_totals' loop)
    if library == "generic build":
        request.getfixturevalue("generic_passes")
    x, w, b, gy = _inputs(3, rows, 32, 2.0, 5, torch.float32)
    y, _, grads = _value_and_grads(stacked_layer_norm.layer_norm, x, w, b, gy)
    exact = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want_y, _, want_grads = _value_and_grads(stacked_layer_norm.layer_norm_composite, *exact, gy.double())
    scale = {name: bound / (8 * _gamma(2 * 32 + 1024)) for name, bound in _bounds(*exact, gy.double()).items()}
    _within(y.double(), want_y, 3e-3 * scale["y"])
    for name, got, want in zip(("x", "weight", "bias"), grads, want_grads):
        _within(got.double(), want, 3e-3 * scale[name])


@pytest.mark.parametrize("mutation", ["weight and bias exchanged", "the gradient's mean dropped"])
def test_a_misplaced_term_fails_the_bound(mutation, monkeypatch):
    x, w, b, gy = _inputs(2, 5, 6, 0.5, 9)
    real = _fused.layer_norm_backward
    if mutation == "weight and bias exchanged":
        monkeypatch.setattr(_fused, "layer_norm_backward",
                            lambda *args: (lambda gx, gw, gb: (gx, gb, gw))(*real(*args)))
    else:  # ∂x + rstd·⟨g⟩: ∂x as if the pass left out its −⟨g⟩ term
        def without_mean(x, gy, gamma, mean, rstd):
            gx, gw, gb = real(x, gy, gamma, mean, rstd)
            return gx + rstd.unsqueeze(2) * (gy * gamma.unsqueeze(1)).mean(2, keepdim=True), gw, gb
        monkeypatch.setattr(_fused, "layer_norm_backward", without_mean)
    with pytest.raises(AssertionError):
        _check(x, w, b, gy)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("entry", ["layer_norm", "Function"])
def test_second_derivatives_tangents_and_batched_gradients_go_through_the_formula(function_checks, layout, entry):
    # through the module's function (which passes contiguous copies) and the Function itself (which
    # saves its inputs as given), on contiguous rows and rows stored transposed
    x, w, b, gy = _inputs(2, 3, 4, 0.3, 1)
    if layout == "transposed":
        x = x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()

    def close(got, want):  # the same formula on both sides: float64 rounding
        _within(got, want, 1e-12 * max(float(want.abs().max()), 1.0))

    function = stacked_layer_norm.layer_norm if entry == "layer_norm" else stacked_layer_norm.StackedLayerNorm.apply
    function_checks.second_order_paths(lambda *args: function(*args, EPS),
                                       lambda *args: stacked_layer_norm.layer_norm_composite(*args, EPS),
                                       (x, w, b), gy, close)


def test_calls_the_pass_cannot_serve_take_the_torch_operations():
    x, w, b, _ = _inputs(2, 3, 4, 0.0, 2)
    layer_norm = stacked_layer_norm.layer_norm
    with unittest.mock.patch.object(stacked_layer_norm.StackedLayerNorm, "apply",
                                    wraps=stacked_layer_norm.StackedLayerNorm.apply) as spy:
        layer_norm(x, w, b, EPS)
        assert spy.call_count == 1
        with _fused.disabled():
            layer_norm(x, w, b, EPS)
        torch.func.vmap(lambda *args: layer_norm(*args, EPS))(x[None], w[None], b[None])
        with FlopCounterMode(display=False):  # a dispatch mode sees torch's ops
            layer_norm(x, w, b, EPS)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones_like(x))
            tangent = torch.autograd.forward_ad.unpack_dual(layer_norm(dual, w, b, EPS)).tangent
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer_norm(x.float(), w.float(), b.float(), EPS)
        layer_norm(x.half(), w.half(), b.half(), EPS)
        assert spy.call_count == 1
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), torch.ones_like(x))
        want = torch.autograd.forward_ad.unpack_dual(stacked_layer_norm.layer_norm_composite(dual, w, b, EPS)).tangent
    assert torch.equal(tangent, want)


def test_two_threads_give_one_threads_numbers():
    # each model's rows and column sums run on one thread in a fixed order (sizes above the
    # pass's grain, so that two threads run)
    x, w, b, gy = _inputs(4, 300, 32, 0.5, 3, torch.float32)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            results.append(_value_and_grads(stacked_layer_norm.layer_norm, x, w, b, gy))
        finally:
            torch.set_num_threads(1)
    (y1, _, grads1), (y2, _, grads2) = results
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2))


def test_a_gradient_of_one_input_alone():
    x, w, b, gy = _inputs(2, 5, 6, 0.5, 4)
    w, b = w.detach(), b.detach()
    got, = torch.autograd.grad(stacked_layer_norm.layer_norm(x, w, b, EPS), x, gy)
    want, = torch.autograd.grad(stacked_layer_norm.layer_norm_composite(x, w, b, EPS), x, gy)
    _within(got, want, _bounds(x, w, b, gy)["x"])


@pytest.mark.parametrize("shapes", [((2, 3, 4), (4,), (4,)), ((2, 3, 4), (2, 4), (2, 3)), ((3, 4), (3, 4), (3, 4))])
def test_shapes_that_do_not_fit_are_refused_in_one_line(shapes):
    with pytest.raises(ValueError, match="needs rows"):
        stacked_layer_norm.layer_norm(*(torch.zeros(shape) for shape in shapes), EPS)


@pytest.mark.parametrize("method, calls", [("vit", 5), ("vit-affine_like-qknorm", 5), ("vit-nonorm", 0)])
def test_the_stacked_engine_takes_the_function(digits, method, calls, function_checks):
    # depth 2: two LayerNorms per block and the last one before the read-out
    got = function_checks.calls_in_a_stacked_step(method, digits, stacked_layer_norm.StackedLayerNorm,
                                                   "layer_norm_backward")
    assert got == (calls, calls)

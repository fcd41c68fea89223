"""The stacked engine's batched products on oneDNN (``affdiv.experiments.runs.stacked_matmul``).

The engine gives oneDNN only products of at least ``ONEDNN_MIN_FLOPS``; these tests lower that
line to 0 (the ``small_products_on_onednn`` fixture) so that small operands exercise oneDNN's path,
except the test of the line itself.

oneDNN sums in its own order, so its float32 products are held to the float64 product of the same
float32 operands by the rounding-error bound of a sum of L products (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., eq. 3.5),

    |fl(a b) − a b| ≤ γ_L |a| |b|,    γ_L = L u / (1 − L u),    u = 2⁻²⁴,

elementwise, and the product added to c by one more rounding (u |a b + c|). A wrong transpose, a
dropped bias or a gradient of the wrong operand is off by far more than that bound. The routing
tests say which calls take oneDNN: plain eager float32 CPU tensors only, and which backwards take
torch's products (a double backward, tangents, batched gradients), checked against torch's.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import stacked_matmul
from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.layers import _native

pytestmark = [pytest.mark.usefixtures("one_thread", "small_products_on_onednn"),
              pytest.mark.skipif(not _native.onednn_enabled(), reason="oneDNN's matmul is not bound here")]

U = 2.0**-24
LINE = stacked_matmul.ONEDNN_MIN_FLOPS  # (the package's value; the module's fixture lowers it to 0)


def _within_bound(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None) -> None:
    """got (float32) against c + a b in float64, by the bound of the module docstring."""
    exact = torch.bmm(a.double(), b.double()) + (0 if c is None else c.double())
    length = a.shape[2]
    gamma = length * U / (1 - length * U)
    bound = gamma * torch.bmm(a.double().abs(), b.double().abs()) + U * exact.abs()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values, contiguous, transposed in the last two dimensions, or strided (every other
    element of a larger tensor, models interleaved with the rows as the CNN read-out's input is)."""
    if layout == "transposed":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "strided":
        wide = torch.zeros(t.shape[1], t.shape[0], 2 * t.shape[2])
        wide[:, :, ::2] = t.transpose(0, 1)
        return wide.transpose(0, 1)[:, :, ::2]
    return t


def _operands(k, m, length, n, bias, layouts, seed):
    g = torch.Generator().manual_seed(seed)
    a = _laid_out(torch.randn(k, m, length, generator=g), layouts[0])
    b = _laid_out(torch.randn(k, length, n, generator=g), layouts[1])
    c = {"none": None, "rows": torch.randn(k, m, 1, generator=g), "columns": torch.randn(k, 1, n, generator=g),
         "full": torch.randn(k, m, n, generator=g)}[bias]
    return a, b, c, torch.randn(k, m, n, generator=g)


@example(k=2, m=256, length=784, n=16, bias="rows", layouts=("contiguous", "transposed"), needs=(True, True, False),
         seed=0)  # (the fashion MLP's first layer at B = 16, as the engine lays it out)
@given(k=st.integers(1, 4), m=st.integers(1, 24), length=st.integers(1, 40), n=st.integers(1, 24),
       bias=st.sampled_from(["none", "rows", "columns", "full"]),
       layouts=st.tuples(*[st.sampled_from(["contiguous", "transposed", "strided"])] * 2),
       needs=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any), seed=st.integers(0, 2**16))
def test_the_product_and_its_gradients_are_the_exact_ones_within_float32_rounding(k, m, length, n, bias, layouts,
                                                                                 needs, seed):
    a, b, c, g = _operands(k, m, length, n, bias, layouts, seed)
    inputs = [t.requires_grad_(need) if t is not None else None for t, need in zip((c, a, b), needs)]
    z = stacked_matmul.baddbmm(*inputs)
    _within_bound(z, a, b, c)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    if not wanted:
        return
    assert type(z.grad_fn).__name__ == "OnednnBaddbmmBackward"
    grads = dict(zip(map(id, wanted), torch.autograd.grad(z, wanted, g)))
    if c is not None and c.requires_grad:  # g summed over c's broadcast dimensions: at most max(m, n) terms
        exact = g.double().sum_to_size(c.shape)
        terms = max(1, g.numel() // c.numel())
        assert ((grads[id(c)].double() - exact).abs() <= terms * U * g.double().abs().sum_to_size(c.shape)).all()
    if a.requires_grad:
        _within_bound(grads[id(a)], g, b.detach().transpose(1, 2), None)
    if b.requires_grad:
        _within_bound(grads[id(b)], a.detach().transpose(1, 2), g, None)


@pytest.mark.parametrize("rows", [3, stacked_matmul.THIN_MIN_CONTRACTION])
def test_an_operand_stored_transposed_gets_its_gradient_in_its_layout(rows):
    # a weight W passed as Wᵀ (the vit's token projections, row_product) gets ∂W contiguous, as
    # autograd.grad hands it to the stacked optimiser (its values: the bound test's transposed layouts);
    # with as many rows as a column layer's thin input gradient needs too (that route is not W's)
    w, x = torch.randn(2, 5, 4, requires_grad=True), torch.randn(2, rows, 4, requires_grad=True)
    xt = torch.randn(2, 4, rows, requires_grad=True)
    for a, b, leaves in ((x, w.transpose(1, 2), (x, w)), (xt.transpose(1, 2), w.transpose(1, 2), (xt, w))):
        z = stacked_matmul.baddbmm(None, a, b)
        assert type(z.grad_fn).__name__ == "OnednnBaddbmmBackward"
        assert all(grad.is_contiguous() for grad in torch.autograd.grad(z, leaves, torch.randn_like(z)))


@example(k=1, m=stacked_matmul.THIN_MIN_CONTRACTION, length=5, n=stacked_matmul.THIN_COLUMNS, seed=0)
@example(k=1, m=stacked_matmul.THIN_MIN_CONTRACTION - 1, length=5, n=stacked_matmul.THIN_COLUMNS, seed=0)
@example(k=1, m=stacked_matmul.THIN_MIN_CONTRACTION, length=5, n=stacked_matmul.THIN_COLUMNS + 1, seed=0)
@given(k=st.integers(1, 3), m=st.integers(stacked_matmul.THIN_MIN_CONTRACTION - 8, 260), length=st.integers(1, 48),
       n=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_column_layers_input_gradient_with_few_columns_is_transposed_back_within_the_bound(k, m, length, n, seed):
    # zᵀ = W xᵀ with xᵀ contiguous (the engine's column layer): ∂xᵀ = Wᵀ g, computed as (gᵀ W)ᵀ and
    # copied where g has at most THIN_COLUMNS columns and W at least THIN_MIN_CONTRACTION rows; either
    # way the exact product within the bound, contiguous
    a, b, _c, g = _operands(k, m, length, n, "none", ("contiguous", "contiguous"), seed)
    b.requires_grad_()
    z = stacked_matmul.baddbmm(None, a, b)
    with unittest.mock.patch.object(stacked_matmul, "_product", wraps=stacked_matmul._product) as spy:
        (grad,) = torch.autograd.grad(z, b, g)
    # (with one column W's transpose is contiguous itself: the direct product reads no transpose)
    thin = n <= stacked_matmul.THIN_COLUMNS and m >= stacked_matmul.THIN_MIN_CONTRACTION and length > 1
    assert [call.args[0].shape for call in spy.call_args_list] == [(k, n, m) if thin else (k, length, m)]
    assert grad.is_contiguous() and grad.shape == b.shape
    _within_bound(grad, a.transpose(1, 2), g, None)


@pytest.mark.parametrize("columns", [LINE // 16000 - 1, LINE // 16000])
def test_a_product_below_the_line_takes_torchs_ops_and_one_on_it_onednn(monkeypatch, columns):
    # 2·K·M·L·N FLOPs with K, M, L = 4, 50, 40: 16000 a column of b, so these are the products
    # just below ONEDNN_MIN_FLOPS and on it
    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", LINE)
    assert LINE % 16000 == 0
    a, b, c, _ = _operands(4, 50, 40, columns, "columns", ("contiguous", "transposed"), 7)
    on_onednn = columns * 16000 >= LINE
    assert stacked_matmul.takes_onednn(c, a, b) == on_onednn
    w = b.transpose(1, 2).contiguous().requires_grad_()  # b passed as a weight's transposed view
    z = stacked_matmul.baddbmm(c, a.requires_grad_(), w.transpose(1, 2))
    assert type(z.grad_fn).__name__ == ("OnednnBaddbmmBackward" if on_onednn else "BaddbmmBackward0")
    _within_bound(z, a.detach(), b, c)
    g = torch.randn_like(z)
    grad_a, grad_w = torch.autograd.grad(z, (a, w), g)
    _within_bound(grad_a, g, b.transpose(1, 2), None)
    _within_bound(grad_w.transpose(1, 2), a.detach().transpose(1, 2), g, None)
    assert grad_w.is_contiguous() == on_onednn  # (below the line, torch's layout: see takes_onednn)
    with unittest.mock.patch.object(stacked_matmul, "_product", wraps=stacked_matmul._product) as spy:
        got = stacked_matmul.product(a.detach(), b)
    assert spy.called == on_onednn
    _within_bound(got, a.detach(), b, None)


def test_a_transposed_operand_fails_the_bound():
    # (the bound is tight enough to fail a product computed from a transposed b: a mutation check)
    a, b, c, _ = _operands(2, 5, 5, 5, "rows", ("contiguous", "contiguous"), 3)
    wrong = stacked_matmul.baddbmm(c, a, b.transpose(1, 2))
    with pytest.raises(AssertionError):
        _within_bound(wrong, a, b, c)


def _grad_fn(c, a, b) -> str:
    return type(stacked_matmul.baddbmm(c, a.requires_grad_(), b).grad_fn).__name__


def test_plain_eager_float32_products_take_onednn_and_every_other_call_torch():
    a, b, c, _ = _operands(2, 3, 4, 5, "rows", ("contiguous", "contiguous"), 1)
    assert _grad_fn(c, a, b) == "OnednnBaddbmmBackward"
    assert _grad_fn(None, a, b) == "OnednnBaddbmmBackward"
    assert _grad_fn(c.double(), a.double(), b.double()) == "BaddbmmBackward0"  # float64: torch's
    assert _grad_fn(None, a.double(), b.double()) == "BmmBackward0"
    with _native.disabled():
        assert _grad_fn(c, a, b) == "BaddbmmBackward0"
    assert _grad_fn(c, a[:, :, :0], b[:, :0]) == "BaddbmmBackward0"  # (empty)
    with FlopCounterMode(display=False) as counter:  # a dispatch mode sees torch's op, counted
        stacked_matmul.baddbmm(c, a, b)
    assert counter.get_total_flops() == 2 * 2 * 3 * 4 * 5
    with unittest.mock.patch.object(stacked_matmul.OnednnBaddbmm, "apply") as spy:
        torch.func.vmap(lambda a, b: stacked_matmul.baddbmm(None, a, b))(a[None], b[None])
        with torch.backends.mkldnn.flags(enabled=False):  # torch's oneDNN switch off
            stacked_matmul.baddbmm(c, a, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: torch's product, in bfloat16
            assert stacked_matmul.baddbmm(c, a, b).dtype == torch.bfloat16
        previous = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # oneDNN's matmul would follow it
        try:
            stacked_matmul.baddbmm(c, a, b)
        finally:
            torch.backends.mkldnn.matmul.fp32_precision = previous
    assert spy.call_count == 0  # torch.func, the switch, autocast and the reduced precision: torch's products
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(a.detach(), torch.ones_like(a))
        tangent = torch.autograd.forward_ad.unpack_dual(stacked_matmul.baddbmm(c, dual, b)).tangent
    assert torch.equal(tangent, torch.bmm(torch.ones_like(a), b))  # forward-mode AD: torch's, with its jvp


def _both(fn):
    """fn(baddbmm) on oneDNN and inside ``_native.disabled()`` (torch's products)."""
    onednn = fn(stacked_matmul.baddbmm)
    with _native.disabled():
        return onednn, fn(stacked_matmul.baddbmm)


#: Cases of the second-order tests: (operands' sizes k, m, length, n, the factor whose gradient is
#: taken). "thin": a column layer's input gradient of 8 columns under 128 rows of W, which a plain
#: backward computes as (gᵀ W)ᵀ (_input_gradient).
SECOND_ORDER = {"small": ((2, 3, 4, 5), 0), "thin": ((2, stacked_matmul.THIN_MIN_CONTRACTION, 16, 8), 1)}


def _second_order_operands(case: str, seed: int):
    """(the factor differentiated, the other factor, g, call): ``call(product, x, y)`` is
    product(c, ·, ·) with x in the differentiated factor's place and y in the other's."""
    sizes, which = SECOND_ORDER[case]
    a, b, c, g = _operands(*sizes, "rows", ("contiguous", "contiguous"), seed)
    leaf, other = (a, b) if which == 0 else (b, a)

    def call(product, x, y):  # x in the place of the differentiated factor
        return product(c, x, y) if which == 0 else product(c, y, x)

    return leaf, other, g, call


@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_a_double_backward_equals_torchs(case):
    # the backward records a graph: torch's products, so that the second derivatives exist
    leaf, other, g, call = _second_order_operands(case, 2)
    leaf.requires_grad_(), other.requires_grad_(), g.requires_grad_()

    def second(product):
        grad, = torch.autograd.grad(call(product, leaf, other), leaf, g, create_graph=True)
        return torch.autograd.grad(grad.square().sum(), (other, g))

    for onednn, torchs in zip(*_both(second)):
        torch.testing.assert_close(onednn, torchs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_forward_over_reverse_keeps_the_tangents(case):
    # a backward fed dual gradients: oneDNN would drop their tangents, torch's products keep them
    leaf, other, g, call = _second_order_operands(case, 4)
    leaf.requires_grad_()

    def tangent(product):
        z = call(product, leaf, other)
        with torch.autograd.forward_ad.dual_level():
            grad, = torch.autograd.grad(z, leaf, torch.autograd.forward_ad.make_dual(g, torch.ones_like(g)))
            return torch.autograd.forward_ad.unpack_dual(grad).tangent

    onednn, torchs = _both(tangent)
    assert onednn is not None
    torch.testing.assert_close(onednn, torchs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(SECOND_ORDER))
def test_batched_gradients_equal_the_looped_ones(case):
    leaf, other, _g, call = _second_order_operands(case, 5)
    leaf.requires_grad_()
    z = call(stacked_matmul.baddbmm, leaf, other)
    basis = torch.eye(z.numel()).reshape(-1, *z.shape)[:: max(1, z.numel() // 64)]  # (64 of them at most)
    batched, = torch.autograd.grad(z, leaf, basis, is_grads_batched=True, retain_graph=True)
    looped = torch.stack([torch.autograd.grad(z, leaf, e, retain_graph=True)[0] for e in basis])
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)


def test_two_threads_give_the_bound_too():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a, b, c, _ = _operands(4, 64, 256, 64, "columns", ("transposed", "contiguous"), 6)
        _within_bound(stacked_matmul.baddbmm(c, a, b), a, b, c)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("method, depth, width", [("affine", 2, 16), ("affine_like", 2, 16), ("vit", 1, 16),
                                                  ("affine", 3, stacked_matmul.THIN_MIN_CONTRACTION)])
def test_the_stacked_engine_takes_onednn_in_float32_with_torchs_numbers_within_rounding(digits, method, depth, width):
    # one SGD step of the same models with and without oneDNN: float32 rounding apart (the step
    # multiplies gradients of ~1 by lr ≤ 0.2; relative 1e-5 is ~100 u), and float64 bit for bit
    # (oneDNN takes no float64 product); at the wider MLP the hidden layer's input gradient, 8
    # columns, takes the transposed product (stacked_matmul._laid_out_as)
    orders = torch.stack([torch.randperm(len(digits.train.y), generator=torch.Generator().manual_seed(s))
                          for s in (0, 1)])
    rule = stacked_matmul.thin_input_gradient
    for dtype in ("float32", "float64"):
        split = (torch.as_tensor(digits.train.x).to(getattr(torch, dtype)), torch.as_tensor(digits.train.y))
        config = RunConfig(dataset="digits", method=method, depth=depth, width=width, batch_size=8, seed=0,
                           dtype=dtype)
        engines = []
        for context in (_native.disabled, contextlib.nullcontext):
            models = [build_member(config, digits, seed) for seed in (0, 1)]
            engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
            taken = []  # what each call of the thin-product rule answered

            def answered(left, right, seen=taken):
                seen.append(rule(left, right))
                return seen[-1]

            with unittest.mock.patch.object(_native, "onednn_bmm_", wraps=_native.onednn_bmm_) as spy, \
                    unittest.mock.patch.object(stacked_matmul, "thin_input_gradient", new=answered), context():
                engine.step(orders[:, :8])
            engines.append((engine, spy.call_count))
        (torch_engine, torch_calls), (onednn_engine, onednn_calls) = engines
        assert torch_calls == 0 and (onednn_calls > 0) == (dtype == "float32")
        assert any(taken) == (dtype == "float32" and width >= stacked_matmul.THIN_MIN_CONTRACTION)
        for name, p in torch_engine.params.items():
            if dtype == "float64":
                assert torch.equal(onednn_engine.params[name], p)
            else:
                torch.testing.assert_close(onednn_engine.params[name], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["affine", "batchnorm"])
def test_a_check_takes_onednn_for_the_first_layer_of_each_split(digits, method):
    # A check evaluates the models of each split on that split's input: the first linear layer is
    # one product of the chunk with those models' weights side by side (a batch of one), on oneDNN
    # in float32 only (batchnorm's linear layers have no bias). Models 0 and 1 share a split, model 2
    # has its own. The logits are each model's own in eval mode within rounding: relative 1e-5
    # (~100 u) in float32, 1e-12 in float64 (2 γ_64 ≈ 1.4e-14 per sum of the 64 inputs or 16 hidden
    # units, with room for cancellation), with and without oneDNN.
    inputs = torch.as_tensor(digits.train.x[:96]), torch.as_tensor(digits.train.x[96:192])
    for dtype in ("float32", "float64"):
        config = RunConfig(dataset="digits", method=method, depth=2, width=16, batch_size=8, seed=0, dtype=dtype)
        models = [build_member(config, digits, seed) for seed in (0, 1, 2)]
        xa, xb = (x.to(getattr(torch, dtype)) for x in inputs)
        splits = [(xa, torch.as_tensor(digits.train.y[:96]))] * 2 + [(xb, torch.as_tensor(digits.train.y[96:192]))]
        engine = stacked_engine(models[0])(models, "sgd", [0.1] * 3, [None] * 3, splits, splits)
        with torch.no_grad():
            alone = torch.stack([model.eval()(x) for model, x in zip(models, (xa, xa, xb))])
        for context in (_native.disabled, contextlib.nullcontext):
            with unittest.mock.patch.object(stacked_matmul.OnednnBaddbmm, "apply",
                                            wraps=stacked_matmul.OnednnBaddbmm.apply) as spy, context(), \
                    torch.no_grad():
                logits = engine._shared_logits(engine.params, engine.buffers, [(0, 2, xa), (2, 3, xb)])
            shapes = [tuple(call.args[1].shape) for call in spy.call_args_list]
            assert (shapes[:2] == [(1, 96, 64)] * 2) == (dtype == "float32" and context is contextlib.nullcontext)
            if dtype == "float32" and context is contextlib.nullcontext:  # Wᵀ side by side: natural batch stride
                assert [call.args[2].stride() for call in spy.call_args_list[:2]] == [(2 * 16 * 64, 1, 64),
                                                                                      (16 * 64, 1, 64)]
            tolerance = 1e-5 if dtype == "float32" else 1e-12
            torch.testing.assert_close(logits, alone, rtol=tolerance, atol=tolerance)


def test_where_onednn_is_not_preferred_every_product_is_torchs(monkeypatch):
    a, b, c = torch.randn(3, 64, 32), torch.randn(3, 32, 48), torch.randn(3, 1, 48)
    assert stacked_matmul.takes_onednn(c, a, b)  # (the module's fixture: every size, every processor)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    assert not stacked_matmul.takes_onednn(c, a, b)
    with unittest.mock.patch.object(_native, "onednn_bmm_", wraps=_native.onednn_bmm_) as onednn:
        out = stacked_matmul.baddbmm(c, a.requires_grad_(), b)
        out.backward(torch.ones_like(out))
        product = stacked_matmul.product(a.detach(), b)
    assert onednn.call_count == 0
    assert torch.equal(out, torch.baddbmm(c, a, b)) and torch.equal(product, torch.bmm(a.detach(), b))

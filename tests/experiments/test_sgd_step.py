"""Plain SGD's step made in the backward of the stacked engine's dense layers
(``stacked_matmul.baddbmm(..., step=...)``, ``stacked_dense``, ``batched.sgd_stepped``).

The stepped weight must end as W + s ⊙ ∂W, s = −η per model, with ∂W the gradient the layer
would have returned. The step sums W and the n terms fl(s l_i) r_i of ∂W's contraction (the smaller
factor scaled, then one product added into W, which a kernel may fold into its sums in any order),
so against the float64 value of the same operands (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., eq. 3.5, over the n + 1 terms, with the scaling's rounding as one more factor
(1 + δ) per term)

    |got − exact| ≤ γ_{n+2} (|W| + |s| (|l| |r|)),    γ_k = k u / (1 − k u),

elementwise, u = 2⁻²⁴ in float32 and 2⁻⁵³ in float64; in float64 the reference, computed in the
same precision, carries as much rounding again, so the bound doubles. A step of the wrong sign,
of the wrong operand, transposed, or forgotten is off by about |s ∂W|, far more. That bound holds
for the fused product (``stacked_matmul.fused_step``); outside it the step must be the optimiser's
update of the gradient the product without the step gives W, bit for bit. The other operands'
gradients must read W before it moves: they are compared bit for bit with the unstepped product's.
"""

from __future__ import annotations

import contextlib
import math
import unittest.mock

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from affdiv.experiments.runs import batched, stacked_dense, stacked_matmul
from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.layers import _native

pytestmark = pytest.mark.usefixtures("one_thread", "small_products_on_onednn")

ROUNDING = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
LINE = stacked_matmul.ONEDNN_MIN_FLOPS  # (the package's line; the module's fixture lowers it to 0)
ROUTES = {"oneDNN": contextlib.nullcontext, "torch": _native.disabled}
#: For the tests of the engine's fused step on oneDNN's product.
needs_onednn = pytest.mark.skipif(not _native.onednn_enabled(), reason="oneDNN's matmul is not bound here")


@contextlib.contextmanager
def _fused_answers():
    """Inside the block, every answer of ``stacked_matmul.fused_step``, in order, in the list yielded."""
    rule, answers = stacked_matmul.fused_step, []

    def answered(*operands):
        answers.append(rule(*operands))
        return answers[-1]

    with unittest.mock.patch.object(stacked_matmul, "fused_step", answered):
        yield answers


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def _assert_stepped(got: torch.Tensor, before: torch.Tensor, step: torch.Tensor, left: torch.Tensor,
                    right: torch.Tensor) -> None:
    """got against before + step ⊙ (left right), in float64, by the bound of the module docstring."""
    s = step.detach().double()
    exact = before.double() + s * torch.bmm(left.double(), right.double())
    terms = before.double().abs() + s.abs() * torch.bmm(left.double().abs(), right.double().abs())
    bound = _gamma(left.shape[2] + 2, ROUNDING[got.dtype]) * terms
    bound *= 2 if got.dtype == torch.float64 else 1  # (the reference's own rounding)
    assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max()


def _case(k, m, length, n, weight, bias, dtype, seed):
    """(c, a, b, g, W) for c + a b with W = a or W = bᵀ, W contiguous as the engine's weights are."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    a, b = randn(k, m, length), randn(k, length, n)
    if weight == "b":
        b = randn(k, n, length).transpose(1, 2)
    c = randn(k, m, 1) if bias else None
    return c, a, b, randn(k, m, n), (a if weight == "a" else b.transpose(1, 2))


@example(k=2, m=256, length=64, n=16, weight="a", bias=True, dtype=torch.float32, route="oneDNN",
         rates=(0.1, 0.4), seed=0)  # (a column layer: W (256, 64), 16 columns; its input gradient thin)
@example(k=1, m=1, length=1, n=1, weight="b", bias=False, dtype=torch.float64, route="torch", rates=(1.0,), seed=1)
@example(k=2, m=3, length=4, n=stacked_matmul.FUSED_STEP_MAX_ROWS + 1, weight="a", bias=False, dtype=torch.float32,
         route="oneDNN", rates=(0.2, 0.5), seed=2)  # (more rows than the fused product takes)
@example(k=2, m=stacked_matmul.FUSED_STEP_MAX_ROWS + 1, length=4, n=3, weight="b", bias=True, dtype=torch.float32,
         route="oneDNN", rates=(0.2, 0.5), seed=3)  # (the same for a weight passed as Wᵀ)
@given(k=st.integers(1, 3), m=st.integers(1, 20), length=st.integers(1, 20), n=st.integers(1, 20),
       weight=st.sampled_from(["a", "b"]), bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       route=st.sampled_from(list(ROUTES)), rates=st.lists(st.floats(1e-3, 2.0), min_size=3, max_size=3),
       seed=st.integers(0, 2**16))
def test_the_step_moves_the_weight_by_minus_eta_times_its_gradient(k, m, length, n, weight, bias, dtype, route, rates,
                                                                   seed):
    c, a, b, g, w = _case(k, m, length, n, weight, bias, dtype, seed)
    step = torch.tensor([-r for r in rates[:k]], dtype=dtype).view(k, 1, 1)
    inputs = [t.requires_grad_() for t in (c, b if weight == "a" else a) if t is not None]
    left, right = (g, b.transpose(1, 2)) if weight == "a" else (g.transpose(1, 2), a)  # ∂W = left right
    before = w.clone()
    with ROUTES[route]():
        fused = stacked_matmul.fused_step(w, left, right)
        # the product without the step, W a leaf of its own
        leaf = before.clone().requires_grad_()
        factors = (leaf, b) if weight == "a" else (a, leaf.transpose(1, 2))
        *plain, plain_w = torch.autograd.grad(stacked_matmul.baddbmm(c, *factors), inputs + [leaf], g)
        out = stacked_matmul.baddbmm(c, a, b, step.requires_grad_(), weight)
        with unittest.mock.patch.object(_native, "onednn_bmm_", wraps=_native.onednn_bmm_) as onednn:
            *grads, step_grad = torch.autograd.grad(out, inputs + [step], g)
    # the fused step is one oneDNN product that adds into the weight itself
    into_w = [call for call in onednn.call_args_list if call.args[0].data_ptr() == w.data_ptr()]
    assert [call.args[3] for call in into_w] == ([1.0] if fused else [])
    for got, want in zip(grads, plain):  # read before the weight moved
        assert torch.equal(got, want)
    assert torch.equal(step_grad, torch.zeros_like(step))
    if fused:
        _assert_stepped(w, before, step, left, right)
    else:  # the optimiser's update of the gradient the product gives W, bit for bit
        assert torch.equal(w, before.addcmul(plain_w, step.detach()))


@pytest.mark.parametrize("weight", ["a", "b"])
@pytest.mark.parametrize("rows", [8, stacked_matmul.FUSED_STEP_MAX_ROWS + 1,
                                  stacked_matmul.MKL_FUSED_STEP_MAX_ROWS + 1])
def test_where_mkl_is_preferred_the_fused_step_is_torchs_product_into_the_weight(weight, rows, monkeypatch):
    # an Intel processor with MKL (stacked_matmul.ONEDNN_PREFERRED false): no product on oneDNN;
    # the fused step is torch's in-place baddbmm_ into the weight itself, within the bound above,
    # up to MKL's line of rows (beyond oneDNN's)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    into, original = [], torch.Tensor.baddbmm_
    monkeypatch.setattr(torch.Tensor, "baddbmm_",
                        lambda self, *args, **kwargs: into.append(self.data_ptr()) or original(self, *args, **kwargs))
    c, a, b, g, w = _case(2, 5, 7, rows, weight, True, torch.float32, 0) if weight == "a" else \
        _case(2, rows, 7, 5, weight, True, torch.float32, 0)
    step = torch.tensor([-0.3, -0.7]).view(2, 1, 1)
    inputs = [t.requires_grad_() for t in (c, b if weight == "a" else a)]
    left, right = (g, b.transpose(1, 2)) if weight == "a" else (g.transpose(1, 2), a)
    before = w.clone()
    fused = stacked_matmul.fused_step(w, left, right)
    assert fused == (rows <= stacked_matmul.MKL_FUSED_STEP_MAX_ROWS)
    with unittest.mock.patch.object(_native, "onednn_bmm_", wraps=_native.onednn_bmm_) as onednn:
        leaf = before.clone().requires_grad_()  # the product without the step, W a leaf of its own
        factors = (leaf, b) if weight == "a" else (a, leaf.transpose(1, 2))
        *plain, plain_w = torch.autograd.grad(stacked_matmul.baddbmm(c, *factors), inputs + [leaf], g)
        into.clear()
        out = stacked_matmul.baddbmm(c, a, b, step.requires_grad_(), weight)
        *grads, _step_grad = torch.autograd.grad(out, inputs + [step], g)
    assert onednn.call_count == 0 and into == ([w.data_ptr()] if fused else [])
    for got, want in zip(grads, plain, strict=True):  # read before the weight moved
        assert torch.equal(got, want)
    if fused:
        _assert_stepped(w, before, step, left, right)
    else:  # the optimiser's update of the gradient torch's product gives W, bit for bit
        assert torch.equal(w, before.addcmul(plain_w, step.detach()))


def test_a_stepped_product_steps_where_nothing_else_needs_a_gradient():
    # a first layer without a bias, on data: only the step requires a gradient, and that is enough
    c, a, b, g, w = _case(2, 6, 5, 4, "a", False, torch.float64, 3)
    before, step = w.clone(), torch.tensor([-0.1, -0.3], dtype=torch.float64).view(2, 1, 1).requires_grad_()
    torch.autograd.grad(stacked_matmul.baddbmm(None, a, b, step), step, g)
    _assert_stepped(w, before, step.detach(), g, b.transpose(1, 2))


def test_the_step_is_refused_where_it_cannot_be_made():
    c, a, b, g, w = _case(2, 3, 4, 5, "a", True, torch.float32, 4)
    step = torch.full((2, 1, 1), -0.1, requires_grad=True)
    before = w.clone()
    with pytest.raises(ValueError, match="must not require a gradient"):
        stacked_matmul.baddbmm(c, a.clone().requires_grad_(), b, step)
    with pytest.raises(ValueError, match="must require a gradient"):
        stacked_matmul.baddbmm(c, a, b, step.detach())
    with pytest.raises(ValueError, match="'a' or 'b'"):
        stacked_matmul.baddbmm(c, a, b, step, "c")
    for layer in ("affine_like", "norm_like"):  # (the dense layers check the same)
        with pytest.raises(ValueError, match="must not require a gradient"):
            _dense(layer, b.transpose(1, 2), a.clone().requires_grad_(), None, step)
    # a hook that copies what the Function saves would have the backward write into the copy
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t), \
            pytest.raises(RuntimeError, match="saved-tensor hooks"):
        stacked_matmul.baddbmm(c, a, b, step)
    out = stacked_matmul.baddbmm(c, a, b.requires_grad_(), step)
    with pytest.raises(RuntimeError, match="cannot record a graph"):
        torch.autograd.grad(out, b, g, create_graph=True)
    torch.autograd.grad(out, b, g, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # a second step of the same graph
        torch.autograd.grad(out, b, g)
    _assert_stepped(w, before, step.detach(), g, b.detach().transpose(1, 2))  # (one step made)


def test_a_compiled_step_is_refused():
    # a compiled backward would not write the weight: the step would be lost without a word
    _c, a, b, _g, _w = _case(2, 3, 4, 5, "a", False, torch.float32, 7)
    compiled = torch.compile(lambda a, b, step: stacked_matmul.baddbmm(None, a, b, step), backend="eager")
    with pytest.raises(RuntimeError, match="cannot be compiled"):
        compiled(a, b.requires_grad_(), torch.full((2, 1, 1), -0.1, requires_grad=True))


def test_a_weight_stepped_twice_in_one_graph_fails_loudly():
    # tied weights: the second backward would read a weight the first has moved; autograd's
    # version check stops it
    _c, a, b, g, _w = _case(2, 3, 3, 3, "a", False, torch.float64, 5)
    step = torch.full((2, 1, 1), -0.1, dtype=torch.float64).requires_grad_()
    x = b.requires_grad_()
    out = stacked_matmul.baddbmm(None, a, stacked_matmul.baddbmm(None, a, x, step), step)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, x, torch.ones_like(g))


def _dense(layer: str, x, w, bias, step=None):
    if layer == "affine_like":
        return stacked_dense.affine_like(x, w, bias, step=step)
    return stacked_dense.norm_like(x, w, bias, 1.0, 1e-6, step=step)


ROUTED_OFF = {"fused": contextlib.nullcontext,
              # the backward's composite fallback (a forward whose pass could not be trusted)
              "fallback": lambda: unittest.mock.patch.object(stacked_dense, "_passes_may_run", lambda *a: False),
              # the composite layer in torch operations, its product stepped
              "composite": lambda: unittest.mock.patch.object(stacked_dense, "usable", lambda *t: False)}


@pytest.mark.parametrize("route", list(ROUTED_OFF))
@pytest.mark.parametrize("layer", ["affine_like", "norm_like"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_dense_layers_step_their_weight_and_keep_their_other_gradients(layer, dtype, route):
    g = torch.Generator().manual_seed(6)
    k, m, length, n = 2, 12, 9, 7
    x = torch.randn(k, m, length, generator=g, dtype=dtype).requires_grad_()
    w, bias = torch.randn(k, n, length, generator=g, dtype=dtype), torch.randn(k, n, generator=g, dtype=dtype)
    gz = torch.randn(k, m, n, generator=g, dtype=dtype)
    step = torch.tensor([-0.2, -0.05], dtype=dtype).view(k, 1, 1)
    with ROUTED_OFF[route]():
        weight = w.clone().requires_grad_()
        bias_leaf = bias.clone().requires_grad_()
        dx, dw, db = torch.autograd.grad(_dense(layer, x, weight, bias_leaf), (x, weight, bias_leaf), gz)
        stepped, bias_leaf = w.clone(), bias.clone().requires_grad_()
        step_leaf = step.clone().requires_grad_()
        with _fused_answers() as fused:
            out = _dense(layer, x, stepped, bias_leaf, step_leaf)
            sdx, sdb, sstep = torch.autograd.grad(out, (x, bias_leaf, step_leaf), gz)
    assert torch.equal(sdx, dx) and torch.equal(sdb, db) and torch.equal(sstep, torch.zeros_like(step))
    # fused where the product may run on oneDNN: the Function's own step, or the composite's
    # product; the fallback steps with the composite's gradient, as the optimiser would
    assert fused == ([] if route == "fallback" else [dtype == torch.float32 and _native.onednn_enabled()])
    if not any(fused):  # the optimiser's update of the gradient the layer gives W, bit for bit
        assert torch.equal(stepped, w.addcmul(dw, step))
        return
    # W + s ∂W against the unstepped gradient ∂W: the step's sum (module docstring, with
    # |gy|ᵀ |x| for |l| |r|), and the unstepped ∂W's own rounding with the reference's sum within
    # as much again
    exact = w.double() + step.double() * dw.double()
    terms = w.double().abs() + step.double().abs() * _abs_gradient(layer, x.detach(), gz)
    bound = 2 * _gamma(m + 2, ROUNDING[dtype]) * terms
    assert ((stepped.double() - exact).abs() <= bound).all()


def _abs_gradient(layer: str, x: torch.Tensor, gz: torch.Tensor) -> torch.Tensor:
    """|gy|ᵀ |x| in float64, gy the gradient that enters ∂W = gyᵀ x (the row scale times gz)."""
    xd = x.double()
    norms = xd.square().sum(2, keepdim=True)
    scale = 1 / (norms + 1).sqrt() if layer == "affine_like" else 1 / norms.sqrt().clamp_min(1e-6)
    return torch.bmm((scale * gz.double()).abs().transpose(1, 2), xd.abs())


METHODS = ("affine", "affine_like", "norm_l2", "batchnorm", "layernorm", "rmsnorm")


def _build(digits, method: str, dtype: str = "float32", lrs=(0.1, 0.3), optimizer: str = "sgd", depth: int = 2):
    """An engine of ``method``'s models (digits, width 16, B = 8), one per lr, on the training split."""
    config = RunConfig(dataset="digits", method=method, depth=depth, width=16, batch_size=8, seed=0, dtype=dtype)
    split = (torch.as_tensor(digits.train.x).to(getattr(torch, dtype)), torch.as_tensor(digits.train.y))
    models = [build_member(config, digits, seed) for seed in range(len(lrs))]
    return stacked_engine(models[0])(models, optimizer, list(lrs), [0.9] * len(lrs), [split] * len(lrs),
                                     [split] * len(lrs))


def _engines(digits, method: str, lrs=(0.1, 0.3)):
    """(the float32 engine, the same with every update by the optimiser, a fresh one: their models'
    start), one model per lr; and the models' shuffles."""
    stepped = _build(digits, method, lrs=lrs)
    with unittest.mock.patch.object(batched, "sgd_stepped", lambda layers, optimizer, params: ()):
        plain = _build(digits, method, lrs=lrs)
    assert stepped.stepped and not plain.stepped
    orders = torch.stack([torch.randperm(len(digits.train.y), generator=torch.Generator().manual_seed(s))
                          for s in range(len(lrs))])
    return stepped, plain, _build(digits, method, lrs=lrs), orders


def _steps(stepped, plain, orders, exact: bool, count: int = 3) -> None:
    """``count`` steps of both engines on the same batches of 8; their losses and parameters equal
    bit for bit (``exact``) or within float32 rounding: relative 1e-5, about 170 u (each step
    rounds −η ∂W otherwise than the optimiser, by a few u of each weight, and three steps of
    training carry that through these small networks; a skipped step, or one of the wrong sign,
    moves a weight by |η ∂W|, some 1e-3 of it here)."""
    tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    for i in range(count):
        batch = orders[:, 8 * i: 8 * i + 8]
        torch.testing.assert_close(stepped.step(batch), plain.step(batch), equal_nan=True, **tolerance)
    for name, p in plain.params.items():
        torch.testing.assert_close(stepped.params[name], p, equal_nan=True, msg=name, **tolerance)


@pytest.mark.parametrize("method", METHODS)
def test_layers_whose_step_would_not_be_one_product_leave_it_to_the_optimiser(digits, method, monkeypatch):
    # at the package's oneDNN line the digits models' products run on torch's ops: no layer is
    # stepped in its backward, and the numbers are the optimiser's, bit for bit
    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", LINE)
    stepped, plain, start, orders = _engines(digits, method)
    with unittest.mock.patch.object(stepped.optimizer, "step", wraps=stepped.optimizer.step) as update:
        _steps(stepped, plain, orders, exact=True)
    assert all(set(call.args[0]) == set(stepped.params) for call in update.call_args_list)
    for name, p in plain.params.items():
        assert not torch.equal(p, start.params[name]), name  # (every parameter moved)


@pytest.mark.parametrize("onednn", [pytest.param(True, marks=needs_onednn, id="oneDNN"),
                                    pytest.param(False, id="MKL on Intel")])
@pytest.mark.parametrize("method", METHODS)
def test_the_fused_step_trains_as_the_optimiser_within_float32_rounding(digits, method, onednn, monkeypatch):
    # every product on oneDNN (the module's fixture), or every product torch's where MKL is the
    # preferred library (which needs no oneDNN); 8 rows: one fused product for every dense weight
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", onednn)
    stepped, plain, _start, orders = _engines(digits, method)
    with _fused_answers() as fused, \
            unittest.mock.patch.object(stepped.optimizer, "step", wraps=stepped.optimizer.step) as update:
        _steps(stepped, plain, orders, exact=False)
    assert fused == [True] * 3 * len(stepped.stepped)
    assert all(set(call.args[0]) == set(stepped.params) - set(stepped.stepped) for call in update.call_args_list)


@needs_onednn
def test_only_the_layers_whose_step_is_one_product_are_stepped(digits, monkeypatch):
    # a line between the first layer's product (32,768 FLOPs) and the others' (8,192 and 5,120):
    # the first layer's step is fused, the others' are the optimiser's
    monkeypatch.setattr(stacked_matmul, "ONEDNN_MIN_FLOPS", 10_000)
    stepped, plain, _start, orders = _engines(digits, "affine")
    with _fused_answers() as fused, \
            unittest.mock.patch.object(stepped.optimizer, "step", wraps=stepped.optimizer.step) as update:
        _steps(stepped, plain, orders, exact=False)
    assert fused == [True] * 3
    assert all(set(call.args[0]) == set(stepped.params) - {"1.weight"} for call in update.call_args_list)


@needs_onednn
def test_a_diverging_model_leaves_the_others_as_the_optimiser_would(digits):
    # one model's infinite lr sends its weights to inf and NaN (the fused product spreads the NaN
    # further than the optimiser's update does); the other model goes on as the optimiser's
    stepped, plain, _start, orders = _engines(digits, "affine", lrs=(0.1, math.inf))
    for i in range(4):
        batch = orders[:, 8 * i: 8 * i + 8]
        torch.testing.assert_close(stepped.step(batch)[0], plain.step(batch)[0], rtol=1e-5, atol=1e-6)
    assert stepped.finite().tolist() == plain.finite().tolist() == [True, False]
    for name, p in plain.params.items():
        torch.testing.assert_close(stepped.params[name][0], p[0], rtol=1e-5, atol=1e-6, msg=name)


@needs_onednn
def test_models_dropped_from_the_stack_choose_the_step_again(digits, monkeypatch):
    # three models over the line of bytes, two within it: keep() steps the two in the backward,
    # and they go on as the optimiser would have taken them
    lrs = (0.1, 0.2, 0.3)
    size = sum(p.numel() * p.element_size() for p in _build(digits, "affine", lrs=lrs[:1]).params.values())
    monkeypatch.setattr(batched, "SGD_STEP_MAX_BYTES", 2 * size)
    stepped = _build(digits, "affine", lrs=lrs)
    with unittest.mock.patch.object(batched, "sgd_stepped", lambda layers, optimizer, params: ()):
        plain = _build(digits, "affine", lrs=lrs)
    assert stepped.stepped == {}
    orders = torch.stack([torch.randperm(len(digits.train.y), generator=torch.Generator().manual_seed(s))
                          for s in range(3)])
    for engine in (stepped, plain):
        engine.step(orders[:, :8])
    stepped.keep([0, 2])
    with unittest.mock.patch.object(batched, "sgd_stepped", lambda layers, optimizer, params: ()):
        plain.keep([0, 2])
    assert stepped.stepped and not plain.stepped
    with _fused_answers() as fused:
        _steps(stepped, plain, orders[[0, 2], 8:], exact=False)
    assert fused and all(fused)


@needs_onednn
def test_a_backward_that_raises_after_a_step_stops_the_ensemble(digits):
    engine = _build(digits, "affine")
    step, calls = stacked_matmul.sgd_step_, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a failure in the backward")
        return step(*args, **kwargs)

    with unittest.mock.patch.object(stacked_matmul, "sgd_step_", second_fails), \
            pytest.raises(RuntimeError, match="a failure in the backward"):
        engine.step(torch.arange(16).reshape(2, 8))
    assert engine.half_stepped
    with pytest.raises(RuntimeError, match="cannot be trained on"):
        engine.step(torch.arange(16).reshape(2, 8))


@pytest.mark.parametrize("method, dtype, depth", [("affine", "float64", 2), ("conv", "float32", 2),
                                                 ("conv", "float32", 1), ("patchnorm", "float32", 1),
                                                 ("patchnorm", "float32", 2), ("conv+batchnorm", "float32", 1),
                                                 ("vit", "float32", 1)])
def test_float64_cnns_and_the_vit_keep_the_optimisers_update(digits, method, dtype, depth):
    # (a CNN of depth 1 has its one convolution in the fused first block)
    assert _build(digits, method, dtype, depth=depth).stepped == {}


LINES_OF_ROWS = [pytest.param(True, stacked_matmul.FUSED_STEP_MAX_ROWS, id="oneDNN", marks=needs_onednn),
                 pytest.param(False, stacked_matmul.MKL_FUSED_STEP_MAX_ROWS, id="MKL")]


@pytest.mark.parametrize("onednn_preferred, line", LINES_OF_ROWS)
def test_the_fused_product_is_taken_within_its_line_only(onednn_preferred, line, monkeypatch):
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", onednn_preferred)
    k, p, q = 2, 8, 6
    weight = torch.randn(k, p, q)
    for rows in (line, line + 1):
        left, right = torch.randn(k, p, rows), torch.randn(k, rows, q)
        assert stacked_matmul.fused_step(weight, left, right) == (rows <= line)
        assert not stacked_matmul.fused_step(weight.transpose(1, 2).contiguous().transpose(1, 2), left, right)
        assert not stacked_matmul.fused_step(weight.double(), left.double(), right.double())
    # beyond the line: the optimiser's update, bit for bit
    step, before = torch.tensor([-0.1, -0.7]).view(k, 1, 1), weight.clone()
    stacked_matmul.sgd_step_(weight, step, left, right)
    assert torch.equal(weight, before.addcmul(stacked_matmul.product(left, right), step))


@pytest.mark.parametrize("onednn_preferred, line", [(True, "SGD_STEP_MAX_BYTES"), (False, "MKL_SGD_STEP_MAX_BYTES")],
                         ids=["oneDNN", "MKL"])
def test_a_stack_steps_in_the_backward_up_to_its_routes_line_of_bytes(digits, onednn_preferred, line, monkeypatch):
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", onednn_preferred)
    config = RunConfig(dataset="digits", method="affine", depth=2, width=16, batch_size=8, seed=0)
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))

    def stepped(bytes_line: int) -> dict:
        models = [build_member(config, digits, seed) for seed in (0, 1)]
        with unittest.mock.patch.object(batched, line, bytes_line):
            return stacked_engine(models[0])(models, "sgd", [0.1, 0.3], [None] * 2, [split] * 2, [split] * 2).stepped

    size = 2 * sum(p.numel() * p.element_size() for p in build_member(config, digits, 0).parameters())
    assert list(stepped(size)) == ["1.weight", "3.weight", "5.weight"] and stepped(size - 1) == {}


@pytest.mark.parametrize("onednn_preferred, line", LINES_OF_ROWS)
def test_a_batch_beyond_the_fused_products_rows_leaves_every_update_to_the_optimiser(digits, onednn_preferred, line,
                                                                                     monkeypatch):
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", onednn_preferred)
    stepped, _plain, _start, orders = _engines(digits, "affine")
    with unittest.mock.patch.object(stepped.optimizer, "step", wraps=stepped.optimizer.step) as update:
        stepped.step(orders[:, :line])
        stepped.step(orders[:, :line + 1])
    within, beyond = (set(call.args[0]) for call in update.call_args_list)
    assert within == set(stepped.params) - set(stepped.stepped) and beyond == set(stepped.params)


def test_without_onednn_every_update_is_the_optimisers(digits):
    stepped, _plain, _start, orders = _engines(digits, "affine")
    with _native.disabled(), \
            unittest.mock.patch.object(stepped.optimizer, "step", wraps=stepped.optimizer.step) as update:
        stepped.step(orders[:, :8])
    assert set(update.call_args.args[0]) == set(stepped.params)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_only_plain_sgd_is_stepped_in_the_backward(digits, optimizer):
    engine = _build(digits, "affine", optimizer=optimizer)
    assert engine.stepped == {}
    with pytest.raises(ValueError, match="only plain SGD"):
        engine.optimizer.sgd_neg_lr(engine.params["1.weight"])


@needs_onednn
def test_a_layer_that_drops_its_step_fails_the_step(digits, monkeypatch):
    # the steps are leaves whose gradient the engine asks for: a layer that ignored its step
    # would leave its weight where it was; autograd refuses instead
    engine = _build(digits, "affine")
    product = batched._column_product
    monkeypatch.setattr(batched, "_column_product", lambda x, weight, bias, step=None: product(x, weight, bias))
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        engine.step(torch.arange(16).reshape(2, 8))

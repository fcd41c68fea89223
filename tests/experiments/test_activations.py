"""The stacked engine's float32 tanh (``affdiv.experiments.runs.activations`` on ``_fused.tanh``)
against the correctly rounded tanh.

Reference (``benchmarks/tanh_accuracy.py``'s ``misrounded``): torch's float64 tanh (within 0.70
ulp of float64 on 19,921 inputs checked against mpmath, a quick measurement) rounded once to
float32, which is the correctly rounded float32 tanh wherever it lies farther than 2⁻⁴⁴ (relative,
about 250 ulps of float64) from the midpoint of two floats; nearer, mpmath decides. The pass
computes each value in double within 1e-15 (its derivation in ``_fused_cpu.c``) and rounds once,
so it must equal the correctly rounded value unless tanh(x) lies within 1e-15 of a midpoint: on
none of the 2³¹ non-negative float32 inputs (``benchmarks/results/cpu_tanh_accuracy.json``). The
suite checks 2²⁵ bit patterns spread over all 2³² and the special values. An error in a
coefficient of the series or in the reduction moves results by far more than that and misrounds
some of them.
"""

from __future__ import annotations

import importlib.util
import unittest.mock
from pathlib import Path

import pytest
import torch

from affdiv.experiments.runs import activations, stacked_matmul
from affdiv.layers import _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused passes are not built here")]

_spec = importlib.util.spec_from_file_location("affdiv_benchmarks_tanh_accuracy",
                                               Path(__file__).resolve().parents[2] / "benchmarks" / "tanh_accuracy.py")
tanh_accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tanh_accuracy)


#: A float32 input whose tanh lies within 2⁻⁴⁴ (relative) of the midpoint of two floats (found by
#: scanning bit patterns from 0x3e000000 with ``misrounded``).
_NEAR_MIDPOINT_INPUT = float.fromhex("0x1.13d76cp-3")


@pytest.fixture(autouse=True)
def _seeded_on_the_pass_route(monkeypatch):
    """Seeded, and on every processor the route that takes the pass (on an Intel processor with
    MKL the engine's tanh is torch's: the tests of that rule set it back)."""
    torch.manual_seed(0)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", True)


def _assert_correctly_rounded(x: torch.Tensor, y: torch.Tensor) -> None:
    for xs, ys in zip(x.flatten().split(1 << 22), y.flatten().split(1 << 22)):  # (the reference's temporaries)
        wrong, _near = tanh_accuracy.misrounded(xs, ys)
        assert not wrong.any(), f"{int(wrong.sum())} not correctly rounded, e.g. tanh({xs[wrong][:3].tolist()})"


def test_the_reference_refuses_a_value_one_float_off_and_accepts_the_rounded_tanh():
    x = torch.tensor([0.3, -1.7, 5.0, float("nan")])
    rounded = torch.tanh(x.double()).float()
    assert not tanh_accuracy.misrounded(x, rounded)[0].any()
    off = torch.nextafter(rounded, torch.tensor(2.0))
    assert tanh_accuracy.misrounded(x, off)[0][:3].all()


def test_the_distance_in_ulps_counts_steps_along_the_floats_across_zero():
    one_up = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    two_up = torch.nextafter(one_up, torch.tensor(2.0))
    tiny = 2.0**-149  # the smallest subnormal
    correct = torch.tensor([1.0, 1.0, 0.0, -0.0, float("nan"), -1.0, tiny, 3.0])
    y = torch.stack([one_up, two_up, torch.tensor(-0.0), torch.tensor(0.0), torch.tensor(float("nan")),
                     torch.tensor(-1.0), torch.tensor(-tiny), torch.tensor(float("nan"))])
    assert tanh_accuracy.ulps_apart(y, correct).tolist() == [1, 2, 0, 0, 0, 0, 2, 2**32]


def test_the_reference_asks_mpmath_near_a_midpoint():
    # float64 alone may not decide it; mpmath does, and the float on the other side of tanh(x) fails
    import mpmath

    x = torch.tensor([_NEAR_MIDPOINT_INPUT])
    y = _fused.tanh(x)
    wrong, near = tanh_accuracy.misrounded(x, y)
    assert near.all() and not wrong.any()
    with mpmath.workprec(160):
        above = mpmath.tanh(mpmath.mpf(_NEAR_MIDPOINT_INPUT)) > mpmath.mpf(float(y))
    other = torch.nextafter(y, torch.tensor(2.0 if above else -2.0))
    assert tanh_accuracy.misrounded(x, other)[0].all()


def test_the_pass_is_the_correctly_rounded_tanh_across_the_float32_bit_patterns():
    # bit patterns i·2654435761 mod 2³² (a permutation of all of them: every bit varies)
    x = tanh_accuracy.as_float32((torch.arange(2**25, dtype=torch.int64) * 2654435761) % 2**32)
    _assert_correctly_rounded(x, _fused.tanh(x))


def test_special_values_and_the_ranges_where_the_computation_changes():
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126,
                             1e-8, 2.0**-12, 20.0, -20.0, 1e30, -3e38, 9.0109, 9.0110])
    # around each switch of the reduction's k (|x| = (j + ½)·ln2/2) and around the clamp and the saturation
    edges = torch.tensor([(j + 0.5) * 0.34657359027997264 for j in range(58)] + [9.010913, 20.0], dtype=torch.float64)
    around = (edges[:, None] + torch.linspace(-1e-5, 1e-5, 2001, dtype=torch.float64)).float().flatten()
    x = torch.cat([specials, around, -around])
    y = _fused.tanh(x)
    _assert_correctly_rounded(x, y)
    ordered = _fused.tanh(torch.sort(around).values)  # (nondecreasing across each switch of k too)
    assert (ordered[1:] >= ordered[:-1]).all()
    assert torch.equal(torch.signbit(y[3:5]), torch.tensor([False, True]))  # ±0 keep their sign
    assert y[0].isnan() and y[1:3].tolist() == [1.0, -1.0]


def test_the_pass_is_odd_and_nondecreasing():
    # (the engine pools before a nondecreasing activation: max(tanh(x)) = tanh(max(x)))
    x = torch.sort(torch.cat([torch.randn(200_000) * 4, torch.rand(10_000) * 1e-3])).values
    y = _fused.tanh(x)
    assert (y[1:] >= y[:-1]).all()
    assert torch.equal(_fused.tanh(-x), -y)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "channels_last", "size one", "empty"])
def test_the_output_keeps_the_inputs_layout(layout):
    base = torch.randn(3, 5, 7, 4)
    x = {"contiguous": base, "transposed": base.transpose(1, 3), "empty": base[:0],
         "size one": base.flatten()[:12].as_strided((3, 1, 4), (4, 999, 1)),  # (any stride on the size-one axis)
         "channels_last": base.contiguous(memory_format=torch.channels_last)}[layout]
    y = _fused.tanh(x)
    assert y.shape == x.shape
    assert [s for n, s in zip(y.shape, y.stride()) if n > 1] == [s for n, s in zip(x.shape, x.stride()) if n > 1]
    _assert_correctly_rounded(x.flatten(), y.flatten())


@pytest.mark.parametrize("x", [torch.randn(4, 6)[:, :3], torch.randn(4, 1).expand(4, 3), torch.randn(5).double(),
                               torch.randn(5).half(), torch._neg_view(torch.randn(5))])
def test_tensors_the_pass_cannot_read_are_refused_in_one_line(x):
    with pytest.raises(ValueError, match=r"^tanh: needs a plain dense float32 CPU tensor, got a Tensor of torch\.\w+"):
        _fused.tanh(x)


def test_two_threads_give_one_threads_numbers():
    x = torch.randn(300_000) * 5
    one = _fused.tanh(x)
    torch.set_num_threads(2)
    try:
        assert torch.equal(_fused.tanh(x), one)
    finally:
        torch.set_num_threads(1)


def test_the_functions_gradients_are_torchs_formula_at_its_output():
    x = (torch.randn(6, 5) * 2).clamp(-2, 2).requires_grad_()
    g = torch.randn(6, 5)
    y = activations.tanh(x)
    assert y.grad_fn.name() == "TanhBackward"  # (the Function, not torch's TanhBackward0)
    gx, = torch.autograd.grad(y, x, g, create_graph=True)
    yd = y.detach()
    # (float32, both sides at the same y: each a few roundings of the same products in another
    # order, a few ulps of each factor; 1 − y², which loses 2|y|²/(1 − y²) ulps of y's last bit
    # if the two sides round y·y differently, 26 at |y| = tanh(2), the inputs' largest: < 2.4e-6)
    torch.testing.assert_close(gx, g * (1 - yd * yd), rtol=1e-5, atol=0)
    ggx, = torch.autograd.grad(gx, x, torch.ones_like(gx))  # d/dx g(1 − y²) = −2 g y (1 − y²)
    torch.testing.assert_close(ggx, -2 * g * yd * (1 - yd * yd), rtol=1e-5, atol=0)
    basis = torch.eye(4)
    v = torch.randn(4, requires_grad=True)
    w = activations.tanh(v)
    batched, = torch.autograd.grad(w, v, basis, is_grads_batched=True)
    torch.testing.assert_close(batched, torch.diag(1 - w.detach() ** 2), rtol=1e-5, atol=0)


def test_where_mkl_runs_on_an_intel_processor_the_tanh_is_torchs_bit_for_bit(monkeypatch):
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", False)
    x = torch.randn(64, 33) * 4
    with unittest.mock.patch.object(activations.Tanh, "apply", side_effect=AssertionError("the pass ran")):
        assert torch.equal(activations.tanh(x), torch.tanh(x))


def test_calls_the_pass_cannot_serve_take_torchs_tanh():
    x = torch.randn(3, 4)
    with unittest.mock.patch.object(activations.Tanh, "apply", side_effect=AssertionError("the pass ran")):
        for dtype in (torch.float64, torch.bfloat16):
            assert torch.equal(activations.tanh(x.to(dtype)), torch.tanh(x.to(dtype)))
        assert torch.equal(activations.tanh(x[:, :2]), torch.tanh(x[:, :2]))  # not dense
        negated = torch._neg_view(x)  # (dense, its storage the values before the negation)
        assert torch.equal(activations.tanh(negated), torch.tanh(negated))
        assert torch.equal(torch.func.vmap(activations.tanh)(x), torch.tanh(x))
        ones = torch.ones_like(x)
        tangents = [torch.func.jvp(f, (x,), (ones,))[1] for f in (activations.tanh, torch.tanh)]
        assert torch.equal(*tangents)
        with _fused.disabled():
            assert torch.equal(activations.tanh(x), torch.tanh(x))


@pytest.mark.parametrize("onednn_preferred, calls", [(True, 2), (False, 0)], ids=["pass", "MKL on Intel"])
def test_the_stacked_engine_takes_the_pass_for_float32_tanh_but_with_mkl_on_intel_and_trains_as_one_model_alone(
        digits, onednn_preferred, calls, monkeypatch):
    # (where torch's BLAS is MKL on an Intel processor, torch's tanh is MKL's own code: no pass)
    monkeypatch.setattr(stacked_matmul, "ONEDNN_PREFERRED", onednn_preferred)
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.training import build_member, stacked_engine

    config = RunConfig(dataset="digits", method="affine", depth=2, width=16, batch_size=8, seed=0, activation="tanh")
    models = [build_member(config, digits, seed) for seed in (0, 1)]
    alone = [build_member(config, digits, seed) for seed in (0, 1)]
    split = (torch.as_tensor(digits.train.x), torch.as_tensor(digits.train.y))
    engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
    batch = torch.stack([torch.arange(8), torch.arange(8, 16)])
    with unittest.mock.patch.object(activations.Tanh, "apply", wraps=activations.Tanh.apply) as applied:
        losses = engine.step(batch)
    assert applied.call_count == calls  # the two hidden layers' tanh, or none
    for k, (model, lr) in enumerate(zip(alone, (0.1, 0.2))):
        loss = torch.nn.functional.cross_entropy(model(split[0][batch[k]]), split[1][batch[k]])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        # float32: the products' order of summation and tanh's last bit (torch's float32 tanh is not
        # correctly rounded everywhere) differ; a few float32 roundings of each quantity
        torch.testing.assert_close(losses[k], loss.detach(), rtol=1e-6, atol=0)
        for name, p in model.named_parameters():
            torch.testing.assert_close(engine.params[name][k], p.detach(), rtol=1e-5, atol=1e-6)

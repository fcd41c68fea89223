"""The stacked CNN's fused 2×2 max-pool and ReLU (``affdiv.experiments.runs.pool_relu``) against
torch's ``max_pool2d`` and ``relu`` on the same channels-last tensors.

The passes only compare and move values, so the reference is exact: outputs and gradients equal
torch's bit for bit (NaN where torch's are NaN, and the sign of every zero), on inputs drawn from
a few integers so that windows tie, with −0 and NaN among them.
"""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import pool_relu
from affdiv.experiments.runs.batched import BatchedEnsemble, batched_layers
from affdiv.experiments.runs.models import build_model
from affdiv.layers import _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused CPU passes were not built")]


def reference(x: torch.Tensor, relu: bool) -> torch.Tensor:
    y = F.max_pool2d(x, 2)
    return F.relu(y) if relu else y


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN at the same places, the same sign of every zero."""
    return (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
            and torch.equal(a.signbit(), b.signbit()))


def sprinkled(shape, dtype, generator, values=(-2.0, -1.0, -0.0, 0.0, 1.0, 2.0)) -> torch.Tensor:
    """Values from a few numbers (ties in most windows), about 1 in 16 a NaN, channels_last."""
    pick = torch.randint(len(values), shape, generator=generator)
    t = torch.tensor(values, dtype=dtype)[pick]
    t[torch.rand(shape, generator=generator) < 1 / 16] = float("nan")
    return t.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(batch=st.integers(1, 3), channels=st.integers(1, 20), h=st.integers(2, 9), w=st.integers(2, 9),
       relu=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_the_pass_is_torchs_pool_and_relu_bit_for_bit(dtype, batch, channels, h, w, relu, seed):
    # channels 1-20: whole and partial vectors (8 float32 or 4 float64 lanes); odd sizes drop a row or column
    g = torch.Generator().manual_seed(seed)
    x = sprinkled((batch, channels, h, w), dtype, g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = pool_relu.max_pool_relu(x1, relu), reference(x2, relu)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    assert identical(got, want)
    grad = sprinkled(want.shape, dtype, g, values=(-1.5, 0.5, 3.0))
    got.backward(grad)
    want.backward(grad)
    assert identical(x1.grad, x2.grad) and x1.grad.is_contiguous(memory_format=torch.channels_last)


def test_gradcheck():
    x = torch.randn(2, 5, 6, 7, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    for relu in (False, True):
        assert torch.autograd.gradcheck(lambda t, relu=relu: pool_relu.max_pool_relu(t, relu),
                                        (x.clone().requires_grad_(),))


def test_the_pass_keeps_no_positions_without_a_gradient(monkeypatch):
    kept = []
    real = _fused.max_pool2
    monkeypatch.setattr(_fused, "max_pool2", lambda x, relu, keep_which: kept.append(keep_which)
                        or real(x, relu, keep_which))
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    pool_relu.max_pool_relu(x, True)
    pool_relu.max_pool_relu(x.requires_grad_(), True).sum().backward()
    assert kept == [False, True]


def test_the_numbers_do_not_depend_on_the_thread_count():
    x = torch.randn(64, 48, 14, 14, generator=torch.Generator().manual_seed(2))  # enough for two threads
    x = x.contiguous(memory_format=torch.channels_last)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            t = x.clone().requires_grad_()
            y = pool_relu.max_pool_relu(t, True)
            y.backward(torch.ones_like(y))
            results.append((y, t.grad))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(one, two) for one, two in zip(*results))


@pytest.mark.parametrize("pool, two_by_two", [
    (nn.MaxPool2d(2), True),
    (nn.MaxPool2d((2, 2), stride=2), True),
    (nn.MaxPool2d(2, stride=1), False),
    (nn.MaxPool2d(3), False),
    (nn.MaxPool2d(2, padding=1), False),
    (nn.MaxPool2d(2, dilation=2), False),
    (nn.MaxPool2d(2, ceil_mode=True), False),
    (nn.MaxPool2d(2, return_indices=True), False),
    (nn.AvgPool2d(2), False),
])
def test_which_pools_fuse(pool, two_by_two):
    assert pool_relu.is_pool_2x2(pool) is two_by_two


def test_calls_the_pass_cannot_take_are_refused():
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    assert pool_relu.usable(x) and pool_relu.usable(x.double()) and pool_relu.usable(x.requires_grad_())
    x = x.detach()
    assert not pool_relu.usable(x.contiguous())  # NCHW
    assert not pool_relu.usable(x.half())
    assert not pool_relu.usable(x[0])  # 3-D
    assert not pool_relu.usable(x[..., :1])  # no pooled column (torch raises)
    assert not pool_relu.usable(x[..., :1, :])
    assert pool_relu.usable(x[..., :2, :2].contiguous(memory_format=torch.channels_last))
    with unittest.mock.patch.object(_fused, "is_compiling", return_value=True):  # traced: torch ops
        assert not pool_relu.usable(x)
    with _fused.disabled():
        assert not pool_relu.usable(x)
    with FlopCounterMode(display=False):  # a dispatch mode would not see the pass
        assert not pool_relu.usable(x)
    with torch.autograd.forward_ad.dual_level():  # forward mode: the pass has no tangents
        assert not pool_relu.usable(x)


@pytest.mark.parametrize("method, activation, relu", [
    ("conv", "relu", True), ("conv+batchnorm", "relu", True), ("patchnorm", "tanh", False)])
def test_the_batched_cnn_runs_its_later_pools_as_the_pass(method, activation, relu, monkeypatch):
    models = [build_model(method, input_shape=(1, 8, 8), num_classes=10, depth=2, width=4, activation=activation)
              for _ in range(3)]
    pooled = [module for _name, module, _layer in batched_layers(models[0])
              if pool_relu.is_pool_2x2(module) or (type(module) is nn.Sequential and pool_relu.is_pool_2x2(module[0]))]
    assert [type(module) is nn.Sequential for module in pooled][-1] is relu  # with its ReLU or alone
    calls = []
    real = _fused.max_pool2
    monkeypatch.setattr(_fused, "max_pool2",
                        lambda x, r, keep_which: calls.append((r, keep_which)) or real(x, r, keep_which))
    data = torch.rand(20, 1, 8, 8), torch.randint(0, 10, (20,))
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 3, [None] * 3, [data] * 3, [data] * 3)
    ensemble.step(torch.arange(12).view(3, 4))
    ensemble.evaluate()
    half = len(calls) // 2  # a step keeps the positions, a check (as many pools) not
    assert calls and calls == [(relu, True)] * half + [(relu, False)] * half
    calls.clear()
    with _fused.disabled():
        ensemble.step(torch.arange(12).view(3, 4))
    assert calls == []


def test_a_value_the_relu_stops_keeps_no_window_position():
    # (the C passes' POOL_NO_GRADIENT: no window position, so no element of the input gets its g)
    x = torch.tensor([[[[-1.0, -2.0], [-3.0, 0.0]]], [[[1.0, 2.0], [3.0, 4.0]]]]).contiguous(
        memory_format=torch.channels_last)
    out, which = _fused.max_pool2(x, True, keep_which=True)
    assert which.flatten().tolist() == [_fused.POOL_NO_GRADIENT, 3] and out.flatten().tolist() == [0.0, 4.0]
    _out, which = _fused.max_pool2(x, False, keep_which=True)
    assert which.flatten().tolist() == [3, 3]  # without the ReLU: the maximum's position, 0 at (1, 1)

"""The stacked CNN's fused first block (``affdiv.experiments.runs.conv_pool``) against the same
block written with torch's own convolution, PatchNorm scale and max-pool, model by model.

Tolerances are error bounds. A convolution output is a sum of kh·kw + 1 terms (taps and bias), so
each implementation's rounding error is at most γ_{kh·kw+1} · (|b| + |W| ⋆ |x|) (γ_n = n·u/(1 − n·u),
u the unit roundoff), and PatchNorm's r = 1/√(Σ x² + 1) adds a relative error of at most
γ_{kh·kw+3}; a pooled value is one of its window's outputs, so the max over the window of that
bound bounds it, and the two implementations differ by at most twice it. A weight or bias gradient
is a sum over the B·H_p·W_p pooled values, at most γ_{B·H_p·W_p + kh·kw + 3} · Σ |g|·r·|x| in each
(r's own error included); the bound is evaluated by the reference's own backward on |g| and |x|.
Random float64 data make two of a window's outputs within rounding of each other (where the
maximum could sit elsewhere) a probability-1e-13 event; exact ties are tested on their own. A ReLU
after the pool moves no value by more than its input's difference (it is 1-Lipschitz), and where
it passes no gradient both implementations drop the same terms (a pooled value within rounding of
0 is the same rare event).
"""

from __future__ import annotations

import itertools
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import conv_pool
from affdiv.experiments.runs.batched import BatchedEnsemble, batched_layers
from affdiv.experiments.runs.models import build_model
from affdiv.layers import PatchNormConv2d, _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused CPU passes were not built")]


def gamma(n: int, dtype: torch.dtype) -> float:
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


def reference(x, weight, bias, padding, patchnorm, relu=False):
    """The block model by model with torch ops: x (K, B, 1, H, W) -> (B, K·C, H_p, W_p)."""
    outs = []
    for k in range(x.shape[0]):
        z = F.conv2d(x[k], weight[k], None if bias is None else bias[k], padding=padding)
        if patchnorm:
            ones = torch.ones_like(weight[k][:1])
            z = z * (F.conv2d(x[k].square(), ones, padding=padding) + 1).rsqrt()
        outs.append(F.max_pool2d(z, 2))
    out = torch.cat(outs, 1)
    return F.relu(out) if relu else out


def leaves(weight, bias):
    return weight.clone().requires_grad_(), None if bias is None else bias.clone().requires_grad_()


@st.composite
def blocks(draw):
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    ph, pw = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    # at least one pooled row and column: a conv output of 2 or more
    h, w = draw(st.integers(max(1, kh + 1 - 2 * ph), 13)), draw(st.integers(max(1, kw + 1 - 2 * pw), 13))
    return dict(models=draw(st.integers(1, 4)), batch=draw(st.integers(1, 4)), channels=draw(st.integers(1, 11)),
                size=(h, w), kernel=(kh, kw), padding=(ph, pw), bias=draw(st.booleans()),
                patchnorm=draw(st.booleans()), relu=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def draw_block(b, dtype):
    g = torch.Generator().manual_seed(b["seed"])
    k, c = b["models"], b["channels"]
    x = torch.randn(k, b["batch"], 1, *b["size"], generator=g, dtype=dtype)
    weight = torch.randn(k, c, 1, *b["kernel"], generator=g, dtype=dtype)
    bias = torch.randn(k, c, generator=g, dtype=dtype) if b["bias"] else None
    return x, weight, bias


def forward_bound(x, weight, bias, padding, patchnorm):
    """max over each window of γ·(|b| + |W| ⋆ |x|)·r (the sum, the product with r and r's own
    error), elementwise like the output."""
    taps = weight.shape[-1] * weight.shape[-2]
    size = reference(x.abs(), weight.abs(), None if bias is None else bias.abs(), padding, patchnorm)
    return (gamma(taps + 2, x.dtype) + (gamma(taps + 3, x.dtype) if patchnorm else 0)) * size


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@given(block=blocks())
def test_the_pass_is_the_block_model_by_model(block, dtype):
    x, weight, bias = draw_block(block, dtype)
    pad, norm, relu = block["padding"], block["patchnorm"], block["relu"]
    w1, b1 = leaves(weight, bias)
    got = conv_pool.conv_max_pool(x, w1, b1, pad, norm, relu)
    w2, b2 = leaves(weight, bias)
    want = reference(x, w2, b2, pad, norm, relu)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    assert ((got - want).abs() <= 2 * forward_bound(x, weight, bias, pad, norm)).all()
    if dtype != torch.float64:  # (in float32 a window's near-tie within rounding is not rare: see above)
        return
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(block["seed"] + 1), dtype=dtype)
    got.backward(g)
    want.backward(g)
    terms = g.shape[0] * g.shape[2] * g.shape[3] + weight.shape[-1] * weight.shape[-2] + 3
    dw_size, db_size = unpooled_abs_grads(x, weight, bias, g, pad, norm)
    assert ((w1.grad - w2.grad).abs() <= 2 * gamma(terms, dtype) * dw_size).all()
    if bias is not None:
        assert ((b1.grad - b2.grad).abs() <= 2 * gamma(terms, dtype) * db_size).all()


def unpooled_abs_grads(x, weight, bias, g, padding, patchnorm):
    """Σ over every window position of |g|·r·|x|: the pooled gradient spread to all four outputs
    of its window, through the convolution's backward on absolute values (an upper bound on the
    sum either implementation forms, whichever position holds each maximum)."""
    models, channels = weight.shape[:2]
    spread = g.abs().repeat_interleave(2, 2).repeat_interleave(2, 3)  # (B, K·C, 2H_p, 2W_p)
    dw, db = [], []
    for k in range(models):
        w = weight[k].detach().abs().requires_grad_()
        b = None if bias is None else torch.zeros(channels, dtype=x.dtype, requires_grad=True)
        z = F.conv2d(x[k].abs(), w, b, padding=padding)
        if patchnorm:
            z = z * (F.conv2d(x[k].square(), torch.ones_like(w[:1]), padding=padding) + 1).rsqrt()
        part = spread[:, k * channels:(k + 1) * channels]
        z[:, :, :part.shape[2], :part.shape[3]].backward(part)
        dw.append(w.grad)
        db.append(None if b is None else b.grad)
    return torch.stack(dw), None if bias is None else torch.stack(db)


def test_gradcheck():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 1, 7, 6, generator=g, dtype=torch.float64)
    for patchnorm in (False, True):
        weight = torch.randn(2, 3, 1, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda w, b, norm=patchnorm: conv_pool.conv_max_pool(x, w, b, (1, 1), norm),
                                        (weight, bias))


def test_a_tied_window_takes_its_first_maximum_as_max_pool2d():
    # Only the centre tap is non-zero, so a window's outputs tie where their centres do; the
    # other taps' gradients then depend on which position holds the maximum (the first, in row
    # order). Every window's centres at (0, 0) and (1, 1) are equal and the largest.
    dtype = torch.float64
    x = torch.rand(1, 2, 1, 8, 8, dtype=dtype, generator=torch.Generator().manual_seed(0))
    x[..., 1::2, 1::2] = x[..., 0::2, 0::2] = 2.0 + torch.arange(16, dtype=dtype).view(4, 4)
    weight = torch.zeros(1, 5, 1, 3, 3, dtype=dtype)  # (5 channels: a vector of 4 and one on its own)
    weight[..., 1, 1] = torch.arange(1.0, 6.0, dtype=dtype).view(5, 1)
    z = F.conv2d(x[0], weight[0], padding=1)
    assert torch.equal(z[..., 0::2, 0::2], z[..., 1::2, 1::2])  # the tie is exact
    w1, _ = leaves(weight, None)
    w2, _ = leaves(weight, None)
    got, want = conv_pool.conv_max_pool(x, w1, None, (1, 1)), reference(x, w2, None, (1, 1), False)
    assert torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype, channels", [(torch.float64, 5), (torch.float32, 9)])  # a whole vector, a partial one
@pytest.mark.parametrize("patchnorm", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_a_nan_pools_and_propagates_as_the_unfused_block(dtype, channels, patchnorm, relu):
    # max_pool2d takes a window's NaN; the convolution's weight gradient then sums g·x over every
    # window position, with g = 0 off the maximum, so 0·NaN spreads the NaN to every tap of a
    # channel whose windows read it: the pass must give the same pattern in whole and partial vectors.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 1, 6, 6, dtype=dtype, generator=g)
    x[1, 2, 0, 3, 4] = float("nan")
    weight = torch.randn(2, channels, 1, 3, 3, dtype=dtype, generator=g)
    bias = torch.randn(2, channels, dtype=dtype, generator=g)
    w1, b1 = leaves(weight, bias)
    w2, b2 = leaves(weight, bias)
    got = conv_pool.conv_max_pool(x, w1, b1, (1, 1), patchnorm, relu)
    want = reference(x, w2, b2, (1, 1), patchnorm, relu)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True)
    got.sum().backward()
    want.sum().backward()
    assert w1.grad.isnan().any()  # (the bias too under PatchNorm, whose r is NaN there)
    for mine, theirs in ((w1.grad, w2.grad), (b1.grad, b2.grad)):
        assert torch.equal(mine.isnan(), theirs.isnan())
        torch.testing.assert_close(mine, theirs, equal_nan=True)


def test_a_nan_only_a_dropped_convolution_output_reads_stays_out_of_the_gradients():
    # An odd convolution output: max_pool2d drops its last row, and the pass never computes that
    # row. torch's convolution backward still multiplies the row's zero gradient by the input
    # there, so a NaN that only the dropped row reads makes its weight gradients NaN; the pass's
    # stay finite (the one place their NaNs differ).
    x = torch.randn(1, 2, 1, 7, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x[0, 1, 0, 6, 3] = float("nan")  # read only by the convolution's output row 4, of 0-4
    weight = torch.randn(1, 5, 1, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    w1, _ = leaves(weight, None)
    w2, _ = leaves(weight, None)
    got, want = conv_pool.conv_max_pool(x, w1, None, (0, 0)), reference(x, w2, None, (0, 0), False)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    got.sum().backward()
    want.sum().backward()
    assert w1.grad.isfinite().all() and w2.grad.isnan().any()


def test_only_a_models_first_two_layers_fuse():
    model = torch.nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(1, 4, 3, padding=1),
                                nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3))
    entries = batched_layers(model)
    assert [name for name, _m, _l in entries] == ["0", "2", "3", "4", "5"]
    assert type(entries[0][1]) is nn.Sequential and type(entries[1][1]) is nn.Conv2d


def test_the_rows_are_whole_vectors_of_the_c_pass():
    # (its vectors are 32 bytes: 8 float32 or 4 float64 lanes; a narrower row would be read past)
    for channels, f32, f64 in [(1, 8, 4), (4, 8, 4), (5, 8, 8), (8, 8, 8), (9, 16, 12), (17, 24, 20)]:
        assert _fused.conv_pool_width(channels, torch.float32) == f32
        assert _fused.conv_pool_width(channels, torch.float64) == f64
    xp, wt = torch.zeros(2, 3, 6, 6), torch.zeros(2, 9, 4)  # 4 channels: rows of 8 wanted
    with pytest.raises(ValueError, match=r"wt must be \(2, 9, 8\)"):
        _fused.conv_pool(xp, wt, None, 4, (3, 3), False, keep_argmax=False)


def test_the_backward_pass_refuses_a_kernel_over_its_taps():
    # (the C pass's per-tap accumulators: conv_pool.usable keeps such kernels off it)
    taps = _fused.CONV_POOL_MAX_TAPS
    xp = torch.randn(1, 2, 3, taps + 2)
    g = torch.randn(2, 3, 1, 1).contiguous(memory_format=torch.channels_last)
    argmax = torch.zeros(2, 1, 1, 3, dtype=torch.uint8)
    width = _fused.conv_pool_width(3, xp.dtype)  # (rows of whole vectors)
    assert _fused.conv_pool_backward(xp, g, argmax, (1, taps), False, True)[0].shape == (1, taps, width)
    with pytest.raises(ValueError, match=f"at most {taps} taps"):
        _fused.conv_pool_backward(xp, g, argmax, (1, taps + 1), False, True)


def test_patchnorm_scales_that_cannot_be_allocated_are_refused_before_any_work(monkeypatch):
    # The C passes allocate PatchNorm's scales first: an impossible size returns -2 with nothing
    # read (null data), and the wrappers raise. 2^50 models' rows of scales (2^57.8 bytes), or
    # 2^50 samples' windows (2^61.6), lie beyond a 57-bit address space (five-level paging) and
    # so beyond what any overcommit can grant; one channel keeps the passes' own size arithmetic
    # within int64.
    huge = 2**50
    assert _fused._call("conv_pool", torch.float32)(
        None, huge, 1, 1, 30, 30, 3, 3, None, None, 1, 0, None, None, 1) == -2
    assert _fused._call("conv_pool_backward", torch.float32)(
        None, None, None, 1, huge, 1, 30, 30, 3, 3, 1, None, None, 1) == -2
    xp, wt = torch.randn(1, 2, 6, 6), torch.zeros(1, 9, _fused.conv_pool_width(3, torch.float32))
    g = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    argmax = torch.zeros(2, 2, 2, 3, dtype=torch.uint8)
    for name in ("conv_pool", "conv_pool_backward"):
        monkeypatch.setattr(_fused, "_call", lambda *_args: lambda *_a: -2)
        with pytest.raises(MemoryError, match="could not allocate PatchNorm's scales"):
            if name == "conv_pool":
                _fused.conv_pool(xp, wt, None, 3, (3, 3), True, False)
            else:
                _fused.conv_pool_backward(xp, g, argmax, (3, 3), True, False)


def test_the_pass_keeps_no_positions_without_a_gradient(monkeypatch):
    kept = []
    real = _fused.conv_pool
    monkeypatch.setattr(_fused, "conv_pool", lambda *a, keep_argmax, relu: kept.append(keep_argmax)
                        or real(*a, keep_argmax=keep_argmax, relu=relu))
    x, weight = torch.randn(1, 2, 1, 4, 4), torch.randn(1, 3, 1, 3, 3)
    conv_pool.conv_max_pool(x, weight, None, (1, 1))
    conv_pool.conv_max_pool(x, weight.requires_grad_(), None, (1, 1)).sum().backward()
    assert kept == [False, True]


@pytest.mark.parametrize("conv, pool, fused", [
    (nn.Conv2d(1, 4, 3, padding=1), nn.MaxPool2d(2), True),
    (PatchNormConv2d(1, 4, 3, padding=1), nn.MaxPool2d(2, 2), True),
    (nn.Conv2d(1, 4, 7, padding=(3, 2)), nn.MaxPool2d((2, 2)), True),
    (nn.Conv2d(2, 4, 3), nn.MaxPool2d(2), False),  # two input channels
    (nn.Conv2d(1, 4, 3, stride=2), nn.MaxPool2d(2), False),
    (nn.Conv2d(1, 4, 3, dilation=2), nn.MaxPool2d(2), False),
    (nn.Conv2d(1, 4, 3, padding="same"), nn.MaxPool2d(2), False),
    (nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"), nn.MaxPool2d(2), False),
    (nn.Conv2d(1, 4, 8), nn.MaxPool2d(2), False),  # 64 taps
    (nn.Conv2d(1, 4, 3), nn.MaxPool2d(3), False),
    (nn.Conv2d(1, 4, 3), nn.MaxPool2d(2, stride=1), False),
    (nn.Conv2d(1, 4, 3), nn.MaxPool2d(2, padding=1), False),
    (nn.Conv2d(1, 4, 3), nn.MaxPool2d(2, ceil_mode=True), False),
    (nn.Conv2d(1, 4, 3), nn.AvgPool2d(2), False),
    (nn.Conv2d(1, 4, 3), nn.ReLU(), False),
])
def test_which_blocks_fuse(conv, pool, fused):
    assert conv_pool.fusable(conv, pool) is fused


def test_calls_the_pass_cannot_take_are_refused():
    x, weight, bias, pad = torch.randn(2, 3, 1, 6, 6), torch.randn(2, 4, 1, 3, 3), torch.randn(2, 4), (1, 1)
    assert conv_pool.usable(x, weight, bias, pad)
    assert not conv_pool.usable(x.requires_grad_(), weight, None, pad)  # an input gradient: not computed
    x = x.detach()
    assert not conv_pool.usable(x.half(), weight.half(), None, pad)
    assert not conv_pool.usable(x.double(), weight, None, pad)  # mixed dtypes
    assert not conv_pool.usable(x[:, :, 0], weight, None, pad)  # not (K, B, 1, H, W)
    assert not conv_pool.usable(torch.randn(2, 3, 2, 6, 6), weight, None, pad)
    assert not conv_pool.usable(x, weight[:1], None, pad)  # other numbers of models
    assert conv_pool.usable(x, weight[:, :, :, :1], None, pad)  # a 1×3 kernel
    assert not conv_pool.usable(x, weight, bias[:, :3], pad)  # a bias of other channels
    assert not conv_pool.usable(x, torch.randn(2, 4, 1, 7, 8), None, (3, 3))  # 56 taps
    assert conv_pool.usable(x, torch.randn(2, 4, 1, 7, 7), None, (3, 3))
    assert not conv_pool.usable(x[..., :3, :], weight, None, (0, 0))  # one conv row: no pooled row
    assert conv_pool.usable(x[..., :4, :], weight, None, (0, 0))  # two conv rows: one pooled row
    assert not conv_pool.usable(x[..., :3], weight, None, (0, 0))  # the same for columns
    assert conv_pool.usable(x[..., :4], weight, None, (0, 0))
    assert not conv_pool.usable(x, weight[:, :, 0], None, pad)  # no weight (K, C, 1, kh, kw)
    assert not conv_pool.usable(x, torch.randn(2, 4, 2, 3, 3), None, pad)
    with unittest.mock.patch.object(_fused, "is_compiling", return_value=True):  # traced: torch ops
        assert not conv_pool.usable(x, weight, None, pad)
    with _fused.disabled():
        assert not conv_pool.usable(x, weight, None, pad)
    with FlopCounterMode(display=False):  # a dispatch mode would not see the pass
        assert not conv_pool.usable(x, weight, None, pad)
    with torch.autograd.forward_ad.dual_level():  # forward mode: the pass has no tangents
        assert not conv_pool.usable(x, weight, None, pad)


@pytest.mark.parametrize("method, names", [
    ("conv", ["0", "3", "5", "6", "7", "8"]),  # conv 0, pool 2 and relu 1 as one; pool 5 and relu 4
    ("patchnorm", ["0", "3", "5", "6", "7", "8"]),
    ("conv+batchnorm", [("0", "1"), "4", "5", "7", "8", "9", "10"]),  # conv 0, its BatchNorm 1, pool 3 and ReLU 2
])
def test_the_batched_cnn_runs_its_first_block_as_the_pass(method, names, monkeypatch):
    models = [build_model(method, input_shape=(1, 8, 8), num_classes=10, depth=2, width=4, activation="relu")
              for _ in range(3)]
    assert [name for name, _module, _layer in batched_layers(models[0])] == names
    calls = []
    real = _fused.conv_pool
    monkeypatch.setattr(_fused, "conv_pool", lambda *a, **kw: calls.append(kw["keep_argmax"]) or real(*a, **kw))
    data = torch.rand(20, 1, 8, 8), torch.randint(0, 10, (20,))
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 3, [None] * 3, [data] * 3, [data] * 3)
    tracked = {key: t.clone() for key, t in ensemble.buffers.items() if key.endswith("num_batches_tracked")}
    ensemble.step(torch.arange(12).view(3, 4))
    assert all(torch.equal(ensemble.buffers[key], t + 1) for key, t in tracked.items())  # (each BatchNorm once)
    ensemble.evaluate()
    assert calls == [True, False]  # a step keeps the maxima, a check not
    calls.clear()
    with _fused.disabled():
        ensemble.step(torch.arange(12).view(3, 4))
    assert calls == []


def test_the_numbers_do_not_depend_on_the_thread_count():
    # Each pooled value is one thread's, and each model's gradients are summed by one thread in a
    # fixed order: bit for bit the same on 1 and 2 threads.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 9, 1, 12, 10, generator=g)
    weight = torch.randn(3, 11, 1, 3, 3, generator=g)
    bias = torch.randn(3, 11, generator=g)
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            w, b = leaves(weight, bias)
            y = conv_pool.conv_max_pool(x, w, b, (1, 1), True)
            y.backward(torch.ones_like(y))
            results.append((y, w.grad, b.grad))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(one, two) for one, two in zip(*results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels, kernel, patchnorm, relu", [(8, 3, False, True), (13, 3, True, False),
                                                                (32, 3, False, False), (11, 5, False, True)])
def test_the_generic_build_gives_the_same_numbers_bit_for_bit(generic_library, monkeypatch, dtype, channels, kernel,
                                                               patchnorm, relu):
    # The build as made narrows the window positions to bytes by one shuffle and takes a 3 × 3
    # kernel with its size as constants; the generic build (a conversion lane by lane, the size a
    # variable) sums the same terms in the same order: the same outputs, positions and gradients,
    # bit for bit, over whole and partial blocks of channels, with and without PatchNorm's scales
    g = torch.Generator().manual_seed(channels + kernel)
    x = torch.randn(3, 5, 1, 14, 13, generator=g, dtype=dtype)
    x[0, 1, 0, 3, 4] = float("nan")  # (a NaN window: its position is the last NaN's)
    weight = torch.randn(3, channels, 1, kernel, kernel, generator=g, dtype=dtype)
    bias = torch.randn(3, channels, generator=g, dtype=dtype)
    xp = conv_pool._pass_input(x, (kernel // 2, kernel // 2))
    wt, flat_bias = conv_pool._pass_parameters(weight, bias, dtype)

    def passes():
        out, argmax = _fused.conv_pool(xp, wt, flat_bias, channels, (kernel, kernel), patchnorm, keep_argmax=True,
                                       relu=relu)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        dw, db = _fused.conv_pool_backward(xp, grad.contiguous(memory_format=torch.channels_last), argmax,
                                           (kernel, kernel), patchnorm, True)
        return out, argmax, dw, db

    as_built = passes()
    monkeypatch.setattr(_fused, "_LIB", generic_library)
    generic = passes()
    for a, b in zip(as_built, generic):  # (equal, NaN where NaN)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert int(as_built[1].max()) <= _fused.POOL_NO_GRADIENT and torch.isnan(as_built[0]).any()


# ----------------------------------------------------------------------------- with a BatchNorm2d

# The block conv → BatchNorm2d → max-pool (→ ReLU) against torch's layers model by model. The pass
# takes the batch's mean and variance of each channel's z = w·patch + b from the patches' sum p and
# Gram matrix G (float64): var = (wᵀGw + 2b w·p)/N + b² − mean², which loses to cancellation a
# relative γ_n·(1 + mean²/var) (n = N·taps terms) where torch's two-pass variance loses γ_n; every
# value compared is then a sum of at most n terms in either implementation. So the bound is
# 4·γ_n·κ·(1 + mean²/var) of the compared tensor's scale, with κ = 10² bounding the cancellation
# inside the sums (the stacked tests' convention); measured differences are 1e-16 to 1e-15
# relative in float64.


def reference_batch_norm(x, weight, bias, bn, padding, momentum, eps, training, relu):
    """The block model by model with torch's own layers: conv2d, batch_norm, max_pool2d, relu."""
    outs = []
    for k in range(x.shape[0]):
        z = F.conv2d(x[k], weight[k], None if bias is None else bias[k], padding=padding)
        y = F.max_pool2d(F.batch_norm(z, bn["running_mean"][k], bn["running_var"][k], bn["weight"][k],
                                      bn["bias"][k], training, momentum, eps), 2)
        outs.append(F.relu(y) if relu else y)
    return torch.cat(outs, 1)


def draw_batch_norm(b, dtype):
    g = torch.Generator().manual_seed(b["seed"] + 7)
    k, c = b["models"], b["channels"]
    x, weight, bias = draw_block(b, dtype)
    x = x + torch.rand(k, 1, 1, 1, 1, generator=g, dtype=dtype)  # (a mean: mean²/var of order 1)
    bn = dict(weight=torch.randn(k, c, generator=g, dtype=dtype), bias=torch.randn(k, c, generator=g, dtype=dtype),
              running_mean=torch.randn(k, c, generator=g, dtype=dtype),
              running_var=torch.rand(k, c, generator=g, dtype=dtype) + 0.5)
    return x, weight, bias, bn


def batch_norm_tolerance(x, weight, bias, padding, dtype):
    """4·γ_n·κ·max(1 + mean²/var) over the channels of the batch (see above)."""
    z = torch.cat([F.conv2d(x[k], weight[k], None if bias is None else bias[k], padding=padding)
                   for k in range(x.shape[0])], 1).double()
    mean, var = z.mean((0, 2, 3)), z.var((0, 2, 3), unbiased=False)
    n = z.shape[0] * z.shape[2] * z.shape[3] * weight.shape[-1] * weight.shape[-2]
    return 4 * gamma(n, dtype) * 100 * float((1 + mean.square() / var).max())


@given(block=blocks(), training=st.booleans())
def test_the_batch_norm_pass_is_the_block_model_by_model(block, training):
    dtype, pad, relu = torch.float64, block["padding"], block["relu"]
    x, weight, bias, bn = draw_batch_norm(block, dtype)
    if training and x.shape[1] * (x.shape[3] + 2 * pad[0] - weight.shape[3] + 1) \
            * (x.shape[4] + 2 * pad[1] - weight.shape[4] + 1) < 2:
        return  # (one value per channel: torch refuses to normalise it)
    tol = batch_norm_tolerance(x, weight, bias, pad, dtype)
    mine = {key: t.clone() for key, t in bn.items()}
    theirs = {key: t.clone() for key, t in bn.items()}
    for state in (mine, theirs):
        state["weight"].requires_grad_()
        state["bias"].requires_grad_()
    w1, b1 = leaves(weight, bias)
    w2, b2 = leaves(weight, bias)
    got = conv_pool.conv_batch_norm_max_pool(x, w1, b1, mine, pad, 0.1, 1e-5, training, relu)
    want = reference_batch_norm(x, w2, b2, theirs, pad, 0.1, 1e-5, training, relu)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    scale = float(want.detach().abs().max()) + float(bn["weight"].abs().max()) + float(bn["bias"].abs().max())
    assert float((got - want).detach().abs().max()) <= tol * scale
    for key in ("running_mean", "running_var"):  # updated in place when training, untouched otherwise
        assert float((mine[key] - theirs[key]).abs().max()) <= tol * float(theirs[key].abs().max())
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(block["seed"] + 1), dtype=dtype)
    got.backward(g)
    want.backward(g)
    pairs = [(w1.grad, w2.grad), (mine["weight"].grad, theirs["weight"].grad),
             (mine["bias"].grad, theirs["bias"].grad)]
    if bias is not None:
        pairs.append((b1.grad, b2.grad))
        if training:  # BatchNorm removes the bias: its gradient is 0, exactly here, within rounding there
            assert torch.equal(b1.grad, torch.zeros_like(b1.grad))
    # Each gradient is a sum of terms a·dy·x̃, a·(Σdy/N)·x̃ and a·x̂·(Σdy·x̂/N)·x̃ (or dy·x̂, dy): their
    # absolute values sum to at most Σ|g|·(1 + max|x̃|)·(1 + max a)·(2 + max|x̂|), the scale the
    # rounding is relative to (a gradient near 0 is a sum that cancelled).
    z = torch.cat([F.conv2d(x[k], weight[k], None if bias is None else bias[k], padding=pad)
                   for k in range(x.shape[0])], 1)
    if training:
        mean, var = z.mean((0, 2, 3)), z.var((0, 2, 3), unbiased=False)
    else:
        mean, var = bn["running_mean"].reshape(-1), bn["running_var"].reshape(-1)
    inv = (var + 1e-5).rsqrt()
    x_hat = (z - mean.view(1, -1, 1, 1)) * inv.view(1, -1, 1, 1)
    a = bn["weight"].reshape(-1).abs() * inv
    terms = float(g.abs().sum()) * (1 + float(x.abs().max())) * (1 + float(a.max())) * (2 + float(x_hat.abs().max()))
    for mine_grad, their_grad in pairs:
        assert float((mine_grad - their_grad).abs().max()) <= tol * terms


def test_the_batch_norm_pass_in_float32_is_the_block_within_its_rounding():
    # the moments in float64, the outputs in float32: within float32's rounding of the block's
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8, 1, 12, 10, generator=g)
    weight, bias = torch.randn(3, 9, 1, 3, 3, generator=g), torch.randn(3, 9, generator=g)
    bn = dict(weight=torch.randn(3, 9, generator=g), bias=torch.randn(3, 9, generator=g),
              running_mean=torch.zeros(3, 9), running_var=torch.ones(3, 9))
    for training in (True, False):
        got = conv_pool.conv_batch_norm_max_pool(x, weight, bias, dict(bn), (1, 1), 0.1, 1e-5, training, True)
        want = reference_batch_norm(x, weight, bias, {key: t.clone() for key, t in bn.items()}, (1, 1), 0.1, 1e-5,
                                    training, True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batch_norm_gradcheck():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 1, 7, 6, generator=g, dtype=torch.float64)
    inputs = [torch.randn(2, 3, 1, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)] + \
             [torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    for training, relu in itertools.product((True, False), (False, True)):
        def block(w, b, gamma_, beta, training=training, relu=relu):
            bn = dict(weight=gamma_, bias=beta, running_mean=torch.zeros(2, 3, dtype=torch.float64),
                      running_var=torch.ones(2, 3, dtype=torch.float64))
            return conv_pool.conv_batch_norm_max_pool(x, w, b, bn, (1, 1), 0.1, 1e-5, training, relu)
        assert torch.autograd.gradcheck(block, inputs)


@pytest.mark.parametrize("layers, length", [
    ([nn.Conv2d(1, 4, 3, padding=1), nn.MaxPool2d(2)], 2),
    ([nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.MaxPool2d(2), nn.ReLU()], 3),
    ([nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.MaxPool2d(2)], 0),  # cumulative
    ([nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, affine=False), nn.MaxPool2d(2)], 0),
    ([nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.MaxPool2d(2)], 0),
    ([PatchNormConv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(2)], 0),
    ([nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(2)], 0),
    ([nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(3)], 0),
    ([nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)], 0),
])
def test_which_first_blocks_fuse(layers, length):
    assert conv_pool.first_block_length(layers) == length


def test_the_batch_norm_pass_centres_the_moments_of_an_offset_input():
    # An input far from 0 (mean 1e4, spread 1; no padding): E[z²] − mean² of the raw patches would lose a
    # relative γ_n·(mean/σ)² ≈ 1e-3 of the variance. The pass takes the moments about the padded
    # input's mean, so it loses γ_n·(1 + m²/σ²) with m the mean of w·(patch − shift): the bound is
    # that, with the convention's κ = 10², evaluated from the centred input.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 1, 10, 9, generator=g, dtype=torch.float64) + 1e4
    weight, bias = torch.randn(2, 5, 1, 3, 3, generator=g, dtype=torch.float64), None
    bn = dict(weight=torch.ones(2, 5, dtype=torch.float64), bias=torch.zeros(2, 5, dtype=torch.float64),
              running_mean=torch.zeros(2, 5, dtype=torch.float64), running_var=torch.ones(2, 5, dtype=torch.float64))
    got = conv_pool.conv_batch_norm_max_pool(x, weight, bias, {k: t.clone() for k, t in bn.items()}, (0, 0), 0.1,
                                             1e-5, True, False)
    want = reference_batch_norm(x, weight, bias, {k: t.clone() for k, t in bn.items()}, (0, 0), 0.1, 1e-5, True,
                                False)
    xp = x[:, :, 0]  # (no padding: a padded zero is data too, and would spread the centred input)
    centred = (xp - xp.mean((1, 2, 3), keepdim=True)).unsqueeze(2)  # (K, B, 1, Hq, Wq)
    z = torch.stack([F.conv2d(centred[k], weight[k]) for k in range(2)])  # w·(patch − shift)
    m, var = z.mean((1, 3, 4)), z.var((1, 3, 4), unbiased=False)
    n = x.shape[1] * z.shape[3] * z.shape[4] * 9
    tol = 4 * gamma(n, torch.float64) * 100 * float((1 + m.square() / var).max())
    assert float((got - want).abs().max()) <= tol * float(want.abs().max())


def test_the_batch_norm_pass_refuses_statistics_it_cannot_take():
    x, weight, pad = torch.randn(2, 3, 1, 6, 6), torch.randn(2, 4, 1, 3, 3), (1, 1)
    stats = [torch.randn(2, 4) for _ in range(4)]
    assert conv_pool.usable(x, weight, None, pad, *stats)
    assert not conv_pool.usable(x, weight, None, pad, *stats[:3], torch.randn(2, 5))  # other channels
    assert not conv_pool.usable(x, weight, None, pad, *stats[:3], torch.randn(2, 4).double())
    assert not conv_pool.usable(x, weight, None, pad, *stats[:3], torch.zeros(2, 4, dtype=torch.long))
    assert not conv_pool.usable(x, weight.long(), None, pad)  # (an integer weight, too)

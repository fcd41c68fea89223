"""Numerical safety of the corrected layers: extreme magnitudes, zeros, NaN/Inf propagation.

The reference for extreme inputs is the same closed form evaluated on x/2^k (exact: a power of
two) with the factor put back analytically, in float64: AffineLike(x) = (W x' + b/2^k)/√(‖x'‖² +
4^-k) with x' = x/2^k. Tolerances: fp32 layers vs that float64 value, rtol 1e-5 (≈ 80 ulp of
fp32 for sums of ≤ 16 terms); fp64 layers rtol 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from affdiv.layers import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d

DENSE = {
    "affine_like": lambda dtype: AffineLike(8, 3, dtype=dtype),
    "norm_l2": lambda dtype: NormLike(8, 3, mode="l2", dtype=dtype),
    "norm_rms": lambda dtype: NormLike(8, 3, mode="rms", dtype=dtype),
}
ALL = {
    **DENSE,
    "conv1d": lambda dtype: PatchNormConv1d(2, 3, 3, padding=1, dtype=dtype),
    "conv2d": lambda dtype: PatchNormConv2d(2, 4, 3, padding=1, groups=2, dtype=dtype),
}
SHAPES = {"affine_like": (4, 8), "norm_l2": (4, 8), "norm_rms": (4, 8), "conv1d": (4, 2, 6), "conv2d": (4, 2, 5, 5)}


def _exact_dense(name, layer, x):
    """Float64 closed form, computed on x scaled by an exact power of two per row."""
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    x = x.double()
    _, k = torch.frexp(x.abs().amax(-1, keepdim=True))  # amax = m·2^k, m ∈ [0.5, 1)
    xs = torch.ldexp(x, -k)  # exact
    norm_s = xs.norm(dim=-1, keepdim=True)  # ‖x‖ = 2^k ‖x'‖
    if name == "affine_like":  # only scale down: for small rows the +1 makes underflow harmless
        k = k.clamp_min(0)
        xs = torch.ldexp(x, -k)
        norm_s = xs.norm(dim=-1, keepdim=True)
        one = torch.ones_like(norm_s)
        return (xs @ w.T + torch.ldexp(one, -k) * b) / torch.sqrt(norm_s**2 + torch.ldexp(one, -2 * k))
    scale = 1.0 if name == "norm_l2" else math.sqrt(x.shape[-1])
    return scale * (xs / norm_s) @ w.T + b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", DENSE)
@pytest.mark.parametrize("magnitude", ["max", "sqrt_max", "tiny", "mixed"])
def test_dense_extreme_inputs_are_finite_and_accurate(name, dtype, magnitude):
    info = torch.finfo(dtype)
    torch.manual_seed(1)
    layer = DENSE[name](dtype)
    if name != "affine_like":
        layer.eps = info.tiny  # so that the "tiny" rows (‖x‖ ≈ 16·tiny) are normalised, not eps-clamped
    x = torch.rand(4, 8, dtype=torch.float64) * 2 - 1
    x[:, 0] = 1.0  # every row has a max-magnitude entry, so no row is all tiny after scaling
    row_scale = {
        "max": [info.max] * 4,
        "sqrt_max": [math.sqrt(info.max) * 4] * 4,  # ‖x‖² overflows, x itself is moderate
        "tiny": [info.tiny * 16] * 4,  # ‖x‖² underflows
        "mixed": [info.max, 1.0, info.tiny * 16, 0.0],
    }[magnitude]
    x = (x * torch.tensor(row_scale, dtype=torch.float64)[:, None]).to(dtype)
    z = layer(x)
    assert torch.isfinite(z).all()
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    expected = _exact_dense(name, layer, x)
    if name != "affine_like":  # an all-zero row gives b (documented)
        expected[x.abs().amax(-1) == 0] = layer.bias.detach().double()
    torch.testing.assert_close(z.double(), expected, rtol=rtol, atol=rtol * layer.weight.abs().max().item())


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_near_max_inputs_give_finite_outputs_and_gradients(name, dtype):
    torch.manual_seed(2)
    layer = ALL[name](torch.float32 if dtype == torch.float32 else dtype)
    x = torch.finfo(dtype).max * (torch.rand(*SHAPES[name]) * 2 - 1).to(dtype)
    x.requires_grad_(True)
    z = layer(x)
    assert torch.isfinite(z).all()
    z.float().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("name", ALL)
def test_all_zero_input_gives_the_bias_and_finite_gradients(name):
    layer = ALL[name](torch.float64)
    x = torch.zeros(*SHAPES[name], dtype=torch.float64, requires_grad=True)
    z = layer(x)
    bias = layer.bias.detach().view(-1, *([1] * (x.dim() - 2))) if "conv" in name else layer.bias.detach()
    assert torch.equal(z, bias.expand_as(z))
    z.sum().backward()
    assert torch.isfinite(x.grad).all()


PLAIN = {
    "affine_like": lambda: torch.nn.Linear(8, 3), "norm_l2": lambda: torch.nn.Linear(8, 3),
    "norm_rms": lambda: torch.nn.Linear(8, 3), "conv1d": lambda: torch.nn.Conv1d(2, 3, 3, padding=1),
    "conv2d": lambda: torch.nn.Conv2d(2, 4, 3, padding=1, groups=2),
}


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_propagates_like_the_plain_layer(name, bad):
    # Documented: an output is non-finite exactly where nn.Linear/nn.Conv's is (the outputs whose
    # row / receptive field holds the NaN/Inf); every other output is the clean value.
    layer = ALL[name](torch.float64)
    plain = PLAIN[name]().double()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(*SHAPES[name], dtype=torch.float64)
    clean = layer(x)
    x.view(x.shape[0], -1)[1, 0] = bad
    z = layer(x)
    finite = torch.isfinite(z)
    assert torch.equal(finite, torch.isfinite(plain(x))) and not finite.all()
    torch.testing.assert_close(z[finite], clean[finite], rtol=1e-12, atol=1e-12)


def test_affine_like_is_a_soft_bound():
    # |z_o| ≤ ‖(W_o, b_o)‖ for every x (Cauchy–Schwarz on the augmented vector): checked at scale
    layer = AffineLike(8, 3, dtype=torch.float64)
    bound = torch.cat([layer.weight, layer.bias[:, None]], 1).norm(dim=1)
    for log_scale in range(-300, 301, 50):
        z = layer(torch.randn(16, 8, dtype=torch.float64) * 10.0**log_scale)
        assert (z.abs() <= bound * (1 + 1e-14)).all()


@pytest.mark.parametrize("name", ALL)
def test_rescaled_path_equals_the_fast_path(name, monkeypatch):
    # Eager CPU takes c = 1 when every norm is finite; traced/CUDA/fp16 runs always rescale.
    # Both must give the same values and gradients (float64: a few ulp, rtol 1e-12).
    from affdiv.layers import _scale

    torch.manual_seed(3)
    layer = ALL[name](torch.float64)
    x = (3 * torch.randn(*SHAPES[name], dtype=torch.float64)).requires_grad_(True)
    results = []
    for force in (False, True):
        monkeypatch.setattr(_scale, "needs_rescale", lambda x, norm, force=force: force)
        z = layer(x)
        grads = torch.autograd.grad(z, [x, *layer.parameters()], torch.ones_like(z))
        results.append((z, *grads))
    for fast, rescaled in zip(*results):
        torch.testing.assert_close(rescaled, fast, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_does_not_depend_on_another_groups_magnitude(dtype):
    # A grouped PatchNorm convolution is its groups side by side: group 1's outputs and gradients
    # are those of a layer of group 1 alone, even when group 0's norm overflows (which sends the
    # call down the rescaled path; a rescale shared by the sample would push group 1's squares
    # below the dtype's range). Reference: the same layer on group 1 alone (the fast path); the two
    # differ by the rescale's rounding, a few ulp (rtol 1e-12 in float64, 1e-5 in float32).
    torch.manual_seed(4)
    both = PatchNormConv2d(4, 6, 3, padding=1, groups=2, dtype=dtype)
    alone = PatchNormConv2d(2, 3, 3, padding=1, dtype=dtype)
    with torch.no_grad():
        alone.weight.copy_(both.weight[3:])
        alone.bias.copy_(both.bias[3:])
    x = torch.randn(3, 4, 5, 5, dtype=dtype)
    x[:, :2] *= torch.finfo(dtype).max / 4  # group 0: its squares overflow
    x.requires_grad_(True)
    z = both(x)
    gz = torch.randn_like(z)
    dx, dw, db = torch.autograd.grad(z, [x, both.weight, both.bias], gz)
    x1 = x[:, 2:].detach().clone().requires_grad_(True)
    z1 = alone(x1)
    dx1, dw1, db1 = torch.autograd.grad(z1, [x1, alone.weight, alone.bias], gz[:, 3:])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for got, want in [(z[:, 3:], z1), (dx[:, 2:], dx1), (dw[3:], dw1), (db[3:], db1)]:
        torch.testing.assert_close(got, want, **tol)
    assert torch.isfinite(z).all()

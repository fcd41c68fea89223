"""The corrected layers equal their closed forms and have exact gradients and forward-mode
derivatives (float64).

Tolerances: forward comparisons are between two float64 evaluations of the same closed form in a
different order of operations (rescaled vs direct): |Δ| ≤ a few ulp of the output scale, so
rtol = atol = 1e-12 bounds that with ~1e3 ulp to spare for sums over ≤ 100 terms.
gradcheck compares reverse and (check_forward_ad) forward mode against central finite
differences (eps 1e-6), whose error is O(eps²·f''') + O(ulp/eps) ≈ 1e-10 for these O(1) smooth
functions; its default atol 1e-5 / rtol 1e-3 is replaced by 1e-7 to keep the check sharp but
above that error.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from affdiv.layers import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d
from affdiv.layers import functional as LF
from affdiv.theory.affine import ReferenceAffineFamily

F64 = torch.float64
GRADCHECK = {"atol": 1e-7, "rtol": 1e-7}


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, dtype=F64, generator=g)).requires_grad_(True)


# --------------------------------------------------------------------------------------------
# dense: forward against the theory reference and the closed form


@pytest.mark.parametrize("member, make", [
    ("affine_like", lambda m, n: AffineLike(m, n, dtype=F64)),
    ("norm_l2", lambda m, n: NormLike(m, n, mode="l2", dtype=F64)),
    ("norm_rms", lambda m, n: NormLike(m, n, mode="rms", dtype=F64)),
])
@settings(max_examples=15, deadline=None)
@given(batch=st.lists(st.integers(1, 4), min_size=0, max_size=2), m=st.integers(1, 9), n=st.integers(1, 6),
       seed=st.integers(0, 2**16), log_scale=st.floats(-3, 3))
def test_dense_forward_equals_theory_reference(member, make, batch, m, n, seed, log_scale):
    layer = make(m, n)
    reference = ReferenceAffineFamily(member, m, n)
    reference.linear.load_state_dict({"weight": layer.weight, "bias": layer.bias})
    x = _rand(*batch, m, seed=seed, scale=10.0**log_scale).detach()
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-12, atol=1e-12)


def test_affine_like_without_bias_keeps_the_augmented_one():
    # documented: z = (W x)/√(‖x‖² + 1), not W x/‖x‖
    layer = AffineLike(3, 2, bias=False, dtype=F64)
    x = torch.tensor([[3.0, 0.0, 4.0]], dtype=F64)
    torch.testing.assert_close(layer(x), x @ layer.weight.T / math.sqrt(26.0), rtol=1e-15, atol=0)


@pytest.mark.parametrize("mode", ["l2", "rms"])
def test_norm_like_zero_input_gives_bias(mode):
    layer = NormLike(5, 3, mode=mode, eps=1e-300, dtype=F64)
    z = layer(torch.zeros(2, 5, dtype=F64))
    assert torch.equal(z, layer.bias.detach().expand(2, 3))
    # ‖x‖ > eps, but ‖x‖² = 5e-400 underflows: the rescaled norm still gives x/‖x‖
    tiny = torch.full((1, 5), 1e-200, dtype=F64)
    k = 1.0 if mode == "l2" else math.sqrt(5)
    expected = (k / math.sqrt(5)) * layer.weight.sum(1) + layer.bias
    torch.testing.assert_close(layer(tiny)[0], expected.detach(), rtol=1e-14, atol=1e-14)


def test_affine_like_zero_input_gives_bias():
    layer = AffineLike(4, 3, dtype=F64)
    assert torch.equal(layer(torch.zeros(4, dtype=F64)), layer.bias.detach())


# --------------------------------------------------------------------------------------------
# dense: gradients


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fn", [
    LF.affine_like,
    lambda x, w, b=None: LF.norm_like(x, w, b, mode="l2"),
    lambda x, w, b=None: LF.norm_like(x, w, b, mode="rms"),
], ids=["affine_like", "norm_l2", "norm_rms"])
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5), (5,), (1, 1)])
def test_dense_gradcheck_and_gradgradcheck(fn, bias, shape):
    m = shape[-1]
    x = _rand(*shape, seed=1, scale=2.0)
    w = _rand(3, m, seed=2)
    args = (x, w, _rand(3, seed=3)) if bias else (x, w)
    assert torch.autograd.gradcheck(fn, args, check_forward_ad=True, **GRADCHECK)
    assert torch.autograd.gradgradcheck(fn, args, **GRADCHECK)


def test_norm_like_gradient_at_zero_input_is_the_constant_branch():
    # for ‖x‖ ≤ eps, n(x) = x/eps: the Jacobian is W/eps (documented); a zero row included
    w = _rand(2, 3, seed=4)
    x = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda x: LF.norm_like(x, w, eps=0.5), x)
    torch.testing.assert_close(jac[0, :, 0, :], w.detach() / 0.5, rtol=1e-15, atol=0)


# --------------------------------------------------------------------------------------------
# convolutions: an independent unfold reference


def _reference_conv(x, w, b, stride, padding, dilation, groups):
    """Unfold-based: every patch explicitly, its norm per group, then the affine map."""
    d = w.dim() - 2
    if d == 1:  # treat (N, C, L) as (N, C, 1, L)
        return _reference_conv(x.unsqueeze(2), w.unsqueeze(2), b, (1, stride[0]), (0, padding[0]),
                               (1, dilation[0]), groups).squeeze(2)
    n, c = x.shape[:2]
    o, cg, kh, kw = w.shape
    cols = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)  # (N, C·kh·kw, P)
    cols = cols.view(n, groups, cg * kh * kw, -1)
    norms = torch.sqrt((cols**2).sum(2) + 1)  # (N, groups, P)
    wg = w.view(groups, o // groups, cg * kh * kw)
    out = torch.einsum("gok,ngkp->ngop", wg, cols)
    if b is not None:
        out = out + b.view(1, groups, o // groups, 1)
    out = out / norms.unsqueeze(2)
    h = (x.shape[2] + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wd = (x.shape[3] + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return out.reshape(n, o, h, wd)


GEOMETRIES_2D = [  # (C_in, C_out, kernel, stride, padding, dilation, groups)
    (3, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1),
    (4, 6, (2, 3), (2, 1), (0, 1), (1, 2), 2),
    (4, 4, (3, 3), (1, 2), (2, 0), (2, 1), 4),
    (2, 3, (1, 1), (1, 1), (0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("geometry", GEOMETRIES_2D)
@pytest.mark.parametrize("bias", [True, False])
def test_patchnorm_conv2d_equals_unfold_reference(geometry, bias):
    c_in, c_out, k, s, p, dl, g = geometry
    layer = PatchNormConv2d(c_in, c_out, k, s, p, dl, g, bias=bias, dtype=F64)
    x = _rand(2, c_in, 7, 6, seed=5, scale=3.0).detach()
    torch.testing.assert_close(layer(x), _reference_conv(x, layer.weight, layer.bias, s, p, dl, g),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geometry", [(3, 4, 3, 1, 1, 1, 1), (4, 6, 2, 2, 0, 3, 2), (2, 2, 3, 3, 2, 1, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_patchnorm_conv1d_equals_unfold_reference(geometry, bias):
    c_in, c_out, k, s, p, dl, g = geometry
    layer = PatchNormConv1d(c_in, c_out, k, s, p, dl, g, bias=bias, dtype=F64)
    x = _rand(3, c_in, 11, seed=6, scale=0.5).detach()
    torch.testing.assert_close(layer(x), _reference_conv(x, layer.weight, layer.bias, (s,), (p,), (dl,), g),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("padding, padding_mode", [("valid", "zeros")] + [
    (p, m) for p in ("same", 2) for m in ("zeros", "reflect", "replicate", "circular")
])
def test_patchnorm_padding_matches_nn_conv_geometry(padding, padding_mode):
    # kernel (2, 3): "same" needs an asymmetric pad; the patch is the padded input, as in nn.Conv2d
    layer = PatchNormConv2d(2, 3, (2, 3), padding=padding, padding_mode=padding_mode, dtype=F64)
    plain = torch.nn.Conv2d(2, 3, (2, 3), padding=padding, padding_mode=padding_mode, dtype=F64)
    plain.load_state_dict(layer.state_dict())
    x = _rand(2, 2, 5, 6, seed=7).detach()
    # ‖patch‖² from the same padded input, by unfold over nn.Conv2d's own padding of x
    ones = torch.nn.Conv2d(2, 1, (2, 3), padding=padding, padding_mode=padding_mode, bias=False, dtype=F64)
    ones.weight.data.fill_(1.0)
    expected = plain(x) / torch.sqrt(ones(x * x) + 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_patchnorm_unbatched_input_matches_batched():
    layer = PatchNormConv2d(2, 3, 3, padding=1, dtype=F64)
    x = _rand(2, 5, 5, seed=8).detach()
    torch.testing.assert_close(layer(x), layer(x.unsqueeze(0)).squeeze(0), rtol=0, atol=0)


@pytest.mark.parametrize("d, geometry", [
    (2, ((3, 3), 1, 1, 1, 1)), (2, ((2, 3), 2, (0, 1), (1, 2), 2)), (2, ((3, 2), 1, "same", (2, 1), 2)),
    (1, (3, 2, 1, 1, 1)), (1, (2, 1, "same", 2, 2)),
])
@pytest.mark.parametrize("bias", [True, False])
def test_patchnorm_gradcheck_and_gradgradcheck(d, geometry, bias):
    # fast_mode: gradcheck compares J·v (and vᵀJ) for random v instead of every column, which keeps
    # the double-backward check of a conv affordable; the full-Jacobian mode runs on one geometry below.
    k, s, p, dl, g = geometry
    ks = (k,) * d if isinstance(k, int) else k
    x = _rand(1, 2 * g, *((5, 4) if d == 2 else (6,)), seed=9, scale=1.5)
    w = _rand(2 * g, 2, *ks, seed=10)
    fn = LF.patchnorm_conv2d if d == 2 else LF.patchnorm_conv1d
    args = (x, w, _rand(2 * g, seed=11) if bias else None)
    f = lambda x, w, b: fn(x, w, b, s, p, dl, g)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, fast_mode=True, check_forward_ad=True, **GRADCHECK)
    assert torch.autograd.gradgradcheck(f, args, fast_mode=True, **GRADCHECK)


def test_patchnorm_full_jacobian_gradcheck():
    x = _rand(1, 2, 3, 3, seed=12, scale=1.5)
    args = (x, _rand(2, 1, 2, 2, seed=13), _rand(2, seed=14))
    f = lambda x, w, b: LF.patchnorm_conv2d(x, w, b, 1, 1, 1, 2)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, **GRADCHECK)
    assert torch.autograd.gradgradcheck(f, args, **GRADCHECK)

"""Forward-mode AD of the corrected layers: torch.func.jvp, jacfwd and torch.autograd.forward_ad
against central finite differences, the naive composite's jvp and reverse mode, in float64.

Tolerances:
* Against central differences D(h) = (f(θ + h v) − f(θ − h v))/2h with unit-norm directions v:
  truncation h²/6·|f'''| plus rounding ≈ u·‖f‖∞/h (u = 2⁻⁵³). Dense inputs have row norms
  in [0.5, 3] and convolution inputs are scaled to patch norms O(1), so the third derivatives of
  the scale along a unit direction stay below ~10³·max(1, ‖f‖∞); with h = 1e-5 the error is
  ≤ 2e-8 + 1e-11 (measured: ≤ 1e-10), and the bound 1e-7·max(1, ‖f‖∞) holds it with margin while
  any error in a tangent formula (O(‖ż‖)) stands far above it.
* Against the naive composite's jvp and reverse mode: the same derivative in a different order of
  operations, sums over ≤ 64 terms of O(1) products: a few hundred ulp, 1e-12 relative to
  max(1, ‖ż‖∞).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import jacfwd, jacrev, jvp

from affdiv.layers import _autograd
from affdiv.layers import functional as LF

F64 = torch.float64
FD_STEP = 1e-5
FD_TOL = 1e-7
EXACT_TOL = 1e-12


def _rows_with_norms(shape, generator) -> torch.Tensor:
    """Rows (last dim) of random directions with norms uniform in [0.5, 3]."""
    x = torch.randn(*shape, dtype=F64, generator=generator)
    norms = 0.5 + 2.5 * torch.rand(*shape[:-1], 1, dtype=F64, generator=generator)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True) * norms


def _unit(*shapes, generator) -> list[torch.Tensor]:
    """Random tangents of these shapes, jointly of unit norm."""
    tangents = [torch.randn(*s, dtype=F64, generator=generator) for s in shapes]
    norm = math.sqrt(sum(float((t * t).sum()) for t in tangents))
    return [t / norm for t in tangents]


def _naive_dense(member: str):
    def f(x, w, b):
        b = 0.0 if b is None else b
        sq = (x * x).sum(-1, keepdim=True)
        if member == "affine_like":
            return (x @ w.T + b) / torch.sqrt(sq + 1)
        k = 1.0 if member == "norm_l2" else math.sqrt(x.shape[-1])
        return k * x / torch.sqrt(sq) @ w.T + b
    return f


LAYER = {
    "affine_like": LF.affine_like,
    "norm_l2": lambda x, w, b: LF.norm_like(x, w, b, mode="l2"),
    "norm_rms": lambda x, w, b: LF.norm_like(x, w, b, mode="rms"),
}


def _assert_tangent(measured, reference, output, tol):
    scale = max(1.0, float(output.abs().max()), float(reference.abs().max()))
    err = float((measured - reference).abs().max())
    assert err <= tol * scale, f"tangent error {err:.3e} > {tol:.0e} × {scale:.3g}"


def _central_difference(f, primals, tangents):
    plus = f(*(p + FD_STEP * t for p, t in zip(primals, tangents)))
    minus = f(*(p - FD_STEP * t for p, t in zip(primals, tangents)))
    return (plus - minus) / (2 * FD_STEP)


# --------------------------------------------------------------------------------------------
# dense layers


def _tangents_of(primals, which, generator) -> tuple[torch.Tensor, ...]:
    """Unit-norm tangents of (x, w[, b]): random for the inputs named in ``which`` ("x", "w",
    "b" or "all"), zero for the others."""
    tangents = _unit(*(p.shape for p in primals), generator=generator)
    return tuple(t if which in ("all", name) else torch.zeros_like(t) for t, name in zip(tangents, "xwb"))


def _check_jvp(layer, naive, primals, tangents):
    """The layer's jvp against central differences of the layer and against the naive jvp."""
    output, tangent = jvp(layer, primals, tangents)
    _assert_tangent(tangent, _central_difference(layer, primals, tangents), output, FD_TOL)
    _, expected = jvp(naive, primals, tangents)
    _assert_tangent(tangent, expected, output, EXACT_TOL)


def _without_bias(f):
    return lambda x, w: f(x, w, None)


@pytest.mark.parametrize("member", LAYER)
@settings(max_examples=20)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), m=st.integers(1, 8), n=st.integers(1, 5),
       seed=st.integers(0, 2**16), which=st.sampled_from(["x", "w", "b", "all"]), bias=st.booleans())
def test_dense_jvp_matches_central_differences_and_the_naive_composite(member, lead, m, n, seed, which, bias):
    g = torch.Generator().manual_seed(seed)
    primals = (_rows_with_norms((*lead, m), g), torch.randn(n, m, dtype=F64, generator=g),
               torch.randn(n, dtype=F64, generator=g))[:3 if bias else 2]
    layer, naive = LAYER[member], _naive_dense(member)
    if not bias:
        layer, naive = _without_bias(layer), _without_bias(naive)
    _check_jvp(layer, naive, primals, _tangents_of(primals, which, g))


@pytest.mark.parametrize("member", LAYER)
def test_dense_jacfwd_equals_jacrev_and_forward_ad_equals_torch_func(member):
    g = torch.Generator().manual_seed(1)
    x, w, b = _rows_with_norms((4, 6), g), torch.randn(3, 6, dtype=F64, generator=g), torch.randn(3, dtype=F64)
    forward = jacfwd(LAYER[member], argnums=(0, 1, 2))(x, w, b)
    reverse = jacrev(LAYER[member], argnums=(0, 1, 2))(x, w, b)
    for a, r in zip(forward, reverse):
        _assert_tangent(a, r, LAYER[member](x, w, b), EXACT_TOL)
    x_t = torch.randn(4, 6, dtype=F64, generator=g)
    _, expected = jvp(lambda x: LAYER[member](x, w, b), (x,), (x_t,))
    with fwAD.dual_level():  # eager forward AD: the layer's own Function, fused passes or not
        dual = LAYER[member](fwAD.make_dual(x, x_t), w, b)
        _assert_tangent(fwAD.unpack_dual(dual).tangent, expected, dual, EXACT_TOL)


@pytest.mark.parametrize("mode", ["l2", "rms"])
def test_norm_like_jvp_below_eps_is_the_constant_branch(mode):
    # for ‖x‖ ≤ eps, z = W k x/eps + b: the row scale is constant, its tangent 0 (documented)
    g = torch.Generator().manual_seed(6)
    x = torch.stack([torch.tensor([0.1, -0.2, 0.0], dtype=F64), torch.tensor([1.0, 2.0, -2.0], dtype=F64),
                     torch.zeros(3, dtype=F64)])  # ‖x‖ = 0.22 and 0 below eps = 0.5, 3 above
    w, b = torch.randn(4, 3, dtype=F64, generator=g), torch.randn(4, dtype=F64, generator=g)
    k = 1.0 if mode == "l2" else math.sqrt(3)

    def naive(x, w, b):
        return k * x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(0.5) @ w.T + b

    def layer(x, w, b):
        return LF.norm_like(x, w, b, mode=mode, eps=0.5)

    primals = (x, w, b)
    _check_jvp(layer, naive, primals, _tangents_of(primals, "all", g))


@pytest.mark.parametrize("member", ["affine_like", "norm_l2"])
def test_the_scale_output_has_the_tangent_of_the_row_scale(member):
    # r = 1/√(‖x‖² + 1) (AffineLike) and q = 1/‖x‖ (NormLike l2): their tangents by the naive formula
    g = torch.Generator().manual_seed(2)
    x, w = _rows_with_norms((5, 4), g), torch.randn(3, 4, dtype=F64, generator=g)
    x_t = torch.randn(5, 4, dtype=F64, generator=g)
    if member == "affine_like":
        scale, naive = (lambda x: _autograd.apply_affine_like(x, w, None)[1]), (
            lambda x: torch.rsqrt((x * x).sum(-1, keepdim=True) + 1))
    else:
        scale, naive = (lambda x: _autograd.apply_norm_like(x, w, None, 1.0, 1e-12)[1]), (
            lambda x: torch.rsqrt((x * x).sum(-1, keepdim=True)))
    measured, expected = jvp(scale, (x,), (x_t,))[1], jvp(naive, (x,), (x_t,))[1]
    _assert_tangent(measured, expected, naive(x), EXACT_TOL)
    _, weight_only = jvp(lambda w: _autograd.apply_affine_like(x, w, None)[1], (w,), (torch.ones_like(w),))
    assert torch.equal(weight_only, torch.zeros_like(weight_only))  # r depends on x only


# --------------------------------------------------------------------------------------------
# convolutions


def _naive_patchnorm(stride, padding, dilation, groups, dims):
    conv = F.conv1d if dims == 1 else F.conv2d

    def f(x, w, b):
        group_squares = (x * x).reshape(x.shape[0], groups, -1, *x.shape[2:]).sum(2)
        ones = torch.ones(groups, 1, *w.shape[2:], dtype=x.dtype)
        patch_sq = conv(group_squares, ones, stride=stride, padding=padding, dilation=dilation, groups=groups)
        y = conv(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return y / torch.sqrt(patch_sq + 1).repeat_interleave(w.shape[0] // groups, dim=1)
    return f


CONVS = [  # dims, C_in, C_out, kernel, stride, padding, dilation, groups
    (1, 2, 4, 3, 1, 1, 1, 2),
    (2, 3, 2, 3, 2, 1, 1, 1),
    (2, 4, 6, 2, 1, 0, 2, 2),
]


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("geometry", CONVS)
@settings(max_examples=8)
@given(batch=st.integers(1, 3), size=st.integers(5, 7), seed=st.integers(0, 2**16),
       which=st.sampled_from(["x", "w", "b", "all"]), bias=st.booleans())
def test_patchnorm_jvp_matches_central_differences_and_the_naive_composite(geometry, recompute, batch, size,
                                                                             seed, which, bias):
    dims, c_in, c_out, k, stride, padding, dilation, groups = geometry
    g = torch.Generator().manual_seed(seed)
    # x scaled so that every patch norm is O(1): 0.5/√(C_in/groups · k^dims) per entry
    x = 0.5 * torch.randn(batch, c_in, *(size,) * dims, dtype=F64, generator=g) / math.sqrt(c_in // groups * k**dims)
    primals = (x, torch.randn(c_out, c_in // groups, *(k,) * dims, dtype=F64, generator=g),
               torch.randn(c_out, dtype=F64, generator=g))[:3 if bias else 2]
    functional = LF.patchnorm_conv1d if dims == 1 else LF.patchnorm_conv2d

    def layer(x, w, b):
        return functional(x, w, b, stride, padding, dilation, groups, recompute)

    naive = _naive_patchnorm(stride, padding, dilation, groups, dims)
    if not bias:
        layer, naive = _without_bias(layer), _without_bias(naive)
    _check_jvp(layer, naive, primals, _tangents_of(primals, which, g))


def test_patchnorm_jacfwd_equals_jacrev_and_forward_ad_equals_torch_func():
    g = torch.Generator().manual_seed(3)
    x = 0.3 * torch.randn(2, 4, 5, 6, dtype=F64, generator=g)
    w, b = torch.randn(6, 2, 3, 3, dtype=F64, generator=g), torch.randn(6, dtype=F64, generator=g)

    def layer(x, w, b):
        return LF.patchnorm_conv2d(x, w, b, stride=(2, 1), padding=1, groups=2)

    output = layer(x, w, b)
    for a, r in zip(jacfwd(layer, argnums=(0, 1, 2))(x, w, b), jacrev(layer, argnums=(0, 1, 2))(x, w, b)):
        _assert_tangent(a, r, output, EXACT_TOL)
    x_t = torch.randn_like(x)
    _, expected = jvp(lambda x: layer(x, w, b), (x,), (x_t,))
    with fwAD.dual_level():
        dual = layer(fwAD.make_dual(x, x_t), w, b)
        _assert_tangent(fwAD.unpack_dual(dual).tangent, expected, output, EXACT_TOL)


@pytest.mark.parametrize("strategy", ["forward-mode", "reverse-mode"])
def test_vectorised_jacobians_of_patchnorm_equal_jacrev(strategy):
    # autograd.functional.jacobian(vectorize=True) batches the jvp (or the backward) with the
    # legacy vmap, which has no rule for every view op
    g = torch.Generator().manual_seed(5)
    x, w = 0.3 * torch.randn(2, 4, 5, 5, dtype=F64, generator=g), torch.randn(6, 2, 3, 3, dtype=F64, generator=g)

    def layer(x):
        return LF.patchnorm_conv2d(x, w, padding=1, groups=2)

    vectorised = torch.autograd.functional.jacobian(layer, x, vectorize=True, strategy=strategy)
    _assert_tangent(vectorised, jacrev(layer)(x), layer(x), EXACT_TOL)


def test_forward_over_reverse_keeps_the_tangent_through_a_backward():
    # a backward on dual tensors (forward AD over reverse, no create_graph) must not run the fused
    # C passes, which would drop the tangents: the Hessian-vector product by forward over reverse
    # equals the one by torch.func
    g = torch.Generator().manual_seed(4)
    x, w = _rows_with_norms((4, 5), g).requires_grad_(True), torch.randn(3, 5, dtype=F64, generator=g)
    x_t = torch.randn(4, 5, dtype=F64, generator=g)

    def loss(x):
        return LF.affine_like(x, w).square().sum()

    _, expected = jvp(torch.func.grad(loss), (x.detach(),), (x_t,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, x_t)
        (grad,) = torch.autograd.grad(loss(dual), dual)
        _assert_tangent(fwAD.unpack_dual(grad).tangent, expected, grad, EXACT_TOL)

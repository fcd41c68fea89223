"""The fused CPU passes (``affdiv.layers._fused``) and the layers' use of them.

Each kernel is checked against the same formula in torch ops, in float64, over hypothesis-drawn
shapes (empty, single-row, single-column, past the parallel grain; NCHW and channels_last),
contents and thread counts. Tolerance: a sum of n products in float64 carries an error
≤ n·u·Σ|a_j b_j| (u = 2^-53 ≈ 1.1e-16, n ≤ 300): the checks use rtol = atol = 1e-12 on O(1)
data, above that bound (≤ 3.3e-14·Σ|ab|) for the sums drawn here and far below any formula
error. The layers with and without the kernels must agree to the same tolerance in float64; in
float32 the kernels' results must lie within the worst-case rounding bound of their sums
(Higham: (n+2)·u·Σ|terms|, see ``_float32_bounds``) of the float64 result, a bound that holds
however the sums cancel (dx ≡ 0 at in_features = 1 is pure rounding noise). gradcheck must pass
with the kernels in the first-order backward (it records no graph, so they are used: counted).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from affdiv.layers import AffineLike, NormLike, PatchNormConv2d, _autograd, _fused, _native
from affdiv.layers import functional as LF

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}

needs_kernels = pytest.mark.skipif(
    not _fused.available(), reason="the compiled row passes were not built (no C compiler with OpenMP at install)"
)


@pytest.fixture
def python_functions():
    """The layers as their Python Functions, whose branches the tests that take this look into (the
    C++ nodes, which skip the Python wrappers of the passes, equal them bit for bit: test_native.py)."""
    with _native.disabled():
        yield


def test_kernels_were_built_where_required():
    # tox sets AFFDIV_REQUIRE_CPU_KERNELS=1: there, a silently failed (optional) build is an error
    if os.environ.get("AFFDIV_REQUIRE_CPU_KERNELS") != "1":
        pytest.skip("AFFDIV_REQUIRE_CPU_KERNELS is not set: the compiled passes are optional here")
    assert _fused.available(), "the C extension affdiv.layers._fused_cpu was not built or did not load"


def test_the_interface_version_is_one_in_the_header_and_the_loader():
    # (read from the source: a mismatch would refuse the built library, and the test below skip)
    header = (Path(__file__).resolve().parents[2] / "layers" / "_fused_cpu.h").read_text()  # (not installed)
    assert re.search(r"#define AFFDIV_FUSED_ABI (\d+)", header).group(1) == str(_fused.FUSED_ABI)


@needs_kernels
def test_a_library_of_another_interface_version_is_not_loaded(monkeypatch):
    # a stale build (passes of other signatures) must be refused, never called
    assert _fused._LIB.affdiv_fused_abi() == _fused.FUSED_ABI
    monkeypatch.setattr(_fused, "FUSED_ABI", _fused.FUSED_ABI + 1)
    with pytest.warns(UserWarning, match="interface version"):
        assert _fused._load() is None


@contextlib.contextmanager
def intra_op_threads(n):
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _data(rows, cols, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, dtype=dtype, generator=g)


# rows × cols up to 300 × 200 (past the 32768-element grain, so both threads work)
shapes = st.tuples(st.integers(0, 300), st.integers(1, 200))
threads = st.sampled_from([1, 2])


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(threads=threads, shape=shapes, out_cols=st.integers(1, 150), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["affine_like", "norm_like"]), bias=st.sampled_from([None, "pre", "post"]))
def test_scale_outputs_matches_torch(threads, shape, out_cols, seed, mode, bias):
    rows, cols = shape
    x, z = _data(rows, cols, seed), _data(rows, out_cols, seed + 1)
    b_pre = _data(1, out_cols, seed + 2)[0] if bias == "pre" else None
    b_post = _data(1, out_cols, seed + 3)[0] if bias == "post" else None
    k, eps = 2.5, 1e-3
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    s_ref = 1 / torch.sqrt(norm**2 + 1) if mode == "affine_like" else k / norm.clamp_min(eps)
    z_ref = ((z if b_pre is None else z + b_pre) * s_ref) + (0 if b_post is None else b_post)
    with intra_op_threads(threads):
        s, safe = _fused.scale_outputs(z, x, mode, pre=b_pre, post=b_post, k=k, eps=eps)
    assert safe
    torch.testing.assert_close(s, s_ref, **TOL)
    torch.testing.assert_close(z, z_ref, **TOL)


@needs_kernels
def test_scale_outputs_takes_one_bias_position():
    x, z, b = _data(2, 3, 0), _data(2, 2, 1), _data(1, 2, 2)[0]
    with pytest.raises(ValueError, match="not both"):
        _fused.scale_outputs(z, x, "affine_like", pre=b, post=b)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_scale_outputs_flags_rows_it_cannot_scale_safely(dtype):
    big = math.sqrt(torch.finfo(dtype).max)
    x = torch.ones(4, 3, dtype=dtype)
    x[1, 0] = 2 * big  # ‖x‖² above the dtype's maximum: the GEMM on x may overflow
    assert not _fused.scale_outputs(torch.zeros(4, 2, dtype=dtype), x, "affine_like")[1]
    x[1, 0] = float("nan")
    assert not _fused.scale_outputs(torch.zeros(4, 2, dtype=dtype), x, "affine_like")[1]
    x[1, 0] = 1.0
    assert _fused.scale_outputs(torch.zeros(4, 2, dtype=dtype), x, "affine_like")[1]
    x[2] = 1e-30  # below ``small``: the caller rescales
    assert not _fused.scale_outputs(torch.zeros(4, 2, dtype=dtype), x, "norm_like", small=1e-20)[1]


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(threads=threads, shape=shapes, seed=st.integers(0, 2**16), column_sum=st.sampled_from([None, "scaled", "input"]),
       with_v=st.booleans())
def test_scale_grad_matches_torch(threads, shape, seed, column_sum, with_v):
    rows, cols = shape
    g, s = _data(rows, cols, seed), _data(rows, 1, seed + 1).abs()
    v = _data(1, cols, seed + 2)[0] if with_v else None
    with intra_op_threads(threads):
        gy, colsum, dot = _fused.scale_grad(g, s, column_sum, v)
    torch.testing.assert_close(gy, g * s, **TOL)
    if column_sum is None:
        assert colsum is None
    else:
        torch.testing.assert_close(colsum, (g * s if column_sum == "scaled" else g).sum(0), **TOL)
    if with_v:
        torch.testing.assert_close(dot, (g * s) @ v.unsqueeze(1), **TOL)
    else:
        assert dot is None


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(threads=threads, shape=shapes, seed=st.integers(0, 2**16), m=st.floats(0.1, 3.0), with_c=st.booleans(),
       limit=st.sampled_from([math.inf, 1.0]))
def test_minus_radial_matches_torch(threads, shape, seed, m, with_c, limit):
    rows, cols = shape
    u, x, s = _data(rows, cols, seed), _data(rows, cols, seed + 1), 2 * _data(rows, 1, seed + 2).abs()
    c = _data(rows, 1, seed + 3) if with_c else None
    a = torch.where(s < limit, (m * s) ** 2, 0.0)
    expected = u - a * ((u * x).sum(1, keepdim=True) + (0 if c is None else c)) * x
    with intra_op_threads(threads):
        torch.testing.assert_close(_fused.minus_radial_(u, x, s, m, limit, c), expected, **TOL)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_are_deterministic_for_a_thread_count(threads):
    g, s = _data(257, 300, 0), _data(257, 1, 1).abs()
    with intra_op_threads(threads):
        first, second = _fused.scale_grad(g, s, "scaled"), _fused.scale_grad(g, s, "scaled")
    assert all(torch.equal(a, b) for a, b in zip(first[:2], second[:2]))


def test_usable_refuses_what_the_kernels_cannot_take():
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert _fused.usable(x, x) == _fused.available()
        assert not _fused.usable(x.t(), x)  # not contiguous
        assert not _fused.usable(x.bfloat16())  # dtype without a kernel
        assert not _fused.usable(x, x.double())  # mixed dtypes
        with _fused.disabled():
            assert not _fused.usable(x)
    assert not _fused.usable(x)  # recording a graph (a double backward needs the torch formulas)


# --------------------------------------------------------------------------------------------
# the layers: kernels on and off agree, gradcheck passes through the kernels


def _layer_outputs(make, x, grad, with_x_grad=True):
    """[z, dx, dW, db] of one forward/backward (None where there is no gradient)."""
    layer = make()
    xi = x.detach().requires_grad_(with_x_grad)
    z = layer(xi)
    z.backward(grad)
    return [z.detach(), xi.grad] + [p.grad for p in layer.parameters()]


DENSE = {
    "affine_like": lambda m, n, bias: AffineLike(m, n, bias=bias),
    "norm_l2": lambda m, n, bias: NormLike(m, n, bias=bias, mode="l2"),
    "norm_rms": lambda m, n, bias: NormLike(m, n, bias=bias, mode="rms"),
}


@needs_kernels
@pytest.mark.parametrize("member", sorted(DENSE))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@settings(max_examples=20, deadline=None)
@given(batch=st.lists(st.integers(1, 40), min_size=1, max_size=2), m=st.integers(1, 70), n=st.integers(1, 50),
       bias=st.booleans(), with_x_grad=st.booleans(), seed=st.integers(0, 2**16), zero_row=st.booleans())
@example(batch=[1], m=1, n=1, bias=True, with_x_grad=True, seed=0, zero_row=False)  # |W| ≪ |b|: dx is the bias term
def test_dense_layers_agree_with_and_without_kernels(member, dtype, batch, m, n, bias, with_x_grad, seed, zero_row):
    x = _data(math.prod(batch), m, seed).reshape(*batch, m)
    if zero_row:
        x.reshape(-1, m)[0] = 0.0  # NormLike's constant branch (a = 0 there), AffineLike's z = b
    grad = _data(math.prod(batch), n, seed + 1).reshape(*batch, n)

    def make(as_dtype):
        torch.manual_seed(seed)  # one set of parameters, drawn in float32, cast exactly
        return lambda: DENSE[member](m, n, bias).to(as_dtype)

    fused = _layer_outputs(make(dtype), x.to(dtype), grad.to(dtype), with_x_grad)
    with _fused.disabled():
        plain = _layer_outputs(make(dtype), x.to(dtype), grad.to(dtype), with_x_grad)
    assert [a is None for a in fused] == [b is None for b in plain]
    if dtype == F64:
        for a, b in zip(fused, plain):
            if a is not None:
                torch.testing.assert_close(a, b, **TOL)
        return
    # float32: each result within the worst-case rounding bound of its sums, against float64
    with _fused.disabled():
        exact = _layer_outputs(make(F64), x, grad, with_x_grad)
    layer = make(F64)()
    bounds = _float32_bounds(member, x.reshape(-1, m), layer.weight.detach(), layer.bias, grad.reshape(-1, n))
    for a, ref, bound in zip(fused, exact, bounds):
        if a is not None:
            assert float((a.double() - ref).abs().max()) <= bound


def _float32_bounds(member, x, w, b, g):
    """Worst-case float32 rounding bounds for [z, dx, dW, db] (Higham: a sum of n products
    computed in float32 is off by at most ~(n + 2)·u·Σ|terms|, u = 2^-24), from float64 data.
    s is the row scale. dx = u − a·(⟨u, x⟩ + c)·x with u = gy W, a = s² and c = ⟨gy, b⟩
    (AffineLike) or a = 1/‖x‖² and c = 0 (NormLike): its terms are |gy||W| plus
    a·(Σ|u||x| + Σ|gy||b|)·|x|, the bias part being unbounded by |W| (a small W, a large b)."""
    u = 2.0**-24
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    k = math.sqrt(x.shape[1]) if member == "norm_rms" else 1.0
    s = 1 / torch.sqrt(norm**2 + 1) if member == "affine_like" else k / norm.clamp_min(1e-12)
    bias = 0.0 if b is None else b.detach().abs()
    z_terms = (x.abs() @ w.abs().t() + (bias if member == "affine_like" else 0.0)) * s + (
        0.0 if member == "affine_like" else bias)
    gy_terms = g.abs() * s
    u_terms = gy_terms @ w.abs()
    dot_terms = (u_terms * x.abs()).sum(1, keepdim=True)
    if member == "affine_like":
        a = s**2
        dot_terms = dot_terms + (gy_terms * bias).sum(1, keepdim=True)
    else:
        a = torch.where(norm > 0, 1 / norm.clamp_min(1e-300) ** 2, 0.0)
    dx_terms = u_terms + a * dot_terms * x.abs()
    dw_terms = gy_terms.t() @ x.abs()
    db_terms = (gy_terms if member == "affine_like" else g.abs()).sum(0)
    rows, m = x.shape
    return [(m + 4) * u * float(z_terms.max()), (g.shape[1] + m + 4) * u * float(dx_terms.max()),
            (rows + 2) * u * float(dw_terms.max()), (rows + 2) * u * float(db_terms.max())]


@needs_kernels
@pytest.mark.parametrize("fn", [
    LF.affine_like,
    lambda x, w, b: LF.norm_like(x, w, b, mode="l2"),
    lambda x, w, b: LF.norm_like(x, w, b, mode="rms"),
], ids=["affine_like", "norm_l2", "norm_rms"])
def test_gradcheck_through_the_kernels(fn, monkeypatch):
    # the Python Functions' calls of the passes (the C++ nodes call them from C++: test_native.py)
    monkeypatch.setitem(_native._state, "disabled", True)
    calls = []
    for name in ("scale_outputs", "scale_grad", "minus_radial_"):
        original = getattr(_fused, name)
        monkeypatch.setattr(_fused, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x, w, b = _data(5, 4, 0).requires_grad_(), _data(3, 4, 1).requires_grad_(), _data(1, 3, 2)[0].requires_grad_()
    assert torch.autograd.gradcheck(fn, (x, w, b), atol=1e-7, rtol=1e-7)
    assert {"scale_outputs", "scale_grad", "minus_radial_"} <= set(calls)


# --------------------------------------------------------------------------------------------
# the PatchNorm passes, both layouts

LAYOUTS = [torch.contiguous_format, torch.channels_last]
conv_shapes = st.tuples(st.integers(0, 4), st.integers(1, 4), st.integers(1, 8), st.integers(1, 9), st.integers(1, 9))


def _planes(batch, groups, per_group, h, w, seed, layout):
    return _data(batch * groups * per_group * h, w, seed).reshape(batch, groups * per_group, h, w).contiguous(
        memory_format=layout)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "channels_last"])
@settings(max_examples=20, deadline=None)
@given(threads=threads, shape=conv_shapes, seed=st.integers(0, 2**16))
def test_group_squares_and_group_update_match_torch(layout, threads, shape, seed):
    batch, groups, per_group, h, w = shape
    x = _planes(batch, groups, per_group, h, w, seed, layout)
    t = _planes(batch, groups, per_group, h, w, seed + 1, layout)
    r = _data(batch * groups * h, w, seed + 2).reshape(batch, groups, h, w)
    grouped = lambda v: v.unflatten(1, (groups, per_group))  # noqa: E731
    with intra_op_threads(threads):
        squares, safe = _fused.group_squares(x, groups)
        scaled = _fused.group_update_(t.clone(memory_format=torch.preserve_format), r, groups)
        added = _fused.group_update_(t.clone(memory_format=torch.preserve_format), r, groups, src=x)
    assert safe
    torch.testing.assert_close(squares, (grouped(x) ** 2).sum(2), **TOL)
    torch.testing.assert_close(scaled, (grouped(t) * r.unsqueeze(2)).flatten(1, 2), **TOL)
    torch.testing.assert_close(added, (grouped(t) + grouped(x) * r.unsqueeze(2)).flatten(1, 2), **TOL)
    assert scaled.is_contiguous(memory_format=layout) and added.is_contiguous(memory_format=layout)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "channels_last"])
@settings(max_examples=20, deadline=None)
@given(threads=threads, shape=conv_shapes, seed=st.integers(0, 2**16), with_dot=st.booleans())
def test_scale_and_dot_matches_torch(layout, threads, shape, seed, with_dot):
    batch, groups, per_group, h, w = shape
    gz = _planes(batch, groups, per_group, h, w, seed, layout)
    z = _planes(batch, groups, per_group, h, w, seed + 1, layout)
    r = _data(batch * groups * h, w, seed + 2).reshape(batch, groups, h, w).abs()
    with intra_op_threads(threads):
        gy, e = _fused.scale_and_dot(gz, z, r, groups, with_dot)
    grouped = lambda v: v.unflatten(1, (groups, per_group))  # noqa: E731
    torch.testing.assert_close(gy, (grouped(gz) * r.unsqueeze(2)).flatten(1, 2), **TOL)
    assert gy.is_contiguous(memory_format=layout)
    if with_dot:
        torch.testing.assert_close(e, -r * r * (grouped(gz) * grouped(z)).sum(2), **TOL)
    else:
        assert e is None


# channels and positions past the vector blocks (8 float32 channels × 16 positions, 4 × 8 in
# float64), past a 64-position tile and past the parallel grain, with ragged edges on all
cross_layout_shapes = st.tuples(st.integers(0, 5), st.integers(1, 3), st.integers(1, 20), st.integers(1, 16),
                                st.integers(1, 16))


@needs_kernels
@pytest.mark.parametrize("dtype", [F64, torch.float32])
@settings(max_examples=25, deadline=None)
@given(threads=threads, shape=cross_layout_shapes, seed=st.integers(0, 2**16), with_dot=st.booleans())
@example(threads=2, shape=(5, 2, 20, 16, 16), seed=0, with_dot=True)  # both threads, ragged groups
def test_passes_across_layouts_match_torch(dtype, threads, shape, seed, with_dot):
    batch, groups, per_group, h, w = shape
    gz, z, d = (_planes(batch, groups, per_group, h, w, seed + i, torch.contiguous_format).to(dtype) for i in range(3))
    d = d.contiguous(memory_format=torch.channels_last)
    r = _data(batch * groups * h, w, seed + 3).reshape(batch, groups, h, w).abs().to(dtype)
    into, out = torch.empty_like(gz), torch.empty_like(gz)
    with intra_op_threads(threads):
        gy, e = _fused.scale_and_dot(gz, z, r, groups, with_dot, to_channels_last=True)
        copy = _fused.channels_last_copy(z, into=into)
        updated = _fused.group_update_from_channels_last(d, r, groups, src=z, out=out)
    grouped = lambda v: v.unflatten(1, (groups, per_group)).double()  # noqa: E731
    # one product or none: exact in any dtype
    assert torch.equal(gy, (gz.unflatten(1, (groups, per_group)) * r.unsqueeze(2)).flatten(1, 2))
    assert torch.equal(copy, z)
    assert gy.is_contiguous(memory_format=torch.channels_last) and copy.is_contiguous(memory_format=torch.channels_last)
    assert copy.data_ptr() == into.data_ptr() and updated is out and out.is_contiguous()
    # a sum of n terms is within (n + 2)·u·Σ|terms| of the exact one (u = unit roundoff), and so
    # is the float64 reference in float64: the bounds allow both
    u = torch.finfo(dtype).eps / 2
    expected = (grouped(d) + grouped(z) * r.double().unsqueeze(2)).flatten(1, 2)
    bound = 4 * u * (grouped(d).abs() + (grouped(z) * r.double().unsqueeze(2)).abs()).flatten(1, 2)
    assert bool(((updated.double() - expected).abs() <= bound).all())
    if with_dot:
        r2 = r.double() ** 2
        exact, terms = -r2 * (grouped(gz) * grouped(z)).sum(2), r2 * (grouped(gz) * grouped(z)).abs().sum(2)
        assert bool(((e.double() - exact).abs() <= (2 * per_group + 6) * u * terms).all())
    else:
        assert e is None


@needs_kernels
@pytest.mark.parametrize("d", [1, 2])
@settings(max_examples=25, deadline=None)
@given(threads=threads, size=st.integers(1, 12), kernel=st.integers(1, 4), stride=st.integers(1, 3),
       padding=st.integers(0, 3), dilation=st.integers(1, 3), planes=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_box_and_its_transpose_match_torch_convolutions(d, threads, size, kernel, stride, padding, dilation, planes,
                                                        seed):
    extent = dilation * (kernel - 1) + 1
    if size + 2 * padding < extent:
        return  # no output position (the layer rejects this geometry before any kernel runs)
    spatial = (size,) * d
    geometry = ((kernel,) * d, (stride,) * d, (padding,) * d, (dilation,) * d)
    sq = _data(planes, size**d, seed).abs().reshape(1, planes, *spatial)
    ones = torch.ones(planes, 1, *geometry[0], dtype=F64)
    conv = torch.convolution(sq, ones, None, *geometry[1:], False, [0] * d, planes)
    with intra_op_threads(threads):
        r = _fused.box(sq, conv.shape[2:], *geometry)
    torch.testing.assert_close(r, 1 / torch.sqrt(conv + 1), **TOL)
    # the transpose is the adjoint: <box(a), b> = <a, boxᵀ(b)>, here against torch's transposed convolution
    e = _data(planes, conv[0, 0].numel(), seed + 1).reshape(conv.shape)
    extra = [n - ((o - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1)
             for n, o in zip(spatial, conv.shape[2:])]
    expected = torch.convolution(e, ones, None, *geometry[1:], True, extra, planes)
    with intra_op_threads(threads):
        torch.testing.assert_close(_fused.box_transpose(e, spatial, *geometry), expected, **TOL)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_group_squares_flags_samples_it_cannot_convolve_safely(dtype):
    x = torch.ones(3, 2, 4, 4, dtype=dtype)
    assert _fused.group_squares(x, 2)[1]
    x[1, 0, 0, 0] = 2 * math.sqrt(torch.finfo(dtype).max)
    assert not _fused.group_squares(x, 2)[1]
    x[1, 0, 0, 0] = float("inf")
    assert not _fused.group_squares(x, 1)[1]


CONV_GEOMETRIES = [dict(kernel_size=3, padding=1), dict(kernel_size=3, stride=2, dilation=2, padding=(1, 2), groups=2),
                   dict(kernel_size=(2, 3), padding="same", groups=4), dict(kernel_size=1)]


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "channels_last"])
@pytest.mark.parametrize("kwargs", CONV_GEOMETRIES)
@pytest.mark.parametrize("bias", [True, False])
def test_patchnorm_conv2d_agrees_with_and_without_kernels(layout, kwargs, bias):
    x = _data(3 * 8 * 7, 6, 0).reshape(3, 8, 7, 6).contiguous(memory_format=layout)

    def run():
        torch.manual_seed(1)
        layer = PatchNormConv2d(8, 4, bias=bias, dtype=F64, **kwargs).to(memory_format=layout)
        xi = x.detach().requires_grad_(True)
        z = layer(xi)
        z.backward(_data(z.numel(), 1, 2).reshape(z.shape))
        return [z.detach(), xi.grad] + [p.grad for p in layer.parameters()]

    fused = run()
    with _fused.disabled():
        plain = run()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, **TOL)


@needs_kernels
@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "channels_last"])
def test_patchnorm_gradcheck_through_the_kernels(layout, monkeypatch, python_functions):
    calls = _count_calls(monkeypatch, ("group_squares", "box", "scale_and_dot", "box_transpose", "group_update_"))
    x = _data(2 * 4 * 5, 5, 0).reshape(2, 4, 5, 5).contiguous(memory_format=layout).requires_grad_()
    w, b = _data(6 * 2 * 9, 1, 1).reshape(6, 2, 3, 3).requires_grad_(), _data(6, 1, 2)[:, 0].requires_grad_()
    fn = lambda x, w, b: LF.patchnorm_conv2d(x, w, b, stride=1, padding=1, groups=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), atol=1e-7, rtol=1e-7)
    assert {"group_squares", "box", "scale_and_dot", "box_transpose", "group_update_"} <= set(calls)


def _count_calls(monkeypatch, names) -> list[str]:
    """The names of the ``_fused`` functions called from now on, in order."""
    calls = []
    for name in names:
        original = getattr(_fused, name)
        monkeypatch.setattr(_fused, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    return calls


NCHW_GEOMETRIES = [dict(kernel_size=3, stride=2, padding=1, groups=2), dict(kernel_size=1),
                   dict(kernel_size=(2, 3), padding=(1, 0), dilation=(2, 1), groups=4)]


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN")


@needs_kernels
@needs_onednn
@pytest.mark.parametrize("kwargs", NCHW_GEOMETRIES)
@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (False, True), (True, False)])
def test_float32_nchw_backward_convolves_channels_last(kwargs, x_grad, w_grad, monkeypatch, python_functions):
    # A float32 NCHW layer's backward convolution runs channels_last (as inductor's, for oneDNN);
    # gradients come back in the layouts of x and W and differ from the NCHW convolution's only
    # by the two convolutions' rounding. Each of dx, dW, db is a sum of n float32 products, off
    # by at most (n + 2)·u·Σ|terms| in either path (Higham; u = 2^-24), with |gy| = r·|g| ≤ |g|
    # (r ≤ 1); dx then adds x·dsq2 (identical in both paths), one or two more roundings each.
    x = _data(3 * 16 * 9, 7, 0).reshape(3, 16, 9, 7).float()
    def layer_of():
        layer = PatchNormConv2d(16, 16, **kwargs)
        layer.weight.requires_grad_(w_grad)
        return layer

    torch.manual_seed(1)
    out_shape = layer_of()(x).shape
    grad = _data(math.prod(out_shape), 1, 1).reshape(out_shape).float()
    policy = _autograd._channels_last_backward

    def run(channels_last):
        monkeypatch.setattr(_autograd, "_channels_last_backward", policy if channels_last else lambda *a: False)
        torch.manual_seed(1)
        layer = layer_of()
        xi = x.detach().requires_grad_(x_grad)
        z = layer(xi)
        wanted = [t for t, w in ((xi, x_grad), (layer.weight, w_grad), (layer.bias, True)) if w]
        grads = dict(zip(("x" * x_grad + "w" * w_grad + "b"), torch.autograd.grad(z, wanted, grad)))
        return z.detach(), grads, layer

    calls = _count_calls(monkeypatch, ("channels_last_copy", "group_update_from_channels_last"))
    z, grads, layer = run(True)
    assert calls == ["channels_last_copy"] * w_grad + ["group_update_from_channels_last"] * x_grad
    z0, plain, _ = run(False)
    assert torch.equal(z, z0)  # (the forward does not change)
    u, geometry = 2.0**-24, (layer.stride, layer.padding, layer.dilation, False, [0, 0], layer.groups)
    dx_terms, dw_terms, db_terms = torch.ops.aten.convolution_backward(
        grad.double().abs(), x.double().abs(), layer.weight.detach().double().abs(), [16], *geometry, [True] * 3)
    n_x = 16 // layer.groups * math.prod(layer.kernel_size)
    n_w = out_shape[0] * math.prod(out_shape[2:])
    assert bool(((grads["b"] - plain["b"]).abs() <= 2 * (n_w + 2) * u * db_terms).all())
    if w_grad:
        assert grads["w"].is_contiguous()  # (as the weight: oneDNN returns it channels_last)
        assert bool(((grads["w"] - plain["w"]).abs() <= 2 * (n_w + 2) * u * dw_terms).all())
    if x_grad:
        assert grads["x"].is_contiguous()
        bound = (2 * (n_x + 2) + 8) * u * dx_terms + 4 * u * plain["x"].double().abs()
        assert bool(((grads["x"].double() - plain["x"].double()).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("dtype, mkldnn", [(torch.float32, False), (F64, True)])
def test_backward_convolution_keeps_nchw_without_onednn_or_in_float64(dtype, mkldnn, monkeypatch,
                                                                     python_functions):
    # float64 convolutions do not go to oneDNN (same cost in both layouts): no transposes
    calls = _count_calls(monkeypatch, ("scale_and_dot", "channels_last_copy", "group_update_from_channels_last"))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", mkldnn)
    x = _data(2 * 8 * 6, 6, 0).reshape(2, 8, 6, 6).to(dtype).requires_grad_()
    PatchNormConv2d(8, 8, 3, padding=1, dtype=dtype)(x).sum().backward()
    assert calls == ["scale_and_dot"] and x.grad.is_contiguous()  # (the fused backward ran, in NCHW)


# --------------------------------------------------------------------------------------------
# where the compiled passes must not run, or must agree at the edges of their formulas


@needs_kernels
@pytest.mark.parametrize("dtype, eps", [(torch.float32, 1e-12), (F64, 1e-12), (F64, 1e-200)])
@pytest.mark.parametrize("mode", ["l2", "rms"])
def test_norm_like_constant_branch_matches_the_torch_formula_in_its_own_dtype(dtype, eps, mode):
    # rows with 0 < ‖x‖ ≤ eps and 0 take n(x) = k·x/eps (no radial term); k/eps is compared in the
    # tensor's dtype (float32: 1/1e-12 rounds below 1e12); (k/eps)² may overflow float64
    x = _data(4, 5, 0).to(dtype)
    x[0] *= 0.5 * eps / x[0].norm()
    x[1] = 0.0
    w, grad = _data(3, 5, 1).to(dtype), _data(4, 3, 2).to(dtype)

    def grads():
        xi = x.clone().requires_grad_(True)
        LF.norm_like(xi, w, None, mode=mode, eps=eps).backward(grad)
        return xi.grad

    fused = grads()
    with _fused.disabled():
        plain = grads()
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, plain, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["nchw", "channels_last"])
def test_patchnorm_under_vmap_with_any_input_layout(layout):
    torch.manual_seed(0)
    layer = PatchNormConv2d(4, 6, 3, padding=1, groups=2, dtype=F64)
    x = torch.randn(2, 3, 4, 5, 5, dtype=F64)  # vmapped over dim 1
    if layout == torch.channels_last:
        x = torch.stack([x[:, i].contiguous(memory_format=layout) for i in range(3)], dim=1)
    batched = torch.func.vmap(layer, in_dims=1)(x)
    looped = torch.stack([layer(x[:, i]) for i in range(3)])
    torch.testing.assert_close(batched, looped, **TOL)


@pytest.mark.parametrize("make", [lambda: AffineLike(5, 3, dtype=F64), lambda: NormLike(5, 3, mode="rms", dtype=F64)],
                         ids=["affine_like", "norm_rms"])
def test_vectorised_jacobians_equal_the_looped_ones(make):
    # vectorize=True feeds the backward legacy batched gradients, which have no storage
    layer, x = make(), _data(4, 5, 0)
    fn = lambda t: layer(t)  # noqa: E731
    looped = torch.autograd.functional.jacobian(fn, x)
    torch.testing.assert_close(torch.autograd.functional.jacobian(fn, x, vectorize=True), looped, **TOL)


def test_dispatch_modes_see_every_op():
    # under a dispatch mode the compiled passes (invisible to it) must not run: the torch ops do
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    layer, x = AffineLike(8, 4), torch.randn(3, 8)
    with torch.no_grad():
        expected = layer(x)
        with Recorder() as recorder:
            got = layer(x)
    assert any("norm" in op for op in recorder.ops), recorder.ops  # ‖x‖ computed by a torch op
    torch.testing.assert_close(got, expected)


def test_fake_tensors_never_reach_the_compiled_passes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert not _fused.plain(FakeTensorMode().from_tensor(torch.randn(2, 3)))
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        assert not _fused.usable(torch.randn(2, 3))  # a dispatch mode is active


@needs_kernels
def test_channels_last_grouped_backward_takes_the_fused_radial_update(monkeypatch, python_functions):
    calls = []
    original = _fused.group_update_
    monkeypatch.setattr(_fused, "group_update_", lambda *a, **k: calls.append("src" in k) or original(*a, **k))
    x = _data(2 * 4 * 5, 5, 0).reshape(2, 4, 5, 5).contiguous(memory_format=torch.channels_last).requires_grad_()
    LF.patchnorm_conv2d(x, _data(6 * 2 * 9, 1, 1).reshape(6, 2, 3, 3), None, padding=1, groups=2).sum().backward()
    assert calls == [False, True]  # the forward's output scaling, then the backward's dx update

"""The corrected layers' C++ autograd nodes (``affdiv.layers._native``).

The nodes claim to be the Python Functions of ``_autograd`` branch for branch, so the checks are
exact: every output, first-order gradient and second-order gradient of a node equals the Python
Function's to the bit (``torch.equal``), on the fused row passes (node vs Function with the
passes) and on the plain-torch passes (node without the passes vs Function inside
``_fused.disabled()``), over hypothesis-drawn shapes (empty batches included), dtypes, biases,
which inputs need a gradient, and rows whose ‖x‖² overflows or is NaN. Any reordered operation
breaks bit-equality. gradcheck and gradgradcheck hold the nodes to finite differences in float64
on their own. The routing checks say which calls take the nodes: plain eager CPU calls, and no
call the nodes cannot serve (forward-mode AD, torch.func, dispatch modes, half precision), and
that a backward fed tangents (forward-over-reverse) keeps them.

The PatchNorm convolution's node is the Function's fused branch, so it is held to the Function
with its passes, bit for bit, over hypothesis-drawn geometries (kernel, stride, padding, dilation,
groups), layouts, dtypes and empty batches; and so are its backwards that call the Function's (a
graph being built, its output changed in place, a second backward), which are counted, as are the
backwards that stay on its fused branch (a gradient in another layout or not contiguous). Calls of
the other branches (rescaled squares, ``recompute``, saved-tensor hooks, 1-D) do not take it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from affdiv.layers import AffineLike, NormLike, PatchNormConv2d, _autograd, _fused, _native
from affdiv.layers import functional as LF

needs_nodes = pytest.mark.skipif(not _native.available(), reason="the C++ autograd nodes were not built for this torch")

DENSE = {
    "affine_like": lambda x, w, b: LF.affine_like(x, w, b),
    "norm_l2": lambda x, w, b: LF.norm_like(x, w, b, mode="l2"),
    "norm_rms": lambda x, w, b: LF.norm_like(x, w, b, mode="rms"),
    # the constant branch q = k/eps, taken by the rows of norm ≤ eps (k = √m for rms: a "small" row)
    "norm_l2_large_eps": lambda x, w, b: LF.norm_like(x, w, b, mode="l2", eps=0.5),
    "norm_rms_large_eps": lambda x, w, b: LF.norm_like(x, w, b, mode="rms", eps=0.5),
}
PYTHON = [_native.disabled]  # the Python Functions, with the row passes
PYTHON_PLAIN = [_native.disabled, _fused.disabled]  # the Python Functions' plain-torch passes
NODES_PLAIN = [_native.without_passes]


def test_nodes_were_built_where_required():
    # tox sets AFFDIV_REQUIRE_CPU_KERNELS=1: there, a silently failed (optional) build is an error
    if os.environ.get("AFFDIV_REQUIRE_CPU_KERNELS") != "1":
        pytest.skip("AFFDIV_REQUIRE_CPU_KERNELS is not set: the C++ nodes are optional here")
    assert _native.available(), "the C++ extension affdiv.layers._autograd_nodes was not built for this torch"
    assert _native.passes_bound(), "the C++ nodes did not bind the fused passes"


def test_onednn_was_bound_exactly_where_the_processor_has_its_float32_path():
    # tox: the extension binds torch's oneDNN matmul where a small product through it matches
    # torch's; on x86 its float32 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
    if os.environ.get("AFFDIV_REQUIRE_CPU_KERNELS") != "1":
        pytest.skip("AFFDIV_REQUIRE_CPU_KERNELS is not set: the C++ extension is optional here")
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("the processor's features are read from /proc/cpuinfo on x86 only")
    if {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"} & set(os.environ):
        pytest.skip("oneDNN's instruction set is capped by the environment")
    flags = set(next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "").split())
    has_path = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert _native.onednn_enabled() == (torch.backends.mkldnn.is_available() and has_path)


@needs_nodes
def test_a_processor_without_onednns_float32_path_keeps_torchs_products():
    # oneDNN told to use AVX2 at most, as on a processor without AVX-512: its float32 matmul
    # raises there, so the self-test must refuse it and the engine's products must be torch's
    # (and the self-test waits for the first use: an import runs no product)
    # (any product would take oneDNN, on any processor)
    script = ("import torch; from affdiv.layers import _native; from affdiv.experiments.runs import stacked_matmul; "
              "stacked_matmul.ONEDNN_MIN_FLOPS = 0; stacked_matmul.ONEDNN_PREFERRED = True; "
              "a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5); print(_native._onednn['bound']); "
              "print(_native.onednn_enabled(), torch.equal(stacked_matmul.baddbmm(None, a, b), torch.bmm(a, b)))")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "False", "True"]


def _results(fn, x, w, b, grad, contexts):
    """[z, first-order grads, second-order grads of Σ(first-order)²] of the inputs that need a
    gradient, and the name of z's grad_fn, with every context of ``contexts`` entered."""
    inputs = [t for t in (x, w, b) if t is not None and t.requires_grad]
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        z = fn(x, w, b)
        first = torch.autograd.grad(z, inputs, grad, allow_unused=True)
        again = torch.autograd.grad(fn(x, w, b), inputs, grad, create_graph=True, allow_unused=True)
        total = sum((g * g).sum() for g in again if g is not None and g.requires_grad)
        second = torch.autograd.grad(total, inputs, allow_unused=True) if torch.is_tensor(total) else ()
    return [z, *first, *second], type(z.grad_fn).__name__


def _assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert (p is None) == (q is None)
        if p is not None:
            assert p.dtype == q.dtype and p.shape == q.shape
            assert torch.equal(p, q) or (p.isnan() == q.isnan()).all() and torch.equal(p.nan_to_num(), q.nan_to_num())


def _case(rows, m, n, dtype, bias, needs, seed, row_kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, m, dtype=dtype, generator=g)
    if rows and row_kind == "zero":
        x[0] = 0.0
    elif rows and row_kind == "small":  # ‖x‖ = 0.75: inside eps = 0.5 times k = √m for m ≥ 3
        x[0] *= 0.75 / x[0].norm()
    elif rows and row_kind == "huge":  # ‖x‖² overflows: the rescaled forward
        x[0] = torch.finfo(dtype).max / 4
    elif rows and row_kind == "nan":
        x[0, 0] = float("nan")
    w = torch.randn(n, m, dtype=dtype, generator=g)
    b = torch.randn(n, dtype=dtype, generator=g) if bias else None
    for t, need in zip((x, w, b), needs):
        if t is not None:
            t.requires_grad_(need)
    return x, w, b, torch.randn(rows, n, dtype=dtype, generator=g)


cases = dict(rows=st.integers(0, 40), m=st.integers(1, 24), n=st.integers(1, 12),
             dtype=st.sampled_from([torch.float32, torch.float64]), bias=st.booleans(),
             needs=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any), seed=st.integers(0, 2**16),
             row_kind=st.sampled_from(["normal", "zero", "small", "huge", "nan"]))


@needs_nodes
@pytest.mark.parametrize("member", sorted(DENSE))
@given(**cases)
@example(rows=3, m=4, n=2, dtype=torch.float32, bias=True, needs=(True, True, True), seed=0, row_kind="normal")
@example(rows=3, m=4, n=2, dtype=torch.float64, bias=True, needs=(True, True, True), seed=0, row_kind="small")
def test_nodes_equal_the_python_functions_bit_for_bit(member, rows, m, n, dtype, bias, needs, seed, row_kind):
    x, w, b, grad = _case(rows, m, n, dtype, bias, needs, seed, row_kind)
    if b is None and not any(needs[:2]):
        return
    fn = DENSE[member]
    node, node_fn = _results(fn, x, w, b, grad, [])
    python, python_fn = _results(fn, x, w, b, grad, PYTHON)
    assert node_fn == "CppFunction" and python_fn != "CppFunction"  # (each side took the path it names)
    _assert_bitwise_equal(node, python)
    node_plain, _ = _results(fn, x, w, b, grad, NODES_PLAIN)
    python_plain, _ = _results(fn, x, w, b, grad, PYTHON_PLAIN)
    _assert_bitwise_equal(node_plain, python_plain)


@needs_nodes
@pytest.mark.parametrize("member", sorted(DENSE))
@pytest.mark.parametrize("contexts", [[], NODES_PLAIN], ids=["row passes", "plain torch"])
def test_nodes_pass_gradcheck_and_gradgradcheck(member, contexts):
    x, w, b, _ = _case(6, 5, 3, torch.float64, True, (True, True, True), 7, "normal")
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        assert type(DENSE[member](x, w, b).grad_fn).__name__ == "CppFunction"
        assert torch.autograd.gradcheck(DENSE[member], (x, w, b))
        assert torch.autograd.gradgradcheck(DENSE[member], (x, w, b))


@needs_nodes
@pytest.mark.parametrize("member", sorted(DENSE))
def test_non_contiguous_inputs_take_the_nodes_plain_passes(member):
    x, w, b, grad = _case(5, 4, 3, torch.float64, True, (True, True, True), 3, "normal")
    x_t = x.detach().t().contiguous().t().requires_grad_()  # column-major: not contiguous
    w_t = w.detach().t().contiguous().t().requires_grad_()
    node, name = _results(DENSE[member], x_t, w_t, b, grad, [])
    python, _ = _results(DENSE[member], x_t, w_t, b, grad, PYTHON)
    assert name == "CppFunction"
    _assert_bitwise_equal(node, python)


@pytest.mark.parametrize("make, shape", [(lambda: AffineLike(6, 3), (5, 6)), (lambda: NormLike(6, 3), (5, 6)),
                                         (lambda: PatchNormConv2d(2, 3, 3, padding=1), (2, 2, 5, 5))])
def test_a_lazily_negated_input_is_read_as_its_values(make, shape):
    # torch._neg_view(a) reads as −a, but its storage holds a: a pass that read the storage (the
    # C++ nodes', the Python Functions' fused passes) would take it for a
    layer = make().double()
    a = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = []
    for x in (torch._neg_view(a).requires_grad_(), (-a).requires_grad_()):
        y = layer(x)
        grads = torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])
        results.append((y, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_nodes
@pytest.mark.parametrize("make", [lambda: AffineLike(4, 3), lambda: NormLike(4, 3, mode="rms")])
def test_eager_cpu_calls_take_the_nodes_and_others_the_python_functions(make):
    layer, x = make().double(), torch.randn(2, 5, 4, dtype=torch.float64)
    assert type(layer(x[0]).grad_fn).__name__ == "CppFunction"
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x[0], torch.ones_like(x[0]))
        assert "CppFunction" not in type(layer(dual).grad_fn).__name__
    w, b = layer.weight, layer.bias
    assert _native.affine_like(x[0].half(), w.half(), None) is None
    assert _native.norm_like(x[0].to(torch.bfloat16), w.to(torch.bfloat16), None, 1.0, 1e-12) is None
    assert _native.affine_like(x[0], w.float(), None) is None  # (mixed dtypes: the Python path names the error)
    assert _native.affine_like(x, w, b) is None  # not 2-D
    assert _native.affine_like(x[0].to("meta"), w.to("meta"), None) is None
    assert _native.affine_like(x[0].to_sparse(), w, b) is None and _native.affine_like(x[0], w.to_sparse(), b) is None
    assert _native.affine_like(x[0].float().to_mkldnn(), w.float().to_mkldnn(), None) is None
    assert _native.affine_like(x[0], w, b) is not None
    seen = []
    torch.func.vmap(lambda row: seen.append(_native.affine_like(row[None], w, b)) or row)(x[0])
    assert seen == [None]
    with FlopCounterMode(display=False):
        assert _native.affine_like(x[0], w, b) is None
    with _fused.disabled():
        assert _native.affine_like(x[0], w, b) is None


@needs_nodes
@pytest.mark.parametrize("member", sorted(DENSE))
def test_forward_over_reverse_through_a_node_keeps_the_tangents(member):
    # a backward fed dual gradients: the row passes would drop the tangents, the node must not use them
    x, w, b, grad = _case(4, 3, 2, torch.float64, True, (True, True, True), 11, "normal")
    tangent = torch.randn_like(grad)

    def directional(contexts):
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            z = DENSE[member](x, w, b)
            with torch.autograd.forward_ad.dual_level():
                dx, = torch.autograd.grad(z, x, torch.autograd.forward_ad.make_dual(grad, tangent))
                return torch.autograd.forward_ad.unpack_dual(dx).tangent

    node = directional([])
    assert node is not None and node.abs().sum() > 0
    torch.testing.assert_close(node, directional(PYTHON_PLAIN), rtol=1e-12, atol=1e-12)


@needs_nodes
def test_saved_tensor_hooks_see_what_the_nodes_save():
    x, w, b, _ = _case(3, 4, 2, torch.float64, True, (True, True, True), 5, "normal")
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        LF.affine_like(x, w, b).sum().backward()
    assert sorted(packed) == sorted([x.shape, w.shape, b.shape, torch.Size([3, 1])])  # x, W, b and the scale r


@needs_nodes
def test_an_extension_built_for_another_torch_is_not_used(monkeypatch):
    monkeypatch.setattr(_native, "_running_torch", lambda: (0, 0, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _native._load() is None
    assert any("built for torch" in str(w.message) for w in caught)


@needs_nodes
def test_an_extension_of_another_python_interface_is_not_used(monkeypatch):
    monkeypatch.setattr(_native, "PYTHON_INTERFACE", _native.PYTHON_INTERFACE + 1)
    with pytest.warns(UserWarning, match="stale build"):
        assert _native._load() is None


@pytest.mark.parametrize("make", [lambda: AffineLike(4, 3), lambda: NormLike(4, 3, mode="rms")])
def test_a_traced_layer_computes_the_layer_on_new_inputs(make):
    # torch.jit.trace records a C++ node's torch ops but not its row passes: tracing must keep the
    # Python Functions (recorded as one call), or the traced module would drop the scale
    layer, x = make(), torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the tracer's warnings about Python ops)
        traced = torch.jit.trace(layer, x)
    fresh = 7 * torch.randn(6, 4)
    assert torch.equal(traced(fresh), layer(fresh))


@pytest.mark.parametrize("make", [lambda: AffineLike(4, 3), lambda: NormLike(4, 3, mode="l2")])
def test_no_grad_and_inference_mode_give_the_recorded_forward(make):
    layer, x = make(), torch.randn(5, 4)
    with _native.disabled():
        recorded = layer(x)  # (the Python Function, recording a graph)
    with torch.no_grad():
        assert torch.equal(layer(x), recorded)
    with torch.inference_mode():
        assert torch.equal(layer(x), recorded)


@needs_nodes
@pytest.mark.parametrize("member", sorted(DENSE))
@pytest.mark.parametrize("wrt", [0, 1, 2], ids=["dx", "dW", "db"])
def test_a_gradient_of_one_input_equals_the_python_functions(member, wrt):
    # a node computes what the backward asks for, a Python Function what required a gradient
    x, w, b, grad = _case(6, 4, 3, torch.float32, True, (True, True, True), 13, "normal")
    node = torch.autograd.grad(DENSE[member](x, w, b), (x, w, b)[wrt], grad, allow_unused=True)
    with _native.disabled():
        python = torch.autograd.grad(DENSE[member](x, w, b), (x, w, b)[wrt], grad, allow_unused=True)
    _assert_bitwise_equal(node, python)


class _Subclass(torch.Tensor):
    pass


@needs_nodes
def test_tensor_subclasses_keep_the_python_functions():
    x, w, b, _ = _case(3, 4, 2, torch.float64, True, (False, False, False), 17, "normal")
    sub = x.as_subclass(_Subclass)
    assert _native.affine_like(sub, w, b) is None
    assert _native.norm_like(x, w.as_subclass(_Subclass), b, 1.0, 0.5) is None
    z = LF.affine_like(sub, w, b)
    assert type(z) is _Subclass  # (its type survives, as through the Python Function)
    with _native.disabled(), _fused.disabled():  # (a subclass takes the Python Function's torch ops)
        assert torch.equal(z.as_subclass(torch.Tensor), LF.affine_like(x, w, b))


@needs_nodes
def test_anomaly_mode_sees_the_nodes_and_their_gradients_unchanged():
    x, w, b, grad = _case(4, 3, 2, torch.float64, True, (True, True, True), 19, "normal")
    with torch.autograd.detect_anomaly(check_nan=True):
        node, name = _results(DENSE["affine_like"], x, w, b, grad, [])
        python, _ = _results(DENSE["affine_like"], x, w, b, grad, PYTHON)
    assert name == "CppFunction"
    _assert_bitwise_equal(node, python)


# --------------------------------------------------------------------------------------------
# the PatchNorm convolution's node (its fused branch; every other branch calls the Function's)

def _conv_fn(stride, padding, dilation, groups):
    return lambda x, w, b: LF.patchnorm_conv2d(x, w, b, stride, padding, dilation, groups)


def _conv_case(batch, groups, per_group, out_per_group, size, kernel, dtype, channels_last, bias, needs, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, groups * per_group, *size, dtype=dtype, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(groups * out_per_group, per_group, *kernel, dtype=dtype, generator=g)
    b = torch.randn(groups * out_per_group, dtype=dtype, generator=g) if bias else None
    for t, need in zip((x, w, b), needs):
        if t is not None:
            t.requires_grad_(need)
    return x, w, b, g


conv_cases = dict(batch=st.integers(0, 3), groups=st.integers(1, 3), per_group=st.integers(1, 3),
                  out_per_group=st.integers(1, 3), size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
                  kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)), stride=st.integers(1, 2),
                  padding=st.integers(0, 2), dilation=st.integers(1, 2),
                  dtype=st.sampled_from([torch.float32, torch.float64]), channels_last=st.booleans(),
                  bias=st.booleans(), needs=st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(any),
                  seed=st.integers(0, 2**16))


@needs_nodes
@given(**conv_cases)
@example(batch=2, groups=2, per_group=2, out_per_group=3, size=(7, 6), kernel=(3, 3), stride=1, padding=1, dilation=1,
         dtype=torch.float32, channels_last=False, bias=True, needs=(True, True, True), seed=0)
@example(batch=2, groups=1, per_group=3, out_per_group=2, size=(8, 8), kernel=(3, 2), stride=2, padding=1, dilation=2,
         dtype=torch.float64, channels_last=True, bias=True, needs=(True, False, True), seed=1)
def test_the_conv_node_equals_the_python_function_bit_for_bit(batch, groups, per_group, out_per_group, size, kernel,
                                                              stride, padding, dilation, dtype, channels_last, bias,
                                                              needs, seed):
    # z, dx, dW, db and the second-order gradients (a graph being built: the node's backward calls
    # the Function's), node against the Function, in both layouts, both dtypes, every geometry
    x, w, b, g = _conv_case(batch, groups, per_group, out_per_group, size, kernel, dtype, channels_last, bias, needs,
                            seed)
    assume(b is not None or any(needs[:2]))
    assume(all(n + 2 * padding >= dilation * (k - 1) + 1 for n, k in zip(size, kernel)))
    fn = _conv_fn(stride, padding, dilation, groups)
    grad = torch.randn(fn(x, w, b).shape, dtype=dtype, generator=g)
    node, node_fn = _results(fn, x, w, b, grad, [])
    python, python_fn = _results(fn, x, w, b, grad, PYTHON)
    assert node_fn == "CppFunction" and python_fn != "CppFunction"
    _assert_bitwise_equal(node, python)


def _conv_results(x, w, b, grad, contexts, consume=lambda z: z, retain=False):
    """z and (dx, dW, db) of a PatchNorm convolution whose output goes through ``consume``, and the
    name of its grad_fn; with ``retain``, the gradients of a second backward through the same graph."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        z = LF.patchnorm_conv2d(x, w, b, padding=1, groups=2)
        name = type(z.grad_fn).__name__
        out = consume(z)
        first = torch.autograd.grad(out, (x, w, b), grad, retain_graph=retain)
        again = torch.autograd.grad(out, (x, w, b), grad) if retain else ()
    return [z.detach(), *first, *again], name


@pytest.fixture
def python_backwards(monkeypatch):
    """The calls of the Function's backward (``_autograd.patchnorm_conv_grads``), which the node's
    backward looks up at each fallback: a list of the grad mode of each call."""
    calls, real = [], _autograd.patchnorm_conv_grads
    monkeypatch.setattr(_autograd, "patchnorm_conv_grads",
                        lambda *args: calls.append(torch.is_grad_enabled()) or real(*args))
    return calls


@needs_nodes
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("case, falls_back", [("output changed in place", 1), ("second backward", 1),
                                              ("gradient in the other layout", 0), ("non-contiguous gradient", 0)])
def test_the_conv_nodes_other_backwards_equal_the_python_functions(layout, case, falls_back, python_backwards):
    # z changed in place, or released by the first backward: the node calls the Function's backward,
    # which computes z again; a gradient in another layout: the node's own branch, made contiguous
    x, w, b, g = _conv_case(3, 2, 2, 2, (6, 5), (3, 3), torch.float32, layout == torch.channels_last, True,
                            (True, True, True), 23)
    grad = torch.randn(3, 4, 6, 5, generator=g)
    consume, retain = lambda z: z, False
    if case == "output changed in place":
        consume = lambda z: z.mul_(2).relu_()  # noqa: E731  (the mul_: a relu_ alone keeps Σ gz·z)
    elif case == "gradient in the other layout":
        other = torch.contiguous_format if layout == torch.channels_last else torch.channels_last
        grad = grad.contiguous(memory_format=other)
    elif case == "second backward":
        retain = True
    else:
        grad = grad.transpose(2, 3).contiguous().transpose(2, 3)
    node, name = _conv_results(x, w, b, grad, [], consume, retain)
    assert name == "CppFunction" and len(python_backwards) == falls_back
    python, _ = _conv_results(x, w, b, grad, PYTHON, consume, retain)
    _assert_bitwise_equal(node, python)


@needs_nodes
def test_the_conv_node_takes_its_own_backward_and_the_functions_for_a_graph(python_backwards):
    x, w, b, g = _conv_case(2, 1, 2, 3, (5, 5), (3, 3), torch.float64, False, True, (True, True, True), 41)
    z = LF.patchnorm_conv2d(x, w, b, padding=1)
    torch.autograd.grad(z, (x, w, b), torch.randn(z.shape, dtype=z.dtype, generator=g))
    assert python_backwards == []
    z = LF.patchnorm_conv2d(x, w, b, padding=1)
    torch.autograd.grad(z, (x, w, b), torch.randn(z.shape, dtype=z.dtype, generator=g), create_graph=True)
    assert python_backwards == [True]


@needs_nodes
def test_an_error_in_the_functions_backward_reaches_the_caller_and_the_node_works_after(monkeypatch):
    x, w, b, g = _conv_case(2, 2, 2, 2, (5, 5), (3, 3), torch.float32, False, True, (True, True, True), 43)
    grad = torch.randn(2, 4, 5, 5, generator=g)
    with monkeypatch.context() as patched:
        patched.setattr(_autograd, "patchnorm_conv_grads", lambda *args: (_ for _ in ()).throw(KeyError("inside")))
        z = LF.patchnorm_conv2d(x, w, b, padding=1, groups=2)
        assert type(z.grad_fn).__name__ == "CppFunction"
        with pytest.raises(KeyError, match="inside"):
            z.mul_(2).backward(grad)  # (z changed in place: the Function's backward)
    node, _ = _conv_results(x, w, b, grad, [], lambda z: z.mul_(2))
    python, _ = _conv_results(x, w, b, grad, PYTHON, lambda z: z.mul_(2))
    _assert_bitwise_equal(node, python)


@needs_nodes
@pytest.mark.parametrize("wrt", ["x", "w"])
def test_vectorised_conv_jacobians_equal_the_looped_ones(wrt, python_backwards):
    # vectorize=True feeds the backward legacy batched gradients (here not contiguous: the output is
    # transposed), whose layout cannot be asked (with wrt="w" the node would ask the gradient's, as no
    # z is held): the node passes them to the Function's backward
    x, w, b, _ = _conv_case(2, 1, 2, 2, (4, 3), (3, 3), torch.float64, False, True, (False, False, False), 47)
    if wrt == "x":
        fn, at = (lambda t: LF.patchnorm_conv2d(t, w, b, padding=1).transpose(2, 3)), x
    else:
        fn, at = (lambda t: LF.patchnorm_conv2d(x, t, b, padding=1).transpose(2, 3)), w
    assert type(fn(at.detach().requires_grad_()).grad_fn).__name__ == "TransposeBackward0"
    assert type(fn(at.detach().requires_grad_()).grad_fn.next_functions[0][0]).__name__ == "CppFunction"
    looped = torch.autograd.functional.jacobian(fn, at)  # (with wrt="x", each backward after the first
    before = len(python_backwards)                       # calls the Function's: z was released)
    vectorised = torch.autograd.functional.jacobian(fn, at, vectorize=True)
    assert len(python_backwards) == before + 1
    torch.testing.assert_close(vectorised, looped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("contexts", [pytest.param([], marks=needs_nodes), PYTHON], ids=["node", "Python Function"])
def test_a_conv_under_inference_mode_gives_the_recorded_forward(contexts):
    # (an inference tensor has no version counter: neither path may hold z there)
    x, w, b, _ = _conv_case(2, 1, 2, 3, (5, 5), (3, 3), torch.float32, False, True, (True, True, True), 53)
    geometry = ((1, 1), (1, 1), (1, 1), 1)
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        recorded = LF.patchnorm_conv2d(x, w, b, padding=1)
        with torch.inference_mode():
            assert torch.equal(LF.patchnorm_conv2d(x, w, b, padding=1), recorded)
            assert (_native.patchnorm_conv(x, w, b, *geometry) is not None) == (not contexts)
        with torch.no_grad():
            assert torch.equal(LF.patchnorm_conv2d(x, w, b, padding=1), recorded)


@needs_nodes
def test_the_conv_node_passes_gradcheck_and_gradgradcheck():
    x, w, b, _ = _conv_case(2, 2, 2, 2, (5, 4), (3, 2), torch.float64, False, True, (True, True, True), 29)
    fn = _conv_fn(1, 1, 1, 2)
    assert type(fn(x, w, b).grad_fn).__name__ == "CppFunction"
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


@needs_nodes
def test_eager_cpu_convolutions_take_the_node_and_others_the_python_function():
    x, w, b, _ = _conv_case(2, 1, 3, 4, (6, 6), (3, 3), torch.float64, False, True, (True, True, True), 31)
    geometry = ((1, 1), (1, 1), (1, 1), 1)
    assert type(LF.patchnorm_conv2d(x, w, b, padding=1).grad_fn).__name__ == "CppFunction"
    assert _native.patchnorm_conv(x, w, b, *geometry) is not None
    not_node = {
        "recompute": LF.patchnorm_conv2d(x, w, b, padding=1, recompute=True),
        "1-D": LF.patchnorm_conv1d(x[:, :, 0], w[:, :, 0], b, padding=1),
        "overflowing squares": LF.patchnorm_conv2d(x * torch.finfo(x.dtype).max, w, b, padding=1),
    }
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        not_node["saved-tensor hooks"] = LF.patchnorm_conv2d(x, w, b, padding=1)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x, torch.ones_like(x))
        not_node["forward AD"] = LF.patchnorm_conv2d(dual, w, b, padding=1)
    with _fused.disabled():
        not_node["passes disabled"] = LF.patchnorm_conv2d(x, w, b, padding=1)
    with _native.without_passes():
        not_node["passes unbound"] = LF.patchnorm_conv2d(x, w, b, padding=1)
    assert {name: type(z.grad_fn).__name__ for name, z in not_node.items()} == {
        name: "PatchNormConvFunctionEagerBackward" for name in not_node}
    assert _native.patchnorm_conv(x.float(), w, b, *geometry) is None  # (mixed dtypes: the Python path names it)
    assert _native.patchnorm_conv(x.half(), w.half(), None, *geometry) is None
    assert _native.patchnorm_conv(x.transpose(2, 3), w, b, *geometry) is None  # (not contiguous in a layout)
    assert _native.patchnorm_conv(x.to("meta"), w.to("meta"), None, *geometry) is None
    seen = []
    torch.func.vmap(lambda s: seen.append(_native.patchnorm_conv(s[None], w, b, *geometry)) or s)(x)
    assert seen == [None]
    with FlopCounterMode(display=False):
        assert _native.patchnorm_conv(x, w, b, *geometry) is None


@needs_nodes
@pytest.mark.parametrize("member", [*sorted(DENSE), "patchnorm_conv"])
def test_compiled_autograd_runs_the_nodes_own_backward_bit_for_bit(member, python_backwards):
    # compiled autograd traces the backward graph; a C++ node it cannot trace splits the graph and
    # runs in eager between the compiled pieces: its own backward (not the Function's, counted),
    # with the eager gradients
    if member == "patchnorm_conv":
        x, w, b, g = _conv_case(2, 2, 2, 3, (6, 5), (3, 3), torch.float32, False, True, (True, True, True), 5)
        grad = torch.randn(2, 6, 6, 5, generator=g)
        fn = lambda x, w, b: LF.patchnorm_conv2d(x, w, b, padding=1, groups=2)  # noqa: E731
    else:
        x, w, b, grad = _case(5, 4, 3, torch.float32, True, (True, True, True), 5, "normal")
        fn = DENSE[member]

    def gradients():
        z = fn(x, w, b)
        assert type(z.grad_fn).__name__ == "CppFunction"
        (z * grad).sum().backward()
        out = [t.grad for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        return out

    eager = gradients()
    torch._dynamo.reset()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        compiled = gradients()
    assert python_backwards == []
    _assert_bitwise_equal(compiled, eager)


def test_a_traced_conv_computes_the_layer_on_new_inputs():
    # (as the dense layers': the node's passes would not be recorded)
    layer, x = PatchNormConv2d(2, 3, 3, padding=1), torch.randn(2, 2, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(layer, x)
    fresh = 7 * torch.randn(3, 2, 6, 6)
    assert torch.equal(traced(fresh), layer(fresh))

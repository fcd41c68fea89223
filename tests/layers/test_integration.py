"""The corrected layers behave like torch.nn layers: torch.func, torch.compile, autocast,
state_dict, init, repr, meta-device init, save/load, torch.export, memory saved for backward,
in-place ops on the output, convert() (shared modules included), the optional GPU dispatch.

Float64 comparisons of two evaluations of the same function: rtol = atol = 1e-12 (a few ulp of
O(1) values, with room for the different summation orders of vmap/compile vs eager).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from affdiv.layers import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d, convert
from affdiv.layers import functional as LF

F64 = torch.float64
CLOSE = {"rtol": 1e-12, "atol": 1e-12}

LAYERS = {
    "affine_like": lambda **kw: AffineLike(6, 4, **kw),
    "norm_l2": lambda **kw: NormLike(6, 4, mode="l2", **kw),
    "norm_rms": lambda **kw: NormLike(6, 4, mode="rms", **kw),
    "conv1d": lambda **kw: PatchNormConv1d(2, 4, 3, padding=1, groups=2, **kw),
    "conv2d": lambda **kw: PatchNormConv2d(2, 4, 3, stride=2, padding="valid", **kw),
}
INPUT_SHAPES = {"affine_like": (3, 6), "norm_l2": (3, 6), "norm_rms": (3, 6), "conv1d": (3, 2, 7),
                "conv2d": (3, 2, 7, 5)}


def _layer_and_input(name, dtype=F64, seed=0):
    torch.manual_seed(seed)
    return LAYERS[name](dtype=dtype), 2.0 * torch.randn(*INPUT_SHAPES[name], dtype=dtype)


# --------------------------------------------------------------------------------------------
# torch.func


@pytest.mark.parametrize("name", LAYERS)
def test_vmap_equals_loop(name):
    layer, x = _layer_and_input(name)
    torch.testing.assert_close(vmap(layer)(x), torch.stack([layer(xi) for xi in x]), **CLOSE)


@pytest.mark.parametrize("name", LAYERS)
def test_jacrev_and_functional_call_match_autograd(name):
    layer, x = _layer_and_input(name)
    params = dict(layer.named_parameters())
    jac = jacrev(lambda p, x: functional_call(layer, p, (x,)), argnums=(0, 1))(params, x)
    out = layer(x)
    for _ in range(3):  # rows of the Jacobian by plain reverse mode, one output element at a time
        index = tuple(torch.randint(0, s, (1,)).item() for s in out.shape)
        grads = torch.autograd.grad(layer(x.requires_grad_(True))[index], [*params.values(), x])
        for (pname, _), g in zip(params.items(), grads):
            torch.testing.assert_close(jac[0][pname][index], g, **CLOSE)
        torch.testing.assert_close(jac[1][index], grads[-1], **CLOSE)
        x = x.detach()


@pytest.mark.parametrize("name", ["affine_like", "norm_l2", "conv2d"])
def test_per_sample_gradients_by_vmap_of_grad(name):
    layer, x = _layer_and_input(name)
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(p, xi):
        return functional_call(layer, p, (xi.unsqueeze(0),)).square().sum()

    per_sample = vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        expected = torch.autograd.grad(loss(dict(layer.named_parameters()), x[i]), list(layer.parameters()))
        for (pname, _), g in zip(layer.named_parameters(), expected):
            torch.testing.assert_close(per_sample[pname][i], g, **CLOSE)


# --------------------------------------------------------------------------------------------
# torch.compile (eager / aot_eager backends: the tracing is what can break; inductor is
# exercised by the benchmark, its CPU compile takes about a minute)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", LAYERS)
def test_compile_matches_eager_forward_and_backward(name, backend):
    torch._dynamo.reset()
    layer, x = _layer_and_input(name)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    z1, z2 = layer(x1), compiled(x2)
    torch.testing.assert_close(z2, z1, **CLOSE)
    g = torch.randn_like(z1)
    d1 = torch.autograd.grad(z1, [x1, *layer.parameters()], g)
    d2 = torch.autograd.grad(z2, [x2, *layer.parameters()], g)
    for a, b in zip(d1, d2):
        torch.testing.assert_close(b, a, **CLOSE)


# --------------------------------------------------------------------------------------------
# autocast and dtypes


@pytest.mark.parametrize("name", LAYERS)
def test_autocast_bf16_matches_float64_within_bf16_rounding(name):
    layer, x = _layer_and_input(name, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = layer(x)
    assert z.dtype == torch.bfloat16
    z.float().sum().backward()  # gradients reach the float32 parameters through the casts
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    exact = layer.to(F64)(x.to(F64))
    # bf16 has an 8-bit significand: inputs, weights and the GEMM output each rounded (≤ 2⁻⁸
    # relative), the sums of ≤ 18 products in float32; |z| ≤ ‖W_o‖·O(1): atol 0.05 bounds it.
    torch.testing.assert_close(z.to(F64), exact, rtol=0.03, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", LAYERS)
def test_every_float_dtype_runs_forward_and_backward(name, dtype):
    layer, x = _layer_and_input(name, dtype=dtype)
    x.requires_grad_(True)
    z = layer(x)
    assert z.dtype == dtype and torch.isfinite(z).all()
    z.float().sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    exact = copy.deepcopy(layer).to(F64)(x.detach().to(F64))
    tol = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-5}[dtype]  # a few ulp × √(terms)
    torch.testing.assert_close(z.detach().to(F64), exact, rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# nn.Module conventions


@pytest.mark.parametrize("name", LAYERS)
def test_state_dict_round_trip_and_plain_layer_keys(name):
    layer, x = _layer_and_input(name)
    fresh = LAYERS[name](dtype=F64)
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x), layer(x), rtol=0, atol=0)
    plain = nn.Linear(6, 4) if "conv" not in name else (nn.Conv1d(2, 4, 3, groups=2) if name == "conv1d"
                                                         else nn.Conv2d(2, 4, 3))
    assert set(layer.state_dict()) == set(plain.state_dict())


def test_reset_parameters_matches_the_plain_layer_init():
    # same RNG stream, same init rule => identical parameters
    for make, plain in [(lambda: AffineLike(7, 5), lambda: nn.Linear(7, 5)),
                        (lambda: NormLike(7, 5, mode="rms"), lambda: nn.Linear(7, 5)),
                        (lambda: PatchNormConv2d(4, 6, 3, groups=2), lambda: nn.Conv2d(4, 6, 3, groups=2)),
                        (lambda: PatchNormConv1d(3, 2, 5, bias=False), lambda: nn.Conv1d(3, 2, 5, bias=False))]:
        torch.manual_seed(3)
        a = make()
        torch.manual_seed(3)
        b = plain()
        for (ka, pa), (kb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(pa, pb)


@pytest.mark.parametrize("layer, plain, kwargs", [
    (PatchNormConv1d, nn.Conv1d, dict(kernel_size=3)),
    (PatchNormConv1d, nn.Conv1d, dict(kernel_size=(5,), stride=2, padding=(1,), dilation=2, groups=2)),
    (PatchNormConv2d, nn.Conv2d, dict(kernel_size=3, padding="same", padding_mode="circular")),
    (PatchNormConv2d, nn.Conv2d, dict(kernel_size=(3, 1), stride=(2, 1), padding=1, dilation=(1, 2), groups=4)),
])
def test_conv_constructors_normalise_arguments_like_the_plain_layer(layer, plain, kwargs):
    a, b = layer(4, 8, **kwargs), plain(4, 8, **kwargs)
    for attribute in ("kernel_size", "stride", "padding", "dilation", "output_padding", "groups", "padding_mode",
                      "_reversed_padding_repeated_twice"):
        assert getattr(a, attribute) == getattr(b, attribute), attribute


def test_extra_repr():
    assert repr(AffineLike(3, 2, bias=False)) == "AffineLike(in_features=3, out_features=2, bias=False)"
    assert repr(NormLike(3, 2, mode="rms", eps=1e-6)) == (
        "NormLike(in_features=3, out_features=2, bias=True, mode='rms', eps=1e-06)")
    assert repr(PatchNormConv2d(2, 4, 3, padding=1, groups=2)) == (
        "PatchNormConv2d(2, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), groups=2)")


def test_not_a_subclass_of_the_plain_layers():
    assert not isinstance(AffineLike(2, 2), nn.Linear)
    assert not isinstance(PatchNormConv2d(2, 2, 1), nn.Conv2d)


def test_meta_device_construction_then_to_empty_and_reset_matches_the_eager_init():
    # the large-model recipe: build on "meta" (no memory), materialise, initialise
    for name in LAYERS:
        torch.manual_seed(5)
        eager = LAYERS[name]()
        lazy = LAYERS[name](device="meta")
        assert all(p.is_meta for p in lazy.parameters())
        x = torch.randn(*INPUT_SHAPES[name], device="meta")
        assert lazy(x).shape == eager(torch.zeros(x.shape)).shape  # shape inference on meta
        lazy.to_empty(device="cpu")
        torch.manual_seed(5)
        lazy.reset_parameters()
        assert list(lazy.state_dict()) == list(eager.state_dict())
        for key, value in eager.state_dict().items():
            assert torch.equal(lazy.state_dict()[key], value), (name, key)


@pytest.mark.parametrize("name", LAYERS)
def test_whole_module_save_load_and_deepcopy(name, tmp_path):
    layer, x = _layer_and_input(name)
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    for other in (loaded, copy.deepcopy(layer)):
        assert type(other) is type(layer) and repr(other) == repr(layer)
        torch.testing.assert_close(other(x), layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", LAYERS)
def test_torch_export_with_a_dynamic_batch_matches_eager(name):
    # torch.export (the successor of TorchScript, which cannot script custom autograd Functions)
    # traces the Functions' forward into aten ops; autograd of those ops must then agree with
    # the hand-written backward.
    layer, x = _layer_and_input(name)
    exported = torch.export.export(layer, (x,), dynamic_shapes=[{0: torch.export.Dim("batch")}]).module()
    bigger = torch.randn(5, *x.shape[1:], dtype=F64, requires_grad=True)
    z = exported(bigger)
    torch.testing.assert_close(z, layer(bigger), **CLOSE)
    g = torch.randn_like(z)
    (dx,) = torch.autograd.grad(z, bigger, g)
    torch.testing.assert_close(dx, torch.autograd.grad(layer(bigger), bigger, g)[0], **CLOSE)


# --------------------------------------------------------------------------------------------
# memory saved for backward


def _saved_new_bytes(module, x):
    """Bytes of the tensors autograd saves for module(x) that are not x or a parameter (which
    exist anyway): the memory the graph keeps alive because of this layer. Also the output."""
    existing = {t.untyped_storage().data_ptr() for t in (x, *module.parameters())}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in existing:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return sum(seen.values()), out


@pytest.mark.parametrize("batch, m, n", [(64, 32, 16), (16, 8, 64)])
def test_dense_layers_save_one_float_per_row_beyond_nn_linear(batch, m, n):
    x = torch.randn(batch, m, requires_grad=True)
    linear = nn.Linear(m, n)
    assert _saved_new_bytes(linear, x)[0] == 0  # nn.Linear saves only x and W
    for layer in (AffineLike(m, n), NormLike(m, n), NormLike(m, n, mode="rms")):
        layer.load_state_dict(linear.state_dict())
        new, _ = _saved_new_bytes(layer, x)
        assert 0 < new <= batch * 4, (type(layer).__name__, new)


def test_patchnorm_under_saved_tensor_hooks_saves_one_float_per_group_and_position_beyond_nn_conv2d():
    # the output it keeps otherwise is not one of the saved tensors (it would escape the hooks of
    # checkpointing and offloading): under hooks it is recomputed in backward instead
    x = torch.randn(4, 6, 9, 9, requires_grad=True)
    conv = nn.Conv2d(6, 8, 3, padding=1, groups=2)
    assert _saved_new_bytes(conv, x)[0] == 0
    new, _ = _saved_new_bytes(PatchNormConv2d(6, 8, 3, padding=1, groups=2), x)
    assert 0 < new <= 4 * (4 * 2 * 9 * 9)  # r: float32 per (sample, group, position)


class _CountForwardConvolutions(TorchDispatchMode):
    """Counts the convolutions run with ``weight`` (the layer's forward convolution; its box
    filters run with a ones kernel of another shape, its backward as convolution_backward)."""

    def __init__(self, weight):
        super().__init__()
        self.shape, self.count = weight.shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default and args[1].shape == self.shape and not args[6]:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case, recomputed", [
    ("kept", 0), ("in-place consumer", 1), ("recompute=True", 1), ("create_graph", 1),
    ("saved-tensor hooks", 1), ("second backward", 1),
])
def test_patchnorm_keeps_its_output_for_backward_and_recomputes_it_only_where_it_must(case, recomputed):
    torch.manual_seed(0)
    layer = PatchNormConv2d(4, 6, 3, padding=1, groups=2, recompute=case == "recompute=True")
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    if case == "saved-tensor hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            z = layer(x)
    else:
        z = layer(x)
    z = torch.relu_(z) if case == "in-place consumer" else torch.relu(z)
    if case == "second backward":
        torch.autograd.grad(z.sum(), x, retain_graph=True)  # the first backward releases the kept z
    count = _CountForwardConvolutions(layer.weight)
    with count:
        torch.autograd.grad(z.sum(), x, create_graph=case == "create_graph")
    assert count.count == recomputed


# --------------------------------------------------------------------------------------------
# convert


def test_convert_swaps_keeps_parameters_and_reports():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Sequential(nn.Linear(4 * 5 * 5, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False)),
    )
    attention = nn.MultiheadAttention(8, 2)
    model.add_module("attn", attention)
    weights = {id(p) for p in model.parameters()}
    records = convert(model, linear="norm_rms", following_norm="remove")
    assert [(r.path, r.old_type, r.new_type, r.weights_kept) for r in records] == [
        ("0", "Conv2d", "PatchNormConv2d", True),
        ("3.0", "Linear", "NormLike", True),
        ("3.1", "LayerNorm", "Identity", False),
        ("3.2", "Linear", "NormLike", True),
    ]
    assert isinstance(model[3][1], nn.Identity) and model[3][2].mode == "rms"
    assert model.attn.out_proj.__class__ is not NormLike  # attention internals are never swapped
    kept = {id(p) for p in model.parameters()}
    assert kept <= weights and len(weights - kept) == 2  # only the LayerNorm's γ, β are gone
    x = torch.randn(2, 3, 5, 5)
    head = model[:4]
    expected = LF.norm_like(head[2](head[1](head[0](x))), head[3][0].weight, head[3][0].bias, mode="rms")
    expected = LF.norm_like(expected, head[3][2].weight, None, mode="rms")
    torch.testing.assert_close(head(x), expected, rtol=0, atol=0)


def _vgg_like(activation, inplace: bool) -> nn.Sequential:
    """Conv2d→activation(inplace) blocks as VGG and AlexNet build them (with nn.ReLU)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), activation(inplace=inplace), nn.Conv2d(8, 8, 3, padding=1, groups=2),
        activation(inplace=inplace), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
        activation(inplace=inplace), nn.Linear(10, 10),
    ).to(torch.float64)


def _train(model: nn.Module, steps: int = 3) -> list[torch.Tensor]:
    """The parameters after ``steps`` SGD steps on a fixed stream of batches."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=generator)
        y = torch.randint(0, 10, (4,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("activation", [nn.ReLU, lambda inplace: nn.LeakyReLU(0.1, inplace=inplace)],
                         ids=["relu", "leaky_relu"])
def test_a_converted_vgg_with_in_place_activations_trains_as_with_recompute(activation, layout):
    # the in-place activation changes the output PatchNormConv2d keeps for backward: it is found
    # changed and recomputed, so the steps equal those of recompute=True and of out-of-place
    # activations (float64, the same operations in the same order: equal to a few ulp). (With
    # ReLU the changed z would give the same gradient, ⟨g, relu(z)⟩ = ⟨g, z⟩ for g masked by the
    # ReLU; LeakyReLU's would not.)
    trained = {}
    for inplace, recompute in ((True, False), (True, True), (False, False)):
        model = _vgg_like(activation, inplace).to(memory_format=layout)
        convert(model, recompute=recompute)
        trained[inplace, recompute] = _train(model)
    for a, b, c in zip(trained[True, False], trained[True, True], trained[False, False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    initial = _vgg_like(activation, True).parameters()
    assert all(not torch.equal(a, p) for a, p in zip(trained[True, False], initial))


def test_convert_gives_every_use_of_a_shared_module_the_same_new_module():
    linear = nn.Linear(4, 4)
    model = nn.Sequential(linear, nn.Tanh(), linear, nn.LayerNorm(4))
    records = convert(model, following_norm="remove")
    assert [(r.path, r.new_type) for r in records] == [("0", "AffineLike"), ("2", "AffineLike"), ("3", "Identity")]
    assert model[0] is model[2] and type(model[0]) is AffineLike
    assert [id(p) for p in model.parameters()] == [id(linear.weight), id(linear.bias)]  # the norm's are gone

    class TwoNames(nn.Module):  # one module under two attribute names, and a container used twice
        def __init__(self):
            super().__init__()
            self.a = self.b = nn.Conv2d(2, 2, 3)
            block = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
            self.blocks = nn.Sequential(block, block)

    model = TwoNames()
    records = convert(model)
    assert model.a is model.b and type(model.a) is PatchNormConv2d
    assert model.blocks[0] is model.blocks[1] and type(model.blocks[0][0]) is AffineLike
    assert [r.path for r in records] == ["a", "b", "blocks.0.0"]  # a container is walked once
    # a module is judged at its first path: skipped there, it stays at every path
    linear = nn.Linear(2, 2)
    model = nn.Sequential(linear, linear)
    assert convert(model, skip=lambda path, module: path == "0") == []
    assert model[0] is model[1] is linear


def test_convert_keep_norm_skip_and_options():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Conv1d(1, 1, 1))
    records = convert(model, conv=False, skip=lambda path, m: False)
    assert [(r.path, r.new_type) for r in records] == [("0", "AffineLike")]
    assert isinstance(model[1], nn.BatchNorm1d) and type(model[2]) is nn.Conv1d
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert [r.path for r in convert(model, skip=lambda path, m: path == "1")] == ["0"]
    with pytest.raises(ValueError, match="linear must be one of"):
        convert(model, linear="affine")
    with pytest.raises(ValueError, match="following_norm must be"):
        convert(model, following_norm="fold")
    with pytest.raises(TypeError, match="container"):
        convert(nn.Linear(2, 2))
    model = nn.Sequential(nn.Conv2d(2, 2, 3), nn.Conv1d(1, 1, 1))
    convert(model, recompute=True)
    assert model[0].recompute and model[1].recompute


# --------------------------------------------------------------------------------------------
# GPU dispatch: the contract with layers._triton_affine_like, checked with a stand-in kernel


class _FakeKernel:
    """Implements the kernel's interface (r: (rows,) float32, as _triton_affine_like) with the
    torch Function, recording the calls."""

    SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self):
        self.calls = []

    def available(self):
        return True

    def forward(self, x2d, weight, bias):
        self.calls.append(("forward", tuple(x2d.shape)))
        from affdiv.layers._autograd import AffineLikeFunction as Fn
        z, r = Fn.forward(x2d, weight, bias)
        return z, r.squeeze(-1).float()

    def backward(self, grad_z2d, x2d, weight, bias, r):
        self.calls.append(("backward", tuple(grad_z2d.shape)))
        from affdiv.layers._autograd import affine_like_grads
        return affine_like_grads(x2d, weight, bias, r.unsqueeze(-1).to(x2d.dtype), grad_z2d, None, (True, True, True))


def test_gpu_dispatch_calls_the_kernel_with_the_agreed_signature(monkeypatch):
    fake = _FakeKernel()
    monkeypatch.setattr(LF, "_gpu_kernel", lambda rows: fake)
    layer, x = _layer_and_input("affine_like", dtype=torch.float32)
    x = x.reshape(1, 3, 6).requires_grad_(True)
    z = layer(x)
    z.sum().backward()
    assert fake.calls == [("forward", (3, 6)), ("backward", (3, 4))]
    x2 = x.detach().requires_grad_(True)
    monkeypatch.setattr(LF, "_gpu_kernel", lambda rows: None)
    z2 = layer(x2)
    z2.sum().backward()
    # float32, the same formulas in the same order: agreement to a few ulp
    torch.testing.assert_close(z, z2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)


def test_gpu_dispatch_double_backward_falls_back_to_the_torch_formula(monkeypatch):
    fake = _FakeKernel()
    monkeypatch.setattr(LF, "_gpu_kernel", lambda rows: fake)
    x = torch.randn(3, 5, requires_grad=True)
    w, b = torch.randn(4, 5, requires_grad=True), torch.randn(4, requires_grad=True)
    (g,) = torch.autograd.grad(LF.affine_like(x, w, b).square().sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), w)
    assert fake.calls == [("forward", (3, 5))]  # the kernel's first-order backward was not used
    monkeypatch.setattr(LF, "_gpu_kernel", lambda rows: None)
    (g2,) = torch.autograd.grad(LF.affine_like(x, w, b).square().sum(), x, create_graph=True)
    (gg2,) = torch.autograd.grad(g2.sum(), w)
    torch.testing.assert_close(gg, gg2, rtol=1e-5, atol=1e-6)


def test_gpu_dispatch_forward_mode_gives_the_torch_formula_tangents(monkeypatch):
    fake = _FakeKernel()
    layer, x = _layer_and_input("affine_like", dtype=torch.float32)
    x_t = torch.randn_like(x)
    tangents = []
    for kernel in (fake, None):
        monkeypatch.setattr(LF, "_gpu_kernel", lambda rows, kernel=kernel: kernel)
        with fwAD.dual_level():
            tangents.append(fwAD.unpack_dual(layer(fwAD.make_dual(x, x_t))).tangent)
    assert fake.calls == [("forward", (3, 6))]
    torch.testing.assert_close(tangents[0], tangents[1], rtol=1e-6, atol=1e-6)  # float32, the same formula


def test_gpu_kernel_is_not_used_on_cpu():
    assert LF._gpu_kernel(torch.zeros(2, 2)) is None


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
def test_patchnorm_with_recompute_saves_one_float_per_group_and_position(layout):
    x = torch.randn(4, 6, 9, 9).contiguous(memory_format=layout).requires_grad_(True)
    layer = PatchNormConv2d(6, 8, 3, padding=1, groups=2, recompute=True)
    new, z = _saved_new_bytes(layer, x)
    assert 0 < new <= 4 * (4 * 2 * 9 * 9)  # r: float32 per (sample, group, position)
    assert "recompute=True" in repr(layer)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("x_grad", [True, False], ids=["dx", "no-dx"])
def test_patchnorm_recompute_gives_the_same_gradients(layout, groups, x_grad):
    # float64: both runs compute the same forward twice, in the same order of operations
    torch.manual_seed(0)
    x = torch.randn(3, 4, 7, 6, dtype=torch.float64).contiguous(memory_format=layout)
    results = []
    for recompute in (False, True):
        torch.manual_seed(1)
        layer = PatchNormConv2d(4, 6, 3, stride=2, padding=1, groups=groups, dtype=torch.float64, recompute=recompute)
        xi = x.detach().requires_grad_(x_grad)
        z = layer(xi)
        z.sum().backward()  # (an expanded, non-contiguous gradient)
        results.append([z.detach(), xi.grad, layer.weight.grad, layer.bias.grad])
    for a, b in zip(*results):
        if a is None:
            assert b is None and not x_grad
        else:
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_patchnorm_recompute_gradgradcheck():
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    fn = lambda x, w, b: LF.patchnorm_conv2d(x, w, b, padding=1, groups=2, recompute=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), atol=1e-7, rtol=1e-7)
    assert torch.autograd.gradgradcheck(fn, (x, w, b), atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("recompute", [False, True])
def test_patchnorm_under_vmap_then_autograd_matches_a_loop(recompute):
    """vmap over stacked weights, then ordinary backward (what the stacked harness does): torch's
    generated vmap rule keeps one saved-tensor layout per context, so the forward-mode and
    backward saves must agree. Float64, same arithmetic per member: equal to rounding (1e-12)."""
    from torch.func import vmap

    from affdiv.layers.functional import patchnorm_conv2d

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 2, 3, 3, dtype=torch.float64, generator=gen)
    x = torch.randn(3, 2, 2, 5, 5, dtype=torch.float64, generator=gen)
    stacked_w, stacked_x = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    vmap(lambda w, x: patchnorm_conv2d(x, w, padding=1, recompute=recompute))(stacked_w, stacked_x).sum().backward()
    loop_w, loop_x = w.clone().requires_grad_(True), x.clone().requires_grad_(True)
    sum(patchnorm_conv2d(loop_x[i], loop_w[i], padding=1, recompute=recompute).sum() for i in range(3)).backward()
    torch.testing.assert_close(stacked_w.grad, loop_w.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(stacked_x.grad, loop_x.grad, rtol=0, atol=1e-12)

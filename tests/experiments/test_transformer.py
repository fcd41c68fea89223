"""The vit methods: each forward against the formula written out independently (and the plain vit
against nn.MultiheadAttention), QK-norm's per-head RMS, the registry and the bad inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from affdiv.experiments.runs import zoo
from affdiv.experiments.runs.config import ACTIVATIONS, VIT_METHODS, RunConfig, architecture
from affdiv.experiments.runs.models import VIT_VARIANTS, build_model

# Float64 forwards of depth ≤ 2 chain ~25 sums of ≤ 2·width·… ≤ 200 terms, each off by at most
# γ_200 ≈ 2.2e-14 of its absolute sum; the two computations differ only in those orders (and the
# softmax's exp and the norms' sqrt, correct to an ulp), so their logits agree to ~1e-12 of their
# scale unless cancellation amplifies it 100-fold: 1e-10 bounds both.
TOL = 1e-10

# What each method is (runs/models.py's docstring): (AffineLike projections, QK-norm, LayerNorm).
VARIANTS = {
    "vit": (False, False, True),
    "vit-qknorm": (False, True, True),
    "vit-affine_like": (True, False, True),
    "vit-affine_like-qknorm": (True, True, True),
    "vit-nonorm": (False, False, False),
}
ACTIVATION_FUNCTIONS = {"tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu, "identity": lambda t: t}
HEADS, GRID = 4, 4


def _build(method, shape, width, depth, activation="gelu", seed=0):
    torch.manual_seed(seed)
    model = build_model(method, input_shape=shape, num_classes=3, depth=depth, width=width, activation=activation)
    return model.double()


def _reference(model, x, method, depth, activation):
    """The network of ``runs/models.py``'s docstring, from the model's parameters alone: patches by
    F.unfold, every sum an einsum, LayerNorm, RMSNorm, softmax and AffineLike from their formulas."""
    affine_like, qk_norm, norm = VARIANTS[method]
    p = dict(model.named_parameters())
    batch, _, height, breadth = x.shape
    tokens = F.unfold(x, kernel_size=(height // GRID, breadth // GRID), stride=(height // GRID, breadth // GRID))
    h = torch.einsum("bft,df->btd", tokens, p["embed.weight"]) + p["embed.bias"] + p["position.weight"]
    dim = h.shape[-1]
    head_dim = dim // HEADS

    def project(name, z):
        out = torch.einsum("btf,df->btd", z, p[f"{name}.weight"]) + p[f"{name}.bias"]
        return out / torch.sqrt(torch.einsum("btf,btf->bt", z, z) + 1)[..., None] if affine_like else out

    def layer_norm(name, z):
        if not norm:
            return z
        centred = z - z.mean(-1, keepdim=True)
        return centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + 1e-5) * p[f"{name}.weight"] \
            + p[f"{name}.bias"]

    def heads(z):
        return z.reshape(batch, -1, HEADS, head_dim)

    def rms_norm(name, z):
        eps = torch.finfo(z.dtype).eps
        return z / torch.sqrt(z.square().mean(-1, keepdim=True) + eps) * p[f"{name}.weight"] if qk_norm else z

    for i in range(depth):
        block = f"blocks.{i}"
        z = layer_norm(f"{block}.norm1", h)
        q = rms_norm(f"{block}.attn.q_norm", heads(project(f"{block}.attn.q", z)))
        k = rms_norm(f"{block}.attn.k_norm", heads(project(f"{block}.attn.k", z)))
        v = heads(project(f"{block}.attn.v", z))
        scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(head_dim)
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        mixed = torch.einsum("bhts,bshe->bthe", weights, v).reshape(batch, -1, dim)
        h = h + project(f"{block}.attn.o", mixed)
        z = layer_norm(f"{block}.norm2", h)
        h = h + project(f"{block}.mlp.2", ACTIVATION_FUNCTIONS[activation](project(f"{block}.mlp.0", z)))
    pooled = layer_norm("norm", h).mean(1)
    return pooled @ p["head.weight"].T + p["head.bias"]


def _assert_close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max() <= TOL * max(1.0, want.abs().max()), (got - want).abs().max()


@given(method=st.sampled_from(VIT_METHODS), channels=st.integers(1, 3), height=st.sampled_from([4, 8, 12]),
       breadth=st.sampled_from([4, 8, 28]), width=st.sampled_from([4, 8, 12]), depth=st.integers(1, 2),
       batch=st.integers(1, 3), activation=st.sampled_from(ACTIVATIONS), seed=st.integers(0, 2**31 - 1))
def test_every_vit_is_its_formula(method, channels, height, breadth, width, depth, batch, activation, seed):
    model = _build(method, (channels, height, breadth), width, depth, activation, seed)
    with torch.no_grad():  # move the gains and biases off their init (1, 0) so that each is seen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, height, breadth, dtype=torch.float64, generator=generator)
    _assert_close(model(x), _reference(model, x, method, depth, activation))


def test_plain_vit_is_multihead_attention_in_a_pre_norm_block():
    """vit against torch's own layers: Conv2d patch embedding, nn.MultiheadAttention, F.layer_norm."""
    depth, width = 2, 16
    model = _build("vit", (1, 28, 28), width, depth, "gelu")
    x = torch.randn(5, 1, 28, 28, dtype=torch.float64)
    p = dict(model.named_parameters())
    h = F.conv2d(x, p["embed.weight"].reshape(width, 1, 7, 7), p["embed.bias"], stride=7).flatten(2).transpose(1, 2)
    h = h + p["position.weight"]
    attention = nn.MultiheadAttention(width, HEADS, batch_first=True, dtype=torch.float64)
    for i in range(depth):
        a = f"blocks.{i}.attn"
        with torch.no_grad():
            attention.in_proj_weight.copy_(torch.cat([p[f"{a}.{s}.weight"] for s in "qkv"]))
            attention.in_proj_bias.copy_(torch.cat([p[f"{a}.{s}.bias"] for s in "qkv"]))
            attention.out_proj.weight.copy_(p[f"{a}.o.weight"])
            attention.out_proj.bias.copy_(p[f"{a}.o.bias"])
        z = F.layer_norm(h, (width,), p[f"blocks.{i}.norm1.weight"], p[f"blocks.{i}.norm1.bias"])
        h = h + attention(z, z, z, need_weights=False)[0]
        z = F.layer_norm(h, (width,), p[f"blocks.{i}.norm2.weight"], p[f"blocks.{i}.norm2.bias"])
        mlp = F.linear(F.gelu(F.linear(z, p[f"blocks.{i}.mlp.0.weight"], p[f"blocks.{i}.mlp.0.bias"])),
                       p[f"blocks.{i}.mlp.2.weight"], p[f"blocks.{i}.mlp.2.bias"])
        h = h + mlp
    pooled = F.layer_norm(h, (width,), p["norm.weight"], p["norm.bias"]).mean(1)
    _assert_close(model(x), F.linear(pooled, p["head.weight"], p["head.bias"]))


@pytest.mark.parametrize("method", ["vit-qknorm", "vit-affine_like-qknorm"])
def test_qk_norm_makes_each_heads_queries_and_keys_unit_rms_times_the_gain(method):
    model = _build(method, (1, 28, 28), 32, 1)
    attention = model.blocks[0].attn
    seen = {}
    for side in ("q", "k"):
        norm = getattr(attention, f"{side}_norm")
        norm.register_forward_hook(lambda _m, args, out, side=side: seen.update({side: (args[0], out)}))
    x = torch.randn(6, 1, 28, 28, dtype=torch.float64)
    model(x)  # at init: gain 1
    for side in ("q", "k"):
        before, after = seen[side]
        assert after.shape == (6, HEADS, 16, 32 // HEADS)  # per sample, head and token: d_h entries
        assert (before.square().mean(-1).sqrt() - 1).abs().max() > 0.1  # not unit RMS before the norm
        # eps = 2.2e-16 under a mean square ≥ 1e-4 moves the RMS by < 1e-12
        assert (after.square().mean(-1).sqrt() - 1).abs().max() < 1e-12
    gains = {side: 0.5 + torch.rand(32 // HEADS, dtype=torch.float64) for side in ("q", "k")}
    with torch.no_grad():
        attention.q_norm.weight.copy_(gains["q"])
        attention.k_norm.weight.copy_(gains["k"])
    model(x)
    for side in ("q", "k"):
        _, after = seen[side]
        assert ((after / gains[side]).square().mean(-1).sqrt() - 1).abs().max() < 1e-12


def test_variants_differ_only_where_named():
    modules = {m: _build(m, (1, 8, 8), 8, 2) for m in VIT_METHODS}

    def count(method, kind):
        return sum(isinstance(module, kind) for module in modules[method].modules())

    from affdiv.layers import AffineLike

    for method, (affine_like, qk_norm, norm) in VARIANTS.items():
        assert count(method, AffineLike) == (6 * 2 if affine_like else 0)  # q, k, v, o, 2 MLP per block
        assert count(method, nn.Linear) == (2 if affine_like else 6 * 2 + 2)  # + embedding, read-out
        assert count(method, nn.RMSNorm) == (2 * 2 if qk_norm else 0)
        assert count(method, nn.LayerNorm) == (2 * 2 + 1 if norm else 0)
    assert modules["vit"].blocks[0].attn.heads == HEADS and len(modules["vit"].position.weight) == GRID * GRID


def test_vit_methods_are_registered_everywhere():
    assert tuple(VIT_VARIANTS) == VIT_METHODS == tuple(VARIANTS)
    assert all(architecture(m) == "vit" for m in VIT_METHODS)
    assert RunConfig(dataset="fashion-mnist", method="vit-qknorm", batch_size=64, seed=0).method == "vit-qknorm"
    # the meter's vit built-ins are the harness's networks, parameter for parameter
    for method in VIT_METHODS:
        torch.manual_seed(3)
        meter = zoo.build(method, input_shape=(1, 28, 28), num_classes=10)
        torch.manual_seed(3)
        harness = build_model(method, input_shape=(1, 28, 28), num_classes=10, **zoo.VIT_DEFAULTS)
        assert meter.state_dict().keys() == harness.state_dict().keys()
        assert all(torch.equal(t, harness.state_dict()[k]) for k, t in meter.state_dict().items())


def test_bad_shapes_and_widths_are_refused():
    with pytest.raises(ValueError, match=r"H and W multiples of 4; got input shape \(1, 28, 30\)"):
        build_model("vit", input_shape=(1, 28, 30), num_classes=2, depth=1, width=8, activation="gelu")
    with pytest.raises(ValueError, match=r"image inputs \(C, H, W\).*got input shape \(64,\)"):
        build_model("vit", input_shape=(64,), num_classes=2, depth=1, width=8, activation="gelu")
    with pytest.raises(ValueError, match="multiple of the 4 attention heads, got 18"):
        build_model("vit-nonorm", input_shape=(1, 8, 8), num_classes=2, depth=1, width=18, activation="gelu")

"""The divergence meter on attention: nn.MultiheadAttention inside a stock nn.TransformerEncoderLayer,
measured and checked against full Jacobians, in float64.

Reference (independent of the meter's routes: no hooks, no jvp-after-vjp, no closed form): the
encoder layer written out by hand (attention as softmax(QKᵀ/√h)V, never the fused kernels), the
attention output z as a function of the parameters Θ that move it, J = ∂z/∂Θ materialised by
torch.func.jacrev, g = ∂L/∂z by autograd through the rest of the layer, and then

    u = −η J Jᵀ g,    d_i = −η J_i J_iᵀ g_i   (J_i: sample i's rows of J)

(layer scope: Θ = the attention's own parameters, in_proj and out_proj; network scope: also
norm1's when it sits before the attention, norm_first=True: everything upstream of z). The samples
are independent (batch_first=True), so in network scope d_i is the same product.

Tolerance 1e-10 relative to the reference's largest entry: both sides sum N ≲ 10³ float64
products in different orders (γ_N ≈ N·u ≈ 1e-13), with cancellation ratios far below 10³ here.
Observed over 48 cases (B, T, heads, norm_first, scope): at most 8.3e-16.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from affdiv.meter import MeterOptions, UnmeasuredModuleWarning, UnsupportedModuleError, divergence

F64 = torch.float64
TOL = 1e-10
LR = 0.1
E = 8


def close(a, b, tol=TOL):
    a, b = a.detach(), b.detach()
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * float(b.abs().max())


def ce(y):
    return lambda out: F.cross_entropy(out, y, reduction="none")


class Encoder(nn.Module):
    """A stock TransformerEncoderLayer (batch first) and a linear head on its flattened output."""

    def __init__(self, tokens, heads, norm_first):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, heads, dim_feedforward=12, dropout=0.0, batch_first=True,
                                                norm_first=norm_first, dtype=F64)
        self.head = nn.Linear(tokens * E, 3, dtype=F64)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1))


def attention(x, w_in, b_in, w_out, b_out, heads):
    """softmax(QKᵀ/√h) V per head, then the output projection: x (B, T, E) -> (B, T, E)."""
    b, t, _ = x.shape
    h = E // heads
    q, k, v = (x @ w_in.T + b_in).chunk(3, dim=-1)

    def split(a):
        return a.reshape(b, t, heads, h).transpose(1, 2)

    weights = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(h), dim=-1)
    return (weights @ split(v)).transpose(1, 2).reshape(b, t, E) @ w_out.T + b_out


def by_hand(net, x, heads):
    """(z(Θ_layer, Θ_up), rest(z)): the attention output and the network after it, written out."""
    layer = net.layer
    sa = layer.self_attn

    def norm(a, module, w=None, b=None):
        return F.layer_norm(a, (E,), module.weight if w is None else w, module.bias if b is None else b, module.eps)

    def ff(a):
        return layer.linear2(torch.relu(layer.linear1(a)))

    def z(theta, up):
        attn_in = norm(x, layer.norm1, up["w"], up["b"]) if layer.norm_first else x
        return attention(attn_in, theta["in_w"], theta["in_b"], theta["out_w"], theta["out_b"], heads)

    def rest(z_value):
        if layer.norm_first:
            h = x + z_value
            out = h + ff(norm(h, layer.norm2))
        else:
            h = norm(x + z_value, layer.norm1)
            out = norm(h + ff(h), layer.norm2)
        return net.head(out.flatten(1))

    theta = {"in_w": sa.in_proj_weight, "in_b": sa.in_proj_bias, "out_w": sa.out_proj.weight,
             "out_b": sa.out_proj.bias}
    up = {"w": layer.norm1.weight, "b": layer.norm1.bias} if layer.norm_first else {}
    return ({k: v.detach() for k, v in theta.items()}, {k: v.detach() for k, v in up.items()}, z, rest)


def reference(net, x, y, heads, scope):
    """(u, d, g) of the attention output by full Jacobians (the module docstring)."""
    theta, up, z, rest = by_hand(net, x, heads)
    assert close(rest(z(theta, up)), net(x), 1e-12)  # the hand-written network is the network
    z0 = z(theta, up).detach()
    delta = torch.zeros_like(z0, requires_grad=True)
    (g,) = torch.autograd.grad(ce(y)(rest(z0 + delta)).mean(), delta)
    if scope == "layer":
        jac = jacrev(lambda t: z(t, up))(theta)
    else:
        jac = jacrev(lambda t, u: z(t, u), argnums=(0, 1))(theta, up)
        jac = {**jac[0], **{f"up.{k}": v for k, v in jac[1].items()}}
    rows = z0.numel()
    matrix = torch.cat([j.reshape(rows, -1) for j in jac.values()], dim=1)  # J: (B·T·E, P)
    u = (-LR * matrix @ (matrix.T @ g.reshape(-1))).reshape(z0.shape)
    per_sample = matrix.reshape(x.shape[0], -1, matrix.shape[1])  # J_i: (T·E, P)
    gi = g.reshape(x.shape[0], -1, 1)
    d = (-LR * per_sample @ (per_sample.transpose(1, 2) @ gi)).reshape(z0.shape)
    return u, d, g


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 4), tokens=st.integers(1, 4), heads=st.sampled_from([1, 2, 4]),
       norm_first=st.booleans(), scope=st.sampled_from(["layer", "network"]), seed=st.integers(0, 2**16))
def test_self_attention_of_a_stock_encoder_layer_matches_full_jacobians(batch, tokens, heads, norm_first, scope,
                                                                          seed):
    torch.manual_seed(seed)
    net = Encoder(tokens, heads, norm_first)
    x, y = torch.randn(batch, tokens, E, dtype=F64), torch.randint(0, 3, (batch,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmeasuredModuleWarning)
        report = divergence(net, x, ce(y), lr=LR, scope=scope, options=MeterOptions(keep_updates=True))
    assert not report.skipped
    assert {"layer.self_attn", "layer.linear1", "layer.linear2", "layer.norm1", "layer.norm2", "head"} == set(
        report.layers)
    attn = report.layers["layer.self_attn"]
    assert attn.kind == "MultiheadAttention"
    assert set(attn.parameters) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    u, d, g = reference(net, x, y, heads, scope)
    assert close(attn.ideal, -LR * g)
    assert close(attn.effective, u)
    assert close(attn.diagonal, d)


def test_the_fused_kernels_are_replaced_by_the_math_path_and_restored():
    """Eval mode meets the conditions of the encoder layer's and the attention's fast paths (and
    float32 those of the fused CPU attention kernel): forward-mode AD has none of them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.TransformerEncoderLayer(E, 2, dim_feedforward=12, batch_first=True), nn.Flatten(),
                        nn.Linear(3 * E, 3)).eval()
    x, y = torch.randn(5, 3, E), torch.randint(0, 3, (5,))
    with torch.no_grad():
        fused = net(x)  # the fast path, outside the meter
    for scope in ("layer", "network"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnmeasuredModuleWarning)
            report = divergence(net, x, ce(y), lr=LR, scope=scope)
        assert "0.self_attn" in report.layers and not report.skipped
        assert torch.isfinite(report.layers["0.self_attn"].scale).all()
    assert torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    with torch.no_grad():
        assert torch.equal(net(x), fused)


class BothOutputs(nn.Module):
    """Attention called directly (need_weights=True): both the output and the averaged weights
    reach the loss, so the measured output is the two side by side per sample."""

    def __init__(self, tokens):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 2, batch_first=True, dtype=F64)
        self.head = nn.Linear(tokens * E + tokens * tokens, 3, dtype=F64)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return self.head(torch.cat([out.flatten(1), weights.flatten(1)], dim=1))


def test_a_tuple_output_is_measured_on_the_tensors_that_reach_the_loss():
    torch.manual_seed(1)
    net, tokens = BothOutputs(3), 3
    x, y = torch.randn(4, tokens, E, dtype=F64), torch.randint(0, 3, (4,))
    report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
    attn = report.layers["attn"]
    names = [n for n, _ in net.attn.named_parameters()]
    theta = {n: p.detach() for n, p in net.attn.named_parameters()}

    def z(t):  # the module's own forward, its two outputs joined per sample
        out, weights = functional_call(net.attn, t, (x, x, x))
        return torch.cat([out.flatten(1), weights.flatten(1)], dim=1)

    z0 = z(theta)
    delta = torch.zeros_like(z0, requires_grad=True)
    h = z0 + delta
    (g,) = torch.autograd.grad(ce(y)(net.head(h)).mean(), delta)
    jac = jacrev(z)(theta)
    matrix = torch.cat([jac[n].reshape(z0.numel(), -1) for n in names], dim=1)
    assert z0.shape == (4, tokens * E + tokens * tokens)
    assert close(attn.effective, (-LR * matrix @ (matrix.T @ g.reshape(-1))).reshape(z0.shape))
    assert close(attn.ideal, -LR * g)


def test_what_cannot_be_measured_is_warned_named_and_listed():
    class BorrowsWeight(nn.Module):  # owns no parameter itself: uses its child's weight directly
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(E, E, dtype=F64)

        def forward(self, x):
            return F.linear(x, self.inner.weight)

    class Twice(nn.Module):  # one attention called twice: its absorbed out_proj goes with it
        def __init__(self):
            super().__init__()
            self.attn, self.borrow = nn.MultiheadAttention(E, 2, batch_first=True, dtype=F64), BorrowsWeight()
            self.head = nn.Linear(2 * E, 3, dtype=F64)

        def forward(self, x):
            h = self.attn(x, x, x)[0]
            h = self.attn(h, h, h)[0]
            return self.head(self.borrow(h).flatten(1))

    torch.manual_seed(2)
    x, y = torch.randn(4, 2, E, dtype=F64), torch.randint(0, 3, (4,))
    with pytest.warns(UnmeasuredModuleWarning) as caught:
        report = divergence(Twice(), x, ce(y), lr=LR)
    assert set(report.layers) == {"head"}
    assert "called 2 times" in report.skipped["attn"]
    assert "parent module 'attn', which is not measured" in report.skipped["attn.out_proj"]
    assert "forward was not called" in report.skipped["borrow.inner"]
    messages = [str(w.message) for w in caught]
    for name, reason in report.skipped.items():
        assert any(f"module {name!r}" in m and reason in m for m in messages), name
    with pytest.raises(UnsupportedModuleError, match="module 'attn' \\(MultiheadAttention\\): called 2 times"):
        divergence(Twice(), x, ce(y), lr=LR, options=MeterOptions(on_unsupported="raise"))


def test_dropout_inside_attention_is_replayed_by_every_pass():
    """A stock encoder layer in train mode (dropout 0.1, inside the attention too): every pass of
    the meter replays the batch pass's draws. Reference: the attention's input, kwargs, output
    gradient and RNG state recorded by plain hooks in a forward from the same seed, J by jacrev
    with that state, u = −η J Jᵀ g and d_i = row i of −η J Jᵀ (e_i ⊙ g) (the module couples
    nothing, but its dropout masks differ between a sample alone and the batch: the masked route)."""
    net = nn.Sequential(nn.TransformerEncoderLayer(E, 2, dim_feedforward=12, batch_first=True, dtype=F64),
                        nn.Flatten(), nn.Linear(3 * E, 3, dtype=F64)).train()
    x, y = torch.randn(5, 3, E, dtype=F64), torch.randint(0, 3, (5,))
    torch.manual_seed(3)
    report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
    attn = report.layers["0.self_attn"]
    assert attn.diagonal_route.startswith("masked")

    seen = {}
    sa = net[0].self_attn
    pre = sa.register_forward_pre_hook(lambda m, a, k: seen.update(state=torch.get_rng_state(), args=a, kwargs=k),
                                       with_kwargs=True)
    post = sa.register_forward_hook(lambda m, a, out: seen.update(out=out[0]))
    with sdpa_kernel(SDPBackend.MATH):  # the fused kernel draws its dropout mask another way
        torch.manual_seed(3)
        (g,) = torch.autograd.grad(ce(y)(net(x)).mean(), [seen["out"]])
    pre.remove()
    post.remove()
    theta = {n: p.detach() for n, p in sa.named_parameters()}
    args = tuple(a.detach() for a in seen["args"])

    def z(t):
        with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH):
            torch.set_rng_state(seen["state"])
            return functional_call(sa, t, args, seen["kwargs"])[0]

    jac = jacrev(z)(theta)
    matrix = torch.cat([j.reshape(g.numel(), -1) for j in jac.values()], dim=1)

    def update(cotangent):
        return (-LR * matrix @ (matrix.T @ cotangent.reshape(-1))).reshape(g.shape)

    d = torch.stack([update(g * (torch.arange(5) == i).reshape(-1, 1, 1))[i] for i in range(5)])
    assert close(attn.effective, update(g))
    assert close(attn.diagonal, d)
    with pytest.raises(UnsupportedModuleError, match="'0.self_attn' \\(Dropout in train mode"):
        divergence(net, x, ce(y), lr=LR, scope="network")

"""The divergence meter against independent references, in float64.

Tolerance: 1e-10 normwise, ‖meter − reference‖∞ ≤ 1e-10 ‖reference‖∞ (metrics: relative, per
sample). The meter and each reference (effective_update / diagonal_update on the module alone,
torch.func jvp through the network, the closed forms of theory.affine / theory.conv) compute the
same sums of at most N ≈ 10³ float64 products in different orders (a GEMM against a kernel
matrix, a jvp against a vjp): each differs from the exact value by at most γ_N ≈ N·u ≈ 1e-13
relative to the sum of magnitudes, times a cancellation ratio Σ|terms|/|Σ terms| that stays
below 10³ for these random, correlated inputs. The observed errors are at most 7.5e-16 (median 1.7e-16).
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp, vjp

from affdiv.layers import AffineLike, NormLike, PatchNormConv2d
from affdiv.meter import MeterOptions, UnmeasuredModuleWarning, UnsupportedModuleError, divergence
from affdiv.meter.routes import batchnorm_diagonal
from affdiv.theory import affine as theory_affine
from affdiv.theory import conv as theory_conv
from affdiv.verify import diagonal_update, effective_update
from affdiv.verify.metrics import cosine, off_diagonal_share, scale_factor

F64 = torch.float64
TOL = 1e-10
LR = 0.1


def close(a, b, tol=TOL):
    return float((a - b).abs().max()) <= tol * float(b.abs().max())


class Custom(nn.Module):
    """Not linear in θ: z = x·exp(s) + tanh(x A) (the meter's generic jvp/vmap routes)."""

    def __init__(self, n):
        super().__init__()
        self.s = nn.Parameter(0.1 * torch.randn(n, dtype=F64))
        self.a = nn.Parameter(torch.randn(n, n, dtype=F64) / n**0.5)

    def forward(self, x):
        return x * self.s.exp() + torch.tanh(x @ self.a)


def deep_net(inplace=True):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), AffineLike(8, 8), nn.LayerNorm(8), nn.Tanh(), NormLike(8, 8),
        Custom(8), nn.Linear(8, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 3),
    ).to(F64)


def batch(b=7, features=6, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(b, 1, dtype=F64).uniform_(-1, 1, generator=g))
    x = scale * (torch.randn(b, features, dtype=F64, generator=g) + 0.8 * torch.randn(1, features, dtype=F64,
                                                                                      generator=g))
    y = torch.randint(0, classes, (b,), generator=g)
    return x, y


def ce(y):
    return lambda out: F.cross_entropy(out, y, reduction="none")


def recorded(net, x, y, reduction="mean"):
    """Reference inputs and output gradients of every child, by plain hooks and autograd."""
    seen = {}

    def hook(name):
        def f(module, args, output):
            seen[name] = (args[0].detach(), output)
            return output.clone()

        return f

    handles = [m.register_forward_hook(hook(n)) for n, m in net.named_children()]
    losses = ce(y)(net(x))
    total = losses.mean() if reduction == "mean" else losses.sum()
    names = [n for n, m in net.named_children() if any(True for _ in m.parameters())]
    grads = torch.autograd.grad(total, [seen[n][1] for n in names])
    for h in handles:
        h.remove()
    return {n: (seen[n][0], g) for n, g in zip(names, grads)}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_layer_scope_matches_effective_and_diagonal_update_on_each_module_alone(reduction):
    net = deep_net()
    x, y = batch()
    report = divergence(net, x, ce(y), lr=LR, reduction=reduction, options=MeterOptions(keep_updates=True))
    assert set(report.layers) == {"0", "2", "3", "5", "6", "7", "9"} and not report.skipped
    reference = recorded(deep_net(inplace=False), x, y, reduction)
    for name, layer in report.layers.items():
        module = net[int(name)]
        inputs, g = reference[name]
        update = effective_update(module, inputs, g, lr=LR)
        diagonal = diagonal_update(module, inputs, g, LR)
        assert close(layer.ideal, update.ideal) and close(layer.effective, update.linear), name
        assert close(layer.diagonal, diagonal), name
        ideal = update.ideal
        for mine, theirs in [
            (layer.scale, scale_factor(update.linear, ideal)),
            (layer.diagonal_scale, scale_factor(diagonal, ideal)),
            (layer.cosine, cosine(update.linear, ideal)),
            (layer.off_diagonal_share, off_diagonal_share(update.linear, diagonal)),
        ]:
            assert torch.allclose(mine, theirs, rtol=TOL, atol=1e-14), name
        assert layer.batch_cosine == pytest.approx(float(cosine(update.linear.reshape(1, -1), ideal.reshape(1, -1))),
                                                   rel=TOL)
        assert torch.allclose(layer.input_norm, inputs.norm(dim=-1), rtol=1e-14)
    assert report.layers["6"].route.startswith("jvp") and report.layers["6"].diagonal_route.startswith("vmap")


def test_linear_and_affine_like_inside_a_deep_network_match_the_closed_forms():
    net = deep_net()
    x, y = batch(b=9)
    report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
    reference = recorded(deep_net(inplace=False), x, y)
    for name, member in [("0", "affine"), ("2", "affine_like"), ("7", "affine"), ("9", "affine")]:
        inputs, g = reference[name]
        m = theory_affine.member(member)
        layer = report.layers[name]
        assert close(layer.effective, theory_affine.predict_update(m, inputs, g, LR)), name
        k_ii = theory_affine.diagonal_factor(m, inputs)
        assert close(layer.diagonal, -LR * k_ii[:, None] * g), name
        assert torch.allclose(layer.diagonal_scale, k_ii, rtol=TOL), name
    # the corrections' claim, wherever the layer sits: K_ii = 1 (affine_like), 2 (norm_l2)
    assert torch.allclose(report.layers["2"].diagonal_scale, torch.ones(9, dtype=F64), rtol=1e-13)
    assert torch.allclose(report.layers["5"].diagonal_scale, torch.full((9,), 2.0, dtype=F64), rtol=1e-13)
    assert math.isnan(report.layers["2"].diagonal_norm_correlation)
    assert report.layers["0"].diagonal_norm_correlation > 0.9  # ‖x‖² + 1 against ‖x‖


def test_token_inputs_use_each_sample_block_both_ways():
    """(B, T, m) inputs: the per-sample diagonal is a T×T block; the kernel form (T small) and the
    per-sample-gradient form (T large) against diagonal_update."""
    torch.manual_seed(3)
    for tokens, m, n in [(3, 6, 5), (40, 2, 3)]:
        for layer in (nn.Linear(m, n, dtype=F64), AffineLike(m, n, dtype=F64), NormLike(m, n, mode="rms", dtype=F64)):
            net = nn.Sequential(layer, nn.Flatten(), nn.Linear(tokens * n, 2, dtype=F64))
            x = torch.randn(5, tokens, m, dtype=F64) + 0.5
            y = torch.randint(0, 2, (5,))
            report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
            g = report.layers["0"].ideal / -LR
            assert close(report.layers["0"].diagonal, diagonal_update(layer, x, g, LR)), (tokens, type(layer))


def test_convolutions_match_the_closed_forms_inside_a_cnn():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), PatchNormConv2d(4, 3, 3, stride=2, padding=1), nn.Tanh(),
        nn.Flatten(), nn.Linear(3 * 3 * 3, 2),
    ).to(F64)
    x = torch.randn(4, 2, 5, 5, dtype=F64) + 0.3
    y = torch.randint(0, 2, (4,))
    report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
    reference = recorded(net, x, y)
    for name, normalised, geometry in [("0", False, theory_conv.Geometry.of(2, 3, 1, 1)),
                                       ("2", True, theory_conv.Geometry.of(2, 3, 2, 1))]:
        inputs, g = reference[name]
        layer = report.layers[name]
        assert close(layer.effective, theory_conv.predict_conv(inputs, geometry, g, LR, normalised)), name
        assert close(layer.diagonal, diagonal_update(net[int(name)], inputs, g, LR)), name


# ---------------------------------------------------------------------------------------------
# network scope


def prefix_reference(net, x, y, upto, coupled=False):
    """u (full step) and d (only sample i's output gradient) at the output of net[upto], by
    torch.func on the prefix Sequential; buffers copied (BatchNorm in train mode)."""
    params = {n: p.detach() for n, p in net.named_parameters()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}

    def full(p):
        return functional_call(net, {**p, **{k: b.clone() for k, b in buffers.items()}}, (x,))

    def prefix(p):
        head = net[: upto + 1]
        mine = {k: v for k, v in p.items() if int(k.split(".")[0]) <= upto}
        return functional_call(head, {**mine, **{k: b.clone() for k, b in buffers.items()
                                                 if int(k.split(".")[0]) <= upto}}, (x,))

    out, pullback = vjp(full, params)
    z = out.detach().requires_grad_()
    (g_out,) = torch.autograd.grad(ce(y)(z).mean(), z)
    (grad,) = pullback(g_out)
    _, u = jvp(prefix, (params,), ({k: -LR * v for k, v in grad.items()},))
    rows = []
    for i in range(x.shape[0]):
        mask = torch.zeros_like(g_out)
        mask[i] = 1
        (grad_i,) = pullback(g_out * mask)
        _, t = jvp(prefix, (params,), ({k: -LR * v for k, v in grad_i.items()},))
        rows.append(t[i])
    return u, torch.stack(rows)


@pytest.mark.parametrize("kind", ["independent", "batchnorm"])
def test_network_scope_matches_torch_func_through_the_prefix(kind):
    torch.manual_seed(0)
    if kind == "independent":
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), AffineLike(8, 8), nn.Tanh(), NormLike(8, 8),
                            Custom(8), nn.Linear(8, 3)).to(F64)
    else:
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), AffineLike(8, 8), nn.Tanh(),
                            nn.Linear(8, 3)).to(F64)
    x, y = batch()
    report = divergence(net, x, ce(y), lr=LR, scope="network", options=MeterOptions(keep_updates=True))
    expected = "one forward-mode pass" if kind == "independent" else "masked"
    assert report.network_diagonal_route.startswith(expected)
    for name, layer in report.layers.items():
        u, d = prefix_reference(net, x, y, int(name))
        assert close(layer.effective, u), name
        assert close(layer.diagonal, d), name


def test_network_scope_routes_agree():
    """The single injection pass and the masked route (forced by a tiny check tolerance) agree."""
    net = deep_net(inplace=False)
    x, y = batch()
    fast = divergence(net, x, ce(y), lr=LR, scope="network", options=MeterOptions(keep_updates=True))
    module = importlib.import_module("affdiv.meter.routes")

    original = module._independent_network
    module._independent_network = lambda *a: False
    try:
        slow = divergence(net, x, ce(y), lr=LR, scope="network",
                          options=MeterOptions(keep_updates=True, memory_budget=1))
    finally:
        module._independent_network = original
    assert slow.network_diagonal_route.startswith("masked") and "chunks of 1" in slow.network_diagonal_route
    for name in fast.layers:
        assert close(fast.layers[name].diagonal, slow.layers[name].diagonal), name


def test_the_last_layer_is_the_same_in_both_scopes():
    net = deep_net()
    x, y = batch()
    layer = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True)).layers["9"]
    network = divergence(net, x, ce(y), lr=LR, scope="network", options=MeterOptions(keep_updates=True)).layers["9"]
    assert not close(layer.effective, network.effective)  # upstream layers move its input too
    assert close(layer.ideal, network.ideal)


# ---------------------------------------------------------------------------------------------
# BatchNorm, invariance


def bn_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(inplace=True), nn.Flatten(),
                        nn.Linear(3 * 16, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).to(F64)
    net.train()
    return net


def test_batchnorm_in_train_mode_is_measured_and_nothing_changes():
    net = bn_net()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for m in net:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2), m.weight.uniform_(0.5, 2)
    x = torch.randn(6, 2, 4, 4, dtype=F64)
    y = torch.randint(0, 2, (6,))
    params = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
    buffers = {n: (b, b.clone()) for n, b in net.named_buffers()}
    rng = torch.get_rng_state()
    for scope in ("layer", "network"):
        report = divergence(net, x, ce(y), lr=LR, scope=scope)
        assert not report.skipped and len(report.layers) == 5
    assert {n: p for n, p in net.named_parameters()} == {n: p for n, (p, _) in params.items()}
    assert all(torch.equal(p, copy) and p.grad is None for p, copy in params.values())
    assert {n: b for n, b in net.named_buffers()} == {n: b for n, (b, _) in buffers.items()}
    assert all(torch.equal(b, copy) for b, copy in buffers.values())
    assert torch.equal(torch.get_rng_state(), rng) and net.training


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_closed_form_diagonal_against_masked_effective_updates(train):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, dtype=F64).train(train)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2), bn.bias.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
    x, g = torch.randn(5, 3, 2, 2, dtype=F64) + 1, torch.randn(5, 3, 2, 2, dtype=F64)
    mine = batchnorm_diagonal(bn, x, g, LR)
    for i in range(5):
        mask = torch.zeros_like(g)
        mask[i] = 1
        reference = effective_update(bn, x, g * mask, lr=LR).linear[i]
        assert close(mine[i], reference)


def test_a_module_that_couples_samples_takes_the_masked_route():
    class Centre(nn.Module):  # z = W(x − mean over the batch): couples samples, linear in θ? no: generic
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4, dtype=F64))

        def forward(self, x):
            return torch.tanh((x - x.mean(0)) @ self.w)

    torch.manual_seed(0)
    net = nn.Sequential(Centre(), nn.Linear(4, 2, dtype=F64))
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 2, (5,))
    report = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True))
    layer = report.layers["0"]
    assert layer.diagonal_route.startswith("masked")
    g = layer.ideal / -LR
    for i in range(5):
        mask = torch.zeros_like(g)
        mask[i] = 1
        assert close(layer.diagonal[i], effective_update(net[0], x, g * mask, lr=LR).linear[i])


# ---------------------------------------------------------------------------------------------
# what the meter refuses


class NoForwardMode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=F64))

    def forward(self, x):
        return NoForwardMode.apply(x, self.w)


def test_refusals_are_listed_with_their_reason():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4, dtype=F64)
    tied_a, tied_b = nn.Linear(4, 4, dtype=F64), nn.Linear(4, 4, dtype=F64)
    tied_b.weight = tied_a.weight
    unused = nn.Linear(4, 4, dtype=F64)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.a, self.b, self.opaque, self.unused = shared, tied_a, tied_b, Opaque(), unused
            self.head = nn.Linear(4, 2, dtype=F64)

        def forward(self, x):
            h = torch.tanh(self.shared(torch.tanh(self.shared(x))))
            self.unused(h)  # output dropped
            h = self.opaque(self.b(self.a(h)))
            return self.head(h)

    net = Net()
    x, y = torch.randn(5, 4, dtype=F64), torch.randint(0, 2, (5,))
    with pytest.warns(UnmeasuredModuleWarning) as caught:
        report = divergence(net, x, ce(y), lr=LR)
    assert set(report.layers) == {"head"}
    reasons = report.skipped
    assert sorted(str(w.message).split("'")[1] for w in caught) == sorted(reasons)  # each named once
    assert "called 2 times" in reasons["shared"]
    assert "tied to module 'b'" in reasons["a"] and "tied to module 'a'" in reasons["b"]
    assert "does not reach the loss" in reasons["unused"]
    assert "opaque" in reasons and "jvp" in reasons["opaque"].lower()
    with pytest.raises(UnsupportedModuleError, match="module 'shared' \\(Linear\\): called 2 times"):
        divergence(net, x, ce(y), lr=LR, options=MeterOptions(on_unsupported="raise"))
    # network scope: the shared and tied modules still step; the diagonals take the masked route
    with pytest.warns(UnmeasuredModuleWarning, match="module '0' \\(Linear\\): called 2 times"):
        network = divergence(nn.Sequential(Net().shared, nn.Tanh(), Net().shared, nn.Linear(4, 2, dtype=F64)), x,
                             ce(y), lr=LR, scope="network")
    assert "called 2 times" in network.skipped["0"] and network.network_diagonal_route.startswith("masked")


def test_input_modified_in_place_after_the_call_is_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3, dtype=F64), nn.Linear(3, 2, dtype=F64)

        def forward(self, x):
            h = torch.tanh(x)
            z = self.a(h)
            h.mul_(2)  # a's input changes after a read it (a's weight gradient would be wrong too)
            return self.b(z + 0)

    x, y = torch.randn(4, 3, dtype=F64), torch.randint(0, 2, (4,))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        divergence(Net(), x, ce(y), lr=LR)  # autograd itself refuses: a saved its input


def test_dropout_in_network_scope_per_sample_is_refused_and_replayed_elsewhere():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 2)).to(F64).train()
    x, y = torch.randn(8, 4, dtype=F64), torch.randint(0, 2, (8,))
    with pytest.raises(UnsupportedModuleError, match="'1' \\(Dropout"):
        divergence(net, x, ce(y), lr=LR, scope="network")
    a = divergence(net, x, ce(y), lr=LR, scope="network", per_sample=False, options=MeterOptions(keep_updates=True))
    b = divergence(net, x, ce(y), lr=LR, scope="network", per_sample=False, options=MeterOptions(keep_updates=True))
    assert torch.equal(a.layers["2"].effective, b.layers["2"].effective)  # one mask for every pass
    assert a.layers["0"].diagonal_scale is None


def test_bad_input_is_refused_before_any_work():
    net = deep_net()
    x, y = batch()
    for kwargs, message in [({"scope": "model"}, "scope must be"), ({"reduction": "max"}, "reduction must be"),
                            ({"lr": 0.0}, "lr must be")]:
        with pytest.raises(ValueError, match=message):
            divergence(net, x, ce(y), **{"lr": LR, **kwargs})
    for options, message in [({"on_unsupported": "ignore"}, "on_unsupported must be"),
                             ({"memory_budget": 0}, "memory_budget must be"),
                             ({"masked_limit": 0}, "masked_limit must be"),
                             ({"keep_updates": "yes"}, "keep_updates must be")]:
        with pytest.raises(ValueError, match=message):
            MeterOptions(**options)
    with pytest.raises(TypeError, match="options must be a MeterOptions"):
        divergence(net, x, ce(y), lr=LR, options={"keep_updates": True})
    with pytest.raises(ValueError, match=r"per-sample losses, shape \(7,\)"):
        divergence(net, x, lambda out: F.cross_entropy(out, y), lr=LR)


def test_a_batch_of_one_has_no_off_diagonal_part():
    net = deep_net()
    x, y = batch(b=1)
    for scope in ("layer", "network"):
        report = divergence(net, x, ce(y), lr=LR, scope=scope)
        for name, layer in report.layers.items():
            assert float(layer.off_diagonal_share.abs().max()) < 1e-12
            if scope == "layer" and name in ("0", "2", "5", "7", "9"):  # the affine family: Θ_ii = K_ii·I
                assert float((layer.cosine - 1).abs().max()) < 1e-12


def test_records_are_json_ready():
    import json

    net = deep_net()
    x, y = batch()
    rows = divergence(net, x, ce(y), lr=LR).records()
    text = json.dumps(rows, allow_nan=False)
    assert {r["layer"] for r in json.loads(text)} == {"0", "2", "3", "5", "6", "7", "9"}
    affine_like = next(r for r in rows if r["layer"] == "2")
    assert affine_like["diagonal_norm_correlation"] is None and affine_like["diagonal_scale_cv"] < 1e-13


# ---------------------------------------------------------------------------------------------
# per-site diagonals, the training callback


def test_site_diagonal_scale_against_the_measured_site_diagonal():
    from affdiv.theory.cases import channels_first_sites, channels_last_sites
    from affdiv.verify.metrics import site_diagonal_update

    torch.manual_seed(0)
    cases = [
        (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, dtype=F64), nn.Tanh(), nn.Flatten(), nn.Linear(64, 2, dtype=F64)),
         torch.randn(3, 2, 4, 4, dtype=F64) + 0.5, channels_first_sites),
        (nn.Sequential(PatchNormConv2d(2, 4, 3, stride=2, padding=1, dtype=F64), nn.Tanh(), nn.Flatten(),
                       nn.Linear(16, 2, dtype=F64)), torch.randn(3, 2, 4, 4, dtype=F64) + 0.5, channels_first_sites),
        (nn.Sequential(nn.Linear(5, 4, dtype=F64), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2, dtype=F64)),
         torch.randn(3, 3, 5, dtype=F64) + 0.5, channels_last_sites),
        (nn.Sequential(AffineLike(5, 4, dtype=F64), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2, dtype=F64)),
         torch.randn(3, 3, 5, dtype=F64) + 0.5, channels_last_sites),
    ]
    for net, x, sites in cases:
        y = torch.randint(0, 2, (3,))
        layer = divergence(net, x, ce(y), lr=LR, options=MeterOptions(keep_updates=True)).layers["0"]
        g = layer.ideal / -LR
        own = site_diagonal_update(net[0], x, g, LR, sites)  # (n_sites, features), sample-major
        ideal = sites(layer.ideal)
        per_sample = own.shape[0] // 3
        expected = torch.stack([
            (own[i * per_sample:(i + 1) * per_sample] * ideal[i * per_sample:(i + 1) * per_sample]).sum()
            / (ideal[i * per_sample:(i + 1) * per_sample] ** 2).sum() for i in range(3)])
        assert torch.allclose(layer.site_diagonal_scale, expected, rtol=TOL), type(net[0])
    assert layer.site_diagonal_scale == pytest.approx(torch.ones(3, dtype=F64), abs=1e-13)  # AffineLike


def test_the_recorder_records_every_n_steps_and_leaves_training_bit_identical():
    from affdiv.meter import DivergenceRecorder

    def train(recorder):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.2), AffineLike(8, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(0)
        x_all, y_all = torch.randn(64, 6, generator=data), torch.randint(0, 3, (64,), generator=data)
        for step in range(6):
            index = torch.randperm(64, generator=data)[:16]
            if recorder is not None:
                recorder(net, step, (x_all[index], y_all[index]))
            loss = F.cross_entropy(net(x_all[index]), y_all[index])
            opt.zero_grad()
            loss.backward()
            opt.step()
        return net

    recorder = DivergenceRecorder(every=2)
    plain, probed = train(None), train(recorder)
    for (name, a), b in zip(plain.state_dict().items(), probed.state_dict().values()):
        assert torch.equal(a, b), name
    assert sorted({r["step"] for r in recorder.records}) == [0, 2, 4]
    assert {r["layer"] for r in recorder.records} == {"0", "1", "4"}
    import json

    json.dumps(recorder.records, allow_nan=False)
    first = next(r for r in recorder.records if r["layer"] == "4")
    assert first["site_diagonal_scale_mean"] == pytest.approx(1.0, abs=1e-6)  # float32: K_ii = 1
    with pytest.raises(ValueError, match="every must be"):
        DivergenceRecorder(every=0)


def test_a_module_that_modifies_its_input_in_place_is_refused():
    class Clamp(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3, dtype=F64)

        def forward(self, x):
            return self.lin(x.clamp_(min=0))  # Clamp owns no parameter; lin reads the clamped x

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3, dtype=F64))

        def forward(self, x):
            x.mul_(2)
            return x * self.s

    x, y = torch.randn(4, 3, dtype=F64), torch.randint(0, 2, (4,))
    net = nn.Sequential(nn.Linear(3, 3, dtype=F64), Clamp(), Scale(), nn.Linear(3, 2, dtype=F64))
    with pytest.warns(UnmeasuredModuleWarning, match="module '2' \\(Scale\\): it modifies its input in place"):
        report = divergence(net, x, ce(y), lr=LR)
    assert "modifies its input in place" in report.skipped["2"]
    assert "1.lin" in report.layers  # its input is the clamped tensor, unchanged after its call

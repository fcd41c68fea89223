"""effective_update measures the production layers of affdiv.layers (its jvp runs their forward
mode) and finds the theory's closed forms: the family theorem for AffineLike and NormLike, the
patch theorem for PatchNormConv1d/2d; a converted model with no closed form is measured against
the NTK and the Taylor order, and left untouched.

Tolerances as in ``affdiv.verify.checks``: TOL = 1e-10 for the closed form against autograd and
the NTK (the same sums in different orders), plus the cancellation bound 16u‖z‖∞/‖Δz‖∞ against
the real step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from affdiv.layers import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d, convert
from affdiv.theory import affine
from affdiv.theory.conv import Geometry, predict_conv
from affdiv.verify import effective_update, empirical_ntk, ntk_update
from affdiv.verify.checks import TOL, cancellation_bound, rel_err

F64 = torch.float64
DENSE = {
    "affine_like": lambda m, n: AffineLike(m, n, dtype=F64),
    "norm_l2": lambda m, n: NormLike(m, n, mode="l2", dtype=F64),
    "norm_rms": lambda m, n: NormLike(m, n, mode="rms", dtype=F64),
}


def _assert_closed_form(u, predicted):
    assert rel_err(predicted, u.linear) <= TOL
    assert rel_err(predicted, u.finite) <= TOL + cancellation_bound(u.output, u.finite)  # linear in θ


@pytest.mark.parametrize("member", DENSE)
@settings(max_examples=10)
@given(batch=st.integers(1, 12), m=st.integers(1, 10), n=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_dense_layers_measure_as_the_family_theorem(member, batch, m, n, seed):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = DENSE[member](m, n)
    x = affine.sample_inputs(batch, m, generator)
    g = torch.randn(batch, n, dtype=F64, generator=generator)
    u = effective_update(layer, x, g, lr=0.1)
    _assert_closed_form(u, affine.predict_update(affine.member(member), x, g, 0.1))


CONVS = [  # the layer, its input shape
    (lambda: PatchNormConv1d(2, 4, 3, padding=1, groups=2, dtype=F64), (3, 2, 7)),
    (lambda: PatchNormConv2d(3, 2, 3, stride=2, padding=1, dtype=F64), (2, 3, 6, 5)),
    (lambda: PatchNormConv2d(4, 6, 2, dilation=2, groups=2, dtype=F64), (2, 4, 5, 6)),
]


@pytest.mark.parametrize("make, shape", CONVS)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_patchnorm_layers_measure_as_the_patch_theorem(make, shape, recompute):
    torch.manual_seed(0)
    layer = make()
    layer.recompute = recompute
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, dtype=F64, generator=generator)
    g = torch.randn(layer(x).shape, dtype=F64, generator=generator)
    u = effective_update(layer, x, g, lr=0.1)
    geometry = Geometry.of(len(layer.kernel_size), layer.kernel_size, layer.stride, layer.padding, layer.dilation,
                           layer.groups)
    _assert_closed_form(u, predict_conv(x, geometry, g, 0.1, normalised=True))


def test_a_converted_model_is_measured_and_left_untouched():
    """Conv→ReLU(inplace)→Conv→ReLU(inplace)→Linear→Tanh→Linear, converted: no closed form, so
    the first order against the NTK (vmap of jacrev, independent of the jvp) and the Taylor
    order of the real step; every parameter the same object with the same value afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(inplace=True),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 5), nn.Tanh(), nn.Linear(5, 3),
    ).to(F64)
    convert(model, linear="norm_rms")
    before = [(p, p.detach().clone()) for p in model.parameters()]
    x = torch.randn(3, 2, 5, 5, dtype=F64)
    g = torch.randn(3, 3, dtype=F64)
    u = effective_update(model, x, g, lr=1e-3)
    assert rel_err(ntk_update(empirical_ntk(model, x), g, 1e-3), u.linear) <= TOL
    remainders = [float(effective_update(model, x, g, lr=lr).remainder.abs().max()) for lr in (1e-3, 1e-4)]
    assert 70 < remainders[0] / remainders[1] < 130  # O(η²)
    assert all(p is q and torch.equal(p, value) for (p, value), q in zip(before, model.parameters()))

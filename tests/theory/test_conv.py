"""Conv and PatchNorm: proofs hold, the patch closed form matches autograd and the real step over
geometries, the box filter equals the unfold definition, and planted wrong formulas fail."""

import dataclasses

import pytest
import sympy as sp
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from affdiv.theory import ProofKind, conv, registry
from affdiv.theory.exact import ETA
from affdiv.verify.checks import check_site_diagonal, check_update
from affdiv.verify.engine import effective_update
from affdiv.verify.metrics import site_diagonal_update


@st.composite
def geometries(draw):
    """Sizes for build(): any stride/padding/dilation/groups whose output is non-empty."""
    d = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 3))
    sizes = {
        "dims": d,
        "batch": draw(st.integers(1, 3)),
        "in_channels": groups * draw(st.integers(1, 2)),
        "out_channels": groups * draw(st.integers(1, 2)),
        "size": draw(st.integers(3, 8 if d == 1 else 5)),
        "kernel": draw(st.integers(1, 3)),
        "stride": draw(st.integers(1, 3)),
        "padding": draw(st.integers(0, 2)),
        "dilation": draw(st.integers(1, 2)),
        "groups": groups,
    }
    geometry = conv.geometry_of(sizes)
    assume(min(geometry.output_size((sizes["size"],) * d)) >= 1)
    return sizes


def test_both_are_registered_and_proven_at_general_size():
    """The index-form theorem (1-D and 2-D, symbolic sizes, stride, dilation, groups) sets the proof
    kind; the exact step at concrete geometries stays as corroboration and holds."""
    for name in ("conv", "patchnorm"):
        d = registry()[name]
        assert d.proven, [p for p in d.proof_steps() if not p.holds]
        assert d.proof_kind is ProofKind.SYMBOLIC_GENERAL
        exact = [p for p in d.proof_steps() if p.kind is ProofKind.EXACT_CONCRETE]
        assert len(exact) == 1 and exact[0].corroborates and exact[0].holds
        assert [p.claim[:9] for p in d.proof_steps()][:2] == ["1-D conv ", "2-D conv "]


def _without_group_restriction(form, n, o, p):
    """Planted: the patch over all C input channels (channel c itself), not o's group's C_g."""
    m, q, k = sp.Symbol("m", integer=True, nonnegative=True), form.index("q"), form.index("k")
    c, channels = sp.Symbol("c", integer=True, nonnegative=True), sp.Symbol("C", integer=True, positive=True)
    window = ((c, 0, channels - 1),) + tuple((ka, 0, size - 1) for ka, size in zip(k, form.kernel))
    dot = sp.Sum(form.tap(n, c, p, k) * form.tap(m, c, q, k), *window)
    kernel = form.scale(n, p) * form.scale(m, q) * (dot + 1)
    return -ETA * sp.Sum(kernel * form.arrays["g"][(m, o) + q], *form.over_sites(m, q))


def _output_delta_dropped(form, n, o, p):
    """Planted: δ(o, o') dropped, so every output channel's gradient reaches channel o."""
    m, q, o2 = sp.Symbol("m", integer=True, nonnegative=True), form.index("q"), sp.Symbol("o2", integer=True)
    kernel = form.scale(n, p) * form.scale(m, q) * (form.patch_dot(o, n, p, m, q) + 1)
    return -ETA * sp.Sum(kernel * form.arrays["g"][(m, o2) + q], *form.over_sites(m, q), (o2, 0, form.sizes["O"] - 1))


def _bias_dropped(form, n, o, p):
    """Planted: K = P·P without the +1 of the bias."""
    m, q = sp.Symbol("m", integer=True, nonnegative=True), form.index("q")
    kernel = form.scale(n, p) * form.scale(m, q) * form.patch_dot(o, n, p, m, q)
    return -ETA * sp.Sum(kernel * form.arrays["g"][(m, o) + q], *form.over_sites(m, q))


def _one_scale_only(form, n, o, p):
    """Planted: PatchNorm's α(n,p) α(m,q) taken as α(n,p) alone."""
    m, q = sp.Symbol("m", integer=True, nonnegative=True), form.index("q")
    kernel = form.scale(n, p) * (form.patch_dot(o, n, p, m, q) + 1)
    return -ETA * sp.Sum(kernel * form.arrays["g"][(m, o) + q], *form.over_sites(m, q))


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize(
    "wrong", [_without_group_restriction, _output_delta_dropped, _bias_dropped, _one_scale_only]
)
def test_planted_wrong_index_form_fails(dims, wrong):
    assert conv.conv_index_theorem(dims).holds
    assert not conv.conv_index_theorem(dims, closed_form=wrong).holds, wrong.__doc__


@settings(max_examples=12)
@given(sizes=geometries(), seed=st.integers(0, 2**16), lr=st.floats(1e-3, 10.0))
def test_conv_closed_form_matches_autograd_and_real_step(sizes, seed, lr):
    result = check_update(registry()["conv"], sizes, seed, lr=lr)
    assert result.passed, result
    assert "finite" in result.errors


@settings(max_examples=12)
@given(sizes=geometries(), seed=st.integers(0, 2**16), lr=st.floats(1e-3, 10.0))
def test_patchnorm_closed_form_matches_autograd_and_real_step(sizes, seed, lr):
    result = check_update(registry()["patchnorm"], sizes, seed, lr=lr)
    assert result.passed, result


@settings(max_examples=8)
@given(sizes=geometries(), seed=st.integers(0, 2**16), name=st.sampled_from(["conv", "patchnorm"]))
def test_site_diagonal_is_patch_norm_plus_one_or_one(sizes, seed, name):
    result = check_site_diagonal(registry()[name], sizes, seed)
    assert result.passed, result


@st.composite
def raw_geometries(draw):
    """Geometry with per-axis tuples (2-D) to exercise the box filter beyond square kernels."""
    d = draw(st.sampled_from([1, 2]))
    per_axis = (lambda s: st.tuples(*[s] * d)) if d == 2 else (lambda s: s)
    groups = draw(st.integers(1, 3))
    geometry = conv.Geometry.of(
        d,
        draw(per_axis(st.integers(1, 4))),
        draw(per_axis(st.integers(1, 3))),
        draw(per_axis(st.integers(0, 3))),
        draw(per_axis(st.integers(1, 3))),
        groups,
    )
    shape = (draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))) + tuple(
        draw(st.integers(1, 9)) for _ in range(d)
    )
    assume(min(geometry.output_size(shape[2:])) >= 1)
    return geometry, shape


@given(geometry_shape=raw_geometries(), seed=st.integers(0, 2**16))
def test_box_filter_equals_unfold_definition(geometry_shape, seed):
    geometry, shape = geometry_shape
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    box, unfold = conv.patch_sq_norms_box(x, geometry), conv.patch_sq_norms_unfold(x, geometry)
    assert box.shape == unfold.shape
    # both sum the same ≤ 3·16 non-negative squares in different orders: relative error ≤ 48 u ≈ 5e-15
    torch.testing.assert_close(box, unfold, rtol=1e-13, atol=0)


def test_box_filter_by_hand_on_a_tiny_1d_case():
    """Independent expected values: x = [1, 2, 3], kernel 2, padding 1, stride 2 -> patches
    [0, 1] and [2, 3] -> squared norms 1 and 13."""
    x = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float64)
    geometry = conv.Geometry.of(1, 2, stride=2, padding=1)
    expected = torch.tensor([[[1.0, 13.0]]], dtype=torch.float64)
    assert torch.equal(conv.patch_sq_norms_box(x, geometry), expected)
    assert torch.equal(conv.patch_sq_norms_unfold(x, geometry), expected)


def test_patches_of_groups_hold_only_their_channels():
    """Channel c of group γ appears only in γ's patch: a one-hot input lights one group."""
    x = torch.zeros(1, 4, 5, dtype=torch.float64)
    x[0, 3, 2] = 1.0  # channel 3 -> group 1 of 2
    p = conv.patches(x, conv.Geometry.of(1, 3, padding=1, groups=2))
    assert p[:, :, 0].abs().sum() == 0 and p[:, :, 1].abs().sum() == 3  # seen by three positions


def _with_kernel(kernel_of):
    """A predict that applies −η K with K = kernel_of(x, geometry) per group."""

    def predict(case, g, lr):
        x, geometry = case.inputs[0], conv._geometry_of_case(case)
        rows = torch.einsum("gpq,qgo->pgo", kernel_of(x, geometry), conv._as_rows(g, geometry.groups))
        return conv._from_rows(-lr * rows, g)

    return predict


@pytest.mark.parametrize(
    "name, wrong_kernel",
    [
        ("conv", lambda x, geo: conv.conv_kernel(x, geo, False) - 1),  # the +1 (bias path) dropped
        ("patchnorm", lambda x, geo: conv.conv_kernel(x, geo, False)),  # the normaliser forgotten
        ("patchnorm", lambda x, geo: torch.ones_like(conv.conv_kernel(x, geo, True))),  # "K = 1 everywhere"
    ],
)
def test_planted_wrong_formula_fails(name, wrong_kernel):
    d = registry()[name]
    result = check_update(dataclasses.replace(d, predict=_with_kernel(wrong_kernel)), d.sizes[2], seed=0)
    assert not result.passed
    assert result.errors["linear"] > 1e-3


def test_conv_kernel_ignoring_groups_fails():
    """Treating a grouped conv as ungrouped (patch = all input channels) is wrong."""
    d = registry()["conv"]
    sizes = d.sizes[1]
    assert sizes["groups"] > 1

    def ungrouped(case, g, lr):
        geo = dataclasses.replace(conv._geometry_of_case(case), groups=1)
        x = case.inputs[0]
        kernel = conv.conv_kernel(x, geo, False)[0]
        rows = g.flatten(2).permute(0, 2, 1).reshape(kernel.shape[0], -1)
        return conv._from_rows(-lr * kernel @ rows, g)

    result = check_update(dataclasses.replace(d, predict=ungrouped), sizes, seed=0)
    assert not result.passed and result.errors["linear"] > 1e-3


def test_coupling_parts_match_measured_updates():
    """own = each position from its own gradient; same-sample = that sample's gradients only, minus
    own; other samples = the rest — each measured by masking g, against the closed-form split."""
    d = registry()["patchnorm"]
    sizes = d.sizes[2]
    case = d.build(sizes, torch.Generator().manual_seed(3))
    x = case.inputs[0]
    geo = conv._geometry_of_case(case)
    with torch.no_grad():
        g = torch.randn_like(case.module(x))
    lr = 0.1
    split = conv.coupling(x, geo, g, normalised=True)
    own = site_diagonal_update(case.module, (x,), g, lr, d.sites)
    norm = lambda rows: rows.norm(dim=-1).reshape(split.own.shape)  # noqa: E731
    torch.testing.assert_close(lr * split.own, norm(own), rtol=1e-10, atol=0)
    same = torch.zeros_like(g)
    for b in range(x.shape[0]):
        mask = torch.zeros_like(g)
        mask[b] = 1
        same[b] = effective_update(case.module, (x,), g * mask, lr=lr).linear[b]
    same_rows = d.sites(same) - own
    torch.testing.assert_close(lr * split.same_sample_share * split.own, norm(same_rows), rtol=1e-9, atol=1e-14)
    total = d.sites(effective_update(case.module, (x,), g, lr=lr).linear)
    torch.testing.assert_close(
        lr * split.other_samples_share * split.own, norm(total - d.sites(same)), rtol=1e-9, atol=1e-14
    )


def test_patchnorm_couples_positions_even_without_overlap():
    """Stride = kernel (disjoint patches): the same-sample share is still far from 0 (the shared +1
    of the augmented patches and correlated content), and one sample has no other-sample share."""
    geometry = conv.Geometry.of(1, 3, stride=3)
    x = conv.correlated_rows((1, 2, 12), torch.Generator().manual_seed(0))
    g = torch.randn(1, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    split = conv.coupling(x, geometry, g, normalised=True)
    assert float(split.same_sample_share.min()) > 0.1
    assert float(split.other_samples_share.abs().max()) == 0.0


@pytest.mark.parametrize(
    "x, geometry, message",
    [
        (torch.zeros(2, 3, 5), conv.Geometry.of(2, 3), "expected input"),
        (torch.zeros(1, 3, 5), conv.Geometry.of(1, 3, groups=2), "not divisible"),
        (torch.zeros(1, 2, 2), conv.Geometry.of(1, 3), "too small"),
    ],
)
def test_bad_input_is_named(x, geometry, message):
    with pytest.raises(ValueError, match=message):
        conv.patches(x, geometry)


def test_bad_geometry_is_named():
    with pytest.raises(ValueError, match="dims must be 1 or 2"):
        conv.Geometry.of(3, 2)
    with pytest.raises(ValueError, match="kernel must be an int or 2 ints"):
        conv.Geometry.of(2, (1, 2, 3))
    with pytest.raises(ValueError, match="missing"):
        conv.build_case({"dims": 1}, torch.Generator(), False)

"""Every bad input on every layer raises an error naming the expected and the actual value."""

from __future__ import annotations

import re

import pytest
import torch

from affdiv.layers import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d
from affdiv.layers import functional as LF

LAYERS = {
    "AffineLike": (lambda: AffineLike(6, 4), (3, 6)),
    "NormLike": (lambda: NormLike(6, 4), (3, 6)),
    "PatchNormConv1d": (lambda: PatchNormConv1d(2, 4, 3, groups=2), (3, 2, 7)),
    "PatchNormConv2d": (lambda: PatchNormConv2d(2, 4, 3), (3, 2, 7, 5)),
}


def _wrong_shape(shape):
    """Right rank, wrong feature/channel count (the last dim for dense, dim 1 for conv)."""
    shape = list(shape)
    axis = -1 if len(shape) == 2 else 1
    shape[axis] += 1
    return shape


@pytest.mark.parametrize("name", LAYERS)
def test_wrong_feature_or_channel_count(name):
    make, shape = LAYERS[name]
    bad = _wrong_shape(shape)
    with pytest.raises(ValueError) as info:
        make()(torch.randn(*bad))
    message = str(info.value)
    assert str(tuple(bad)) in message  # the actual shape
    expected = "in_features=6" if len(shape) == 2 else "with 2 channels"
    assert expected in message  # the expected size


@pytest.mark.parametrize("name", ["PatchNormConv1d", "PatchNormConv2d"])
def test_wrong_rank_for_a_convolution(name):
    make, shape = LAYERS[name]
    bad = (1, *shape)
    with pytest.raises(ValueError, match=rf"expected input to be {len(shape) - 1}-D or {len(shape)}-D, got shape"):
        make()(torch.randn(*bad))


@pytest.mark.parametrize("name", ["AffineLike", "NormLike"])
def test_zero_dim_input(name):
    with pytest.raises(ValueError, match="at least 1 dimension, got a 0-D tensor"):
        LAYERS[name][0]()(torch.tensor(1.0))


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_float_input(name, dtype):
    make, shape = LAYERS[name]
    with pytest.raises(TypeError, match=f"floating-point dtype, got {dtype}"):
        make()(torch.zeros(*shape, dtype=dtype))


@pytest.mark.parametrize("name", LAYERS)
def test_input_dtype_different_from_the_weights(name):
    make, shape = LAYERS[name]
    with pytest.raises(TypeError, match="expected weight of the input's dtype torch.float64, got torch.float32"):
        make()(torch.randn(*shape, dtype=torch.float64))


@pytest.mark.parametrize("name", LAYERS)
def test_input_on_another_device_than_the_weights(name):
    make, shape = LAYERS[name]
    layer = make().to("meta")  # a second device that exists on every machine
    with pytest.raises(ValueError, match="expected weight on the input's device cpu, got meta"):
        layer(torch.randn(*shape))


@pytest.mark.parametrize("name", LAYERS)
def test_not_a_tensor(name):
    make, shape = LAYERS[name]
    with pytest.raises(TypeError, match="expected input to be a torch.Tensor, got list"):
        make()([[0.0] * shape[-1]])


def test_functional_bias_and_weight_shapes():
    x = torch.randn(3, 6)
    with pytest.raises(ValueError, match=r"expected bias of shape \(4,\) \(out_features\), got \(5,\)"):
        LF.affine_like(x, torch.randn(4, 6), torch.randn(5))
    with pytest.raises(ValueError, match=r"expected weight to be 2-D, got shape \(4, 6, 1\)"):
        LF.norm_like(x, torch.randn(4, 6, 1))
    with pytest.raises(ValueError, match=r"expected bias of shape \(4,\), got \(4, 1\)|expected bias to be 1-D"):
        LF.patchnorm_conv1d(torch.randn(1, 2, 5), torch.randn(4, 2, 3), torch.randn(4, 1))
    with pytest.raises(ValueError, match=r"out_channels divisible by groups.*weight of shape \(3, 1, 3\)"):
        LF.patchnorm_conv1d(torch.randn(1, 2, 5), torch.randn(3, 1, 3), groups=2)


def test_bad_options():
    with pytest.raises(ValueError, match="mode must be one of \\('l2', 'rms'\\), got 'l1'"):
        NormLike(3, 2, mode="l1")
    with pytest.raises(ValueError, match="eps must be a finite number > 0, got 0"):
        LF.norm_like(torch.randn(2, 3), torch.randn(2, 3), eps=0)
    x, w = torch.randn(1, 2, 6, 6), torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match=r"padding='same' needs stride 1, got stride=\(2, 2\)"):
        LF.patchnorm_conv2d(x, w, stride=2, padding="same")
    with pytest.raises(ValueError, match="padding must be 'same', 'valid' or ints, got 'full'"):
        LF.patchnorm_conv2d(x, w, padding="full")
    with pytest.raises(ValueError, match=r"stride must be an int >= 1 or 2 of them, got \(1, 0\)"):
        LF.patchnorm_conv2d(x, w, stride=(1, 0))
    with pytest.raises(ValueError, match=r"padding must be an int >= 0 or 2 of them, got -1"):
        LF.patchnorm_conv2d(x, w, padding=-1)
    with pytest.raises(ValueError, match="groups must be an integer >= 1, got 0"):
        LF.patchnorm_conv2d(x, w, groups=0)
    with pytest.raises(ValueError, match=r"kernel extent \(3, 3\) exceeds the padded input size \(2, 2\)"):
        LF.patchnorm_conv2d(torch.randn(1, 2, 2, 2), w)


@pytest.mark.parametrize("eps", [0, -1e-6, float("nan"), float("inf"), True, "1e-6", None])
def test_norm_like_rejects_a_bad_eps_at_construction_and_in_the_functional(eps):
    with pytest.raises(ValueError, match=re.escape(f"NormLike: eps must be a finite number > 0, got {eps!r}")):
        NormLike(3, 2, eps=eps)
    with pytest.raises(ValueError, match=re.escape(f"norm_like: eps must be a finite number > 0, got {eps!r}")):
        LF.norm_like(torch.randn(2, 3), torch.randn(2, 3), eps=eps)


def test_norm_like_stores_a_good_eps_as_a_float():
    layer = NormLike(3, 2, eps=1)
    assert type(layer.eps) is float and layer.eps == 1.0


@pytest.mark.parametrize("what, value", [
    ("stride", True), ("stride", 1.0), ("stride", (1,)), ("stride", (1, 1, 1)), ("dilation", (1, 0)),
    ("dilation", None), ("padding", (0, False)), ("padding", 1.5),
])
def test_conv_geometry_must_be_ints_of_the_right_count(what, value):
    minimum = 0 if what == "padding" else 1
    x, w = torch.randn(1, 2, 6, 6), torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match=re.escape(f"{what} must be an int >= {minimum} or 2 of them, got {value!r}")):
        LF.patchnorm_conv2d(x, w, **{what: value})


@pytest.mark.parametrize("groups", [True, 1.0, 0])
def test_conv_groups_must_be_a_positive_int(groups):
    with pytest.raises(ValueError, match=f"groups must be an integer >= 1, got {groups!r}"):
        LF.patchnorm_conv1d(torch.randn(1, 2, 6), torch.randn(2, 2, 3), groups=groups)


@pytest.mark.parametrize("recompute", [1, "yes", None])
def test_patchnorm_recompute_must_be_a_bool(recompute):
    with pytest.raises(TypeError, match=f"recompute must be a bool, got {re.escape(repr(recompute))}"):
        PatchNormConv2d(2, 4, 3, recompute=recompute)
    with pytest.raises(TypeError, match=f"recompute must be a bool, got {re.escape(repr(recompute))}"):
        LF.patchnorm_conv1d(torch.randn(1, 2, 5), torch.randn(4, 2, 3), recompute=recompute)

"""The method registry: every method builds the network it names, at any depth, width, activation."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from affdiv.experiments.runs.config import ACTIVATIONS, CNN_METHODS, METHODS, MLP_METHODS, VIT_METHODS
from affdiv.experiments.runs.models import ACTIVATION_MODULES, CNN_BLOCKS, MLP_BLOCKS, build_model

# The layer each method puts in every hidden block (the one the theory is about).
HIDDEN_LAYER = {
    "affine": nn.Linear,
    "batchnorm": nn.BatchNorm1d,
    "layernorm": nn.LayerNorm,
    "rmsnorm": nn.RMSNorm,
    "conv": nn.Conv2d,
    "conv+batchnorm": nn.BatchNorm2d,
}


def _corrected_layer(method):
    import affdiv.layers as layers

    return {"norm_l2": layers.NormLike, "affine_like": layers.AffineLike, "patchnorm": layers.PatchNormConv2d}[method]


def _count(model, kind):
    return sum(isinstance(m, kind) for m in model.modules())


@given(
    method=st.sampled_from(sorted(MLP_METHODS)),
    depth=st.integers(1, 3),
    width=st.integers(1, 9),
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    batch=st.integers(2, 5),
)
def test_mlp_shapes_blocks_and_gradients(method, depth, width, activation, batch):
    torch.manual_seed(0)
    model = build_model(method, input_shape=(2, 3), num_classes=4, depth=depth, width=width, activation=activation)
    out = model(torch.randn(batch, 2, 3))
    assert out.shape == (batch, 4)
    kind = HIDDEN_LAYER.get(method) or _corrected_layer(method)
    # affine: depth hidden Linear + the Linear read-out; everything else: depth blocks of its kind.
    assert _count(model, kind) == depth + (method == "affine")
    assert _count(model, ACTIVATION_MODULES[activation]) >= depth
    assert isinstance(model[-1], nn.Linear) and model[-1].out_features == 4
    out.square().sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize("method", sorted(CNN_METHODS))
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 5, 7)])
def test_cnn_shapes_and_blocks(method, shape):
    torch.manual_seed(0)
    model = build_model(method, input_shape=shape, num_classes=3, depth=2, width=4, activation="relu")
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    kind = HIDDEN_LAYER.get(method) or _corrected_layer(method)
    assert _count(model, kind) == 2


def test_same_seed_same_initialisation():
    def params(seed):
        torch.manual_seed(seed)
        model = build_model("batchnorm", input_shape=(5,), num_classes=2, depth=2, width=3, activation="tanh")
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(params(1), params(1))
    assert not torch.equal(params(1), params(2))


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown method 'dropout'.*affine.*batchnorm.*patchnorm"):
        build_model("dropout", input_shape=(4,), num_classes=2, depth=1, width=2, activation="tanh")
    assert set(METHODS) == set(MLP_METHODS) | set(CNN_METHODS) | set(VIT_METHODS)


def test_every_named_method_and_activation_has_its_module_and_no_other():
    assert tuple(MLP_BLOCKS) == MLP_METHODS and tuple(CNN_BLOCKS) == CNN_METHODS
    assert tuple(ACTIVATION_MODULES) == ACTIVATIONS


def test_bad_activation_depth_and_input_shape():
    with pytest.raises(ValueError, match="unknown activation 'swish'.*tanh"):
        build_model("affine", input_shape=(4,), num_classes=2, depth=1, width=2, activation="swish")
    with pytest.raises(ValueError, match="depth=0"):
        build_model("affine", input_shape=(4,), num_classes=2, depth=0, width=2, activation="tanh")
    with pytest.raises(ValueError, match=r"needs image inputs \(C, H, W\); got input shape \(64,\)"):
        build_model("conv", input_shape=(64,), num_classes=2, depth=1, width=2, activation="relu")

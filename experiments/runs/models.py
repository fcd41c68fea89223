"""The networks the falsification sweeps train, built from a method name.

A *method* names what every hidden layer is; everything else (depth, width, activation, the
linear read-out) is shared, so that two methods differ only in the layer the theory is about.

MLP (input flattened):   [hidden(method) -> activation] x depth -> Linear read-out
    affine       z = W x + b                               (no normalisation)
    batchnorm    Linear (no bias, BN shifts) -> BatchNorm1d
    layernorm    Linear -> LayerNorm
    rmsnorm      Linear -> RMSNorm
    norm_l2      NormLike(mode="l2")                   (the paper's norm-like correction)
    affine_like  AffineLike                                (the paper's affine-like correction)

CNN (image input C,H,W): [conv block(method) -> activation -> 2x2 max-pool while H,W >= 2] x depth
                         -> global average pool -> Linear read-out; every block has `width` channels.
    conv             Conv2d 3x3
    conv+batchnorm   Conv2d 3x3 (no bias) -> BatchNorm2d
    patchnorm        PatchNormConv2d 3x3                   (the paper's convolutional correction)

ViT (image input C,H,W, H and W multiples of 4; ``runs/transformer.py``): a 4x4 grid of patches
(Fashion-MNIST: 7x7 pixels, 16 tokens) -> Linear embedding to ``width`` + learned position embedding
-> ``depth`` pre-norm blocks [x + Attn(N(x)); x + MLP(N(x)), MLP width -> 2·width -> width with
``activation``] -> N -> mean over tokens -> Linear read-out; 4 heads of width/4 (width a multiple of 4).
    vit                     nn.Linear q, k, v, o and MLP projections, N = LayerNorm   (the practitioners' baseline)
    vit-qknorm              the same with QK-norm: RMSNorm on each head's queries and keys
    vit-affine_like         AffineLike q, k, v, o and MLP projections, N = LayerNorm  (the paper's correction per layer)
    vit-affine_like-qknorm  the same with QK-norm
    vit-nonorm              nn.Linear projections, no normalisation at all (N = identity, no QK-norm).
                            It trains at these sizes: on Fashion-MNIST (width 32, depth 1, gelu, plain SGD,
                            B = 64, seed 0) it reached 0.80 validation accuracy in 1800 steps at lr 0.3
                            (vit: 1100) and in 2600 at lr 0.1, and diverged at lr 1.0 (vit: 1800 steps).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from affdiv.checks import check_choice
from affdiv.experiments.runs.config import ACTIVATIONS, METHODS, MLP_METHODS
from affdiv.experiments.runs.transformer import VisionTransformer

Block = Callable[[int, int], list[nn.Module]]

#: The modules behind ``config.ACTIVATIONS``.
ACTIVATION_MODULES: dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "identity": nn.Identity,
}


def _norm_like(n_in: int, n_out: int) -> list[nn.Module]:
    from affdiv.layers import NormLike

    return [NormLike(n_in, n_out, mode="l2")]


def _affine_like(n_in: int, n_out: int) -> list[nn.Module]:
    from affdiv.layers import AffineLike

    return [AffineLike(n_in, n_out)]


def _patchnorm(c_in: int, c_out: int) -> list[nn.Module]:
    from affdiv.layers import PatchNormConv2d

    return [PatchNormConv2d(c_in, c_out, 3, padding=1)]


#: The hidden blocks behind ``config.MLP_METHODS`` and ``config.CNN_METHODS``.
MLP_BLOCKS: dict[str, Block] = {
    "affine": lambda n_in, n_out: [nn.Linear(n_in, n_out)],
    "batchnorm": lambda n_in, n_out: [nn.Linear(n_in, n_out, bias=False), nn.BatchNorm1d(n_out)],
    "layernorm": lambda n_in, n_out: [nn.Linear(n_in, n_out), nn.LayerNorm(n_out)],
    "rmsnorm": lambda n_in, n_out: [nn.Linear(n_in, n_out), nn.RMSNorm(n_out)],
    "norm_l2": _norm_like,
    "affine_like": _affine_like,
}

CNN_BLOCKS: dict[str, Block] = {
    "conv": lambda c_in, c_out: [nn.Conv2d(c_in, c_out, 3, padding=1)],
    "conv+batchnorm": lambda c_in, c_out: [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
    ],
    "patchnorm": _patchnorm,
}

#: The variants behind ``config.VIT_METHODS``: (AffineLike projections, QK-norm, LayerNorm).
VIT_VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "vit": (False, False, True),
    "vit-qknorm": (False, True, True),
    "vit-affine_like": (True, False, True),
    "vit-affine_like-qknorm": (True, True, True),
    "vit-nonorm": (False, False, False),
}


def build_model(
    method: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    depth: int,
    width: int,
    activation: str,
) -> nn.Module:
    """The network for ``method`` (an MLP, CNN or ViT method name) on inputs of ``input_shape``."""
    check_choice("method", method, METHODS)
    check_choice("activation", activation, ACTIVATIONS)
    if depth < 1 or width < 1:
        raise ValueError(f"depth and width must be >= 1, got depth={depth}, width={width}")
    act = ACTIVATION_MODULES[activation]
    if method in VIT_VARIANTS:
        affine_like, qk_norm, norm = VIT_VARIANTS[method]
        return VisionTransformer(tuple(input_shape), num_classes, depth=depth, dim=width, activation=act,
                                 affine_like=affine_like, qk_norm=qk_norm, norm=norm)
    layers: list[nn.Module] = []
    if method in MLP_METHODS:
        n_in = 1
        for size in input_shape:
            n_in *= size
        layers.append(nn.Flatten())
        for _ in range(depth):
            layers += [*MLP_BLOCKS[method](n_in, width), act()]
            n_in = width
    else:
        if len(input_shape) != 3:
            raise ValueError(
                f"CNN method {method!r} needs image inputs (C, H, W); got input shape {input_shape}"
            )
        channels, height, breadth = input_shape
        for _ in range(depth):
            layers += [*CNN_BLOCKS[method](channels, width), act()]
            channels = width
            if min(height, breadth) >= 2:
                layers.append(nn.MaxPool2d(2))
                height, breadth = height // 2, breadth // 2
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def build_network(config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The network of a run's ``config`` (a :class:`~affdiv.experiments.runs.config.RunConfig`):
    its ``model`` factory's (:mod:`~affdiv.experiments.runs.factories`) for a method of one's
    own, else :func:`build_model`'s for its method, depth, width and activation."""
    if config.model is not None:
        from affdiv.experiments.runs.factories import build

        return build(config.model, config.model_digest, tuple(input_shape), num_classes)
    return build_model(config.method, input_shape=tuple(input_shape), num_classes=num_classes,
                       depth=config.depth, width=config.width, activation=config.activation)

"""The built-in models of the divergence meter (``affdiv probe --model NAME``), and how a model is
named on the command line.

Every built-in is a factory ``(input_shape, num_classes) -> nn.Module`` for image inputs (C, H, W):

    layer-<member>       one layer from the flattened input to the logits: the affine family's
                         members as production layers (affine = nn.Linear, norm_l2 / norm_rms =
                         NormLike, affine_like = AffineLike): the old member-based probe
    mlp-<method>         the harness's MLP for every method of ``config.MLP_METHODS``
                         (depth 3, width 256, tanh: the fashion preset's networks)
    cnn-<method>         the harness's CNN for every method of ``config.CNN_METHODS``
                         (depth 3, width 32, relu: the paper preset's CNNs at half width)
    vit, vit-<variant>   the harness's vision transformer for every method of ``config.VIT_METHODS``
                         (depth 1, width 32, gelu: 16 patch tokens, 4 heads of 8; ``runs/models.py``)
    resnet               a small ResNet: 3x3 stem, two basic blocks (16 channels, then 32 at
                         stride 2 with a 1x1 projection), global average pool, linear read-out;
                         Conv2d -> BatchNorm2d everywhere (the standard block)
    resnet-conv          the same with plain Conv2d (with bias) and no normalisation
    resnet-patchnorm     the same with PatchNormConv2d and no normalisation
    transformer          one pre-norm transformer block on the image read as tokens (each row of
                         H a token of C*W features: Fashion-MNIST 28 tokens of 28, digits 8 of 8):
                         linear embedding to d=32 plus a learned position embedding,
                         x + Attn(LN(x)), x + MLP(LN(x)) (2 heads, MLP 32->64->32 GELU),
                         LayerNorm, mean over tokens, linear read-out; nn.Linear projections
    transformer-qknorm   the same with QK-norm: RMSNorm (learned scale) on each head's queries
                         and keys before the scores
    transformer-affine_like, transformer-affine_like-qknorm
                         the same with AffineLike as the q, k, v, o and MLP projections

A model given as ``package.module:factory`` is imported and called as
``factory(input_shape=..., num_classes=...)`` when its signature takes those, else ``factory()``.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from affdiv.experiments.runs.config import CNN_METHODS, MLP_METHODS, VIT_METHODS
from affdiv.experiments.runs.models import build_model
from affdiv.experiments.runs.transformer import Patches, PositionEmbedding, TransformerBlock

Factory = Callable[..., nn.Module]

MLP_DEFAULTS = {"depth": 3, "width": 256, "activation": "tanh"}
CNN_DEFAULTS = {"depth": 3, "width": 32, "activation": "relu"}
VIT_DEFAULTS = {"depth": 1, "width": 32, "activation": "gelu"}
MEMBERS = ("affine", "norm_l2", "norm_rms", "affine_like")


# ---------------------------------------------------------------------------------------------
# one layer (the affine family's members as production layers)


def _single_layer(member: str) -> Factory:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        from affdiv.layers import AffineLike, NormLike

        n_in = math.prod(input_shape)
        layer = {
            "affine": lambda: nn.Linear(n_in, num_classes),
            "norm_l2": lambda: NormLike(n_in, num_classes, mode="l2"),
            "norm_rms": lambda: NormLike(n_in, num_classes, mode="rms"),
            "affine_like": lambda: AffineLike(n_in, num_classes),
        }[member]()
        return nn.Sequential(nn.Flatten(), layer)

    return build


def _harness(method: str, defaults: dict) -> Factory:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        return build_model(method, input_shape=tuple(input_shape), num_classes=num_classes, **defaults)

    return build


# ---------------------------------------------------------------------------------------------
# a small ResNet


def _conv(kind: str, c_in: int, c_out: int, kernel: int, stride: int) -> list[nn.Module]:
    padding = kernel // 2
    if kind == "bn":
        return [nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False), nn.BatchNorm2d(c_out)]
    if kind == "conv":
        return [nn.Conv2d(c_in, c_out, kernel, stride, padding)]
    from affdiv.layers import PatchNormConv2d

    return [PatchNormConv2d(c_in, c_out, kernel, stride, padding)]


class BasicBlock(nn.Module):
    """relu(F(x) + S(x)), F = conv-[norm]-relu-conv-[norm], S = identity or a 1x1 projection."""

    def __init__(self, kind: str, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.branch = nn.Sequential(*_conv(kind, c_in, c_out, 3, stride), nn.ReLU(),
                                    *_conv(kind, c_out, c_out, 3, 1))
        self.shortcut = (nn.Identity() if stride == 1 and c_in == c_out
                         else nn.Sequential(*_conv(kind, c_in, c_out, 1, stride)))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.branch(x) + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, kind: str, in_channels: int, num_classes: int, widths=(16, 32)):
        super().__init__()
        self.stem = nn.Sequential(*_conv(kind, in_channels, widths[0], 3, 1), nn.ReLU())
        self.block1 = BasicBlock(kind, widths[0], widths[0], 1)
        self.block2 = BasicBlock(kind, widths[0], widths[1], 2)
        self.head = nn.Linear(widths[1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block2(self.block1(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def _resnet(kind: str) -> Factory:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        _require_image("resnet", input_shape)
        return SmallResNet(kind, input_shape[0], num_classes)

    return build


# ---------------------------------------------------------------------------------------------
# a small pre-norm transformer block on image rows as tokens


class TokenTransformer(nn.Module):
    """One pre-norm block on the image's rows as tokens (module docstring)."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, dim: int = 32, heads: int = 2,
                 affine_like: bool = False, qk_norm: bool = False):
        super().__init__()
        channels, height, width = input_shape
        self.tokens = Patches((1, width))
        self.embed = nn.Linear(channels * width, dim)
        self.position = PositionEmbedding(height, dim)
        self.block = TransformerBlock(dim, heads, affine_like, qk_norm)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(self.position(self.embed(self.tokens(x))))
        return self.head(self.norm(h).mean(dim=1))


def _transformer(affine_like: bool, qk_norm: bool) -> Factory:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        _require_image("transformer", input_shape)
        return TokenTransformer(tuple(input_shape), num_classes, affine_like=affine_like, qk_norm=qk_norm)

    return build


def _require_image(name: str, input_shape: tuple[int, ...]) -> None:
    if len(input_shape) != 3:
        raise ValueError(f"model {name!r} needs image inputs (C, H, W); got input shape {tuple(input_shape)}")


# ---------------------------------------------------------------------------------------------
# the registry


BUILTIN: dict[str, Factory] = {
    **{f"layer-{m}": _single_layer(m) for m in MEMBERS},
    **{f"mlp-{m}": _harness(m, MLP_DEFAULTS) for m in MLP_METHODS},
    **{f"cnn-{m}": _harness(m, CNN_DEFAULTS) for m in CNN_METHODS},
    **{m: _harness(m, VIT_DEFAULTS) for m in VIT_METHODS},
    "resnet": _resnet("bn"),
    "resnet-conv": _resnet("conv"),
    "resnet-patchnorm": _resnet("patchnorm"),
    "transformer": _transformer(False, False),
    "transformer-qknorm": _transformer(False, True),
    "transformer-affine_like": _transformer(True, False),
    "transformer-affine_like-qknorm": _transformer(True, True),
}


def resolve(spec: str) -> Factory:
    """The factory for a built-in name or ``package.module:factory``; a ValueError naming the
    built-ins (or what failed to import) otherwise. Nothing is built."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a model is a built-in name or package.module:factory, got {spec!r}")
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"unknown model {spec!r}; built-in models: {', '.join(BUILTIN)} "
                         "(or give package.module:factory)")
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model {spec!r}: cannot import {module_name!r} ({error})") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"model {spec!r}: {module_name!r} has no callable {attribute!r}")
    return factory


def build(spec: str, *, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the model ``spec`` names (see :func:`resolve`) for inputs of ``input_shape``."""
    factory = resolve(spec)
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        parameters = {}
    takes = {"input_shape", "num_classes"} <= set(parameters) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    try:  # the user's code: whatever it raises is bad input for this command, named with the model
        model = factory(input_shape=tuple(input_shape), num_classes=num_classes) if takes else factory()
    except Exception as error:
        raise ValueError(f"model {spec!r}: the factory failed: {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec!r}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model

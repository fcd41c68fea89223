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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from affdiv.experiments.runs.config import CNN_METHODS, MLP_METHODS
from affdiv.experiments.runs.models import build_model

Factory = Callable[..., nn.Module]

MLP_DEFAULTS = {"depth": 3, "width": 256, "activation": "tanh"}
CNN_DEFAULTS = {"depth": 3, "width": 32, "activation": "relu"}
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


class Tokens(nn.Module):
    """(B, C, H, W) -> (B, H, C·W): each image row is one token."""

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


class PositionEmbedding(nn.Module):
    """x + P, P a learned (T, d) table."""

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(tokens, dim) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.weight


def _projection(affine_like: bool) -> Callable[[int, int], nn.Module]:
    if affine_like:
        from affdiv.layers import AffineLike

        return AffineLike
    return nn.Linear


class Attention(nn.Module):
    """Multi-head self-attention written out (softmax(q kᵀ/√d_h) v), with separate q, k, v, o
    projections so that each is measured; QK-norm: RMSNorm with a learned scale on each head's
    queries and keys."""

    def __init__(self, dim: int, heads: int, affine_like: bool, qk_norm: bool):
        super().__init__()
        proj = _projection(affine_like)
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (proj(dim, dim) for _ in range(4))
        self.q_norm = nn.RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim) if qk_norm else None

    def _split(self, t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        y = torch.softmax(scores, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(x.shape))


class TransformerBlock(nn.Module):
    """Pre-norm: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int, affine_like: bool, qk_norm: bool):
        super().__init__()
        proj = _projection(affine_like)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, affine_like, qk_norm)
        self.mlp = nn.Sequential(proj(dim, 2 * dim), nn.GELU(), proj(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TokenTransformer(nn.Module):
    def __init__(self, tokens: int, features: int, num_classes: int, dim: int = 32, heads: int = 2,
                 affine_like: bool = False, qk_norm: bool = False):
        super().__init__()
        self.tokens = Tokens()
        self.embed = nn.Linear(features, dim)
        self.position = PositionEmbedding(tokens, dim)
        self.block = TransformerBlock(dim, heads, affine_like, qk_norm)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block(self.position(self.embed(self.tokens(x))))
        return self.head(self.norm(h).mean(dim=1))


def _transformer(affine_like: bool, qk_norm: bool) -> Factory:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        _require_image("transformer", input_shape)
        channels, height, width = input_shape
        return TokenTransformer(height, channels * width, num_classes, affine_like=affine_like, qk_norm=qk_norm)

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


def check_forward(spec: str, model: nn.Module, x: torch.Tensor) -> None:
    """Run ``model`` once on the batch ``x`` (without gradients): whatever the user's forward raises
    is bad input for the command, a ValueError naming the model, the batch's shape and the error."""
    try:
        with torch.no_grad():
            model(x)
    except Exception as error:  # noqa: BLE001  (the user's code)
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"model {spec!r}: its forward failed on a batch of shape {tuple(x.shape)}: "
                         f"{type(error).__name__}: {reason}") from None

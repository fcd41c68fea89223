"""Swap the plain layers of an existing model for the corrected ones.

``convert(model)`` walks the module tree and replaces, in place:

* every module whose type is exactly nn.Linear by AffineLike (``linear="affine_like"``) or
  NormLike (``linear="norm_l2"`` / ``"norm_rms"``), or leaves it (``linear=None``);
* every module whose type is exactly nn.Conv1d / nn.Conv2d by PatchNormConv1d / 2d
  (``conv=False`` leaves them; ``recompute=True`` makes them save one float per position
  instead of their output, see PatchNormConv2d).

The new module gets the same constructor arguments and *the same Parameter objects* (so an
optimizer built before the swap still updates them): the weights are kept, and with them what
the plain layer had learned, but the function changes (that is the point). Subclasses of
nn.Linear / nn.Conv*d are never swapped (they may use ``.weight`` outside ``forward``, as
nn.MultiheadAttention's out_proj does), nor anything ``skip(path, module)`` returns True for.

``following_norm="remove"`` also replaces by nn.Identity a LayerNorm, RMSNorm or BatchNorm1d
that directly follows a swapped nn.Linear *in the same nn.Sequential* (only there is "follows"
defined by the module tree); its parameters and statistics are dropped (``weights_kept=False``
in its record). The corrected layer takes over the normalisation; the norm's learned affine
(γ, β) cannot be folded exactly into AffineLike (β would be scaled by the row scale), so it
is not. ``following_norm="keep"`` (the default) leaves such norms in place.

Returns the list of ``SwapRecord`` (path, old type, new type, weights kept), in tree order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn

from affdiv.layers.modules import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d

LINEAR_TARGETS = ("affine_like", "norm_l2", "norm_rms")
FOLLOWING_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d)


@dataclass(frozen=True)
class SwapRecord:
    """One replacement: the module's dotted path, its old and new type names, and whether its
    parameters live on in the new module."""

    path: str
    old_type: str
    new_type: str
    weights_kept: bool


def convert(
    model: nn.Module,
    *,
    linear: str | None = "affine_like",
    conv: bool = True,
    following_norm: str = "keep",
    eps: float | None = None,
    recompute: bool = False,
    skip: Callable[[str, nn.Module], bool] | None = None,
) -> list[SwapRecord]:
    """Swap in place (see the module doc); returns what was swapped. ``eps`` goes to NormLike,
    ``recompute`` to PatchNormConv1d / 2d."""
    if linear is not None and linear not in LINEAR_TARGETS:
        raise ValueError(f"convert: linear must be one of {LINEAR_TARGETS} or None, got {linear!r}")
    if following_norm not in ("keep", "remove"):
        raise ValueError(f"convert: following_norm must be 'keep' or 'remove', got {following_norm!r}")
    if isinstance(model, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        raise TypeError("convert: pass a container module; a bare layer cannot be replaced in place")
    records: list[SwapRecord] = []
    replace = partial(_replacement, linear=linear, conv=conv, eps=eps, recompute=recompute)
    _convert_children(model, "", replace, following_norm, skip or (lambda path, module: False), records)
    return records


def _convert_children(parent, prefix, replace, following_norm, skip, records) -> None:
    previous_swapped_linear = False
    for name, child in list(parent.named_children()):
        path = f"{prefix}{name}"
        if skip(path, child):
            previous_swapped_linear = False
            continue
        replacement = replace(child)
        if replacement is not None:
            setattr(parent, name, replacement)
            records.append(SwapRecord(path, type(child).__name__, type(replacement).__name__, True))
            previous_swapped_linear = type(child) is nn.Linear
            continue
        if (
            following_norm == "remove"
            and previous_swapped_linear
            and isinstance(parent, nn.Sequential)
            and type(child) in FOLLOWING_NORMS
        ):
            setattr(parent, name, nn.Identity())
            records.append(SwapRecord(path, type(child).__name__, "Identity", False))
        elif not isinstance(child, nn.MultiheadAttention):
            _convert_children(child, f"{path}.", replace, following_norm, skip, records)
        previous_swapped_linear = False


def _replacement(module: nn.Module, linear: str | None, conv: bool, eps: float | None,
                 recompute: bool) -> nn.Module | None:
    kind = type(module)
    if kind is nn.Linear and linear is not None:
        factory = {"device": module.weight.device, "dtype": module.weight.dtype}
        if linear == "affine_like":
            new = AffineLike(module.in_features, module.out_features, module.bias is not None, **factory)
        else:
            extra = {} if eps is None else {"eps": eps}
            new = NormLike(
                module.in_features, module.out_features, module.bias is not None, mode=linear[len("norm_"):],
                **extra, **factory,
            )
    elif kind in (nn.Conv1d, nn.Conv2d) and conv:
        cls = PatchNormConv1d if kind is nn.Conv1d else PatchNormConv2d
        new = cls(
            module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
            module.dilation, module.groups, module.bias is not None, module.padding_mode,
            device=module.weight.device, dtype=module.weight.dtype, recompute=recompute,
        )
    else:
        return None
    new.weight = module.weight
    new.bias = module.bias
    new.train(module.training)
    return new

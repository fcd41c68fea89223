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

A module registered at several paths (``Sequential(lin, Tanh(), lin)``, ``self.a = self.b =
block``) is judged once, at its first path in tree order, and every use gets the same outcome:
one new module shared by all of them, as the old one was (so the sharing, and the
parameters' sharing, survive the swap).

Returns the list of ``SwapRecord`` (path, old type, new type, weights kept), in tree order: one
per attribute set, so a module swapped at two paths has two records.
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
    r"""One replacement made by :func:`convert`.

    Args:
        path: the dotted path of the attribute that was set (as in ``named_modules``).
        old_type: the replaced module's type name, e.g. ``"Linear"``.
        new_type: the new module's type name, e.g. ``"AffineLike"`` or ``"Identity"``.
        weights_kept: whether the old module's parameters live on in the new one (the same
            Parameter objects); False for a removed norm.

    Example::

        >>> from torch import nn
        >>> from affdiv.layers import convert
        >>> convert(nn.Sequential(nn.Linear(4, 2)))
        [SwapRecord(path='0', old_type='Linear', new_type='AffineLike', weights_kept=True)]
    """

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
    r"""Swap, in place, every plain ``nn.Linear`` / ``nn.Conv1d`` / ``nn.Conv2d`` of ``model`` for
    the corrected layer (Linear → AffineLike z = (Wx + b)/√(‖x‖² + 1) or NormLike, Conv →
    PatchNormConv), keeping the Parameter objects; see the module docstring for the rules.

    Args:
        model: a container module (a bare layer cannot be replaced in place: TypeError).
        linear: ``"affine_like"``, ``"norm_l2"``, ``"norm_rms"`` (the layer kind each
            nn.Linear becomes) or ``None`` (leave them). Default: ``"affine_like"``.
        conv: swap nn.Conv1d / nn.Conv2d for PatchNormConv1d / 2d. Default: ``True``.
        following_norm: ``"keep"`` or ``"remove"`` (replace by nn.Identity a LayerNorm,
            RMSNorm or BatchNorm1d directly after a swapped nn.Linear in an nn.Sequential).
            Default: ``"keep"``.
        eps: NormLike's eps. Default: ``None`` (NormLike's default, 1e-12).
        recompute: PatchNormConv's ``recompute``. Default: ``False``.
        skip: ``skip(path, module)`` True leaves that module and everything under it alone.
            Default: ``None`` (skip nothing).

    Returns:
        the list of :class:`SwapRecord`, in tree order, one per attribute set.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from affdiv.layers import convert
        >>> shared = nn.Linear(8, 8)
        >>> model = nn.Sequential(shared, nn.Tanh(), shared, nn.LayerNorm(8))
        >>> for record in convert(model, linear="norm_l2", following_norm="remove"):
        ...     print(record.path, record.old_type, "->", record.new_type, record.weights_kept)
        0 Linear -> NormLike True
        2 Linear -> NormLike True
        3 LayerNorm -> Identity False
        >>> model[0] is model[2] and model[0].weight is shared.weight  # one new module, the same weights
        True
        >>> model(torch.randn(5, 8)).shape
        torch.Size([5, 8])
    """
    if linear is not None and linear not in LINEAR_TARGETS:
        raise ValueError(f"convert: linear must be one of {LINEAR_TARGETS} or None, got {linear!r}")
    if following_norm not in ("keep", "remove"):
        raise ValueError(f"convert: following_norm must be 'keep' or 'remove', got {following_norm!r}")
    if isinstance(model, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        raise TypeError("convert: pass a container module; a bare layer cannot be replaced in place")
    records: list[SwapRecord] = []
    replace = partial(_replacement, linear=linear, conv=conv, eps=eps, recompute=recompute)
    _convert_children(model, "", replace, following_norm, skip or (lambda path, module: False), records, {})
    return records


def _convert_children(parent, prefix, replace, following_norm, skip, records, decided) -> None:
    """Swap ``parent``'s children (and, recursively, theirs). ``decided`` maps id(module) to
    (module, its new module or None, weights kept) for every module met so far (the module is
    held so that its id stays its own): a module met again gets the same new module, and a
    container met again is not walked again."""
    previous_swapped_linear = False
    for name, child in list(parent._modules.items()):  # (named_children yields a shared child once)
        if child is None:
            continue
        path = f"{prefix}{name}"
        if id(child) in decided:
            _, new, weights_kept = decided[id(child)]
        else:
            new, weights_kept = None, True
            if not skip(path, child):
                new = replace(child)
                if new is None and (
                    following_norm == "remove"
                    and previous_swapped_linear
                    and isinstance(parent, nn.Sequential)
                    and type(child) in FOLLOWING_NORMS
                ):
                    new, weights_kept = nn.Identity(), False
                elif new is None and not isinstance(child, nn.MultiheadAttention):
                    _convert_children(child, f"{path}.", replace, following_norm, skip, records, decided)
            decided[id(child)] = (child, new, weights_kept)
        if new is not None:
            setattr(parent, name, new)
            records.append(SwapRecord(path, type(child).__name__, type(new).__name__, weights_kept))
        previous_swapped_linear = new is not None and type(child) is nn.Linear


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

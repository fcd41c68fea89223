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

``following_norm="remove"`` also replaces by nn.Identity a normalisation that directly follows a
swapped layer *in the same nn.Sequential* (only there is "follows" defined by the module tree),
by the pairs the harness compares (``REMOVED_AFTER``): a LayerNorm, RMSNorm or BatchNorm1d after
an nn.Linear, a BatchNorm1d after an nn.Conv1d, a BatchNorm2d after an nn.Conv2d (Conv2d →
BatchNorm2d becomes PatchNormConv2d alone, as the harness's ``conv+batchnorm`` and ``patchnorm``
CNNs). Its parameters and statistics are dropped (``weights_kept=False`` in its record). The
corrected layer takes over the normalisation; the norm's learned affine (γ, β) cannot be folded
exactly into AffineLike (β would be scaled by the row scale), so it is not. Any other
normalisation module (GroupNorm, InstanceNorm, a subclass, a norm of another dimension) directly
after a swapped layer, and every normalisation module beside a swapped layer in a container that
is not an nn.Sequential (a ResNet block's ``bn1``), is kept, and one UserWarning names each such
path; ``skip`` it to keep it without the warning, or replace it yourself. ``following_norm="keep"``
(the default) leaves every norm in place, without a warning.

A module registered at several paths (``Sequential(lin, Tanh(), lin)``, ``self.a = self.b =
block``) is judged once, at its first path in tree order, and every use gets the same outcome:
one new module shared by all of them, as the old one was (so the sharing, and the
parameters' sharing, survive the swap).

Returns the list of ``SwapRecord`` (path, old type, new type, weights kept), in tree order: one
per attribute set, so a module swapped at two paths has two records.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import nn

from affdiv.layers.modules import AffineLike, NormLike, PatchNormConv1d, PatchNormConv2d

LINEAR_TARGETS = ("affine_like", "norm_l2", "norm_rms")
# following_norm="remove": the norm types (exact) removed directly after each swapped layer type
REMOVED_AFTER = {
    nn.Linear: (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm1d),
    nn.Conv1d: (nn.BatchNorm1d,),
    nn.Conv2d: (nn.BatchNorm2d,),
}
# what counts as a normalisation module for the warning about the ones kept (subclasses included)
NORM_TYPES = (
    nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d, nn.SyncBatchNorm,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d,
)


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
        following_norm: ``"keep"`` or ``"remove"`` (replace by nn.Identity, in an nn.Sequential,
            a LayerNorm, RMSNorm or BatchNorm1d directly after a swapped nn.Linear, a BatchNorm1d
            after a swapped nn.Conv1d, a BatchNorm2d after a swapped nn.Conv2d; warn about the
            other normalisation modules it keeps beside a swapped layer). Default: ``"keep"``.
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
    kept: list[str] = []
    replace = partial(_replacement, linear=linear, conv=conv, eps=eps, recompute=recompute)
    _convert_children(model, "", replace, following_norm, skip or (lambda path, module: False), records, {}, kept)
    if kept:
        warnings.warn(
            "convert: following_norm='remove' kept " + "; ".join(kept) + ". Replace them yourself "
            "(e.g. setattr(parent, name, nn.Identity())) or skip= them to keep them without this warning",
            UserWarning, stacklevel=2,
        )
    return records


def _convert_children(parent, prefix, replace, following_norm, skip, records, decided, kept) -> None:
    """Swap ``parent``'s children (and, recursively, theirs). ``decided`` maps id(module) to
    (module, its new module or None, weights kept) for every module met so far (the module is
    held so that its id stays its own): a module met again gets the same new module, and a
    container met again is not walked again. ``kept`` collects, under ``following_norm="remove"``,
    the normalisation modules kept beside a swapped layer (path and why) for the warning."""
    sequential = isinstance(parent, nn.Sequential)
    previous = None  # the type of the layer swapped at the previous position, else None
    swapped_here, norms_here = False, []
    for name, child in list(parent._modules.items()):  # (named_children yields a shared child once)
        if child is None:
            previous = None
            continue
        path = f"{prefix}{name}"
        if id(child) in decided:
            _, new, weights_kept = decided[id(child)]
        else:
            new, weights_kept = None, True
            if not skip(path, child):
                new = replace(child)
                if new is None and following_norm == "remove" and sequential and previous is not None \
                        and type(child) in REMOVED_AFTER[previous]:
                    new, weights_kept = nn.Identity(), False
                elif new is None and following_norm == "remove" and isinstance(child, NORM_TYPES):
                    norms_here.append((path, child, previous if sequential else None))
                elif new is None and not isinstance(child, nn.MultiheadAttention):
                    _convert_children(child, f"{path}.", replace, following_norm, skip, records, decided, kept)
            decided[id(child)] = (child, new, weights_kept)
        if new is not None:
            setattr(parent, name, new)
            records.append(SwapRecord(path, type(child).__name__, type(new).__name__, weights_kept))
        previous = type(child) if new is not None and type(child) in REMOVED_AFTER else None
        swapped_here = swapped_here or previous is not None
    for path, norm, after in norms_here:
        if after is not None:
            allowed = " or ".join(t.__name__ for t in REMOVED_AFTER[after])
            kept.append(f"{path!r} ({type(norm).__name__} after a swapped {after.__name__}: only a {allowed} "
                        "is removed there)")
        elif swapped_here and not sequential:
            kept.append(f"{path!r} ({type(norm).__name__} beside a swapped layer in a {type(parent).__name__}, "
                        "not an nn.Sequential: which module it follows is not defined by the module tree)")


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

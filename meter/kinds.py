"""Which modules are linear in their parameters (their update is a forward with the step as
parameters) and which have closed-form per-sample diagonals (the dense affine family, BatchNorm's
affine parameters).
"""

from __future__ import annotations

from torch import nn


def _linear_forwards() -> dict:
    """forward function -> a predicate on the module: f(x; θ) is homogeneous linear in θ, so
    J_θ Δθ = f(x; Δθ) exactly. Keyed by the forward function itself, so that a subclass that
    overrides forward takes the generic jvp."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    from affdiv.layers.modules import AffineLike, NormLike, _PatchNormConvNd

    always = lambda m: True  # noqa: E731
    table = {
        nn.Linear.forward: always,
        nn.Bilinear.forward: always,
        nn.Conv1d.forward: always,
        nn.Conv2d.forward: always,
        nn.Conv3d.forward: always,
        nn.ConvTranspose1d.forward: always,
        nn.ConvTranspose2d.forward: always,
        nn.ConvTranspose3d.forward: always,
        _BatchNorm.forward: always,
        _InstanceNorm.forward: always,
        nn.LayerNorm.forward: always,
        nn.GroupNorm.forward: always,
        nn.Embedding.forward: lambda m: m.max_norm is None,  # max_norm renormalises W in place
        AffineLike.forward: always,
        NormLike.forward: always,
        _PatchNormConvNd.forward: always,
    }
    if hasattr(nn, "RMSNorm"):
        table[nn.RMSNorm.forward] = always
    del _ConvNd
    return table

_LINEAR_TABLE: dict | None = None


def linear_in_parameters(module: nn.Module) -> bool:
    """True when ``module``'s forward is a known map linear (homogeneous) in its parameters."""
    global _LINEAR_TABLE
    if _LINEAR_TABLE is None:
        _LINEAR_TABLE = _linear_forwards()
    predicate = _LINEAR_TABLE.get(getattr(type(module), "forward", None))
    return bool(predicate and predicate(module))


def dense_member(module: nn.Module) -> str | None:
    """The affine-family member a dense module is ("affine", "affine_like", "norm_like"), or None."""
    from affdiv.layers.modules import AffineLike, NormLike

    forward = getattr(type(module), "forward", None)
    if forward is nn.Linear.forward:
        return "affine"
    if forward is AffineLike.forward:
        return "affine_like"
    if forward is NormLike.forward:
        return "norm_like"
    return None


def is_batchnorm(module: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm) and type(module).forward is _BatchNorm.forward


def uses_batch_statistics(module: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm) and (module.training or module.running_mean is None)


def active_dropout(model: nn.Module) -> list[str]:
    from torch.nn.modules.dropout import _DropoutNd

    return [name for name, m in model.named_modules() if m.training and (
        (isinstance(m, _DropoutNd) and m.p > 0) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0))]

"""Functional forms of the corrected layers (the modules in ``affdiv.layers`` call these).

    affine_like(x, W, b)           z = (W x + b)/√(‖x‖² + 1)          over the last dim of x
    norm_like(x, W, b, mode, eps)  z = W·k x/max(‖x‖, eps) + b          k = 1 (mode l2) or √m (rms)
    patchnorm_conv1d/2d(x, W, b, stride, padding, dilation, groups)
                                   z_{o,p} = conv(x, W, b)_{o,p}/√(‖P_{g,p}‖² + 1)

(P_{g,p}: the receptive field of output position p over the input channels of o's group g.)
Without a bias, affine_like is (W x)/√(‖x‖² + 1): the "+1" (the bias input of the augmented
vector [x; 1]) stays, only b is absent. An all-zero row gives affine_like: b (or 0), norm_like: b.

Numerics: finite output for every finite input, including |x| up to the dtype's maximum, for
weights with ‖W_o‖ < √max (see ``_scale``). A NaN or ±Inf input makes exactly the outputs
non-finite that nn.Linear / nn.Conv would (its whole row; the positions whose receptive field
holds it) and leaves every other output at its clean value. Under autocast the inputs are cast
like F.linear / F.conv (to the autocast dtype) and the norms are accumulated in float32.
Gradients are exact to rounding while the squared scale r² is a normal number (fp32: ‖x‖ <
1.8e19); beyond, they stay finite but lose the radial term to underflow. The convolutions
rescale per sample and group: in a group whose channels' norm in a sample overflows (fp32: >
1.8e19), patches smaller than the group's largest by more than ~2^96 lose relative precision;
the other groups keep theirs.

Bad input (shape, dtype, device) raises ValueError/TypeError naming the expected and the
actual value. On CUDA, with the optional Triton kernel available (``_triton_affine_like``),
affine_like runs fused there. On the CPU in eager mode the dense layers, and the 2-D PatchNorm
convolutions that need no rescaling and keep their output, are C++ autograd nodes (``_native``,
where built); everywhere else they are the Functions in ``_autograd``. Both take the fused CPU
passes of ``_fused`` where those apply, and give the same numbers to the bit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from string import Template

import torch
import torch.nn.functional as F
from torch import Tensor

from affdiv.checks import check_int, is_int
from affdiv.layers import _autograd, _native
from affdiv.layers._scale import plain_eager

NORM_MODES = ("l2", "rms")
DEFAULT_EPS = 1e-12


# --------------------------------------------------------------------------------------------
# dense layers


def affine_like(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""The affine-like correction over the last dimension: :math:`z = (x W^\top + b)/\sqrt{\|x\|^2 + 1}`.

    See :class:`affdiv.layers.AffineLike`.

    Args:
        x: the input.
        weight: W.
        bias: b. Default: ``None`` (then z = x Wᵀ/√(‖x‖² + 1)).

    Shape:
        - x: :math:`(*, m)`; weight: :math:`(n, m)`; bias: :math:`(n,)`.
        - Output: :math:`(*, n)`.

    Example::

        >>> import torch
        >>> from affdiv.layers.functional import affine_like
        >>> x = torch.tensor([[3.0, 4.0]])  # ‖x‖² + 1 = 26
        >>> affine_like(x, torch.eye(2), torch.tensor([1.0, 0.0]))  # (4, 4)/√26
        tensor([[0.7845, 0.7845]])
    """
    x, weight, bias = _prepare_dense("affine_like", x, weight, bias)
    rows = _rows(x)
    kernel = _gpu_kernel(rows)
    if kernel is not None:
        z, _ = _TritonAffineLike.apply(rows, weight, bias, kernel)
    elif (z := _native.affine_like(rows, weight, bias)) is None:
        z, _ = _autograd.apply_affine_like(rows, weight, bias)
    return _unrows(z, x)


def norm_like(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, mode: str = "l2", eps: float = DEFAULT_EPS
) -> Tensor:
    r"""The norm-like correction over the last dimension: :math:`z = W\,k\,x/\max(\|x\|, \epsilon) + b`.

    See :class:`affdiv.layers.NormLike`.

    Args:
        x: the input.
        weight: W.
        bias: b. Default: ``None``.
        mode: ``"l2"`` (k = 1) or ``"rms"`` (k = √m). Default: ``"l2"``.
        eps: the smallest norm divided by, a finite number > 0. Default: ``1e-12``.

    Shape:
        - x: :math:`(*, m)`; weight: :math:`(n, m)`; bias: :math:`(n,)`.
        - Output: :math:`(*, n)`.

    Example::

        >>> import torch
        >>> from affdiv.layers.functional import norm_like
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])  # a row of norm 5, an all-zero row
        >>> norm_like(x, torch.eye(2), torch.tensor([1.0, 0.0]))
        tensor([[1.6000, 0.8000],
                [1.0000, 0.0000]])
    """
    if mode not in NORM_MODES:
        raise ValueError(f"norm_like: mode must be one of {NORM_MODES}, got {mode!r}")
    eps = _check_eps("norm_like", eps)
    x, weight, bias = _prepare_dense("norm_like", x, weight, bias)
    k = 1.0 if mode == "l2" else math.sqrt(x.shape[-1])
    rows = _rows(x)
    if (z := _native.norm_like(rows, weight, bias, k, eps)) is None:
        z, _ = _autograd.apply_norm_like(rows, weight, bias, k, eps)
    return _unrows(z, x)


def _rows(x: Tensor) -> Tensor:
    """x (*, in) as a 2-D (rows, in) tensor (x itself when already 2-D: a reshape would add a
    view node to the autograd graph, which costs each call of a small layer a few µs)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _unrows(z: Tensor, x: Tensor) -> Tensor:
    """z (rows, out) in x's leading shape: (*, out)."""
    return z if x.dim() == 2 else z.reshape(*x.shape[:-1], z.shape[-1])


def _check_eps(name: str, eps) -> float:
    """eps as a float; a bool, a non-real, a non-finite or a non-positive eps is a ValueError."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name}: eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def _prepare_dense(name, x, weight, bias):
    _check_tensor(name, "weight", weight, dims=(2,))
    _check_tensor(name, "input", x, min_dim=1)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: expected input with last dimension in_features={weight.shape[1]}, "
            f"got input of shape {tuple(x.shape)}"
        )
    if bias is not None:
        _check_tensor(name, "bias", bias, dims=(1,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"{name}: expected bias of shape ({weight.shape[0]},) (out_features), got {tuple(bias.shape)}"
            )
    return _autocast_and_match(name, x, weight, bias)


# --------------------------------------------------------------------------------------------
# convolutions


# What the docstrings of patchnorm_conv1d and patchnorm_conv2d share ($dims: the spatial dimensions, $ints:
# as many ints in words): the formula and the Args; each function adds its Shape and Example.
_PATCHNORM_CONV_DOC = Template(r"""``conv${dims}d`` with each output position divided by √(‖patch‖² + 1), per group:
    :math:`z_{o,p} = (W_o \cdot P_p + b_o)/\sqrt{\|P_p\|^2 + 1}`.

    See :class:`affdiv.layers.PatchNormConv${dims}d`.

    Args:
        x: the input.
        weight: the filters.
        bias: Default: ``None``.
        stride: an int or $ints. Default: 1.
        padding: an int, $ints, ``"same"`` or ``"valid"`` (zero padding). Default: 0.
        dilation: an int or $ints. Default: 1.
        groups: Default: 1.
        recompute: save one float per group and position instead of keeping the output, and
            run the forward again in backward. Default: ``False``.
""")


def patchnorm_conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, recompute=False) -> Tensor:
    return _patchnorm_conv("patchnorm_conv1d", 1, x, weight, bias, stride, padding, dilation, groups, recompute)


patchnorm_conv1d.__doc__ = _PATCHNORM_CONV_DOC.substitute(dims=1, ints="one int") + r"""
    Shape:
        - x: :math:`(N, C_{in}, L_{in})` or :math:`(C_{in}, L_{in})`;
          weight: :math:`(C_{out}, C_{in}/groups, k)`; bias: :math:`(C_{out},)`.
        - Output: :math:`(N, C_{out}, L_{out})` or :math:`(C_{out}, L_{out})`, as ``conv1d``'s.

    Example::

        >>> import torch
        >>> from affdiv.layers.functional import patchnorm_conv1d
        >>> x = torch.tensor([[[0.0, 2.0, 0.0]]])  # one patch of width 1 per position
        >>> patchnorm_conv1d(x, torch.ones(1, 1, 1))  # 2/√(2² + 1) at the middle
        tensor([[[0.0000, 0.8944, 0.0000]]])
    """


def patchnorm_conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, recompute=False) -> Tensor:
    return _patchnorm_conv("patchnorm_conv2d", 2, x, weight, bias, stride, padding, dilation, groups, recompute)


patchnorm_conv2d.__doc__ = _PATCHNORM_CONV_DOC.substitute(dims=2, ints="two ints") + r"""
    Shape:
        - x: :math:`(N, C_{in}, H, W)` or :math:`(C_{in}, H, W)`;
          weight: :math:`(C_{out}, C_{in}/groups, k_H, k_W)`; bias: :math:`(C_{out},)`.
        - Output: :math:`(N, C_{out}, H_{out}, W_{out})` or without N, as ``conv2d``'s.

    Example::

        >>> import torch
        >>> from affdiv.layers.functional import patchnorm_conv2d
        >>> x = torch.ones(1, 1, 1, 3)  # one 1×3 patch: ‖P‖² = 3
        >>> patchnorm_conv2d(x, torch.ones(1, 1, 1, 3), torch.tensor([1.0]))  # (3 + 1)/√(3 + 1)
        tensor([[[[2.]]]])
    """


def _patchnorm_conv(name, d, x, weight, bias, stride, padding, dilation, groups, recompute):
    _check_tensor(name, "weight", weight, dims=(d + 2,))
    _check_tensor(name, "input", x, dims=(d + 1, d + 2))
    stride, dilation = _int_tuple(name, "stride", stride, d, 1), _int_tuple(name, "dilation", dilation, d, 1)
    check_int(f"{name}: groups", groups)
    if not isinstance(recompute, bool):
        raise TypeError(f"{name}: recompute must be a bool, got {recompute!r}")
    unbatched = x.dim() == d + 1
    if unbatched:
        x = x.unsqueeze(0)
    channels = x.shape[1]
    if weight.shape[0] % groups or channels != weight.shape[1] * groups:
        raise ValueError(
            f"{name}: expected input with {weight.shape[1] * groups} channels (weight.shape[1]={weight.shape[1]} "
            f"x groups={groups}) and out_channels divisible by groups, got input of shape {tuple(x.shape)} "
            f"and weight of shape {tuple(weight.shape)}"
        )
    if bias is not None:
        _check_tensor(name, "bias", bias, dims=(1,))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"{name}: expected bias of shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    x, weight, bias = _autocast_and_match(name, x, weight, bias)
    x, padding = _resolve_padding(name, x, padding, weight.shape[2:], stride, dilation)
    reach = [dl * (k - 1) + 1 for dl, k in zip(dilation, weight.shape[2:])]
    if any(n + 2 * p < e for n, p, e in zip(x.shape[2:], padding, reach)):
        raise ValueError(
            f"{name}: the (dilated) kernel extent {tuple(reach)} exceeds the padded input size "
            f"{tuple(n + 2 * p for n, p in zip(x.shape[2:], padding))}"
        )
    z = None if recompute else _native.patchnorm_conv(x, weight, bias, stride, padding, dilation, groups)
    if z is None:
        z, _ = _autograd.apply_patchnorm_conv(x, weight, bias, stride, padding, dilation, groups, recompute)
    return z.squeeze(0) if unbatched else z


def _resolve_padding(name, x, padding, kernel, stride, dilation):
    """(x, symmetric per-side padding): "valid" = 0; "same" pads the odd extra on the right of x."""
    d = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return x, (0,) * d
        if padding != "same":
            raise ValueError(f"{name}: padding must be 'same', 'valid' or ints, got {padding!r}")
        if any(s != 1 for s in stride):
            raise ValueError(f"{name}: padding='same' needs stride 1, got stride={tuple(stride)}")
        total = [dl * (k - 1) for dl, k in zip(dilation, kernel)]
        left = tuple(t // 2 for t in total)
        extra = [t - 2 * lt for t, lt in zip(total, left)]
        if any(extra):
            x = F.pad(x, [p for e in reversed(extra) for p in (0, e)])
        return x, left
    padding = _int_tuple(name, "padding", padding, d, 0)
    return x, padding


def _int_tuple(name, what, value, d, minimum) -> tuple[int, ...]:
    """``value`` (an int, or d ints) as d ints, each ≥ ``minimum``; anything else is a ValueError
    (bools included: True is an int to Python, never a meant stride)."""
    if isinstance(value, int):
        values = (value,) * d
    else:
        values = tuple(value) if isinstance(value, Sequence) else ()
    if len(values) != d or not all(is_int(v, minimum) for v in values):
        raise ValueError(f"{name}: {what} must be an int >= {minimum} or {d} of them, got {value!r}")
    return values


# --------------------------------------------------------------------------------------------
# shared checks, autocast


def _check_tensor(name, what, t, dims: Sequence[int] | None = None, min_dim: int | None = None):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected {what} to be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected {what} of a floating-point dtype, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{n}-D" for n in dims)
        raise ValueError(f"{name}: expected {what} to be {want}, got shape {tuple(t.shape)}")
    if min_dim is not None and t.dim() < min_dim:
        raise ValueError(f"{name}: expected {what} with at least {min_dim} dimension, got a 0-D tensor")


def _autocast_and_match(name, x, weight, bias):
    """Cast like an autocast-listed op (F.linear, F.conv*), then insist on one dtype and device."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    for what, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name}: expected {what} on the input's device {x.device}, got {t.device}")
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected {what} of the input's dtype {x.dtype}, got {t.dtype}")
    return x, weight, bias


# --------------------------------------------------------------------------------------------
# optional GPU kernel


def _gpu_kernel(rows: Tensor):
    """The Triton module when ``rows`` is a plain CUDA tensor of a dtype it supports and the
    kernel is available, else None (a raw kernel cannot run under torch.func / compile)."""
    if not rows.is_cuda or not plain_eager(rows):
        return None
    try:
        from affdiv.layers import _triton_affine_like as kernel
    except ImportError:
        return None
    return kernel if kernel.available() and rows.dtype in kernel.SUPPORTED_DTYPES else None


class _TritonAffineLike(torch.autograd.Function):
    """affine_like through the fused kernel: its r is (rows,) float32, its backward first order
    only; double backward (or a gradient on r) takes the differentiable torch formula, and
    forward mode the torch formula's tangents."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernel):
        z, r = kernel.forward(x, weight, bias)
        ctx.save_for_backward(x, weight, bias, r)
        ctx.save_for_forward(x, weight, bias, r)
        ctx.kernel = kernel
        ctx.set_materialize_grads(False)
        return z, r

    @staticmethod
    def jvp(ctx, x_t, weight_t, bias_t, _kernel):
        x, weight, bias, r = ctx.saved_tensors
        z_t, r_t = _autograd.affine_like_tangents(x, weight, bias, r.unsqueeze(-1), x_t, weight_t, bias_t)
        return z_t, r_t.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_z, grad_r):
        x, weight, bias, r = ctx.saved_tensors
        if grad_z is not None and grad_r is None and not torch.is_grad_enabled():
            dx, dw, db = ctx.kernel.backward(grad_z.contiguous(), x, weight, bias, r)
        else:
            column = None if grad_r is None else grad_r.unsqueeze(-1)
            dx, dw, db = _autograd.affine_like_grads(
                x, weight, bias, r.unsqueeze(-1), grad_z, column, ctx.needs_input_grad[:3]
            )
        return dx, dw, db, None

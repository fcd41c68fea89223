"""The stacked CNN's first block as one pass: K models' convolutions (``nn.Conv2d`` or
``PatchNormConv2d``) of a one-channel image, each followed by a 2×2 max-pool (and by the ReLU
that the engine runs after the pool, where the model has one), without the full-resolution
convolution output.

For model k with weights W_k (C, 1, kh, kw), bias b_k and input x_k (B, H, W),

    y_k = maxpool₂ₓ₂(r ⊙ (W_k ⋆ x_k + b_k)),                (B, C, ⌊H'/2⌋, ⌊W'/2⌋)
    ∂L/∂W_k[c, i, j] = Σ_{n,p} g_{n,c,p} r_{n,a} · x̃_k[n, a + (i, j)],   ∂L/∂b_k[c] = Σ_{n,p} g_{n,c,p} r_{n,a},

with H' × W' the convolution's output, x̃ the zero-padded input, a = a_{n,c,p} the convolution
output each pooled value came from (the window's first maximum, or its last NaN, as
``max_pool2d``), and r = 1 for a convolution, PatchNorm's r_{n,a} = 1/√(‖x̃_k[n, a + ·]‖² + 1)
(the patch's squared norm; one input channel, so one group) for a PatchNormConv2d. With the
ReLU, y_k is relu of the above and g is 0 where it passes no gradient (its output neither above
0 nor NaN), as in :mod:`~affdiv.experiments.runs.pool_relu`.

The batched engine (:mod:`~affdiv.experiments.runs.batched`) would otherwise run this block as a
grouped convolution writing K·C full-resolution planes, a max-pool over them, and in
backward a zero-filled gradient of that size, the pool's scatter into it and the convolution's
weight gradient reading it back: on the fashion CNN (28×28 inputs, 32 channels) those passes over
memory cost more than the block's arithmetic. Here each pooled value is computed from its (kh+1) ×
(kw+1) input patch in vector registers (the four convolution outputs, their maximum and its
position) and the weight gradient reads only the pooled gradient and each maximum's position (a
byte). Only the input's own gradient is not computed: the block is the model's first, on data.
The C pass lives in the layers' compiled library (``affdiv.layers._fused``, ``conv_pool``).

The numbers are the unfused block's up to the order of summation (each convolution output is
b + Σ_taps w·x in tap order, times r; a weight gradient is summed per sample, then over samples), so a
maximum decided by a rounding-level difference between two of a window's outputs may sit at
another position than the unfused block's: the same value, its gradient at a neighbouring patch.
A NaN in the input spreads to the gradients as through torch's convolution backward (which
multiplies it by the zero gradient of a window's other outputs), except where only a
convolution output that the pool drops (an odd size) reads it: the pass never computes those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from affdiv.experiments.runs import pool_relu
from affdiv.layers import _fused


def fusable(conv: nn.Module, pool: nn.Module) -> bool:
    """Whether ``conv`` then ``pool`` is a block this pass computes: an ``nn.Conv2d`` or
    ``PatchNormConv2d`` of one input channel (stride 1, no dilation, zero padding given as
    numbers, kh·kw at most ``_fused.CONV_POOL_MAX_TAPS`` = 49), then ``nn.MaxPool2d(2)`` (stride 2,
    no padding, no dilation, floor mode, no indices)."""
    from affdiv.layers import PatchNormConv2d

    if type(conv) not in (nn.Conv2d, PatchNormConv2d):
        return False
    settings = (conv.in_channels, conv.groups, conv.stride, conv.dilation, conv.padding_mode)
    return settings == (1, 1, (1, 1), (1, 1), "zeros") and not isinstance(conv.padding, str) \
        and conv.kernel_size[0] * conv.kernel_size[1] <= _fused.CONV_POOL_MAX_TAPS and pool_relu.is_pool_2x2(pool)


def usable(x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int]) -> bool:
    """Whether :func:`conv_max_pool` may take this call: the mode allows the compiled passes
    (``_fused.eager_kernels_allowed``; a graph may be recorded: the pass is its own autograd
    Function); x (K, B, 1, H, W), weight (K, C, 1, kh, kw) with kh·kw at most
    ``_fused.CONV_POOL_MAX_TAPS``, bias (K, C) or None, plain CPU tensors of one float32/float64
    dtype; the input not requiring a gradient; at least one pooled row and column."""
    if not _fused.eager_kernels_allowed():
        return False
    if x.dim() != 5 or x.shape[2] != 1 or weight.dim() != 5 or weight.shape[0] != x.shape[0] or weight.shape[2] != 1:
        return False
    (kh, kw), (ph, pw) = weight.shape[3:], padding
    if kh * kw > _fused.CONV_POOL_MAX_TAPS or min(x.shape[3] + 2 * ph - kh, x.shape[4] + 2 * pw - kw) < 1:
        return False  # (a convolution output of one row or column has no pooled row or column)
    if bias is not None and bias.shape != weight.shape[:2]:
        return False
    return (x.dtype in (torch.float32, torch.float64) and not x.requires_grad
            and all(t is None or (_fused.plain(t) and t.is_cpu and t.dtype == x.dtype) for t in (x, weight, bias)))


def conv_max_pool(x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                  patchnorm: bool = False, relu: bool = False) -> Tensor:
    """maxpool₂ₓ₂(r ⊙ (W_k ⋆ x_k + b_k)) for K models at once (r: module docstring, 1 unless
    ``patchnorm``), then the ReLU after it with ``relu`` (as :mod:`~affdiv.experiments.runs.pool_relu`'s):
    x (K, B, 1, H, W), weight (K, C, 1, kh, kw), bias (K, C) or None -> (B, K·C, H_p, W_p) in
    channels_last order (the batched CNN's layout). Call only where :func:`usable`."""
    return ConvMaxPool.apply(x, weight, bias, padding, patchnorm, relu)


class ConvMaxPool(torch.autograd.Function):
    """:func:`conv_max_pool` (module docstring); backward gives the weight's and the bias's
    gradients (once differentiable)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                patchnorm: bool, relu: bool) -> Tensor:
        models, channels, _one, kh, kw = weight.shape
        ph, pw = padding
        xp = F.pad(x[:, :, 0], (pw, pw, ph, ph)).contiguous()  # (K, B, Hq, Wq), zeros around
        width = _fused.conv_pool_width(channels, x.dtype)  # (whole vectors: spare channels zero)
        wt = weight.new_zeros(models, kh * kw, width)
        wt[:, :, :channels] = weight.reshape(models, channels, kh * kw).transpose(1, 2)
        flat_bias = None
        if bias is not None:
            flat_bias = bias.new_zeros(models, width)
            flat_bias[:, :channels] = bias
            flat_bias = flat_bias.view(-1)
        keep = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        out, argmax = _fused.conv_pool(xp, wt, flat_bias, channels, (kh, kw), patchnorm, keep_argmax=keep, relu=relu)
        if keep:
            ctx.save_for_backward(xp, argmax)
        ctx.weight_shape, ctx.patchnorm = weight.shape, patchnorm
        ctx.with_bias = bias is not None and ctx.needs_input_grad[2]
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xp, argmax = ctx.saved_tensors
        models, channels, _one, kh, kw = ctx.weight_shape
        grad = grad.contiguous(memory_format=torch.channels_last)
        dwt, db = _fused.conv_pool_backward(xp, grad, argmax, (kh, kw), ctx.patchnorm, ctx.with_bias)
        dw = dwt[:, :, :channels].transpose(1, 2).reshape(ctx.weight_shape) if ctx.needs_input_grad[1] else None
        return None, dw, None if db is None else db.view(models, -1)[:, :channels], None, None, None

"""The stacked CNN's 2×2 max-pools, each with the ReLU after it, as one pass.

On the batched engine's (B, K·C, H, W) channels-last activations,

    y = relu(maxpool₂ₓ₂(x)),    ∂L/∂x_{n,c,2i+a,2j+b} = g_{n,c,i,j} where (a, b) is the window's
                                maximum and y_{n,c,i,j} > 0 (or NaN), else 0,

(the engine runs a nondecreasing activation after the pool that follows it, so a ReLU follows
the pool here; without one, y is the pool alone). In torch ops this is a max-pool writing its
output and int64 indices, a ReLU writing another copy, and in backward the ReLU's masked copy of
the gradient, a zero-filled gradient of the pool's input and a scatter into it: on the fashion
CNN's 14×14 maps (K·32 channels) those passes cost several times a copy of the input. Here the
forward reads x once and writes y and each maximum's window position as a byte (or
``_fused.POOL_NO_GRADIENT`` where the ReLU passes no gradient), and the backward writes every
element of the input's gradient once. The passes only compare and move values, so the numbers are
torch's exactly: the first maximum in row order or the last NaN, as ``max_pool2d``; ReLU's −0 and
NaN kept, and its gradient passed where its output is above 0 or NaN, as torch's. The C passes
live in the layers' compiled library (``affdiv.layers._fused``, ``max_pool2``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from affdiv.layers import _fused


def is_pool_2x2(pool: nn.Module) -> bool:
    """Whether ``pool`` is ``nn.MaxPool2d(2)``: a 2×2 window, stride 2, no padding, no dilation,
    floor mode, no indices returned."""
    if type(pool) is not nn.MaxPool2d:
        return False
    stride = pool.kernel_size if pool.stride is None else pool.stride
    window = tuple(v if isinstance(v, tuple) else (v, v)
                   for v in (pool.kernel_size, stride, pool.padding, pool.dilation))
    return window == ((2, 2), (2, 2), (0, 0), (1, 1)) and not pool.ceil_mode and not pool.return_indices


def takes(pool: nn.Module) -> bool:
    """Whether the batched engine runs ``pool``, a max-pool after a CNN's first block, with the
    ReLU after it as this pass: a 2×2 max-pool (:func:`is_pool_2x2`). (A first block that
    ``conv_pool`` fuses holds its own pool; that pass asks :func:`is_pool_2x2` itself.)"""
    return is_pool_2x2(pool)


def usable(x: Tensor) -> bool:
    """Whether :func:`max_pool_relu` may take this call: the mode allows the compiled passes
    (``_fused.eager_kernels_allowed``; a graph may be recorded: the pass is its own autograd
    Function), x a plain 4-D CPU float32/float64 tensor in channels-last order, at least 2×2."""
    return (_fused.eager_kernels_allowed() and x.dim() == 4 and x.dtype in (torch.float32, torch.float64)
            and _fused.plain(x) and x.is_cpu and x.is_contiguous(memory_format=torch.channels_last)
            and min(x.shape[2:]) >= 2)


def max_pool_relu(x: Tensor, relu: bool) -> Tensor:
    """relu(maxpool₂ₓ₂(x)) (the pool alone without ``relu``), channels-last like x. Call only
    where :func:`usable`."""
    return MaxPoolReLU.apply(x, relu)


class MaxPoolReLU(torch.autograd.Function):
    """:func:`max_pool_relu` (module docstring); once differentiable."""

    @staticmethod
    def forward(ctx, x: Tensor, relu: bool) -> Tensor:
        keep = ctx.needs_input_grad[0]
        out, which = _fused.max_pool2(x, relu, keep_which=keep)
        if keep:
            ctx.save_for_backward(which)
            ctx.input_shape = x.shape
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (which,) = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        return _fused.max_pool2_backward(grad, which, ctx.input_shape), None

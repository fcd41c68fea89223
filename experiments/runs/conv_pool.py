"""The stacked CNN's first block as one pass: K models' convolutions (``nn.Conv2d`` or
``PatchNormConv2d``) of a one-channel image, each followed by a 2×2 max-pool (and by the ReLU
that the engine runs after the pool, where the model has one; an ``nn.Conv2d`` may have a
BatchNorm2d before the pool), without the full-resolution convolution output.

For model k with weights W_k (C, 1, kh, kw), bias b_k and input x_k (B, H, W),

    y_k = maxpool₂ₓ₂(r ⊙ (W_k ⋆ x_k + b_k)),                (B, C, ⌊H'/2⌋, ⌊W'/2⌋)
    ∂L/∂W_k[c, i, j] = Σ_{n,p} g_{n,c,p} r_{n,a} · x̃_k[n, a + (i, j)],   ∂L/∂b_k[c] = Σ_{n,p} g_{n,c,p} r_{n,a},

with H' × W' the convolution's output, x̃ the zero-padded input, a = a_{n,c,p} the convolution
output each pooled value came from (the window's first maximum, or its last NaN, as
``max_pool2d``), and r = 1 for a convolution, PatchNorm's r_{n,a} = 1/√(‖x̃_k[n, a + ·]‖² + 1)
(the patch's squared norm; one input channel, so one group) for a PatchNormConv2d. With the
ReLU, y_k is relu of the above and g is 0 where it passes no gradient (its output neither above
0 nor NaN), as in :mod:`~affdiv.experiments.runs.pool_relu`.

A BatchNorm2d between the convolution and the pool (the conv+batchnorm CNN) is folded into the
pass. On the batch, each channel's z = w·patch + b has mean and second moment

    μ = (w·p)/N + b + s·Σw,    σ² = wᵀGw/N − ((w·p)/N)²,

with p = Σ_{n,a} (x̃[n, a + ·] − s) and G = Σ_{n,a} (x̃[n, a + ·] − s)(x̃[n, a + ·] − s)ᵀ over the
N = B·H'·W' convolution outputs, s the padded input's mean (:func:`patch_moments`, float64; the
running statistics get μ and the unbiased N/(N − 1)·σ²), so BN(z) = γ(z − μ)/√(σ² + ε) + β =
a·(w·patch + b − μ) + β with a = γ/√(σ² + ε) is the pass with weights a·w and bias a·(b − μ) + β.
Backward, the block's gradient
dy is g at the pooled maxima and 0 elsewhere, so with T = Σ dy·patch and S₁ = Σ dy (the pass's
own weight and bias gradients) and x̂ = (z − μ)/√(σ² + ε),

    ∂L/∂β = S₁,   ∂L/∂γ = S₂ = Σ dy·x̂ = (w·T + (b − μ)·S₁)/√(σ² + ε),
    ∂L/∂w = a·(T − s·S₁ − (S₁/N)·p − (S₂/N)·Σ x̂·(patch − s)),
    Σ x̂·(patch − s) = (G w − ((w·p)/N)·p)/√(σ² + ε),   ∂L/∂b = a·(S₁ − S₁ − (S₂/N)·Σ x̂) = 0,

(BatchNorm's backward, dz = a·(dy − S₁/N − x̂·S₂/N), summed against each tap; Σ dz = 0, so the
shift s changes no sum), all from T, S₁, p and G: the full-resolution convolution output, its
normalisation and their gradients are never written. In evaluation the running statistics take
the batch's place (dz = a·dy). The variance from the centred moments loses to cancellation a
relative γ_n·(1 + m²/σ²), m = (w·p)/N the mean of w·(patch − s), where torch's two passes lose γ_n;
it is computed in float64.

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

from collections.abc import Sequence

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


def first_block_length(layers: Sequence[nn.Module]) -> int:
    """How many of a model's first ``layers`` (the batched engine's order: a max-pool before the
    activation it follows) the pass computes as one block: 2 for a convolution and a max-pool that
    :func:`fusable` takes, 3 for an ``nn.Conv2d`` of at most :data:`BATCH_NORM_MAX_TAPS` taps, an
    ``nn.BatchNorm2d`` that :func:`stackable_batch_norm` takes and such a max-pool, else 0."""
    if len(layers) > 1 and fusable(layers[0], layers[1]):
        return 2
    if len(layers) > 2 and type(layers[0]) is nn.Conv2d and fusable(layers[0], layers[2]) \
            and layers[0].kernel_size[0] * layers[0].kernel_size[1] <= BATCH_NORM_MAX_TAPS \
            and type(layers[1]) is nn.BatchNorm2d and stackable_batch_norm(layers[1]):
        return 3
    return 0


def stackable_batch_norm(module: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether the stacked engines take this BatchNorm: affine, with running statistics updated by a
    momentum (not a cumulative average), as each model's own statistics in place."""
    return module.affine and module.track_running_stats and module.momentum is not None


def usable(x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int], *batch_norm: Tensor) -> bool:
    """Whether :func:`conv_max_pool` (or, given a BatchNorm2d's stacked weight, bias and running
    statistics as ``batch_norm``, :func:`conv_batch_norm_max_pool`) may take this call: the mode
    allows the compiled passes (``_fused.eager_kernels_allowed``; a graph may be recorded: the pass
    is its own autograd Function); x (K, B, 1, H, W), weight (K, C, 1, kh, kw) with kh·kw at most
    ``_fused.CONV_POOL_MAX_TAPS``, bias and each of ``batch_norm`` (K, C) or None, plain CPU
    tensors of one float32/float64 dtype; the input not requiring a gradient; at least one pooled
    row and column."""
    if not _fused.eager_kernels_allowed():
        return False
    if x.dim() != 5 or x.shape[2] != 1 or weight.dim() != 5 or weight.shape[0] != x.shape[0] or weight.shape[2] != 1:
        return False
    (kh, kw), (ph, pw) = weight.shape[3:], padding
    if kh * kw > _fused.CONV_POOL_MAX_TAPS or min(x.shape[3] + 2 * ph - kh, x.shape[4] + 2 * pw - kw) < 1:
        return False  # (a convolution output of one row or column has no pooled row or column)
    if any(t is not None and t.shape != weight.shape[:2] for t in (bias, *batch_norm)):
        return False
    return (x.dtype in (torch.float32, torch.float64) and not x.requires_grad
            and all(t is None or (_fused.plain(t) and t.is_cpu and t.dtype == x.dtype)
                    for t in (x, weight, bias, *batch_norm)))


def conv_max_pool(x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                  patchnorm: bool = False, relu: bool = False) -> Tensor:
    """maxpool₂ₓ₂(r ⊙ (W_k ⋆ x_k + b_k)) for K models at once (r: module docstring, 1 unless
    ``patchnorm``), then the ReLU after it with ``relu`` (as :mod:`~affdiv.experiments.runs.pool_relu`'s):
    x (K, B, 1, H, W), weight (K, C, 1, kh, kw), bias (K, C) or None -> (B, K·C, H_p, W_p) in
    channels_last order (the batched CNN's layout). Call only where :func:`usable`."""
    return ConvMaxPool.apply(x, weight, bias, padding, patchnorm, relu)


def conv_batch_norm_max_pool(x: Tensor, weight: Tensor, bias: Tensor | None, batch_norm: dict[str, Tensor],
                             padding: tuple[int, int], momentum: float, eps: float, training: bool,
                             relu: bool = False) -> Tensor:
    """maxpool₂ₓ₂(BN(W_k ⋆ x_k + b_k)) for K models at once, then the ReLU after it with ``relu``;
    BN is BatchNorm2d with the stacked ``batch_norm`` (its ``weight``, ``bias``, ``running_mean``
    and ``running_var``, (K, C) each): on the batch's statistics, which it folds into the running
    ones in place, when ``training``, else on the running ones (module docstring). Shapes as
    :func:`conv_max_pool`'s. Call only where :func:`usable`."""
    return ConvBatchNormMaxPool.apply(x, weight, bias, batch_norm["weight"], batch_norm["bias"],
                                      batch_norm["running_mean"], batch_norm["running_var"], padding, momentum, eps,
                                      training, relu)


def _pass_input(x: Tensor, padding: tuple[int, int]) -> Tensor:
    """x (K, B, 1, H, W) zero-padded as the pass takes it: (K, B, Hq, Wq), contiguous."""
    ph, pw = padding
    return F.pad(x[:, :, 0], (pw, pw, ph, ph)).contiguous()


def _pass_parameters(weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """(wt, bias) as the pass takes them: wt (K, kh·kw, Cp), each tap's channels side by side, and
    bias (K·Cp,), the channels padded with zeros to whole vectors of the pass."""
    models, channels, _one, kh, kw = weight.shape
    width = _fused.conv_pool_width(channels, dtype)
    wt = weight.new_zeros(models, kh * kw, width, dtype=dtype)
    wt[:, :, :channels] = weight.reshape(models, channels, kh * kw).transpose(1, 2)
    if bias is None:
        return wt, None
    flat_bias = bias.new_zeros(models, width, dtype=dtype)
    flat_bias[:, :channels] = bias
    return wt, flat_bias.view(-1)


def _pass_gradients(xp: Tensor, grad: Tensor, argmax: Tensor, weight_shape: torch.Size, patchnorm: bool,
                    with_bias: bool) -> tuple[Tensor, Tensor | None]:
    """(Σ g·r·patch, Σ g·r) of the pass at its output's gradient ``grad``, summed at each pooled
    value's maximum: (K, C, kh·kw) and (K, C) (None without ``with_bias``)."""
    models, channels, _one, kh, kw = weight_shape
    grad = grad.contiguous(memory_format=torch.channels_last)
    dwt, db = _fused.conv_pool_backward(xp, grad, argmax, (kh, kw), patchnorm, with_bias)
    return dwt[:, :, :channels].transpose(1, 2), None if db is None else db.view(models, -1)[:, :channels]


class ConvMaxPool(torch.autograd.Function):
    """:func:`conv_max_pool` (module docstring); backward gives the weight's and the bias's
    gradients (once differentiable)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, padding: tuple[int, int],
                patchnorm: bool, relu: bool) -> Tensor:
        channels, (kh, kw) = weight.shape[1], weight.shape[3:]
        xp = _pass_input(x, padding)
        wt, flat_bias = _pass_parameters(weight, bias, x.dtype)
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
        dw, db = _pass_gradients(xp, grad, argmax, ctx.weight_shape, ctx.patchnorm, ctx.with_bias)
        dw = dw.reshape(ctx.weight_shape) if ctx.needs_input_grad[1] else None
        return None, dw, db, None, None, None


#: The most taps (kh·kw) a first block with a BatchNorm2d takes: its moments cost taps·(taps + 1)/2
#: products of the input (:func:`patch_moments`), more than the unfused block's beyond 3×3.
BATCH_NORM_MAX_TAPS = 9


def patch_moments(xp: Tensor, kernel: tuple[int, int], shift: Tensor) -> tuple[Tensor, Tensor, int]:
    """(p, G, N) of each model's patches of x̃ − shift over its batch, in float64: p (K, kh·kw) =
    Σ_{n,a} (x̃[n, a + ·] − shift) and G (K, kh·kw, kh·kw) = Σ_{n,a} (x̃[n, a + ·] − shift)(…)ᵀ over
    the N = B·H'·W' convolution outputs a of the padded input xp (K, B, Hq, Wq), ``shift`` (K,)
    per model. Each tap's inputs are a shifted view of xp, so G is the views' pairwise products
    summed (no patch matrix is written)."""
    kh, kw = kernel
    rows, cols = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    centred = xp.double() - shift.view(-1, 1, 1, 1)
    views = [centred[:, :, i:i + rows, j:j + cols] for i in range(kh) for j in range(kw)]
    sums = torch.stack([view.sum((1, 2, 3)) for view in views], 1)
    gram = sums.new_empty(xp.shape[0], len(views), len(views))
    for t, one in enumerate(views):
        for u in range(t, len(views)):
            gram[:, t, u] = gram[:, u, t] = (one * views[u]).sum((1, 2, 3))
    return sums, gram, xp.shape[1] * rows * cols


class ConvBatchNormMaxPool(torch.autograd.Function):
    """:func:`conv_batch_norm_max_pool` (module docstring); once differentiable. In training the
    forward updates the running statistics in place, as ``F.batch_norm`` does: buffers, neither
    outputs nor saved, with no gradient, so nothing is marked dirty (``mark_dirty`` is for
    inputs returned as outputs)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, gamma: Tensor, beta: Tensor,
                running_mean: Tensor, running_var: Tensor, padding: tuple[int, int], momentum: float, eps: float,
                training: bool, relu: bool) -> Tensor:
        models, channels, _one, kh, kw = weight.shape
        xp = _pass_input(x, padding)
        w = weight.reshape(models, channels, kh * kw).double()
        b = torch.zeros(models, channels, dtype=torch.float64) if bias is None else bias.double()
        shift = sums = gram = centred = None
        if training:  # the batch's moments of z = w·patch + b (module docstring), from those of the
            # patches about the input's mean: z = w·(patch − shift) + b + shift·Σw, so that the
            # variance, E[(w·(patch − shift))²] − E[w·(patch − shift)]², cancels only what the
            # centred input's moments do
            shift = xp.mean((1, 2, 3), dtype=torch.float64)
            sums, gram, count = patch_moments(xp, (kh, kw), shift)
            centred = torch.bmm(w, sums.unsqueeze(2)).squeeze(2) / count  # E[w·(patch − shift)]
            mean = centred + b + shift.unsqueeze(1) * w.sum(2)
            var = (torch.einsum("kct,kts,kcs->kc", w, gram, w) / count - centred * centred).clamp_min(0)
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            running_var.mul_(1 - momentum).add_(momentum * (var * count / max(count - 1, 1)).to(running_var.dtype))
            ctx.count = count
        else:
            mean, var = running_mean.double(), running_var.double()
        inv = (var + eps).rsqrt()
        scale = gamma.double() * inv  # y = scale·(z − mean) + β = (scale·w)·patch + scale·(b − mean) + β
        folded = (scale.unsqueeze(2) * w).view(weight.shape).to(x.dtype)
        wt, flat_bias = _pass_parameters(folded, (scale * (b - mean) + beta.double()).to(x.dtype), x.dtype)
        keep = any(ctx.needs_input_grad[1:5])
        out, argmax = _fused.conv_pool(xp, wt, flat_bias, channels, (kh, kw), False, keep_argmax=keep, relu=relu)
        if keep:
            ctx.save_for_backward(xp, argmax, w, b, mean, inv, scale, shift, sums, gram, centred)
        ctx.weight_shape, ctx.training = weight.shape, training
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xp, argmax, w, b, mean, inv, scale, shift, sums, gram, centred = ctx.saved_tensors
        t, s1 = _pass_gradients(xp, grad, argmax, ctx.weight_shape, False, True)  # Σ dy·patch, Σ dy
        t, s1 = t.double(), s1.double()
        s2 = ((w * t).sum(2) + (b - mean) * s1) * inv  # Σ dy·x̂, x̂ = (z − mean)·inv
        if ctx.training:  # dz = scale·(dy − Σdy/N − x̂·Σ(dy·x̂)/N), summed against each tap of the
            # centred patches (the same sums: Σ dz = 0), x̂ = (w·(patch − shift) − centred)·inv
            t = t - shift.view(-1, 1, 1) * s1.unsqueeze(2)
            x_hat_patch = (torch.bmm(w, gram) - centred.unsqueeze(2) * sums.unsqueeze(1)) * inv.unsqueeze(2)
            dw = scale.unsqueeze(2) * (t - (s1 / ctx.count).unsqueeze(2) * sums.unsqueeze(1)
                                       - (s2 / ctx.count).unsqueeze(2) * x_hat_patch)
            db = torch.zeros_like(s1)  # Σ dz = 0: BatchNorm removes the bias
        else:  # running statistics: dz = scale·dy
            dw, db = scale.unsqueeze(2) * t, scale * s1
        grads = [dw.view(ctx.weight_shape), db, s2, s1]  # weight, bias, gamma, beta
        return (None, *(g.to(grad.dtype) if needed else None for g, needed in zip(grads, ctx.needs_input_grad[1:5])),
                None, None, None, None, None, None, None)

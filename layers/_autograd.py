"""The corrected layers as autograd Functions with hand-written, twice-differentiable backwards.

Every Function returns (z, scale): the layer output and the per-row (per-position) scale it
applied, which is also the only thing it saves beyond what nn.Linear / nn.Conv save (the input
and the weight; PatchNormConv also saves z, see ``PatchNormConv``). The scale is an output so
that double backward sees its dependence on x: its gradient arrives as ``grad_scale``.

All are ``generate_vmap_rule = True`` with ``setup_context``, so torch.func (vmap, jacrev,
functional_call) works; the backward formulas are derived in each docstring and checked
against autograd of the closed form by the tests (gradcheck, gradgradcheck in float64).
Inputs are already validated and 2-D (rows) or (N, C, *spatial) by ``functional``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from affdiv.layers._scale import accumulation_dtype, matvec, plain_eager, prepare, rowdot, safe_exponent, small_norm


class AffineLike(Function):
    """z = r·(x Wᵀ + b),  r = 1/√(‖x‖² + 1) per row.

    Forward on x' = c·x (``prepare``): z = ρ·(x' Wᵀ + c·b), ρ = 1/hypot(‖x'‖, c), r = ρ·c.
    Backward, with y = x Wᵀ + b:  gy = r·gz,  dW = gyᵀ x,  db = Σ_rows gy = gzᵀ r,  u = gy W,
    dr = ⟨gz, y⟩ + g_r = (⟨u, x⟩ + ⟨gy, b⟩)/r + g_r  and  ∂r/∂x = −r³ x, so
        dx = u − r²·(⟨u, x⟩ + ⟨gy, b⟩ + r·g_r)·x.
    No output is saved: ⟨gz, y⟩ comes from u, which dx needs anyway.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        x_scaled, c, norm = prepare(x, (-1,), floor=1.0)
        rho = 1.0 / torch.hypot(norm, c)
        r = rho * c
        if x_scaled is x and bias is not None:  # c = 1: the bias goes into the GEMM
            return torch.addmm(bias, x, weight.t()).mul_(rho.to(x.dtype)), r
        z = (x_scaled @ weight.t()).mul_(rho.to(x.dtype))
        if bias is not None:
            z = torch.addcmul(z, r.to(x.dtype), bias)
        return z, r

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight, bias, output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_z: Tensor | None, grad_r: Tensor | None):
        return affine_like_grads(*ctx.saved_tensors, grad_z, grad_r, ctx.needs_input_grad[:3])


def affine_like_grads(x, weight, bias, r, grad_z, grad_r, needs) -> tuple[Tensor | None, ...]:
    """(dx, dW, db) of AffineLike from the saved (x, W, b, r); see ``AffineLike``."""
    need_x, need_w, need_b = needs
    dx = dw = db = None
    coef = None  # r²·(...) of dx = u − coef·x, in the accumulation dtype
    if grad_z is not None:
        r_z = r.to(grad_z.dtype)
        if need_b and bias is not None:
            db = (grad_z.t() @ r_z).squeeze(-1)  # gzᵀr: one BLAS matvec (measured faster than gy.sum(0))
        if need_w or need_x:
            gy = grad_z * r_z
        if need_w:
            dw = gy.t() @ x
        if need_x:
            u = gy @ weight
            dot = rowdot(u, x) if bias is None else rowdot(u, x) + matvec(gy, bias)
            coef = r * (r * dot)
            dx = u
    if grad_r is not None and need_x:
        extra = r * (r * (r * grad_r))
        coef = extra if coef is None else coef + extra
    if coef is not None:
        dx = _minus_coef_times(dx, coef.to(x.dtype), x)
    return dx, dw, db


def _minus_coef_times(u: Tensor | None, coef: Tensor, x: Tensor) -> Tensor:
    """u − coef·x (u None: −coef·x), in place on u (a temporary of ours) where that is allowed."""
    if u is None:
        return -coef * x
    if plain_eager(u) and not u.requires_grad:  # (under create_graph, u is saved by rowdot)
        return u.addcmul_(coef, x, value=-1)
    return torch.addcmul(u, coef, x, value=-1)


class NormLike(Function):
    """z = q·(x Wᵀ) + b,  q = k/max(‖x‖, eps) per row (k = 1 for l2, √m for rms).

    An all-zero row gives z = b (it is x/max(‖x‖, eps) = 0). Forward on x' = c·x:
    q' = k/max(‖x'‖, eps·c), z = q'·(x' Wᵀ) + b, q = q'·c. Backward: gy = q·gz, dW = gyᵀ x,
    db = Σ_rows gz, u = gy W. Where ‖x‖ > eps (i.e. q < k/eps), ∂q/∂x = −q x/‖x‖² and with
    p = q/k = 1/‖x‖:  dx = u − p²·(⟨u, x⟩ + q·g_q)·x;  elsewhere q is constant and dx = u.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor, bias: Tensor | None, k: float, eps: float):
        small = None if eps >= small_norm(x.dtype) else small_norm(x.dtype)  # eps too small to hide underflow
        x_scaled, c, norm = prepare(x, (-1,), floor=2.0 ** -safe_exponent(x.dtype), small=small)
        q_scaled = k / torch.maximum(norm, eps * c)
        z = (x_scaled @ weight.t()).mul_(q_scaled.to(x.dtype))
        if bias is not None:
            z = z.add_(bias) if plain_eager(z) else z + bias
        return z, q_scaled * c

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, k, eps = inputs
        ctx.save_for_backward(x, weight, output[1])  # db = Σ gz needs no b
        ctx.k, ctx.eps, ctx.has_bias = k, eps, bias is not None
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_z: Tensor | None, grad_q: Tensor | None):
        x, weight, q = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        p = torch.where(q < ctx.k / ctx.eps, q / ctx.k, 0.0)  # 1/‖x‖ where the norm branch is live
        dx = dw = db = None
        dot = None
        if grad_z is not None:
            gy = grad_z * q.to(grad_z.dtype)
            if need_w:
                dw = gy.t() @ x
            if need_b and ctx.has_bias:
                db = grad_z.sum(0)
            if need_x:
                dx = gy @ weight
                dot = rowdot(dx, x)
        if grad_q is not None and need_x:
            dot = q * grad_q if dot is None else dot + q * grad_q
        if dot is not None:
            dx = _minus_coef_times(dx, (p * (p * dot)).to(x.dtype), x)
        return dx, dw, db, None, None


class PatchNormConv(Function):
    """z_{o,p} = r_{g,p}·(conv(x, W)_{o,p} + b_o),  r_{g,p} = 1/√(‖P_{g,p}‖² + 1),

    P_{g,p} the receptive field of output position p restricted to the input channels of group g
    (the group of output channel o). ‖P_{g,p}‖² = box(Σ_{c∈g} x_c²): a convolution of the
    group's summed squares with a ones kernel of the same geometry.

    Forward on x' = c·x with c per sample (``prepare`` over C and space): s' = box(Σ x'²),
    ρ = 1/hypot(√s', c), z = ρ·(conv(x', W) + c·b), r = ρ·c.
    Backward: gy = r·gz (broadcast over the group's output channels); dx, dW, db of the conv at
    gy; dr = ⟨gz, y⟩_{g,p} + g_r with ⟨gz, y⟩ = ⟨gz, z⟩/r summed over the group's output
    channels; ∂r/∂s = −r³/2, so ds = −(r²/2)·⟨gz, z⟩ − (r³/2)·g_r; dx += 2 x · boxᵀ(ds).
    The per-position ⟨gz, y⟩ needs y (or z): it cannot come from the conv's dx, which sums
    overlapping patches. So z is saved too (when the consumer saves z as well, e.g. a conv, a
    linear or BatchNorm, the storage is shared), rather than recomputing the conv (+1 conv).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups):
        x_scaled, c, _ = prepare(x, tuple(range(1, x.dim())), floor=1.0, finite_only=True)
        patch_sq = _box(_group_squares(x_scaled, groups), weight.shape[2:], stride, padding, dilation)
        rho = 1.0 / torch.hypot(patch_sq.clamp_min(0).sqrt(), c)
        r = rho * c
        in_place = plain_eager(x)
        geometry = (stride, padding, dilation, False, _zeros(x), groups)
        if x_scaled is x:  # c = 1: the bias goes into the convolution
            y = torch.convolution(x, weight, bias, *geometry)
        else:
            y = torch.convolution(x_scaled, weight, None, *geometry)
            if bias is not None:
                scaled_bias = c.to(x.dtype) * bias.reshape((1, -1) + (1,) * (x.dim() - 2))
                y = y.add_(scaled_bias) if in_place else y + scaled_bias
        return _per_group(y, rho.to(x.dtype), groups, in_place), r

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, stride, padding, dilation, groups = inputs
        z, r = output
        ctx.save_for_backward(x, weight, r, z)
        ctx.geometry = (stride, padding, dilation, groups)
        ctx.bias_shape = None if bias is None else list(bias.shape)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_z, grad_r):
        x, weight, r, z = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        acc = accumulation_dtype(x.dtype)
        dx = dw = db = None
        ds = None
        if grad_z is not None:
            gy = _per_group(grad_z, r.to(grad_z.dtype), groups)
            dx, dw, db = torch.ops.aten.convolution_backward(
                gy, x, weight, ctx.bias_shape, stride, padding, dilation,
                False, _zeros(x), groups, [need_x, need_w, need_b and ctx.bias_shape is not None],
            )
            if need_x:
                gz_dot_z = (grad_z * z).unflatten(1, (groups, -1)).sum(2, dtype=acc)
                ds = -0.5 * r * r * gz_dot_z
        if grad_r is not None and need_x:
            extra = -0.5 * r * r * r * grad_r
            ds = extra if ds is None else ds + extra
        if ds is not None:
            # ∂‖P‖²/∂x = 2x on each patch, for each channel of the group (2 goes on dsq: 2x may
            # overflow where x is near max)
            dsq2 = (2 * _box_transpose(ds, x, weight.shape[2:], stride, padding, dilation)).to(x.dtype).unsqueeze(2)
            x_groups = x.unflatten(1, (groups, -1))
            if dx is None:
                dx = (x_groups * dsq2).flatten(1, 2)
            elif plain_eager(dx) and not dx.requires_grad:
                dx.unflatten(1, (groups, -1)).addcmul_(x_groups, dsq2)
            else:
                dx = torch.addcmul(dx.unflatten(1, (groups, -1)), x_groups, dsq2).flatten(1, 2)
        return dx, dw, db, None, None, None, None


def _zeros(x: Tensor) -> list[int]:
    return [0] * (x.dim() - 2)


def _per_group(t: Tensor, scale: Tensor, groups: int, in_place: bool = False) -> Tensor:
    """t (N, O, *S) times scale (N, groups, *S), each group's scale over its O/groups channels."""
    if in_place:
        t.unflatten(1, (groups, -1)).mul_(scale.unsqueeze(2))
        return t
    return (t.unflatten(1, (groups, -1)) * scale.unsqueeze(2)).flatten(1, 2)


def _group_squares(x: Tensor, groups: int) -> Tensor:
    """Σ_{c∈g} x_c² per group g: (N, C, *S) -> (N, groups, *S), in the accumulation dtype."""
    x = x.to(accumulation_dtype(x.dtype))
    return (x * x).unflatten(1, (groups, -1)).sum(2)  # (x * x: faster than square() on CPU)


def _ones_kernel(groups: int, kernel, like: Tensor) -> Tensor:
    return torch.ones((groups, 1, *kernel), dtype=like.dtype, device=like.device)


def _box(sq: Tensor, kernel, stride, padding, dilation) -> Tensor:
    """‖P_{g,p}‖²: the sum of sq (N, groups, *S) over each receptive field (a depthwise
    convolution with a ones kernel) -> (N, groups, *out)."""
    groups = sq.shape[1]
    ones = _ones_kernel(groups, kernel, sq)
    return torch.convolution(sq, ones, None, stride, padding, dilation, False, _zeros(sq), groups)


def _box_transpose(ds: Tensor, x: Tensor, kernel, stride, padding, dilation) -> Tensor:
    """The adjoint of ``_box``: each position's ds spread over its receptive field -> (N, groups, *S)."""
    groups = ds.shape[1]
    ones = _ones_kernel(groups, kernel, ds)
    # output_padding: the input rows/cols past the last full stride (< stride, as torch requires)
    extra = [
        n - ((o - 1) * s - 2 * p + dl * (k - 1) + 1)
        for n, o, s, p, dl, k in zip(x.shape[2:], ds.shape[2:], stride, padding, dilation, kernel)
    ]
    return torch.convolution(ds, ones, None, stride, padding, dilation, True, extra, groups)

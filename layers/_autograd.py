"""The corrected layers as autograd Functions with hand-written, twice-differentiable backwards.

Every Function returns (z, scale): the layer output and the per-row (per-position) scale it
applied, which is also the only thing it saves beyond what nn.Linear / nn.Conv save (the input
and the weight; PatchNormConv also saves z unless ``recompute``, see ``PatchNormConv``). The
scale is an output so that double backward sees its dependence on x: its gradient arrives as
``grad_scale``.

Where ``_fused.usable`` (plain eager CPU float32/float64, no graph being recorded) the passes
around the GEMM / convolution run as the fused C kernels of ``_fused``; otherwise as the torch
ops written out below, which are the reference the fused path is tested against.

All are ``generate_vmap_rule = True`` with ``setup_context``, so torch.func (vmap, jacrev,
functional_call) works; the backward formulas are derived in each docstring and checked
against autograd of the closed form by the tests (gradcheck, gradgradcheck in float64).
Inputs are already validated and 2-D (rows) or (N, C, *spatial) by ``functional``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd import Function

from affdiv.layers import _fused
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
        if _fused.usable(x, weight, bias):
            z = torch.mm(x, weight.t())
            r, safe = _fused.scale_outputs(z, x, "affine_like", pre=bias)
            if safe:  # ‖x‖² finite in x's dtype: c = 1 (see ``prepare``)
                return z, r
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
    if grad_z is not None:
        grad_z = grad_z.contiguous()  # (a no-op but for e.g. the expanded gradient of a sum)
        if _fused.usable(x, weight, bias, r, grad_z, grad_r):
            column_sum = "scaled" if need_b and bias is not None else None  # db = Σ r·gz
            extra = None if grad_r is None else r * grad_r
            return _dense_grads_fused(x, weight, r, grad_z, extra, need_x, need_w, column_sum, bias)
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


def _dense_grads_fused(x, weight, s, grad_z, extra, need_x, need_w, column_sum, bias=None, m=1.0,
                       limit=math.inf) -> tuple[Tensor | None, ...]:
    """(dx, dW, db) of a dense layer z = s·(x Wᵀ) (+ bias) in three fused row passes around the
    two GEMMs: gy = s·gz (with db, ``column_sum``, and ⟨gy, b⟩ when ``bias`` enters the scaled
    part), dW = gyᵀ x, dx = u − a·(⟨u, x⟩ + ⟨gy, b⟩ + extra)·x with u = gy W, a = (m·s)² where
    s < limit (see ``_fused.minus_radial_``)."""
    gy, db, beta = _fused.scale_grad(grad_z, s, column_sum, bias if need_x else None)
    dx = None
    if need_x:  # (before dW: the radial pass then finds u in cache)
        offset = beta if extra is None else (extra if beta is None else beta + extra)
        dx = _fused.minus_radial_(gy @ weight, x, s, m, limit, offset)
    dw = gy.t() @ x if need_w else None
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
        if _fused.usable(x, weight, bias):
            z = torch.mm(x, weight.t())
            q, safe = _fused.scale_outputs(z, x, "norm_like", post=bias, k=k, eps=eps, small=small or 0.0)
            if safe:  # ‖x‖² finite in x's dtype and no norm below ``small``: c = 1 (see ``prepare``)
                return z, q
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
        if grad_z is not None:
            grad_z = grad_z.contiguous()  # (as in ``affine_like_grads``)
            if _fused.usable(x, weight, q, grad_z, grad_q):
                column_sum = "input" if need_b and ctx.has_bias else None  # db = Σ gz (b is not scaled)
                extra = None if grad_q is None else q * grad_q
                grads = _dense_grads_fused(x, weight, q, grad_z, extra, need_x, need_w, column_sum,
                                           m=1 / ctx.k, limit=ctx.k / ctx.eps)
                return *grads, None, None
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
    The per-position ⟨gz, y⟩ needs y (or z): it is bilinear in gz, unknown until backward, and
    y_p (O/groups numbers per group and position) cannot be rebuilt from less: not from the
    conv's dx, which sums overlapping patches. So either z is saved (``recompute=False``, the
    default: the memory of Conv2d→BatchNorm2d, which saves the conv output too, and shared with
    a consumer that saves its input) or the forward is run again in backward (``recompute=True``:
    one float per group and position saved beyond nn.Conv2d, at the cost of one more
    convolution). Under a double backward the recomputed z is itself differentiable.
    With the fused passes, an NCHW input's backward convolution runs channels_last (see
    ``_channels_last_backward``); its gradients still come back in the layouts of x and W.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, stride, padding, dilation, groups, recompute=False):
        geometry = (stride, padding, dilation, False, _zeros(x), groups)
        if _fused.usable(x, memory_format=None):
            squares, safe = _fused.group_squares(x, groups)
            if safe:  # every ‖x_n‖² finite in x's dtype: c = 1 (see ``prepare``)
                y = torch.convolution(x, weight, bias, *geometry)
                r = _fused.box(squares, y.shape[2:], weight.shape[2:], stride, padding, dilation)
                if _fused.usable(y, memory_format=None):
                    return _fused.group_update_(y, r, groups), r
                return _per_group(y, r, groups, True), r
        x_scaled, c, _ = prepare(x, tuple(range(1, x.dim())), floor=1.0, finite_only=True)
        patch_sq = _box(_group_squares(x_scaled, groups), weight.shape[2:], stride, padding, dilation)
        rho = 1.0 / torch.hypot(patch_sq.clamp_min(0).sqrt(), c)
        r = rho * c
        in_place = plain_eager(x)
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
        x, weight, bias, stride, padding, dilation, groups, recompute = inputs
        z, r = output
        ctx.save_for_backward(x, weight, r, bias if recompute else z)
        ctx.geometry = (stride, padding, dilation, groups)
        ctx.bias_shape = None if bias is None else list(bias.shape)
        ctx.recompute = recompute
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_z, grad_r):
        x, weight, r, z_or_bias = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.geometry
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        z = None if ctx.recompute else z_or_bias  # z is needed only for dx
        if ctx.recompute and grad_z is not None and need_x:  # z from the forward again
            z = apply(PatchNormConv, x, weight, z_or_bias, stride, padding, dilation, groups, True)[0]
        dx = dw = db = None
        dsq2 = None  # 2·boxᵀ(ds): dx gets x·dsq2, per group
        dx_buffer = None  # set when the convolution runs channels_last: where dx is written back
        if grad_z is not None:
            fused = grad_r is None and _fused.usable(r)
            if fused:
                layout = _fused.layout_of(grad_z if z is None else z)
                grad_z = grad_z.contiguous(memory_format=layout)  # (a no-op unless the consumer's layout differs)
                fused = _fused.usable(grad_z, z, memory_format=layout)
            x_conv = x
            if fused and (need_x or need_w) and _channels_last_backward(x, layout):  # gy and x transposed in the passes
                gy, e = _fused.scale_and_dot(grad_z, z, r, groups, with_dot=need_x, to_channels_last=True)
                dx_buffer = torch.empty_like(x)  # x channels_last now (only dW reads it), dx later
                x_conv = _fused.channels_last_copy(x, dx_buffer) if need_w else _fused.channels_last_view(dx_buffer)
            elif fused:  # one pass for gy and e = 2·ds
                gy, e = _fused.scale_and_dot(grad_z, z, r, groups, with_dot=need_x)
            else:
                gy = _per_group(grad_z, r.to(grad_z.dtype), groups)
            dx, dw, db = torch.ops.aten.convolution_backward(
                gy, x_conv, weight, ctx.bias_shape, stride, padding, dilation,
                False, _zeros(x), groups, [need_x, need_w, need_b and ctx.bias_shape is not None],
            )
            if dx_buffer is not None and dw is not None:  # (oneDNN returns it channels_last)
                dw = dw.contiguous(memory_format=_fused.layout_of(weight))
            if need_x and fused:
                dsq2 = _fused.box_transpose(e, x.shape[2:], weight.shape[2:], stride, padding, dilation)
            elif need_x:
                ds = -0.5 * r * r * (grad_z * z).unflatten(1, (groups, -1)).sum(2, dtype=accumulation_dtype(x.dtype))
                if grad_r is not None:
                    ds = ds - 0.5 * r * r * r * grad_r
                dsq2 = _doubled_box_transpose(ds, x, weight.shape[2:], stride, padding, dilation)
        elif grad_r is not None and need_x:
            dsq2 = _doubled_box_transpose(-0.5 * r * r * r * grad_r, x, weight.shape[2:], stride, padding, dilation)
        if dsq2 is not None and dx_buffer is not None:  # dx = dx_cl + x·dsq2, back in x's layout
            dx_rows = dx.contiguous(memory_format=torch.channels_last)  # (a no-op: oneDNN keeps the layout)
            dx = _fused.group_update_from_channels_last(dx_rows, dsq2, groups, src=x, out=dx_buffer)
        elif dsq2 is not None:
            dx = _add_radial(dx, x, dsq2, groups)
        return dx, dw, db, None, None, None, None, None


def _channels_last_backward(x: Tensor, layout: torch.memory_format) -> bool:
    """Whether the backward convolution of this contiguous (N, C, H, W) float32 input runs
    channels_last, as torch.compile (inductor) runs every oneDNN convolution on CPU. In NCHW,
    oneDNN reorders x, gy and dx to and from its blocked layout and runs slower kernels; the
    transposes that channels_last needs ride on the passes around the convolution instead (all
    but x's own, which fills the buffer dx is later written to). Float64 convolutions do not go
    to oneDNN and cost the same in both layouts, so there the transposes would be pure cost.
    Measured in docs/FINDINGS.md."""
    return (layout == torch.contiguous_format and x.dim() == 4 and x.dtype == torch.float32 and _fused.usable(x)
            and torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available())


def _doubled_box_transpose(ds, x, kernel, stride, padding, dilation) -> Tensor:
    """2·boxᵀ(ds) in x's dtype: ∂‖P‖²/∂x = 2x on each patch (the 2 goes here, not on x: 2x may
    overflow where x is near max)."""
    return (2 * _box_transpose(ds, x, kernel, stride, padding, dilation)).to(x.dtype)


def _add_radial(dx: Tensor | None, x: Tensor, dsq2: Tensor, groups: int) -> Tensor:
    """dx + x·dsq2 (dsq2 (N, groups, *S) over each group's channels; dx None: x·dsq2), in place
    on dx (a temporary of ours) where that is allowed."""
    if dx is None:
        return _per_group(x, dsq2, groups)
    if _fused.usable(dx, x, memory_format=None) and _fused.usable(dsq2):
        return _fused.group_update_(dx, dsq2, groups, src=x)
    x_groups, dsq2 = x.unflatten(1, (groups, -1)), dsq2.unsqueeze(2)
    if plain_eager(dx) and not dx.requires_grad:
        dx.unflatten(1, (groups, -1)).addcmul_(x_groups, dsq2)
        return dx
    return torch.addcmul(dx.unflatten(1, (groups, -1)), x_groups, dsq2).flatten(1, 2)


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


def apply(function: type[Function], *args):
    """``function.apply(*args)``; in plain eager mode through its old-style twin (forward taking
    ctx, no setup_context), which Function.apply calls directly: for setup_context-style
    Functions it first binds the arguments with inspect.signature, about 30 µs a call, while
    torch.func needs that style. Same forward, same saved tensors, same backward."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return function.apply(*args)
    return _EAGER_TWINS[function].apply(*args)


def _eager_twin(function: type[Function]) -> type[Function]:
    def forward(ctx, *args):
        output = function.forward(*args)
        function.setup_context(ctx, args, output)
        return output

    body = {"forward": staticmethod(forward), "backward": staticmethod(function.backward)}
    return type(f"{function.__name__}Eager", (Function,), body)


_EAGER_TWINS = {function: _eager_twin(function) for function in (AffineLike, NormLike, PatchNormConv)}

"""The corrected layers as autograd Functions with hand-written, twice-differentiable backwards
and forward-mode derivatives (``jvp``).

Every Function returns (z, scale): the layer output and the per-row (per-position) scale it
applied, which is also the only thing it saves beyond what nn.Linear / nn.Conv save (the input
and the weight; PatchNormConvFunction also keeps z unless ``recompute``, see there). The
scale is an output so that double backward sees its dependence on x: its gradient arrives as
``grad_scale``, and forward mode gives its tangent too.

Where ``_fused.usable`` (plain eager CPU float32/float64, no graph being recorded) the passes
around the GEMM / convolution run as the fused C kernels of ``_fused``; otherwise as the torch
ops written out below, which are the reference the fused path is tested against.

All are ``generate_vmap_rule = True`` with ``setup_context``, so torch.func (vmap, jacrev,
jvp, jacfwd, functional_call) and ``torch.autograd.forward_ad`` work; the backward and jvp
formulas are derived in each docstring and checked by the tests against autograd of the
closed form (gradcheck, gradgradcheck), central finite differences and the naive composite's
jvp, in float64. The jvp formulas hold where ‖x‖² is finite in x's dtype (as the backward's).
Inputs are already validated and 2-D (rows) or (N, C, *spatial) by ``functional``.

AffineLikeFunction and NormLikeFunction have C++ twins (``_autograd_nodes.cpp``, loaded by
``_native``), which plain eager CPU calls take: the same branches and the same ops in the same
order, so a change to the formulas here must be made there too (the tests compare them bit for
bit). So has PatchNormConvFunction's fused branch (plain eager CPU 2-D convolutions whose squares
sum finitely): the node's backward calls ``patchnorm_conv_grads`` for every other case.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd import Function

from affdiv.layers import _fused
from affdiv.layers._scale import accumulation_dtype, matvec, plain_eager, prepare, rowdot, safe_exponent, small_norm
from affdiv.layers._torch_internals import functorch_transforms_active, is_compiling, saved_tensors_hooks_active


class AffineLikeFunction(Function):
    """z = r·(x Wᵀ + b),  r = 1/√(‖x‖² + 1) per row.

    Forward on x' = c·x (``prepare``): z = ρ·(x' Wᵀ + c·b), ρ = 1/hypot(‖x'‖, c), r = ρ·c.
    Backward, with y = x Wᵀ + b:  gy = r·gz,  dW = gyᵀ x,  db = Σ_rows gy = gzᵀ r,  u = gy W,
    dr = ⟨gz, y⟩ + g_r = (⟨u, x⟩ + ⟨gy, b⟩)/r + g_r  and  ∂r/∂x = −r³ x, so
        dx = u − r²·(⟨u, x⟩ + ⟨gy, b⟩ + r·g_r)·x.
    No output is saved: ⟨gz, y⟩ comes from u, which dx needs anyway.
    Forward mode (tangents ẋ, Ẇ, ḃ): ṙ = −r³⟨x, ẋ⟩ = −r·c with c = r²⟨x, ẋ⟩, so
        ż = ṙ·y + r·ẏ = r·((ẋ − c·x) Wᵀ + x Ẇᵀ + ḃ − c·b):
    the tangent of the augmented input [x; 1] less its part along [x; 1], through the layer.
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
        ctx.save_for_forward(x, weight, bias, output[1])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_z: Tensor | None, grad_r: Tensor | None):
        return affine_like_grads(*ctx.saved_tensors, grad_z, grad_r, ctx.needs_input_grad[:3])

    @staticmethod
    def jvp(ctx, x_t: Tensor | None, weight_t: Tensor | None, bias_t: Tensor | None):
        return affine_like_tangents(*ctx.saved_tensors, x_t, weight_t, bias_t)


def affine_like_grads(x, weight, bias, r, grad_z, grad_r, needs) -> tuple[Tensor | None, ...]:
    """(dx, dW, db) of AffineLikeFunction from the saved (x, W, b, r); see there."""
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


def affine_like_tangents(x, weight, bias, r, x_t, weight_t, bias_t) -> tuple[Tensor, Tensor]:
    """(ż, ṙ) of AffineLikeFunction from the saved (x, W, b, r) and the input tangents; see there."""
    c = None if x_t is None else r * (r * rowdot(x, x_t))
    return _dense_tangent(x, weight, bias, r, c, x_t, weight_t, bias_t, bias_scaled=True), _scale_tangent(r, c)


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


def _dense_tangent(x, weight, bias, s, c, x_t, weight_t, bias_t, bias_scaled: bool) -> Tensor:
    """ż of a dense layer z = s·(x Wᵀ + b) (``bias_scaled``, AffineLike) or z = s·(x Wᵀ) + b
    (NormLike) whose row scale has the tangent ṡ = −s·c:
        ż = s·((ẋ − c·x) Wᵀ + x Ẇᵀ [+ ḃ − c·b]) [+ ḃ],
    the bracketed terms where the bias is inside the scale, the last where it is outside
    (c is None exactly where ẋ is; jvp is called with at least one tangent)."""
    inner = []
    if x_t is not None:
        c_x = c.to(x.dtype)
        inner.append((x_t - c_x * x) @ weight.t())
        if bias_scaled and bias is not None:
            inner.append(-c_x * bias)
    if weight_t is not None:
        inner.append(x @ weight_t.t())
    if bias_scaled and bias_t is not None:
        inner.append(bias_t)
    z_t = sum(inner[1:], inner[0]) * s.to(x.dtype) if inner else None
    if not bias_scaled and bias_t is not None:
        z_t = bias_t.expand(x.shape[0], -1) if z_t is None else z_t + bias_t
    return z_t


def _scale_tangent(s: Tensor, c: Tensor | None) -> Tensor:
    """ṡ = −s·c of a row (position) scale s whose relative tangent is −c; zeros where c is None
    (no ẋ: s depends on x only), as torch.func needs a tangent for every differentiable output."""
    return torch.zeros_like(s) if c is None else -s * c


class NormLikeFunction(Function):
    """z = q·(x Wᵀ) + b,  q = k/max(‖x‖, eps) per row (k = 1 for mode l2, √m for mode rms).

    An all-zero row gives z = b (it is x/max(‖x‖, eps) = 0). Forward on x' = c·x:
    q' = k/max(‖x'‖, eps·c), z = q'·(x' Wᵀ) + b, q = q'·c. Backward: gy = q·gz, dW = gyᵀ x,
    db = Σ_rows gz, u = gy W. Where ‖x‖ > eps (i.e. q < k/eps), ∂q/∂x = −q x/‖x‖² and with
    p = q/k = 1/‖x‖:  dx = u − p²·(⟨u, x⟩ + q·g_q)·x;  elsewhere q is constant and dx = u.
    Forward mode: q̇ = −q·c with c = p²⟨x, ẋ⟩ (0 where q is constant), so
        ż = q·((ẋ − c·x) Wᵀ + x Ẇᵀ) + ḃ:  ẋ less its radial part, through the layer.
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
        ctx.save_for_forward(x, weight, output[1])
        ctx.k, ctx.eps, ctx.has_bias = k, eps, bias is not None
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, x_t: Tensor | None, weight_t: Tensor | None, bias_t: Tensor | None, _k, _eps):
        x, weight, q = ctx.saved_tensors
        c = None
        if x_t is not None:
            p = _inverse_norm(q, ctx.k, ctx.eps)
            c = p * (p * rowdot(x, x_t))
        return _dense_tangent(x, weight, None, q, c, x_t, weight_t, bias_t, bias_scaled=False), _scale_tangent(q, c)

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
        p = _inverse_norm(q, ctx.k, ctx.eps)
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


def _inverse_norm(q: Tensor, k: float, eps: float) -> Tensor:
    """p = 1/‖x‖ where NormLike's norm branch is live (q = k/‖x‖ < k/eps), 0 where q = k/eps is
    constant: ∂q/∂x = −q·p²·x."""
    return torch.where(q < k / eps, q / k, 0.0)


class PatchNormConvFunction(Function):
    """z_{o,p} = r_{g,p}·(conv(x, W)_{o,p} + b_o),  r_{g,p} = 1/√(‖P_{g,p}‖² + 1),

    P_{g,p} the receptive field of output position p restricted to the input channels of group g
    (the group of output channel o). ‖P_{g,p}‖² = box(Σ_{c∈g} x_c²): a convolution of the
    group's summed squares with a ones kernel of the same geometry.

    Forward on x' = c·x with c per sample and group (``prepare`` over the group's channels and
    space, so that no group's precision depends on another's magnitude): s' = box(Σ x'²),
    ρ = 1/hypot(√s', c), z = ρ·(conv(x', W) + c·b), r = ρ·c.
    Backward: gy = r·gz (broadcast over the group's output channels); dx, dW, db of the conv at
    gy; dr = ⟨gz, y⟩_{g,p} + g_r with ⟨gz, y⟩ = ⟨gz, z⟩/r summed over the group's output
    channels; ∂r/∂s = −r³/2, so ds = −(r²/2)·⟨gz, z⟩ − (r³/2)·g_r; dx += 2 x · boxᵀ(ds).
    The per-position ⟨gz, y⟩ needs y (or z): it is bilinear in gz, unknown until backward, and
    y_p (O/groups numbers per group and position) cannot be rebuilt from less: not from the
    conv's dx, which sums overlapping patches. So either z is kept (``recompute=False``, the
    default: the memory of Conv2d→BatchNorm2d, which saves the conv output too, and shared with
    a consumer that saves its input) or the forward is run again in backward (``recompute=True``:
    one float per group and position saved beyond nn.Conv2d, at the cost of one more
    convolution). In plain eager mode z is kept as a ``_HeldOutput``, outside the saved tensors:
    a consumer may modify z in place (Conv2d→ReLU(inplace=True), as VGG and AlexNet are built),
    which would make a saved z fail backward; a held z is found changed by its version counter
    and recomputed. The same recompute serves a backward that builds a graph (double backward:
    the recomputed z is differentiable; torch.func transforms always build one) and forwards
    under saved-tensor hooks (checkpointing, offloading: a held z would escape them). Traced by
    torch.compile, z is saved (traced in-place ops are functionalised).
    Forward mode: ṙ = −r·h with h = r²·box(Σ_{c∈g} x_c·ẋ_c) (= ½r²·ṡ), so
        ż = r·(conv(ẋ, W) + conv(x, Ẇ) + ḃ) − h·z,  per group.
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
        x_groups = _by_group(x, groups)
        x_scaled, c, _ = prepare(x_groups, tuple(range(2, x_groups.dim())), floor=1.0, finite_only=True)
        rescaled = x_scaled is not x_groups
        x_scaled, c = (_merge_groups(x_scaled) if rescaled else x), c.squeeze(2)  # c: (N, groups, 1, …)
        patch_sq = _box(_group_dot(x_scaled, x_scaled, groups), weight.shape[2:], stride, padding, dilation)
        rho = 1.0 / torch.hypot(patch_sq.clamp_min(0).sqrt(), c)
        r = rho * c
        in_place = plain_eager(x)
        if not rescaled:  # c = 1: the bias goes into the convolution
            y = torch.convolution(x, weight, bias, *geometry)
        else:
            y = torch.convolution(x_scaled, weight, None, *geometry)
            if bias is not None:
                scaled_bias = _per_group(bias.reshape((1, -1) + (1,) * (x.dim() - 2)), c.to(x.dtype), groups)
                y = y.add_(scaled_bias) if in_place else y + scaled_bias
        return _per_group(y, rho.to(x.dtype), groups, in_place), r

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, stride, padding, dilation, groups, recompute = inputs
        z, r = output
        saved_z, ctx.held_output = None, None
        if not recompute and ctx.needs_input_grad[0]:  # (z is needed for dx only)
            if is_compiling():
                saved_z = z
            elif plain_eager(z) and not z.is_inference() and not functorch_transforms_active() \
                    and not saved_tensors_hooks_active():  # (an inference tensor has no version to hold)
                ctx.held_output = _HeldOutput(z)
        # One tuple for both modes: torch's generated vmap rule keeps a single saved-tensor layout
        # per context, so two different tuples break vmap followed by autograd.
        ctx.save_for_backward(x, weight, r, bias, saved_z)
        ctx.save_for_forward(x, weight, r, bias, saved_z)
        ctx.geometry = (stride, padding, dilation, groups)
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, x_t: Tensor | None, weight_t: Tensor | None, bias_t: Tensor | None, *_geometry_tangents):
        x, weight, r, bias, z = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.geometry
        if x_t is not None and z is None:  # z is kept only when backward needs it: held, or recomputed
            held = ctx.held_output
            z = held.tensor if held is not None and held.unchanged() else apply_patchnorm_conv(
                x, weight, bias, stride, padding, dilation, groups, True)[0]
        geometry = (stride, padding, dilation, False, _zeros(x), groups)
        parts = []
        if x_t is not None:
            parts.append(torch.convolution(x_t, weight, None, *geometry))
        if weight_t is not None:
            parts.append(torch.convolution(x, weight_t, None, *geometry))
        if bias_t is not None:
            parts.append(bias_t.reshape((1, -1) + (1,) * (x.dim() - 2)))
        z_t = _per_group(sum(parts[1:], parts[0]), r.to(x.dtype), groups) if parts else None
        h = None
        if x_t is not None:
            h = r * r * _box(_group_dot(x, x_t, groups), weight.shape[2:], stride, padding, dilation)
            z_t = z_t - _per_group(z, h.to(x.dtype), groups)
        return z_t, _scale_tangent(r, h)

    @staticmethod
    def backward(ctx, grad_z, grad_r):
        x, weight, r, bias, z = ctx.saved_tensors
        held, ctx.held_output = ctx.held_output, None  # released at the first backward
        if z is None and held is not None and held.unchanged() and not torch.is_grad_enabled():
            z = held.tensor
        dx, dw, db = patchnorm_conv_grads(x, weight, r, bias, z, grad_z, grad_r, ctx.geometry, ctx.needs_input_grad[:3])
        return dx, dw, db, None, None, None, None, None


def patchnorm_conv_grads(x: Tensor, weight: Tensor, r: Tensor, bias: Tensor | None, z: Tensor | None,
                         grad_z: Tensor | None, grad_r: Tensor | None, geometry: tuple, needs: Sequence[bool]):
    """(dx, dW, db) of PatchNormConvFunction (its docstring has the math) at (grad_z, grad_r), each
    None unless ``needs`` (x, weight, bias) asks for it; z is the layer's output as saved or held
    (None: computed again where needed); geometry is (stride, padding, dilation, groups). Also the
    backward of the C++ node (``_native``) where its fused branch does not serve."""
    stride, padding, dilation, groups = geometry
    need_x, need_w, need_b = needs
    bias_shape = None if bias is None else list(bias.shape)
    if grad_z is None or not need_x:
        z = None  # (z is needed for dx only)
    elif z is None:  # recompute=True, z modified in place or released, or a graph being built
        z = apply_patchnorm_conv(x, weight, bias, stride, padding, dilation, groups, True)[0]
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
            gy, x_conv, weight, bias_shape, stride, padding, dilation,
            False, _zeros(x), groups, [need_x, need_w, need_b and bias_shape is not None],
        )
        if dx_buffer is not None and dw is not None:  # (oneDNN returns it channels_last)
            dw = dw.contiguous(memory_format=_fused.layout_of(weight))
        if need_x and fused:
            dsq2 = _fused.box_transpose(e, x.shape[2:], weight.shape[2:], stride, padding, dilation)
        elif need_x:
            ds = -0.5 * r * r * _by_group(grad_z * z, groups).sum(2, dtype=accumulation_dtype(x.dtype))
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
    return dx, dw, db


class _HeldOutput:
    """A layer output kept for backward outside ``save_for_backward``: a detached alias (no
    reference cycle through the output's grad_fn; the same storage, so no copy) and the output's
    version when it was made. The alias shares the output's version counter, so ``unchanged``
    is False once anything modified the output in place."""

    __slots__ = ("tensor", "version")

    def __init__(self, output: Tensor):
        self.tensor, self.version = output.detach(), output._version

    def unchanged(self) -> bool:
        return self.tensor._version == self.version


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
    x_groups, dsq2 = _by_group(x, groups), dsq2.unsqueeze(2)
    if plain_eager(dx) and not dx.requires_grad:
        _by_group(dx, groups).addcmul_(x_groups, dsq2)
        return dx
    return _merge_groups(torch.addcmul(_by_group(dx, groups), x_groups, dsq2))


def _zeros(x: Tensor) -> list[int]:
    return [0] * (x.dim() - 2)


def _by_group(t: Tensor, groups: int) -> Tensor:
    """t (N, C, *S) viewed as (N, groups, C/groups, *S); ``_merge_groups`` undoes it. (``view``
    and ``reshape``, not ``unflatten`` and ``flatten``, which the legacy vmap of
    ``autograd.grad(is_grads_batched=True)`` and of vectorised ``autograd.functional.jacobian``
    cannot batch.)"""
    return t.view(t.shape[0], groups, t.shape[1] // groups, *t.shape[2:])


def _merge_groups(t: Tensor) -> Tensor:
    """t (N, groups, C/groups, *S) as (N, C, *S)."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


def _per_group(t: Tensor, scale: Tensor, groups: int, in_place: bool = False) -> Tensor:
    """t (N, O, *S) times scale (N, groups, *S), each group's scale over its O/groups channels."""
    if in_place:
        _by_group(t, groups).mul_(scale.unsqueeze(2))
        return t
    return _merge_groups(_by_group(t, groups) * scale.unsqueeze(2))


def _group_dot(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """Σ_{c∈g} a_c·b_c per group g: (N, C, *S) -> (N, groups, *S), in the accumulation dtype
    (a·a: the squares; faster than square() on CPU)."""
    accumulation = accumulation_dtype(a.dtype)
    a_acc = a.to(accumulation)
    b_acc = a_acc if b is a else b.to(accumulation)
    return _by_group(a_acc * b_acc, groups).sum(2)


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


def _applier(function: type[Function]):
    """``function.apply`` through the twin that suits the mode:

    * under torch.func transforms, ``function`` itself (setup_context style, which they need);
    * traced by torch.compile, its twin without ``jvp``: dynamo refuses to trace a Function
      that defines one (and has no forward mode to use it in);
    * in plain eager mode, its old-style twin (forward taking ctx, no setup_context), which
      Function.apply calls directly: for setup_context-style Functions it first binds the
      arguments with inspect.signature, about 30 µs a call.

    Same forward, same saved tensors, same backward (and jvp, where there is one). (The twins
    are closure variables: dynamo can trace neither a dict lookup nor an attribute keyed by a
    Function class.)"""
    eager = _eager_twin(function)
    traceable = type(f"{function.__name__}Traceable", (function,), {"jvp": staticmethod(Function.jvp)})

    def apply(*args):
        if functorch_transforms_active():
            return function.apply(*args)
        if is_compiling():
            return traceable.apply(*args)
        return eager.apply(*args)

    return apply


def _eager_twin(function: type[Function]) -> type[Function]:
    def forward(ctx, *args):
        output = function.forward(*args)
        function.setup_context(ctx, args, output)
        return output

    body = {"forward": staticmethod(forward), "backward": staticmethod(function.backward),
            "jvp": staticmethod(function.jvp)}
    return type(f"{function.__name__}Eager", (Function,), body)


apply_affine_like = _applier(AffineLikeFunction)
apply_norm_like = _applier(NormLikeFunction)
apply_patchnorm_conv = _applier(PatchNormConvFunction)

"""How each update is computed: a module's batch update (a forward with the step as parameters,
or a jvp), its per-sample diagonals (closed forms, a vmapped per-sample vjp→jvp, or the masked
route for modules that couple samples), and the network-scope diagonals (one dual pass, or the
masked route over the whole network), in chunks within the memory budget.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import jvp, vjp, vmap

from affdiv.meter.capture import CapturePass, Hooks, MeasuredModule, error_reason, trainable_params
from affdiv.meter.kinds import active_dropout, dense_member, is_batchnorm, linear_in_parameters, uses_batch_statistics
from affdiv.meter.options import MeterOptions, UnsupportedModuleError


class Update(NamedTuple):
    """A module's output update (u of the batch, or the per-sample diagonals d) and how it was
    computed (``route``, in words: closed form, jvp, vmap, masked, ...)."""

    value: Tensor
    route: str


def _batched(t: object, batch: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch


def _chunk(budget: int, itemsize: int, params: int, activations: int, items: int) -> int:
    per_item = itemsize * (3 * params + 8 * activations)
    return int(max(1, min(items, budget // max(per_item, 1))))


def _onehots(batch: int, like: Tensor) -> Tensor:
    return torch.eye(batch, dtype=like.dtype, device=like.device)


def _select(t: Tensor, onehot: Tensor) -> Tensor:
    """Row i of t (batch first), written as a contraction so that it vmaps over one-hots."""
    return (t * onehot.reshape((-1,) + (1,) * (t.dim() - 1))).sum(0)


def _dense_features(member: str, module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """(φ, ψ) per row for the affine family: z = W φ(x) + b ψ(x) (theory.affine's α c x and α β)."""
    if member == "affine":
        return x, torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)
    sq = (x * x).sum(-1)
    if member == "affine_like":
        r = torch.rsqrt(sq + 1)
        return x * r.unsqueeze(-1), r
    k = 1.0 if module.mode == "l2" else math.sqrt(x.shape[-1])
    norm = sq.sqrt().clamp_min(module.eps)
    return x * (k / norm).unsqueeze(-1), torch.ones_like(sq)


def dense_diagonal(member: str, module: nn.Module, x: Tensor, g: Tensor, lr: float) -> Tensor:
    """−η Θ_ii g_i per sample for a dense affine-family module on x (B, *, m), g (B, *, n):
    −η (w ΦᵢΦᵢᵀ + b ψᵢψᵢᵀ) Gᵢ over the rows (tokens) of sample i, w and b 1 where the weight and
    the bias are trainable (the family theorem of theory.affine, one sample's block)."""
    params = trainable_params(module)
    w_on, b_on = "weight" in params, "bias" in params
    batch = x.shape[0]
    phi, psi = _dense_features(member, module, x)
    phi = phi.reshape(batch, -1, x.shape[-1])
    psi = psi.reshape(batch, -1)
    grads = g.reshape(batch, -1, g.shape[-1])
    rows, m, n = phi.shape[1], phi.shape[2], grads.shape[2]
    if rows == 1:
        factor = (phi * phi).sum(-1) * w_on + psi * psi * b_on  # (B, 1)
        return (-lr * factor.unsqueeze(-1) * grads).reshape(g.shape)
    if rows * (m + n) <= 2 * m * n:  # the T×T kernel of each sample
        kernel = torch.bmm(phi, phi.transpose(1, 2)) * w_on + psi.unsqueeze(2) * psi.unsqueeze(1) * b_on
        out = torch.bmm(kernel, grads)
    else:  # each sample's own weight gradient
        out = torch.zeros_like(grads)
        if w_on:
            out = out + torch.bmm(phi, torch.bmm(grads.transpose(1, 2), phi).transpose(1, 2))
        if b_on:
            out = out + psi.unsqueeze(-1) * (psi.unsqueeze(-1) * grads).sum(1, keepdim=True)
    return (-lr * out).reshape(g.shape)


def site_factors(module: nn.Module, x: Tensor, output: Tensor) -> Tensor | None:
    """k_s, each site's kernel diagonal (Θ_ss = k_s I), broadcastable to the output, for the
    affine family (sites: rows) and zero-padded Conv1d/2d / PatchNormConv1d/2d (sites: output
    positions; theory.conv); None where no closed form applies."""
    from affdiv.layers.modules import _PatchNormConvNd
    from affdiv.theory import conv as theory_conv

    params = trainable_params(module)
    w_on, b_on = float("weight" in params), float("bias" in params)
    member = dense_member(module)
    if member is not None:
        phi, psi = _dense_features(member, module, x)
        return ((phi * phi).sum(-1) * w_on + psi * psi * b_on).unsqueeze(-1)
    forward = getattr(type(module), "forward", None)
    plain = forward in (nn.Conv1d.forward, nn.Conv2d.forward)
    patchnorm = isinstance(module, _PatchNormConvNd)
    if not (plain or patchnorm) or isinstance(module.padding, str) or module.padding_mode != "zeros":
        return None
    if patchnorm and w_on and b_on:
        return torch.ones((), dtype=output.dtype, device=output.device)
    geometry = theory_conv.Geometry.of(module.weight.dim() - 2, tuple(module.kernel_size), tuple(module.stride),
                                       tuple(module.padding), tuple(module.dilation), module.groups)
    sq = theory_conv.patch_sq_norms_box(x, geometry)  # (B, groups, *out)
    k = sq * w_on + b_on
    if patchnorm:
        k = k / (sq + 1)
    return k.repeat_interleave(output.shape[1] // geometry.groups, dim=1)


def batchnorm_diagonal(module: nn.Module, x: Tensor, g: Tensor, lr: float) -> Tensor:
    """−η Θ_ii g_i per sample for BatchNorm's affine parameters, z = γ x̂ + β with x̂ from the batch
    (train mode) or the running statistics: per channel −η(⟨x̂_i, g_i⟩ x̂_i + Σ g_i), the sums over
    sample i's positions. x̂ depends on the whole batch but not on θ: the coupling is in x̂."""
    params = trainable_params(module)
    dims = [0, *range(2, x.dim())]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if uses_batch_statistics(module):
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
    else:
        mean, var = module.running_mean, module.running_var
    xhat = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + module.eps)
    spatial = list(range(2, x.dim()))

    def per_channel(t: Tensor) -> Tensor:
        return t.sum(spatial, keepdim=True) if spatial else t

    out = torch.zeros_like(g)
    if "weight" in params:
        out = out + per_channel(xhat * g) * xhat
    if "bias" in params:
        out = out + per_channel(g)
    return -lr * out


def layer_update(m: MeasuredModule) -> Update:
    """u = J_θ Δθ of the module alone (its own parameters stepping)."""
    record = m.record
    if linear_in_parameters(m.module):
        values = {n: m.step.get(n, torch.zeros_like(v)) for n, v in m.values.items()}
        with torch.no_grad():
            u = m(values, record.args, record.kwargs, None)
        return Update(u, "closed form f(x; Δθ) (linear in θ)")

    def f(p):
        return m({**m.values, **p}, record.args, record.kwargs, record.rng_state)

    primal = {n: m.values[n] for n in m.step}
    _, u = jvp(f, (primal,), (m.step,))
    return Update(u.detach(), "jvp (module alone)")


def layer_diagonal(m: MeasuredModule, lr: float, batch: int, budget: int) -> Update:
    """d_i = −η Θ_ii g_i of the module alone, per sample."""
    record, module, g = m.record, m.module, m.grad
    member = dense_member(module)
    if member is not None and record.args and isinstance(record.args[0], Tensor) and not record.kwargs:
        return Update(dense_diagonal(member, module, record.args[0], g, lr), f"closed form ({member} family kernel)")
    if is_batchnorm(module):
        return Update(batchnorm_diagonal(module, record.args[0], g, lr), "closed form (BatchNorm, batch statistics)")
    if batch == 1:
        return Update(layer_update(m).value, "B = 1: the batch update")
    trainable_values = {n: m.values[n] for n in m.step}
    linear = linear_in_parameters(module)
    params = sum(v.numel() for v in trainable_values.values())
    itemsize = g.element_size()
    batched_kwargs = any(_batched(v, batch) for v in record.kwargs.values())
    if not batched_kwargs and _independent_module(m, batch):
        in_dims = tuple(0 if _batched(a, batch) else None for a in record.args)
        sample_size = sum(a[0].numel() for a in record.args if _batched(a, batch)) + g[0].numel()

        def one(g_i, *sample):
            sample = tuple(s.unsqueeze(0) if d == 0 else s for s, d in zip(sample, in_dims))

            def f(p):
                return m({**m.values, **p}, sample, record.kwargs, record.rng_state)

            _, pullback = vjp(f, trainable_values)
            (grad,) = pullback(g_i.unsqueeze(0))
            own = {n: -lr * v for n, v in grad.items()}
            if linear:
                out = m({n: own.get(n, torch.zeros_like(v)) for n, v in m.values.items()}, sample, record.kwargs,
                        None)
            else:
                _, out = jvp(f, (trainable_values,), (own,))
            return out.squeeze(0)

        chunk = _chunk(budget, itemsize, params, sample_size, batch)
        d = vmap(one, in_dims=(0, *in_dims), chunk_size=chunk)(g, *record.args)
        return Update(d.detach(), f"vmap per-sample vjp→jvp (module alone, chunks of {chunk})")

    def f(p):
        return m({**m.values, **p}, record.args, record.kwargs, record.rng_state)

    _, pullback = vjp(f, trainable_values)

    def masked(onehot):
        (grad,) = pullback(g * onehot.reshape((-1,) + (1,) * (g.dim() - 1)))
        own = {n: -lr * v for n, v in grad.items()}
        if linear:
            out = m({n: own.get(n, torch.zeros_like(v)) for n, v in m.values.items()}, record.args,
                    record.kwargs, None)
        else:
            _, out = jvp(f, (trainable_values,), (own,))
        return _select(out, onehot)

    size = sum(a.numel() for a in record.args if isinstance(a, Tensor)) + g.numel()
    chunk = _chunk(budget, itemsize, params, size, batch)
    # randomness="same": each pass replays the batch's draws (dropout inside attention), as the batch update did
    d = vmap(masked, chunk_size=chunk, randomness="same")(_onehots(batch, g))
    return Update(d.detach(), f"masked vjp→jvp over the batch (module couples samples; chunks of {chunk})")


def _sub_batch(batch: int) -> list[int]:
    return [0, batch - 1] if batch >= 3 else [0]


def _close(a: Tensor, b: Tensor) -> bool:
    tol = math.sqrt(torch.finfo(b.dtype).eps) if b.is_floating_point() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (scale + tol)).all())


def _independent_module(m: MeasuredModule, batch: int) -> bool:
    """Whether the module alone maps a sub-batch to the same rows as the batch (no coupling)."""
    index = _sub_batch(batch)
    args = tuple(a[index] if _batched(a, batch) else a for a in m.record.args)
    try:
        with torch.no_grad():
            sub = m(m.values, args, m.record.kwargs, m.record.rng_state)
    except Exception:
        return False  # e.g. BatchNorm1d refuses a batch of one in train mode: it couples samples
    return _close(sub, m.output[index])


def network_diagonals(captured: CapturePass, layer_diagonals: Mapping[str, Tensor], skipped: Mapping[str, str],
                      options: MeterOptions) -> tuple[dict[str, Tensor], str]:
    """d_i at every measured module with only sample i's output gradient kept (network scope):
    ({module: d}, how it was computed). ``layer_diagonals``: each module's own diagonal (the
    layer scope's); ``skipped``: the modules left out; ``options``: the memory budget of the
    chunked passes and the masked route's batch limit."""
    model, function, hooks, args = captured.function.module, captured.function, captured.hooks, captured.args
    modules, step, batch = captured.modules, captured.step, captured.batch
    dropout = active_dropout(model)
    if dropout:
        raise UnsupportedModuleError(
            f"module {dropout[0]!r} (Dropout in train mode, p > 0): per-sample diagonals in network scope need a "
            "deterministic forward (the per-sample passes would draw other masks); call model.eval() or pass "
            "per_sample=False"
        )
    coupled = [n for n, m in model.named_modules() if uses_batch_statistics(m)]
    canonical = {id(p): n for n, p in model.named_parameters()}
    by_name = dict(model.named_modules())
    stepping_skipped = [n for n in skipped if any(bool(step[canonical[id(p)]].abs().max() > 0)
                                                  for p in trainable_params(by_name[n]).values())]
    missing = [n for n in modules if n not in layer_diagonals]
    fast = not coupled and not stepping_skipped and not missing and (batch == 1 or _independent_network(
        function, hooks, args, modules, batch))
    if fast:
        with fwAD.dual_level():
            hooks.inject = {n: layer_diagonals[n] for n in modules}
            with hooks.active("inject"):
                try:
                    function(function.params, args)
                except Exception as error:
                    raise UnsupportedModuleError(
                        f"module {hooks.where()!r}: forward-mode AD through the network failed: {error_reason(error)}"
                    ) from error
                tangents = dict(hooks.seen)
            hooks.inject = {}
        out = {n: tangents[n].detach() if tangents.get(n) is not None else layer_diagonals[n] for n in modules}
        return out, "one forward-mode pass injecting each module's own diagonal (samples independent)"

    why = ("BatchNorm " + repr(coupled[0]) + " uses batch statistics" if coupled else
           "module " + repr(stepping_skipped[0]) + " is not measured" if stepping_skipped else
           "module " + repr(missing[0]) + " has no layer diagonal" if missing else
           "a sub-batch does not reproduce the batch's rows")
    if options.masked_limit is not None and batch > options.masked_limit:
        return {}, (f"not computed: the masked route ({why}) needs B = {batch} full-batch passes, above "
                    f"masked_limit = {options.masked_limit}")
    return _masked_network_diagonals(captured, options.memory_budget, why)


def _masked_network_diagonals(captured: CapturePass, budget: int, why: str) -> tuple[dict[str, Tensor], str]:
    """The masked route over the whole network: B passes, each keeping one sample's output gradient."""
    function, hooks, args, modules = captured.function, captured.hooks, captured.args, captured.modules
    grad_out, lr, batch = captured.grad_out, captured.lr, captured.batch
    params = function.params
    n_params = sum(t.numel() for t in params.values())
    activations = sum(m.output.numel() for m in modules.values()) * 2 + sum(a.numel() for a in args)

    def forward(p):
        return function(p, args)

    def collected(p):
        with hooks.active("collect"):
            function(p, args)
            return {n: hooks.seen[n] for n in modules}

    _, pullback = vjp(forward, params)

    def masked(onehot):
        (grad,) = pullback(grad_out * onehot.reshape((-1,) + (1,) * (grad_out.dim() - 1)))
        own = {n: -lr * v for n, v in grad.items()}
        _, tangents = jvp(collected, (params,), (own,))
        return {n: _select(t, onehot) for n, t in tangents.items()}

    chunk = _chunk(budget, grad_out.element_size(), n_params, activations, batch)
    try:
        d = vmap(masked, chunk_size=chunk)(_onehots(batch, grad_out))
    except Exception as error:
        raise UnsupportedModuleError(
            f"module {hooks.where()!r}: the masked per-sample pass through the network failed: {error_reason(error)}"
        ) from error
    return ({n: t.detach() for n, t in d.items()},
            f"masked vjp→jvp over the whole network ({why}; B passes in chunks of {chunk})")


def _independent_network(function, hooks: Hooks, args, modules, batch) -> bool:
    """A forward of a sub-batch reproduces the batch's rows at every measured module."""
    index = _sub_batch(batch)
    sub = tuple(a[index] if _batched(a, batch) else a for a in args)
    try:
        with torch.no_grad(), hooks.active("compare"):
            function(function.params, sub)
            seen = dict(hooks.seen)
    except Exception:
        return False
    return all(isinstance(seen.get(n), Tensor) and _close(seen[n], m.output[index])
               for n, m in modules.items())

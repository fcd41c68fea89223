"""The empirical NTK of a module's output with respect to its own parameters.

    Θ(x_i, x_j) = J_i J_jᵀ,   J_i = ∂f(x_i; θ)/∂θ  (out × P)

computed as in neural-tangents' ``empirical_ntk`` (jacobian contraction): ``vmap`` of ``jacrev``
over single samples, contracted over every parameter. It is the expensive, independent reference
for the jvp-after-vjp measurement in :mod:`affdiv.verify.engine`; use it on small problems only.
The module must treat the samples of a batch independently (true for affine, conv, residual and
per-sequence attention layers; false for BatchNorm in training mode).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from affdiv.verify.engine import as_inputs, parameters_of


def empirical_ntk(module: nn.Module, inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
    """Θ as a tensor of shape (B, B, *out, *out) for a batch of B samples (leading dim of inputs)."""
    args = as_inputs(inputs)
    params = parameters_of(module)

    def single(p: dict[str, Tensor], *sample: Tensor) -> Tensor:
        return functional_call(module, p, tuple(t.unsqueeze(0) for t in sample)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None,) + (0,) * len(args))(params, *args)
    total = None
    for name, j in jac.items():
        out_dims = j.dim() - 1 - params[name].dim()
        flat = j.reshape(j.shape[: 1 + out_dims] + (-1,))  # (B, *out, P_name)
        term = torch.tensordot(flat, flat, dims=([flat.dim() - 1], [flat.dim() - 1]))
        total = term if total is None else total + term
    # tensordot gives (B, *out, B, *out); move the second batch axis next to the first
    return total.movedim(1 + out_dims, 1)


def ntk_update(ntk: Tensor, grad_output: Tensor, lr: float) -> Tensor:
    """−η Σ_j Θ(x_i, x_j) g_j, shaped like grad_output (B, *out)."""
    batch = grad_output.shape[0]
    out_size = grad_output[0].numel()
    theta = ntk.reshape(batch, batch, out_size, out_size).permute(0, 2, 1, 3).reshape(batch * out_size, -1)
    return (-lr * theta @ grad_output.reshape(-1)).reshape(grad_output.shape)

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
from torch.func import jacrev, vmap

from affdiv.verify.functional import ModuleFunction, as_inputs


def empirical_ntk(module: nn.Module, inputs: Tensor | tuple[Tensor, ...]) -> Tensor:
    r"""The empirical NTK of ``module`` over its trainable parameters: :math:`\Theta(x_i, x_j) = J_i J_j^\top`.

    ``vmap(jacrev)`` over single samples, contracted over every parameter; the module is left
    untouched as by :func:`effective_update`. Memory B·out·P: for small problems.

    Args:
        module: the layer or model; it must treat the samples of a batch independently.
        inputs: its positional input(s), batched along the first dimension.

    Shape:
        - inputs: :math:`(B, *)`, the output :math:`(B, *out)`.
        - Output: :math:`(B, B, *out, *out)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import empirical_ntk
        >>> layer = torch.nn.Linear(2, 1, dtype=torch.float64)
        >>> x = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=torch.float64)
        >>> empirical_ntk(layer, x).squeeze()  # x_i·x_j + 1
        tensor([[ 2.,  4.],
                [ 4., 26.]], dtype=torch.float64)
    """
    args = as_inputs(inputs)
    function = ModuleFunction(module, args)
    params = function.params

    def single(p: dict[str, Tensor], *sample: Tensor) -> Tensor:
        return function(p, tuple(t.unsqueeze(0) for t in sample)).squeeze(0)

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
    r"""The first-order update that an NTK predicts: :math:`-\eta \sum_j \Theta(x_i, x_j)\, g_j`.

    Args:
        ntk: Θ, as :func:`empirical_ntk` returns it.
        grad_output: g = ∂L/∂z.
        lr: η.

    Shape:
        - ntk: :math:`(B, B, *out, *out)`; grad_output: :math:`(B, *out)`.
        - Output: :math:`(B, *out)`.

    Example::

        >>> import torch
        >>> from affdiv.verify import ntk_update
        >>> theta = torch.tensor([[2.0, 4.0], [4.0, 26.0]]).reshape(2, 2, 1, 1)
        >>> ntk_update(theta, torch.tensor([[1.0], [0.0]]), lr=0.5)
        tensor([[-1.],
                [-2.]])
    """
    batch = grad_output.shape[0]
    out_size = grad_output[0].numel()
    theta = ntk.reshape(batch, batch, out_size, out_size).permute(0, 2, 1, 3).reshape(batch * out_size, -1)
    return (-lr * theta @ grad_output.reshape(-1)).reshape(grad_output.shape)

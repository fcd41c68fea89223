"""The stacked engine's fused autograd Functions fall back on their formulas in torch operations: a
backward that records a graph (a double backward), carries tangents or batched gradients, or whose
forward could not trust its pass, differentiates the composite instead (:func:`composite_grads`)."""

from __future__ import annotations

import torch
from torch import Tensor


def composite_grads(composite, inputs: tuple[Tensor | None, ...], g: Tensor, needs) -> tuple[Tensor | None, ...]:
    """The gradients of ``composite(*inputs)`` for g, by autograd of its torch operations: a graph
    of them where the caller's backward records one (a double backward), plain ones otherwise."""
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        leaves = [t if t is None or graph else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        wanted = [t for t, need in zip(leaves, needs) if need and t is not None]
        found = iter(torch.autograd.grad(composite(*leaves), wanted, g, create_graph=graph)) if wanted else iter(())
    return tuple(next(found) if need and t is not None else None for t, need in zip(leaves, needs))

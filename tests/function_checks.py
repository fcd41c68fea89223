"""Checks shared by the tests of the stacked engine's fused autograd Functions (stacked_dense,
stacked_attention, stacked_layer_norm): the paths on which a Function runs its torch formulas."""

from __future__ import annotations

import torch


def second_order_paths(function, composite, inputs, g, close) -> None:
    """gradcheck and gradgradcheck of ``function`` at ``inputs`` (float64 leaves; a double backward
    runs the formulas); batched gradients of its output with respect to ``inputs[0]`` against a loop
    over the basis; and the tangent of that gradient for a dual ``g`` (forward over reverse)
    against ``composite``'s. ``close(got, want)`` asserts each agreement."""
    assert torch.autograd.gradcheck(function, inputs)
    assert torch.autograd.gradgradcheck(function, inputs)
    y = function(*inputs)
    basis = torch.eye(y.numel(), dtype=y.dtype).reshape(-1, *y.shape)
    batched, = torch.autograd.grad(y, inputs[0], basis, is_grads_batched=True, retain_graph=True)
    looped = torch.stack([torch.autograd.grad(y, inputs[0], e, retain_graph=True)[0] for e in basis])
    close(batched, looped)

    def tangent_of_grad(fn):
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(g, torch.ones_like(g))
            grad, = torch.autograd.grad(fn(*inputs), inputs[0], dual)
            return torch.autograd.forward_ad.unpack_dual(grad).tangent

    close(tangent_of_grad(function), tangent_of_grad(composite))


def calls_in_a_stacked_step(method: str, digits, function, backward: str, depth: int = 2) -> tuple[int, int]:
    """(how often ``function.apply`` ran, how often ``_fused.<backward>`` ran) in one SGD step of
    two float64 models of ``method`` (width 16, batch 8) on the stacked engine."""
    import unittest.mock

    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.training import build_member, stacked_engine
    from affdiv.layers import _fused

    config = RunConfig(dataset="digits", method=method, depth=depth, width=16, batch_size=8, seed=0, dtype="float64")
    models = [build_member(config, digits, seed) for seed in (0, 1)]
    split = (torch.as_tensor(digits.train.x).double(), torch.as_tensor(digits.train.y))
    engine = stacked_engine(models[0])(models, "sgd", [0.1, 0.2], [None, None], [split] * 2, [split] * 2)
    with unittest.mock.patch.object(function, "apply", wraps=function.apply) as spy, \
            unittest.mock.patch.object(_fused, backward, wraps=getattr(_fused, backward)) as pass_spy:
        engine.step(torch.arange(16).reshape(2, 8))
    return spy.call_count, pass_spy.call_count

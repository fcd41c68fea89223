"""The stacked vision transformer's attention: every (sequence, head) of K models' short sequences
in fused passes that read and write the projections' rows.

For queries, keys and values as the projections give them, rows (K, B·T, H·d_h) (sequence n's
tokens at rows n·T … n·T + T − 1, head h's entries at h·d_h … (h + 1)·d_h − 1 of each), head h
of sequence n is

    y = softmax(q kᵀ/√d_h) v,                                         (T, d_h), softmax row-wise

and for the gradient gy of y, with p the softmax and dp = gy vᵀ,

    ∂v = pᵀ gy,    ds = p ⊙ (dp − rowsum(p ⊙ dp))/√d_h,    ∂q = ds k,    ∂k = dsᵀ q.

Written in torch operations (the model's own formula, :func:`attention_composite`) the heads are
split off by copies ((K·B, H, T, d_h) from the rows, and back for the output projection), and
each product is a batched product of K·B·H matrices of T × d_h (16 × 8 in the harness's vit):
at the vit's B = 64 (48 models) their forward and backward took 28–44 ms in quick measurements,
against about 80 for the whole step. Here the scores are one pass
(``_fused.attention_scores``, each (sequence, head) in cache) and the softmax torch's, or, in
float32 at the harness's sizes (16 tokens, heads of 8), the scores and their softmax are one pass
(``_fused.attention_probabilities``: e^x by its own polynomial, the scores never written); the
weighted values are one pass writing the rows the output projection takes
(``_fused.attention_values``), and the backward is one pass (``_fused.attention_backward``); their
sums run in the order written, so the numbers are the formula's up to the order of summation (and,
on the float32 softmax pass, its own e^x, within (|s − max| + a few) units of float32's roundoff,
and 0 for e^(s − max) under e^−87).

:func:`attention` takes :class:`StackedAttention` where the fused passes may run
(:func:`usable`), else the composite, which torch.func,
forward-mode AD, torch.compile and dispatch modes differentiate or trace; the Function's backward
runs the composite's autograd where it records a graph (a double backward) or the passes may not
run (tangents, batched gradients).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from affdiv.experiments.runs import composite
from affdiv.layers import _fused


def attention(q: Tensor, k: Tensor, v: Tensor, tokens: int, heads: int) -> Tensor:
    """softmax(q_h k_hᵀ/√d_h) v_h for every sequence of ``tokens`` rows and every head h of
    q, k, v (K, B·tokens, heads·d_h): (K, B·tokens, heads·d_h), in the rows' layout (module
    docstring). A shape that does not split so is a ValueError."""
    if q.dim() != 3:
        raise ValueError(f"attention: needs rows (K, B·T, d), got a {q.dim()}-d tensor")
    rows, width = q.shape[1:]
    if tokens < 1 or heads < 1:
        raise ValueError(f"attention: needs at least one token and one head, got {tokens} and {heads}")
    if rows % tokens:
        raise ValueError(f"attention: cannot split {rows} rows into sequences of {tokens} tokens")
    if width % heads:
        raise ValueError(f"attention: cannot split {width} entries per row into {heads} heads")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"attention: needs q, k and v of one shape, got {tuple(q.shape)}, {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if usable(q, k, v):
        return StackedAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), tokens, heads)
    return attention_composite(q, k, v, tokens, heads)


def usable(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :class:`StackedAttention` may take the call: ``_fused.functions_usable``."""
    return _fused.functions_usable(q, k, v)


def attention_composite(q: Tensor, k: Tensor, v: Tensor, tokens: int, heads: int) -> Tensor:
    """:func:`attention` in torch operations, as the model computes it per sequence."""
    models, rows, width = q.shape
    size = width // heads

    def split(t: Tensor) -> Tensor:  # (K·B, H, T, d_h)
        return t.reshape(-1, tokens, heads, size).transpose(1, 2)

    y = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(size), dim=-1) @ split(v)
    return y.transpose(1, 2).reshape(models, rows, width)


class StackedAttention(torch.autograd.Function):
    """:func:`attention` on the fused passes (module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, tokens: int, heads: int) -> Tensor:
        # the passes read dense rows; the inputs themselves are saved (a backward that cannot take
        # the pass differentiates the composite with respect to them)
        rows = [t.contiguous().view(-1, t.shape[2]) for t in (q, k, v)]
        if _fused.attention_probabilities_take(rows[0], rows[1], tokens, heads):
            p = _fused.attention_probabilities(rows[0], rows[1], tokens, heads)
        else:  # (float64, other sizes: the scores, then torch's softmax)
            p = torch.softmax(_fused.attention_scores(rows[0], rows[1], tokens, heads), dim=-1)
        ctx.save_for_backward(q, k, v, p)
        ctx.tokens, ctx.heads = tokens, heads
        return _fused.attention_values(p, rows[2]).view(q.shape)

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        gy = gy.contiguous()
        if not _fused.usable(q, k, v, p, gy):  # a graph recorded, tangents, batched gradients, strided inputs
            grads = composite.composite_grads(
                lambda *qkv: attention_composite(*qkv, ctx.tokens, ctx.heads), (q, k, v), gy,
                ctx.needs_input_grad[:3])
            return *grads, None, None
        grads = _fused.attention_backward(*(t.view(-1, t.shape[2]) for t in (q, k, v)), p, gy.view(-1, gy.shape[2]))
        return *(g.view(q.shape) if need else None for g, need in zip(grads, ctx.needs_input_grad[:3])), None, None

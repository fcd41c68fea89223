"""The stacked vision transformer's attention (``affdiv.experiments.runs.stacked_attention``) against
autograd of the model's formula in torch operations (``attention_composite``, which the engine ran
before).

Tolerance. Both sides evaluate y = softmax(q kᵀ/√d_h) v and its gradients in float64, in other
orders of summation. A score sums d_h products, each side within γ_{d_h}·d_h·|q|·|k|/√d_h of the
exact value (|·| the largest entry), so the two sides' scores differ by at most twice that, δ;
softmax turns a perturbation δ of the scores into one of at most 2δ of each probability, relative
to itself. Every other sum has at most T + d_h terms (γ_{T+d_h} of its terms' magnitudes, on each
side). So each output differs by at most (4δ + 4γ_{T+d_h})·S, S the magnitude of its terms:
S = |v| for y; T·|gy| for ∂v = pᵀ gy; for ∂q = ds k and ∂k = dsᵀ q, T·|ds|·|k| (|q|), with
|ds| ≤ 2·d_h·|gy|·|v|/√d_h. :func:`_bound` computes it, at twice that for margin. A dropped
or misplaced term (the softmax's mean in ds, p transposed, the gradients of q and k exchanged)
moves entries by O(1) of S.
"""

from __future__ import annotations

import math
import unittest.mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from affdiv.experiments.runs import stacked_attention
from affdiv.layers import _fused

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not _fused.available(), reason="the fused passes are not built here")]

U = 2.0 ** -53
#: the float32 softmax pass is built (a compiler with the shuffle builtin)
probabilities_pass = pytest.mark.skipif(not _fused.attention_probabilities_built(),
                                        reason="the library was built without the float32 softmax pass")


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _inputs(k, sequences, tokens, heads, size, seed, dtype=torch.float64, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    shape = (k, sequences * tokens, heads * size)
    q, key, v = (torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3))
    if layout == "strided":  # each a view of every other column of a wider tensor
        q, key, v = (torch.stack([t, torch.zeros_like(t)], 3)[..., 0] for t in (q, key, v))
    return q.requires_grad_(), key.requires_grad_(), v.requires_grad_(), torch.randn(*shape, generator=g, dtype=dtype)


def _bound(q, k, v, gy, tokens, size) -> dict[str, float]:
    """Per output, the largest difference the module docstring allows between two float64
    evaluations."""
    m = {name: float(t.detach().abs().max()) for name, t in (("q", q), ("k", k), ("v", v), ("gy", gy))}
    delta = 2 * _gamma(size) * size * m["q"] * m["k"] / math.sqrt(size)
    rel = 2 * (4 * delta + 4 * _gamma(tokens + size))
    ds = 2 * size * m["gy"] * m["v"] / math.sqrt(size)
    return {"y": rel * m["v"], "v": rel * tokens * m["gy"], "q": rel * tokens * ds * m["k"],
            "k": rel * tokens * ds * m["q"]}


def _value_and_grads(function, q, k, v, gy, tokens, heads):
    y = function(q, k, v, tokens, heads)
    return y, y.grad_fn, torch.autograd.grad(y, (q, k, v), gy)


def _within(got, want, bound):
    assert got.shape == want.shape and got.dtype == want.dtype
    difference = float((got.detach() - want.detach()).abs().max())
    assert difference <= bound, (difference, bound)


def _check(q, k, v, gy, tokens, heads):
    """The Function's value and gradients against the composite's, within :func:`_bound`; the
    backward ran the pass."""
    with unittest.mock.patch.object(_fused, "attention_backward", wraps=_fused.attention_backward) as spy:
        y, node, grads = _value_and_grads(stacked_attention.attention, q, k, v, gy, tokens, heads)
    assert type(node).__name__ == "StackedAttentionBackward" and spy.call_count == 1
    want_y, _, want_grads = _value_and_grads(stacked_attention.attention_composite, q, k, v, gy, tokens, heads)
    bound = _bound(q, k, v, gy, tokens, q.shape[2] // heads)
    _within(y, want_y, bound["y"])
    for name, got, want in zip("qkv", grads, want_grads):
        _within(got, want, bound[name])


@given(k=st.integers(1, 3), sequences=st.integers(1, 4), tokens=st.integers(1, 16), heads=st.integers(1, 4),
       size=st.integers(1, 8), layout=st.sampled_from(["contiguous", "strided"]), seed=st.integers(0, 2**16))
def test_the_function_equals_autograd_of_the_formula(k, sequences, tokens, heads, size, layout, seed):
    q, key, v, gy = _inputs(k, sequences, tokens, heads, size, seed, layout=layout)
    _check(q, key, v, gy, tokens, heads)


def test_the_harness_shapes_and_large_scores():
    # the vit's 16 tokens and 4 heads of 8, and scores of several units (a sharp softmax)
    q, key, v, gy = _inputs(2, 5, 16, 4, 8, 11)
    with torch.no_grad():
        q.mul_(3)
    _check(q, key, v, gy, 16, 4)


@pytest.mark.parametrize("library", ["as built", "generic build"])
def test_float32_is_the_float64_formula_within_float32_rounding(library, request):
    # the same bound at float32's unit roundoff u = 6e-8: 2·(4δ + 4γ_24) with δ = 2·γ_8·8·|q||k|/√8
    # ≈ 6.8e-5 for |q|, |k| < 5: about 5.5e-4·S; 2e-3·S taken (a margin of about 4); also with the
    # library a compiler without the shuffle builtin builds (generic items, torch's softmax)
    if library == "generic build":
        request.getfixturevalue("generic_passes")
    q, key, v, gy = _inputs(3, 4, 16, 4, 8, 5, torch.float32)
    y, _, grads = _value_and_grads(stacked_attention.attention, q, key, v, gy, 16, 4)
    exact = [t.detach().double().requires_grad_() for t in (q, key, v)]
    want_y, _, want_grads = _value_and_grads(stacked_attention.attention_composite, *exact, gy.double(), 16, 4)
    scale = _bound(*exact, gy.double(), 16, 8)
    rel = 2e-3 / (scale["y"] / float(v.detach().abs().max()))  # the float64 bound's S, at 2e-3
    _within(y.double(), want_y, rel * scale["y"])
    for name, got, want in zip("qkv", grads, want_grads):
        _within(got.double(), want, rel * scale[name])


@probabilities_pass
@given(sequences=st.integers(1, 40), heads=st.integers(1, 6), magnitude=st.sampled_from([0.25, 1.0, 4.0, 16.0, 40.0]),
       seed=st.integers(0, 2**16))
def test_the_float32_probabilities_are_the_softmax_within_their_rounding(sequences, heads, magnitude, seed):
    # p of the float32 pass (16 tokens, heads of 8) against the float64 softmax p* of the float64
    # scores of the same float32 q, k (u = 2⁻²⁴). A float32 score s_tu is within δ_tu =
    # γ_10·Σ_j |q_tj k_uj|/√8 of the exact one (8 products, the rounded 1/√8, the scaling); the
    # computed maximum m is one number, which cancels from p_tu = e^(s_tu − m)/Σ_v e^(s_tv − m), so
    # the scores move p_tu by at most δ_tu + max_v δ_tv ≤ 2δ_t (δ_t the row's largest), relative;
    # the rounding of x = s − m, by u·(|x_tu| + max_v |x_tv|) ≤ 4u·S_t (S_t the row's largest |s|);
    # e^x (its polynomial's truncation, 0.13u, Horner's rounding, 2^k exact, ln 2 in two parts: a
    # few u, in numerator and sum), the row's pairwise sum, its reciprocal and the last product, at
    # most about 24u. The bound 2·(2δ_t + 2u·S_t + 24u)·p* holds that with a margin of 2 on the
    # scores' and the u terms and none on the subtraction's, which is at most a tenth of the
    # scores' (δ_t ≥ 10u·S_t); where e^x is under e^−87 (0 there), within 2e-38. The magnitudes
    # take rows from nearly uniform (0.25) to one-hot (40), x down to −87 and beyond.
    g = torch.Generator().manual_seed(seed)
    q, k = (magnitude * torch.randn(sequences * 16, 8 * heads, generator=g) for _ in range(2))
    p = _fused.attention_probabilities(q, k, 16, heads)
    scores = _fused.attention_scores(q.double(), k.double(), 16, heads)
    exact = torch.softmax(scores, dim=-1)
    u = 2.0 ** -24
    delta = 10 * u / (1 - 10 * u) * _fused.attention_scores(q.double().abs(), k.double().abs(), 16, heads)
    relative = 2 * delta.amax(3, keepdim=True) + 2 * u * scores.abs().amax(3, keepdim=True) + 24 * u
    assert p.dtype == torch.float32 and p.shape == exact.shape
    assert ((p.double() - exact).abs() <= 2 * relative * exact + 2e-38).all()
    torch.set_num_threads(2)  # (one (sequence, head) per work item: two threads, the same numbers)
    try:
        assert torch.equal(_fused.attention_probabilities(q, k, 16, heads), p)
    finally:
        torch.set_num_threads(1)


@probabilities_pass
def test_a_nan_score_gives_its_row_nan_as_torchs_softmax_does():
    q, k = torch.randn(2 * 16, 32), torch.randn(2 * 16, 32)
    q[3, 9] = float("nan")  # sequence 0, token 3, head 1: that row's 16 scores
    k[21, 17] = float("nan")  # sequence 1, token 5, head 2: one score in each of its 16 rows
    p = _fused.attention_probabilities(q, k, 16, 4)
    want = torch.softmax(_fused.attention_scores(q, k, 16, 4), dim=-1)
    assert torch.equal(p.isnan(), want.isnan()) and p.isnan().sum() == 16 + 16 * 16
    assert p[0, 1, 3].isnan().all() and p[1, 2].isnan().all()


def test_the_softmax_pass_refuses_other_rows_in_one_line():
    rows = torch.randn(2 * 16, 32)
    for q, k, tokens, heads in [(torch.randn(2 * 8, 32),) * 2 + (8, 4), (torch.randn(2 * 16, 16),) * 2 + (16, 4),
                                (rows.double(), rows.double(), 16, 4), (rows, rows[:16], 16, 4),
                                (rows, rows.t().contiguous().t(), 16, 4), (rows[:24], rows[:24], 16, 4)]:
        assert not _fused.attention_probabilities_take(q, k, tokens, heads)
        with pytest.raises(ValueError, match=r"^attention_probabilities: needs contiguous float32 [^\n]*$"):
            _fused.attention_probabilities(q, k, tokens, heads)
    assert _fused.attention_probabilities_take(rows, rows, 16, 4) == _fused.attention_probabilities_built()


@pytest.mark.parametrize("mutation", ["p transposed", "q and k exchanged"])
def test_a_misplaced_term_fails_the_bound(mutation, monkeypatch):
    q, key, v, gy = _inputs(2, 3, 6, 2, 4, 9)
    if mutation == "p transposed":
        real = _fused.attention_values
        monkeypatch.setattr(_fused, "attention_values", lambda p, v: real(p.transpose(2, 3).contiguous(), v))
    else:
        real = _fused.attention_backward
        monkeypatch.setattr(_fused, "attention_backward", lambda *args: (lambda gq, gk, gv: (gk, gq, gv))(*real(*args)))
    with pytest.raises(AssertionError):
        _check(q, key, v, gy, 6, 2)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("entry", ["attention", "Function"])
def test_second_derivatives_tangents_and_batched_gradients_go_through_the_formula(function_checks, layout, entry):
    # through the module's function (which passes contiguous copies) and the Function itself (which
    # saves its inputs as given), on contiguous and strided inputs
    q, key, v, gy = _inputs(2, 2, 3, 2, 2, 1, layout=layout)

    def close(got, want):  # the same formula on both sides: float64 rounding
        _within(got, want, 1e-12 * max(float(want.abs().max()), 1.0))

    function = stacked_attention.attention if entry == "attention" else stacked_attention.StackedAttention.apply
    function_checks.second_order_paths(lambda *qkv: function(*qkv, 3, 2),
                                       lambda *qkv: stacked_attention.attention_composite(*qkv, 3, 2),
                                       (q, key, v), gy, close)


def test_calls_the_passes_cannot_serve_take_the_torch_operations():
    q, key, v, _ = _inputs(2, 2, 3, 2, 2, 2)
    attention = stacked_attention.attention
    with unittest.mock.patch.object(stacked_attention.StackedAttention, "apply",
                                    wraps=stacked_attention.StackedAttention.apply) as spy:
        attention(q, key, v, 3, 2)
        assert spy.call_count == 1
        with _fused.disabled():
            attention(q, key, v, 3, 2)
        torch.func.vmap(lambda *qkv: attention(*qkv, 3, 2))(q[None], key[None], v[None])
        with FlopCounterMode(display=False) as counter:  # a dispatch mode sees torch's ops
            attention(q, key, v, 3, 2)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(q.detach(), torch.ones_like(q))
            tangent = torch.autograd.forward_ad.unpack_dual(attention(dual, key, v, 3, 2)).tangent
        with torch.autocast("cpu", dtype=torch.bfloat16):
            attention(q.float(), key.float(), v.float(), 3, 2)
        attention(q.half(), key.half(), v.half(), 3, 2)
        assert spy.call_count == 1
    # two products per (sequence, head), 2 models × 2 sequences × 2 heads, of 3×2 by 2×3 and 3×3 by 3×2
    assert counter.get_total_flops() == 2 * 8 * (2 * 3 * 3 * 2)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q.detach(), torch.ones_like(q))
        want = torch.autograd.forward_ad.unpack_dual(stacked_attention.attention_composite(dual, key, v, 3, 2)).tangent
    assert torch.equal(tangent, want)


@pytest.mark.parametrize("shapes, tokens, heads, message", [
    (((6, 4),) * 3, 3, 2, "needs rows"),
    (((1, 6, 4),) * 3, 0, 2, "at least one token and one head"),
    (((1, 6, 4),) * 3, 4, 2, "6 rows into sequences of 4 tokens"),
    (((1, 6, 4),) * 3, 3, 3, "4 entries per row into 3 heads"),
    (((1, 6, 4), (1, 6, 4), (1, 3, 4)), 3, 2, "q, k and v of one shape"),
])
def test_shapes_that_do_not_split_are_refused_in_one_line(shapes, tokens, heads, message):
    with pytest.raises(ValueError, match=message):
        stacked_attention.attention(*(torch.zeros(shape) for shape in shapes), tokens, heads)


def test_two_threads_give_one_threads_numbers():
    # each (sequence, head) is summed by one thread in a fixed order: the team's size changes
    # nothing (sizes above the passes' grain, so that two threads run, each on its scratch)
    q, key, v, gy = _inputs(2, 40, 16, 4, 8, 3, torch.float32)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            results.append(_value_and_grads(stacked_attention.attention, q, key, v, gy, 16, 4))
        finally:
            torch.set_num_threads(1)
    (y1, _, grads1), (y2, _, grads2) = results
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(grads1, grads2))


def test_a_gradient_of_one_input_alone():
    q, key, v, gy = _inputs(1, 2, 4, 2, 3, 4)
    key, v = key.detach(), v.detach()
    y = stacked_attention.attention(q, key, v, 4, 2)
    want = stacked_attention.attention_composite(q, key, v, 4, 2)
    got, = torch.autograd.grad(y, q, gy)
    wanted, = torch.autograd.grad(want, q, gy)
    _within(got, wanted, _bound(q, key, v, gy, 4, 3)["q"])


@pytest.mark.parametrize("method", ["vit", "vit-affine_like-qknorm"])
def test_the_stacked_engine_takes_the_function(digits, method, function_checks):
    calls = function_checks.calls_in_a_stacked_step(method, digits, stacked_attention.StackedAttention,
                                                     "attention_backward")
    assert calls == (2, 2)  # one per block (depth 2), forward and backward

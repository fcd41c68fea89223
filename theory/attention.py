"""Multi-head self-attention, optional output projection and causal mask.

Per head h (d = d_head, c = 1/√d), tokens of the whole batch stacked into N = B·T rows:

    S = c Q Kᵀ,  Q = X W_Q,  K = X W_K,  V = X W_V,   A = softmax(S + mask)   (block-diagonal:
    Y_h = A V,   Z = [Y_1 … Y_H] W_O  (or Z = Y)        a token attends within its own sequence)

One SGD step Δθ = −η ∇θ L, g = ∂L/∂Z, G_Y = g W_Oᵀ split by head, ∂L/∂A = G_Y Vᵀ,
D = ∂L/∂S = J(∂L/∂A) with the row-softmax Jacobian J(U) = A ⊙ (U − rowsum(A ⊙ U)) (symmetric),
Gram matrices Γ_X = X Xᵀ, Γ_Q = Q Qᵀ, Γ_K = K Kᵀ over all N tokens:

    V path   ΔY = −η (A X)(A X)ᵀ G_Y                 the token-Gram kernel, mixed by attention
    Q path   ΔS = −η c² Γ_X D Γ_K                    then ΔY = J(ΔS) V
    K path   ΔS = −η c² Γ_Q D Γ_X
    O path   ΔZ = −η Y Yᵀ g

These are the first-order effective update ΔZ = J_θ Δθ. The real step has O(η²) terms (exact:)

    S2 = c (X ΔW_Q)(X ΔW_K)ᵀ                            the bilinear Q·K term ("quadratic")
    A2 = J(S2) + ½ C(S1),   C(U) = A ⊙ ((U−ū)² − rowsum(A ⊙ (U−ū)²)),  ū = rowsum(A ⊙ U)
    Y2 = A2 V + A1 (X ΔW_V),   Z2 = Y2 W_O + Y1 ΔW_O,    A1 = J(S1), S1 = ΔS_Q + ΔS_K

S is exactly quadratic in θ (S1 + S2 is its whole change); the softmax makes everything else a
Taylor series, so first order + Z2 leaves O(η³).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cache

import sympy as sp
import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp

from affdiv.theory.cases import channels_last_sites, correlated_rows, require, seed_from
from affdiv.theory.derivation import Case, Derivation, Proof, ProofKind, register
from affdiv.theory.exact import ETA, exact_first_order, is_zero, random_rational_matrix, symbolic_identity

PATHS = ("q", "k", "v", "o")


class ReferenceAttention(nn.Module):
    """Plain-torch multi-head self-attention, written per head and per sequence from its definition."""

    def __init__(self, d_model: int, heads: int, d_head: int, d_out: int = 0, causal: bool = False,
                 dtype=torch.float64):
        super().__init__()
        self.heads, self.d_head, self.causal = heads, d_head, causal

        def weight(rows: int, cols: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(rows, cols, dtype=dtype) / math.sqrt(rows))

        self.w_q, self.w_k, self.w_v = (weight(d_model, heads * d_head) for _ in range(3))
        self.w_o = weight(heads * d_head, d_out) if d_out else None

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.w_q.shape[0]:
            raise ValueError(f"expected input (B, T, {self.w_q.shape[0]}), got {tuple(x.shape)}")
        tokens = x.shape[1]
        heads = []
        for h in range(self.heads):
            cols = slice(h * self.d_head, (h + 1) * self.d_head)
            q, k, v = x @ self.w_q[:, cols], x @ self.w_k[:, cols], x @ self.w_v[:, cols]
            s = q @ k.transpose(1, 2) / math.sqrt(self.d_head)
            if self.causal:
                future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
                s = s.masked_fill(future, float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ v)
        y = torch.cat(heads, dim=-1)
        return y @ self.w_o if self.w_o is not None else y


# ---------------------------------------------------------------------------------------------
# closed form, numeric (flattened tokens, block-diagonal attention)


def softmax_jvp(a: Tensor, u: Tensor) -> Tensor:
    """J(U) = A ⊙ (U − rowsum(A ⊙ U)): the row-softmax derivative in direction U (also its vjp)."""
    return a * (u - (a * u).sum(-1, keepdim=True))


def softmax_curvature(a: Tensor, u: Tensor) -> Tensor:
    """C(U) = d²/dt² softmax(S + tU) at t = 0, row-wise: A ⊙ ((U−ū)² − rowsum(A ⊙ (U−ū)²))."""
    c2 = (u - (a * u).sum(-1, keepdim=True)) ** 2
    return a * (c2 - (a * c2).sum(-1, keepdim=True))


@dataclass(frozen=True)
class Parts:
    """The forward pass over the N = B·T tokens: x (N, d_model); q, k, v (H, N, d); a (H, N, N)."""

    x: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    a: Tensor
    w_o: Tensor | None
    scale: float

    def concat(self, per_head: Tensor) -> Tensor:
        """(H, N, d) -> (N, H·d)."""
        return per_head.permute(1, 0, 2).reshape(per_head.shape[1], -1)

    def split(self, rows: Tensor) -> Tensor:
        """(N, H·d) -> (H, N, d)."""
        return rows.reshape(rows.shape[0], self.q.shape[0], -1).permute(1, 0, 2)

    def project(self, per_head: Tensor) -> Tensor:
        """Per-head activation changes to output changes: concatenate, then W_O if present."""
        y = self.concat(per_head)
        return y @ self.w_o if self.w_o is not None else y

    @property
    def y(self) -> Tensor:
        return self.concat(self.a @ self.v)


@torch.no_grad()
def parts(module: ReferenceAttention, x: Tensor) -> Parts:
    batch, tokens, _ = x.shape
    flat = x.reshape(batch * tokens, -1)

    def heads(w: Tensor) -> Tensor:
        return (flat @ w).reshape(batch * tokens, module.heads, module.d_head).permute(1, 0, 2)

    q, k, v = heads(module.w_q), heads(module.w_k), heads(module.w_v)
    sequence = torch.arange(batch).repeat_interleave(tokens)
    position = torch.arange(tokens).repeat(batch)
    allowed = sequence[:, None] == sequence[None, :]
    if module.causal:
        allowed &= position[None, :] <= position[:, None]
    scale = 1 / math.sqrt(module.d_head)
    s = (scale * q @ k.transpose(1, 2)).masked_fill(~allowed, float("-inf"))
    return Parts(flat, q, k, v, torch.softmax(s, dim=-1), module.w_o, scale)


@dataclass(frozen=True)
class FirstOrder:
    """Each path's contribution to ΔZ, (B, T, d_out), and the pieces the second order reuses."""

    paths: dict[str, Tensor]
    s1: Tensor  # ΔS from the Q and K paths (H, N, N)
    x_dw_v: Tensor  # X ΔW_V (H, N, d)
    x_dw_q: Tensor  # X ΔW_Q (H, N, d)
    x_dw_k: Tensor  # X ΔW_K (H, N, d)
    dw_o: Tensor | None  # ΔW_O

    @property
    def total(self) -> Tensor:
        return sum(self.paths.values())


@torch.no_grad()
def first_order(case: Case, g: Tensor, lr: float, paths: Collection[str] = PATHS) -> FirstOrder:
    """J_θ Δθ by path, in the kernel forms of the module docstring."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"paths must be among {PATHS}, got {sorted(unknown)}")
    p = parts(case.module, case.inputs[0])
    rows = g.reshape(p.x.shape[0], -1)
    g_y = p.split(rows @ p.w_o.T if p.w_o is not None else rows)
    d_s = softmax_jvp(p.a, g_y @ p.v.transpose(1, 2))  # ∂L/∂S
    gram_x = p.x @ p.x.T
    x_dw_q = -lr * p.scale * gram_x @ d_s @ p.k
    x_dw_k = -lr * p.scale * gram_x @ d_s.transpose(1, 2) @ p.q
    x_dw_v = -lr * gram_x @ p.a.transpose(1, 2) @ g_y
    s_q = p.scale * x_dw_q @ p.k.transpose(1, 2)  # = −η c² Γ_X D Γ_K
    s_k = p.scale * p.q @ x_dw_k.transpose(1, 2)  # = −η c² Γ_Q D Γ_X
    out = {}
    if "q" in paths:
        out["q"] = p.project(softmax_jvp(p.a, s_q) @ p.v)
    if "k" in paths:
        out["k"] = p.project(softmax_jvp(p.a, s_k) @ p.v)
    if "v" in paths:
        out["v"] = p.project(p.a @ x_dw_v)  # = −η (A X)(A X)ᵀ G_Y
    dw_o = None
    if p.w_o is not None:
        dw_o = -lr * p.y.T @ rows
        if "o" in paths:
            out["o"] = p.y @ dw_o  # = −η Y Yᵀ g
    use = {name: name in paths for name in ("q", "k", "v")}
    return FirstOrder(
        paths={k: v.reshape(g.shape) for k, v in out.items()},
        s1=s_q * use["q"] + s_k * use["k"],
        x_dw_v=x_dw_v * use["v"],
        x_dw_q=x_dw_q * use["q"],
        x_dw_k=x_dw_k * use["k"],
        dw_o=dw_o if "o" in paths else None,
    )


def predict_attention(case: Case, g: Tensor, lr: float, paths: Collection[str] = PATHS) -> Tensor:
    """The first-order effective update, summed over ``paths``."""
    terms = first_order(case, g, lr, paths).paths
    return sum(terms.values()) if terms else torch.zeros_like(g)


@torch.no_grad()
def second_order_terms(case: Case, g: Tensor, lr: float) -> dict[str, Tensor]:
    """The exact O(η²) term of the real step, by source (each (B, T, d_out)):

    qk_bilinear        J(S2) V W_O, S2 = c (X ΔW_Q)(X ΔW_K)ᵀ: Q and K updates multiplied
    softmax_curvature  ½ C(S1) V W_O: the softmax's second derivative along the first-order ΔS
    score_value        J(S1) (X ΔW_V) W_O: the score change times the value change
    output             Y1 ΔW_O: the first-order ΔY times the output-projection change
    """
    p = parts(case.module, case.inputs[0])
    first = first_order(case, g, lr)
    s2 = p.scale * first.x_dw_q @ first.x_dw_k.transpose(1, 2)
    a1 = softmax_jvp(p.a, first.s1)
    terms = {
        "qk_bilinear": p.project(softmax_jvp(p.a, s2) @ p.v),
        "softmax_curvature": p.project(0.5 * softmax_curvature(p.a, first.s1) @ p.v),
        "score_value": p.project(a1 @ first.x_dw_v),
    }
    if first.dw_o is not None:
        y1 = p.concat(a1 @ p.v + p.a @ first.x_dw_v)
        terms["output"] = y1 @ first.dw_o
    return {k: v.reshape(g.shape) for k, v in terms.items()}


def predict_attention_second_order(case: Case, g: Tensor, lr: float) -> Tensor:
    return predict_attention(case, g, lr) + sum(second_order_terms(case, g, lr).values())


@torch.no_grad()
def value_kernel(case: Case) -> Tensor:
    """The V path's token-Gram kernel (A X)(A X)ᵀ per head, (H, N, N) over all N = B·T tokens."""
    p = parts(case.module, case.inputs[0])
    ax = p.a @ p.x
    return ax @ ax.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# proofs


@cache
def value_path_theorem() -> Proof:
    """V path with A fixed: ΔZ = −η (AX)(AX)ᵀ G W_Oᵀ W_O, at general N, d_model, d, d_out."""
    n, m, d, o = sp.symbols("N m d o", integer=True, positive=True)
    A, X = sp.MatrixSymbol("A", n, n), sp.MatrixSymbol("X", n, m)
    Wv, Wo, G = sp.MatrixSymbol("W_V", m, d), sp.MatrixSymbol("W_O", d, o), sp.MatrixSymbol("G", n, o)
    step = -ETA * sp.diff(sp.Trace(G.T * A * X * Wv * Wo), Wv)
    effective = A * X * (Wv + step) * Wo - A * X * Wv * Wo
    closed = -ETA * (A * X) * (A * X).T * G * Wo.T * Wo
    return symbolic_identity(
        "V path (A held at its value, as the path's own parameters do not move it): "
        "ΔZ = −η (AX)(AX)ᵀ G W_Oᵀ W_O exactly (linear in W_V); without W_O drop W_Oᵀ W_O",
        effective - closed,
    )


@cache
def score_theorem() -> Proof:
    """S = c X W_Q W_Kᵀ Xᵀ under the step driven by D = ∂L/∂S: first order + the bilinear term, exactly."""
    n, m, d = sp.symbols("N m d", integer=True, positive=True)
    c = sp.Symbol("c", positive=True)
    X, D = sp.MatrixSymbol("X", n, m), sp.MatrixSymbol("D", n, n)
    Wq, Wk = sp.MatrixSymbol("W_Q", m, d), sp.MatrixSymbol("W_K", m, d)

    def s(q, k):
        return c * X * q * k.T * X.T

    loss = sp.Trace(D.T * s(Wq, Wk))
    dq, dk = -ETA * sp.diff(loss, Wq), -ETA * sp.diff(loss, Wk)
    effective = s(Wq + dq, Wk + dk) - s(Wq, Wk)
    gram_x = X * X.T
    first = -ETA * c**2 * (gram_x * D * X * Wk * Wk.T * X.T + X * Wq * Wq.T * X.T * D * gram_x)
    second = c * (X * dq) * (X * dk).T
    return symbolic_identity(
        "ΔS = −η c² (Γ_X D Γ_K + Γ_Q D Γ_X) + c (X ΔW_Q)(X ΔW_K)ᵀ exactly: the scores are "
        "bilinear in (W_Q, W_K), so the Q·K product is their only O(η²) term",
        effective - first - second,
    )


@cache
def softmax_derivatives_proof(lengths: tuple[int, ...] = (1, 2, 3)) -> Proof:
    """d/dt and d²/dt² of softmax(s + t u) at t = 0 equal J(u) and C(u), for symbolic s, u
    (written with e_i = exp(s_i) > 0, so the identities are between rational functions)."""
    t = sp.Symbol("t")
    for n in lengths:
        e, u = sp.symbols(f"e0:{n}", positive=True), sp.symbols(f"u0:{n}", real=True)
        moved = [ei * sp.exp(t * ui) for ei, ui in zip(e, u)]
        soft = [mi / sum(moved) for mi in moved]
        a = [ei / sum(e) for ei in e]
        mean = sum(ai * ui for ai, ui in zip(a, u))
        var = sum(ai * (ui - mean) ** 2 for ai, ui in zip(a, u))
        for i in range(n):
            d1 = sp.diff(soft[i], t).subs(t, 0) - a[i] * (u[i] - mean)
            d2 = sp.diff(soft[i], t, 2).subs(t, 0) - a[i] * ((u[i] - mean) ** 2 - var)
            if sp.cancel(d1) != 0 or sp.cancel(d2) != 0:
                return Proof("softmax derivatives", ProofKind.EXACT_CONCRETE, False, f"fails at length {n}, entry {i}")
    return Proof(
        claim="row softmax: first derivative J(U) = A ⊙ (U − ū), second C(U) = A ⊙ ((U−ū)² − Σ A (U−ū)²)",
        kind=ProofKind.EXACT_CONCRETE,
        holds=True,
        detail=f"symbolic scores and directions at row lengths {lengths}",
    )


def _exact_softmax_rows(scores: sp.Matrix, causal: bool) -> sp.Matrix:
    return sp.Matrix(
        [
            [e / sum(row) for e in row]
            for row in (
                [sp.exp(scores[i, j]) if (j <= i or not causal) else sp.Integer(0) for j in range(scores.cols)]
                for i in range(scores.rows)
            )
        ]
    )


def _exact_jvp(a: sp.Matrix, u: sp.Matrix) -> sp.Matrix:
    return sp.Matrix(a.rows, a.cols, lambda i, j: a[i, j] * (u[i, j] - sum(a[i, k] * u[i, k] for k in range(a.cols))))


@cache
def exact_first_order_proof(seed: int = 0) -> Proof:
    """J Δθ by exact differentiation of Z = Σ_h softmax(c X W_Q,h W_K,hᵀ Xᵀ) X W_V,h W_O,h equals the
    four-path closed form summed over heads, at small sizes with and without the causal mask, with
    the scale c a free positive symbol (so a c-for-c² slip cannot pass, and the identity holds for
    every c, 1/√d included). Two heads of d = 1 without the mask, one head of d = 2 with it: two
    heads of d = 2 push sympy from ~8 s past 20 s."""
    rng = random.Random(seed)
    c = sp.Symbol("c", positive=True)
    checked = []
    for tokens, causal, heads, d in ((2, False, 2, 1), (3, True, 1, 2)):
        m, out = 2, 1
        x = random_rational_matrix(tokens, m, rng, nonzero=True)
        shapes = {f"{w}{h}": shape for h in range(heads)
                  for w, shape in {"Q": (m, d), "K": (m, d), "V": (m, d), "O": (d, out)}.items()}
        params = {k: random_rational_matrix(*shape, rng) for k, shape in shapes.items()}
        g = random_rational_matrix(tokens, out, rng)

        def forward(p, x=x, causal=causal, heads=heads, tokens=tokens, out=out):  # this case's sizes
            return sum(
                (_exact_softmax_rows(c * x * p[f"Q{h}"] * p[f"K{h}"].T * x.T, causal) * x * p[f"V{h}"] * p[f"O{h}"]
                 for h in range(heads)),
                sp.zeros(tokens, out),
            )

        linear = exact_first_order(forward, params, g, ETA)
        gram = x * x.T
        closed, y = sp.zeros(tokens, out), []
        for h in range(heads):
            q, k, v = (x * params[f"{w}{h}"] for w in "QKV")
            w_o = params[f"O{h}"]
            a = _exact_softmax_rows(c * q * k.T, causal)
            g_y = g * w_o.T
            d_s = _exact_jvp(a, g_y * v.T)
            s1 = -ETA * c**2 * (gram * d_s * k * k.T + q * q.T * d_s * gram)
            closed += (_exact_jvp(a, s1) * v - ETA * (a * x) * (a * x).T * g_y) * w_o
            y.append(a * v)
        y = sp.Matrix.hstack(*y)
        closed -= ETA * y * y.T * g
        if not is_zero(linear - closed):
            return Proof("attention first order", ProofKind.EXACT_CONCRETE, False,
                         f"differs at T={tokens}, causal={causal}")
        checked.append(f"(T={tokens}, d_model={m}, heads={heads}, d={d}, d_out={out}, causal={causal})")
    return Proof(
        claim="first order: ΔZ = Σ_h [J(S1) V W_O − η (AX)(AX)ᵀ G_Y W_O]_h − η Y Yᵀ g with S1 = −η c² (Γ_X D Γ_K + "
        "Γ_Q D Γ_X), D = J(G_Y Vᵀ) per head: the Q, K, V and O paths, nothing else",
        kind=ProofKind.EXACT_CONCRETE,
        holds=True,
        detail="exact differentiation (rationals and exponentials, c a free symbol) at " + ", ".join(checked),
    )


# the case of the second-order step: two heads, W_O and the causal mask, so all four η² sources appear
_SECOND_ORDER_SIZES = {"batch": 2, "tokens": 3, "d_model": 3, "heads": 2, "d_head": 2, "d_out": 2, "causal": 1}
# Z2 and ½ d²/dt² Z(θ + tΔθ) both sum O(10²) products of O(1) terms in different orders (≈ 1e-14
# relative); 1e-10, the checks' TOL, leaves room for cancellation and still exposes any wrong term.
_SECOND_ORDER_TOL = 1e-10


@cache
def second_order_step(seed: int = 0) -> Proof:
    """Z2 (second_order_terms) equals the η² Taylor coefficient ½ d²/dt² Z(θ + tΔθ)|₀, measured by
    forward-over-forward AD on one float64 case: a numerical check, independent of the closed form."""
    generator = torch.Generator().manual_seed(seed)
    case = build_case(_SECOND_ORDER_SIZES, generator)
    module, inputs = case.module, case.inputs
    params = {name: p.detach() for name, p in module.named_parameters()}

    def f(p):
        return functional_call(module, p, inputs)

    output, pullback = vjp(f, params)
    g = torch.randn(output.shape, dtype=output.dtype, generator=generator)
    lr = 0.1
    (grad,) = pullback(g)
    step = {k: -lr * v for k, v in grad.items()}
    _, curvature = jvp(lambda p: jvp(f, (p,), (step,))[1], (params,), (step,))
    measured = 0.5 * curvature
    predicted = sum(second_order_terms(case, g, lr).values())
    err = float((predicted - measured).abs().max() / measured.abs().max())
    return Proof(
        claim="second order: Z2 = (J(S2) + ½ C(S1)) V W_O + J(S1) X ΔW_V W_O + Y1 ΔW_O (Taylor coefficient of η²)",
        kind=ProofKind.NUMERIC_ONLY,
        holds=err <= _SECOND_ORDER_TOL,
        detail=f"assembled from the pieces above by the product rule; vs ½ d²/dt² Z(θ + tΔθ) by nested forward-mode "
        f"AD at {_SECOND_ORDER_SIZES}, seed {seed}, η = {lr}: rel. error {err:.1e} "
        f"(tolerance {_SECOND_ORDER_TOL:.0e}); "
        "the Taylor check then requires the remainder after Z2 to fall as η³",
    )


def _proofs() -> tuple[Proof, ...]:
    return (
        value_path_theorem(), score_theorem(), softmax_derivatives_proof(), exact_first_order_proof(),
        second_order_step(),
    )


# ---------------------------------------------------------------------------------------------
# registration

SIZES = (
    {"batch": 1, "tokens": 4, "d_model": 3, "heads": 1, "d_head": 2, "d_out": 0, "causal": 0},
    {"batch": 2, "tokens": 5, "d_model": 4, "heads": 2, "d_head": 3, "d_out": 4, "causal": 0},
    {"batch": 2, "tokens": 4, "d_model": 4, "heads": 2, "d_head": 2, "d_out": 3, "causal": 1},
    {"batch": 3, "tokens": 3, "d_model": 2, "heads": 1, "d_head": 2, "d_out": 0, "causal": 1},
)


def build_case(sizes: Mapping[str, int], generator: torch.Generator) -> Case:
    require(sizes, "batch", "tokens", "d_model", "heads", "d_head")
    torch.manual_seed(seed_from(generator))
    module = ReferenceAttention(
        sizes["d_model"], sizes["heads"], sizes["d_head"], sizes.get("d_out", 0), bool(sizes.get("causal", 0))
    )
    # amplitude 0.5: keeps η = 0.1, the top of the Taylor check's window, in the asymptotic regime
    # (fitted first-order slopes 1.99-2.00 over ten seeds; at amplitude 1 they reach 1.82)
    x = 0.5 * correlated_rows((sizes["batch"], sizes["tokens"], sizes["d_model"]), generator, spread=0.5)
    return Case(module, (x,))


DERIVATION = register(
    Derivation(
        name="attention",
        layer=r"Z = \mathrm{softmax}(X W_Q (X W_K)^\top/\sqrt{d} + \text{mask})\, X W_V\, W_O, per head",
        statement=r"\Delta Z = \underbrace{J(-\eta c^2 \Gamma_X D \Gamma_K) V W_O}_{Q}"
        r" + \underbrace{J(-\eta c^2 \Gamma_Q D \Gamma_X) V W_O}_{K}"
        r" - \eta\,\underbrace{(AX)(AX)^\top G_Y W_O}_{V} - \eta\,\underbrace{Y Y^\top g}_{O} + Z_2 + O(\eta^3)",
        build=build_case,
        predict=predict_attention,
        proofs=_proofs,
        sizes=SIZES,
        linear_in_params=False,
        predict_second_order=predict_attention_second_order,
        tags=("attention",),
        sites=channels_last_sites,
    )
)

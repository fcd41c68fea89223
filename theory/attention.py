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

Proof at general size (N tokens, d_model, d, d_out symbolic; every step checked by sympy):
``value_path_theorem`` and ``score_theorem`` (matrix calculus); ``softmax_row_theorem`` (J, C and
J's self-adjointness at symbolic row length T, in index form); ``first_order_assembly`` and
``second_order_assembly`` (matrix calculus, A any attention matrix). Two steps rest on arguments
in words, with the concrete checks beside them: (1) any number of heads: head h's parameters
enter only Y_h W_O,h, so ⟨g, dZ⟩ is a sum of per-head terms and the assemblies, run with two
heads, show no cross-head term; (2) the mask: a masked key has A = 0 for every θ, and the row
softmax over the allowed keys is the theorem's row (J and C carry the factor A, so they vanish
there too). The exact first order at concrete sizes (``exact_first_order_proof``) and the η²
coefficient against nested forward-mode AD (``second_order_step``) corroborate.
"""

from __future__ import annotations

import dataclasses
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
from affdiv.theory.exact import (
    ETA,
    exact_first_order,
    is_zero,
    linear_sums,
    random_rational_matrix,
    sums_as_atoms,
    symbolic_identity,
)

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


@dataclass(frozen=True)
class SoftmaxRow:
    """One row of the row softmax at general length T, in index form: scores s, directions u, w,

        a_k(t) = exp(s_k + t u_k + t² w_k) / Σ_{l<T} exp(s_l + t u_l + t² w_l),

    the row's allowed keys only (under a mask the others have a_k ≡ 0, and J, C carry the factor
    a_k, so they vanish there too)."""

    @property
    def length(self) -> sp.Symbol:
        return sp.Symbol("T", integer=True, positive=True)

    def _index(self, name: str) -> sp.Symbol:
        return sp.Symbol(name, integer=True, nonnegative=True)

    def row_sum(self, f) -> sp.Expr:
        """Σ_{l<T} f(l)."""
        key = self._index("l")
        return sp.Sum(f(key), (key, 0, self.length - 1))

    def array(self, name: str) -> sp.IndexedBase:
        return sp.IndexedBase(name, real=True)

    def a(self, k) -> sp.Expr:
        s = self.array("s")
        return sp.exp(s[k]) / self.row_sum(lambda j: sp.exp(s[j]))

    def moved(self, k, t) -> sp.Expr:
        s, u, w = (self.array(n) for n in "suw")
        shifted = lambda i: sp.exp(s[i] + t * u[i] + t**2 * w[i])  # noqa: E731
        return shifted(k) / self.row_sum(shifted)

    def jvp(self, k, direction) -> sp.Expr:
        """J(U)_k = a_k (U_k − Σ_l a_l U_l)."""
        return self.a(k) * (direction(k) - self.row_sum(lambda j: self.a(j) * direction(j)))

    def curvature(self, k, direction) -> sp.Expr:
        """C(U)_k = a_k ((U_k − ū)² − Σ_l a_l (U_l − ū)²), ū = Σ_l a_l U_l."""
        mean = self.row_sum(lambda j: self.a(j) * direction(j))
        return self.a(k) * ((direction(k) - mean) ** 2 - self.row_sum(lambda j: self.a(j) * (direction(j) - mean) ** 2))


def _row_identity(residual: sp.Expr) -> bool:
    """``residual`` (finite sums over one row) vanishes as a rational function of its sums."""
    return is_zero(sp.Matrix([sums_as_atoms(linear_sums(residual))]))


@cache
def softmax_row_theorem(jvp=SoftmaxRow.jvp, curvature=SoftmaxRow.curvature) -> Proof:
    """At general row length T: d/dt a(t)|₀ = J(u), d²/dt² a(t)|₀ = 2 J(w) + C(u), and J is
    self-adjoint, Σ_k g_k J(u)_k = Σ_k J(g)_k u_k. ``jvp``, ``curvature`` are parameters so that a
    planted-wrong one can be shown to fail."""
    row = SoftmaxRow()
    t, k = sp.Symbol("t", real=True), row._index("k")
    u, w, g = (row.array(n) for n in "uwg")
    first = sp.diff(row.moved(k, t), t).subs(t, 0) - jvp(row, k, lambda i: u[i])
    second = sp.diff(row.moved(k, t), t, 2).subs(t, 0) - 2 * jvp(row, k, lambda i: w[i]) - curvature(
        row, k, lambda i: u[i]
    )
    symmetric = row.row_sum(lambda j: g[j] * jvp(row, j, lambda i: u[i])) - row.row_sum(
        lambda j: jvp(row, j, lambda i: g[i]) * u[j]
    )
    holds = {name: _row_identity(r) for name, r in (("first", first), ("second", second), ("adjoint", symmetric))}
    return Proof(
        claim="row softmax at general row length T (any mask: the allowed keys of the row): along s + tu + t²w "
        "its first derivative is J(u) = A ⊙ (u − ū), its second 2 J(w) + C(u), C(u) = A ⊙ ((u−ū)² − Σ A (u−ū)²); "
        "and J is self-adjoint, ⟨G, J(U)⟩ = ⟨J(G), U⟩ (row by row)",
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=all(holds.values()),
        detail="index form with symbolic T; sums distributed, then each distinct sum an independent symbol and "
        "the residuals cancelled as rational functions: " + ", ".join(f"{n} {'0' if ok else '≠ 0'}"
                                                                      for n, ok in holds.items()),
    )


@dataclass(frozen=True)
class AttentionCalculus:
    """Two heads h of multi-head attention at general sizes (N tokens of the batch, d_model m, d_head
    d, d_out o), scale c, A_h any (row-softmax) attention matrix, mask included:

        S_h = c X W_Q,h W_K,hᵀ Xᵀ,  Y_h = A_h X W_V,h,  Z = Σ_h Y_h W_O,h,   G_Y,h = g W_O,hᵀ.

    D_h stands for J_h(G_Y,h V_hᵀ) and A1_h, A2_h for the first and second Taylor coefficients of
    A_h(θ + tΔθ) (their forms in J and C are ``softmax_row_theorem`` applied to S's expansion,
    ``score_theorem``)."""

    heads: tuple[str, ...] = ("1", "2")

    @property
    def sizes(self):
        return sp.symbols("N m d o", integer=True, positive=True)

    @property
    def scale(self) -> sp.Symbol:
        return sp.Symbol("c", positive=True)

    def _m(self, name: str, rows, cols) -> sp.MatrixSymbol:
        return sp.MatrixSymbol(name, rows, cols)

    @property
    def x(self) -> sp.MatrixSymbol:
        n, m, _, _ = self.sizes
        return self._m("X", n, m)

    @property
    def grad(self) -> sp.MatrixSymbol:
        n, _, _, o = self.sizes
        return self._m("g", n, o)

    def params(self, h: str) -> dict[str, sp.MatrixSymbol]:
        _, m, d, o = self.sizes
        return {f"W_{w}{h}": self._m(f"W_{w}{h}", m, d) for w in "QKV"} | {f"W_O{h}": self._m(f"W_O{h}", d, o)}

    def head(self, h: str) -> dict:
        """Head h's symbols: A, D (N×N), A1, A2 (N×N), and its weights by letter."""
        n = self.sizes[0]
        weights = {name[2]: p for name, p in self.params(h).items()}
        return weights | {name: self._m(f"{name}_{h}", n, n) for name in ("A", "D", "A1", "A2")}

    def scores_differential(self, h: str, d_q, d_k) -> sp.MatrixExpr:
        """dS_h = c X (dW_Q W_Kᵀ + W_Q dW_Kᵀ) Xᵀ."""
        p, x = self.head(h), self.x
        return self.scale * x * (d_q * p["K"].T + p["Q"] * d_k.T) * x.T

    def loss_differential(self, direction: Mapping[str, sp.MatrixExpr]) -> list[sp.MatrixExpr]:
        """The terms of ⟨g, dZ(dθ)⟩, with ⟨G_Y Vᵀ, J(dS)⟩ written ⟨J(G_Y Vᵀ), dS⟩ = ⟨D, dS⟩ (J self-adjoint)."""
        total = []
        for h in self.heads:
            p = self.head(h)
            ds = self.scores_differential(h, direction[f"W_Q{h}"], direction[f"W_K{h}"])
            total += [
                sp.Trace(p["D"].T * ds),
                sp.Trace((self.grad * p["O"].T).T * p["A"] * self.x * direction[f"W_V{h}"]),
                sp.Trace(self.grad.T * p["A"] * self.x * p["V"] * direction[f"W_O{h}"]),
            ]
        return total

    def first_order(self) -> tuple[list, sp.MatrixExpr]:
        """([S1_h] per head, the V and O paths' ΔZ): the closed forms of the module docstring."""
        x, g, c = self.x, self.grad, self.scale
        scores, rest = [], []
        for h in self.heads:
            p = self.head(h)
            q, k, ax = x * p["Q"], x * p["K"], p["A"] * x
            scores.append(-ETA * c**2 * (x * x.T * p["D"] * k * k.T + q * q.T * p["D"] * x * x.T))
            y = ax * p["V"]
            rest += [-ETA * ax * ax.T * g * p["O"].T * p["O"], -ETA * y * y.T * g]
        return scores, sp.Add(*rest)

    def second_order(self, step: Mapping[str, sp.MatrixExpr]) -> sp.MatrixExpr:
        """Z2 = Σ_h [A2 V W_O + A1 X ΔW_V W_O + Y1 ΔW_O]_h, Y1 = A1 V + A X ΔW_V."""
        x, terms = self.x, []
        for h in self.heads:
            p = self.head(h)
            dv, do = step[f"W_V{h}"], step[f"W_O{h}"]
            y1 = p["A1"] * x * p["V"] + p["A"] * x * dv
            terms += [p["A2"] * x * p["V"] * p["O"], p["A1"] * x * dv * p["O"], y1 * do]
        return sp.Add(*terms)


@cache
def first_order_assembly(closed_form=AttentionCalculus.first_order) -> Proof:
    """Δθ = −η ∇θ⟨g, Z⟩ from the loss differential, then ΔS_h = S1_h per head and the V and O paths'
    ΔZ, at general sizes with two heads; ``closed_form`` is a parameter for planted-wrong twins."""
    calc = AttentionCalculus()
    params = {name: p for h in calc.heads for name, p in calc.params(h).items()}
    directions = {name: sp.MatrixSymbol(f"d{name}", *p.shape) for name, p in params.items()}
    # ∂/∂θ term by term: sympy 1.14 returns 0 for the derivative of a sum of such traces.
    loss = calc.loss_differential(directions)
    step = {name: -ETA * sp.Add(*[sp.diff(term, d) for term in loss]) for name, d in directions.items()}
    scores, rest = closed_form(calc)
    residuals = [calc.scores_differential(h, step[f"W_Q{h}"], step[f"W_K{h}"]) - s for h, s in zip(calc.heads, scores)]
    x = calc.x
    moved = sp.Add(*[calc.head(h)["A"] * x * step[f"W_V{h}"] * calc.head(h)["O"]
                     + calc.head(h)["A"] * x * calc.head(h)["V"] * step[f"W_O{h}"] for h in calc.heads])
    residuals.append(moved - rest)
    holds = [is_zero(r) for r in residuals]
    return Proof(
        claim="first-order assembly at general N (tokens of the batch), d_model, d_head, d_out, any attention "
        "matrix A (mask included): dZ = Σ_h [J(dS_h) V_h + A_h X dW_V,h] W_O,h + Y_h dW_O,h; with ⟨G_Y Vᵀ, J(dS)⟩ "
        "= ⟨D, dS⟩ (J self-adjoint, D = J(G_Y Vᵀ)) the step gives ΔS_h = S1_h = −η c² (Γ_X D Γ_K + Γ_Q D Γ_X)_h "
        "(so the Q and K paths are J(S1_h) V_h W_O,h) and the V and O paths −η Σ_h (AX)(AX)ᵀ G_Y W_O − η Y Yᵀ g; "
        "shown with two heads: no cross-head term, so it holds for any number of heads",
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=all(holds),
        detail="sympy matrix calculus: ΔS_1 − S1_1, ΔS_2 − S1_2 and the V, O paths' residual expand to "
        + ", ".join("0" if ok else "≠ 0" for ok in holds),
    )


def _taylor_coefficient(expr: sp.MatrixExpr, t: sp.Symbol, order: int) -> sp.MatrixExpr:
    """The coefficient of t^order in a matrix polynomial in the scalar t (expanded term by term)."""
    terms = []
    for term in sp.Add.make_args(sp.expand(expr.doit())):
        coeff, matrices = term.as_coeff_mmul()
        if sp.degree(coeff, t) == order:
            terms.append(coeff / t**order * matrices)
    return sp.Add(*terms) if terms else sp.ZeroMatrix(*expr.shape)


@cache
def second_order_assembly(closed_form=AttentionCalculus.second_order) -> Proof:
    """½ d²/dt² of Z(θ + tΔθ) at t = 0, with A_h(t) = A_h + t A1_h + t² A2_h + O(t³), is Z2."""
    calc = AttentionCalculus()
    t = sp.Symbol("t", real=True)
    step = {name: sp.MatrixSymbol(f"Delta{name}", *p.shape) for h in calc.heads for name, p in calc.params(h).items()}
    moved = []
    for h in calc.heads:
        p = calc.head(h)
        attention = p["A"] + t * p["A1"] + t**2 * p["A2"]
        moved.append(attention * calc.x * (p["V"] + t * step[f"W_V{h}"]) * (p["O"] + t * step[f"W_O{h}"]))
    coefficient = _taylor_coefficient(sp.Add(*moved), t, 2)
    holds = is_zero(coefficient - closed_form(calc, step))
    return Proof(
        claim="second-order assembly at general sizes, any A and mask: S is exactly S + t S1 + t² S2 (score theorem), "
        "so A(t) = A + t J(S1) + t² (J(S2) + ½ C(S1)) + O(t³) (row-softmax theorem), and the η² coefficient of "
        "Z(θ + tΔθ) is Z2 = (J(S2) + ½ C(S1)) V W_O + J(S1) X ΔW_V W_O + Y1 ΔW_O, Y1 = J(S1) V + A X ΔW_V "
        "(any ΔW_V, ΔW_O)",
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=bool(holds),
        detail="sympy matrix calculus, two heads: the t² coefficient of Z(t), less Z2, expands to "
        + ("0" if holds else "≠ 0"),
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
    """The general-size chain (V path, scores, row softmax, the two assemblies), then the exact first
    order at concrete sizes and the η² coefficient against nested AD, as corroboration."""
    corroboration = (exact_first_order_proof(), second_order_step())
    return (
        value_path_theorem(), score_theorem(), softmax_row_theorem(), first_order_assembly(),
        second_order_assembly(), *(dataclasses.replace(p, corroborates=True) for p in corroboration),
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

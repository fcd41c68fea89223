"""The affine family: z = α(s) (W c(s) x + β b),  s = ‖x‖²,  m = dim x.

Every member is linear in θ = (W, b); α, c, β depend on the input only:

    affine       α = 1,            c = 1,        β = 1     z = W x + b
    norm_l2      α = 1,            c = 1/√s,     β = 1     z = W x/‖x‖ + b
    norm_rms     α = 1,            c = √(m/s),   β = 1     z = W x √m/‖x‖ + b
    affine_like  α = 1/√(s + 1),   c = 1,        β = 1     z = (W x + b)/√(‖x‖² + 1)

Family theorem (proven with sympy matrix calculus at general n, m):

    Δz_i = −η Σ_j K_ij g_j,   K_ij = α_i α_j (c_i c_j x_i·x_j + β_i β_j),

exactly (no O(η²) term). With the loss reduction ``mean`` over B samples g_j = (1/B) ∂ℓ_j/∂z_j,
so the per-sample-loss form is Δz_i = −(η/B) Σ_j K_ij ∂ℓ_j/∂z_j; with ``sum`` there is no 1/B.
The diagonal K_ii is the per-sample factor: ‖x‖²+1, 2, m+1 and 1 for the four members.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache

import sympy as sp
import torch
from torch import Tensor, nn

from affdiv.theory.cases import correlated_rows, seed_from
from affdiv.theory.derivation import Case, Derivation, Proof, ProofKind, register
from affdiv.theory.exact import ETA, exact_effective_update, is_zero, random_rational_matrix, symbolic_identity

# Scalar symbols of the closed form: d = x_i·x_j, s_i = ‖x_i‖², s_j = ‖x_j‖², m = dim x.
D, S_I, S_J = sp.symbols("d s_i s_j", positive=True)
M = sp.Symbol("m", integer=True, positive=True)
S = sp.Symbol("s", positive=True)


@dataclass(frozen=True)
class Member:
    """One member of the family, by its input-dependent factors (functions of s and m)."""

    name: str
    formula: str
    alpha: sp.Expr
    c: sp.Expr
    beta: sp.Expr
    expected_diagonal: sp.Expr  # what the paper / our notes say K_ii should be

    def factors(self, s: sp.Expr, m: sp.Expr = M) -> tuple[sp.Expr, sp.Expr, sp.Expr]:
        return tuple(f.subs({S: s, M: m}) for f in (self.alpha, self.c, self.beta))

    @property
    def kernel(self) -> sp.Expr:
        """K(d, s_i, s_j) from the family theorem."""
        a_i, c_i, b_i = self.factors(S_I)
        a_j, c_j, b_j = self.factors(S_J)
        return sp.simplify(a_i * a_j * (c_i * c_j * D + b_i * b_j))

    @property
    def diagonal_factor(self) -> sp.Expr:
        """K_ii: the kernel at d = s_i = s_j = s."""
        return sp.simplify(self.kernel.subs({D: S, S_I: S, S_J: S}))


MEMBERS = (
    Member("affine", "z = W x + b", sp.Integer(1), sp.Integer(1), sp.Integer(1), S + 1),
    Member("norm_l2", r"z = W \frac{x}{\|x\|} + b", sp.Integer(1), 1 / sp.sqrt(S), sp.Integer(1), sp.Integer(2)),
    Member(
        "norm_rms", r"z = W \frac{x \sqrt{m}}{\|x\|} + b", sp.Integer(1), sp.sqrt(M / S), sp.Integer(1), M + 1
    ),
    Member(
        "affine_like", r"z = \frac{W x + b}{\sqrt{\|x\|^2 + 1}}", 1 / sp.sqrt(S + 1), sp.Integer(1), sp.Integer(1),
        sp.Integer(1),
    ),
)


def member(name: str) -> Member:
    """The member called ``name``."""
    for m in MEMBERS:
        if m.name == name:
            return m
    raise ValueError(f"member must be one of {[m.name for m in MEMBERS]}, got {name!r}")


# ---------------------------------------------------------------------------------------------
# proofs


@cache
def family_theorem() -> Proof:
    """Δz_i from sample j's gradient is −η α_i α_j (c_i c_j x_jᵀx_i + β_i β_j) g_j, at general n, m."""
    n, m = sp.symbols("n m", integer=True, positive=True)
    W, b = sp.MatrixSymbol("W", n, m), sp.MatrixSymbol("b", n, 1)
    x_i, x_j = sp.MatrixSymbol("x_i", m, 1), sp.MatrixSymbol("x_j", m, 1)
    g_j = sp.MatrixSymbol("g_j", n, 1)
    a_i, a_j, c_i, c_j, b_i, b_j = sp.symbols("alpha_i alpha_j c_i c_j beta_i beta_j")

    def z(weight, bias, x, a, c, beta):
        return a * (weight * (c * x) + beta * bias)

    loss = sp.Trace(g_j.T * z(W, b, x_j, a_j, c_j, b_j))  # the part of L that sample j contributes
    d_w, d_b = -ETA * sp.diff(loss, W), -ETA * sp.diff(loss, b)
    effective = z(W + d_w, b + d_b, x_i, a_i, c_i, b_i) - z(W, b, x_i, a_i, c_i, b_i)
    closed = -ETA * a_i * a_j * (c_i * c_j * g_j * (x_j.T * x_i) + b_i * b_j * g_j)
    return symbolic_identity(
        "z(θ−η∇θ(g_jᵀz_j)) − z(θ) at x_i equals −η α_i α_j (c_i c_j x_i·x_j + β_i β_j) g_j, "
        "for any n×m W, any α, c, β independent of θ; summing over j (∇ is linear) gives the batch",
        effective - closed,
    )


def _diagonal_proof(member: Member) -> Proof:
    got = member.diagonal_factor
    holds = sp.simplify(got - member.expected_diagonal) == 0
    return Proof(
        claim=f"K_ii = {sp.sstr(member.expected_diagonal)} for {member.name}",
        kind=ProofKind.SYMBOLIC_GENERAL,
        holds=bool(holds),
        detail=f"K(s, s, s) simplifies to {sp.sstr(got)}",
    )


def _exact_forward(member: Member, inputs: sp.Matrix):
    """The layer on a batch of exact inputs (rows), as a sympy function of (W, b)."""
    m = inputs.cols
    scales = []
    for row in range(inputs.rows):
        s = sum(v**2 for v in inputs.row(row))
        scales.append(member.factors(s, sp.Integer(m)))

    def forward(params: Mapping[str, sp.Matrix]) -> sp.Matrix:
        W, b = params["W"], params["b"]
        rows = [
            (a * (W * (c * inputs.row(r).T) + beta * b)).T for r, (a, c, beta) in enumerate(scales)
        ]
        return sp.Matrix.vstack(*rows)

    return forward


def exact_kernel_matrix(member: Member, inputs: sp.Matrix) -> sp.Matrix:
    """K evaluated exactly on rows of ``inputs`` (the closed form, not the layer)."""
    m = inputs.cols
    sq = [sum(v**2 for v in inputs.row(r)) for r in range(inputs.rows)]
    return sp.Matrix(
        inputs.rows,
        inputs.rows,
        lambda i, j: member.kernel.subs(
            {D: (inputs.row(i) * inputs.row(j).T)[0], S_I: sq[i], S_J: sq[j], M: m}
        ),
    )


def _concrete_proof(member: Member, sizes=((1, 2, 2), (2, 2, 3), (3, 3, 2)), seed: int = 0) -> Proof:
    rng = random.Random(seed)
    checked = []
    for batch, m, n in sizes:
        inputs = random_rational_matrix(batch, m, rng, nonzero=True)
        params = {"W": random_rational_matrix(n, m, rng), "b": random_rational_matrix(n, 1, rng)}
        grad = random_rational_matrix(batch, n, rng)
        exact = exact_effective_update(_exact_forward(member, inputs), params, grad)
        predicted = -ETA * exact_kernel_matrix(member, inputs) * grad
        if not (is_zero(exact.finite - predicted) and is_zero(exact.linear - predicted)):
            return Proof(
                claim=f"closed form = real step for {member.name}",
                kind=ProofKind.EXACT_CONCRETE,
                holds=False,
                detail=f"differs at B={batch}, m={m}, n={n}",
            )
        checked.append(f"(B={batch}, m={m}, n={n})")
    return Proof(
        claim=f"−η K G equals the real step z(θ+Δθ) − z(θ) and J Δθ for {member.name}, "
        "as an identity in η (so no O(η²) term)",
        kind=ProofKind.EXACT_CONCRETE,
        holds=True,
        detail="exact rational/algebraic arithmetic at " + ", ".join(checked),
        corroborates=True,
    )


# ---------------------------------------------------------------------------------------------
# numeric side: reference layers, evaluators


class ReferenceAffineFamily(nn.Module):
    """Plain-torch reference implementation of a member, written from its definition."""

    def __init__(self, member: str, in_features: int, out_features: int, dtype=torch.float64):
        super().__init__()
        self.member = member
        self.linear = nn.Linear(in_features, out_features, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        if self.member == "affine":
            return self.linear(x)
        if self.member == "norm_l2":
            return self.linear(x / norm)
        if self.member == "norm_rms":
            return self.linear(x * x.shape[-1] ** 0.5 / norm)
        if self.member == "affine_like":
            return self.linear(x) / torch.sqrt(norm**2 + 1)
        raise ValueError(f"unknown member {self.member!r}")


def sample_inputs(batch: int, features: int, generator: torch.Generator) -> Tensor:
    """Correlated inputs with per-sample norms spread over two decades (so K_ii varies)."""
    return correlated_rows((batch, features), generator, spread=2.3)


def _torch_lambdify(expr: sp.Expr):
    return sp.lambdify((D, S_I, S_J, M), expr, modules=[{"sqrt": torch.sqrt}, "math"])


def kernel_matrix(member: Member, x: Tensor) -> Tensor:
    """K_ij for the rows of x (…, m) flattened to (B, m), evaluated from the derived closed form."""
    flat = x.reshape(-1, x.shape[-1])
    sq = (flat * flat).sum(-1)
    values = _torch_lambdify(member.kernel)(flat @ flat.T, sq[:, None], sq[None, :], flat.shape[-1])
    return torch.as_tensor(values, dtype=flat.dtype).expand(flat.shape[0], flat.shape[0])


def predict_update(member: Member, x: Tensor, grad_output: Tensor, lr: float) -> Tensor:
    """Δz = −η K G, shaped like the layer output."""
    kernel = kernel_matrix(member, x)
    g = grad_output.reshape(kernel.shape[0], -1)
    return (-lr * kernel @ g).reshape(grad_output.shape)


def diagonal_factor(member: Member, x: Tensor) -> Tensor:
    """K_ii per sample, from the simplified diagonal of the closed form."""
    flat = x.reshape(-1, x.shape[-1])
    sq = (flat * flat).sum(-1)
    fn = sp.lambdify((S, M), member.diagonal_factor, modules=[{"sqrt": torch.sqrt}, "math"])
    return torch.as_tensor(fn(sq, flat.shape[-1]), dtype=flat.dtype).expand(flat.shape[0])


SIZES = (
    {"batch": 1, "in_features": 5, "out_features": 3},
    {"batch": 8, "in_features": 16, "out_features": 4},
    {"batch": 32, "in_features": 64, "out_features": 10},
    {"batch": 3, "in_features": 1, "out_features": 1},
)


def make_derivation(member: Member) -> Derivation:
    def build(sizes: Mapping[str, int], generator: torch.Generator) -> Case:
        torch.manual_seed(seed_from(generator))
        module = ReferenceAffineFamily(member.name, sizes["in_features"], sizes["out_features"])
        return Case(module, (sample_inputs(sizes["batch"], sizes["in_features"], generator),))

    def proofs() -> list[Proof]:
        return [family_theorem(), _diagonal_proof(member), _concrete_proof(member)]

    statement = (
        rf"{member.formula}:\quad \Delta z_i = -\eta \sum_j K_{{ij}} g_j,\quad "
        rf"K_{{ij}} = {sp.latex(member.kernel)},\quad K_{{ii}} = {sp.latex(member.diagonal_factor)},"
        r"\quad d = x_i \cdot x_j,\; s = \|x\|^2,\; g_j = \partial L/\partial z_j"
        r" \;(L = \textstyle\sum_j \ell_j:\ g_j = \partial \ell_j/\partial z_j;\ "
        r"L = \frac{1}{B}\sum_j \ell_j:\ g_j = \frac{1}{B}\partial \ell_j/\partial z_j)"
    )
    return Derivation(
        name=member.name,
        layer=member.formula,
        statement=statement,
        build=build,
        predict=lambda case, g, lr: predict_update(member, case.inputs[0], g, lr),
        proofs=proofs,
        sizes=SIZES,
        linear_in_params=True,
        diagonal=lambda case: diagonal_factor(member, case.inputs[0]),
        tags=("affine",),
    )


DERIVATIONS = tuple(register(make_derivation(member)) for member in MEMBERS)

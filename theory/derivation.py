"""What a derivation is: a closed form for the effective update of one layer, its proof, and a
numeric evaluator of that closed form.

A derivation describes a layer z = f(x; θ) under one plain gradient-descent step
Δθ = −η ∇θ L and states the effective activation update

    Δz_i = z_i(θ + Δθ) − z_i(θ) = −η Σ_j Θ(x_i, x_j) g_j + R(η),    g_j = ∂L/∂z_j,

in closed form, with R(η) ≡ 0 when f is linear in θ. ``predict`` evaluates the closed form on
torch tensors; ``prove`` runs the symbolic (sympy) proof and says which kind it is.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

import torch
from torch import Tensor, nn


class ProofKind(str, enum.Enum):  # noqa: UP042 (str() and format() as before 3.11's StrEnum)
    """How strongly a claim is established, strongest first."""

    SYMBOLIC_GENERAL = "symbolic, general dimension"
    EXACT_CONCRETE = "exact identity at concrete sizes"
    NUMERIC_ONLY = "numerical only"


@dataclass(frozen=True)
class Proof:
    """One proof step: what it claims, of which kind, and whether it held.

    A step that ``corroborates`` re-establishes a claim already proven by the other steps (for
    instance an exact check at concrete sizes of a general symbolic theorem): it must hold, but it
    does not weaken the derivation's proof kind.
    """

    claim: str
    kind: ProofKind
    holds: bool
    detail: str = ""
    corroborates: bool = False


@dataclass(frozen=True)
class Case:
    """One numerical instance of a layer: a module and the inputs it is applied to."""

    module: nn.Module
    inputs: tuple[Tensor, ...]


@dataclass(frozen=True)
class Derivation:
    """A proven closed form for the effective update of one layer.

    name:      short identifier used in reports and on the command line.
    layer:     the layer in words, with its formula.
    statement: the closed form as LaTeX.
    build:     (sizes, generator) -> Case: a float64 instance of the layer and its inputs.
    predict:   (case, grad_output, lr) -> Δz predicted by the closed form (first order).
    proofs:    () -> the sympy proof steps; run once, then cached.
    sizes:     the size configurations `affdiv verify` checks.
    linear_in_params: True when R(η) ≡ 0, so the finite step must equal the prediction exactly.
    diagonal:  optional (case) -> per-sample diagonal factor Θ_ii predicted for one-sample steps.
    predict_second_order: optional (case, grad_output, lr) -> the prediction including the exact
               O(η²) term, for layers that are not linear in θ.
    sites:     optional output tensor -> (n_sites, features): one row per *site*, the output vector
               the theory treats as a unit (conv: one position of one sample; attention: one token).
    site_diagonal: optional (case) -> the factor k_ss (broadcastable to the output) when each site's
               own block Θ_ss is k_ss·I: a site's update from its own gradient alone is −η k_ss g_s.
    taylor_lrs: the step sizes of the Taylor-remainder check, when the default window (10⁻¹ … 10⁻⁴)
               reaches past the layer's asymptotic regime.
    """

    name: str
    layer: str
    statement: str
    build: Callable[[Mapping[str, int], torch.Generator], Case]
    predict: Callable[[Case, Tensor, float], Tensor]
    proofs: Callable[[], Sequence[Proof]]
    sizes: tuple[Mapping[str, int], ...]
    linear_in_params: bool = True
    diagonal: Callable[[Case], Tensor] | None = None
    predict_second_order: Callable[[Case, Tensor, float], Tensor] | None = None
    sites: Callable[[Tensor], Tensor] | None = None
    site_diagonal: Callable[[Case], Tensor] | None = None
    taylor_lrs: tuple[float, ...] | None = None
    tags: tuple[str, ...] = field(default=())

    def proof_steps(self) -> tuple[Proof, ...]:
        return _run_proofs(self.proofs)

    @property
    def proof_kind(self) -> ProofKind:
        """The weakest kind among the essential proof steps (a chain is as strong as its weakest link)."""
        kinds = [p.kind for p in self.proof_steps() if not p.corroborates] or [ProofKind.NUMERIC_ONLY]
        order = list(ProofKind)
        return max(kinds, key=order.index)

    @property
    def proven(self) -> bool:
        return all(p.holds for p in self.proof_steps())


@cache
def _run_proofs(proofs: Callable[[], Sequence[Proof]]) -> tuple[Proof, ...]:
    return tuple(proofs())


_REGISTRY: dict[str, Derivation] = {}


def register(derivation: Derivation) -> Derivation:
    """Add a derivation to the registry that `affdiv verify` runs; names are unique."""
    if derivation.name in _REGISTRY:
        raise ValueError(f"a derivation named {derivation.name!r} is already registered")
    _REGISTRY[derivation.name] = derivation
    return derivation


def registry() -> dict[str, Derivation]:
    """All registered derivations, by name, in registration order."""
    return dict(_REGISTRY)

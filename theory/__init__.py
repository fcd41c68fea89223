"""Symbolic derivations of the effective activation update, each with a numeric evaluator.

Importing this package registers every derivation; ``registry()`` lists them.
"""

from affdiv.theory.derivation import Case, Derivation, Proof, ProofKind, register, registry
from affdiv.theory import affine, attention, conv, residual  # noqa: F401  (each registers its family)

__all__ = ["Case", "Derivation", "Proof", "ProofKind", "register", "registry", "affine", "attention", "conv", "residual"]

"""Symbolic derivations of the effective activation update, each with a numeric evaluator.

Importing this package registers every derivation; ``registry()`` lists them.
"""

from affdiv._extras import missing_extra
from affdiv.theory.derivation import Case, Derivation, Proof, ProofKind, register, registry

try:
    from affdiv.theory import affine, attention, conv, residual  # noqa: F401  (each registers its family)
except ModuleNotFoundError as error:  # sympy comes with the verify extra
    raise missing_extra(error, extra="verify", feature="affdiv.theory (and affdiv.verify)") from None

__all__ = [
    "Case", "Derivation", "Proof", "ProofKind", "register", "registry", "affine", "attention", "conv", "residual",
]

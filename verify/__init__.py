"""Checks of every derivation against autograd (jvp after vjp), the empirical NTK and a real SGD step."""

from affdiv.verify.checks import DEFAULT_LR, CheckResult, run_checks
from affdiv.verify.engine import EffectiveUpdate, effective_update
from affdiv.verify.metrics import Alignment, alignment, cosine, diagonal_update, off_diagonal_share, scale_factor
from affdiv.verify.ntk import empirical_ntk, ntk_update

__all__ = [
    "DEFAULT_LR",
    "Alignment",
    "CheckResult",
    "EffectiveUpdate",
    "alignment",
    "cosine",
    "diagonal_update",
    "effective_update",
    "empirical_ntk",
    "ntk_update",
    "off_diagonal_share",
    "run_checks",
    "scale_factor",
]

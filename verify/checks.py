"""Checking a derivation's closed form against measurements, in float64.

Errors are normwise relative, rel(a, b) = ‖a − b‖∞ / ‖b‖∞ with b the measurement.

Tolerances and the error each bounds (u = 2⁻⁵³ ≈ 1.1e-16, float64 unit roundoff):
* closed form vs jvp∘vjp (and vs the NTK): both evaluate the same sums of N ≤ 10⁴ products in
  different orders; Higham's bound |fl(Σ) − Σ| ≤ γ_N Σ|terms|, γ_N ≈ N u ≈ 1e-12, times the
  cancellation ratio Σ|terms| / |Σ| (≤ 10² for the inputs drawn here) gives TOL = 1e-10.
* closed form vs the real step: z(θ+Δθ) − z(θ) loses a further u ‖z‖∞/‖Δz‖∞ to cancellation, so
  its tolerance is TOL + 16 u ‖z‖∞/‖Δz‖∞, computed per check from the measured values.
* linearity in θ (no O(η²) term): at η = 10 the remainder ‖finite − linear‖ / ‖linear‖ must be
  within the same rounding bound; a layer with a genuine η² term fails it by orders of magnitude.
* Taylor order (layers not linear in θ): the log-log slope of ‖finite − linear‖ against η over
  three decades must be 2 ± SLOPE_TOL (0.1). The slope after the O(η²) term is reported, fitted
  over the η whose remainder exceeds 10³ u ‖z‖∞ (the rounding of the real step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import Tensor

from affdiv.theory.derivation import Derivation
from affdiv.verify.engine import effective_update
from affdiv.verify.metrics import alignment, diagonal_update, site_alignment, site_diagonal_update
from affdiv.verify.ntk import empirical_ntk, ntk_update

UNIT_ROUNDOFF = float(torch.finfo(torch.float64).eps) / 2
TOL = 1e-10
SLOPE_TOL = 0.1
LR = 0.1
LINEARITY_LR = 10.0
TAYLOR_LRS = tuple(float(v) for v in np.logspace(-1, -4, 7))
ROUNDING_FLOOR = 1e3  # remainders below 10³ u ‖z‖∞ are rounding noise of z(θ+Δθ) − z(θ)
NTK_MAX_OUTPUTS = 512  # batch × output size up to which the full NTK reference is built


def rel_err(predicted: Tensor, measured: Tensor) -> float:
    scale = measured.abs().max()
    diff = (predicted - measured).abs().max()
    return float(diff / scale) if scale > 0 else float(diff)


def cancellation_bound(output: Tensor, update: Tensor) -> float:
    """Rounding lost when a small update is recovered as a difference of two outputs."""
    return 16 * UNIT_ROUNDOFF * float(output.abs().max() / update.abs().max())


@dataclass
class CheckResult:
    """One row of the verification report."""

    name: str
    derivation: str
    check: str  # update | diagonal | site_diagonal | linearity | taylor
    sizes: dict
    seed: int
    lr: float | list
    tol: float
    passed: bool
    max_rel_err: float
    errors: dict = field(default_factory=dict)  # per reference: linear, finite, ntk, ...
    proof: str = ""
    detail: str = ""
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _case(derivation: Derivation, sizes: Mapping[str, int], seed: int):
    generator = torch.Generator().manual_seed(seed)
    case = derivation.build(sizes, generator)
    with torch.no_grad():
        out = case.module(*case.inputs)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    return case, grad


def _sizes_label(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


def check_update(derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = LR) -> CheckResult:
    """Closed form vs jvp∘vjp, vs the NTK (small problems) and, if linear in θ, vs the real step."""
    case, grad = _case(derivation, sizes, seed)
    measured = effective_update(case.module, case.inputs, grad, lr=lr)
    predicted = derivation.predict(case, grad, lr)
    errors = {"linear": rel_err(predicted, measured.linear)}
    if grad.numel() <= NTK_MAX_OUTPUTS:
        errors["ntk"] = rel_err(predicted, ntk_update(empirical_ntk(case.module, case.inputs), grad, lr))
    tol = TOL
    passed = all(e <= TOL for e in errors.values())
    if derivation.linear_in_params:
        errors["finite"] = rel_err(predicted, measured.finite)
        tol = TOL + cancellation_bound(measured.output, measured.finite)
        passed = passed and errors["finite"] <= tol
    metrics = alignment(case.module, case.inputs, grad, lr, measured.linear).summary()
    if derivation.sites is not None:
        per_site = site_alignment(case.module, case.inputs, grad, lr, measured.linear, derivation.sites)
        metrics.update({f"site_{k}": v for k, v in per_site.summary().items()})
    return CheckResult(
        name=f"{derivation.name}/update",
        derivation=derivation.name,
        check="update",
        sizes=dict(sizes),
        seed=seed,
        lr=lr,
        tol=tol,
        passed=passed,
        max_rel_err=max(errors.values()),
        errors=errors,
        proof=derivation.proof_kind.value,
        metrics=metrics,
    )


def check_diagonal(derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = LR) -> CheckResult:
    """Each sample's update from its own gradient alone vs −η K_ii g_i with the derived K_ii."""
    case, grad = _case(derivation, sizes, seed)
    measured = diagonal_update(case.module, case.inputs, grad, lr)
    factor = derivation.diagonal(case)
    predicted = -lr * factor.reshape((-1,) + (1,) * (grad.dim() - 1)) * grad
    err = rel_err(predicted, measured)
    return CheckResult(
        name=f"{derivation.name}/diagonal",
        derivation=derivation.name,
        check="diagonal",
        sizes=dict(sizes),
        seed=seed,
        lr=lr,
        tol=TOL,
        passed=err <= TOL,
        max_rel_err=err,
        errors={"single_sample": err},
        proof=derivation.proof_kind.value,
        detail=f"K_ii in [{float(factor.min()):.6g}, {float(factor.max()):.6g}]",
    )


def check_site_diagonal(
    derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = LR
) -> CheckResult:
    """Each site's update from its own gradient alone vs −η k_ss g_s with the derived k_ss."""
    case, grad = _case(derivation, sizes, seed)
    measured = site_diagonal_update(case.module, case.inputs, grad, lr, derivation.sites)
    factor = derivation.site_diagonal(case).expand(grad.shape)
    err = rel_err(derivation.sites(-lr * factor * grad), measured)
    return CheckResult(
        name=f"{derivation.name}/site_diagonal",
        derivation=derivation.name,
        check="site_diagonal",
        sizes=dict(sizes),
        seed=seed,
        lr=lr,
        tol=TOL,
        passed=err <= TOL,
        max_rel_err=err,
        errors={"single_site": err},
        proof=derivation.proof_kind.value,
        detail=f"k_ss in [{float(factor.min()):.6g}, {float(factor.max()):.6g}]",
    )


def check_linearity(derivation: Derivation, sizes: Mapping[str, int], seed: int) -> CheckResult:
    """No O(η²) term: at a large step the real update still equals the first-order one."""
    case, grad = _case(derivation, sizes, seed)
    measured = effective_update(case.module, case.inputs, grad, lr=LINEARITY_LR)
    err = rel_err(measured.linear, measured.finite)
    tol = TOL + cancellation_bound(measured.output, measured.finite)
    return CheckResult(
        name=f"{derivation.name}/linearity",
        derivation=derivation.name,
        check="linearity",
        sizes=dict(sizes),
        seed=seed,
        lr=LINEARITY_LR,
        tol=tol,
        passed=err <= tol,
        max_rel_err=err,
        errors={"remainder": err},
        proof=derivation.proof_kind.value,
        detail="‖finite − linear‖∞/‖linear‖∞ at η = 10",
    )


def taylor_slope(lrs: Sequence[float], remainders: Sequence[float]) -> float:
    """Least-squares slope of log ‖remainder‖ against log η."""
    return float(np.polyfit(np.log(lrs), np.log(remainders), 1)[0])


def check_taylor(derivation: Derivation, sizes: Mapping[str, int], seed: int, lrs=TAYLOR_LRS) -> CheckResult:
    """The real step minus the first-order prediction shrinks as η² (and as η³ after the O(η²) term).

    The second-order slope is fitted only where that remainder stands above the rounding of the
    real step, ROUNDING_FLOOR·u·‖z‖∞ (below it the series is float64 noise, whatever its slope)."""
    case, grad = _case(derivation, sizes, seed)
    first, second = [], []
    for lr in lrs:
        measured = effective_update(case.module, case.inputs, grad, lr=lr)
        first.append(float((measured.finite - derivation.predict(case, grad, lr)).abs().max()))
        if derivation.predict_second_order is not None:
            remainder = float((measured.finite - derivation.predict_second_order(case, grad, lr)).abs().max())
            floor = ROUNDING_FLOOR * UNIT_ROUNDOFF * float(measured.output.abs().max())
            second.append((lr, remainder, remainder > floor))
    slope = taylor_slope(lrs, first)
    errors = {"slope_first_order": slope}
    detail = f"slope {slope:.3f} over η ∈ [{min(lrs):.0e}, {max(lrs):.0e}]"
    if second:
        errors["removed_by_second_order"] = 1 - second[0][1] / first[0]
        above = [(lr, r) for lr, r, visible in second if visible]
        if len(above) >= 3:
            errors["slope_second_order"] = taylor_slope(*zip(*above))
            detail += (
                f"; with the O(η²) term: slope {errors['slope_second_order']:.3f} "
                f"over η ∈ [{above[-1][0]:.0e}, {above[0][0]:.0e}]"
            )
        else:
            detail += "; with the O(η²) term the remainder is at float64 rounding"
    err = abs(slope - 2)
    return CheckResult(
        name=f"{derivation.name}/taylor",
        derivation=derivation.name,
        check="taylor",
        sizes=dict(sizes),
        seed=seed,
        lr=list(lrs),
        tol=SLOPE_TOL,
        passed=err <= SLOPE_TOL,
        max_rel_err=err,
        errors=errors,
        proof=derivation.proof_kind.value,
        detail=detail,
    )


def checks_for(derivation: Derivation, sizes: Mapping[str, int], seed: int) -> list[Callable[[], CheckResult]]:
    """The checks that apply to one derivation at one size and seed (deferred, to show progress)."""
    checks = [lambda: check_update(derivation, sizes, seed)]
    if derivation.diagonal is not None:
        checks.append(lambda: check_diagonal(derivation, sizes, seed))
    if derivation.site_diagonal is not None:
        checks.append(lambda: check_site_diagonal(derivation, sizes, seed))
    if derivation.linear_in_params:
        checks.append(lambda: check_linearity(derivation, sizes, seed))
    else:
        checks.append(lambda: check_taylor(derivation, sizes, seed, lrs=derivation.taylor_lrs or TAYLOR_LRS))
    return checks


def run_checks(
    derivations: Iterable[Derivation],
    seeds: Sequence[int],
    progress: Callable[[int, int, CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Every check of every derivation at each of its sizes and each seed."""
    pending = [
        check
        for derivation in derivations
        for sizes in derivation.sizes
        for seed in seeds
        for check in checks_for(derivation, sizes, seed)
    ]
    results = []
    for index, check in enumerate(pending, 1):
        results.append(check())
        if progress is not None:
            progress(index, len(pending), results[-1])
    return results

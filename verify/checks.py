"""Checking a derivation's closed form against measurements, in float64.

Errors are normwise relative, rel(a, b) = ‖a − b‖∞ / ‖b‖∞ with b the measurement.

Tolerances and the error each bounds (u = 2⁻⁵³ ≈ 1.1e-16, float64 unit roundoff):
* closed form vs jvp after vjp (and vs the NTK): both evaluate the same sums of N ≤ 10⁴ products in
  different orders; Higham's bound |fl(Σ) − Σ| ≤ γ_N Σ|terms|, γ_N ≈ N u ≈ 1e-12, times the
  cancellation ratio Σ|terms| / |Σ| (≤ 10² for the inputs drawn here) gives TOL = 1e-10.
* closed form vs the real step: z(θ+Δθ) − z(θ) loses a further u ‖z‖∞/‖Δz‖∞ to cancellation, so
  its tolerance is TOL + 16 u ‖z‖∞/‖Δz‖∞, computed per check from the measured values.
* linearity in θ (no O(η²) term): at η = 10 the remainder ‖finite − linear‖∞ / ‖finite‖∞ must be
  within the same rounding bound; a layer with a genuine η² term fails it by orders of magnitude.
* Taylor order (layers not linear in θ): remainders ‖·‖∞ measured over three decades of η, each
  slope fitted over the FIT_POINTS = 3 smallest η where the remainder stands above the rounding
  floor F = 10³ u ‖z‖∞ of the real step z(θ+Δθ) − z(θ). Below F the series is float64 noise,
  whatever its slope; above it a point carries at most about 10⁻³ of rounding relative to itself
  (the real step's rounding is a few u ‖z‖∞), which moves a slope fitted over points half a decade
  apart by about 10⁻³. The smallest η are where the next order weighs least and a wrong lower
  order weighs most: a remainder a η² + b η³ has the local slope 2 + bη/(a + bη). Over the whole
  window residual_tanh at one seed, with a ≈ 169 and b ≈ 2·10⁴, read 2.10 while its ratio to η²
  converged, and over its three smallest η it reads 2.006. With r = c η + a η² + b η³ at those
  a and b, a wrong first order reads below 1.9 from about c = 0.3 a η_min, where the whole-window
  fit let c = 3 a η_min pass. A remainder that is not finite fails the check:
  - first order, finite − predict: the log-log slope must be 2 ± SLOPE_TOL (0.1), fitted over
    ≥ 3 such η (fewer: the layer is linear in θ at these η and should be declared so: fail);
  - with the O(η²) term (``predict_second_order``), finite − predict_second_order: if ≥ 3 η stand
    above F, the slope must be 3 ± SLOPE_TOL (the remainder is O(η³)); otherwise the remainder
    must be at rounding level, ≤ F, at *every* η — which is what an exact second order gives
    (the affine residual block: its real step is first order + η² term, nothing more). One or
    two points above F, too few to fit, fail: the check cannot establish the order there.
"""

from __future__ import annotations

import math
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
#: How many of the smallest η above the rounding floor a Taylor slope is fitted over (module docstring).
FIT_POINTS = 3
DEFAULT_LR = 0.1  # the step size of the update and diagonal checks (and of `affdiv probe`)
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
    r"""One row of the verification report: a check of one derivation at one size and seed,
    passed when its error :math:`\|predicted - measured\|_\infty / \|measured\|_\infty` is within ``tol``.

    Args:
        name: ``"{derivation}/{check}"``.
        derivation: the derivation's registered name.
        check: ``"update"``, ``"diagonal"``, ``"site_diagonal"``, ``"linearity"`` or ``"taylor"``.
        sizes: the case's sizes.
        seed: the case's seed.
        lr: the step size η (the list of η for ``taylor``).
        tol: the tolerance the errors are held to (for ``taylor``: the slope tolerance).
        passed: whether every error is within ``tol``.
        max_rel_err: the largest error (for ``taylor``: the largest |slope − expected|).
        errors: the error against each reference (``linear``, ``finite``, ``ntk``, …).
            Default: empty.
        proof: the derivation's proof kind. Default: ``""``.
        detail: a line of explanation for the report. Default: ``""``.
        metrics: the alignment summary of the measured update. Default: empty.

    Example::

        >>> from affdiv.verify.checks import CheckResult
        >>> row = CheckResult("affine/update", "affine", "update", {"batch": 2}, 0, 0.1, 1e-10, True, 3e-16)
        >>> row.to_dict()["max_rel_err"]
        3e-16
    """

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
        """The row as a JSON-ready dict (the ``checks`` entries of ``verify.json``)."""
        return asdict(self)


def _case(derivation: Derivation, sizes: Mapping[str, int], seed: int):
    """The derivation's case for (sizes, seed) and output gradients drawn from the same generator.
    Builds seed torch's global RNG (module initialisation): fork_rng restores it afterwards."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        case = derivation.build(sizes, generator)
    with torch.no_grad():
        out = case.module(*case.inputs)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    return case, grad


def _result(derivation: Derivation, check: str, sizes, seed: int, lr, tol: float, passed: bool,
            errors: dict, max_rel_err: float | None = None, **extra) -> CheckResult:
    """One CheckResult of ``check`` for ``derivation``; max_rel_err defaults to the largest error."""
    return CheckResult(
        name=f"{derivation.name}/{check}",
        derivation=derivation.name,
        check=check,
        sizes=dict(sizes),
        seed=seed,
        lr=lr,
        tol=tol,
        passed=bool(passed),
        max_rel_err=max(errors.values()) if max_rel_err is None else max_rel_err,
        errors=errors,
        proof=derivation.proof_kind.value,
        **extra,
    )


def check_update(
    derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = DEFAULT_LR
) -> CheckResult:
    """Closed form vs jvp after vjp, vs the NTK (small problems) and, if linear in θ, vs the real step."""
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
    return _result(derivation, "update", sizes, seed, lr, tol, passed, errors, metrics=metrics)


def check_diagonal(
    derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = DEFAULT_LR
) -> CheckResult:
    """Each sample's update from its own gradient alone vs −η K_ii g_i with the derived K_ii."""
    case, grad = _case(derivation, sizes, seed)
    measured = diagonal_update(case.module, case.inputs, grad, lr)
    factor = derivation.diagonal(case)
    predicted = -lr * factor.reshape((-1,) + (1,) * (grad.dim() - 1)) * grad
    err = rel_err(predicted, measured)
    return _result(derivation, "diagonal", sizes, seed, lr, TOL, err <= TOL, {"single_sample": err},
                   detail=f"K_ii in [{float(factor.min()):.6g}, {float(factor.max()):.6g}]")


def check_site_diagonal(
    derivation: Derivation, sizes: Mapping[str, int], seed: int, lr: float = DEFAULT_LR
) -> CheckResult:
    """Each site's update from its own gradient alone vs −η k_ss g_s with the derived k_ss."""
    case, grad = _case(derivation, sizes, seed)
    measured = site_diagonal_update(case.module, case.inputs, grad, lr, derivation.sites)
    factor = derivation.site_diagonal(case).expand(grad.shape)
    err = rel_err(derivation.sites(-lr * factor * grad), measured)
    return _result(derivation, "site_diagonal", sizes, seed, lr, TOL, err <= TOL, {"single_site": err},
                   detail=f"k_ss in [{float(factor.min()):.6g}, {float(factor.max()):.6g}]")


def check_linearity(derivation: Derivation, sizes: Mapping[str, int], seed: int) -> CheckResult:
    """No O(η²) term: at a large step the real update still equals the first-order one."""
    case, grad = _case(derivation, sizes, seed)
    measured = effective_update(case.module, case.inputs, grad, lr=LINEARITY_LR)
    err = rel_err(measured.linear, measured.finite)
    tol = TOL + cancellation_bound(measured.output, measured.finite)
    return _result(derivation, "linearity", sizes, seed, LINEARITY_LR, tol, err <= tol, {"remainder": err},
                   detail=f"‖finite − linear‖∞/‖finite‖∞ at η = {LINEARITY_LR:g}")


def taylor_slope(lrs: Sequence[float], remainders: Sequence[float]) -> float:
    """Least-squares slope of log ‖remainder‖ against log η."""
    return float(np.polyfit(np.log(lrs), np.log(remainders), 1)[0])


def fit_above_floor(lrs: Sequence[float], remainders: Sequence[float], floor: float):
    """(slope, the η it was fitted over) for the :data:`FIT_POINTS` smallest η whose remainders
    stand above ``floor`` (module docstring); slope None with fewer above it, and those η."""
    above = sorted((lr, r) for lr, r in zip(lrs, remainders) if r > floor)
    if len(above) < FIT_POINTS:
        return None, [lr for lr, _ in above]
    fitted = above[:FIT_POINTS]
    return taylor_slope([lr for lr, _ in fitted], [r for _, r in fitted]), [lr for lr, _ in fitted]


def _window(lrs: Sequence[float]) -> str:
    return f"η ∈ [{min(lrs):.0e}, {max(lrs):.0e}]"


def check_taylor(derivation: Derivation, sizes: Mapping[str, int], seed: int, lrs=TAYLOR_LRS) -> CheckResult:
    """The real step minus the first-order prediction shrinks as η², and minus the prediction with
    the O(η²) term as η³ or is at rounding level everywhere (the rules in the module docstring)."""
    case, grad = _case(derivation, sizes, seed)
    first, second, floor = [], [], 0.0
    for lr in lrs:
        measured = effective_update(case.module, case.inputs, grad, lr=lr)
        floor = ROUNDING_FLOOR * UNIT_ROUNDOFF * float(measured.output.abs().max())
        first.append(float((measured.finite - derivation.predict(case, grad, lr)).abs().max()))
        if derivation.predict_second_order is not None:
            second.append(float((measured.finite - derivation.predict_second_order(case, grad, lr)).abs().max()))
    nonfinite = sum(not math.isfinite(r) for r in (*first, *second))
    if nonfinite:
        return _result(derivation, "taylor", sizes, seed, list(lrs), SLOPE_TOL, False,
                       {"nonfinite_remainders": float(nonfinite)}, math.inf,
                       detail=f"{nonfinite} remainder(s) not finite: nothing to fit")
    slope, fitted = fit_above_floor(lrs, first, floor)
    if slope is None:
        errors = {"points_above_rounding": float(len(fitted))}
        return _result(derivation, "taylor", sizes, seed, list(lrs), SLOPE_TOL, False, errors, math.inf,
                       detail=f"first-order remainder above rounding at only {len(fitted)} η: nothing to fit")
    errors = {"slope_first_order": slope}
    passed, err = abs(slope - 2) <= SLOPE_TOL, abs(slope - 2)
    detail = f"slope {slope:.3f} over {_window(fitted)}"
    if second:
        errors["removed_by_second_order"] = 1 - second[0] / first[0]
        slope2, fitted2 = fit_above_floor(lrs, second, floor)
        if slope2 is not None:
            errors["slope_second_order"] = slope2
            passed, err = passed and abs(slope2 - 3) <= SLOPE_TOL, max(err, abs(slope2 - 3))
            detail += f"; with the O(η²) term: slope {slope2:.3f} over {_window(fitted2)}"
        else:
            errors["second_order_remainder_over_floor"] = max(second) / floor
            passed = passed and not fitted2
            detail += (
                f"; with the O(η²) term the remainder is ≤ 10³u‖z‖∞ = {floor:.1e} at every η (exact)"
                if not fitted2
                else f"; with the O(η²) term the remainder exceeds 10³u‖z‖∞ at only {len(fitted2)} η: cannot fit"
            )
    return _result(derivation, "taylor", sizes, seed, list(lrs), SLOPE_TOL, passed, errors, err, detail=detail)


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
    r"""Every check of every derivation at each of its sizes and each seed: the closed form against
    jvp after vjp, the NTK and the real step (tolerances in the module docstring).

    Args:
        derivations: the derivations to check (e.g. values of ``affdiv.theory.registry()``).
        seeds: the seeds of the cases, each at every size.
        progress: called as ``progress(index, total, result)`` after each check. Default: ``None``.

    Returns:
        one :class:`CheckResult` per check, in the order derivation, size, seed, check.

    Example::

        >>> from affdiv.theory import registry
        >>> from affdiv.verify import run_checks
        >>> results = run_checks([registry()["affine_like"]], seeds=[0])
        >>> len(results), all(r.passed for r in results)  # 4 sizes × (update, diagonal, linearity)
        (12, True)
    """
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

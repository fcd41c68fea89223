"""Steps to a target against batch size: the critical batch size B_crit per method, and the test of
the sharpened prediction B_crit(corrected) / B_crit(baseline) < 1.

The model (Shallue et al., JMLR 2019; McCandlish et al., arXiv 1812.06162). A run of method m at
batch size B that reaches the target after S steps follows

    log S = log S_min + log(1 + B_crit / B) + e,      e ~ N(0, sigma^2)    (per method m),

so that the median steps are S(B) = S_min (1 + B_crit/B) and the median examples E(B) = B S(B) =
E_min (1 + B/B_crit), E_min = S_min B_crit. A run that did not reach the target within its
``max_steps`` is right-censored: it contributes P(log S > log max_steps) =
1 - Phi((log max_steps - mu)/sigma) to the likelihood (a log-normal accelerated-failure-time model
with a curve in place of the linear predictor: a Tobit model in log S). Censored runs are never
dropped and never replaced by max_steps.

Fit: for each B_crit on a grid in log B_crit from B_min/8 to 8 B_max (3 doublings beyond the batch
sizes on each side; :data:`GRID_DOUBLINGS`), the MLE of (log S_min, sigma) is closed-form without
censoring and a Newton iteration otherwise (the censored normal log-likelihood is concave in
(mu/sigma, 1/sigma), Olsen 1978, so the iteration converges from any start); the profile
log-likelihood over the grid is maximised and refined by a parabola through the best three grid
points. A B_crit that ends on a grid edge is *unresolved* by the batch sizes run: it is reported
as that edge (a bound, not an estimate).

Uncertainty: seeds are the independent units (each seed has its own data split, init and
shuffles). The intervals and the ratio test use the leave-one-seed-out *jackknife*: every method
refitted G times, seed s left out each time; se^2 = (G-1)/G sum_s (t_(-s) - mean)^2 of log B_crit
(log S_min, log E_min, and the log ratio of two methods, a seed left out of both: paired), with t
on G-1 degrees of freedom (the analogue of the CR3 cluster-robust variance). Why not the seed
bootstrap: with 4-8 seeds its percentile intervals are too narrow — on simulated studies of this
model the 95% interval of B_crit covered the truth 82% (4 seeds) and 86-89% (8 seeds) of the
time and the one-sided 5% ratio test rejected a true ratio of 1 10-13% of the time, while the
jackknife t gave 95.5-95.8% and 4-6% (400 studies each; the tests assert it). The paired seed
bootstrap's percentile interval (all methods refitted on the same drawn seeds) is still reported
as a sensitivity analysis (``boot_ci_low``, ``boot_ci_high``) when ``n_boot`` > 0.

Steps are treated as observed exactly. Reads every ``eval_every`` steps record the first read at
or past the crossing (an error below log(S/(S - eval_every)), small when eval_every is small
against S); geometric reads (``read_spacing`` = r) interpolate the crossing between the read
before and the read that reached it (the gap is below r S; :mod:`~affdiv.experiments.runs.reads`).

Along a ladder (records with several values of ``target``) every target is analysed as above, the
primary target deciding; the trend of each log ratio along the targets (:func:`trend`) is
descriptive. The pair outcomes keep a small effect apart from none (:func:`_ratio`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special

from affdiv.experiments.analysis import stats
from affdiv.experiments.analysis.design import by_batch_size, in_role_order, joint, overall, rng, role_of, roles_clause
from affdiv.experiments.analysis.groups import default_primary_group
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.reporting import json_ready
from affdiv.vocabulary import (
    CONTRADICTED,
    EQUIVALENT,
    INCONCLUSIVE,
    LARGER,
    NO_PREDICTION,
    REFERENCE,
    SMALLER,
    SMALLER_WITHIN_MARGIN,
    STEPS_TO_TARGET,
    SUPPORTED,
    TARGET_METRIC,
    UNCLEAR,
)

GRID_DOUBLINGS = 3.0  # the B_crit search range extends this many doublings beyond the batch sizes
GRID_POINTS_PER_DOUBLING = 4
RATIO_MARGIN = 2.0 ** -0.5  # ratios within [2^-1/2, 2^1/2] (half a doubling) are negligible differences
MIN_SEEDS = 3
MIN_BATCH_SIZES = 3
MAX_FAILED_RESAMPLES = 0.1  # more failed bootstrap refits than this and no CI is reported

TREND_STEP = 0.01  # the trend of a log ratio along the ladder is reported per this rise of the target

_LOG_2PI = math.log(2 * math.pi)


# ----------------------------------------------------------------------------------- records
def check_target_records(records: Sequence[Mapping], *, metric: str = TARGET_METRIC) -> list[dict]:
    """Typed copies of steps-to-target records; raises ValueError naming the record and column.

    Each record needs ``method``, ``batch_size`` > 0, ``seed``, ``max_steps`` > 0 and either a
    positive ``steps_to_target`` <= max_steps (reached) or an empty one (censored); ``censored``
    (0/1), when present, must agree (:func:`affdiv.experiments.records.validate_records`). Adds
    ``log_steps``: log S, or log max_steps for a censored run.
    """
    from affdiv.experiments.records import validate_records

    rows = validate_records(records, metric=metric)
    for number, row in enumerate(rows, start=1):
        for column in ("diverged", "lr_at_grid_edge"):
            if row.get(column) not in (None, ""):
                row[column] = _integer(row[column], column, f"record {number}")
                if row[column] not in (0, 1):
                    raise ValueError(f"record {number}: column {column!r} must be 0 or 1, got {row[column]!r}")
        row["log_steps"] = math.log(row["max_steps"] if row["censored"] else row[metric])
    return rows


def _integer(value, column: str, where: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{where}: column {column!r} must be an integer, got {value!r}")
    return int(number)


# ----------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class MethodData:
    """One method's runs as arrays; ``seed_index`` indexes ``seeds`` (shared by a group's methods)."""

    batch: np.ndarray  # (n,) batch size of each run
    log_steps: np.ndarray  # (n,) log S, or log max_steps where censored
    censored: np.ndarray  # (n,) bool
    seed_index: np.ndarray  # (n,) int
    seeds: tuple  # the group's seed labels

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({int(b) for b in self.batch})


def _grid(batch_sizes: Sequence[int]) -> np.ndarray:
    low = math.log2(min(batch_sizes)) - GRID_DOUBLINGS
    high = math.log2(max(batch_sizes)) + GRID_DOUBLINGS
    points = int(round((high - low) * GRID_POINTS_PER_DOUBLING)) + 1
    return np.linspace(low, high, points) * math.log(2.0)  # natural log of B_crit


def _solve(n_obs, s1, s2, wc, rc, iterations: int = 60):
    """MLE of (mu, sigma) of residuals r ~ N(mu, sigma^2) from weighted sufficient statistics.

    Observed residuals enter through n_obs = sum w, s1 = sum w r, s2 = sum w r^2 (shape (R, K)); the
    censored ones as bounds rc (.., K, U) with weights wc (R, 1, U): log P(r > rc). Returns mu,
    sigma, loglik of shape (R, K). Without censoring the MLE is closed-form; with it, Newton on the
    concave parametrisation (a, b) = (mu/sigma, 1/sigma) (Olsen 1978) with step halving.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        mu = s1 / n_obs
        var = np.maximum(s2 / n_obs - mu * mu, 1e-12)
    if wc is None or not np.any(wc > 0):
        return mu, np.sqrt(var), -0.5 * n_obs * (np.log(var) + 1.0 + _LOG_2PI)

    def loglik_of(a, b):
        z = b[..., None] * rc - a[..., None]
        return (n_obs * (np.log(b) - 0.5 * _LOG_2PI) - 0.5 * (b * b * s2 - 2 * a * b * s1 + a * a * n_obs)
                + (wc * special.log_ndtr(-z)).sum(-1))

    # Start: the censored bounds counted as observations.
    total = n_obs + wc.sum(-1)
    m0 = (s1 + (wc * rc).sum(-1)) / total
    v0 = np.maximum((s2 + (wc * rc * rc).sum(-1)) / total - m0 * m0, 1e-6)
    b = 1.0 / np.sqrt(v0)
    a = m0 * b
    current = loglik_of(a, b)
    done = np.zeros(a.shape, dtype=bool)
    for _ in range(iterations):
        z = b[..., None] * rc - a[..., None]
        lam = np.exp(_log_phi(z) - special.log_ndtr(-z))  # inverse Mills ratio phi(z) / (1 - Phi(z))
        kappa = wc * lam * (lam - z)  # weighted -(d^2/dz^2) log(1 - Phi(z)) >= 0
        wl = wc * lam
        ga = b * s1 - a * n_obs + wl.sum(-1)
        gb = n_obs / b - b * s2 + a * s1 - (wl * rc).sum(-1)
        haa = -n_obs - kappa.sum(-1)
        hab = s1 + (kappa * rc).sum(-1)
        hbb = -n_obs / (b * b) - s2 - (kappa * rc * rc).sum(-1)
        det = haa * hbb - hab * hab
        with np.errstate(invalid="ignore", divide="ignore"):
            da = np.nan_to_num(-(hbb * ga - hab * gb) / det)
            db = np.nan_to_num(-(haa * gb - hab * ga) / det)
        # Newton decrement: the predicted gain; below 1e-10 the point is the optimum to rounding.
        done = done | (0.5 * -(haa * da * da + 2 * hab * da * db + hbb * db * db) < 1e-10)
        if done.all():
            break
        step = np.where(done, 0.0, 1.0)
        for _halving in range(30):
            na, nb = a + step * da, b + step * db
            positive = nb > 0
            trial = np.where(positive, loglik_of(na, np.where(positive, nb, 1.0)), -np.inf)
            better = trial >= current
            if (better | done).all():
                break
            step = np.where(better | done, step, step / 2)
        move = better & ~done
        a, b = np.where(move, na, a), np.where(move, nb, b)
        current = np.where(move, trial, current)
    return a / b, 1.0 / b, current


def _log_phi(z):
    return -0.5 * z * z - 0.5 * _LOG_2PI


@dataclass(frozen=True)
class CurveFit:
    """Fitted curves of one method over R seed resamples (R = 1 for the point estimate)."""

    log_b_crit: np.ndarray  # (R,) natural log
    log_s_min: np.ndarray  # (R,)
    sigma: np.ndarray  # (R,)
    at_edge: np.ndarray  # (R,) bool: the profile maximum sits on the grid's edge (unresolved)
    valid: np.ndarray  # (R,) bool: the resample had enough data to fit


def fit_curve(data: MethodData, seed_weights: np.ndarray, *, chunk: int = 512) -> CurveFit:
    """Profile-likelihood fit of S(B) = S_min (1 + B_crit/B) for each row of ``seed_weights``
    (R, G) (multiplicities of the G seeds; a row of ones is the data as they are)."""
    seed_weights = np.atleast_2d(np.asarray(seed_weights, dtype=np.float64))
    rows = seed_weights.shape[0]
    weights = seed_weights[:, data.seed_index]
    return fit_curves(data.batch, np.broadcast_to(data.log_steps, weights.shape),
                      np.broadcast_to(data.censored.astype(bool), weights.shape), weights, chunk=chunk) \
        if rows else CurveFit(*(np.zeros(0),) * 3, np.zeros(0, bool), np.zeros(0, bool))


def fit_curves(batch: np.ndarray, log_steps: np.ndarray, censored: np.ndarray, weights: np.ndarray, *,
               chunk: int = 512) -> CurveFit:
    """The fit of :func:`fit_curve` for R data sets at once that share their runs' batch sizes:
    ``log_steps``, ``censored`` and ``weights`` are (R, n), one row per data set (a bootstrap or
    jackknife resample, or a simulated study); ``batch`` (n,). A run with weight 0 is absent."""
    batch = np.asarray(batch, dtype=np.float64)
    batch_sizes = sorted({int(b) for b in batch})
    grid = _grid(batch_sizes)
    spacing = grid[1] - grid[0]
    n_rows = weights.shape[0]
    # Censoring bounds: runs with the same (batch size, bound) share one term with summed weights.
    keys = sorted({(float(b), float(t)) for b, t in zip(np.broadcast_to(batch, log_steps.shape)[censored],
                                                          log_steps[censored])})
    bound_b = np.array([b for b, _ in keys])
    bound_t = np.array([t for _, t in keys])
    offsets = np.log1p(np.exp(grid)[:, None] / batch[None, :])  # (K, n)
    rc_grid = (bound_t[None, :] - np.log1p(np.exp(grid)[:, None] / bound_b[None, :]))[None] if keys else None
    masks = [batch == b for b in batch_sizes]

    out = {k: np.full(n_rows, np.nan) for k in ("log_b_crit", "log_s_min", "sigma")}
    at_edge = np.zeros(n_rows, dtype=bool)
    valid = np.zeros(n_rows, dtype=bool)
    for start in range(0, n_rows, chunk):
        positions = np.arange(start, min(start + chunk, n_rows))
        w, y, c = weights[positions], log_steps[positions], censored[positions]
        wo = w * ~c
        # Enough data: >= MIN_BATCH_SIZES batch sizes with a reached target (weight > 0).
        reached = np.stack([(wo[:, m] > 0).any(1) for m in masks], 1).sum(1)
        ok = reached >= MIN_BATCH_SIZES
        if not ok.any():
            continue
        positions, w, y, c, wo = positions[ok], w[ok], y[ok], c[ok], wo[ok]
        wc = None
        if keys:
            wcen = w * c
            wc = np.stack([(wcen * ((batch == b)[None, :] & (y == t))).sum(1) for b, t in zip(bound_b, bound_t)],
                          1)[:, None, :]  # (r, 1, U): the censored weight at each bound
        n_obs = wo.sum(1, keepdims=True)
        wy = wo * y
        s1 = wy.sum(1, keepdims=True) - wo @ offsets.T
        s2 = (wy * y).sum(1, keepdims=True) - 2 * wy @ offsets.T + wo @ (offsets * offsets).T
        _mu, _sigma, loglik = _solve(n_obs, s1, s2, wc, rc_grid)
        best = np.argmax(np.where(np.isfinite(loglik), loglik, -np.inf), axis=1)
        edge = (best == 0) | (best == grid.size - 1)
        inner = np.clip(best, 1, grid.size - 2)
        index = np.arange(best.size)
        l0, l1, l2 = loglik[index, inner - 1], loglik[index, inner], loglik[index, inner + 1]
        curvature = l0 - 2 * l1 + l2
        with np.errstate(invalid="ignore", divide="ignore"):
            shift = np.where(curvature < 0, 0.5 * (l0 - l2) / curvature, 0.0)
        shift = np.clip(np.nan_to_num(shift), -0.5, 0.5)
        log_c = np.where(edge, grid[best], grid[inner] + shift * spacing)

        def at(log_cs, wo=wo, wy=wy, y=y, n_obs=n_obs, wc=wc):  # the inner fit at one B_crit per row and column
            o = np.log1p(np.exp(log_cs)[..., None] / batch)  # (r, k, n)
            s1_ = wy.sum(1)[:, None] - np.einsum("rn,rkn->rk", wo, o)
            s2_ = (wy * y).sum(1)[:, None] - 2 * np.einsum("rn,rkn->rk", wy, o) + np.einsum("rn,rkn->rk", wo, o * o)
            rc_ = (bound_t - np.log1p(np.exp(log_cs)[..., None] / bound_b)) if keys else None
            return _solve(n_obs, s1_, s2_, wc, rc_)

        # A second parabola on a grid 8 times finer around the first one's vertex.
        h = spacing / 8
        _m, _s, local = at(log_c[:, None] + np.array([-h, 0.0, h]))
        l0, l1, l2 = local[:, 0], local[:, 1], local[:, 2]
        curvature = l0 - 2 * l1 + l2
        with np.errstate(invalid="ignore", divide="ignore"):
            shift = np.where(curvature < 0, 0.5 * (l0 - l2) / curvature, 0.0)
        log_c = np.where(edge, log_c, log_c + np.clip(np.nan_to_num(shift), -1.0, 1.0) * h)
        mu, sigma, _ = at(log_c[:, None])
        out["log_b_crit"][positions] = log_c
        out["log_s_min"][positions] = mu[:, 0]
        out["sigma"][positions] = sigma[:, 0]
        at_edge[positions] = edge
        valid[positions] = np.isfinite(log_c) & np.isfinite(mu[:, 0])
    return CurveFit(out["log_b_crit"], out["log_s_min"], out["sigma"], at_edge, valid)


# ---------------------------------------------------------------------------------- analysis
def _percentile(values: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(values, [0.5 - level / 2, 0.5 + level / 2])
    return float(low), float(high)


def _method_status(data: MethodData, n_seeds: int) -> str:
    censored = data.censored.astype(bool)
    if censored.all():
        return f"inconclusive: every one of the {censored.size} runs was censored (the target was never reached)"
    reached = sorted({int(b) for b, c in zip(data.batch, censored) if not c})
    if len(data.batch_sizes) < MIN_BATCH_SIZES or len(reached) < MIN_BATCH_SIZES:
        return (f"inconclusive: needs >= {MIN_BATCH_SIZES} batch sizes at which some run reached the target "
                f"(3 parameters: S_min, B_crit, sigma), got {len(reached)} ({', '.join(map(str, reached)) or 'none'})")
    if n_seeds < MIN_SEEDS:
        return f"inconclusive: needs >= {MIN_SEEDS} seeds for a seed-bootstrap CI, got {n_seeds}"
    return "ok"


def _cells(rows: Sequence[Mapping], metric: str) -> list[dict]:
    cells = []
    for b, runs in by_batch_size(rows).items():
        reached = [r[metric] for r in runs if not r["censored"]]
        cell = {"batch_size": b, "n": len(runs), "censored": sum(r["censored"] for r in runs),
                "median_steps": float(np.median(reached)) if reached else None,
                "geomean_steps": float(np.exp(np.mean(np.log(reached)))) if reached else None,
                "max_steps": max(r["max_steps"] for r in runs)}
        # the gradient noise scale and the divergence meter's off-diagonal share, where the runs measured them
        for column in ("b_simple", "b_simple_init", "off_diagonal_share_init", "off_diagonal_share_last"):
            values = [float(r[column]) for r in runs if r.get(column) not in (None, "")]
            values = [v for v in values if math.isfinite(v)]
            if values:
                cell[column] = float(np.median(values))
                cell[f"{column}_n"] = len(values)
        cells.append(cell)
    return cells


def _method_summary(fit: CurveFit, data: MethodData, alpha: float, n_boot: int) -> dict:
    """Estimates (fit row 0), jackknife t intervals (rows 1..G), bootstrap percentile intervals (the rest)."""
    g = len(data.seeds)
    log_c, log_s = float(fit.log_b_crit[0]), float(fit.log_s_min[0])
    grid = _grid(data.batch_sizes)
    result = {"b_crit": math.exp(log_c), "s_min": math.exp(log_s), "e_min": math.exp(log_c + log_s),
              "sigma": float(fit.sigma[0]),
              "search_range": [float(np.exp(grid[0])), float(np.exp(grid[-1]))]}
    # Seed shift and run noise (moments of the reached runs' residuals; for the calibration's layout).
    reached = ~data.censored.astype(bool)
    residual = data.log_steps - (log_s + np.log1p(math.exp(log_c) / data.batch.astype(np.float64)))
    groups = [residual[reached & (data.seed_index == i)] for i in sorted(set(data.seed_index.tolist()))]
    groups = [r for r in groups if r.size]
    within = sum(float(np.sum((r - r.mean()) ** 2)) for r in groups)
    df_within = sum(r.size - 1 for r in groups)
    if df_within > 0 and len(groups) >= 2:
        noise_var = within / df_within
        mean_size = float(np.mean([r.size for r in groups]))
        seed_var = float(np.var([r.mean() for r in groups], ddof=1)) - noise_var / mean_size
        result["noise_sd"], result["seed_sd"] = math.sqrt(noise_var), math.sqrt(max(seed_var, 0.0))
    present = sorted(set(data.seed_index.tolist()))
    jack = 1 + np.array(present)
    edges = bool(fit.at_edge[0]) or bool(fit.at_edge[jack].any())
    if not fit.valid[jack].all():
        result.update(resolved=False, ci_status="no CI: leaving out one seed left too few batch sizes with a "
                                                "reached target to fit")
        return result
    if edges:
        side = "above" if log_c > 0.5 * (grid[0] + grid[-1]) else "below"
        result.update(resolved=False, ci_status=(
            f"not resolved by the batch sizes: the fit (or a leave-one-seed-out refit) puts B_crit on the edge of "
            f"the search range [{result['search_range'][0]:.3g}, {result['search_range'][1]:.3g}] ({side}); "
            "the reported B_crit is that edge, a bound, not an estimate"))
        return result
    result["resolved"] = True
    quantile = float(_t_quantile(1 - alpha / 2, len(present) - 1))
    for name, estimate, replicates in (("b_crit", log_c, fit.log_b_crit[jack]),
                                       ("s_min", log_s, fit.log_s_min[jack]),
                                       ("e_min", log_c + log_s, fit.log_b_crit[jack] + fit.log_s_min[jack])):
        se = stats.jackknife_se(replicates)
        prefix = "" if name == "b_crit" else f"{name}_"
        result[f"{prefix}ci_low"] = math.exp(estimate - quantile * se)
        result[f"{prefix}ci_high"] = math.exp(estimate + quantile * se)
        result[f"{prefix}log_se"] = se
    if n_boot:
        boot = slice(1 + g, 1 + g + n_boot)
        ok = fit.valid[boot]
        if ok.mean() >= 1 - MAX_FAILED_RESAMPLES:
            low, high = _percentile(fit.log_b_crit[boot][ok], 1 - alpha)
            result["boot_ci_low"], result["boot_ci_high"] = math.exp(low), math.exp(high)
        result["boot_failed"] = float(1 - ok.mean())
    return result


def _t_quantile(q: float, df: int) -> float:
    return float(special.stdtrit(df, q))


def _ratio(fc: CurveFit, fb: CurveFit, seeds_c: set, seeds_b: set, n_seeds: int, alpha: float,
           n_boot: int) -> dict:
    """The one-sided jackknife t test of log(B_crit(c)/B_crit(b)) < 0 and its classification: the
    test first (smaller, then whether the 1 - 2 alpha interval lies inside the band), then
    equivalence, then larger. ``_replicates``: the leave-one-seed-out log ratios by seed position
    (for the trend along a ladder, keyed by seed by the caller; not reported)."""
    estimate = float(fc.log_b_crit[0] - fb.log_b_crit[0])
    present = sorted(seeds_c | seeds_b)
    jack = 1 + np.array(present)
    replicates = fc.log_b_crit[jack] - fb.log_b_crit[jack]
    se = stats.jackknife_se(replicates)
    df = len(present) - 1
    t = estimate / se if se > 0 else math.copysign(math.inf, estimate) if estimate else 0.0
    p = float(special.stdtr(df, t))
    half, half2 = _t_quantile(1 - alpha / 2, df) * se, _t_quantile(1 - alpha, df) * se
    margin = -math.log(RATIO_MARGIN)
    low2, high2 = estimate - half2, estimate + half2
    inside = -margin < low2 and high2 < margin
    if p < alpha:
        kind = SMALLER_WITHIN_MARGIN if inside else SMALLER
    elif inside:
        kind = EQUIVALENT
    elif low2 > 0:
        kind = LARGER
    else:
        kind = UNCLEAR
    out = {"status": "ok", "ratio": math.exp(estimate), "ci_low": math.exp(estimate - half),
           "ci_high": math.exp(estimate + half), "ci_low_one_sided": math.exp(low2),
           "ci_high_one_sided": math.exp(high2), "log_se": se, "df": df, "t": t, "p": p, "class": kind,
           "_replicates": dict(zip(present, replicates.tolist()))}
    if n_boot:
        boot = slice(1 + n_seeds, 1 + n_seeds + n_boot)
        ok = fc.valid[boot] & fb.valid[boot]
        if ok.mean() >= 1 - MAX_FAILED_RESAMPLES:
            low, high = _percentile(fc.log_b_crit[boot][ok] - fb.log_b_crit[boot][ok], 1 - alpha)
            out["boot_ci_low"], out["boot_ci_high"] = math.exp(low), math.exp(high)
    return out


def decision_rule(settings: AnalysisSettings) -> str:
    """The steps-to-target decision rule, in words (one clause a line)."""
    margin, alpha = RATIO_MARGIN, settings.alpha
    return "\n".join([
        "Model per method: log S = log S_min + log(1 + B_crit/B) + e, e ~ N(0, sigma^2) (median steps "
        "S(B) = S_min (1 + B_crit/B), examples E(B) = E_min (1 + B/B_crit), E_min = S_min B_crit); a run "
        "censored at max_steps enters as log S > log max_steps (censored maximum likelihood).",
        f"{roles_clause(settings)} Other methods are reported without a verdict.",
        "Uncertainty: leave-one-seed-out jackknife of log B_crit (and of log S_min, log E_min), t with seeds-1 "
        f"df; a method needs >= {MIN_SEEDS} seeds and >= {MIN_BATCH_SIZES} batch sizes at which some run reached "
        "the target, else it is inconclusive with the reason; a B_crit whose fit (or a leave-one-seed-out refit) "
        "ends on the edge of the search range (3 doublings beyond the batch sizes) is unresolved: a bound, no CI.",
        f"Per pair (corrected c, baseline b), r = B_crit(c)/B_crit(b), log r with the paired jackknife (a seed "
        f"left out of both). The margin: ratios within [{margin:.3f}, {1 / margin:.3f}] (half a doubling either "
        "way) are differences too small to matter in practice: a batch size half a doubling off the critical one "
        "costs at most about 1.2x the minimum steps or examples, within the run-to-run spread of S. The test "
        f"comes first: if the one-sided t test of H1: r < 1 has p < alpha = {alpha:g}, the pair is 'smaller' when "
        f"its {1 - 2 * alpha:.0%} interval is not inside the band, 'smaller_within_margin' when it is; otherwise "
        f"'equivalent' if the {1 - 2 * alpha:.0%} interval lies inside the band, 'larger' if it lies above 1, else "
        "'unclear' (also when either B_crit is unresolved).",
        "Corrected layer: supported if smaller (either kind) against every baseline (intersection-union: each test "
        "at alpha, no adjustment), and the report says whether the effect exceeds the margin; contradicted if "
        "'equivalent' or 'larger' against some baseline; inconclusive otherwise.",
        "A method with a diverged run or a run whose chosen learning rate sits on its grid's edge makes its pairs "
        "inconclusive (the steps may reflect the LR grid, not the layer).",
        "Joint verdict of the prediction: supported if every corrected layer is supported; contradicted if some "
        "corrected layer is contradicted and none supported; mixed if both occur; inconclusive otherwise. "
        "A false joint 'supported' needs every one of its tests to err, so its rate is at most alpha. The primary "
        "group's joint verdict is the study's; other groups are sensitivity analyses.",
        "Descriptive, not in the rule: the paired seed-bootstrap percentile intervals, the gradient noise scale.",
    ])


def _flags(rows: Sequence[Mapping]) -> str:
    diverged = sorted({r["batch_size"] for r in rows if r.get("diverged")})
    edges = sorted({r["batch_size"] for r in rows if r.get("lr_at_grid_edge")})
    parts = []
    if diverged:
        parts.append(f"{sum(1 for r in rows if r.get('diverged'))} diverged run(s) (batch sizes "
                     f"{', '.join(map(str, diverged))})")
    if edges:
        parts.append(f"{sum(1 for r in rows if r.get('lr_at_grid_edge'))} run(s) with the chosen LR on the grid "
                     f"edge (batch sizes {', '.join(map(str, edges))})")
    return "; ".join(parts)


def analyse_group(rows: Sequence[Mapping], settings: AnalysisSettings, *, label: str = "") -> dict:
    """Fits, ratios and verdicts of one group of typed rows (see :func:`check_target_records`) by
    ``settings`` (metric, roles, alpha, n_boot, seed); ``label`` seeds its bootstrap resamples (the
    same at every target: paired along a ladder)."""
    metric, alpha, n_boot = settings.metric, settings.alpha, settings.n_boot
    by_method = defaultdict(list)
    for row in rows:
        by_method[row["method"]].append(row)
    seeds = tuple(sorted({row["seed"] for row in rows}))
    seed_position = {s: i for i, s in enumerate(seeds)}
    g = len(seeds)
    # Row 0: the data; rows 1..G: leave one seed out (jackknife); then the paired bootstrap resamples.
    weights = [np.ones((1, g)), 1.0 - np.eye(g)]
    if n_boot:
        weights.append(rng(settings.seed, label, "seed-bootstrap").multinomial(
            g, np.full(g, 1.0 / g), size=n_boot).astype(np.float64))
    weights = np.vstack(weights)
    role = {m: role_of(m, settings) for m in by_method}
    methods, fits, seed_sets = {}, {}, {}
    for method in in_role_order(role):
        runs = sorted(by_method[method], key=lambda r: (r["batch_size"], r["seed"]))
        data = MethodData(np.array([r["batch_size"] for r in runs]), np.array([r["log_steps"] for r in runs]),
                          np.array([bool(r["censored"]) for r in runs]),
                          np.array([seed_position[r["seed"]] for r in runs]), seeds)
        n_seeds = len({r["seed"] for r in runs})
        result = {"role": role[method], "n_runs": len(runs), "n_seeds": n_seeds, "batch_sizes": data.batch_sizes,
                  "censored": int(data.censored.sum()), "cells": _cells(runs, metric)}
        flags = _flags(runs)
        if flags:
            result["flags"] = flags
        status = _method_status(data, n_seeds)
        result["status"] = status
        if status == "ok":
            fit = fit_curve(data, weights)
            result.update(_method_summary(fit, data, alpha, n_boot))
            if result["resolved"]:
                fits[method] = fit
                seed_sets[method] = set(data.seed_index.tolist())
        methods[method] = result

    ratios: dict[str, dict] = {}
    for c in (m for m in methods if role[m] == "corrected"):
        ratios[c] = {}
        for b in (m for m in methods if role[m] == "baseline"):
            missing = [m for m in (c, b) if m not in fits]
            if missing:
                ratios[c][b] = {"class": UNCLEAR, "status": "no ratio: " + "; ".join(
                    f"{m}: {methods[m].get('ci_status', methods[m]['status'])}" for m in missing)}
                continue
            ratios[c][b] = pair = _ratio(fits[c], fits[b], seed_sets[c], seed_sets[b], g, alpha, n_boot)
            pair["_replicates"] = {seeds[i]: value for i, value in pair["_replicates"].items()}  # by seed

    for method, result in methods.items():
        if role[method] == "other":
            result["verdict"], result["reason"] = NO_PREDICTION, "not a corrected layer nor a baseline"
        elif role[method] == "baseline":
            result["verdict"], result["reason"] = REFERENCE, "baseline: its B_crit is the reference of the ratios"
        else:
            result["verdict"], result["reason"] = _corrected_verdict(method, ratios.get(method, {}), methods, alpha)
    verdicts = [methods[m]["verdict"] for m in methods if role[m] == "corrected"]
    verdict = joint(verdicts)
    reason = "; ".join(f"{m}: {methods[m]['verdict']}" for m in methods if role[m] == "corrected") or \
        "no corrected layer in the data"
    return {"critical_batch": methods, "ratios": ratios, "prediction": {"verdict": verdict, "reason": reason}}


def _corrected_verdict(method: str, pairs: Mapping[str, Mapping], methods: Mapping[str, Mapping],
                       alpha: float) -> tuple[str, str]:
    if methods[method]["status"] != "ok":
        return INCONCLUSIVE, methods[method]["status"].removeprefix("inconclusive: ")
    if not pairs:
        return INCONCLUSIVE, "no baseline in this group to compare with"
    flagged = [m for m in (method, *pairs) if methods[m].get("flags")]
    if flagged:
        return INCONCLUSIVE, "; ".join(f"{m}: {methods[m]['flags']}" for m in flagged)
    kinds = {b: p["class"] for b, p in pairs.items()}
    against = [b for b, k in kinds.items() if k in (EQUIVALENT, LARGER)]
    if against:
        return CONTRADICTED, "; ".join(
            f"B_crit ratio vs {b} {kinds[b]} ({pairs[b]['ratio']:.3g}, {1 - 2 * alpha:.0%} interval "
            f"[{pairs[b]['ci_low_one_sided']:.3g}, {pairs[b]['ci_high_one_sided']:.3g}])" for b in against)
    if all(k in (SMALLER, SMALLER_WITHIN_MARGIN) for k in kinds.values()):
        return SUPPORTED, "B_crit smaller than that of " + ", ".join(
            f"{b} (ratio {pairs[b]['ratio']:.3g}, p = {pairs[b]['p']:.3g}; "
            + ("not shown within the margin" if kinds[b] == SMALLER else "within the margin") + ")" for b in kinds)
    unclear = [b for b, k in kinds.items() if k == UNCLEAR]
    return INCONCLUSIVE, "ratio unclear against " + ", ".join(
        f"{b}" + (f" ({pairs[b]['status']})" if pairs[b].get("status", "ok") != "ok" else
                  f" (ratio {pairs[b]['ratio']:.3g}, p = {pairs[b]['p']:.3g})") for b in unclear)


def target_key(target: float | None) -> str:
    """A target as the keys of ``by_target`` write it: the shortest text that reads back as the
    same float ("0.84"), "" for records without a target."""
    return "" if target is None else repr(float(target))


def trend(by_target: Mapping[str, Mapping], corrected: str, baseline: str, alpha: float) -> dict:
    """The trend of log r = log(B_crit(c)/B_crit(b)) along the ladder: the least-squares slope of
    log r on the target over the targets where the ratio was estimated, per ``TREND_STEP`` of
    target, with a leave-one-seed-out jackknife t interval on seeds-1 df (the same seed left out
    at every target: seeds are the clusters). Needs >= 3 targets."""
    points = [(float(t), content["ratios"].get(corrected, {}).get(baseline, {})) for t, content in by_target.items()]
    points = sorted((t, r) for t, r in points if r.get("status") == "ok")
    if len(points) < 3:
        return {"status": f"no trend: the ratio was estimated at {len(points)} target(s), needs >= 3"}
    x = np.array([t for t, _ in points]) / TREND_STEP
    seeds = sorted(set.intersection(*(set(r["_replicates"]) for _, r in points)))
    if len(seeds) < MIN_SEEDS:
        return {"status": f"no trend: {len(seeds)} seed(s) common to every target, needs >= {MIN_SEEDS}"}

    def slope(y: np.ndarray) -> np.ndarray:
        xc = x - x.mean()
        return (y - y.mean(axis=-1, keepdims=True)) @ xc / float(xc @ xc)

    estimate = float(slope(np.array([math.log(r["ratio"]) for _, r in points])))
    replicates = slope(np.array([[r["_replicates"][s] for _, r in points] for s in seeds]))
    se = stats.jackknife_se(replicates)
    df = len(seeds) - 1
    t = estimate / se if se > 0 else math.copysign(math.inf, estimate) if estimate else 0.0
    half = _t_quantile(1 - alpha / 2, df) * se
    return {"status": "ok", "targets": [t for t, _ in points], "per": TREND_STEP, "log_slope": estimate,
            "ci_low": estimate - half, "ci_high": estimate + half, "factor": math.exp(estimate),
            "factor_ci_low": math.exp(estimate - half), "factor_ci_high": math.exp(estimate + half),
            "log_se": se, "df": df, "p": float(2 * special.stdtr(df, -abs(t)))}


@dataclass(frozen=True)
class TargetAnalysis:
    """The steps-to-target analysis; :meth:`to_dict` is the content of summary.json.

    ``by_target``: {target key: {group: analyse_group(...)}}; ``groups`` is the primary target's
    entry; ``trends``: {group: {corrected: {baseline: trend}}} along the ladder."""

    settings: dict
    decision_rule: str
    groups: dict  # {group: analyse_group(...)} at the primary target
    primary_group: str
    overall: dict = field(default_factory=dict)  # {method: verdict across groups}
    primary_target: float | None = None
    by_target: dict = field(default_factory=dict)
    trends: dict = field(default_factory=dict)

    design = STEPS_TO_TARGET

    @property
    def primary(self) -> dict:
        """The primary group's results at the primary target."""
        return self.groups[self.primary_group]

    @property
    def prediction(self) -> dict:
        """The joint verdict of the primary group at the primary target (the study's verdict)."""
        return self.primary["prediction"]

    def to_dict(self, provenance: Mapping | None = None) -> dict:
        primary = self.primary
        methods = {m: {"role": r["role"], "verdict": self.overall[m],
                       "groups": {g: c["critical_batch"][m]["verdict"] for g, c in self.groups.items()
                                  if m in c["critical_batch"]}}
                   for m, r in primary["critical_batch"].items()}
        return json_ready({
            "schema_version": 2,
            "design": self.design,
            "decision_rule": self.decision_rule,
            "provenance": dict(provenance or {}),
            "settings": self.settings,
            "primary_group": self.primary_group,
            "prediction": {**primary["prediction"], "rule": self.decision_rule, "group": self.primary_group},
            "critical_batch": primary["critical_batch"],
            "ratios": primary["ratios"],
            "methods": methods,
            "overall": self.overall,
            "groups": self.groups,
            "primary_target": self.primary_target,
            "by_target": {t: {k: groups[self.primary_group][k] for k in ("critical_batch", "ratios", "prediction")}
                          for t, groups in self.by_target.items() if self.primary_group in groups},
            "trends": self.trends.get(self.primary_group, {}),
        })


def _problems(rows: Sequence[Mapping]) -> list[str]:
    """Why records cannot give a curve at all (the report says so, never a fitted number)."""
    problems = []
    if all(r["censored"] for r in rows):
        problems.append(f"no run reached the target: all {len(rows)} runs are censored at their max_steps "
                        f"({', '.join(map(str, sorted({r['max_steps'] for r in rows})))}); lower the target or raise "
                        "max_steps")
    batch_sizes = sorted({r["batch_size"] for r in rows})
    if len(batch_sizes) < MIN_BATCH_SIZES:
        problems.append(f"a steps-vs-batch-size curve needs >= {MIN_BATCH_SIZES} batch sizes, got {batch_sizes}")
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) < MIN_SEEDS:
        problems.append(f"confidence intervals need >= {MIN_SEEDS} seeds, got {len(seeds)} ({seeds})")
    return problems


def _primary_target(rows: Sequence[Mapping], targets: Sequence[float | None], given: float | None) -> float | None:
    """The given primary target (one of the records'), else the records' own ``primary_target``
    when they agree on one, else the highest target."""
    if given is not None:
        if not any(t is not None and math.isclose(t, given, rel_tol=0, abs_tol=1e-12) for t in targets):
            raise ValueError(f"primary_target {given!r} is not among the records' targets "
                             f"{[t for t in targets if t is not None]}")
        return next(t for t in targets if t is not None and math.isclose(t, given, rel_tol=0, abs_tol=1e-12))
    named = {float(r["primary_target"]) for r in rows if r.get("primary_target") not in (None, "")}
    if len(named) == 1 and named <= set(targets):
        return named.pop()
    return max((t for t in targets if t is not None), default=None)


def _grouped(rows: Sequence[Mapping], group_by: str | None) -> tuple[dict, bool]:
    """{target: {group: rows}} and whether ``group_by`` split them; ValueError on a record without a
    group value or a second run in a cell."""
    has_group = group_by is not None and any(group_by in r for r in rows)
    grouped = defaultdict(lambda: defaultdict(list))
    seen = set()
    for number, row in enumerate(rows, start=1):
        if has_group and row.get(group_by) in (None, ""):
            raise ValueError(f"record {number}: no value for the group column {group_by!r} (other records have one)")
        group = str(row[group_by]) if has_group else "all"
        key = (group, row.get("target"), row["method"], row["batch_size"], row["seed"])
        if key in seen:
            target = "" if row.get("target") is None else f", target={row['target']!r}"
            raise ValueError(f"record {number}: a second run for group={group!r}, method={row['method']!r}, "
                             f"batch_size={row['batch_size']}, seed={row['seed']}{target}; expected one run per cell")
        seen.add(key)
        grouped[row.get("target")][group].append(row)
    return grouped, has_group


def _trends(by_target: Mapping[str, dict], groups: Mapping[str, dict], alpha: float) -> dict:
    """{group: {corrected: {baseline: trend}}} along the ladder; then drops the jackknife replicates."""
    trends = {}
    for g in groups:
        ladder = {t: content[g] for t, content in by_target.items() if g in content and t}
        trends[g] = {c: {b: trend(ladder, c, b, alpha) for b in against}
                     for c, against in groups[g]["ratios"].items()} if len(ladder) > 1 else {}
    for content in (c for t in by_target.values() for c in t.values()):  # the jackknife stays inside
        for against in content["ratios"].values():
            for pair in against.values():
                pair.pop("_replicates", None)
    return trends


def analyse_target(records: Sequence[Mapping], settings: AnalysisSettings, *,
                   progress: Callable[[str], None] | None = None) -> TargetAnalysis:
    """Fit B_crit per method (and group) at every target of the records (their ``target``
    column: a ladder), the ratios, their verdicts and their trend along the ladder (see the
    module docstring), by ``settings``
    (:class:`~affdiv.experiments.analysis.settings.AnalysisSettings` whose metric is
    ``steps_to_target``). ``settings.primary_target``: the target whose verdict is the study's
    (default: the records' ``primary_target``, else the highest). ``settings.n_boot``: 0 for no
    bootstrap, else at least 200 draws are taken. The fixed-budget settings (margins,
    sensitivity, test_baselines, higher_is_better) do not apply: fewer steps are better.
    ``progress``: called with a line before each target's fits.
    """
    if settings.design != STEPS_TO_TARGET:
        raise ValueError(f"settings: metric {settings.metric!r} is the {settings.design} design; analyse it with "
                         "decision.analyse")
    if not records:
        raise ValueError("no records to analyse")
    settings = settings.replace(n_boot=max(settings.n_boot, 200) if settings.n_boot else 0)
    rows = check_target_records(records, metric=settings.metric)
    grouped, has_group = _grouped(rows, settings.group_by)
    targets = sorted(grouped, key=lambda t: -1.0 if t is None else t)
    primary_target = _primary_target(rows, targets, settings.primary_target)
    by_target, problems = {}, {}
    for target in targets:
        name = target_key(target)
        if progress is not None:
            progress(f"fitting the curves at target {name or '(one)'} ...")
        problems[name] = _problems([r for g in grouped[target].values() for r in g])
        by_target[name] = {g: analyse_group(grouped[target][g], settings, label=g) for g in sorted(grouped[target])}
        for content in by_target[name].values():
            if problems[name]:
                content["prediction"]["reason"] = "inconclusive: " + "; ".join(problems[name])
    groups = by_target[target_key(primary_target)]
    primary_group = settings.primary_group
    if primary_group is None:
        primary_group = default_primary_group({g: {r["seed"] for r in grouped[primary_target][g]} for g in groups})
    elif primary_group not in groups:
        raise ValueError(f"primary_group {primary_group!r} is not among the groups {sorted(groups)}")
    trends = _trends(by_target, groups, settings.alpha)
    names = sorted({m for g in groups.values() for m in g["critical_batch"]})
    verdicts = {m: overall([g["critical_batch"][m]["verdict"] for g in groups.values() if m in g["critical_batch"]])
                for m in names}
    summary = {"metric": settings.metric, "design": STEPS_TO_TARGET, "alpha": settings.alpha,
               "corrected": list(settings.corrected), "baselines": list(settings.baselines),
               "group_by": settings.group_by if has_group else None, "n_boot": settings.n_boot,
               "seed": settings.seed, "n_records": len(rows), "ratio_margin": RATIO_MARGIN,
               "grid_doublings": GRID_DOUBLINGS, "higher_is_better": False,
               "problems": problems[target_key(primary_target)],
               "targets": [t for t in targets if t is not None], "primary_target": primary_target}
    return TargetAnalysis(summary, decision_rule(settings), groups, primary_group, verdicts, primary_target,
                          by_target, trends)


# ------------------------------------------------------------------------------ simulation
def simulate_target_records(curves: Mapping[str, tuple[float, float]], *, batch_sizes: Sequence[int],
                            seeds: Sequence[int], sigma: float, seed_sd: float = 0.0, max_steps: int | None = None,
                            rng: np.random.Generator, shared_seed_effect: bool = True) -> list[dict]:
    """Records from the model of this module: {method: (S_min, B_crit)}; log-normal noise of s.d.
    ``sigma`` per run plus a per-seed shift of s.d. ``seed_sd`` (shared by the methods of a seed when
    ``shared_seed_effect``: the paired design); censored at ``max_steps``."""
    common = rng.normal(0.0, seed_sd, size=len(seeds))
    records = []
    for method, (s_min, b_crit) in curves.items():
        shift = common if shared_seed_effect else rng.normal(0.0, seed_sd, size=len(seeds))
        for i, s in enumerate(seeds):
            for b in batch_sizes:
                steps = s_min * (1 + b_crit / b) * math.exp(shift[i] + rng.normal(0.0, sigma))
                steps = max(1, int(math.ceil(steps)))
                limit = max_steps if max_steps is not None else 10 ** 9
                records.append({"method": method, "batch_size": b, "seed": s, "max_steps": limit,
                                TARGET_METRIC: steps if steps <= limit else None,
                                "censored": int(steps > limit)})
    return records

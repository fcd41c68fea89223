"""The primary estimand of a fixed budget (epochs or steps): how far each method falls from its best
batch size to the largest one, and whether a corrected layer falls further than each baseline.

Why not the slope: the metric is rarely linear in log2(batch size) (under an epoch budget it peaks
and then falls as the steps run out), so the per-doubling slope mixes curvature with trend and a
planted inverted U can read as "rises". The contrast below assumes no shape.

* Per method m, Delta_m = P_m(B_max) - max_B P_m(B): the performance P (the metric, or minus the
  metric when lower is better) at the largest batch size minus that at the method's best one.
* Selection bias. The best batch size picked on the same runs makes Delta biased downwards
  (E max_B of noisy means >= max_B of the true ones): a flat curve would look like a fall. We
  *cross-fit* it, leave one seed out: for seed s, the best batch size b*(-s) is the argmax of the
  mean performance over the *other* seeds, and seed s contributes d_s = P_s(B_max) - P_s(b*(-s)).
  Batch sizes whose means agree to rounding are tied (accuracies come in steps of 1/test-set size),
  and a tie goes to the smaller batch size.
  Seed s's noise never chooses its own comparison, so E d_s = P(B_max) - P(b*(-s)) >= Delta_m: the
  estimate errs towards 0 (towards "no fall"), never towards a fall. Choosing on the validation
  split of the same runs would not remove the bias (a run's validation and test metrics share its
  init and shuffle noise), and a record CSV need not carry a validation column; a fixed split of
  the seeds into a selection and an estimation half would halve the seeds of each.
* Estimate: mean of d_s over the seeds that ran B_max and b*(-s). Its standard error is NOT the
  one of d_s as if independent: every seed's selection uses the other seeds, so the d_s share
  their selections and are positively correlated (on simulated studies with a flat curve the naive
  one-sample t rejected a true null 11-12% of the time at alpha = 0.05). The standard error is
  the leave-one-seed-out jackknife of the *whole* cross-fitted estimator (seed t left out, the
  cross-fitting redone on the others; all t at once, in O(seeds) unless the choices are near a
  tie), with t on (seeds - 1) df: 1.7-4.4% at alpha = 5% on the
  same simulations (conservative; see the report's calibration for its power).
* Difference in differences against a baseline b: DiD = Delta(m) - Delta(b), its jackknife
  replicates the paired differences of the two methods' replicates (a seed is the same data split,
  init and shuffles for every method); t with (seeds - 1) df. The
  budget's own effect of B (fewer steps at larger B under an epoch budget) is shared by the methods
  and cancels here; it does not cancel in Delta_m alone.
* Lack of fit of the linear trend: per complete seed, the orthonormal polynomial contrasts of
  degree 2 .. J-1 of its J performances (in x = log2 B); F = G * sum_k mean_k^2 / sum_k var_k
  on (J-2, (J-2)(G-1)) df, the univariate repeated-measures test, exact when the runs' noise is
  independent with equal variance (seed intercepts and seed slopes drop out of these contrasts).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import special
from scipy import stats as _st

from affdiv.experiments.analysis import stats
from affdiv.vocabulary import CONTRADICTED, EQUIVALENT, INCONCLUSIVE, MIXED, NO_PREDICTION, SUPPORTED, UNCLEAR

NOT_TESTED = "not tested"
FASTER, SLOWER = "falls faster", "falls slower"
FALLS, RISES, FLAT = "falls", "rises", "flat"


def default_contrast_margin(values: Sequence[float], higher_is_better: bool) -> tuple[float, str]:
    """The equivalence margin of the contrasts when none is given, and why.

    A score in [0, 1] (accuracy): 0.01, one percentage point between the largest and the best batch
    size (about twice a cell's seed-to-seed s.d. in the committed Fashion-MNIST run). Anything else:
    2% of the median |metric|.
    """
    return stats.scale_margin(values, higher_is_better, accuracy=0.01, fraction=0.02, per="between two batch sizes",
                              name="a contrast margin", argument="contrast_margin")


def _table(rows: Sequence[Mapping], metric: str, sign: float) -> tuple[list, list, np.ndarray]:
    """(seeds, batch sizes, the (seeds x batch sizes) table of the performance sign * metric, NaN
    where the seed did not run the batch size)."""
    seeds = sorted({r["seed"] for r in rows})
    batch_sizes = sorted({r["batch_size"] for r in rows})
    row_of = {s: i for i, s in enumerate(seeds)}
    column_of = {b: j for j, b in enumerate(batch_sizes)}
    table = np.full((len(seeds), len(batch_sizes)), np.nan)
    table[[row_of[r["seed"]] for r in rows], [column_of[r["batch_size"]] for r in rows]] = [
        sign * r[metric] for r in rows]
    return seeds, batch_sizes, table


def _complete_seeds(rows: Sequence[Mapping], metric: str, sign: float) -> tuple[list, np.ndarray]:
    """(batch sizes, the rows of :func:`_table` of the seeds that ran every batch size). A NaN
    metric counts as a missing run: its seed is left out (so are :func:`lack_of_fit`'s and
    :func:`noise_components`' inputs)."""
    _, batch_sizes, table = _table(rows, metric, sign)
    return batch_sizes, table[~np.isnan(table).any(1)]


def _t_sf(t: float, df: float) -> float:
    """P(T > t), T ~ t(df) (scipy.special: ~100x faster than scipy.stats in the calibration loops)."""
    return float(special.stdtr(df, -t))


def _summary(estimate: float, se: float, df: float, alpha: float, margin: float) -> dict:
    """CIs, one-sided and TOST p-values of a t(df) estimate (as :class:`stats.Estimate`, faster)."""
    def t_of(null: float) -> float:
        if se > 0:
            return (estimate - null) / se
        return math.copysign(math.inf, estimate - null) if estimate != null else 0.0

    half, half2 = float(special.stdtrit(df, 1 - alpha / 2)) * se, float(special.stdtrit(df, 1 - alpha)) * se
    return {"estimate": estimate, "se": se, "df": df, "ci_low": estimate - half, "ci_high": estimate + half,
            "tost_ci_low": estimate - half2, "tost_ci_high": estimate + half2,
            "p_less": _t_sf(-t_of(0.0), df), "p_greater": _t_sf(t_of(0.0), df),
            "p_equivalent": max(_t_sf(t_of(-margin), df), _t_sf(-t_of(margin), df))}


#: Elements of one block of the leave-two-seeds-out means (8 MB of float64 a temporary).
_BLOCK = 1 << 20
#: Up to this many leave-two-seeds-out means (seeds^2 x batch sizes), all of them are computed.
_ALL_PAIRS_UP_TO = 1 << 12
_EPS = float(np.finfo(np.float64).eps)


def _column_sums(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(present, filled, S, n) of a (seeds x batch sizes) table, NaN = not run: p_sj = whether seed s
    ran batch size j, x_sj its performance (0 where not run), S_j = sum_s x_sj, n_j = sum_s p_sj."""
    present = ~np.isnan(table)
    filled = np.where(present, table, 0.0)
    return present, filled, filled.sum(0), present.sum(0)


def _tie_tolerance(filled: np.ndarray) -> float:
    """8 (G + 2) eps max|x| (``filled``: :func:`_column_sums`'): a bound on the rounding error of a
    mean of the G seeds' performances x less one or two of them, however it is summed. Two batch
    sizes whose means agree within it are tied (accuracies are multiples of 1/test-set size, so exact
    ties occur, and rounding must not break them)."""
    return 8 * (filled.shape[0] + 2) * _EPS * float(np.abs(filled).max())


def _mean_of_rest(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """sums / counts of what is left of a column after seeds are taken out: -inf where no seed is left
    (or the arithmetic left the floats), so that it is never chosen."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        means = sums / counts
    return np.where(np.isfinite(means), means, -np.inf)


def _contrast_at_best(largest: np.ndarray, values: np.ndarray, means: np.ndarray,
                      tol: float) -> tuple[np.ndarray, np.ndarray]:
    """d = largest - values[..., b] at the best batch size b: the first whose means[..., b] is within
    ``tol`` of the largest mean (ties: the smallest batch size); NaN where the seed lacks one of the
    two or no batch size has a seed to choose on (every mean -inf). Returns (d, b). The last axis of
    ``values`` and ``means`` runs over the candidate batch sizes in increasing order."""
    top = means.max(-1, keepdims=True)
    chosen = (means >= top - tol).argmax(-1)
    with np.errstate(invalid="ignore", over="ignore"):
        d = largest - np.take_along_axis(values, chosen[..., None], -1)[..., 0]
    return np.where(np.isfinite(top[..., 0]), d, np.nan), chosen


def _cross_fit(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-seed-out contrasts of a (seeds x batch sizes) performance table (NaN = not run):
    seed s chooses b*(-s) = argmax_j (S_j - x_sj) / (n_j - p_sj), the mean over the other seeds
    (:func:`_column_sums`; ties within :func:`_tie_tolerance`: the smallest j), and contributes
    d_s = x_s(B_max) - x_s(b*(-s)). Returns (d, b*) per seed, NaN / -1 where the seed lacks the
    largest or its chosen batch size."""
    present, filled, sums, counts = _column_sums(table)
    d, chosen = _contrast_at_best(table[:, -1], table, _mean_of_rest(sums - filled, counts - present),
                                  _tie_tolerance(filled))
    return d, np.where(np.isfinite(d), chosen, -1)


def _settled_choices(table: np.ndarray, present: np.ndarray, rest_sums: np.ndarray, rest_counts: np.ndarray,
                     tol: float) -> tuple[np.ndarray, np.ndarray]:
    """(settled, contenders): which seeds choose the same batch size whichever other seed t is left
    out, and the batch sizes any other seed might choose.

    Leaving t out moves seed s's leave-one-out mean o_sj (over m_sj = n_j - p_sj seeds) to
    o_sj + (o_sj - x_tj) / (m_sj - 1) if t ran j, so into [lo_sj, hi_sj] = [o_sj - (max_j - o_sj) /
    (m_sj - 1), o_sj + (o_sj - min_j) / (m_sj - 1)], max_j and min_j the column's extremes (lo_sj =
    -inf where m_sj = 1: no seed left). Batch size j contends for seed s if hi_sj reaches max_k lo_sk
    less 4 tol (the tie tolerance and the rounding of the bounds); a seed with one contender is
    settled, and so is one without the largest batch size or without any other seed's runs.
    """
    means = _mean_of_rest(rest_sums, rest_counts)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        step = 1.0 / (rest_counts - 1)
        lowest = np.where(rest_counts >= 2, means - (np.where(present, table, -np.inf).max(0) - means) * step,
                          -np.inf)
        highest = np.where(rest_counts >= 2, means + (means - np.where(present, table, np.inf).min(0)) * step,
                           means)
        contends = highest >= lowest.max(1, keepdims=True) - 4 * tol
    settled = (contends.sum(1) == 1) | ~np.isfinite(means.max(1)) | ~present[:, -1]
    return settled, np.flatnonzero(contends[~settled].any(0))


def _jackknife_replicates(table: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The cross-fitted estimator redone with each seed t left out, for every t at once:
    r_t = mean over the seeds s != t with a finite d_s(-t) of d_s(-t), seed s's contrast at its best
    batch size chosen on the seeds other than s and t, argmax_j (S_j - x_sj - x_tj) / (n_j - p_sj - p_tj);
    NaN where no seed has one. ``d`` is :func:`_cross_fit`'s.

    A seed whose choice no t can change (:func:`_settled_choices`) has d_s(-t) = d_s for every t:
    O(seeds x batch sizes) for all of them. The others get their leave-two-out means exactly, on the
    batch sizes that contend, in blocks of seeds: O(seeds) each, O(seeds^2) when every seed is near
    a tie. With few seeds (``_ALL_PAIRS_UP_TO``) every seed takes the exact path: cheaper than the
    bounds.
    """
    g = table.shape[0]
    present, filled, sums, counts = _column_sums(table)
    rest_sums, rest_counts = sums - filled, counts - present  # the other seeds', per seed
    tol = _tie_tolerance(filled)
    if g * table.size <= _ALL_PAIRS_UP_TO:
        settled, columns = np.zeros(g, dtype=bool), np.arange(table.shape[1])
    else:
        settled, columns = _settled_choices(table, present, rest_sums, rest_counts, tol)
    kept = settled & np.isfinite(d)
    total = d[kept].sum() - np.where(kept, d, 0.0)  # sum over the settled seeds s != t
    count = kept.sum() - kept.astype(np.intp)
    unsettled = np.flatnonzero(~settled)
    block = max(1, _BLOCK // (g * max(columns.size, 1)))
    for start in range(0, unsettled.size, block):
        s = unsettled[start:start + block]  # rows: these seeds s; columns: every seed t
        two_out = _mean_of_rest(rest_sums[s][:, None, columns] - filled[None, :, columns],
                                rest_counts[s][:, None, columns] - present[None, :, columns])  # (s, t, columns)
        d_st, _ = _contrast_at_best(table[s, -1, None], table[s][:, None, columns], two_out, tol)
        d_st[np.arange(s.size), s] = np.nan  # t = s leaves no s
        finite = np.isfinite(d_st)
        total += np.where(finite, d_st, 0.0).sum(0)
        count += finite.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)


def method_contrast(rows: Sequence[Mapping], *, metric: str, sign: float, alpha: float, margin: float) -> dict:
    """Delta = P(B_max) - P(best B), cross-fitted by leaving one seed out, jackknife standard error
    (module docstring)."""
    seeds, batch_sizes, table = _table(rows, metric, sign)
    largest = batch_sizes[-1]
    result = {"largest": largest}
    if len(batch_sizes) < 2:
        return {**result, "status": f"insufficient data: needs >= 2 batch sizes, got {batch_sizes}"}
    means = np.nanmean(table, axis=0)
    best = int(np.argmax(means))
    result.update(in_sample_best=batch_sizes[best], in_sample=float(means[-1] - means[best]))
    d, chosen = _cross_fit(table)
    keep = np.isfinite(d)
    result["per_seed"] = {str(seeds[i]): float(d[i]) for i in np.flatnonzero(keep)}
    result["chosen"] = {str(seeds[i]): batch_sizes[chosen[i]] for i in np.flatnonzero(keep)}
    if len(seeds) < 3 or keep.sum() < 2:
        return {**result, "status": f"insufficient data: needs >= 3 seeds, >= 2 of them with the largest and the "
                                    f"cross-fitted best batch size, got {len(seeds)} and {int(keep.sum())}"}
    replicates = _jackknife_replicates(table, d)
    if not np.isfinite(replicates).all():
        return {**result, "status": "insufficient data: leaving a seed out leaves no seed with both batch sizes"}
    with np.errstate(all="ignore"):
        estimate = float(d[keep].mean())
        se = stats.jackknife_se(replicates)
    if not (math.isfinite(estimate) and math.isfinite(se)):
        return {**result, "status": "non-finite arithmetic in the contrast (metric values too large for floats)"}
    result["jackknife"] = dict(zip(map(str, seeds), replicates.tolist()))
    result.update(status="ok", n_seeds=int(keep.sum()),
                  **_summary(estimate, se, float(len(seeds) - 1), alpha, margin))
    return result


def difference_in_differences(corrected: Mapping, baseline: Mapping, *, alpha: float, margin: float) -> dict:
    """DiD = Delta(corrected) - Delta(baseline) with the paired jackknife standard error (a seed left
    out of both); needs both contrasts 'ok'."""
    if corrected.get("status") != "ok" or baseline.get("status") != "ok":
        return {"status": "insufficient data: a contrast is missing (" + "; ".join(
            f"{name}: {c.get('status')}" for name, c in (("corrected", corrected), ("baseline", baseline))
            if c.get("status") != "ok") + ")"}
    seeds = sorted(set(corrected["jackknife"]) | set(baseline["jackknife"]), key=lambda s: (len(s), s))
    replicates = np.array([corrected["jackknife"].get(s, corrected["estimate"])
                           - baseline["jackknife"].get(s, baseline["estimate"]) for s in seeds])
    return {"status": "ok", "n_seeds": len(seeds),
            **_summary(corrected["estimate"] - baseline["estimate"], stats.jackknife_se(replicates),
                       float(len(seeds) - 1), alpha, margin)}


def _classify(test: Mapping, alpha: float, *, equivalent: str, less: str, greater: str) -> str:
    """``equivalent`` if the TOST of ``test`` has p < alpha (checked first), else ``less`` or ``greater``
    if that one-sided test has, else 'unclear' (also when the test did not run)."""
    if test.get("status") != "ok":
        return UNCLEAR
    for key, label in (("p_equivalent", equivalent), ("p_less", less), ("p_greater", greater)):
        if test[key] < alpha:
            return label
    return UNCLEAR


def classify_did(did: Mapping, alpha: float) -> str:
    """'equivalent' (TOST, checked first), 'falls faster', 'falls slower' or 'unclear'."""
    return _classify(did, alpha, equivalent=EQUIVALENT, less=FASTER, greater=SLOWER)


def classify_contrast(contrast: Mapping, alpha: float) -> str:
    """'flat' (TOST, checked first), 'falls', 'rises' or 'unclear' of one method's Delta."""
    return _classify(contrast, alpha, equivalent=FLAT, less=FALLS, greater=RISES)


def lack_of_fit(rows: Sequence[Mapping], *, metric: str, sign: float = 1.0) -> dict:
    """Repeated-measures F test of the nonlinear (degree >= 2) polynomial contrasts in log2 B, on
    the seeds that ran every batch size with a metric that is not NaN (:func:`_complete_seeds`)."""
    batch_sizes, table = _complete_seeds(rows, metric, sign)
    q, g = len(batch_sizes) - 2, table.shape[0]
    if q < 1 or g < 2:
        return {"status": f"insufficient data: needs >= 3 batch sizes and >= 2 complete seeds, got "
                          f"{len(batch_sizes)} and {g}"}
    x = np.log2(np.asarray(batch_sizes, dtype=np.float64))
    basis, _ = np.linalg.qr(np.vander(x - x.mean(), len(x), increasing=True))  # orthonormal polynomials
    nonlinear = basis[:, 2:]  # (J, q): orthogonal to constants and to x
    scores = table @ nonlinear  # (G, q)
    means, variances = scores.mean(0), scores.var(0, ddof=1)
    df1, df2 = q, q * (g - 1)
    if variances.sum() == 0:
        statistic, p = (math.inf, 0.0) if np.any(means != 0) else (0.0, 1.0)
    else:
        statistic = float(g * np.sum(means ** 2) / np.sum(variances))
        p = float(_st.f.sf(statistic, df1, df2))
    quadratic = float(means[0] / np.linalg.norm(nonlinear[:, 0]))
    return {"status": "ok", "F": statistic, "df1": df1, "df2": df2, "p": p, "n_seeds": g,
            "curvature_sign": "concave (peaks inside)" if quadratic < 0 else "convex" if quadratic > 0 else "none"}


def noise_components(rows: Sequence[Mapping], *, metric: str, sign: float = 1.0) -> dict:
    """Method-of-moments decomposition of a method's runs (performance scale) around its cell means:

        P(s, B) = mu(B) + u_s + v_s (x - mean x) + e,   x = log2 B,

    u_s the seed's shift (s.d. ``seed_sd``), v_s its slope (s.d. ``slope_sd``), e the run's own noise
    (s.d. ``noise_sd``). From the complete seeds' (every batch size, no NaN: :func:`_complete_seeds`)
    two-way residuals e_sB = P - mean_s - mean_B + mean: per seed, the slope of e_s on x and the
    residual after it; noise_sd^2 = residual sum of squares / ((G-1)(J-2)); slope_sd^2 = var(seed
    slopes) - noise_sd^2 / Sxx; seed_sd^2 = var(seed means) - noise_sd^2 / J (each clipped at 0).
    Curvature (mu) never enters the noise: that was the error of the earlier calibration, which took
    its noise from the residuals of a straight line.
    """
    batch_sizes, table = _complete_seeds(rows, metric, sign)
    g, j = table.shape
    if j < 3 or g < 2:
        return {"status": f"insufficient data: needs >= 3 batch sizes and >= 2 complete seeds, got {j} and {g}"}
    x = np.log2(np.asarray(batch_sizes, dtype=np.float64))
    xc = x - x.mean()
    sxx = float(xc @ xc)
    residual = table - table.mean(1, keepdims=True) - table.mean(0, keepdims=True) + table.mean()
    slopes = residual @ xc / sxx
    rest = residual - slopes[:, None] * xc[None, :]
    noise_var = float(np.sum(rest ** 2) / ((g - 1) * (j - 2)))
    seed_var = float(np.var(table.mean(1), ddof=1) - noise_var / j)
    slope_var = float(np.var(slopes, ddof=1) - noise_var / sxx)
    return {"status": "ok", "noise_sd": math.sqrt(noise_var), "seed_sd": math.sqrt(max(seed_var, 0.0)),
            "slope_sd": math.sqrt(max(slope_var, 0.0)), "n_seeds": g,
            "cell_means": [float(m) for m in table.mean(0)], "batch_sizes": list(batch_sizes)}


# ---------------------------------------------------------------------------------- verdicts
def _flags(result: Mapping) -> str:
    """'' unless some run of the method diverged or chose an LR on its grid's edge."""
    parts = []
    if result.get("n_diverged"):
        parts.append(f"{result['n_diverged']} of {result['n_runs']} runs diverged (batch sizes "
                     f"{', '.join(map(str, result['diverged_batch_sizes']))})")
    if result.get("n_lr_edge"):
        parts.append(f"{result['n_lr_edge']} of {result['n_runs']} runs chose a learning rate on the edge of "
                     f"the grid (batch sizes {', '.join(map(str, result['lr_edge_batch_sizes']))})")
    return "; ".join(parts)


def _fmt(did: Mapping) -> str:
    return f"{did['estimate']:+.3g} [{did['ci_low']:+.3g}, {did['ci_high']:+.3g}]"


def assign_verdicts(methods: Mapping[str, dict], *, alpha: float, test_baselines: bool) -> dict:
    """Set 'verdict' and 'reason' of every method of one group (in place); returns the group's joint
    verdict {"verdict", "reason", "stage1", "stage2"} (see :func:`rule_lines`)."""
    corrected = [m for m, r in methods.items() if r["role"] == "corrected"]
    baselines = [m for m, r in methods.items() if r["role"] == "baseline"]
    for r in methods.values():
        flags = _flags(r)
        kind = classify_contrast(r.get("contrast", {}), alpha)
        r["contrast_class"] = kind
        if r["role"] != "other" and r.get("status", "ok") != "ok":
            r["verdict"], r["reason"] = INCONCLUSIVE, r["status"]
        elif r["role"] == "other":
            r["verdict"], r["reason"] = NO_PREDICTION, f"not a corrected layer nor a baseline; contrast {kind}"
        elif r["role"] == "baseline":
            if flags:
                r["verdict"], r["reason"] = INCONCLUSIVE, flags
            elif r.get("contrast", {}).get("status") != "ok":
                r["verdict"], r["reason"] = INCONCLUSIVE, r.get("contrast", {}).get("status", "no contrast")
            elif not test_baselines:
                r["verdict"], r["reason"] = NOT_TESTED, (
                    f"contrast {kind}; under an epoch budget larger batches take fewer steps for every method, "
                    "so a baseline's own fall is not evidence about the layer (only the differences are)")
            else:
                r["verdict"] = {FLAT: SUPPORTED, RISES: SUPPORTED, FALLS: CONTRADICTED}.get(kind, INCONCLUSIVE)
                r["reason"] = f"contrast {kind} ({_fmt(r['contrast'])})"
    for m in corrected:
        r = methods[m]
        if r.get("status", "ok") != "ok":
            continue
        dids = r.get("did", {})
        for d in dids.values():
            d["class"] = classify_did(d, alpha)
        flagged = ([_flags(r)] if _flags(r) else []) + [f"baseline {b}: {_flags(methods[b])}" for b in dids
                                                        if _flags(methods[b])]
        if flagged:
            r["verdict"], r["reason"] = INCONCLUSIVE, "; ".join(flagged) + \
                ", so a fall with the batch size may be the divergence or the LR grid, not the layer"
        elif not dids:
            r["verdict"], r["reason"] = INCONCLUSIVE, "no baseline in this group to compare with"
        else:
            kinds = {b: d["class"] for b, d in dids.items()}
            against = [b for b, k in kinds.items() if k in (EQUIVALENT, SLOWER)]
            if against:
                r["verdict"] = CONTRADICTED
                r["reason"] = "; ".join(f"vs {b}: {kinds[b]}, DiD {_fmt(dids[b])}" for b in against)
            elif all(k == FASTER for k in kinds.values()):
                r["verdict"] = SUPPORTED
                r["reason"] = "; ".join(f"vs {b}: falls faster, DiD {_fmt(dids[b])}" for b in kinds)
            else:
                r["verdict"] = INCONCLUSIVE
                r["reason"] = "; ".join(
                    f"vs {b}: {kinds[b]}" + (f", DiD {_fmt(dids[b])}" if dids[b].get("status") == "ok"
                                             else f" ({dids[b]['status']})") for b in kinds if kinds[b] != FASTER)
    stage1 = [methods[m]["verdict"] for m in corrected]
    stage2 = [methods[m]["verdict"] for m in baselines]
    if not corrected:
        return {"verdict": INCONCLUSIVE, "reason": "no corrected layer in this group", "stage1": None, "stage2": None}
    if CONTRADICTED in stage1:
        verdict = MIXED if SUPPORTED in stage1 else CONTRADICTED
        reason = "stage 1: " + ", ".join(f"{m} {methods[m]['verdict']}" for m in corrected)
    elif not all(v == SUPPORTED for v in stage1):
        verdict, reason = INCONCLUSIVE, "stage 1: " + ", ".join(f"{m} {methods[m]['verdict']}" for m in corrected)
    elif not test_baselines:
        verdict = SUPPORTED
        reason = ("stage 1: every corrected layer falls faster than every baseline; stage 2 (baselines flat) "
                  "not tested under an epoch budget")
    elif not baselines:
        verdict, reason = INCONCLUSIVE, "stage 1 passed, but no baseline to test in stage 2"
    elif all(v == SUPPORTED for v in stage2):
        verdict, reason = SUPPORTED, "stage 1 and stage 2 passed: corrected layers fall faster, baselines do not fall"
    elif CONTRADICTED in stage2:
        verdict = CONTRADICTED
        reason = "stage 1 passed; stage 2: " + ", ".join(f"{m} {methods[m]['verdict']}" for m in baselines)
    else:
        verdict = INCONCLUSIVE
        reason = "stage 1 passed; stage 2: " + ", ".join(f"{m} {methods[m]['verdict']}" for m in baselines)
    return {"verdict": verdict, "reason": reason, "stage1": stage1, "stage2": stage2 if test_baselines else None}


def rule_lines(*, alpha: float, margin: float, margin_source: str, test_baselines: bool) -> list[str]:
    """The fixed-budget decision rule, one clause a line."""
    return [
        "Primary estimand per method: Delta = P(largest batch size) - P(best batch size), P the performance, "
        "the best batch size chosen leave-one-seed-out (for seed s, the argmax of the mean over the other seeds; "
        "seed s contributes P_s(largest) - P_s(that batch size)); the mean over seeds, with the leave-one-seed-out "
        "jackknife standard error of the whole cross-fitted estimator and t with seeds-1 df. Cross-fitting keeps "
        "a seed's noise out of its own selection: the estimate errs towards 0, not towards a fall.",
        "Per corrected layer c and baseline b, the difference in differences DiD = Delta(c) - Delta(b) (paired "
        "jackknife: a seed left out of both), t with seeds-1 df: 'equivalent' if the TOST of |DiD| < margin = "
        f"{margin:.4g} ({margin_source}) has p < alpha = {alpha:g} (checked first); 'falls faster' if H1 DiD < 0 "
        "has p < alpha; 'falls slower' if H1 DiD > 0 has p < alpha; else 'unclear'.",
        "Corrected layer: supported if it falls faster than every baseline (intersection-union: every test at "
        "alpha, no multiplicity adjustment needed); contradicted if 'equivalent' or 'falls slower' against "
        "some baseline; inconclusive otherwise.",
        ("Baseline (stage 2): its own Delta, 'flat' (TOST, first), 'falls' or 'rises' at alpha: supported if flat "
         "or rises, contradicted if it falls, inconclusive otherwise." if test_baselines else
         "Baselines: not tested. Under an epoch budget larger batches take fewer steps for every method, so a "
         "baseline's own Delta measures the budget as much as the layer; their Delta is reported."),
        "Diverged runs (metric recorded at chance level) and runs whose chosen learning rate sits on the edge of "
        "its grid stay in the estimates, but a method with a diverged run in a group is inconclusive there, and "
        "so is a method with such an LR-edge run, and a corrected layer compared with such a baseline: its fall "
        "could be the divergence or the LR grid, not the layer.",
        ("Joint verdict of the two-part prediction, by gatekeeping: stage 1, every corrected layer supported; "
         "stage 2, tested only once stage 1 has passed, every baseline supported. Supported if both stages pass; "
         "contradicted if a corrected layer is contradicted (mixed if another is supported) or, after stage 1, a "
         "baseline is; inconclusive otherwise." if test_baselines else
         "Joint verdict of the prediction: supported if every corrected layer is supported (stage 1; the "
         "baselines' part cannot be tested under this budget); contradicted if a corrected layer is contradicted "
         "(mixed if another is supported); inconclusive otherwise.")
        + " 'Supported' needs every one of its tests to reject at alpha, so a false joint 'supported' has "
        "probability <= alpha (intersection-union).",
        "The joint verdict of the primary group is the study's verdict; the other groups are sensitivity analyses.",
    ]


def group_contrasts(methods: Mapping[str, dict], rows_by_method: Mapping[str, Sequence[Mapping]], *, metric: str,
                    sign: float, alpha: float, margin: float, baselines: Sequence[str], noise: bool = True) -> None:
    """Add 'contrast', LR-edge counts, (corrected) 'did' and, unless ``noise`` is False (the
    calibration's loops), 'lack_of_fit' and 'noise' (:func:`noise_components`) to each method's
    result, in place."""
    for method, result in methods.items():
        rows = rows_by_method[method]
        result["contrast"] = method_contrast(rows, metric=metric, sign=sign, alpha=alpha, margin=margin)
        if noise:
            result["lack_of_fit"] = lack_of_fit(rows, metric=metric, sign=sign)
            result["noise"] = noise_components(rows, metric=metric, sign=sign)
        if any("lr_at_grid_edge" in r for r in rows):
            edges = [r for r in rows if _edge(r)]
            result["n_lr_edge"] = len(edges)
            result["lr_edge_batch_sizes"] = sorted({r["batch_size"] for r in edges})
    for result in methods.values():
        if result["role"] == "corrected":
            result["did"] = {b: difference_in_differences(result["contrast"], methods[b]["contrast"], alpha=alpha,
                                                          margin=margin)
                             for b in baselines if b in methods}


def _edge(row: Mapping) -> bool:
    value = row.get("lr_at_grid_edge")
    if value in (None, ""):
        return False
    number = float(value)
    if number not in (0.0, 1.0):
        raise ValueError(f"column 'lr_at_grid_edge' must be 0 or 1, got {value!r}")
    return number == 1.0


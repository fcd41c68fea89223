"""Does the metric fall with batch size for the divergence-correcting layers? The decision logic.

The affine-divergence theory (G. Bird, arXiv 2512.22247; summarised in the package README) predicts
that the performance of the corrected layers (``affine_like``, ``norm_l2``, ``patchnorm``) falls as the
batch size B grows while baselines (``affine``, ``batchnorm``) do not.
:func:`analyse` tests it under a fixed budget (epochs or steps) per group (``group_by``, e.g. the
learning-rate rule), per method, on records ``{method, batch_size, seed, <metric>, [lr_rule, ...]}``,
by an :class:`~affdiv.experiments.analysis.settings.AnalysisSettings`.

The verdicts come from the curvature-proof contrast of
:mod:`affdiv.experiments.analysis.contrast`: per method, the performance at the largest batch size
minus that at the method's best one (cross-fitted, leave one seed out), its difference in
differences against each baseline, an intersection-union rule per corrected layer and a gatekept
joint verdict per group (:func:`decision_rule`). Records whose metric is ``steps_to_target`` are
the other design's, :func:`affdiv.experiments.analysis.critical_batch.analyse_target` (the critical
batch size; :func:`affdiv.experiments.analysis.design.analyse_study` picks by the settings).
Everything below is descriptive: reported, not part of the rule.

* x = log2 B, so every slope is "metric change per doubling of the batch size". "Performance" is the
  metric itself when ``higher_is_better`` (accuracy), its negative otherwise (loss).
* the OLS slope with a seed-clustered CR1 standard error, t with G-1 df
  (G = seeds); one-sided p-values for "performance falls" and "performance rises" and a TOST
  p-value for "flat" (|slope| < ``margin``).
* reported alongside (sensitivity): Page's L across batch sizes with seeds as blocks,
  cluster-bootstrap percentile CI. (The REML random-intercept model was dropped: it did not
  converge in 12 of 12 cells of the committed Fashion-MNIST run and decided nothing.)
* differential test (corrected methods): per seed, the slope of (corrected − baseline) at matched
  (seed, batch size) against log2 B; one-sample t across seeds, one-sided for "the corrected
  layer's performance falls faster than the baseline's"; bootstrap CI from resampling the seeds.
* Holm: the p-values of corrected and baseline methods in all groups form one family
  ("prediction"); those of other methods a second ("exploratory"); the descriptive "trend" reads
  the adjusted p-values at level ``alpha``.

Diverged runs (records with ``diverged`` = 1; the harness records their accuracy at chance level)
stay in the fits, so the slopes describe what was run, but they never decide a verdict: under
``lr_rule = linear`` the largest batches get the largest learning rates, and "performance falls
with B" would follow from divergence alone. A method with a diverged run in a group is
"inconclusive" there, and so is a corrected layer whose compared baseline diverged there. A run
whose tuned learning rate sits on the edge of its grid (``lr_at_grid_edge`` = 1) counts the same.

Finite metrics can still overflow in the fit (±1e308: their sum is infinite). A method whose
slope, standard error or p-values come out non-finite gets the status "non-finite arithmetic: ..."
and the verdict "inconclusive" with that reason, never a test; so does a differential test.

Methods outside ``corrected`` and ``baselines`` (layernorm, rmsnorm, conv, ...) get role "other":
their trend is reported and classified, but the prediction says nothing about them, so their
verdict is always "no prediction".
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from affdiv.experiments.analysis import contrast, stats
from affdiv.experiments.analysis.design import by_batch_size, in_role_order, overall, rng, role_of, roles_clause
from affdiv.experiments.analysis.groups import default_primary_group
from affdiv.experiments.analysis.settings import MIN_BOOT, AnalysisSettings
from affdiv.experiments.records import validate_records
from affdiv.reporting import json_ready
from affdiv.vocabulary import FIXED_BUDGET, UNCLEAR

SCHEMA_VERSION = 2  # 2: verdicts from the contrasts; methods.<m> no longer a copy of one group
SINGLE_GROUP = "all"
FALLS, RISES, FLAT = "falls", "rises", "flat"


# ------------------------------------------------------------------------------- decision rule
def default_margin(values: Sequence[float], higher_is_better: bool) -> tuple[float, str]:
    """The equivalence margin per doubling of B used when none is given, and why.

    A score in [0, 1] (accuracy, as the harness records it): 0.005, half a percentage point.
    Anything else (a loss, a percentage): 1% of the median |metric| — pass ``margin`` to do better.
    """
    return stats.scale_margin(values, higher_is_better, accuracy=0.005, fraction=0.01,
                              per="per doubling of the batch size", name="an equivalence margin", argument="margin")


@dataclass(frozen=True)
class Margins:
    """The equivalence margins an analysis used (given, or from the metric's scale) and where each
    comes from, in words."""

    margin: float  # of the slope, per doubling of the batch size (descriptive)
    margin_source: str
    contrast_margin: float  # of the contrasts, between two batch sizes (the rule's)
    contrast_margin_source: str


def decision_rule(settings: AnalysisSettings, margins: Margins) -> str:
    """The rule that turns the contrasts into verdicts, in words (Markdown), then what is descriptive.
    ``settings.test_baselines`` None reads as True."""
    performance = "the metric" if settings.higher_is_better else "minus the metric (lower is better)"
    return "\n".join([
        f"Performance P is {performance}. {roles_clause(settings)} Every other method is reported without a "
        "verdict ('no prediction').",
        *contrast.rule_lines(alpha=settings.alpha, margin=margins.contrast_margin,
                             margin_source=margins.contrast_margin_source,
                             test_baselines=settings.test_baselines is not False),
        "A method whose fit overflows (non-finite numbers from finite metrics) is inconclusive, with that reason.",
        "Across groups, per method: supported if supported in every group; contradicted if contradicted in some "
        "group and supported in none; mixed if both occur; inconclusive otherwise.",
        f"Descriptive, not in the rule: the seed-clustered OLS slope of P against x = log2(batch size) (CR1, t "
        f"with G-1 df) with 'falls'/'rises'/'flat' (TOST, margin {margins.margin:.4g} per doubling, "
        f"{margins.margin_source}) Holm-adjusted over corrected and baseline methods (the 'trend'), the per-seed "
        "differential slopes, the lack-of-fit test of linearity, the noise decomposition, Page's L and the "
        "bootstrap (the metric is rarely linear in log2 B).",
    ])


# --------------------------------------------------------------------------------------- fitting
def _cells(rows, metric, level) -> list[dict]:
    cells = []
    for batch_size, runs in by_batch_size(rows).items():
        values = np.asarray([row[metric] for row in runs])
        with np.errstate(all="ignore"):  # a sum that overflows is reported as null, and the fit says why
            cell = {"batch_size": batch_size, "n": int(values.size), "mean": float(values.mean()),
                    "sd": None, "ci_low": None, "ci_high": None}
            if values.size >= 2:
                low, high = stats.mean_estimate(values).ci(level)
                cell.update(sd=float(values.std(ddof=1)), ci_low=low, ci_high=high)
        cells.append(cell)
    return cells


def _codes(labels) -> tuple[np.ndarray, list]:
    """(index of each label among the distinct ones, the distinct labels sorted): cluster codes for
    seeds of any size (numpy would turn a list holding 2**64 - 1 into float64, merging seeds)."""
    distinct = sorted(set(labels))
    position = {label: i for i, label in enumerate(distinct)}
    return np.fromiter((position[label] for label in labels), dtype=np.intp, count=len(labels)), distinct


def _directional(estimate: stats.Estimate, sign: float, margin: float) -> dict[str, float]:
    """Raw p-values of the three tests, on the performance scale (sign = +1 or -1)."""
    falls = estimate.p_less(0.0) if sign > 0 else estimate.p_greater(0.0)
    rises = estimate.p_greater(0.0) if sign > 0 else estimate.p_less(0.0)
    return {FALLS: falls, RISES: rises, FLAT: estimate.p_equivalent(margin)}


def _non_finite(error: Exception) -> str:
    """The status of a fit whose arithmetic left the floats (it starts "non-finite arithmetic")."""
    return f"{error}; no test is possible on these values"


def _fit_method(rows, *, metric, sign, margin, alpha, n_boot, seed, group, method, sensitivity,
                progress=None) -> dict:
    batch_sizes = sorted({row["batch_size"] for row in rows})
    x = np.log2(np.array([row["batch_size"] for row in rows], dtype=np.float64))
    y = np.array([row[metric] for row in rows], dtype=np.float64)
    codes, seeds = _codes([row["seed"] for row in rows])
    result = {"n_runs": len(rows), "n_seeds": len(seeds), "batch_sizes": batch_sizes,
              "cells": _cells(rows, metric, 1 - alpha), "tests": {}}
    if any("diverged" in row for row in rows):  # kept in the fits at their recorded metric; see _verdict
        diverged = [row for row in rows if row.get("diverged")]
        result["n_diverged"] = len(diverged)
        result["diverged_batch_sizes"] = sorted({row["batch_size"] for row in diverged})
    if len(batch_sizes) < 2 or result["n_seeds"] < 2 or len(rows) < 3:
        result["status"] = (f"insufficient data: needs >= 2 batch sizes, >= 2 seeds and >= 3 runs, got "
                            f"{len(batch_sizes)}, {result['n_seeds']} and {len(rows)}")
        return result
    try:
        clustered = stats.clustered_slope(x, y, codes)
        with np.errstate(all="ignore"):
            tests = _directional(clustered, sign, margin)
            intervals = clustered.ci(1 - alpha), clustered.ci(1 - 2 * alpha)
        if not all(math.isfinite(v) for v in (*tests.values(), *intervals[0], *intervals[1])):
            raise stats.NonFiniteError(f"non-finite arithmetic in the tests of the slope {clustered.estimate:.3g} "
                                       f"(se {clustered.se:.3g})")
    except stats.NonFiniteError as error:
        result["status"] = _non_finite(error)
        return result
    result["status"] = "ok"
    result.update(slope=clustered.estimate, se=clustered.se, df=clustered.df, p_value=clustered.p_two_sided())
    (result["ci_low"], result["ci_high"]), (result["tost_ci_low"], result["tost_ci_high"]) = intervals
    result["tests"] = {name: {"p": p} for name, p in tests.items()}
    if sensitivity:
        result.update(_sensitivity(x, y, codes, batch_sizes, [row["batch_size"] for row in rows], sign=sign,
                                   margin=margin, alpha=alpha, rng=rng(seed, group, method), n_boot=n_boot,
                                   progress=progress, label=f"{method} in group {group}"))
    return result


def _sensitivity(x, y, codes, batch_sizes, run_batch_sizes, *, sign, margin, alpha, rng, n_boot, progress,
                 label) -> dict:
    """Cluster-bootstrap CI and Page's L of one method (runs in any order;
    ``codes`` numbers the seeds 0..G-1)."""
    result = {}
    boot = stats.cluster_bootstrap(x, y, codes, n_boot=n_boot, rng=rng)
    with np.errstate(all="ignore"):
        result["boot_ci_low"], result["boot_ci_high"] = (stats.percentile_ci(boot, 1 - alpha) if boot.size
                                                         else (math.nan, math.nan))
    result["n_boot"] = int(boot.size)

    # No mixed model: REML did not converge in 12 of 12 cells of the committed Fashion-MNIST run, and
    # the contrasts (seeds as the units) make it redundant.
    n_seeds = int(codes.max()) + 1

    # Page's L on the seeds that ran every batch size (one run per cell: checked by analyse).
    column = {b: i for i, b in enumerate(batch_sizes)}
    per_seed = np.bincount(codes, minlength=n_seeds)
    complete = per_seed == len(batch_sizes)
    if int(complete.sum()) >= 2 and len(batch_sizes) >= 3:
        keep = complete[codes]
        rank = np.cumsum(complete) - 1  # row of each complete seed, in seed order
        table = np.empty((int(complete.sum()), len(batch_sizes)))
        table[rank[codes[keep]], [column[b] for b, k in zip(run_batch_sizes, keep) if k]] = y[keep]
        page = stats.page_trend(table)
        result["page"] = {"L": page.statistic, "n_blocks": page.n_blocks, "method": page.method,
                          "p_falls": page.p_decreasing if sign > 0 else page.p_increasing,
                          "p_rises": page.p_increasing if sign > 0 else page.p_decreasing}
    else:
        result["page"] = {"error": f"needs >= 2 complete seeds and >= 3 batch sizes, got {int(complete.sum())} "
                                   f"and {len(batch_sizes)}"}
    return result


def _fit_differential(corrected_rows, baseline_rows, *, metric, sign, alpha, n_boot, seed, labels,
                      progress=None) -> dict:
    baseline = {(r["seed"], r["batch_size"]): r[metric] for r in baseline_rows}
    matched = [(r["seed"], r["batch_size"], r[metric] - baseline[r["seed"], r["batch_size"]])
               for r in corrected_rows if (r["seed"], r["batch_size"]) in baseline]
    if not matched:
        return {"status": "insufficient data: no (seed, batch size) run by both methods", "n_seeds": 0}
    seed_labels, batch_sizes, differences = zip(*matched)
    codes, seeds = _codes(seed_labels)
    with np.errstate(all="ignore"):
        differences = np.array(differences, dtype=np.float64)
        by_code = stats.per_cluster_slopes(np.log2(np.array(batch_sizes, dtype=np.float64)), differences, codes)
    slopes = {seeds[code]: slope for code, slope in by_code.items()}
    if len(slopes) < 2:
        return {"status": f"insufficient data: needs >= 2 seeds with >= 2 matched batch sizes, got {len(slopes)}",
                "n_seeds": len(slopes)}
    values = np.array(list(slopes.values()))
    with np.errstate(all="ignore"):
        estimate = stats.mean_estimate(values)
    if not (np.all(np.isfinite(values)) and math.isfinite(estimate.estimate) and math.isfinite(estimate.se)):
        return {"status": _non_finite(stats.NonFiniteError(
                    f"non-finite arithmetic in the per-seed slopes of the differences (magnitude up to "
                    f"{np.abs(differences).max():.3g})")), "n_seeds": int(values.size)}
    boot = stats.bootstrap_means(values, n_boot, rng(seed, *labels))
    low, high = estimate.ci(1 - alpha)
    boot_low, boot_high = stats.percentile_ci(boot, 1 - alpha)
    return {"status": "ok", "n_seeds": int(values.size), "slope": estimate.estimate, "se": estimate.se,
            "df": estimate.df, "ci_low": low, "ci_high": high, "boot_ci_low": boot_low, "boot_ci_high": boot_high,
            "p_value": estimate.p_two_sided(), "per_seed_slopes": {str(k): v for k, v in slopes.items()},
            "test": {"p": estimate.p_less(0.0) if sign > 0 else estimate.p_greater(0.0)}}


# -------------------------------------------------------------------------------------- verdicts
def _significant(test: Mapping | None, alpha: float) -> bool:
    return bool(test) and test.get("p_holm") is not None and test["p_holm"] < alpha


def _trend(result: Mapping, alpha: float) -> str:
    tests = result["tests"]
    for name in (FLAT, FALLS, RISES):
        if _significant(tests.get(name), alpha):
            return name
    return UNCLEAR


def _apply_holm(groups: Mapping[str, Mapping], roles: Mapping[str, str]) -> dict[str, int]:
    """Holm-adjust each family in place (adds 'p_holm' next to every 'p'); returns the family sizes."""
    families: dict[str, list[dict]] = {"prediction": [], "exploratory": []}
    for group in groups.values():
        for method, result in group["methods"].items():
            family = families["exploratory" if roles[method] == "other" else "prediction"]
            family.extend(result["tests"].values())
            family.extend(d["test"] for d in result.get("differential", {}).values() if "test" in d)
    for tests in families.values():
        for test, adjusted in zip(tests, stats.holm([t["p"] for t in tests])):
            test["p_holm"] = float(adjusted)
    return {name: len(tests) for name, tests in families.items()}


# -------------------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class Analysis:
    """The result of :func:`analyse`; :meth:`to_dict` is the content of summary.json."""

    settings: dict
    decision_rule: str
    groups: dict
    primary_group: str
    overall: dict
    family_sizes: dict

    design = FIXED_BUDGET  # a class attribute, not a field
    primary_target = None  # one budget, no targets

    @property
    def methods(self) -> dict:
        """The primary group's per-method results."""
        return self.groups[self.primary_group]["methods"]

    @property
    def prediction(self) -> dict:
        """The joint verdict of the primary group (the study's verdict)."""
        return self.groups[self.primary_group]["prediction"]

    def to_dict(self, provenance: Mapping | None = None) -> dict:
        """JSON-ready summary (NaN and infinities become null); schema in :mod:`affdiv.experiments.report.writer`.

        One verdict per level, each where it belongs: ``prediction`` (the joint verdict of the primary
        group), ``overall`` (per method, across groups), ``groups.<g>.prediction`` and
        ``groups.<g>.methods.<m>.verdict`` (per group). ``methods.<m>`` holds only the role, the
        across-groups verdict and the per-group verdicts: every number lives under its group.
        """
        methods = {name: {"role": next(g["methods"][name]["role"] for g in self.groups.values()
                                       if name in g["methods"]),
                          "verdict": verdict,
                          "groups": {g: c["methods"][name]["verdict"] for g, c in self.groups.items()
                                     if name in c["methods"]}}
                   for name, verdict in self.overall.items()}
        return json_ready({
            "schema_version": SCHEMA_VERSION,
            "design": FIXED_BUDGET,
            "decision_rule": self.decision_rule,
            "provenance": dict(provenance or {}),
            "settings": self.settings,
            "family_sizes": self.family_sizes,
            "primary_group": self.primary_group,
            "prediction": {**self.prediction, "rule": self.decision_rule, "group": self.primary_group},
            "methods": methods,
            "overall": self.overall,
            "groups": self.groups,
        })


def _grouped(rows: Sequence[Mapping], group_by: str | None) -> tuple[dict, bool]:
    """{group: {method: rows sorted by (batch size, seed)}} and whether ``group_by`` split them;
    ValueError on a record without a group value or a second run in a cell."""
    grouped = defaultdict(lambda: defaultdict(list))
    has_group = group_by is not None and any(group_by in r for r in rows)
    seen = set()
    for number, row in enumerate(rows, start=1):
        if has_group and row.get(group_by) in (None, ""):
            raise ValueError(f"record {number}: no value for the group column {group_by!r} (other records have one)")
        group = str(row[group_by]) if has_group else SINGLE_GROUP
        key = (group, row["method"], row["batch_size"], row["seed"])
        if key in seen:
            raise ValueError(f"record {number}: a second run for group={group!r}, method={row['method']!r}, "
                             f"batch_size={row['batch_size']}, seed={row['seed']}; expected one run per cell "
                             "(filter or group the other varying columns first)")
        seen.add(key)
        grouped[group][row["method"]].append(row)
    for methods in grouped.values():  # a canonical order: the numbers never depend on the input order
        for rows_of_method in methods.values():
            rows_of_method.sort(key=lambda r: (r["batch_size"], r["seed"]))
    return grouped, has_group


def _margins(rows: Sequence[Mapping], settings: AnalysisSettings) -> Margins:
    """The given margins, or the defaults from the metric's scale, with where each comes from."""
    values = [r[settings.metric] for r in rows]
    if settings.margin is None:
        margin, margin_source = default_margin(values, settings.higher_is_better)
    else:
        margin, margin_source = settings.margin, "given"
    if settings.contrast_margin is None:
        contrast_margin, contrast_source = contrast.default_contrast_margin(values, settings.higher_is_better)
    else:
        contrast_margin, contrast_source = settings.contrast_margin, "given"
    return Margins(margin, margin_source, contrast_margin, contrast_source)


def _fit_group(group: str, by_method: Mapping[str, list], roles: Mapping[str, str], settings: AnalysisSettings,
               margins: Margins, progress: Callable[[str], None] | None) -> dict:
    """The fits of every method of one group (slopes, sensitivity, differential tests)."""
    fit = dict(metric=settings.metric, sign=1.0 if settings.higher_is_better else -1.0, alpha=settings.alpha,
               n_boot=settings.n_boot, seed=settings.seed)
    methods = {}
    for method in in_role_order({m: roles[m] for m in by_method}):
        if progress is not None:
            progress(f"fitting {method} in group {group} ({len(by_method[method])} runs) ...")
        result = {"role": roles[method], **_fit_method(by_method[method], margin=margins.margin, group=group,
                                                       method=method, sensitivity=settings.sensitivity,
                                                       progress=progress, **fit)}
        if roles[method] == "corrected":
            result["differential"] = {
                base: _fit_differential(by_method[method], by_method[base], labels=(group, method, base), **fit)
                for base in settings.baselines if base in by_method}
        methods[method] = result
    return {"methods": methods}


def _decide(groups: Mapping[str, dict], grouped: Mapping, settings: AnalysisSettings, margins: Margins,
            progress: Callable[[str], None] | None) -> None:
    """The trends and the verdicts of every group, in place: the cross-fitted contrasts and their
    differences (module contrast) decide."""
    for name, group in groups.items():
        for result in group["methods"].values():
            result["trend"] = _trend(result, settings.alpha)
        if progress is not None:
            progress(f"contrasts of group {name} ({len(grouped[name])} methods) ...")
        contrast.group_contrasts(group["methods"], grouped[name], metric=settings.metric,
                                 sign=1.0 if settings.higher_is_better else -1.0, alpha=settings.alpha,
                                 margin=margins.contrast_margin, baselines=settings.baselines)
        for result in group["methods"].values():
            if result["status"] != "ok" and result["status"].startswith("non-finite"):
                result["contrast"] = {"status": result["status"]}
        group["prediction"] = contrast.assign_verdicts(group["methods"], alpha=settings.alpha,
                                                       test_baselines=settings.test_baselines)


def _primary_group(settings: AnalysisSettings, grouped: Mapping, groups: Mapping) -> str:
    if settings.primary_group is None:
        seeds = {g: {r["seed"] for rows_of_method in grouped[g].values() for r in rows_of_method} for g in groups}
        return default_primary_group(seeds)
    if settings.primary_group not in groups:
        raise ValueError(f"primary_group {settings.primary_group!r} is not among the groups {sorted(groups)}")
    return settings.primary_group


def analyse(records: Sequence[Mapping], settings: AnalysisSettings, *,
            progress: Callable[[str], None] | None = None) -> Analysis:
    """Test the batch-size prediction on ``records`` under a fixed budget (see the module docstring
    for the tests), by ``settings`` (:class:`~affdiv.experiments.analysis.settings.AnalysisSettings`;
    steps to a target are :func:`~affdiv.experiments.analysis.critical_batch.analyse_target`'s).

    ``settings.group_by`` splits the records into independent analyses (None, or a column no
    record has: one group "all"); a ``margin`` or ``contrast_margin`` of None comes from the
    metric's scale (:func:`default_margin`, :func:`~affdiv.experiments.analysis.contrast.default_contrast_margin`);
    ``test_baselines`` None: yes unless every record has ``budget`` = "epochs" (where fewer steps
    at larger B make every method fall); ``sensitivity`` False skips the bootstrap and Page's L
    (they do not enter the verdicts). ``progress``: called with a line before each method's fits.

    Arithmetic that leaves the floats (metrics such as ±1e308 whose sums overflow) makes that
    method's status, and so its verdict, "inconclusive" with the reason; it never yields a test.
    """
    if settings.design != FIXED_BUDGET:
        raise ValueError(f"settings: metric {settings.metric!r} is the {settings.design} design; analyse it with "
                         "critical_batch.analyse_target")
    if settings.n_boot < MIN_BOOT:
        raise ValueError(f"n_boot (draws of a percentile CI) must be >= {MIN_BOOT} for a fixed budget, "
                         f"got {settings.n_boot}")
    if settings.metric is None:
        settings = settings.replace(metric="metric")
    rows = validate_records(records, metric=settings.metric)
    if not rows:
        raise ValueError("no records to analyse")
    margins = _margins(rows, settings)
    if settings.test_baselines is None:
        settings = settings.replace(test_baselines=not all(r.get("budget") == "epochs" for r in rows))
    grouped, has_group = _grouped(rows, settings.group_by)
    roles = {m: role_of(m, settings) for g in grouped.values() for m in g}
    groups = {group: _fit_group(group, grouped[group], roles, settings, margins, progress)
              for group in sorted(grouped)}
    family_sizes = _apply_holm(groups, roles)
    _decide(groups, grouped, settings, margins, progress)
    verdicts = {m: overall([g["methods"][m]["verdict"] for g in groups.values() if m in g["methods"]])
                for m in in_role_order(roles)}
    primary_group = _primary_group(settings, grouped, groups)
    summary = {"metric": settings.metric, "higher_is_better": settings.higher_is_better, "alpha": settings.alpha,
               "margin": margins.margin, "margin_source": margins.margin_source,
               "corrected": list(settings.corrected), "baselines": list(settings.baselines),
               "group_by": settings.group_by if has_group else None, "n_boot": settings.n_boot,
               "seed": settings.seed, "sensitivity": settings.sensitivity,
               "contrast_margin": margins.contrast_margin, "contrast_margin_source": margins.contrast_margin_source,
               "test_baselines": settings.test_baselines, "design": FIXED_BUDGET, "n_records": len(rows)}
    return Analysis(summary, decision_rule(settings, margins), groups, primary_group, verdicts, family_sizes)

"""Does the metric fall with batch size for the divergence-correcting layers? The decision logic.

The affine-divergence theory (G. Bird, arXiv 2512.22247; summarised in the package README) predicts
that the performance of the corrected layers (``affine_like``, ``norm_l2``, ``patchnorm``) falls as the
batch size B grows while baselines (``affine``, ``batchnorm``) do not.
:func:`analyse` tests it per group (by default per learning-rate rule), per method, on records
``{method, batch_size, seed, <metric>, [lr_rule, ...]}``:

* x = log2 B, so every slope is "metric change per doubling of the batch size". "Performance" is the
  metric itself when ``higher_is_better`` (accuracy), its negative otherwise (loss).
* primary test: the OLS slope with a seed-clustered CR1 standard error, t with G-1 df
  (G = seeds); one-sided p-values for "performance falls" and "performance rises" and a TOST
  p-value for "flat" (|slope| < ``margin``).
* reported alongside (sensitivity, not in the decision rule): REML random-intercept model, Page's L
  across batch sizes with seeds as blocks, cluster-bootstrap percentile CI.
* differential test (corrected methods): per seed, the slope of (corrected − baseline) at matched
  (seed, batch size) against log2 B; one-sample t across seeds, one-sided for "the corrected
  layer's performance falls faster than the baseline's"; bootstrap CI from resampling the seeds.
* Holm: the p-values of corrected and baseline methods in all groups form one family
  ("prediction"); those of other methods a second ("exploratory"); the verdicts read the
  adjusted p-values at level ``alpha``. :func:`decision_rule` states the rule in words.

Diverged runs (records with ``diverged`` = 1; the harness records their accuracy at chance level)
stay in the fits, so the slopes describe what was run, but they never decide a verdict: under
``lr_rule = linear`` the largest batches get the largest learning rates, and "performance falls
with B" would follow from divergence alone. A method with a diverged run in a group is
"inconclusive" there, and so is a corrected layer whose compared baseline diverged there.

Methods outside ``corrected`` and ``baselines`` (layernorm, rmsnorm, conv, ...) get role "other":
their trend is reported and classified, but the prediction says nothing about them, so their
verdict is always "no prediction".
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from affdiv.experiments.analysis import stats
from affdiv.experiments.records import validate_records

SCHEMA_VERSION = 1
DEFAULT_CORRECTED = ("affine_like", "norm_l2", "patchnorm")
DEFAULT_BASELINES = ("affine", "batchnorm")
SINGLE_GROUP = "all"

SUPPORTED, CONTRADICTED, INCONCLUSIVE, NO_PREDICTION = "supported", "contradicted", "inconclusive", "no prediction"
MIXED = "mixed"  # across groups: supported in some, contradicted in others
FALLS, RISES, FLAT, UNCLEAR = "falls", "rises", "flat", "unclear"


# ------------------------------------------------------------------------------- decision rule
def default_margin(values: Sequence[float], higher_is_better: bool) -> tuple[float, str]:
    """The equivalence margin per doubling of B used when none is given, and why.

    A score in [0, 1] (accuracy, as the harness records it): 0.005, half a percentage point.
    Anything else (a loss, a percentage): 1% of the median |metric| — pass ``margin`` to do better.
    """
    values = np.asarray(values, dtype=np.float64)
    if higher_is_better and values.min() >= 0 and values.max() <= 1:
        return 0.005, "0.5 percentage points of accuracy (metric in [0, 1]) per doubling of the batch size"
    scale = float(np.median(np.abs(values)))
    if scale == 0:
        raise ValueError("cannot derive an equivalence margin from a metric whose median is 0; pass margin=")
    return 0.01 * scale, f"1% of the median |metric| ({scale:.4g}) per doubling of the batch size"


def decision_rule(*, alpha: float, margin: float, margin_source: str, higher_is_better: bool,
                  corrected: Sequence[str], baselines: Sequence[str]) -> str:
    """The rule that turns the adjusted p-values into verdicts, in words (Markdown)."""
    performance = "the metric" if higher_is_better else "minus the metric (lower is better)"
    return "\n".join([
        f"Performance is {performance}; x = log2(batch size); slopes are per doubling of the batch size.",
        f"Corrected layers: {', '.join(corrected)}. Baselines: {', '.join(baselines)}. "
        "Every other method is reported without a verdict ('no prediction').",
        "Per group (learning-rate rule) and method, three tests on the seed-clustered OLS slope b of performance "
        "(CR1 standard error, t with G-1 df, G = seeds): 'falls', H1 b < 0; 'rises', H1 b > 0; "
        f"'flat', TOST of H1 |b| < margin = {margin:.4g} ({margin_source}).",
        "Corrected layers also get, for each baseline B in the group, the test 'differential vs B': per seed, the "
        "slope of performance(corrected) - performance(B) at matched seed and batch size; H1 mean < 0 "
        "(one-sided t across seeds).",
        f"All p-values of corrected and baseline methods, in all groups, are Holm-adjusted as one family; "
        f"a test is significant when its adjusted p < alpha = {alpha:g}.",
        "Trend: 'flat' if 'flat' is significant; else 'falls' or 'rises' if that test is significant; else 'unclear'.",
        "Verdict, corrected layer: supported if the trend is 'falls' and every differential test is significant "
        "(at least one baseline must be present); contradicted if the trend is 'flat' or 'rises'; "
        "inconclusive otherwise.",
        "Verdict, baseline: supported if the trend is 'flat' or 'rises'; contradicted if it is 'falls'; "
        "inconclusive if 'unclear'.",
        "Diverged runs (non-finite loss; metric recorded at chance level) stay in the fits, but a method with a "
        "diverged run in a group is inconclusive there, whatever its tests, and so is a corrected layer whose "
        "compared baseline diverged there: a fall with the batch size could be the divergence, not the layer.",
        "Across groups: supported if supported in every group; contradicted if contradicted in some group and "
        "supported in none; mixed if both occur; inconclusive otherwise.",
        "The mixed model, Page's L and the bootstrap CI are sensitivity analyses: reported, not part of the rule.",
    ])


# --------------------------------------------------------------------------------------- fitting
def _rng(seed: int, *labels: str) -> np.random.Generator:
    """A generator that depends on the labels, not on the order in which methods are analysed."""
    return np.random.default_rng([seed, *(zlib.crc32(label.encode()) for label in labels)])


def _cells(rows, metric, level) -> list[dict]:
    by_batch = defaultdict(list)
    for row in rows:
        by_batch[row["batch_size"]].append(row[metric])
    cells = []
    for batch_size in sorted(by_batch):
        values = np.asarray(by_batch[batch_size])
        cell = {"batch_size": batch_size, "n": int(values.size), "mean": float(values.mean()),
                "sd": None, "ci_low": None, "ci_high": None}
        if values.size >= 2:
            low, high = stats.mean_estimate(values).ci(level)
            cell.update(sd=float(values.std(ddof=1)), ci_low=low, ci_high=high)
        cells.append(cell)
    return cells


def _directional(estimate: stats.Estimate, sign: float, margin: float) -> dict[str, float]:
    """Raw p-values of the three tests, on the performance scale (sign = +1 or -1)."""
    falls = estimate.p_less(0.0) if sign > 0 else estimate.p_greater(0.0)
    rises = estimate.p_greater(0.0) if sign > 0 else estimate.p_less(0.0)
    return {FALLS: falls, RISES: rises, FLAT: estimate.p_equivalent(margin)}


def _fit_method(rows, *, metric, sign, margin, alpha, n_boot, seed, group, method, sensitivity) -> dict:
    x = np.log2([row["batch_size"] for row in rows])
    y = np.array([row[metric] for row in rows])
    seeds = np.array([row["seed"] for row in rows])
    batch_sizes = sorted({row["batch_size"] for row in rows})
    result = {"n_runs": len(rows), "n_seeds": int(np.unique(seeds).size), "batch_sizes": batch_sizes,
              "cells": _cells(rows, metric, 1 - alpha), "tests": {}}
    if any("diverged" in row for row in rows):  # kept in the fits at their recorded metric; see _verdict
        diverged = [row for row in rows if row.get("diverged")]
        result["n_diverged"] = len(diverged)
        result["diverged_batch_sizes"] = sorted({row["batch_size"] for row in diverged})
    if len(batch_sizes) < 2 or result["n_seeds"] < 2 or len(rows) < 3:
        result["status"] = (f"insufficient data: needs >= 2 batch sizes, >= 2 seeds and >= 3 runs, got "
                            f"{len(batch_sizes)}, {result['n_seeds']} and {len(rows)}")
        return result
    result["status"] = "ok"
    clustered = stats.clustered_slope(x, y, seeds)
    result.update(slope=clustered.estimate, se=clustered.se, df=clustered.df,
                  p_value=clustered.p_two_sided())
    result["ci_low"], result["ci_high"] = clustered.ci(1 - alpha)
    result["tost_ci_low"], result["tost_ci_high"] = clustered.ci(1 - 2 * alpha)
    result["tests"] = {name: {"p": p} for name, p in _directional(clustered, sign, margin).items()}
    if sensitivity:
        result.update(_sensitivity(rows, x, y, seeds, batch_sizes, metric=metric, sign=sign, margin=margin,
                                   alpha=alpha, rng=_rng(seed, group, method), n_boot=n_boot))
    return result


def _sensitivity(rows, x, y, seeds, batch_sizes, *, metric, sign, margin, alpha, rng, n_boot) -> dict:
    """Cluster-bootstrap CI, random-intercept model and Page's L of one method."""
    result = {}
    boot = stats.cluster_bootstrap(x, y, seeds, n_boot=n_boot, rng=rng)
    result["boot_ci_low"], result["boot_ci_high"] = stats.percentile_ci(boot, 1 - alpha)
    result["n_boot"] = int(boot.size)

    try:
        mixed = stats.mixed_slope(x, y, seeds)
        mixed_p = _directional(mixed.slope, sign, margin)
        result["mixed"] = {"slope": mixed.slope.estimate, "se": mixed.slope.se,
                           "p_value": mixed.slope.p_two_sided(), "p_falls": mixed_p[FALLS],
                           "p_rises": mixed_p[RISES], "seed_variance": mixed.seed_variance,
                           "residual_variance": mixed.residual_variance, "converged": mixed.converged}
    except (np.linalg.LinAlgError, ValueError) as error:
        result["mixed"] = {"error": f"{type(error).__name__}: {error}"}

    complete = [s for s in np.unique(seeds) if {r["batch_size"] for r in rows if r["seed"] == s} == set(batch_sizes)]
    if len(complete) >= 2 and len(batch_sizes) >= 3:
        lookup = {(r["seed"], r["batch_size"]): r[metric] for r in rows}
        page = stats.page_trend([[lookup[s, b] for b in batch_sizes] for s in complete])
        result["page"] = {"L": page.statistic, "n_blocks": page.n_blocks, "method": page.method,
                          "p_falls": page.p_decreasing if sign > 0 else page.p_increasing,
                          "p_rises": page.p_increasing if sign > 0 else page.p_decreasing}
    else:
        result["page"] = {"error": f"needs >= 2 complete seeds and >= 3 batch sizes, got {len(complete)} "
                                   f"and {len(batch_sizes)}"}
    return result


def _fit_differential(corrected_rows, baseline_rows, *, metric, sign, alpha, n_boot, seed, labels) -> dict:
    baseline = {(r["seed"], r["batch_size"]): r[metric] for r in baseline_rows}
    matched = [(r["seed"], r["batch_size"], r[metric] - baseline[r["seed"], r["batch_size"]])
               for r in corrected_rows if (r["seed"], r["batch_size"]) in baseline]
    if not matched:
        return {"status": "insufficient data: no (seed, batch size) run by both methods", "n_seeds": 0}
    seeds, batch_sizes, differences = map(np.asarray, zip(*matched))
    slopes = stats.per_cluster_slopes(np.log2(batch_sizes), differences, seeds)
    if len(slopes) < 2:
        return {"status": f"insufficient data: needs >= 2 seeds with >= 2 matched batch sizes, got {len(slopes)}",
                "n_seeds": len(slopes)}
    values = np.array(list(slopes.values()))
    estimate = stats.mean_estimate(values)
    rng = _rng(seed, *labels)
    boot = values[rng.integers(0, values.size, size=(n_boot, values.size))].mean(axis=1)
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


def _diverged(result: Mapping) -> str:
    """'' if no run of the method diverged, else a clause saying how many and at which batch sizes."""
    if not result.get("n_diverged"):
        return ""
    return (f"{result['n_diverged']} of {result['n_runs']} runs diverged (batch sizes "
            f"{', '.join(map(str, result['diverged_batch_sizes']))})")


def _verdict(role: str, result: Mapping, alpha: float, baselines: Mapping[str, Mapping]) -> tuple[str, str]:
    """(verdict, reason) of one method in one group, from its Holm-adjusted tests.

    ``baselines``: the results of the baseline methods in the same group (their divergence makes a
    corrected layer's differential tests meaningless too).
    """
    trend = result["trend"]
    if role == "other":
        return NO_PREDICTION, "; ".join(filter(None, [f"not a corrected layer nor a baseline; trend {trend}",
                                                      _diverged(result)]))
    if result["status"] != "ok":
        return INCONCLUSIVE, result["status"]
    diverged = [_diverged(result)] if _diverged(result) else []
    if role == "corrected":
        diverged += [f"baseline {b}: {_diverged(baselines[b])}" for b in result.get("differential", {})
                     if _diverged(baselines[b])]
    if diverged:
        return INCONCLUSIVE, f"{'; '.join(diverged)}, so the trend ({trend}) may be divergence, not the layer"
    if role == "baseline":
        verdict = {FLAT: SUPPORTED, RISES: SUPPORTED, FALLS: CONTRADICTED}.get(trend, INCONCLUSIVE)
        return verdict, f"trend {trend}"
    if trend in (FLAT, RISES):
        return CONTRADICTED, f"trend {trend}"
    if trend == UNCLEAR:
        return INCONCLUSIVE, f"trend {trend}"
    differentials = result.get("differential", {})
    if not differentials:
        return INCONCLUSIVE, "falls, but no baseline in this group to compare with"
    weak = [b for b, d in differentials.items() if not _significant(d.get("test"), alpha)]
    if weak:
        return INCONCLUSIVE, f"falls, but not significantly faster than {', '.join(weak)}"
    return SUPPORTED, f"falls, and faster than {', '.join(differentials)}"


def _overall(verdicts: Sequence[str]) -> str:
    if all(v == NO_PREDICTION for v in verdicts):
        return NO_PREDICTION
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    if CONTRADICTED in verdicts:
        return MIXED if SUPPORTED in verdicts else CONTRADICTED
    return INCONCLUSIVE


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

    @property
    def methods(self) -> dict:
        """The primary group's per-method results."""
        return self.groups[self.primary_group]["methods"]

    def to_dict(self, provenance: Mapping | None = None) -> dict:
        """JSON-ready summary (NaN and infinities become null); schema in :mod:`affdiv.experiments.report.writer`."""
        methods = {name: {**result, "overall_verdict": self.overall[name]} for name, result in self.methods.items()}
        return _json_ready({
            "schema_version": SCHEMA_VERSION,
            "decision_rule": self.decision_rule,
            "provenance": dict(provenance or {}),
            "settings": self.settings,
            "family_sizes": self.family_sizes,
            "primary_group": self.primary_group,
            "methods": methods,
            "overall": self.overall,
            "groups": self.groups,
        })


def _json_ready(value):
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (np.integer, np.bool_)):
        return value.item()
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def _role(method: str, corrected: Sequence[str], baselines: Sequence[str]) -> str:
    return "corrected" if method in corrected else "baseline" if method in baselines else "other"


def analyse(records: Sequence[Mapping], *, metric: str = "metric", higher_is_better: bool = True,
            corrected: Sequence[str] = DEFAULT_CORRECTED, baselines: Sequence[str] = DEFAULT_BASELINES,
            group_by: str | None = "lr_rule", alpha: float = 0.05, margin: float | None = None,
            n_boot: int = 2000, seed: int = 0, primary_group: str | None = None,
            sensitivity: bool = True) -> Analysis:
    """Test the batch-size prediction on ``records`` (see the module docstring for the tests).

    group_by: the column whose values split the records into independent analyses (the LR rule);
    None, or a column that no record has, analyses everything as one group named "all".
    margin: equivalence margin per doubling of B in metric units (None: :func:`default_margin`).
    primary_group: the group reported at the top level (default: the first in sorted order).
    sensitivity: False skips the bootstrap, mixed model and Page's L (they do not enter the verdicts;
    the calibration of the whole rule runs without them).
    """
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must lie in (0, 0.5), got {alpha!r}")
    if set(corrected) & set(baselines):
        raise ValueError(f"a method cannot be both corrected and baseline: {sorted(set(corrected) & set(baselines))}")
    if n_boot < 100:
        raise ValueError(f"n_boot must be >= 100 for a percentile CI, got {n_boot}")
    rows = validate_records(records, metric=metric)
    if not rows:
        raise ValueError("no records to analyse")
    if margin is None:
        margin, margin_source = default_margin([r[metric] for r in rows], higher_is_better)
    elif not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    else:
        margin_source = "given"

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

    sign = 1.0 if higher_is_better else -1.0
    roles = {m: _role(m, corrected, baselines) for g in grouped.values() for m in g}
    order = {"corrected": 0, "baseline": 1, "other": 2}
    fit = dict(metric=metric, sign=sign, alpha=alpha, n_boot=n_boot, seed=seed)
    groups = {}
    for group in sorted(grouped):
        methods = {}
        for method in sorted(grouped[group], key=lambda m: (order[roles[m]], m)):
            result = {"role": roles[method], **_fit_method(grouped[group][method], margin=margin, group=group,
                                                           method=method, sensitivity=sensitivity, **fit)}
            if roles[method] == "corrected":
                result["differential"] = {
                    base: _fit_differential(grouped[group][method], grouped[group][base],
                                            labels=(group, method, base), **fit)
                    for base in baselines if base in grouped[group]}
            methods[method] = result
        groups[group] = {"methods": methods}

    family_sizes = _apply_holm(groups, roles)
    for group in groups.values():
        for method, result in group["methods"].items():
            result["trend"] = _trend(result, alpha)
            result["verdict"], result["reason"] = _verdict(roles[method], result, alpha, group["methods"])
    overall = {m: _overall([g["methods"][m]["verdict"] for g in groups.values() if m in g["methods"]])
               for m in sorted(roles, key=lambda m: (order[roles[m]], m))}

    if primary_group is None:
        primary_group = next(iter(groups))
    elif primary_group not in groups:
        raise ValueError(f"primary_group {primary_group!r} is not among the groups {sorted(groups)}")
    settings = {"metric": metric, "higher_is_better": higher_is_better, "alpha": alpha, "margin": margin,
                "margin_source": margin_source, "corrected": list(corrected), "baselines": list(baselines),
                "group_by": group_by if has_group else None, "n_boot": n_boot, "seed": seed,
                "sensitivity": sensitivity,
                "n_records": len(rows)}
    rule = decision_rule(alpha=alpha, margin=margin, margin_source=margin_source,
                         higher_is_better=higher_is_better, corrected=corrected, baselines=baselines)
    return Analysis(settings, rule, groups, primary_group, overall, family_sizes)

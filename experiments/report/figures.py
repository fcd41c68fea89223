"""Figures of the falsification report (matplotlib, no pyplot state: each function saves one PNG).

* :func:`metric_vs_batch` — mean metric per batch size with the t confidence band over seeds, per
  method (marker and line style as well as colour), one panel per group, shared y range.
* :func:`contrast_forest` — the tests that decide a fixed-budget verdict: Δ per method and the DiD
  of each corrected layer against each baseline, with CIs and the ± margin band, per group.
* :func:`slope_forest` — the descriptive clustered-OLS slope per method and group with its CI (and
  the bootstrap CI), the equivalence band ±margin shaded.
* :func:`steps_vs_batch` — steps to target against batch size, log-log, per method: the runs
  (censored ones at max_steps), the fitted S(B) = S_min (1 + B_crit/B) and B_crit marked.
* :func:`examples_vs_steps` — examples E = B S against steps S: the trade-off curve
  (S/S_min - 1)(E/E_min - 1) = 1 per method with the measured batch sizes.
* :func:`bcrit_forest` — B_crit per method at the primary target with its CI (log x).
* :func:`ratio_forest` — each ratio B_crit(corrected)/B_crit(baseline) at the primary target with
  its CI, the equivalence band shaded, 1 marked: the tests that decide.
* :func:`bcrit_vs_target` — along a target ladder: B_crit per method with its CI against the
  target (log y), the primary target marked.
* :func:`ratio_vs_target` — along a target ladder: each ratio B_crit(corrected)/B_crit(baseline)
  with its CI against the target, the equivalence band shaded, 1 and the primary target marked.
* :func:`training_curves` — mean over seeds per epoch: one row per curve metric (train loss,
  validation metric), one panel per method, one line per batch size.
* :func:`calibration_curves` — verdict rates of the decision rule at each planted effect simulated
  (points with ±2 Monte-Carlo s.e., no lines between them), with α.

Each public function builds its Figure with a private ``_build_*`` (what the tests inspect) and saves
it at ``_DPI``; no figure is wider than ``MAX_WIDTH_PX`` pixels (panels wrap into rows).
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from affdiv.atomic import atomic_write
from affdiv.experiments.analysis.critical_batch import RATIO_MARGIN
from affdiv.vocabulary import CONTRADICTED, SUPPORTED

_DPI = 120
MAX_WIDTH_PX = 1800
_MAX_WIDTH_IN = MAX_WIDTH_PX / _DPI - 0.5  # room for bbox_inches="tight"
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")


def _style(i: int) -> dict:
    """Marker and line style of the i-th series: overlapping methods stay visible without colour."""
    return {"marker": _MARKERS[i % len(_MARKERS)], "ls": _LINES[(i // len(_MARKERS) + i) % len(_LINES)],
            "color": f"C{i % 10}"}


def _group_title(analysis, group: str) -> str:
    return _group_words(analysis.settings.get("group_by"), group)


def _group_words(by: str | None, group: str) -> str:
    """A group in words: the LR rule spelled out, else '<column> = <value>'."""
    if by == "lr_rule":
        return {"tuned": "learning rate tuned per method and batch size", "sqrt": "learning rate ∝ √B",
                "linear": "learning rate ∝ B", "constant": "constant learning rate"}.get(group, f"LR rule {group}")
    if by is None:
        return "all runs" if group == "all" else group
    return f"{by} = {group}"


_METRIC_WORDS = {"test_accuracy": "test accuracy (fraction correct)",
                 "val_accuracy": "validation accuracy (fraction correct)",
                 "accuracy": "accuracy (fraction correct)", "test_loss": "test loss (cross-entropy)",
                 "val_loss": "validation loss (cross-entropy)", "train_loss": "training loss (cross-entropy)",
                 "val_metric": "validation metric", "metric": "performance metric"}


def _words(column: str) -> str:
    """A column name in words (never the raw name with underscores)."""
    return _METRIC_WORDS.get(column, column.replace("_", " "))


def _grid(n: int, width: float, height: float, *, sharey: bool = False, max_cols: int | None = None):
    """n panels of width × height inches, wrapped into rows so the figure stays ≤ MAX_WIDTH_PX wide
    (and at most ``max_cols`` panels a row); returns the figure and the n axes (unused grid cells
    removed)."""
    cols = max(1, min(n, int(_MAX_WIDTH_IN // width), max_cols or n))
    rows = -(-n // cols)
    figure = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = list(figure.subplots(rows, cols, squeeze=False, sharey=sharey).ravel())
    for ax in axes[n:]:
        figure.delaxes(ax)
    return figure, axes[:n]


def _plain_log(axis) -> None:
    """A log axis ticked at 1, 2, 5 x 10^k and labelled plainly (``0.2``, ``500``), without minor
    labels: never the crowded ``3×10^-1 4×10^-1`` of matplotlib's minor labels on a short range."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _thousands(value: float, _position=None) -> str:
    """A tick label that stays short: ``1.5k`` for 1500, ``800`` for 800."""
    return f"{value / 1000:g}k" if abs(value) >= 1000 else f"{value:g}"


def _save(figure: Figure, path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return atomic_write(path, buffer.getvalue())


def metric_vs_batch(analysis, path) -> Path:
    return _save(_build_metric_vs_batch(analysis), path)


def _build_metric_vs_batch(analysis) -> Figure:
    metric = analysis.settings["metric"]
    figure, axes = _grid(len(analysis.groups), 4.4, 3.6, sharey=True)
    names = list(dict.fromkeys(m for content in analysis.groups.values() for m in content["methods"]))
    ylabel = f"{_words(metric)}, mean over seeds ({1 - analysis.settings['alpha']:.0%} CI)"
    for ax, (group, content) in zip(axes, analysis.groups.items()):
        for method, result in content["methods"].items():
            cells = result["cells"]
            batch = [c["batch_size"] for c in cells]
            style = _style(names.index(method))
            ax.plot(batch, [c["mean"] for c in cells], ms=4, label=f"{method} ({result['verdict']})", **style)
            banded = [c for c in cells if c["ci_low"] is not None]
            ax.fill_between([c["batch_size"] for c in banded], [c["ci_low"] for c in banded],
                            [c["ci_high"] for c in banded], color=style["color"], alpha=0.15, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (examples per step)")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(_group_title(analysis, group), fontsize=9)
        ax.legend(fontsize=7)
    return figure


_FOREST_STYLE = {"corrected": ("o", "C3", "Δ corrected layer (descriptive: its verdict comes from the DiD rows)"),
                 "baseline": ("s", "C0", "Δ baseline (decides its verdict)"),
                 "other": ("^", "0.55", "Δ other (no prediction)"),
                 "did": ("D", "k", "DiD corrected − baseline (decides the corrected layer)")}


def _contrast_rows(analysis) -> list[tuple[str, dict, str]]:
    """(label, estimate, kind) of each plotted interval; each verdict sits on the row of the test that
    decided it: a baseline's on its Δ, a corrected layer's on its DiD rows (intersection-union)."""
    rows = []
    for group, content in analysis.groups.items():
        for method, r in content["methods"].items():
            c = r.get("contrast", {})
            role = r["role"]
            if c.get("status") == "ok":
                if role == "corrected":
                    rows.append((f"Δ {method} [{group}] (see DiD)", c, role))
                elif role == "baseline":
                    rows.append((f"Δ {method} [{group}] ⇒ {r['verdict']}", c, role))
                else:
                    rows.append((f"Δ {method} [{group}] — {r['verdict']}", c, role))
            for base, d in r.get("did", {}).items():
                if d.get("status") == "ok":
                    rows.append((f"DiD {method} − {base} [{group}]: {d['class']} ⇒ {method} {r['verdict']}", d, "did"))
    return rows


def contrast_forest(analysis, path) -> Path:
    """Δ per method and DiD per (corrected, baseline), with CIs, per group: what decided the verdicts."""
    return _save(_build_contrast_forest(analysis), path)


def _build_contrast_forest(analysis) -> Figure:
    rows = _contrast_rows(analysis)
    figure = Figure(figsize=(8.0, 1.6 + 0.3 * max(len(rows), 1)), layout="constrained")
    ax = figure.subplots()
    margin = analysis.settings["contrast_margin"]
    ax.axvspan(-margin, margin, color="0.88", label=f"± contrast margin ({margin:.3g})")
    ax.axvline(0.0, color="0.3", lw=0.8)
    seen = set()
    for i, (_label, e, kind) in enumerate(rows):
        y = len(rows) - i
        marker, colour, name = _FOREST_STYLE[kind]
        ax.errorbar(e["estimate"], y, xerr=[[e["estimate"] - e["ci_low"]], [e["ci_high"] - e["estimate"]]],
                    fmt=marker, color=colour, capsize=3, ms=4, label=None if name in seen else name)
        seen.add(name)
    ax.set_yticks(range(len(rows), 0, -1), [label for label, _, _ in rows], fontsize=7)
    words = _words(analysis.settings["metric"])
    ax.set_xlabel(f"{words}: largest − best batch size (Δ),\nand Δ(corrected) − Δ(baseline) (DiD)", fontsize=8)
    ax.set_ylabel("test [group] ⇒ the verdict it decided", fontsize=8)
    figure.suptitle("the tests that decide the verdicts, per group and LR rule "  # centred on the figure: the
                    f"({1 - analysis.settings['alpha']:.0%} CI)", fontsize=9)  # labels leave the axes narrow
    figure.legend(fontsize=7, loc="outside lower center", ncols=2)  # under the figure: room for the labels
    return figure


def slope_forest(analysis, path) -> Path:
    return _save(_build_slope_forest(analysis), path)


def _build_slope_forest(analysis) -> Figure:
    rows = [(group, method, result) for group, content in analysis.groups.items()
            for method, result in content["methods"].items() if result["status"] == "ok"]
    figure = Figure(figsize=(7.0, 1.4 + 0.32 * max(len(rows), 1)), layout="constrained")
    ax = figure.subplots()
    margin = analysis.settings["margin"]
    ax.axvspan(-margin, margin, color="0.85", label=f"±margin ({margin:.3g})")
    ax.axvline(0.0, color="0.3", lw=0.8, ls=":")
    for i, (_, _, r) in enumerate(rows):
        y = len(rows) - i
        ax.errorbar(r["slope"], y, xerr=[[r["slope"] - r["ci_low"]], [r["ci_high"] - r["slope"]]],
                    fmt="o" if r["role"] != "other" else "^", color="C0" if r["role"] != "other" else "0.5",
                    capsize=3, label="clustered OLS, t CI" if i == 0 else None)
        if "boot_ci_low" in r:
            ax.plot([r["boot_ci_low"], r["boot_ci_high"]], [y - 0.22] * 2, color="C1", lw=2,
                    label="cluster bootstrap CI" if i == 0 else None)
    ax.set_yticks(range(len(rows), 0, -1), [f"{m} [{g}] — trend {r['trend']}" for g, m, r in rows], fontsize=8)
    words = _words(analysis.settings["metric"])
    ax.set_xlabel(f"slope of {words} per doubling of the batch size", fontsize=8)
    ax.set_ylabel("method [group]: descriptive trend", fontsize=8)
    ax.set_title("descriptive slopes (no verdict: the verdicts come from the contrast forest)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return figure


def training_curves(curves: Sequence[Mapping], path, *, metrics: Sequence[str] = ("train_loss", "val_metric"),
                    group_by: str | None = None, group: str | None = None) -> Path:
    """Curves are points {method, batch_size, seed, epoch or step, <metric>...}: per metric present in
    them, one panel per method (wrapped into rows), one line per batch size (mean over seeds), against
    ``step`` when the points carry it (one point per check), else against ``epoch``. Only ``group``
    is drawn if given, and it is named in the figure's title."""
    return _save(_build_training_curves(curves, metrics=metrics, group_by=group_by, group=group), path)


def _build_training_curves(curves: Sequence[Mapping], *, metrics: Sequence[str] = ("train_loss", "val_metric"),
                           group_by: str | None = None, group: str | None = None) -> Figure:
    if group_by is not None and group is not None:
        curves = [c for c in curves if str(c.get(group_by)) == group]
    present = [m for m in metrics if any(m in c for c in curves)]
    if not present:
        raise ValueError(f"no training-curve points with any of the metrics {list(metrics)}")
    x_key = "step" if all(c.get("step") is not None for c in curves) else "epoch"
    methods = sorted({c["method"] for c in curves})
    batch_all = sorted({int(c["batch_size"]) for c in curves})
    figure, axes = _grid(len(present) * len(methods), 3.4, 2.8)
    panels = iter(axes)
    for metric in present:
        for method in methods:
            ax = next(panels)
            points = defaultdict(list)
            for c in curves:
                if c["method"] == method and c.get(metric) is not None:
                    points[int(c["batch_size"]), int(c[x_key])].append(float(c[metric]))
            for batch_size in sorted({b for b, _ in points}):
                k = batch_all.index(batch_size)
                xs = sorted(x for b, x in points if b == batch_size)
                style = _style(k)
                ax.plot(xs, [np.mean(points[batch_size, x]) for x in xs], marker=style["marker"], ls=style["ls"],
                        ms=3, color=colormaps["viridis"](k / max(len(batch_all) - 1, 1)), label=f"B = {batch_size}")
            ax.set_title(method, fontsize=9)
            ax.set_xlabel("optimizer step" if x_key == "step" else "epoch (passes over the training set)", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # labels that fit a narrow panel
            ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
            ax.set_ylabel(f"{_words(metric)}\nmean over seeds", fontsize=8)
            ax.legend(fontsize=7)
    where = "" if group is None else f" — {_group_words(group_by, group)}"
    figure.suptitle(f"training curves{where}", fontsize=10)
    return figure


def calibration_curves(calibration, path) -> Path:
    """Verdict rates (joint 'supported' and 'contradicted', each corrected layer's 'supported')
    against the planted effect: points at the simulated effects only (no line implies a rate
    between them), ±2 Monte-Carlo s.e., with alpha and the ± equivalence margin."""
    return _save(_build_calibration_curves(calibration), path)


def _build_calibration_curves(calibration) -> Figure:
    figure = Figure(figsize=(7.0, 4.4), layout="constrained")
    ax = figure.subplots()
    effects = np.asarray(calibration.effects, dtype=np.float64)
    order = np.argsort(effects)
    series = [(f"joint verdict '{v}' of the prediction", calibration.joint[v])
              for v in (SUPPORTED, CONTRADICTED) if v in calibration.joint]
    series += [(f"{m}: verdict 'supported'", rates) for m, rates in calibration.methods.items()]
    gap = float(np.min(np.diff(effects[order]))) if len(effects) > 1 else 1.0
    for i, (label, rates) in enumerate(series):  # points only where studies were simulated, dodged apart
        rates = np.asarray(rates)[order]
        se = np.sqrt(rates * (1 - rates) / calibration.n_sims)
        style = _style(i)
        dx = (i - (len(series) - 1) / 2) * 0.3 * gap / max(len(series) - 1, 1)
        ax.errorbar(effects[order] + dx, rates, yerr=2 * se, fmt=style["marker"], color=style["color"], ms=5,
                    capsize=2, lw=1, label=label)
    ax.axhline(calibration.alpha, color="k", ls="--", lw=0.8, label=f"α = {calibration.alpha:g} (nominal error rate)")
    ax.axvline(calibration.null_effect, color="0.5", ls=":", lw=0.8, label="no planted effect (prediction false)")
    margin = (calibration.layout or {}).get("margin")
    if margin:
        for k, x in enumerate((calibration.null_effect - margin, calibration.null_effect + margin)):
            ax.axvline(x, color="C7", ls="-", lw=0.8,
                       label=f"± equivalence margin ({margin:g})" if k == 0 else None)
    ax.set_xlabel(calibration.effect_name, fontsize=8)
    ax.set_ylabel(f"rate over {calibration.n_sims} simulated studies")
    ax.set_title("calibration of the decision rule on simulated studies\npoints: the simulated effects, "
                 "±2 Monte-Carlo s.e.", fontsize=9)
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    return figure


def _curve_fits(analysis):
    content = analysis.primary
    return [(m, r) for m, r in content["critical_batch"].items()]


def _fitted(r: Mapping, widen: float):
    """The fitted S(B) = S_min (1 + B_crit/B) over the measured batch sizes widened ×``widen`` each
    way, as (batch sizes, steps); None when the fit gave no S_min or B_crit."""
    if not (r.get("b_crit") and r.get("s_min")):
        return None
    batch = np.geomspace(min(r["batch_sizes"]) / widen, max(r["batch_sizes"]) * widen, 100)
    return batch, r["s_min"] * (1 + r["b_crit"] / batch)


def _build_target_figure(analysis, draw, *, xscale: dict, xlabel: str, ylabel: str, title: str) -> Figure:
    """One panel per target-design figure: ``draw(ax, method, fit, style)`` per method of the
    primary group (marker, line style and colour of the method's rank) returns the method's legend
    label (None: nothing drawn); log-log axes, the group in words in the title's first line."""
    figure = Figure(figsize=(6.5, 4.4), layout="constrained")
    ax = figure.subplots()
    handles = []
    for i, (method, r) in enumerate(_curve_fits(analysis)):
        style = _style(i)
        if (label := draw(ax, method, r, style)) is not None:
            # the legend shows the method's marker and its fit's line style together
            handles.append(Line2D([], [], marker=style["marker"], ls=style["ls"], color=style["color"], ms=5,
                                  lw=1, label=label))
    ax.set_xscale("log", **xscale)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    first, _, rest = title.partition("\n")
    ax.set_title(f"{first}, {_group_title(analysis, analysis.primary_group)}\n{rest}", fontsize=9)
    if handles:  # no legend where no method reached the target
        ax.legend(handles=handles, fontsize=7)
    return figure


def steps_vs_batch(analysis, path) -> Path:
    """Log-log steps to target against B per method: runs, censored runs, the fit and B_crit."""
    return _save(_build_steps_vs_batch(analysis), path)


def _build_steps_vs_batch(analysis) -> Figure:
    def draw(ax, method, r, style):
        reached = [(c["batch_size"], c["median_steps"]) for c in r["cells"] if c.get("median_steps")]
        if reached:
            ax.plot(*zip(*reached), marker=style["marker"], ls="none", color=style["color"], ms=5)
        censored = [(c["batch_size"], c["max_steps"]) for c in r["cells"] if c["censored"]]
        if censored:
            ax.plot(*zip(*censored), marker=style["marker"], ls="none", mfc="none", color=style["color"], ms=7,
                    alpha=0.6)
        if (fit := _fitted(r, 1.5)) is not None:
            ax.plot(*fit, ls=style["ls"], color=style["color"], lw=1)
            if r.get("resolved"):  # S(B_crit) = 2 S_min: B_crit on the method's own curve
                ax.plot(r["b_crit"], 2 * r["s_min"], marker=style["marker"], ms=11, mfc="none", mew=1.5,
                        ls="none", color=style["color"])
        return f"{method} ({r['verdict']})" if reached else None

    return _build_target_figure(
        analysis, draw, xscale={"base": 2}, xlabel="batch size B (examples per step)",
        ylabel="optimizer steps to the target (median of the runs)",
        title="steps to target\nlines: fits; large open markers: B_crit (S = 2 S_min); faint open: censored runs")


def examples_vs_steps(analysis, path) -> Path:
    """E = B S against S per method, with the fitted hyperbola (S/S_min - 1)(E/E_min - 1) = 1."""
    return _save(_build_examples_vs_steps(analysis), path)


def _build_examples_vs_steps(analysis) -> Figure:
    def draw(ax, method, r, style):
        points = [(c["median_steps"], c["batch_size"] * c["median_steps"]) for c in r["cells"] if c.get("median_steps")]
        if points:
            ax.plot(*zip(*points), marker=style["marker"], ls="none", color=style["color"], ms=5)
        if (fit := _fitted(r, 2.0)) is not None:
            batch, steps = fit
            ax.plot(steps, steps * batch, ls=style["ls"], color=style["color"], lw=1)
        return method if points else None

    return _build_target_figure(
        analysis, draw, xscale={}, xlabel="optimizer steps to the target S",
        ylabel="training examples to the target E = B·S",
        title="the steps–examples trade-off\nS_min and E_min are the asymptotes")


def _ladder(analysis) -> list[tuple[float, Mapping]]:
    """(target, the primary group's analysis there) along the ladder, in increasing target."""
    return sorted((float(key), groups[analysis.primary_group]) for key, groups in analysis.by_target.items()
                  if key and analysis.primary_group in groups)


def _dodge(i: int, n: int, ladder: Sequence[tuple[float, Mapping]]) -> float:
    """The x offset of the i-th of n series, so that their intervals at one target do not overlap:
    within a fifth of the smallest gap between targets."""
    targets = [t for t, _ in ladder]
    gap = min(np.diff(targets)) if len(targets) > 1 else 0.01
    return (i - (n - 1) / 2) * 0.2 * gap / max(n - 1, 1)


def _build_ladder_figure(analysis, series, *, ylabel: str, title: str, band: tuple[float, float] | None) -> Figure:
    """One panel against the target: ``series`` [(label, [(target, estimate, low, high, resolved)])]
    as points with their CIs (open markers: unresolved, no CI), told apart by marker and line style
    as well as colour; log y; the primary target dotted; ``band`` shaded (with a line at 1)."""
    ladder = _ladder(analysis)
    figure = Figure(figsize=(6.5, 4.4), layout="constrained")
    ax = figure.subplots()
    if band is not None:
        ax.axhspan(*band, color="0.9", label=f"equivalence band [{band[0]:.3g}, {band[1]:.3g}]")
        ax.axhline(1.0, color="0.3", lw=0.8, label="ratio 1 (no difference)")
    for i, (label, points) in enumerate(series):
        style = _style(i)
        dx = _dodge(i, len(series), ladder)
        xs = [t + dx for t, *_ in points]
        ax.plot(xs, [p[1] for p in points], lw=1, ms=5, label=label, **style)
        for x, (_, estimate, low, high, resolved) in zip(xs, points):
            if resolved and low is not None and high is not None:
                ax.errorbar(x, estimate, yerr=[[estimate - low], [high - estimate]], fmt="none",
                            color=style["color"], capsize=3, lw=1)
            else:
                ax.plot(x, estimate, marker=style["marker"], mfc="white", color=style["color"], ms=7, ls="none")
    primary = analysis.primary_target
    if primary is not None:
        ax.axvline(primary, color="k", ls=":", lw=1, label=f"primary target {primary:g} (decides the verdict)")
    ax.set_yscale("log")
    ax.set_xticks([t for t, _ in ladder], [f"{t:g}" for t, _ in ladder])
    ax.set_xlabel("target validation accuracy (steps are counted to reach it)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}, {_group_title(analysis, analysis.primary_group)}\n"
                 f"{1 - analysis.settings['alpha']:.0%} CI (jackknife); open markers: unresolved, a bound", fontsize=9)
    ax.legend(fontsize=7)
    return figure


def bcrit_vs_target(analysis, path) -> Path:
    """B_crit per method with its CI against the target of a ladder (log y), the primary target marked."""
    return _save(_build_bcrit_vs_target(analysis), path)


def _build_bcrit_vs_target(analysis) -> Figure:
    ladder = _ladder(analysis)
    methods = list(dict.fromkeys(m for _, content in ladder for m in content["critical_batch"]))
    series = []
    for method in methods:
        points = [(t, r["b_crit"], r.get("ci_low"), r.get("ci_high"), bool(r.get("resolved")))
                  for t, content in ladder if (r := content["critical_batch"].get(method)) and r.get("b_crit")]
        if points:
            role = next(c["critical_batch"][method]["role"] for _, c in ladder if method in c["critical_batch"])
            series.append((f"{method} ({role})", points))
    return _build_ladder_figure(analysis, series, ylabel="critical batch size B_crit (examples per step)",
                                title="B_crit along the target ladder", band=None)


def ratio_vs_target(analysis, path) -> Path:
    """Each ratio B_crit(corrected)/B_crit(baseline) with its CI against the target of a ladder, the
    equivalence band [RATIO_MARGIN, 1/RATIO_MARGIN] shaded, a line at 1, the primary target marked."""
    return _save(_build_ratio_vs_target(analysis), path)


def _build_ratio_vs_target(analysis) -> Figure:
    ladder = _ladder(analysis)
    pairs = list(dict.fromkeys((c, b) for _, content in ladder for c, against in content["ratios"].items()
                               for b in against))
    series = []
    for c, b in pairs:
        points = [(t, r["ratio"], r.get("ci_low"), r.get("ci_high"), True) for t, content in ladder
                  if (r := content["ratios"].get(c, {}).get(b, {})).get("status") == "ok"]
        if points:
            series.append((f"{c} / {b}", points))
    return _build_ladder_figure(analysis, series, ylabel="ratio B_crit(corrected) / B_crit(baseline)",
                                title="B_crit ratios along the target ladder", band=(RATIO_MARGIN, 1 / RATIO_MARGIN))


def bcrit_forest(analysis, path) -> Path:
    """B_crit per method at the primary target with its CI (log x): one row per method of the
    primary group, open markers for an unresolved B_crit (a bound, no CI)."""
    return _save(_build_bcrit_forest(analysis), path)


def _build_bcrit_forest(analysis) -> Figure:
    rows = [(m, r) for m, r in analysis.primary["critical_batch"].items() if r.get("b_crit")]
    figure = Figure(figsize=(6.5, 1.9 + 0.34 * max(len(rows), 1)), layout="constrained")
    ax = figure.subplots()
    for i, (_, r) in enumerate(rows):
        y, style = len(rows) - i, _style(i)
        if r.get("resolved") and r.get("ci_low") is not None:
            ax.errorbar(r["b_crit"], y, xerr=[[r["b_crit"] - r["ci_low"]], [r["ci_high"] - r["b_crit"]]],
                        fmt=style["marker"], color=style["color"], capsize=3, ms=6)
        else:
            ax.plot(r["b_crit"], y, marker=style["marker"], mfc="white", color=style["color"], ms=7, ls="none")
    ax.set_xscale("log")
    _plain_log(ax.xaxis)
    ax.set_yticks(range(len(rows), 0, -1), [f"{m} ({r['role']}): {r['verdict']}" for m, r in rows], fontsize=8)
    ax.set_ylim(0.4, len(rows) + 0.6)
    ax.set_xlabel("critical batch size B_crit (examples per step; log scale)")
    ax.set_ylabel("method (role): verdict", fontsize=8)
    figure.suptitle(f"B_crit per method{_at_primary(analysis)}, {1 - analysis.settings['alpha']:.0%} CI "
                    f"(jackknife)\n{_group_title(analysis, analysis.primary_group)}; open markers: unresolved, a bound",
                    fontsize=9)
    return figure


def ratio_forest(analysis, path) -> Path:
    """Each ratio B_crit(corrected)/B_crit(baseline) at the primary target with its CI (log x), the
    equivalence band [RATIO_MARGIN, 1/RATIO_MARGIN] shaded and a line at 1: the tests that decide."""
    return _save(_build_ratio_forest(analysis), path)


def _build_ratio_forest(analysis) -> Figure:
    rows = [(c, b, r) for c, against in analysis.primary["ratios"].items() for b, r in against.items()
            if r.get("status") == "ok"]
    figure = Figure(figsize=(6.5, 1.9 + 0.34 * max(len(rows), 1)), layout="constrained")
    ax = figure.subplots()
    ax.axvspan(RATIO_MARGIN, 1 / RATIO_MARGIN, color="0.9",
               label=f"equivalence band [{RATIO_MARGIN:.3g}, {1 / RATIO_MARGIN:.3g}]")
    ax.axvline(1.0, color="0.3", lw=0.8, label="ratio 1 (no difference)")
    for i, (_, _, r) in enumerate(rows):
        y, style = len(rows) - i, _style(i)
        ax.errorbar(r["ratio"], y, xerr=[[r["ratio"] - r["ci_low"]], [r["ci_high"] - r["ratio"]]],
                    fmt=style["marker"], color=style["color"], capsize=3, ms=6)
    ax.set_xscale("log")
    _plain_log(ax.xaxis)
    ax.set_yticks(range(len(rows), 0, -1), [f"{c} / {b}: {r['class']}, p = {r['p']:.2g}" for c, b, r in rows],
                  fontsize=8)
    ax.set_ylim(0.4, len(rows) + 0.6)
    ax.set_xlabel("ratio B_crit(corrected) / B_crit(baseline) (log scale)")
    ax.set_ylabel("pair: class, one-sided p", fontsize=8)
    figure.suptitle(f"the tests that decide{_at_primary(analysis)}, {1 - analysis.settings['alpha']:.0%} CI "
                    f"(jackknife)\n{_group_title(analysis, analysis.primary_group)}", fontsize=9)
    figure.legend(fontsize=7, loc="outside lower center", ncols=2)
    return figure


def _at_primary(analysis) -> str:
    target = analysis.primary_target
    return "" if target is None else f" at the primary target {target:g}"

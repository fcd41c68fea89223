"""Figures of the falsification report (matplotlib, no pyplot state: each function saves one PNG).

* :func:`metric_vs_batch` — mean metric per batch size with the t confidence band over seeds, per
  method, one panel per group.
* :func:`slope_forest` — clustered-OLS slope per method and group with its CI (and the bootstrap
  CI), the equivalence band ±margin shaded.
* :func:`training_curves` — mean over seeds per epoch: one row per curve metric (train loss,
  validation metric), one panel per method, one line per batch size.
* :func:`calibration_curves` — rejection rate against planted slope per test, with α and ±margin.
* :func:`probe_alignment` — ``affdiv probe``: each alignment metric against batch size, one line per
  layer, ± its standard error over repeats.
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from affdiv.atomic import atomic_write
from affdiv.experiments.analysis.calibration import Calibration
from affdiv.experiments.analysis.decision import Analysis

_DPI = 120


def _save(figure: Figure, path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return atomic_write(path, buffer.getvalue())


def _panels(n: int, width: float = 4.2, height: float = 3.4):
    figure = Figure(figsize=(width * n, height), layout="constrained")
    axes = figure.subplots(1, n, squeeze=False)[0]
    return figure, axes


def metric_vs_batch(analysis: Analysis, path) -> Path:
    metric = analysis.settings["metric"]
    figure, axes = _panels(len(analysis.groups))
    for ax, (group, content) in zip(axes, analysis.groups.items()):
        for method, result in content["methods"].items():
            cells = result["cells"]
            batch = [c["batch_size"] for c in cells]
            (line,) = ax.plot(batch, [c["mean"] for c in cells], marker="o", ms=3,
                              ls="-" if result["role"] != "other" else ":", label=method)
            banded = [c for c in cells if c["ci_low"] is not None]
            ax.fill_between([c["batch_size"] for c in banded], [c["ci_low"] for c in banded],
                            [c["ci_high"] for c in banded], color=line.get_color(), alpha=0.2, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"{metric} (mean over seeds, {1 - analysis.settings['alpha']:.0%} CI)")
        ax.set_title(group)
        ax.legend(fontsize=7)
    return _save(figure, path)


def slope_forest(analysis: Analysis, path) -> Path:
    rows = [(group, method, result) for group, content in analysis.groups.items()
            for method, result in content["methods"].items() if result["status"] == "ok"]
    figure = Figure(figsize=(6.5, 0.9 + 0.32 * max(len(rows), 1)))
    ax = figure.subplots()
    margin = analysis.settings["margin"]
    ax.axvspan(-margin, margin, color="0.85", label=f"±margin ({margin:.3g})")
    ax.axvline(0.0, color="0.3", lw=0.8)
    for i, (_, _, r) in enumerate(rows):
        y = len(rows) - i
        ax.errorbar(r["slope"], y, xerr=[[r["slope"] - r["ci_low"]], [r["ci_high"] - r["slope"]]],
                    fmt="o", color="C0" if r["role"] != "other" else "0.5", capsize=3,
                    label="clustered OLS, t CI" if i == 0 else None)
        if "boot_ci_low" in r:
            ax.plot([r["boot_ci_low"], r["boot_ci_high"]], [y - 0.22] * 2, color="C1", lw=2,
                    label="cluster bootstrap CI" if i == 0 else None)
    ax.set_yticks(range(len(rows), 0, -1), [f"{m} [{g}] — {r['verdict']}" for g, m, r in rows], fontsize=8)
    ax.set_xlabel(f"slope of {analysis.settings['metric']} per doubling of the batch size")
    ax.legend(fontsize=7, loc="best")
    return _save(figure, path)


def training_curves(curves: Sequence[Mapping], path, *, metrics: Sequence[str] = ("train_loss", "val_metric"),
                    group_by: str | None = None, group: str | None = None) -> Path:
    """Curves are points {method, batch_size, seed, epoch, <metric>...}: one row of panels per metric
    present in them, one panel per method, one line per batch size (mean over seeds). Only ``group``
    is drawn if given."""
    if group_by is not None and group is not None:
        curves = [c for c in curves if str(c.get(group_by)) == group]
    present = [m for m in metrics if any(m in c for c in curves)]
    if not present:
        raise ValueError(f"no training-curve points with any of the metrics {list(metrics)}")
    methods = sorted({c["method"] for c in curves})
    figure = Figure(figsize=(3.6 * len(methods), 2.8 * len(present)), layout="constrained")
    axes = figure.subplots(len(present), len(methods), squeeze=False)
    for row, metric in zip(axes, present):
        for ax, method in zip(row, methods):
            points = defaultdict(list)
            for c in curves:
                if c["method"] == method and c.get(metric) is not None:
                    points[int(c["batch_size"]), int(c["epoch"])].append(float(c[metric]))
            batch_sizes = sorted({b for b, _ in points})
            for k, batch_size in enumerate(batch_sizes):
                epochs = sorted(e for b, e in points if b == batch_size)
                ax.plot(epochs, [np.mean(points[batch_size, e]) for e in epochs],
                        color=colormaps["viridis"](k / max(len(batch_sizes) - 1, 1)), label=f"B={batch_size}")
            ax.set_title(method, fontsize=9)
            ax.set_xlabel("epoch")
            ax.set_ylabel(f"{metric} (mean over seeds)", fontsize=8)
            ax.legend(fontsize=6)
    return _save(figure, path)


def calibration_curves(calibration: Calibration, path) -> Path:
    figure = Figure(figsize=(6.5, 4.0))
    ax = figure.subplots()
    planted = np.asarray(calibration.planted)
    order = np.argsort(planted)
    for test, rates in calibration.rates.items():
        rates = np.asarray(rates)[order]
        se = np.sqrt(rates * (1 - rates) / calibration.n_sims)
        (line,) = ax.plot(planted[order], rates, marker="o", ms=3, label=test)
        ax.fill_between(planted[order], rates - 2 * se, rates + 2 * se, color=line.get_color(), alpha=0.2, lw=0)
    ax.axhline(calibration.alpha, color="k", ls="--", lw=0.8, label=f"α = {calibration.alpha:g}")
    for edge in (-calibration.margin, calibration.margin):
        ax.axvline(edge, color="0.5", ls=":", lw=0.8)
    ax.set_xlabel("planted slope per doubling of the batch size")
    ax.set_ylabel(f"rejection rate ({calibration.n_sims} simulations, ±2 MC s.e.)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7)
    return _save(figure, path)


def probe_alignment(rows: Sequence[Mapping], metrics: Sequence[str], path) -> Path:
    """Rows {member, batch_size, <metric>, <metric>_se}: one panel per metric, one line per member."""
    figure, axes = _panels(len(metrics), width=4.0)
    members = list(dict.fromkeys(r["member"] for r in rows))
    for ax, metric in zip(axes, metrics):
        for member in members:
            mine = [r for r in rows if r["member"] == member]
            ax.errorbar([r["batch_size"] for r in mine], [r[metric] for r in mine],
                        yerr=[r[f"{metric}_se"] for r in mine], marker="o", ms=3, capsize=2, label=member)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(metric.replace("_", " "))
    axes[0].legend(fontsize=7)
    return _save(figure, path)

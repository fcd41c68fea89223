"""The falsification report: Markdown, self-contained HTML, summary.json, a LaTeX table, figures.

:func:`write_report` writes into ``out_dir``:

* ``report.md`` and ``report.html`` (the same document; the HTML embeds its figures);
* ``summary.json`` — schema version 1::

    {"schema_version": 1,
     "decision_rule": str,                 # the rule, stated before any number (one clause a line)
     "provenance": {...},                  # affdiv.provenance.provenance(...) of the run
     "settings": {"metric", "higher_is_better", "alpha", "margin", "margin_source", "corrected",
                  "baselines", "group_by", "n_boot", "seed", "sensitivity", "n_records"},
     "family_sizes": {"prediction": int, "exploratory": int},   # Holm families
     "primary_group": str,
     "methods": {name: <method> + {"overall_verdict"}},          # the primary group's methods
     "overall": {name: "supported"|"contradicted"|"mixed"|"inconclusive"|"no prediction"},
     "groups": {group: {"methods": {name: <method>}}},
     "calibration": {...} | absent,        # Calibration.to_dict()
     "files": {name: relative path}}

  where <method> is
    {"role": "corrected"|"baseline"|"other", "status": "ok"|"insufficient data: ...",
     "n_runs", "n_seeds", "batch_sizes": [int],
     "n_diverged", "diverged_batch_sizes": [int],  # only when records carry "diverged"; any diverged run
                                                  # makes the verdict "inconclusive" (see the decision rule)
     "cells": [{"batch_size", "n", "mean", "sd", "ci_low", "ci_high"}],    # per batch size, over seeds
     "slope", "se", "df", "ci_low", "ci_high",    # clustered OLS (CR1), metric units per doubling, 1-alpha CI
     "p_value",                                   # two-sided p of slope = 0 (unadjusted)
     "tost_ci_low", "tost_ci_high",               # 1-2 alpha CI (TOST)
     "boot_ci_low", "boot_ci_high", "n_boot",     # cluster-bootstrap percentile CI  } only when
     (and "mixed", "page" below)                  #   settings.sensitivity is true
     "tests": {"falls"|"rises"|"flat": {"p", "p_holm"}},   # performance scale; p_holm within its family
     "mixed": {"slope", "se", "p_value", "p_falls", "p_rises", "seed_variance", "residual_variance",
               "converged"} | {"error"},
     "page": {"L", "n_blocks", "method", "p_falls", "p_rises"} | {"error"},
     "differential": {baseline: {"status", "n_seeds", "slope", "se", "df", "ci_low", "ci_high",
                      "boot_ci_low", "boot_ci_high", "p_value", "per_seed_slopes", "test": {"p", "p_holm"}}},
                                                  # corrected methods only
     "trend": "falls"|"rises"|"flat"|"unclear", "verdict": str, "reason": str}

  Non-finite numbers are written as null; fields of a method with insufficient data are absent.
* ``summary.tex`` — a booktabs table of the verdicts;
* ``records.csv`` — the analysed records (``affdiv analyse --input records.csv`` reproduces the numbers);
* ``metric_vs_batch.png``, ``slope_forest.png``, and when given ``training_curves.png`` and ``calibration.png``.

Every file is written to a temporary name and renamed, so a killed process leaves no half-written file.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from affdiv.atomic import atomic_write
from affdiv.experiments.analysis.calibration import Calibration
from affdiv.experiments.analysis.decision import Analysis
from affdiv.experiments.records import write_csv
from affdiv.experiments.report import figures
from affdiv.verify.latex import escape


# --------------------------------------------------------------------------------------- output
def _number(value) -> str:
    return "—" if value is None else f"{value:.3g}"


def _p(value) -> str:
    if value is None:
        return "—"
    return "<1e-4" if value < 1e-4 else f"{value:.4f}"


def _interval(low, high) -> str:
    return "—" if low is None else f"[{_number(low)}, {_number(high)}]"


# ------------------------------------------------------------------------------------- document
# A document is a list of blocks: ("h", level, text), ("p", text), ("list", [text]),
# ("table", header, rows), ("image", file, caption), ("code", text). It renders to both formats.

def _tables(summary: Mapping) -> list:
    blocks = []
    groups = summary["groups"]
    header = ["method", "role", *[f"verdict [{g}]" for g in groups], "overall"]
    rows = [[m, next(g["methods"][m]["role"] for g in groups.values() if m in g["methods"]),
             *[groups[g]["methods"].get(m, {}).get("verdict", "—") for g in groups], verdict]
            for m, verdict in summary["overall"].items()]
    sizes = summary["family_sizes"]
    blocks += [("h", 2, "Verdicts"), ("table", header, rows),
               ("p", f"Holm families: {sizes['prediction']} tests on corrected and baseline methods (verdicts), "
                     f"{sizes['exploratory']} on other methods (trend only). Equivalence margin "
                     f"{summary['settings']['margin']:.4g} per doubling ({summary['settings']['margin_source']}).")]
    for group, content in groups.items():
        title = f"Group {group}" if summary["settings"]["group_by"] is None else \
            f"Group {summary['settings']['group_by']} = {group}"
        blocks.append(("h", 2, title))
        rows = []
        for m, r in content["methods"].items():
            t = r["tests"]
            rows.append([m, r["role"], str(r["n_seeds"]), " ".join(map(str, r["batch_sizes"])), _number(r.get("slope")),
                         _interval(r.get("ci_low"), r.get("ci_high")),
                         _interval(r.get("boot_ci_low"), r.get("boot_ci_high")), _p(r.get("p_value")),
                         *[_p(t.get(k, {}).get("p_holm")) for k in ("falls", "rises", "flat")],
                         r["trend"], f"**{r['verdict']}**", r["reason"]])
        blocks.append(("table", ["method", "role", "seeds", "batch sizes", "slope", "CI (t, clustered)",
                                 "CI (bootstrap)", "p (two-sided)", "p_Holm falls", "p_Holm rises",
                                 "p_Holm flat", "trend", "verdict", "reason"], rows))
        diffs = [[m, b, str(d["n_seeds"]), _number(d.get("slope")), _interval(d.get("ci_low"), d.get("ci_high")),
                  _interval(d.get("boot_ci_low"), d.get("boot_ci_high")), _p(d.get("test", {}).get("p")),
                  _p(d.get("test", {}).get("p_holm")), d["status"]]
                 for m, r in content["methods"].items() for b, d in r.get("differential", {}).items()]
        if diffs:
            blocks += [("p", "Differential slopes (corrected − baseline, per seed, then averaged):"),
                       ("table", ["corrected", "baseline", "seeds", "slope", "CI (t)", "CI (bootstrap)",
                                  "p (falls faster)", "p_Holm", "status"], diffs)]
        sensitivity = [[m, _number(r.get("mixed", {}).get("slope")), _number(r.get("mixed", {}).get("se")),
                        _p(r.get("mixed", {}).get("p_falls")), str(r.get("mixed", {}).get("converged", "—")),
                        _number(r.get("page", {}).get("L")), _p(r.get("page", {}).get("p_falls")),
                        _p(r.get("page", {}).get("p_rises"))]
                       for m, r in content["methods"].items() if r["status"] == "ok"]
        if sensitivity:
            blocks += [("p", "Sensitivity analyses (unadjusted; not part of the decision rule). The mixed model's "
                             "Wald z and the percentile cluster bootstrap ignore that only G seeds inform the "
                             "slope's variance: with few seeds both are liberal (see the calibration)."),
                       ("table", ["method", "mixed-model slope", "s.e.", "p falls", "converged", "Page's L",
                                  "Page p falls", "Page p rises"], sensitivity)]
    return blocks


def _calibration_blocks(calibration: Calibration) -> list:
    layout = calibration.layout
    rows = [[_number(s), *[f"{calibration.rates[t][i]:.3f}" for t in calibration.rates]]
            for i, s in enumerate(calibration.planted)]
    blocks = [
        ("h", 2, "Calibration on simulated sweeps"),
        ("p", f"{calibration.n_sims} simulated sweeps per planted slope, {layout.n_seeds} seeds × batch sizes "
              f"{', '.join(map(str, layout.batch_sizes))}, seed s.d. {layout.seed_sd:g}, noise s.d. "
              f"{layout.noise_sd:g}; unadjusted one-sided tests at α = {calibration.alpha:g}, TOST margin "
              f"{calibration.margin:g}. At slope 0 a rate is a false-positive rate, below 0 a power; the "
              f"Monte-Carlo s.e. of a rate r is √(r(1−r)/{calibration.n_sims})."),
        ("table", ["planted slope", *calibration.rates], rows),
    ]
    if calibration.verdicts is not None:
        rows = [[_number(s), *[f"{calibration.verdicts[v][i]:.3f}" for v in calibration.verdicts]]
                for i, s in enumerate(calibration.planted)]
        blocks += [("p", "The whole decision rule on simulated studies (affine_like at the planted slope, affine "
                         "and batchnorm flat, every group, Holm over the full family): how often each overall "
                         "verdict for affine_like comes out. At slope 0, 'supported' is a false positive."),
                   ("table", ["planted slope", *calibration.verdicts], rows)]
    return blocks


def _provenance_block(provenance: Mapping) -> list:
    return [("h", 2, "Provenance"), ("code", json.dumps(dict(provenance), indent=2, sort_keys=True, default=str))]


def _document(summary: Mapping, files: Mapping[str, str], calibration: Calibration | None) -> list:
    s = summary["settings"]
    blocks = [
        ("h", 1, "Falsification report: does performance fall with batch size?"),
        ("p", "Prediction under test (G. Bird, arXiv 2512.22247; see the affdiv README): the performance of "
              f"the divergence-correcting layers ({', '.join(s['corrected'])}) falls as the batch size grows; "
              f"the baselines ({', '.join(s['baselines'])}) do not show this. "
              f"Metric: `{s['metric']}` ({'higher' if s['higher_is_better'] else 'lower'} is better), "
              f"{s['n_records']} runs."),
        ("h", 2, "Decision rule (fixed before the numbers)"),
        ("list", summary["decision_rule"].splitlines()),
        *_tables(summary),
        ("h", 2, "Figures"),
        ("image", files["metric_vs_batch"], "Metric against batch size, mean over seeds with its confidence band."),
        ("image", files["slope_forest"], "Slopes per doubling of the batch size (shaded: equivalence margin)."),
    ]
    if "training_curves" in files:
        blocks.append(("image", files["training_curves"], f"Training curves, group {summary['primary_group']}."))
    if calibration is not None:
        blocks += [*_calibration_blocks(calibration),
                   ("image", files["calibration"], "Rejection rate against planted slope.")]
    return blocks + _provenance_block(summary["provenance"])


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _markdown(blocks: Sequence) -> str:
    out = []
    for kind, *args in blocks:
        if kind == "h":
            out.append("#" * args[0] + " " + args[1])
        elif kind == "p":
            out.append(args[0])
        elif kind == "list":
            out.append("\n".join(f"- {item}" for item in args[0]))
        elif kind == "table":
            header, rows = args
            out.append("\n".join([_md_row(header), "|" + "---|" * len(header), *map(_md_row, rows)]))
        elif kind == "image":
            out.append(f"![{args[1]}]({args[0]})\n\n*{args[1]}*")
        elif kind == "code":
            out.append(f"```\n{args[0]}\n```")
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


_STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}"
          "table{border-collapse:collapse;font-size:0.85em;margin:1em 0}td,th{border:1px solid #bbb;"
          "padding:2px 6px;text-align:left}th{background:#eee}pre{background:#f5f5f5;padding:1em;"
          "overflow-x:auto;font-size:0.8em}img{max-width:100%}figcaption{font-style:italic}")


def _html(blocks: Sequence, out_dir: Path) -> str:
    body = []
    for kind, *args in blocks:
        if kind == "h":
            body.append(f"<h{args[0]}>{_inline(args[1])}</h{args[0]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(args[0])}</p>")
        elif kind == "list":
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in args[0]) + "</ul>")
        elif kind == "table":
            header, rows = args
            head = "".join(f"<th>{_inline(c)}</th>" for c in header)
            rows_html = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows_html}</tbody></table>")
        elif kind == "image":
            data = base64.b64encode((out_dir / args[0]).read_bytes()).decode()
            body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(args[1])}">'
                        f"<figcaption>{_inline(args[1])}</figcaption></figure>")
        elif kind == "code":
            body.append(f"<pre>{html.escape(args[0])}</pre>")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>affdiv falsification report'
            f"</title><style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def latex_table(summary: Mapping) -> str:
    """A booktabs table: one row per (group, method) with slope, CI, Holm p-values, verdict."""
    level = f"{1 - summary['settings']['alpha']:.0%}".replace("%", r"\%")
    lines = [r"\begin{tabular}{llllrlrrl}", r"\toprule",
             rf"Group & Method & Role & Trend & Slope & {level} CI & $p_\mathrm{{Holm}}$ falls & "
             r"$p_\mathrm{Holm}$ flat & Verdict \\", r"\midrule"]
    for group, content in summary["groups"].items():
        for method, r in content["methods"].items():
            lines.append(" & ".join(escape(c) for c in (
                group, method, r["role"], r["trend"], _number(r.get("slope")),
                _interval(r.get("ci_low"), r.get("ci_high")),
                _p(r["tests"].get("falls", {}).get("p_holm")), _p(r["tests"].get("flat", {}).get("p_holm")),
                r["verdict"])) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_report(out_dir, analysis: Analysis, *, records: Sequence[Mapping], curves: Sequence[Mapping] | None = None,
                 provenance: Mapping, calibration: Calibration | None = None) -> dict[str, Path]:
    """Write the report files (see the module docstring); returns {name: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"records": write_csv(out_dir / "records.csv", records, metric=analysis.settings["metric"]),
             "metric_vs_batch": figures.metric_vs_batch(analysis, out_dir / "metric_vs_batch.png"),
             "slope_forest": figures.slope_forest(analysis, out_dir / "slope_forest.png")}
    if curves:
        paths["training_curves"] = figures.training_curves(
            curves, out_dir / "training_curves.png", group_by=analysis.settings["group_by"],
            group=analysis.primary_group)
    if calibration is not None:
        paths["calibration"] = figures.calibration_curves(calibration, out_dir / "calibration.png")
    files = {name: path.name for name, path in paths.items()}

    summary = analysis.to_dict(provenance)
    if calibration is not None:
        summary["calibration"] = calibration.to_dict()
    summary["files"] = {**files, "report_md": "report.md", "report_html": "report.html",
                        "summary_json": "summary.json", "summary_tex": "summary.tex"}
    blocks = _document(summary, files, calibration)
    paths["summary_json"] = atomic_write(out_dir / "summary.json",
                                          json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n")
    paths["summary_tex"] = atomic_write(out_dir / "summary.tex", latex_table(summary))
    paths["report_md"] = atomic_write(out_dir / "report.md", _markdown(blocks))
    paths["report_html"] = atomic_write(out_dir / "report.html", _html(blocks, out_dir))
    return paths

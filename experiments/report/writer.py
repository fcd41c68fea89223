"""The falsification report: Markdown, self-contained HTML, summary.json, a LaTeX table, figures.

:func:`write_report` writes into ``out_dir`` (for either design: a fixed budget of epochs or steps,
:class:`~affdiv.experiments.analysis.decision.Analysis`; or steps to a target,
:class:`~affdiv.experiments.analysis.critical_batch.TargetAnalysis`):

* ``report.md`` and ``report.html`` (the same document; the HTML embeds its figures). A preset's
  caveats (``caveats`` in its TOML) and the design's own limits come first, then the decision rule,
  then the numbers. The provenance closes the document (collapsed in the HTML).
* ``summary.json`` — schema version 2. Common keys::

    {"schema_version": 2,
     "design": "fixed budget" | "steps_to_target",
     "decision_rule": str,                 # the rule, stated before any number (one clause a line)
     "provenance": {...},
     "settings": {...},                    # the analysis settings (alpha, margins, roles, ...)
     "primary_group": str,                 # the group whose joint verdict is the study's
     "prediction": {"verdict", "reason", "rule", "group", ...},   # THE verdict: joint, primary group
     "methods": {name: {"role", "verdict", "groups": {group: verdict}}},
                                           # verdict: across groups; per-group verdicts beside it
     "overall": {name: verdict across groups},
     "groups": {group: {...}},             # every number, per group (below)
     "calibration": {...} | absent,        # VerdictCalibration.to_dict()
     "files": {name: relative path}}

  Fixed budget, ``groups.<g>``: ``{"prediction": {"verdict", "reason", "stage1", "stage2"},
  "methods": {name: <method>}}`` where <method> holds ``role``, ``status``, ``verdict``,
  ``reason``, ``contrast`` (the primary estimand: ``estimate``, ``se``, ``df``, ``ci_low``,
  ``ci_high``, ``tost_ci_low``, ``tost_ci_high``, ``p_less``, ``p_greater``, ``p_equivalent``,
  ``per_seed``, ``chosen``, ``jackknife``, ``in_sample``, ``in_sample_best``, ``largest``),
  ``contrast_class``, ``did`` (corrected: ``{baseline: {..., "class"}}``), ``lack_of_fit``
  (``F``, ``df1``, ``df2``, ``p``, ``curvature_sign``), ``noise`` (``noise_sd``, ``seed_sd``,
  ``slope_sd``, ``cell_means``), ``n_lr_edge``/``n_diverged`` where present, ``cells`` (per batch
  size: ``n``, ``mean``, ``sd``, ``ci_low``, ``ci_high``) and the descriptive slope: ``slope``,
  ``se``, ``df``, ``ci_low``, ``ci_high``, ``p_value``, ``tests`` (Holm-adjusted
  ``falls``/``rises``/``flat``), ``trend``, ``differential``, ``boot_ci_low``/``boot_ci_high``
  and ``page`` when ``settings.sensitivity``.

  Steps to target: top-level ``critical_batch`` and ``ratios`` (the primary group's, as in
  ``groups.<g>``), and ``groups.<g>``: ``{"critical_batch": {method: {"b_crit", "ci_low",
  "ci_high", "s_min", "s_min_ci_low", "s_min_ci_high", "e_min", "e_min_ci_low", "e_min_ci_high",
  "censored", "sigma", "noise_sd", "seed_sd", "resolved", "search_range", "boot_ci_low",
  "boot_ci_high", "cells", "status", "verdict", "reason", ...}}, "ratios": {corrected:
  {baseline: {"ratio", "ci_low", "ci_high", "ci_low_one_sided", "ci_high_one_sided", "p", "t",
  "df", "class", "boot_ci_low", "boot_ci_high"}}}, "prediction": {"verdict", "reason"}}``;
  each of ``cells`` (per batch size) holds ``n``, ``censored``, ``median_steps``, ... and, where the
  runs measured them, the medians ``b_simple``, ``b_simple_init``, ``off_diagonal_share_init`` and
  ``off_diagonal_share_last`` with their counts ``<name>_n``;
  along a target ladder (records with a ``target`` column) all of these are the primary target's,
  and ``primary_target``, ``settings.targets`` (every target the records answer), ``by_target``
  ({target: {"critical_batch", "ratios", "prediction"}} of the primary group) and ``trends``
  ({corrected: {baseline: {"status", "targets", "per", "log_slope", "ci_low", "ci_high",
  "factor", "factor_ci_low", "factor_ci_high", "p", ...}}}) are added. Its ``calibration`` adds
  ``classes`` ({pair: {class: rate at each planted ratio}}) and ``measured`` ({pair: {"ratio",
  "power"}}: the power of the pair's test at its own measured ratio).

  Non-finite numbers are written as null.
* ``summary.tex`` — a booktabs table of the verdicts that fits a one-column page.
* ``records.csv`` — the analysed records (``affdiv analyse --input records.csv`` reproduces the numbers).
* figures: fixed budget ``metric_vs_batch.png``, ``contrast_forest.png`` (the tests that decided),
  ``slope_forest.png`` (descriptive); steps to target ``ratio_forest.png`` (the tests that decided:
  each ratio with its CI and the equivalence band, at the primary target), ``bcrit_forest.png``
  (B_crit per method with its CI), ``steps_vs_batch.png``, ``examples_vs_steps.png``
  and, along a ladder of more than one target, ``bcrit_vs_target.png`` and ``ratio_vs_target.png``
  (with a section "Along the target ladder": ratios, B_crit and trends per target, and how the runs
  read their steps); when given ``training_curves.png`` and ``calibration.png``.
  Long per-batch tables come after the figures, collapsed (``<details>``); a table's columns that
  are empty in every row are left out.

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
from affdiv.experiments.analysis.calibration import VerdictCalibration
from affdiv.experiments.analysis.critical_batch import target_key
from affdiv.experiments.analysis.design import StudyAnalysis, design_of
from affdiv.experiments.records import write_csv
from affdiv.experiments.report import figures
from affdiv.provenance import machine_key
from affdiv.reporting import (
    HTML_STYLE,
    Column,
    Latex,
    html_table,
    latex_table,
    provenance_html,
    provenance_latex,
    provenance_markdown,
)
from affdiv.vocabulary import FIXED_BUDGET, JOINT_VERDICTS, STEPS_TO_TARGET


# --------------------------------------------------------------------------------------- output
def format_number(value, fmt: str = ".3g") -> str:
    """``value`` in format ``fmt`` (3 significant digits), "—" for None (undefined)."""
    return "—" if value is None else f"{value:{fmt}}"


def _signed(value) -> str:
    return "—" if value is None else f"{value:+.3g}"


def _p(value) -> str:
    if value is None:
        return "—"
    return "<1e-4" if value < 1e-4 else f"{value:.4f}"


def format_interval(low, high, fmt: str = ".3g") -> str:
    """``[low, high]`` in format ``fmt``, "—" where either end is None."""
    return "—" if low is None or high is None else f"[{low:{fmt}}, {high:{fmt}}]"


def _design(summary: Mapping) -> str:
    return summary.get("design", FIXED_BUDGET)


# ------------------------------------------------------------------------------------- document
# A document is a list of blocks: ("h", level, text), ("p", text), ("list", [text]),
# ("table", header, rows[, first]), ("image", file, caption), ("provenance", record) and
# ("details", summary, [blocks]) (collapsed in the HTML). A table's columns that are empty ("—")
# in every row are left out.

def _caveats(summary: Mapping) -> list:
    """The preset's caveats and the design's own limits, for the top of the report."""
    provenance = summary.get("provenance", {})
    preset = provenance.get("preset_settings") or {}
    items = preset.get("caveats") or []
    items = [items] if isinstance(items, str) else list(items)
    failed = provenance.get("failed_runs") or []
    if failed:  # the dask executor went on without them (affdiv.experiments.runs.sweep)
        shown = "; ".join(f"{f.get('method')} B={f.get('batch_size')} seed={f.get('seed')} lr_rule={f.get('lr_rule')}: "
                          f"{f.get('error')}" for f in failed[:10])
        items.append(f"{len(failed)} run(s) failed on every attempt and are missing from the analysis (the same "
                     f"command tries them again): {shown}{' ...' if len(failed) > 10 else ''} (all of them: "
                     "failed_runs in the provenance).")
    code = provenance.get("run_code") or []  # the code that trained the runs, as the store recorded it
    if len(code) > 1:
        versions = len({(entry.get("version"), entry.get("git_commit"), entry.get("git_dirty")) for entry in code})
        machines = len({machine_key(entry["cpu"]) for entry in code if entry.get("cpu") is not None})
        why = [*(["numbers of different versions may differ"] if versions > 1 else []),
               *(["a run's numbers follow the machine's kernels (on a CPU, chosen by the processor's vendor and "
                  "instruction set, torch and its BLAS; on a CUDA GPU, by the GPU and CUDA), and training carries a "
                  "difference in the last bits onward, so runs of different machines may differ too"]
                 if machines > 1 else [])] \
            or ["some runs' machines were not recorded (stored before affdiv recorded them)"]
        items.append(f"The runs were trained by {versions} version(s) of affdiv on {machines} recorded machine(s) "
                     f"({'; '.join(map(_code, code))}): {' and '.join(why)}. Rerun the runs of the others to "
                     "compare like with like.")
    elif code and (code[0].get("version"), code[0].get("git_commit")) != (provenance.get("version"),
                                                                          provenance.get("git_commit")):
        items.append(f"The runs were trained by other code than the command that wrote this report "
                     f"({_code(code[0])}); the version in the provenance is that command's.")
    settings = summary["settings"]
    if _design(summary) == FIXED_BUDGET and not settings.get("test_baselines", True):
        items.append("Epoch budget: a larger batch size takes fewer optimizer steps, so every method can fall "
                     "with the batch size for that reason alone. Only the differences between methods "
                     "(difference in differences) are evidence about the layers; the baselines' own fall is "
                     "reported, not tested.")
    if _design(summary) == FIXED_BUDGET:
        groups = summary["groups"]
        if len(groups) > 1:
            items.append(f"{len(groups)} groups were analysed; the verdict is the primary group's "
                         f"({summary['primary_group']}), the others are sensitivity analyses.")
    if not items:
        return []
    title = f"Read this first (preset {provenance['preset']})" if provenance.get("preset") else "Read this first"
    return [("h", 2, title), ("list", items)]


def _code(entry: Mapping) -> str:
    """One entry of the provenance's ``run_code``: ``affdiv 0.1.0 (commit 2fe6550...; GenuineIntel,
    torch 2.13.0 AVX512, BLAS mkl, oneDNN on): 8 run(s)`` (:func:`_machine`)."""
    runs = f"{entry.get('runs')} run(s)"
    if entry.get("version") is None:
        return f"not recorded (stored before affdiv recorded it): {runs}"
    commit = entry.get("git_commit")
    where = f"commit {commit[:12]}{' with uncommitted changes' if entry.get('git_dirty') else ''}" if commit else \
        "no git commit"
    return f"affdiv {entry['version']} ({where}{_machine(entry.get('cpu'))}): {runs}"


def _machine(cpu: Mapping | None) -> str:
    """A run_code entry's ``cpu`` (``affdiv.provenance.machine_identity``) as the report names it,
    ``; GenuineIntel, torch 2.13.0 AVX512, BLAS mkl, oneDNN on`` and, for a run on a CUDA GPU,
    ``, GPU NVIDIA H100 80GB HBM3 (9.0), CUDA 12.8, cuDNN 91002`` (the parts recorded), or nothing
    where none is."""
    if cpu is None:
        return ""
    torch_part = " ".join(str(cpu[key]) for key in ("torch", "cpu_capability") if cpu.get(key))
    capability = f" ({cpu['gpu_capability']})" if cpu.get("gpu_capability") else ""
    parts = [cpu.get("vendor") or "processor vendor unknown", *([f"torch {torch_part}"] if torch_part else []),
             *([f"BLAS {cpu['torch_blas']}"] if cpu.get("torch_blas") else []),
             *([f"oneDNN {'on' if cpu['onednn'] else 'off'}"] if "onednn" in cpu else []),
             *([f"GPU {cpu['gpu']}{capability}"] if cpu.get("gpu") else []),
             *(f"{name} {cpu[key]}" for key, name in (("cuda", "CUDA"), ("hip", "HIP"), ("cudnn", "cuDNN"))
               if cpu.get(key))]
    return "; " + ", ".join(parts)


def _verdict_block(summary: Mapping) -> list:
    prediction = summary["prediction"]
    groups = summary["groups"]
    header = ["method", "role", *[f"verdict [{g}]" for g in groups], "across groups"]
    rows = [[m, info["role"], *[info["groups"].get(g, "—") for g in groups], info["verdict"]]
            for m, info in summary["methods"].items()]
    return [("h", 2, "Verdict"),
            ("p", f"**The prediction: {prediction['verdict']}** (joint verdict of group "
                  f"{summary['primary_group']}): {prediction['reason']}."),
            ("table", header, rows, ["method", "across groups"])]


def _fixed_group_blocks(name: str, content: Mapping, summary: Mapping) -> list:
    settings = summary["settings"]
    primary = " (primary)" if name == summary["primary_group"] else " (sensitivity)"
    title = f"Group {name}" if settings.get("group_by") is None else f"Group {settings['group_by']} = {name}"
    methods = content["methods"]
    blocks = [("h", 2, title + primary),
              ("p", f"Joint verdict of this group: **{content['prediction']['verdict']}** — "
                    f"{content['prediction']['reason']}.")]
    rows = []
    for m, r in methods.items():
        c = r.get("contrast", {})
        chosen = sorted(set((c.get("chosen") or {}).values()))
        rows.append([m, r["role"], f"**{r['verdict']}**", str(r.get("n_seeds", "—")),
                     _signed(c.get("estimate")), format_interval(c.get("ci_low"), c.get("ci_high"), "+.3g"),
                     " ".join(map(str, chosen)) or "—", _signed(c.get("in_sample")),
                     r.get("contrast_class", "—"), r.get("reason", "")])
    level = f"{1 - settings['alpha']:.0%}"
    blocks += [("p", "Primary estimand Δ = P(largest batch size) − P(best batch size), best chosen "
                     "leave-one-seed-out (jackknife CI); the in-sample Δ (best chosen on the same runs, biased "
                     "towards a fall) is shown for comparison only."),
               ("table", ["method", "role", "verdict", "seeds", "Δ (cross-fitted)", f"{level} CI",
                          "best B chosen", "Δ in-sample", "Δ class", "reason"], rows, ["method", "verdict"])]
    dids = [[m, b, d.get("class", "—"), _signed(d.get("estimate")),
             format_interval(d.get("ci_low"), d.get("ci_high"), "+.3g"), _p(d.get("p_less")), _p(d.get("p_equivalent")),
             d.get("status", "")]
            for m, r in methods.items() for b, d in r.get("did", {}).items()]
    if dids:
        blocks += [("p", "Difference in differences DiD = Δ(corrected) − Δ(baseline) (paired seed jackknife): "
                         "negative means the corrected layer falls further from its best batch size."),
                   ("table", ["corrected", "baseline", "class", "DiD", f"{level} CI", "p (falls faster)",
                              "p (equivalent)", "status"], dids, ["corrected", "baseline", "class"])]
    shape = []
    for m, r in methods.items():
        lof, noise = r.get("lack_of_fit", {}), r.get("noise", {})
        shape.append([m, format_number(lof.get("F")), f"{lof['df1']}, {lof['df2']}" if "df1" in lof else "—",
                      _p(lof.get("p")), lof.get("curvature_sign", lof.get("status", "—")),
                      format_number(noise.get("noise_sd")), format_number(noise.get("seed_sd")),
                      format_number(noise.get("slope_sd"))])
    blocks += [("p", "Shape and noise (descriptive): the lack-of-fit test of a straight line in log2 B (repeated-"
                     "measures F on the degree ≥ 2 polynomial contrasts), and the noise decomposition the "
                     "calibration simulates (moments around the cell means)."),
               ("table", ["method", "lack-of-fit F", "df", "p", "curvature", "run noise s.d.", "seed s.d.",
                          "seed-slope s.d."], shape)]
    slopes = [[m, format_number(r.get("slope")), format_interval(r.get("ci_low"), r.get("ci_high")),
               format_interval(r.get("boot_ci_low"), r.get("boot_ci_high")), _p(r.get("p_value")),
               *[_p(r.get("tests", {}).get(k, {}).get("p_holm")) for k in ("falls", "rises", "flat")],
               r.get("trend", "—")]
              for m, r in methods.items()]
    blocks += [("p", f"Descriptive slopes per doubling of the batch size (clustered OLS; Holm over corrected and "
                     f"baseline methods; margin {settings['margin']:.4g} per doubling). Not part of the rule: the "
                     "lack-of-fit tests above say how far a straight line is from the data."),
               ("table", ["method", "slope", "CI (t, clustered)", "CI (bootstrap)", "p (two-sided)",
                          "p_Holm falls", "p_Holm rises", "p_Holm flat", "trend"], slopes)]
    return blocks


def _target_group_blocks(name: str, content: Mapping, summary: Mapping) -> list:
    settings = summary["settings"]
    primary = " (primary)" if name == summary["primary_group"] else " (sensitivity)"
    title = f"Group {name}" if settings.get("group_by") is None else f"Group {settings['group_by']} = {name}"
    level = f"{1 - settings['alpha']:.0%}"
    fits = content["critical_batch"]
    rows = [[m, r["role"], f"**{r['verdict']}**", str(r["n_seeds"]), str(r["n_runs"]), str(r["censored"]),
             format_number(r.get("b_crit")), format_interval(r.get("ci_low"), r.get("ci_high")),
             format_number(r.get("s_min")), format_interval(r.get("s_min_ci_low"), r.get("s_min_ci_high")),
             format_number(r.get("e_min")), format_interval(r.get("e_min_ci_low"), r.get("e_min_ci_high")),
             format_number(r.get("sigma")), r.get("ci_status", r["status"] if r["status"] != "ok" else "ok"),
             r.get("reason", "")]
            for m, r in fits.items()]
    blocks = [("h", 2, title + primary),
              ("p", f"Joint verdict of this group: **{content['prediction']['verdict']}** — "
                    f"{content['prediction']['reason']}."),
              ("p", f"Fitted S(B) = S_min (1 + B_crit/B) per method (censored log-normal likelihood); {level} "
                    "intervals from the leave-one-seed-out jackknife (t with seeds − 1 df)."),
              ("table", ["method", "role", "verdict", "seeds", "runs", "censored", "B_crit", f"{level} CI",
                         "S_min", "CI", "E_min", "CI", "σ (log steps)", "fit", "reason"], rows,
               ["method", "verdict", "B_crit"])]
    ratios = [[c, b, r.get("class", "—"), format_number(r.get("ratio")),
               format_interval(r.get("ci_low"), r.get("ci_high")),
               format_interval(r.get("ci_low_one_sided"), r.get("ci_high_one_sided")), _p(r.get("p")),
               format_interval(r.get("boot_ci_low"), r.get("boot_ci_high")), r.get("status", "")]
              for c, against in content["ratios"].items() for b, r in against.items()]
    if ratios:
        blocks += [("p", "Ratios B_crit(corrected) / B_crit(baseline); p is the one-sided jackknife t test of "
                         "ratio < 1; the paired seed-bootstrap percentile interval is shown as a sensitivity "
                         "analysis (it is too narrow with few seeds; see the module documentation)."),
                   ("table", ["corrected", "baseline", "class", "ratio", f"{level} CI",
                              f"{1 - 2 * settings['alpha']:.0%} interval", "p (ratio < 1)", "bootstrap CI",
                              "status"], ratios, ["corrected", "baseline", "class"])]
    return blocks


def _per_batch_blocks(name: str, content: Mapping, summary: Mapping) -> list:
    """The runs per method and batch size of a group (a long table: collapsed, after the figures)."""
    fits = content["critical_batch"]
    cells = []
    for m, r in fits.items():
        for c in r["cells"]:
            cells.append([m, str(c["batch_size"]), str(c["n"]), str(c["censored"]),
                          format_number(c.get("median_steps")),
                          str(c["max_steps"]), format_number(c.get("b_simple_init")), format_number(c.get("b_simple")),
                          format_number(r.get("b_crit"))])
    by = summary["settings"].get("group_by")
    title = f"Runs per method and batch size, group {name if by is None else f'{by} = {name}'}"
    return [("details", title, [
        ("p", "The median steps to target of the runs that reached it, and the gradient noise scale "
              "B_simple = tr(Σ)/|G|² (median over seeds; at initialisation and at the last measurement) where the "
              "runs measured it, beside the method's fitted B_crit."),
        ("table", ["method", "batch size", "runs", "censored", "median steps", "max_steps", "B_simple (init)",
                   "B_simple (last)", "B_crit (fit)"], cells)])]


def _share_blocks(content: Mapping) -> list:
    """Beside each method's B_crit, the off-diagonal share of its network as the divergence meter
    measured it along the runs (``falsify --probe-every`` or a preset's [measure] ``probe_every``):
    per batch size, the median over the runs of the per-run value at step 0 and at the last
    measured step (each the mean over the measured layers of the per-sample median ‖u_i − d_i‖/‖d_i‖,
    at the run's own batch size). Descriptive, no test; nothing where no run measured it."""
    fits = content["critical_batch"]
    measured = {c["batch_size"] for r in fits.values() for c in r["cells"] if "off_diagonal_share_init" in c}
    if not measured:
        return []
    batch_sizes = sorted(measured)
    rows = []
    for method, r in fits.items():
        by_batch = {c["batch_size"]: c for c in r["cells"]}
        rows.append([method, r["role"], format_number(r.get("b_crit")),
                     *(f"{format_number(by_batch.get(b, {}).get('off_diagonal_share_init'))} / "
                       f"{format_number(by_batch.get(b, {}).get('off_diagonal_share_last'))}" for b in batch_sizes)])
    return [("p", "Off-diagonal share of each method's network beside its B_crit (descriptive, not part of the "
                  "rule): the divergence meter along the runs, at each run's own batch size, the mean over the "
                  "measured layers of the median over the batch of ‖u_i − d_i‖/‖d_i‖ (what the other samples add "
                  "to a sample's update), median over the runs; at step 0 / at the last measured step."),
            ("table", ["method", "role", "B_crit", *(f"B = {b}" for b in batch_sizes)], rows)]


def reads_sentence(records: Sequence[Mapping]) -> str:
    """How the runs of ``records`` read their steps to a target, in words: geometric reads with
    interpolated crossings (``read_spacing``), or a read every ``eval_every`` steps."""
    def values(column: str, cast, rows) -> list:
        return sorted({cast(float(r[column])) for r in rows if r.get(column) not in (None, "")})

    spacings = values("read_spacing", float, records)
    sparse = values("sparse_spacing", float, records)
    every = values("eval_every", int, [r for r in records if r.get("read_spacing") in (None, "")])
    parts = []
    if spacings:
        parts.append(f"geometric reads, spacing r = {', '.join(f'{r:g}' for r in spacings)}: the validation "
                     "accuracy is read at steps s_{k+1} = s_k + max(1, floor(r s_k)), so each gap is at most r times "
                     "the steps so far, and a crossing between two reads is interpolated linearly between them")
    if sparse:
        parts.append(f"adaptive reads, sparse spacing R = {', '.join(f'{r:g}' for r in sparse)}: gaps of up to R "
                     "times the steps so far where no target is near, r near one, and a sparse gap at whose end a "
                     "target was first reached is trained again with reads at spacing r, so every crossing is "
                     "bracketed within r times its steps")
    if every:
        parts.append(f"a read every {', '.join(map(str, every))} steps: a run's steps to a target are those of the "
                     "first read at or past the crossing")
    if not parts:
        return "The records do not say how the runs read their steps (no read_spacing or eval_every column)."
    return "How steps are read: " + "; ".join(parts) + "."


def _ladder_blocks(summary: Mapping, reads: str) -> list:
    """The ratios, B_crit and the ratios' trends along the target ladder (primary group)."""
    settings = summary["settings"]
    targets, primary = settings["targets"], summary["primary_target"]
    by_target = summary["by_target"]
    level = f"{1 - settings['alpha']:.0%}"
    keys = {t: target_key(t) for t in targets}
    header = [f"{t:g} (primary)" if t == primary else f"{t:g}" for t in targets]

    def at(t: float) -> Mapping:
        return by_target.get(keys[t], {})

    pairs = list(dict.fromkeys((c, b) for t in targets for c, against in at(t).get("ratios", {}).items()
                               for b in against))
    ratio_rows = []
    for c, b in pairs:
        cells = []
        for t in targets:
            r = at(t).get("ratios", {}).get(c, {}).get(b)
            if r is None:
                cells.append("—")
            elif r.get("status", "ok") != "ok":
                cells.append(f"— {r.get('class', '')} ({r['status'].split(':')[0]})")
            else:
                cells.append(f"{r['ratio']:.3g} {format_interval(r.get('ci_low'), r.get('ci_high'))} {r['class']}")
        ratio_rows.append([f"{c} vs {b}", *cells])
    methods = list(dict.fromkeys(m for t in targets for m in at(t).get("critical_batch", {})))
    b_rows = []
    for m in methods:
        cells, role = [], "—"
        for t in targets:
            r = at(t).get("critical_batch", {}).get(m)
            role = r["role"] if r else role
            if r is None:
                cells.append("—")
            elif r["status"] != "ok":
                cells.append("— (no fit)")
            elif not r.get("resolved"):
                cells.append(f"{r['b_crit']:.3g} (a bound: unresolved)")
            else:
                cells.append(f"{r['b_crit']:.3g} {format_interval(r.get('ci_low'), r.get('ci_high'))}")
        b_rows.append([m, role, *cells])
    trend_rows = []
    for c, against in summary.get("trends", {}).items():
        for b, tr in against.items():
            if tr.get("status") != "ok":
                trend_rows.append([f"{c} vs {b}", "—", "—", "—", "—", tr.get("status", "")])
                continue
            trend_rows.append([f"{c} vs {b}", ", ".join(f"{t:g}" for t in tr["targets"]),
                               f"{tr['factor']:.3g}", format_interval(tr["factor_ci_low"], tr["factor_ci_high"]),
                               _p(tr["p"]), "ok"])
    step = next((tr["per"] for against in summary.get("trends", {}).values() for tr in against.values()
                 if "per" in tr), 0.01)
    blocks = [("h", 2, "Along the target ladder"),
              ("p", f"The runs read targets {', '.join(f'{t:g}' for t in targets)} (the targets this store can "
                    f"answer: `affdiv analyse --primary-target T` decides at any of them). The verdict above is at "
                    f"the primary target {primary:g}; the other targets show how the result depends on the "
                    f"target. Group {summary['primary_group']}. {reads}"),
              ("p", f"Ratios B_crit(corrected) / B_crit(baseline) per target: ratio [{level} CI] and the pair's "
                    "class under the rule (smaller, smaller_within_margin, equivalent, larger, unclear)."),
              ("table", ["pair", *header], ratio_rows, ["pair"]),
              ("p", f"B_crit per method and target [{level} CI] (leave-one-seed-out jackknife)."),
              ("table", ["method", "role", *header], b_rows, ["method"])]
    if trend_rows:
        blocks += [("p", f"Trend of each log ratio along the ladder: the least-squares slope of log r on the target, "
                         f"as the factor by which r changes per +{step:g} of target ({level} CI from the "
                         "leave-one-seed-out jackknife, the same seed left out at every target; p two-sided, H0: "
                         "no trend). Descriptive: not part of the rule."),
                   ("table", ["pair", "targets", f"ratio factor per +{step:g}", f"{level} CI", "p (no trend)",
                              "status"], trend_rows, ["pair"])]
    return blocks


def _calibration_blocks(calibration: Mapping) -> list:
    n, alpha = calibration["n_sims"], calibration["alpha"]
    effects, null = calibration["effects"], calibration["null_effect"]
    target = calibration["design"] == STEPS_TO_TARGET
    verdicts = [v for v in JOINT_VERDICTS if v in calibration["joint"]]
    rows = [[format_number(e), *[f"{calibration['joint'][v][i]:.3f}" for v in verdicts],
             *[f"{calibration['methods'][m][i]:.3f}" for m in calibration["methods"]]]
            for i, e in enumerate(effects)]
    what = ("the planted ratio B_crit(corrected)/B_crit(baselines)" if target else
            "the planted extra fall of the corrected layers at the largest batch size (performance units; the "
            f"contrast margin is {calibration['layout'].get('margin', float('nan')):.3g})")
    blocks = [
        ("h", 2, "Calibration of the decision rule on simulated studies"),
        ("p", f"{n} simulated studies per row, in this study's own layout (its batch sizes and seed count; each "
              "method with its own fitted noise), run through the same decision rule. Rows: "
              f"{what}. At {format_number(null)} the prediction is false: a 'supported' there is a false positive and "
              f"its rate must stay at or below α = {alpha:g}; 'contradicted' there is the right answer, not an error. "
              "At the other rows the prediction is true: 'supported' is the power, 'contradicted' a false "
              f"contradiction. Monte-Carlo s.e. of a rate r: √(r(1−r)/{n}) (0.015 at r = 0.05)."),
        ("table", ["planted ratio" if target else "effect", *[f"joint {v}" for v in verdicts],
                   *[f"{m} supported" for m in calibration["methods"]]], rows),
    ]
    if calibration["pairs"]:
        pairs = list(calibration["pairs"])
        rows = [[format_number(e), *[f"{calibration['pairs'][p][i]:.3f}" for p in pairs]]
                for i, e in enumerate(effects)]
        blocks += [("p", f"Each pair's own test ({calibration['pair_event']}): at {format_number(null)} its rate is "
                         "the test's size (α up to Monte-Carlo error); elsewhere its power. A rejection is "
                         "not yet a verdict: a corrected layer needs every pair."
                         + ("" if target else " The equivalence check comes first.")),
                   ("table", ["planted ratio" if target else "effect", *pairs], rows)]
    classes = calibration.get("classes") or {}
    measured = calibration.get("measured") or {}
    if classes:
        kinds = list(next(iter(classes.values())))
        rows = [[pair, format_number(e, ".4g") + (" (measured)" if measured.get(pair, {}).get("ratio") == e else ""),
                 *[f"{classes[pair][k][i]:.3f}" for k in kinds],
                 f"{calibration['pairs'][pair][i]:.3f}" if pair in calibration["pairs"] else "—"]
                for pair in classes for i, e in enumerate(effects)]
        blocks += [("p", "The rate of every outcome of each pair at each planted ratio (each row sums to 1). At "
                         f"ratio {format_number(null)} 'smaller' of either kind is a false positive (at most α up to "
                         "Monte-Carlo error); below 1 'smaller' of either kind is the power, 'equivalent' and "
                         "'larger' are errors where the planted ratio lies outside the band, and 'equivalent' is "
                         "right where it lies inside."),
                   ("table", ["pair", "planted ratio", *kinds, "p < α"], rows, ["pair"])]
    if measured:
        rows = [[pair, format_number(m["ratio"], ".4g"), f"{m['power']:.3f}",
                 f"{(m['power'] * (1 - m['power']) / n) ** 0.5:.3f}"] for pair, m in measured.items()]
        blocks += [("p", "Power at the measured ratio: each pair's ratio at the primary target, planted in this "
                         "layout; the rate at which the pair's test rejects there (p < α) is the power the study "
                         "had against an effect of the size it found (descriptive: a measured effect is not the "
                         "truth)."),
                   ("table", ["pair", "measured ratio", "power (p < α)", "Monte-Carlo s.e."], rows, ["pair"])]
    for name, scenario in (calibration.get("scenarios") or {}).items():
        verdicts = [v for v in JOINT_VERDICTS if v in scenario["joint"]]
        rows = [[format_number(e), *[f"{scenario['joint'][v][i]:.3f}" for v in verdicts],
                 *[f"{scenario['pairs'][p][i]:.3f}" for p in scenario["pairs"]]]
                for i, e in enumerate(scenario["effects"])]
        blocks += [("p", f"Scenario: {name} (a shock per method and batch size shared by every seed, as a data "
                         "split shared by the seeds produces; with one split per seed it is part of each run's "
                         "noise instead)."),
                   ("table", ["effect", *[f"joint {v}" for v in verdicts], *scenario["pairs"]], rows)]
    return blocks


def _document(summary: Mapping, files: Mapping[str, str], reads: str = "") -> list:
    s = summary["settings"]
    target = _design(summary) == STEPS_TO_TARGET
    if target:
        blocks = [("h", 1, "Falsification report: steps to target and the critical batch size"),
                  *_caveats(summary),
                  ("p", "Prediction under test (G. Bird, arXiv 2512.22247; see the affdiv README), sharpened: the "
                        "divergence-correcting layers "
                        f"({', '.join(s['corrected'])}) stop profiting from larger batches sooner than the "
                        f"baselines ({', '.join(s['baselines'])}): B_crit(corrected) / B_crit(baseline) < 1. "
                        f"Metric: `{s['metric']}`, {s['n_records']} runs.")]
    else:
        blocks = [("h", 1, "Falsification report: does performance fall with batch size?"),
                  *_caveats(summary),
                  ("p", "Prediction under test (G. Bird, arXiv 2512.22247; see the affdiv README): the performance "
                        f"of the divergence-correcting layers ({', '.join(s['corrected'])}) falls as the batch size "
                        f"grows; the baselines ({', '.join(s['baselines'])}) do not show this. "
                        f"Metric: `{s['metric']}` ({'higher' if s['higher_is_better'] else 'lower'} is better), "
                        f"{s['n_records']} runs.")]
    blocks += [("h", 2, "Decision rule (fixed before the numbers)"), ("list", summary["decision_rule"].splitlines()),
               *_verdict_block(summary)]
    group_blocks = _target_group_blocks if target else _fixed_group_blocks
    for name, content in summary["groups"].items():
        blocks += group_blocks(name, content, summary)
        if target:
            blocks += _share_blocks(content)
    if target and len(s.get("targets") or []) > 1:
        blocks += _ladder_blocks(summary, reads)
    blocks.append(("h", 2, "Figures"))
    captions = {
        "ratio_forest": "The tests that decide: each ratio B_crit(corrected)/B_crit(baseline) at the primary target "
                        "with its CI; shaded: the equivalence band.",
        "bcrit_forest": "B_crit per method at the primary target with its CI (open markers: unresolved, a bound).",
        "steps_vs_batch": "Steps to target against batch size (log–log): runs (censored ones as faint open markers at "
                          "max_steps), the fitted S(B) = S_min(1 + B_crit/B), B_crit as a large open marker on it.",
        "examples_vs_steps": "Examples against steps to target: the trade-off curve (S/S_min − 1)(E/E_min − 1) = 1 "
                             "per method, the measured batch sizes on it.",
        "metric_vs_batch": "Metric against batch size, mean over seeds with its confidence band.",
        "contrast_forest": "The tests that decide: Δ per method and DiD per corrected layer and baseline, with "
                           "their CIs; shaded: ± the contrast margin.",
        "slope_forest": "Descriptive slopes per doubling of the batch size (shaded: ± the slope margin).",
        "bcrit_vs_target": "B_crit per method against the target (95% CI; open markers: unresolved, a bound); "
                           "dotted: the primary target.",
        "ratio_vs_target": "Ratios B_crit(corrected)/B_crit(baseline) against the target (95% CI); shaded: the "
                           "equivalence band; dotted: the primary target.",
        "training_curves": "Training curves of the primary group.",
    }
    for name, caption in captions.items():
        if name in files:
            blocks.append(("image", files[name], caption))
    if target:
        for name, content in summary["groups"].items():
            blocks += _per_batch_blocks(name, content, summary)
    if "calibration" in summary:
        blocks += _calibration_blocks(summary["calibration"])
        if "calibration" in files:
            blocks.append(("image", files["calibration"], "Verdict rates of the decision rule at each planted effect "
                                                          "simulated (±2 Monte-Carlo s.e.)."))
    return blocks + _cost_blocks(summary["provenance"]) + [("provenance", summary["provenance"])]


def _cost_blocks(provenance: Mapping) -> list:
    """What the runs cost and the share of it their checks (validation reads) took, from the
    provenance's ``compute_time_s`` and ``checks``; nothing where it has neither."""
    checks, seconds = provenance.get("checks"), provenance.get("compute_time_s")
    if not checks or seconds is None:
        return []
    text = f"The {checks['runs']} runs took {seconds:,.0f} s in all"
    if checks["share"] is None:
        text += "; how much of it their checks (validation reads) took was not recorded (stored before affdiv " \
                "recorded it)."
    else:
        part = "" if checks["runs_recorded"] == checks["runs"] else \
            f" (over the {checks['runs_recorded']} of {checks['runs']} runs that recorded it; the others were stored " \
            "before affdiv did)"
        text += f"; their checks (validation reads) took {100 * checks['share']:.1f}% of it{part}."
    return [("h", 2, "Cost"), ("p", text)]


_EMPTY = (None, "", "—")


def _nonempty_columns(header: Sequence[str], rows: Sequence[Sequence], first: Sequence[str] = ()) -> tuple:
    """(header, rows, first) without the columns that are empty ("—" or blank) in every row."""
    keep = [i for i in range(len(header)) if not rows or any(row[i] not in _EMPTY for row in rows)]
    kept = [header[i] for i in keep]
    return kept, [[row[i] for i in keep] for row in rows], [name for name in first if name in kept]


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def markdown_document(blocks: Sequence) -> str:
    """Markdown of a list of blocks: ``("h", level, text)``, ``("p", text)``, ``("list", items)``,
    ``("table", header, rows)`` (columns empty in every row left out), ``("details", summary,
    blocks)``, ``("image", path, caption)``, ``("provenance", provenance)``."""
    out = []
    for kind, *args in blocks:
        if kind == "h":
            out.append("#" * args[0] + " " + args[1])
        elif kind == "p":
            out.append(args[0])
        elif kind == "list":
            out.append("\n".join(f"- {item}" for item in args[0]))
        elif kind == "table":
            header, rows, _ = _nonempty_columns(args[0], args[1])
            out.append("\n".join([_md_row(header), "|" + "---|" * len(header), *map(_md_row, rows)]))
        elif kind == "details":  # GitHub and most Markdown viewers render it collapsed
            out.append(f"<details><summary>{args[0]}</summary>\n\n{markdown_document(args[1]).rstrip()}\n\n</details>")
        elif kind == "image":
            out.append(f"![{args[1]}]({args[0]})\n\n*{args[1]}*")
        elif kind == "provenance":
            out.append(provenance_markdown(args[0]).rstrip("\n"))
    return "\n\n".join(out) + "\n"


def _inline(text: str) -> str:
    text = html.escape(str(text))
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


_STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;line-height:1.4}"
          "img{max-width:100%}figcaption{font-style:italic}details>summary{cursor:pointer;font-weight:bold;"
          "margin:1em 0}" + HTML_STYLE)


def _html(blocks: Sequence, out_dir: Path, *, whole: bool = True) -> str:
    """The blocks as HTML: a whole self-contained page, or (``whole=False``) its body's elements."""
    body = []
    for kind, *args in blocks:
        if kind == "h":
            body.append(f"<h{args[0]}>{_inline(args[1])}</h{args[0]}>")
        elif kind == "p":
            body.append(f"<p>{_inline(args[0])}</p>")
        elif kind == "list":
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in args[0]) + "</ul>")
        elif kind == "table":
            header, rows, first = _nonempty_columns(args[0], args[1], args[2] if len(args) > 2 else ())
            body.append(html_table(header, rows, first=first, cell=lambda v: _inline("—" if v is None else v)))
        elif kind == "details":
            body.append(f"<details><summary>{_inline(args[0])}</summary>{_html(args[1], out_dir, whole=False)}"
                        "</details>")
        elif kind == "image":
            data = base64.b64encode((out_dir / args[0]).read_bytes()).decode()
            body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(args[1])}">'
                        f"<figcaption>{_inline(args[1])}</figcaption></figure>")
        elif kind == "provenance":
            body.append(provenance_html(args[0]))
    if not whole:
        return "\n".join(body)
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>affdiv falsification report'
            f"</title><style>{_STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def summary_tex(summary: Mapping) -> str:
    """A booktabs table of the verdicts that fits a one-column page (needs booktabs, tabularx): per
    method its estimate with its CI and, beside its verdict, the test(s) that decided it, each with
    its estimate, CI and p-value (:func:`deciding_tests`)."""
    level = f"{1 - summary['settings']['alpha']:.0%} CI"
    head = provenance_latex(summary.get("provenance", {}), what="affdiv falsification report: verdict table")
    target = _design(summary) == STEPS_TO_TARGET
    rows = []
    for group, content in summary["groups"].items():
        for method, r, tests in deciding_tests(summary, content):
            if target:
                estimate = [r.get("b_crit"), format_interval(r.get("ci_low"), r.get("ci_high")), str(r["censored"])]
            else:
                c = r.get("contrast", {})
                estimate = [c.get("estimate"), format_interval(c.get("ci_low"), c.get("ci_high"))]
            decided = "; ".join(_test_words(t) for t in tests) or "---"
            rows.append([group, method, r["role"], *estimate, decided, r["verdict"]])
    if target:
        columns = [Column("Group"), Column("Method", "X"), Column("Role"), Column(Latex(r"$B_\mathrm{crit}$"), "r"),
                   Column(level), Column("Censored", "r")]
    else:
        columns = [Column("Group"), Column("Method", "X"), Column("Role"), Column(Latex(r"$\Delta$"), "r"),
                   Column(level)]
    columns += [Column("Deciding test: estimate [CI], p, class", "X"), Column("Verdict")]
    notes = f"Joint verdict of the prediction (group {summary['primary_group']}): {summary['prediction']['verdict']}."
    return latex_table(columns, rows, notes=notes, head=head)


def _test_words(test: tuple) -> str:
    """A deciding test in one line: ``ratio vs affine 0.81 [0.7, 0.93], p = 0.012: smaller``."""
    name, estimate, interval, p, kind = test
    return f"{name} {estimate} {interval}, p = {p}: {kind}"


def deciding_tests(summary: Mapping, content: Mapping) -> list[tuple[str, Mapping, list]]:
    """(method, its result, [(test, estimate, CI, p, class)]) of a group: the tests that decided each
    verdict, as text. Fixed budget: a corrected layer's DiD against each baseline, else its Δ, with
    p = "p(falls) / p(equivalent)" (the one-sided test and the equivalence test the class comes
    from). Steps to target: a corrected layer's B_crit ratio against each baseline, p of the
    one-sided test of ratio < 1; a baseline's verdict is 'reference' (no test decides it) and an
    other method has no prediction: no test (empty list)."""
    out = []
    if _design(summary) == STEPS_TO_TARGET:
        for method, r in content["critical_batch"].items():
            pairs = content["ratios"].get(method, {}) if r["role"] == "corrected" else {}
            out.append((method, r, [(f"ratio vs {b}", format_number(p.get("ratio")),
                                     format_interval(p.get("ci_low"), p.get("ci_high")), _p(p.get("p")),
                                     p.get("class", "—")) for b, p in pairs.items()]))
        return out
    for method, r in content["methods"].items():
        dids = r.get("did", {}) if r["role"] == "corrected" else {}
        tests = [(f"DiD vs {b}", _signed(d.get("estimate")), format_interval(d.get("ci_low"), d.get("ci_high")),
                  f"{_p(d.get('p_less'))} / {_p(d.get('p_equivalent'))}", d.get("class", "—"))
                 for b, d in dids.items()]
        c = r.get("contrast", {})
        if not tests and r["role"] != "other":
            tests = [("Δ", _signed(c.get("estimate")), format_interval(c.get("ci_low"), c.get("ci_high")),
                      f"{_p(c.get('p_less'))} / {_p(c.get('p_equivalent'))}", r.get("contrast_class", "—"))]
        out.append((method, r, tests))
    return out


def verdict_table(summary: Mapping) -> str:
    """A compact plain-text table of the verdicts (for the terminal, e.g. after ``affdiv falsify``):
    group, method, role, verdict and the test that decided it (:func:`deciding_tests`): its
    estimate, CI, p-value(s) and class; then the joint verdict. Fixed budget: a baseline's Δ, a
    corrected layer's DiD against each baseline (p: falls / equivalent); steps to target: a
    corrected layer's B_crit ratio against each baseline (p: one-sided, ratio < 1) with the pair's
    class (smaller, smaller_within_margin, equivalent, larger, unclear). A method whose verdict no
    test decided (a baseline's 'reference', 'no prediction') shows none."""
    level = f"{1 - summary['settings']['alpha']:.0%} CI"
    target = _design(summary) == STEPS_TO_TARGET
    rows = [["group", "method", "role", "verdict", "deciding test", "estimate", level,
             "p (ratio < 1)" if target else "p (falls / equiv.)", "class"]]
    for group, content in summary["groups"].items():
        for method, r, tests in deciding_tests(summary, content):
            for k, test in enumerate(tests or [("none", "—", "—", "—", "—")]):
                first = [group, method, r["role"], r["verdict"]] if k == 0 else ["", "", "", ""]
                rows.append(first + list(test))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"Joint verdict of the prediction (group {summary['primary_group']}): "
                 f"{summary['prediction']['verdict']}")
    return "\n".join(lines) + "\n"


def write_report(out_dir: str | Path, analysis: StudyAnalysis, *, records: Sequence[Mapping],
                 curves: Sequence[Mapping] | None = None, provenance: Mapping,
                 calibration: VerdictCalibration | None = None) -> dict[str, Path]:
    """Write the report files (see the module docstring); returns {name: path}. The figures are
    those of the analysis's design (:func:`~affdiv.experiments.analysis.design.design_of`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = analysis.design == STEPS_TO_TARGET
    paths = {"records": write_csv(out_dir / "records.csv", records, metric=analysis.settings["metric"])}
    design = design_of(analysis.design)
    names = design.figures + (design.ladder_figures if len(analysis.settings.get("targets") or []) > 1 else ())
    for name in names:
        paths[name] = getattr(figures, name)(analysis, out_dir / f"{name}.png")
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
    blocks = _document(summary, files, reads_sentence(records) if target else "")
    paths["summary_json"] = atomic_write(out_dir / "summary.json",
                                          json.dumps(summary, indent=2, allow_nan=False, default=str) + "\n")
    paths["summary_tex"] = atomic_write(out_dir / "summary.tex", summary_tex(summary))
    paths["report_md"] = atomic_write(out_dir / "report.md", markdown_document(blocks))
    paths["report_html"] = atomic_write(out_dir / "report.html", _html(blocks, out_dir))
    return paths


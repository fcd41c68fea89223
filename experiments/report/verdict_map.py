"""The verdict map: every corrected/baseline pair of one or more steps-to-target studies, at
every target of their ladders, in one Markdown table.

Rows are study × pair (corrected method / baseline), columns the targets of all the studies; a
cell is the pair's ratio r = B_crit(corrected) / B_crit(baseline) at that target with its
interval (at the study's level, 95% by default) and its class (``smaller``,
``smaller_within_margin``, ``equivalent``, ``larger``, ``unclear``: see :mod:`affdiv.vocabulary`).
The primary target of each study (its verdict) is set in bold; the last column is the trend of log r along the ladder,
written as the factor by which r changes per 0.01 of target, with its interval. Every number
is read from the studies' ``summary.json``; nothing is re-estimated here.

:func:`write_into` replaces the map between two marker lines of an existing Markdown file (e.g.
``docs/results/VERDICTS.md``), so the hand-written text around it stays as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from affdiv.atomic import atomic_write
from affdiv.vocabulary import STEPS_TO_TARGET

BEGIN = "<!-- verdict map: begin (written by `affdiv map`; edits inside are overwritten) -->"
END = "<!-- verdict map: end -->"
FIGURES = ("ratio_vs_target.png", "bcrit_vs_target.png")


def read_study(folder: str | Path) -> dict:
    """A study folder's ``summary.json``, checked to be a steps-to-target analysis along a ladder."""
    path = Path(folder) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no summary.json (run `affdiv analyse` or `affdiv falsify` first)")
    summary = json.loads(path.read_text())
    if summary.get("design") != STEPS_TO_TARGET or not summary.get("by_target"):
        raise ValueError(f"{path}: not a steps-to-target study along a target ladder (design "
                         f"{summary.get('design')!r}, {len(summary.get('by_target') or {})} target(s))")
    return summary


def _cell(ratio: Mapping | None, primary: bool) -> str:
    if not ratio or ratio.get("status") != "ok":
        return "—"
    text = f"{ratio['ratio']:.3g} [{ratio['ci_low']:.3g}, {ratio['ci_high']:.3g}] {ratio['class']}"
    return f"**{text}**" if primary else text


def _trend(trend: Mapping | None) -> str:
    if not trend or trend.get("status") != "ok":
        return "—"
    return f"×{trend['factor']:.3g} [{trend['factor_ci_low']:.3g}, {trend['factor_ci_high']:.3g}]"


def verdict_map(studies: Sequence[tuple[str, Mapping]], *, relative_to: str | Path = ".") -> str:
    """The map of ``studies`` ((folder, summary) pairs, in row order) as Markdown; figure links are
    written relative to the folder ``relative_to`` (where the Markdown file lies)."""
    targets = sorted({float(t) for _, summary in studies for t in summary["by_target"]})
    header = ["study", "pair (corrected / baseline)", *(f"{t:g}" for t in targets), "trend per 0.01"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for folder, summary in studies:
        name = Path(folder).name
        primary = float(summary["primary_target"])
        by_target = {float(t): content for t, content in summary["by_target"].items()}
        for corrected, pairs in summary["ratios"].items():
            for baseline in pairs:
                cells = [_cell(by_target.get(t, {}).get("ratios", {}).get(corrected, {}).get(baseline), t == primary)
                         for t in targets]
                trend = summary.get("trends", {}).get(corrected, {}).get(baseline)
                lines.append("| " + " | ".join([name, f"{corrected} / {baseline}", *cells, _trend(trend)]) + " |")
    notes = ["", "Bold: the study's primary target (its verdict, fixed in its preset before the runs). "
             "Cell: B_crit ratio [CI at the study's level, below] and its class; —: not estimated at that target.",
             ""]
    for folder, summary in studies:
        links = ", ".join(f"[{f}]({os.path.relpath(Path(folder) / f, relative_to)})" for f in FIGURES
                          if (Path(folder) / f).is_file())
        seeds = sorted({c.get("n_seeds", 0) for c in summary["critical_batch"].values()})
        level = 1 - float(summary.get("settings", {}).get("alpha", 0.05))
        notes.append(f"- `{Path(folder).name}`: primary target {float(summary['primary_target']):g}, "
                     f"{'/'.join(map(str, seeds))} seeds per method, {level:.0%} intervals"
                     + (f"; figures: {links}" if links else ""))
    return "\n".join(lines + notes) + "\n"


def write_into(path: str | Path, text: str) -> None:
    """Replace what lies between :data:`BEGIN` and :data:`END` in the Markdown file ``path`` by
    ``text``; a file without the markers is refused (its text is hand-written: say where the map goes)."""
    path = Path(path)
    document = path.read_text()
    if document.count(BEGIN) != 1 or document.count(END) != 1 or document.index(BEGIN) > document.index(END):
        raise ValueError(f"{path}: needs one line {BEGIN!r} and, after it, one line {END!r} where the map goes")
    head, rest = document.split(BEGIN)
    _, tail = rest.split(END)
    atomic_write(path, f"{head}{BEGIN}\n{text}{END}{tail}")

"""The two designs of an analysis behind one shape: what their results share
(:class:`StudyAnalysis`), which functions analyse, calibrate and draw each (:func:`design_of`,
:func:`analyse_study`), and the pieces of their rules that both use (the seeded generators, the
roles of the methods, the verdict across groups).

* fixed budget (epochs or steps): :func:`affdiv.experiments.analysis.decision.analyse`;
* steps to a target: :func:`affdiv.experiments.analysis.critical_batch.analyse_target`.

Which one a study gets follows from its settings' metric (:attr:`AnalysisSettings.design`).
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.vocabulary import CONTRADICTED, FIXED_BUDGET, INCONCLUSIVE, MIXED, STEPS_TO_TARGET, SUPPORTED

if TYPE_CHECKING:  # calibration imports this module
    from affdiv.experiments.analysis.calibration import VerdictCalibration

#: The roles of the methods, in the order a table lists them.
ROLE_ORDER = {"corrected": 0, "baseline": 1, "other": 2}


@runtime_checkable
class StudyAnalysis(Protocol):
    """What the result of either design holds: the report, the calibration and the verdict map read
    it through this shape alone. ``to_dict`` is the content of summary.json."""

    design: str  # FIXED_BUDGET or STEPS_TO_TARGET
    settings: dict  # the settings as analysed (defaults resolved), as summary.json writes them
    decision_rule: str  # the rule in words, one clause a line
    groups: dict  # {group: that group's results, its "prediction" among them}
    primary_group: str  # the group whose joint verdict is the study's
    overall: dict  # {method: verdict across groups}
    primary_target: float | None  # the target that decides (steps to a target along a ladder), else None

    @property
    def prediction(self) -> dict:
        """The joint verdict of the primary group (the study's): ``{"verdict", "reason", ...}``."""

    def to_dict(self, provenance: Mapping | None = None) -> dict:
        """The JSON-ready summary (summary.json), with ``provenance``."""


@dataclass(frozen=True)
class Design:
    """One design: its analysis, its calibration and its figures (names of functions of
    :mod:`affdiv.experiments.report.figures`, each written to ``<name>.png``)."""

    name: str
    analyse: Callable[..., StudyAnalysis]  # (records, settings, *, progress=None)
    calibrate: Callable[..., VerdictCalibration]  # (analysis, *, n_sims, seed, progress)
    figures: tuple[str, ...]
    ladder_figures: tuple[str, ...] = ()  # drawn when the records hold more than one target


def designs() -> dict[str, Design]:
    """The registry: {design name: :class:`Design`} (imported on use: the designs import this module)."""
    from affdiv.experiments.analysis import calibration, critical_batch, decision

    return {
        FIXED_BUDGET: Design(FIXED_BUDGET, decision.analyse, calibration.calibrate_fixed_budget,
                             ("metric_vs_batch", "contrast_forest", "slope_forest")),
        STEPS_TO_TARGET: Design(STEPS_TO_TARGET, critical_batch.analyse_target, calibration.calibrate_target,
                                ("steps_vs_batch", "examples_vs_steps", "bcrit_forest", "ratio_forest"),
                                ("bcrit_vs_target", "ratio_vs_target")),
    }


def design_of(name: str) -> Design:
    """The :class:`Design` named ``name``; ValueError naming the designs otherwise."""
    registry = designs()
    if name not in registry:
        raise ValueError(f"design must be one of {sorted(registry)}, got {name!r}")
    return registry[name]


def analyse_study(records: Sequence[Mapping], settings: AnalysisSettings, *,
                  progress: Callable[[str], None] | None = None) -> StudyAnalysis:
    """Analyse ``records`` by the design of ``settings`` (:attr:`AnalysisSettings.design`)."""
    return design_of(settings.design).analyse(records, settings, progress=progress)


# ------------------------------------------------------------------------ shared pieces of the rules
def rng(seed: int, *labels: str) -> np.random.Generator:
    """A generator that depends on the labels, not on the order in which methods are analysed."""
    return np.random.default_rng([seed, *(zlib.crc32(label.encode()) for label in labels)])


def role_of(method: str, settings: AnalysisSettings) -> str:
    """``corrected``, ``baseline`` or ``other`` (no prediction)."""
    return "corrected" if method in settings.corrected else "baseline" if method in settings.baselines else "other"


def in_role_order(roles: Mapping[str, str]) -> list[str]:
    """The methods of ``roles`` ({method: role}), corrected first, then baselines, then the others, by name."""
    return sorted(roles, key=lambda m: (ROLE_ORDER[roles[m]], m))


def roles_clause(settings: AnalysisSettings) -> str:
    """The rule's sentence naming the methods in each role."""
    return f"Corrected layers: {', '.join(settings.corrected)}. Baselines: {', '.join(settings.baselines)}."


def joint(verdicts: Sequence[str]) -> str:
    """Verdicts combined: supported if every one is; contradicted if some is and none supported;
    mixed if both occur; inconclusive otherwise (also when there are none)."""
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    if CONTRADICTED in verdicts:
        return MIXED if SUPPORTED in verdicts else CONTRADICTED
    return INCONCLUSIVE


def overall(verdicts: Sequence[str]) -> str:
    """A method's verdict across groups: the same verdict in every group stands (supported, no
    prediction, reference, ...); otherwise :func:`joint`."""
    if verdicts and len(set(verdicts)) == 1:
        return verdicts[0]
    return joint(verdicts)


def by_batch_size(rows: Sequence[Mapping]) -> dict[int, list[Mapping]]:
    """The rows of each batch size, by increasing batch size (each list in the rows' order)."""
    grouped = defaultdict(list)
    for row in rows:
        grouped[row["batch_size"]].append(row)
    return {b: grouped[b] for b in sorted(grouped)}

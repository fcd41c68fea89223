"""The settings of an analysis, either design: :class:`AnalysisSettings`, the one place that names
them, gives their defaults and checks their values.

A preset's ``[analysis]`` table, ``affdiv analyse``'s options and a library call all end here
(:meth:`AnalysisSettings.from_mapping`); the design follows from the metric (steps to a target, or
a fixed budget of epochs or steps), and :mod:`affdiv.experiments.analysis.design` maps it to the
functions that analyse, calibrate and draw it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from affdiv.checks import check_int
from affdiv.vocabulary import DEFAULT_BASELINES, DEFAULT_CORRECTED, FIXED_BUDGET, STEPS_TO_TARGET, TARGET_METRIC

#: The settings only the fixed-budget design uses (the steps-to-target design has no slopes, margins
#: or bootstrap of slopes; fewer steps are better).
FIXED_BUDGET_ONLY = ("margin", "contrast_margin", "sensitivity", "test_baselines")
#: The fewest bootstrap draws of a percentile interval (0: no bootstrap, the steps-to-target design only).
MIN_BOOT = 100


@dataclass(frozen=True)
class AnalysisSettings:
    """Every setting of an analysis, with its default (a preset's ``[analysis]`` table takes these keys).

    metric: the record column analysed; ``steps_to_target`` makes it the steps-to-target design;
        None: the input decides (``analyse_file``: steps to a target for target runs, else
        test_accuracy of a store, the column "metric" of a CSV), the analysis reads the column "metric".
    higher_is_better: the metric is a score (True) or a loss (False); fixed budget only.
    corrected, baselines: the method names in each role (every other method: no prediction).
    group_by: the column whose values split the records into independent analyses; None, or a
        column no record has, analyses everything as one group "all" (the pipeline then groups by
        every setting that varies, :func:`~affdiv.experiments.analysis.groups.label_groups`).
    alpha: the level of every test, in (0, 0.5).
    margin: the slope's equivalence margin per doubling of B (None: from the metric's scale).
    n_boot: bootstrap draws of the percentile intervals (>= 100; 0: none, steps to target only).
    seed: seeds the bootstrap resamples.
    primary_group: the group whose joint verdict is the study's (None: the default rule).
    sensitivity: run the bootstrap and Page's L of the slopes (descriptive).
    contrast_margin: the contrasts' equivalence margin (None: from the metric's scale).
    test_baselines: test the baselines' own contrast (None: yes unless every run has an epoch budget).
    primary_target: the target whose verdict is the study's along a ladder (None: the records' own,
        else the highest).
    """

    metric: str | None = None
    higher_is_better: bool = True
    corrected: tuple[str, ...] = DEFAULT_CORRECTED
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    group_by: str | None = None
    alpha: float = 0.05
    margin: float | None = None
    n_boot: int = 2000
    seed: int = 0
    primary_group: str | None = None
    sensitivity: bool = True
    contrast_margin: float | None = None
    test_baselines: bool | None = None
    primary_target: float | None = None
    #: the settings a caller named (:meth:`from_mapping` records its mapping's keys): :meth:`given`
    #: counts them even where they equal the default
    named: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for role in ("corrected", "baselines"):  # any sequence of names is kept as a tuple
            value = getattr(self, role)
            if not isinstance(value, str) and isinstance(value, Sequence):
                object.__setattr__(self, role, tuple(value))
        _check(self)

    @property
    def design(self) -> str:
        """``steps_to_target`` when the metric is steps to a target, else ``fixed budget``."""
        return STEPS_TO_TARGET if self.metric == TARGET_METRIC else FIXED_BUDGET

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The names of the settings, in the order of the fields."""
        return tuple(f.name for f in fields(cls) if f.name != "named")

    @classmethod
    def from_mapping(cls, mapping: Mapping, *, methods: Sequence[str] | None = None,
                     where: str | None = None) -> AnalysisSettings:
        """The settings a mapping (a preset's ``[analysis]`` table) names, the others at their defaults.

        Raises ValueError on one line naming the key and the value (led by ``where``, when given):
        an unknown key, a value of the wrong kind or out of range, a method both corrected and
        baseline, and, when ``methods`` is given, names in ``corrected``/``baselines`` not among them."""
        prefix = f"{where}: " if where else ""
        unknown = sorted(set(mapping) - set(cls.keys()))
        if unknown:
            raise ValueError(f"{prefix}unknown setting(s) {unknown}; expected among {list(cls.keys())}")
        try:
            settings = cls(**mapping, named=frozenset(mapping))
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None
        if methods is not None:
            for role in ("corrected", "baselines"):
                missing = sorted(set(getattr(settings, role)) - set(methods)) if role in mapping else []
                if missing:
                    raise ValueError(f"{prefix}{role}: unknown method(s) {missing}; the methods are {sorted(methods)}")
        return settings

    def replace(self, **changes) -> AnalysisSettings:
        """A copy with ``changes`` (checked as the constructor checks)."""
        return dataclasses.replace(self, **changes)

    def given(self) -> list[str]:
        """The names of the settings a caller named (:meth:`from_mapping`) or that differ from their defaults."""
        default = AnalysisSettings()
        return [k for k in self.keys() if k in self.named or getattr(self, k) != getattr(default, k)]


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _check(settings: AnalysisSettings) -> None:
    """Refuse a value of the wrong kind or out of range; ValueError naming the setting and the value."""
    alpha = settings.alpha
    if not _number(alpha) or not 0 < alpha < 0.5:
        raise ValueError(f"alpha must lie in (0, 0.5), got {alpha!r}")
    for key in ("margin", "contrast_margin"):
        margin = getattr(settings, key)
        if margin is not None and (not _number(margin) or not (math.isfinite(margin) and margin > 0)):
            raise ValueError(f"{key} must be a finite number > 0, got {margin!r}")
    target = settings.primary_target
    if target is not None and (not _number(target) or not 0 < target <= 1):
        raise ValueError(f"primary_target must be a validation accuracy in (0, 1], got {target!r}")
    for key in ("higher_is_better", "sensitivity", "test_baselines"):
        value = getattr(settings, key)
        if not isinstance(value, bool) and not (value is None and key == "test_baselines"):
            raise ValueError(f"{key} must be true or false (a TOML boolean, unquoted), got {value!r}")
    for key in ("metric", "group_by", "primary_group"):
        value = getattr(settings, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{key} must be a non-empty name (a string), got {value!r}")
    check_int("seed (of the bootstrap)", settings.seed, minimum=0)
    check_int("n_boot (draws of a percentile CI)", settings.n_boot, minimum=0)
    if 0 < settings.n_boot < MIN_BOOT:
        raise ValueError(f"n_boot (draws of a percentile CI) must be 0 (no bootstrap) or >= {MIN_BOOT}, "
                         f"got {settings.n_boot}")
    if settings.metric is not None and settings.design == FIXED_BUDGET and settings.n_boot < MIN_BOOT:
        # (with no metric the design is not known yet: the analysis checks it once it is)
        raise ValueError(f"n_boot (draws of a percentile CI) must be >= {MIN_BOOT} for a fixed budget "
                         f"(metric {settings.metric!r}), got {settings.n_boot}")
    for role in ("corrected", "baselines"):
        value = getattr(settings, role)
        if not isinstance(value, tuple) or not all(isinstance(m, str) for m in value):
            raise ValueError(f"{role} must be a list of method names, got {value!r}")
    both = sorted(set(settings.corrected) & set(settings.baselines))
    if both:
        raise ValueError(f"a method cannot be both corrected and baseline: {both}")


def fixed_budget_only(given: Iterable[str]) -> list[str]:
    """The names among ``given`` (settings given, e.g. :meth:`AnalysisSettings.given`) that only the
    fixed-budget design uses (:data:`FIXED_BUDGET_ONLY`), sorted: a steps-to-target analysis refuses them."""
    return sorted(set(given) & set(FIXED_BUDGET_ONLY))

"""A study before it trains: its plan and its preflight.

:func:`plan_study` turns a preset and its :class:`StudyOverrides` into a :class:`StudyPlan`: the
expanded, checked runs of each study (their keys), its analysis settings and the metric it is
analysed by (chosen here, once: :func:`default_metric`), and the sweep's options with the preset's
[sweep] and [measure] defaults filled in. A plan depends on the preset, the overrides and the
model factories' sources only, never on the machine or the files it will read and write.

:func:`preflight` then checks a plan against this machine and its output paths, before the store
is created or a run trains: every run's device is here, every dataset loads and takes its batch
sizes, the report folders are writable and would overwrite no input, and an existing results store
is one of ours, holds runs on the same data and was measured at the same intervals
(:func:`check_measurement_resume`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from affdiv.atomic import check_writable_file, check_writable_folder
from affdiv.experiments.analysis.groups import label_groups
from affdiv.experiments.analysis.settings import AnalysisSettings, fixed_budget_only
from affdiv.experiments.runs.config import METHODS, RunConfig, check_finite, config_hash
from affdiv.experiments.runs.options import SweepOptions
from affdiv.vocabulary import TARGET_METRIC

if TYPE_CHECKING:
    from affdiv.experiments.runs.presets import Preset
    from affdiv.experiments.runs.store import ResultStore

#: The files :func:`~affdiv.experiments.report.writer.write_report` may write into its folder
#: (tests/experiments/test_pipeline.py checks this list against a written report).
REPORT_FILES = ("records.csv", "metric_vs_batch.png", "slope_forest.png", "contrast_forest.png",
                "steps_vs_batch.png", "examples_vs_steps.png", "bcrit_forest.png", "ratio_forest.png",
                "bcrit_vs_target.png", "ratio_vs_target.png",
                "training_curves.png", "calibration.png", "summary.json", "summary.tex", "report.md", "report.html")


@dataclass(frozen=True)
class StudyOverrides:
    """What replaces a preset's settings for one invocation (None / empty: the preset's).

    ``seeds``, ``batch_sizes``: replace those grid axes; ``methods``: run only these, each study
    keeping those of its kind (MLP, CNN, ViT, or a method of one's own); ``settings``: run settings
    of every run (a grid axis is replaced by the value, or the list). Checked when made: no inf or
    nan in ``settings`` (a run's key is JSON, which has neither).
    """

    seeds: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    methods: tuple[str, ...] | None = None
    settings: Mapping = field(default_factory=dict)

    def __post_init__(self):
        for name in ("seeds", "batch_sizes", "methods"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, str | bytes) or not isinstance(value, Sequence):
                    raise ValueError(f"{name} must be a list, got {value!r}")
                object.__setattr__(self, name, tuple(value) or None)
        if not isinstance(self.settings, Mapping):
            raise ValueError(f"settings must be a table of run settings, got {self.settings!r}")
        object.__setattr__(self, "settings", dict(self.settings))
        check_finite(self.settings, "settings ")


@dataclass(frozen=True)
class PlannedStudy:
    """One analysed family of runs: its configs (in the preset's order), their keys (sorted), the
    analysis settings with the ``metric`` it is analysed by, and that metric."""

    name: str
    configs: tuple[RunConfig, ...]
    hashes: tuple[str, ...]
    analysis: AnalysisSettings
    metric: str

    @property
    def digest(self) -> str:
        """SHA-256 of the study's sorted run keys (the provenance's ``config_hash``)."""
        return hashlib.sha256("".join(self.hashes).encode()).hexdigest()


@dataclass(frozen=True)
class StudyPlan:
    """A preset's studies after the overrides, checked; ``runs``: {key: config} of every study's
    runs, once each; ``options``: how they train, with the preset's defaults filled in;
    ``origin``: {measurement interval: where it was set} for those the preset set."""

    preset: Preset
    overrides: StudyOverrides
    studies: tuple[PlannedStudy, ...]
    runs: Mapping[str, RunConfig]
    options: SweepOptions
    origin: Mapping[str, str]

    def out_dirs(self, out: str | Path) -> dict[str, Path]:
        """{study name: its report folder}: ``out`` itself for one study, else a sub-folder each."""
        out = Path(out)
        return {s.name: out if len(self.studies) == 1 else out / s.name for s in self.studies}


def default_metric(budgets: set[str], *, database: bool, where: str) -> str:
    """The metric a study, a store or a CSV is analysed by when none is named: ``steps_to_target``
    when every run (record) is of ``budget = "target"``, else ``test_accuracy`` of runs or a store,
    the column ``metric`` of a CSV. Target runs mixed with others raise ValueError asking for the
    metric to be named."""
    if budgets == {"target"}:
        return TARGET_METRIC
    if "target" in budgets:
        others = sorted(b or "(empty)" for b in budgets - {"target"})
        raise ValueError(f"{where}: records of budget 'target' mixed with budget(s) {others}; name the metric (e.g. "
                         f"{TARGET_METRIC} or {'test_accuracy' if database else 'metric'}) to choose what to analyse")
    return "test_accuracy" if database else "metric"


def plan_study(preset: str | Path | Preset, overrides: StudyOverrides | None = None,
               options: SweepOptions | None = None) -> StudyPlan:
    """The plan of ``preset`` (a packaged name, a TOML path, or a loaded preset) under
    ``overrides``, with ``options`` (default: the defaults) completed by the preset's [sweep] and
    [measure] tables. Every run setting and analysis setting is checked here; raises ValueError
    naming the preset table or the override, the setting and its value."""
    from affdiv.experiments.runs.presets import Preset, load_preset

    overrides = overrides or StudyOverrides()
    preset = preset if isinstance(preset, Preset) else load_preset(str(preset))
    _check_preset_finite(preset)
    try:
        studies = preset.studies(seeds=_listed(overrides.seeds), batch_sizes=_listed(overrides.batch_sizes),
                                 methods=_listed(overrides.methods), run=dict(overrides.settings))
    except TypeError as error:  # a setting of the wrong type (e.g. base_lr = "fast") met a comparison
        raise ValueError(f"preset {preset.name!r}: a run setting has the wrong type ({error})") from None
    planned = []
    for study in studies:
        configs = tuple(config.check() for config in study.configs)
        where = f"preset {preset.name!r} [analysis] of study {study.name!r}"
        methods = sorted({*METHODS, *(c.method for c in configs)})
        given_metric = AnalysisSettings.from_mapping(study.analysis, methods=methods, where=where).metric
        metric = given_metric or default_metric({c.budget for c in configs}, database=True, where=where)
        # checked again with the metric it is analysed by (a fixed budget's n_boot, ...)
        analysis = AnalysisSettings.from_mapping({**study.analysis, "metric": metric}, methods=methods, where=where)
        check_study_analysis(configs, study.analysis, metric=metric, where=where)
        hashes = tuple(sorted(config_hash(c.to_dict()) for c in configs))
        planned.append(PlannedStudy(study.name, configs, hashes, analysis, metric))
    runs = {config_hash(c.to_dict()): c for study in planned for c in study.configs}
    given = options or SweepOptions()
    origin = {key: f"preset {preset.name!r} [measure]" for key in preset.measure if getattr(given, key) is None}
    resolved = given.with_defaults(ensemble_memory=preset.ensemble_memory, intervals=preset.measure)
    return StudyPlan(preset, overrides, tuple(planned), runs, resolved, origin)


def _listed(values: tuple | None) -> list | None:
    return None if values is None else list(values)


def _check_preset_finite(preset: Preset) -> None:
    """Refuse inf and nan in a preset's run settings, naming its table."""
    for block in [preset.raw, *preset.raw.get("study", [])]:
        for table in ("run", "grid"):
            check_finite(block.get(table, {}), f"preset {preset.name!r} [{table}] ")
    for method, table in preset.raw.get("method", {}).items():
        check_finite(table, f"preset {preset.name!r} [method.{method}] ")


def check_study_analysis(configs: Sequence[RunConfig], settings: Mapping, *, metric: str, where: str) -> None:
    """Refuse the analysis settings of a study that only its runs' records could refuse, before the
    runs train: a ``metric`` its runs do not record, settings the steps-to-target analysis has no
    use for, a ``group_by`` that is no run setting or that leaves two runs in one cell (group,
    method, batch size, seed), a ``primary_group`` that names none of its groups. Raises ValueError
    naming ``where``, the setting, its value and the choices."""
    from affdiv.experiments.runs.training import metric_names

    recorded = sorted(set.intersection(*(set(metric_names(c)) for c in configs)))
    if settings.get("metric") is not None and metric not in recorded:
        raise ValueError(f"{where}: metric {metric!r} is not recorded by the study's runs; they record "
                         f"{', '.join(recorded)}")
    if metric == TARGET_METRIC:
        idle = fixed_budget_only(settings) + (["higher_is_better"] if settings.get("higher_is_better") else [])
        if idle:
            raise ValueError(f"{where}: {', '.join(idle)} do(es) not apply to the steps-to-target analysis (fewer "
                             "steps are better; no slopes, margins or bootstrap of slopes); remove it")
    records = [config.to_dict() for config in configs]
    group_by = settings.get("group_by")
    if group_by is not None and group_by not in RunConfig.__dataclass_fields__:
        raise ValueError(f"{where}: group_by {group_by!r} is not a run setting; name one (e.g. 'lr_rule'), or leave "
                         "group_by out to group by every setting that varies")
    column = group_by or label_groups(records)
    cells: dict[tuple, dict] = {}
    for record in records:
        cell = (str(record.get(column)), record["method"], record["batch_size"], record["seed"])
        other = cells.setdefault(cell, record)
        if other is not record:
            differ = sorted(k for k in record if k != column and record[k] != other.get(k))
            raise ValueError(f"{where}: group_by {column!r} puts two runs in one cell ({column}={cell[0]}, method "
                             f"{cell[1]}, batch size {cell[2]}, seed {cell[3]}; they differ in {', '.join(differ)}); "
                             "leave group_by out to group by every setting that varies")
    groups = sorted({str(record.get(column)) for record in records})
    primary = settings.get("primary_group")
    if primary is not None and primary not in groups:
        raise ValueError(f"{where}: primary_group {primary!r} is none of the study's groups {groups}")


# ----------------------------------------------------------------------------------- preflight
@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` found: the results store (``db``) and whether it holds runs already
    (``resumes``), each study's report folder, and {dataset: its fingerprints} of the runs' data."""

    db: Path
    resumes: bool
    out_dirs: Mapping[str, Path]
    fingerprints: Mapping[str, tuple[str, ...]]


def preflight(plan: StudyPlan, out: str | Path, *, db: str | Path | None = None,
              data_dir: str | None = None) -> Preflight:
    """Check ``plan`` against this machine and its paths before any run trains (the report folders
    are created; no store is written): each run's
    device (:func:`check_device`), the report folders under ``out`` (writable, replacing no input),
    the results store ``db`` (default ``out/results.sqlite``: writable, and when it exists, an
    affdiv store, intact, holding runs on the same data and measured at the plan's intervals), and
    every run's dataset (it loads from ``data_dir``, and its training split takes the batch size).
    Raises ValueError (or an OSError subclass) naming the parameter: ``db``, ``out``, ``device``."""
    from affdiv.experiments.runs.store import identify

    for device in sorted({c.device for c in plan.runs.values()}):
        check_device(device)
    out_dirs = plan.out_dirs(out)
    db = Path(db) if db else Path(out) / "results.sqlite"
    check_no_overwrite({"db": db}, list(out_dirs.values()))
    for folder in out_dirs.values():
        check_writable_folder(folder, "out")
    try:
        existing = identify(db) in ("affdiv", "legacy")
    except (ValueError, IsADirectoryError) as error:
        raise type(error)(option_named("db", error)) from None
    check_writable_file(db, "db")
    fingerprints, expected, expected_raw = _load_data(plan, data_dir)
    if existing:
        _check_store(db, plan, expected, expected_raw)
    return Preflight(db, existing, out_dirs, {k: tuple(sorted(v)) for k, v in fingerprints.items()})


def _load_data(plan: StudyPlan, data_dir: str | None) -> tuple[dict, dict, dict]:
    """Load every run's data (bad batch sizes, data options and missing files are refused here):
    {dataset: fingerprints}, {data key: fingerprint} and {raw key: raw SHA-256}."""
    from affdiv.experiments.runs.store import data_key, raw_key
    from affdiv.experiments.runs.sweep import dataset_for
    from affdiv.experiments.runs.training import steps_per_epoch

    fingerprints: dict[str, set[str]] = {}
    expected: dict[str, str] = {}
    expected_raw: dict[str, str] = {}
    for config in plan.runs.values():
        data = dataset_for(config, data_dir)
        fingerprints.setdefault(config.dataset, set()).add(str(data.fingerprint))
        expected[data_key(config.to_dict())] = str(data.fingerprint)
        expected_raw[raw_key(config.to_dict())] = str(data.config["raw_sha256"])
        steps_per_epoch(config, len(data.train.y))
    return fingerprints, expected, expected_raw


def _check_store(db: Path, plan: StudyPlan, expected: Mapping, expected_raw: Mapping) -> None:
    """Refuse an existing store that is damaged, holds runs on other data, or was measured otherwise."""
    from affdiv.experiments.runs.store import ResultStore

    try:
        with ResultStore(db, read_only=True) as store:
            store.verify()
            store.check_fingerprints(expected)
            store.check_raw_data(expected_raw)
            check_measurement_resume(store, list(plan.runs), plan.options.intervals, plan.origin)
    except ValueError as error:
        raise ValueError(option_named("db", error)) from None


def option_named(option: str, error: Exception) -> str:
    """``error``'s message led by the parameter ``option`` (once: a message that names it already
    is kept)."""
    message = str(error.args[0] if error.args else error)
    return message if message.startswith(option) else f"{option} {message}"


def check_device(name) -> None:
    """Refuse a device torch cannot parse or this machine does not have (before any run)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"device {name!r}: not a torch device ({reason})") from None
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {name!r}: CUDA is not available on this machine ({why}); use device 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return
    if device.type == "mps" and torch.backends.mps.is_available():
        return
    raise ValueError(f"device {name!r}: not available for training here; expected cpu, cuda[:N] or mps")


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # a symbolic-link loop (RuntimeError before Python 3.13): not one file
        return False


def check_no_overwrite(inputs: Mapping[str, Path], out_dirs: Sequence[Path]) -> None:
    """Refuse a report folder whose files would replace an input (``{parameter: path}``): the
    report writes :data:`REPORT_FILES` into each of ``out_dirs``."""
    for option, path in inputs.items():
        for folder in out_dirs:
            clash = [name for name in REPORT_FILES if _same_file(Path(folder) / name, Path(path))]
            if clash:
                raise ValueError(f"{option} {path} would be overwritten by the report written to {folder} (its "
                                 f"{clash[0]}); choose another out folder or move the input")


def _interval(measurements: Sequence[Mapping], name: str):
    """The interval a stored run was measured with by measurement ``name``: None (no such
    measurements), the step between its first two, or "?" when it has only one (the run was
    shorter than the interval: any interval that long gives the same measurements)."""
    steps = sorted(m["step"] for m in measurements if m.get("measurement") == name)
    if not steps:
        return None
    return steps[1] - steps[0] if len(steps) > 1 else "?"


def check_measurement_resume(store: ResultStore, hashes: Sequence[str], intervals: Mapping[str, int | None],
                             origin: Mapping[str, str] | None = None) -> None:
    """Refuse to resume a sweep whose finished runs were measured with another interval of one of
    the measurements (or not at all, or measured when now they are not) while runs are still to
    train: their measurement columns would mix intervals. ``intervals``: {key of
    :data:`~affdiv.experiments.runs.options.INTERVALS`: interval now, None for none}; ``origin``:
    {key: where its interval was set, e.g. a preset's [measure] table}, named in the error. A
    sweep with nothing left to train is never refused."""
    from affdiv.experiments.runs.presets import MEASURE

    done = store.finished() & set(hashes)
    if not done or done == set(hashes):
        return
    measured = store.measurements(done)
    for key, now in intervals.items():
        found = {_interval(measured.get(run, []), MEASURE[key].NAME) for run in done} - {"?"}
        other = sorted(found - {now}, key=str)
        if other:
            before, where = _with(key, other[0]), f" (set by {origin[key]})" if key in (origin or {}) else ""
            raise ValueError(f"db {store.path} holds runs of this sweep measured {before}; resuming "
                             f"{_with(key, now)}{where} would mix them; rerun {before} or use another results store")


def _with(key: str, interval: int | None) -> str:
    return f"without {key}" if interval is None else f"with {key} {interval}"


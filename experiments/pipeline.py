"""The whole study as stages: plan → preflight → run → analyse → report. ``affdiv falsify`` and
``affdiv analyse`` call these functions.

:func:`falsify` takes a preset through :func:`~affdiv.experiments.plan.plan_study` (the runs, their
analysis and metric, checked), :func:`~affdiv.experiments.plan.preflight` (this machine, the data,
the output paths and the results store, checked before anything is written), the sweep
(:func:`~affdiv.experiments.runs.sweep.run_sweep`), and, per study, :func:`analyse_and_report`.

The sweep's modules (:mod:`affdiv.experiments.runs`, which import torch) are imported inside the
functions that train or read a store, so that ``affdiv analyse`` of a CSV does not wait for them.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from affdiv.atomic import check_writable_folder
from affdiv.checks import check_int
from affdiv.experiments.analysis.calibration import calibrate_for
from affdiv.experiments.analysis.design import analyse_study
from affdiv.experiments.analysis.groups import label_curves, label_groups
from affdiv.experiments.analysis.settings import AnalysisSettings, fixed_budget_only
from affdiv.experiments.plan import (
    Preflight,
    StudyOverrides,
    StudyPlan,
    check_no_overwrite,
    default_metric,
    option_named,
    plan_study,
    preflight,
)
from affdiv.experiments.records import RENAMED_METHODS, is_sqlite, read_csv, read_csv_rows
from affdiv.experiments.report.writer import write_report
from affdiv.provenance import machine_key, provenance, relative_path
from affdiv.vocabulary import TARGET_METRIC

if TYPE_CHECKING:
    from affdiv.experiments.runs.options import SweepOptions
    from affdiv.experiments.runs.presets import Preset
    from affdiv.experiments.runs.store import ResultStore
    from affdiv.experiments.runs.sweep import SweepOutcome

#: From this many records on, the analysis prints a line before each long step.
PROGRESS_FROM = 5000


def _check_calibration_sims(n: int) -> None:
    check_int("calibration_sims", n, minimum=0)


def _progress(started: float):
    def show(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f} s] {line}", file=sys.stderr, flush=True)

    return show


def code_versions(store: ResultStore, hashes: Sequence[str] | None = None) -> list[dict]:
    """The code that trained the runs (``hashes``: of these only) and their machines, as the store
    recorded them: ``{"version", "git_commit", "git_dirty", "cpu", "runs"}`` per distinct code and
    machine (``cpu``: :func:`affdiv.provenance.machine_identity`, None where not recorded), most runs
    first; the runs stored without a record count under version None."""
    counts: dict[tuple, int] = {}
    for code in store.code_versions(hashes).values():
        key = (None, None, None, None) if code is None else \
            (code["version"], code["git_commit"], code["git_dirty"], machine_key(code["cpu"]))
        counts[key] = counts.get(key, 0) + 1
    return [{"version": v, "git_commit": c, "git_dirty": d, "cpu": None if cpu is None else dict(cpu), "runs": n}
            for (v, c, d, cpu), n in sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))]


def analyse_and_report(out: Path, records: list[dict], curves: list[dict] | None, settings: AnalysisSettings,
                       provenance: Mapping, calibration_sims: int,
                       progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Analyse ``records`` by the design of ``settings`` (grouped by ``settings.group_by``, or, when
    None, by the groups of ``label_groups``), calibrate the rule in that layout, and
    ``write_report``; returns the written paths. ``progress``: called with a line before each long
    step (None: quiet)."""
    _check_calibration_sims(calibration_sims)
    settings = settings.replace(group_by=settings.group_by or label_groups(records))
    if curves:
        label_curves(curves, records)
    analysis = analyse_study(records, settings, progress=progress)
    calibration = None
    if calibration_sims:
        print(f"calibrating the tests ({calibration_sims} simulated studies per planted effect) ...", file=sys.stderr)
        try:
            calibration = calibrate_for(analysis, n_sims=calibration_sims)
        except ValueError as error:  # the sweep's layout cannot be simulated (< 3 batch sizes, no fit)
            print(f"calibration left out of the report: {error}", file=sys.stderr)
    if progress is not None:
        progress(f"writing the report to {out} ...")
    return write_report(
        out, analysis, records=records, curves=curves, provenance=provenance, calibration=calibration
    )


def _hardware(outcome, devices: set[str]) -> dict:
    import torch

    from affdiv.experiments.runs.sweep import available_cpus

    info = {"usable_cpus": available_cpus(), "workers": outcome.workers, "threads_per_worker": outcome.threads,
            "devices": sorted(devices), "executor": outcome.executor}
    if torch.cuda.is_available() and any(d.startswith("cuda") for d in devices):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def falsify(
    preset: str | Path | Preset,
    out: str | Path,
    *,
    db: str | Path | None = None,
    data_dir: str | None = None,
    overrides: StudyOverrides | None = None,
    options: SweepOptions | None = None,
    calibration_sims: int = 500,
) -> dict[str, dict[str, Path]]:
    """Run every run of ``preset`` (a packaged name, a TOML path or a loaded preset) not yet in the store, then
    analyse each of its studies and write its report under ``out``.

    Args:
        preset: ``smoke``, ``fashion``, ``paper``, ..., a path to a TOML preset, or a loaded preset.
        out: report folder (one sub-folder per study when the preset has several).
        db: results store (default ``out/results.sqlite``); re-running resumes it.
        data_dir: folder holding the dataset files (default: each loader's own search path).
        overrides: :class:`~affdiv.experiments.plan.StudyOverrides`: seeds, batch sizes, methods
            and run settings in place of the preset's (default: none).
        options: :class:`~affdiv.experiments.runs.options.SweepOptions`: how the runs train
            (workers, stacking, ensemble memory, measurements, retries, the dask executor); a
            setting left None is the preset's ([sweep], [measure]) or the default. Measurements
            are not part of a run's key: resuming a store whose runs were measured otherwise is
            refused (:func:`~affdiv.experiments.plan.check_measurement_resume`), and the
            provenance records both intervals.
        calibration_sims: simulated studies per planted effect for the report's calibration (0: none).

    Returns:
        ``{study name: {file kind: path}}`` of the written reports.
    """
    if options is not None and options.dask is not None and options.dask.scheduler is not None:
        # First, before the heavy imports: a scheduler that does not answer is told within its deadline.
        from affdiv.experiments.runs.dask_executor import check_scheduler

        check_scheduler(options.dask.scheduler)
    from affdiv.experiments.runs.store import ResultStore
    from affdiv.experiments.runs.sweep import check_executor, run_sweep

    started = time.monotonic()
    # Every setting and output path is checked before the first run trains, and the store is
    # created only then: a refused sweep leaves no results database behind.
    _check_calibration_sims(calibration_sims)
    plan = plan_study(preset, overrides, options)
    check_executor(plan.options)
    checked = preflight(plan, out, db=db, data_dir=data_dir)
    print(f"affdiv falsify: preset {plan.preset.name}: {len(plan.runs)} runs -> {checked.db}", file=sys.stderr)
    try:
        writer = ResultStore(checked.db)  # the writer's lock: a second sweep on this store stops here
    except ValueError as error:
        raise type(error)(option_named("db", error)) from None
    written = {}
    with writer as store:
        outcome = run_sweep(list(plan.runs.values()), store, plan.options, data_dir=data_dir,
                            progress=sys.stderr)  # as it is now (run_sweep's default is bound at its import)
        if outcome.failed:
            print(f"affdiv falsify: {len(outcome.failed)} run(s) failed on every attempt; the report lists them and "
                  "leaves them out (the same command tries them again)", file=sys.stderr)
        for study in plan.studies:
            study_out = checked.out_dirs[study.name]
            records = store.records(list(study.hashes), metric=study.metric)
            record = _study_provenance(plan, checked, study, store, outcome, started)
            written[study.name] = analyse_and_report(
                study_out, records, store.curves(list(study.hashes)), study.analysis, record, calibration_sims,
                progress=_progress(started) if len(records) >= PROGRESS_FROM else None,
            )
    return written


def _study_provenance(plan: StudyPlan, checked: Preflight, study, store: ResultStore, outcome: SweepOutcome,
                      started: float) -> dict:
    """The provenance of one study's report: what was planned, where it ran, how, and what failed."""
    hashes = list(study.hashes)
    options = plan.options
    return provenance(
        preset=plan.preset.name,
        preset_settings=plan.preset.raw,
        study=study.name,
        metric=study.metric,
        config_hash=study.digest,
        runs=len(hashes),
        seeds=sorted({c.seed for c in study.configs}),
        data_fingerprint={c.dataset: list(checked.fingerprints[c.dataset]) for c in study.configs},
        results_db=relative_path(Path(checked.db).resolve(), checked.out_dirs[study.name]),
        hardware=_hardware(outcome, {c.device for c in study.configs}),
        wall_time_s=round(time.monotonic() - started, 1),
        compute_time_s=round(store.seconds(hashes), 1),
        checks=_checks(store, hashes),
        runs_this_invocation=outcome.ran,
        runs_resumed_from_db=outcome.skipped,
        run_code=code_versions(store, hashes),
        # how this invocation trained its runs (resumed runs may have trained otherwise)
        this_invocation={"stack": options.stack, "ensemble_memory": options.ensemble_memory if options.stack else None},
        **options.intervals,
        failed_runs=[{k: f[k] for k in ("config_hash", "error", "kind", "attempts")}
                     | {k: f["config"].get(k) for k in ("method", "batch_size", "seed", "lr_rule")}
                     for f in store.failures(hashes)],
    )


def _checks(store: ResultStore, hashes: list[str] | None = None) -> dict:
    """The provenance's ``checks``: the runs' seconds in validation reads and their share of the
    runs' seconds (:meth:`~affdiv.experiments.runs.store.ResultStore.check_time`), rounded."""
    checks = store.check_time(hashes)
    return {**checks, "check_s": round(checks["check_s"], 1),
            "share": None if checks["share"] is None else round(checks["share"], 4)}


def _read_store(path: Path, metric: str | None) -> tuple[list[dict], list[dict], str, dict]:
    """(records, curves, metric, provenance extras) of a results store, opened read-only: the code
    that trained the runs and the data they were trained on, as the store recorded them."""
    from affdiv.experiments.runs.store import ResultStore, data_key

    try:
        with ResultStore(path, read_only=True) as store:
            if metric is None:
                metric = default_metric(store.budgets(), database=True, where=f"input {path}")
            records, curves = store.records(metric=metric), store.curves()
            extra = {"run_code": code_versions(store), "compute_time_s": round(store.seconds(), 1),
                     "checks": _checks(store)}
    except (ValueError, IsADirectoryError) as error:
        raise ValueError(option_named("input", error)) from None
    by_data: dict[str, set[str]] = {}
    for r in records:
        by_data.setdefault(data_key(r), set()).add(str(r.get("data_fingerprint")))
    mixed = {key: sorted(found) for key, found in by_data.items() if len(found) > 1}
    if mixed:
        print(f"affdiv analyse: warning: {path} mixes runs on different data for the same data settings "
              f"(written before stores refused it): {mixed}", file=sys.stderr)
    extra["data_fingerprint"] = {dataset: sorted({str(r.get("data_fingerprint")) for r in records
                                                  if str(r.get("dataset")) == dataset})
                                 for dataset in sorted({str(r.get("dataset")) for r in records})}
    return records, curves, metric, extra


def _read_csv_input(path: Path, data: bytes, metric: str | None) -> tuple[list[dict], str]:
    """(records, metric) of a record CSV (``data``: its bytes, parsed once)."""
    table = read_csv_rows(path, data)  # parsed once: the budgets choose the default metric
    if metric is None:
        header, rows = table
        if "budget" in header:
            budgets = {str(row.get("budget") or "").strip() for row in rows}
        else:  # told by its columns: steps to a target and no column "metric" make a CSV of target runs
            budgets = {"target"} if TARGET_METRIC in header and "metric" not in header else set()
        metric = default_metric(budgets, database=False, where=f"input {path}")
    return read_csv(path, metric=metric, table=table), metric


def _check_input_settings(path: Path, records: Sequence[Mapping], settings: AnalysisSettings) -> None:
    """Refuse ``corrected``/``baselines`` names that are no method of the records, and settings of the
    fixed-budget analysis given for steps to a target."""
    present = sorted({RENAMED_METHODS.get(str(r["method"]), str(r["method"])) for r in records})
    for role in ("corrected", "baselines"):
        unknown = sorted(set(getattr(settings, role)) - set(present)) if role in settings.given() else []
        if unknown:
            raise ValueError(f"{role}: unknown method(s) {unknown}; the methods in {path} are {present}")
    idle = fixed_budget_only(settings.given()) if settings.metric == TARGET_METRIC else []
    if idle:
        raise ValueError(f"{idle[0]} applies to the fixed-budget analysis only; input {path} holds steps to a target "
                         "(fewer steps are better; no slopes or margins): leave it out")


def analyse_file(path: str | Path, out: str | Path, settings: AnalysisSettings | None = None, *,
                 calibration_sims: int = 500) -> dict[str, Path]:
    """Test the batch-size prediction on existing results: a record CSV or a results store;
    returns the written paths. ``settings`` (default: every default); its metric, when None, is
    :func:`default_metric`'s: ``steps_to_target`` for records of ``budget = "target"`` runs (a
    CSV without a ``budget`` column: one with a ``steps_to_target`` column and no ``metric``
    column), else ``test_accuracy`` of a store or the column ``metric`` of a CSV.

    The input is only read: a store is opened read-only (its bytes, and the folder it is in, stay
    as they were), and a report folder whose files would replace the input is refused. The
    provenance records the SHA-256 of the input as it was read. Names in ``corrected`` and
    ``baselines`` must be methods of the records (old names are read as their new ones); the
    settings only the fixed-budget analysis uses (``margin``, ``contrast_margin``, ...) are
    refused on steps to a target. ``primary_target``: for steps to a target along a ladder, the
    target that decides (default: the runs' own, else the highest). Every setting is checked
    before the analysis.
    """
    started = time.monotonic()
    _check_calibration_sims(calibration_sims)
    settings = settings or AnalysisSettings()
    path, out = Path(path), Path(out)
    if path.is_dir():
        raise IsADirectoryError(f"input {path}: is a folder, expected a CSV file or a results database")
    if not path.is_file():
        raise FileNotFoundError(f"input {path}: no such file")
    settings = settings.replace(**{role: tuple(RENAMED_METHODS.get(m, m) for m in getattr(settings, role))
                                   for role in ("corrected", "baselines") if role in settings.given()})
    check_no_overwrite({"input": path}, [out])
    check_writable_folder(out, "out")
    extra = {}
    if is_sqlite(path):
        with open(path, "rb") as handle:  # the database file before it is opened (a -wal file is not in it)
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        records, curves, metric, extra = _read_store(path, settings.metric)
    else:
        data = path.read_bytes()  # read once: the digest is of the bytes parsed
        digest = hashlib.sha256(data).hexdigest()
        (records, metric), curves = _read_csv_input(path, data, settings.metric), None
    settings = settings.replace(metric=metric)
    if not records:
        raise ValueError(f"input {path}: no records")
    _check_input_settings(path, records, settings)
    record = provenance(input=relative_path(path.resolve(), out), input_sha256=digest, metric=metric, **extra)
    progress = _progress(started) if len(records) >= PROGRESS_FROM else None
    if progress is not None:
        progress(f"read {len(records)} records from {path}")
    return analyse_and_report(out, records, curves, settings, record, calibration_sims, progress=progress)

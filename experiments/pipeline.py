"""The whole study: run (or resume) a preset's sweep, analyse it, calibrate the tests in its
layout, and write the report. ``affdiv falsify`` and ``affdiv analyse`` call these functions.

The sweep's modules (:mod:`affdiv.experiments.runs`, which import torch) are imported inside the
functions that train or read a store, so that ``affdiv analyse`` of a CSV does not wait for them.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from affdiv.atomic import check_writable_file, check_writable_folder
from affdiv.checks import check_int
from affdiv.experiments.analysis.calibration import calibrate_for
from affdiv.experiments.analysis.design import analyse_study
from affdiv.experiments.analysis.groups import label_curves, label_groups
from affdiv.experiments.analysis.settings import AnalysisSettings, check_settings, fixed_budget_only
from affdiv.experiments.records import RENAMED_METHODS, is_sqlite, read_csv, read_csv_rows
from affdiv.experiments.report.writer import write_report
from affdiv.provenance import provenance, relative_path
from affdiv.vocabulary import TARGET_METRIC

if TYPE_CHECKING:
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.store import ResultStore

#: The files :func:`~affdiv.experiments.report.writer.write_report` may write into its folder
#: (tests/experiments/test_pipeline.py checks this list against a written report).
REPORT_FILES = ("records.csv", "metric_vs_batch.png", "slope_forest.png", "contrast_forest.png",
                "steps_vs_batch.png", "examples_vs_steps.png", "bcrit_forest.png", "ratio_forest.png",
                "bcrit_vs_target.png", "ratio_vs_target.png",
                "training_curves.png", "calibration.png", "summary.json", "summary.tex", "report.md", "report.html")
#: torch's seed range (``torch.manual_seed``; a negative seed s is taken as s + 2**64, so it is refused).
MAX_SEED = 2**64 - 1
#: From this many records on, the analysis prints a line before each long step.
PROGRESS_FROM = 5000


def _check_calibration_sims(n: int) -> None:
    check_int("calibration_sims", n, minimum=0)


def _progress(started: float):
    def show(line: str) -> None:
        print(f"[{time.monotonic() - started:7.1f} s] {line}", file=sys.stderr, flush=True)

    return show


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, RuntimeError):  # a symbolic-link loop (RuntimeError before Python 3.13): not one file
        return False


def _option_named(option: str, error: Exception) -> str:
    """``error``'s message led by the parameter ``option`` (once: a message that names it already
    is kept)."""
    message = str(error.args[0] if error.args else error)
    return message if message.startswith(option) else f"{option} {message}"


def code_versions(store: ResultStore, hashes: Sequence[str] | None = None) -> list[dict]:
    """The code that trained the runs (``hashes``: of these only), as the store recorded it:
    ``{"version", "git_commit", "git_dirty", "runs"}`` per distinct code, most runs first; the
    runs stored without a record count under version None."""
    counts: dict[tuple, int] = {}
    for code in store.code_versions(hashes).values():
        key = (None, None, None) if code is None else (code["version"], code["git_commit"], code["git_dirty"])
        counts[key] = counts.get(key, 0) + 1
    return [{"version": v, "git_commit": c, "git_dirty": d, "runs": n}
            for (v, c, d), n in sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))]


def check_no_overwrite(inputs: Mapping[str, Path], out_dirs: Sequence[Path]) -> None:
    """Refuse a report folder whose files would replace an input (``{option: path}``): the report
    writes :data:`REPORT_FILES` into each of ``out_dirs``."""
    for option, path in inputs.items():
        for folder in out_dirs:
            clash = [name for name in REPORT_FILES if _same_file(Path(folder) / name, Path(path))]
            if clash:
                raise ValueError(f"{option} {path} would be overwritten by the report written to {folder} (its "
                                 f"{clash[0]}); choose another --out or move the input")


def _check_device(name) -> None:
    """Refuse a device torch cannot parse or this machine does not have (before any run)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"device {name!r} (--device or --set device=...): not a torch device ({reason})") from None
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {name!r}: CUDA is not available on this machine ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        return
    if device.type == "mps" and torch.backends.mps.is_available():
        return
    raise ValueError(f"device {name!r}: not available for training here; expected cpu, cuda[:N] or mps")


def _check_number(config: RunConfig, name: str, low: float, high: float | None, text: str) -> None:
    value = getattr(config, name)
    good = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not (good and low <= value and (high is None or value < high)):
        raise ValueError(f"{name} must be {text}, got {value!r}")


def _check_finite(settings: Mapping, where: str) -> None:
    """Refuse inf and nan anywhere in run settings (a run's key is JSON, which has neither)."""
    def walk(value, name):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}{name}: {value!r} is not a finite number")
        for key, item in (value.items() if isinstance(value, Mapping) else
                          enumerate(value) if isinstance(value, list | tuple) else ()):
            walk(item, f"{name}.{key}" if isinstance(value, Mapping) else f"{name}[{key}]")

    for key, value in settings.items():
        walk(value, key)


def check_run_config(config: RunConfig) -> None:
    """Refuse settings that :class:`RunConfig` lets through but a run (or its key) cannot take:
    a seed outside torch's range, a non-finite learning rate, a momentum outside [0, 1),
    data_options that are not a table, a device this machine lacks. Raises ValueError naming the
    setting and the value."""
    for name in ("seed", "data_seed"):
        value = getattr(config, name)
        check_int(f"run setting {name} (torch's seed range)", value, minimum=0, maximum=MAX_SEED)
    _check_number(config, "base_lr", 0, None, "a finite number > 0")
    _check_number(config, "momentum", 0, 1, "a number in [0, 1)")
    if any(not math.isfinite(lr) for lr in config.lr_grid):
        raise ValueError(f"every lr in lr_grid must be finite, got {list(config.lr_grid)}")
    if not isinstance(config.data_options, dict):
        raise ValueError(f"data_options must be a table of dataset options, e.g. --set "
                         f"'data_options={{standardize=\"none\"}}', got {config.data_options!r}")
    if not isinstance(config.device, str):
        raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {config.device!r}")


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


def study_metric(configs: Sequence[RunConfig]) -> str:
    """The metric a study is analysed by when its preset names none: steps to the target when every
    run is of the ``target`` budget, else the test accuracy."""
    return TARGET_METRIC if all(c.budget == "target" for c in configs) else "test_accuracy"


def check_study_analysis(configs: Sequence[RunConfig], settings: Mapping, *, where: str) -> None:
    """Refuse the analysis settings of a study that only its runs' records could refuse, before the
    runs train: a ``metric`` its runs do not record, a ``group_by`` that is no run setting or that
    leaves two runs in one cell (group, method, batch size, seed), a ``primary_group`` that names
    none of its groups. Raises ValueError naming ``where``, the setting, its value and the choices."""
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.training import metric_names

    metric = settings.get("metric")
    recorded = sorted(set.intersection(*(set(metric_names(c)) for c in configs)))
    if metric is not None and metric not in recorded:
        raise ValueError(f"{where}: metric {metric!r} is not recorded by the study's runs; they record "
                         f"{', '.join(recorded)}")
    if (metric or study_metric(configs)) == TARGET_METRIC:
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
    :data:`~affdiv.experiments.runs.presets.MEASURE`: interval now, None for none}; ``origin``:
    {key: where its interval was set, e.g. a preset's [measure] table}, named in the error. A
    sweep with nothing left to train is never refused."""
    from affdiv.experiments.runs.presets import MEASURE

    done = store.finished() & set(hashes)
    if not done or done == set(hashes):
        return
    measured = store.measurements(done)
    for key, now in intervals.items():
        option, module = MEASURE[key]
        found = {_interval(measured.get(run, []), module.NAME) for run in done} - {"?"}
        other = sorted(found - {now}, key=str)
        if other:
            before, where = _with(option, other[0]), f" (set by {origin[key]})" if key in (origin or {}) else ""
            raise ValueError(f"db {store.path} holds runs of this sweep measured {before}; resuming "
                             f"{_with(option, now)}{where} would mix them; rerun {before} or use another results store")


def _with(option: str, interval: int | None) -> str:
    return f"without {option}" if interval is None else f"with {option} {interval}"


def _hardware(outcome, devices: set[str]) -> dict:
    import torch

    from affdiv.experiments.runs.sweep import available_cpus

    info = {"usable_cpus": available_cpus(), "workers": outcome.workers, "threads_per_worker": outcome.threads,
            "devices": sorted(devices), "executor": outcome.executor}
    if torch.cuda.is_available() and any(d.startswith("cuda") for d in devices):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def falsify(
    preset: str,
    out: str | Path,
    *,
    data_dir: str | None = None,
    workers: int | None = None,
    db: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    batch_sizes: Sequence[int] | None = None,
    methods: Sequence[str] | None = None,
    settings: Mapping | None = None,
    calibration_sims: int = 500,
    stack: bool = True,
    ensemble_memory: int | str | None = None,
    probe_every: int | None = None,
    noise_scale_every: int | None = None,
    executor: str = "local",
    scheduler: str | None = None,
    retries: int = 2,
) -> dict[str, dict[str, Path]]:
    """Run every run of ``preset`` (a packaged name or a TOML path) not yet in the store, then
    analyse each of its studies and write its report under ``out``.

    Args:
        preset: ``smoke``, ``fashion``, ``paper``, or a path to a TOML preset.
        out: report folder (one sub-folder per study when the preset has several).
        data_dir: folder holding the dataset files (default: each loader's own search path).
        workers: worker processes (default: the usable CPUs).
        db: results store (default ``out/results.sqlite``); re-running resumes it.
        seeds, batch_sizes, methods: replace the preset's grid axes (methods: only those of each
            study's kind).
        settings: run settings applied to every run (``--set KEY=VALUE``; a grid axis is replaced).
        calibration_sims: simulated studies per planted effect for the report's calibration (0: none).
        stack: train the runs that can share one as a stacked ensemble (False: one at a time).
        ensemble_memory: memory budget of one ensemble, bytes or a size such as "2GiB" (default: the
            preset's [sweep] ensemble_memory, else
            :data:`~affdiv.experiments.runs.ensembles.DEFAULT_ENSEMBLE_MEMORY`, 2 GiB).
        probe_every: measure every run with the divergence meter
            (:mod:`affdiv.experiments.runs.divergence_measurement`) at step 0 and every
            ``probe_every`` steps; kept in the store, its columns join the records.
        noise_scale_every: measure every run's gradient noise scale B_simple = tr(Σ)/|G|²
            (:mod:`affdiv.experiments.runs.noise_scale`) at step 0 and every
            ``noise_scale_every`` steps; its columns ``b_simple_init``/``b_simple`` join the
            records, and the critical-batch table shows them beside B_crit.
            Either interval, when None, is the preset's [measure] one (absent: not measured).
            Measurements are not part of a run's key: resuming a store whose runs were measured
            otherwise is refused (:func:`check_measurement_resume`), and the provenance records
            both intervals.
        executor: ``"local"`` (worker processes here) or ``"dask"`` (tasks on a Dask scheduler;
            :mod:`affdiv.experiments.runs.dask_executor`).
        scheduler: the Dask scheduler's address (default: a LocalCluster of ``workers`` processes).
        retries: retries of a unit whose worker died (dask: also of one that raised).
            The dask executor then records its runs as failed and goes on; the report lists them.

    Returns:
        ``{study name: {file kind: path}}`` of the written reports.
    """
    if executor == "dask" and scheduler is not None:
        # First, before the heavy imports: a scheduler that does not answer is told within its deadline.
        from affdiv.experiments.runs.dask_executor import check_scheduler

        check_scheduler(scheduler)
    from affdiv.experiments.runs.config import METHODS, config_hash
    from affdiv.experiments.runs.ensembles import DEFAULT_ENSEMBLE_MEMORY, parse_memory
    from affdiv.experiments.runs.presets import MEASURE, check_every, load_preset
    from affdiv.experiments.runs.store import ResultStore, data_key, identify, raw_key
    from affdiv.experiments.runs.sweep import check_executor, dataset_for, run_sweep
    from affdiv.experiments.runs.training import steps_per_epoch

    started = time.monotonic()
    # Every setting and output path is checked before the first run trains, and the store is
    # created only then: a refused sweep leaves no results database behind.
    _check_calibration_sims(calibration_sims)
    given = {"noise_scale_every": noise_scale_every, "probe_every": probe_every}
    for key, value in given.items():
        check_every(MEASURE[key][0], value)
    check_executor(executor, scheduler, retries)
    memory_given = None if ensemble_memory is None else parse_memory(ensemble_memory)
    if workers is not None:
        check_int("workers", workers)
    preset_ = load_preset(preset)
    ensemble_memory = memory_given if memory_given is not None else preset_.ensemble_memory
    if ensemble_memory is None:
        ensemble_memory = DEFAULT_ENSEMBLE_MEMORY
    intervals = {key: preset_.measure.get(key) if value is None else value for key, value in given.items()}
    origin = {key: f"preset {preset_.name!r} [measure]" for key in preset_.measure if given.get(key) is None}
    _check_finite(settings or {}, "--set ")
    for block in [preset_.raw, *preset_.raw.get("study", [])]:
        for table in ("run", "grid"):
            _check_finite(block.get(table, {}), f"preset {preset_.name!r} [{table}] ")
    for method, table in preset_.raw.get("method", {}).items():
        _check_finite(table, f"preset {preset_.name!r} [method.{method}] ")
    try:
        studies = preset_.studies(seeds=seeds, batch_sizes=batch_sizes, methods=methods, run=dict(settings or {}))
    except TypeError as error:  # a setting of the wrong type (e.g. base_lr = "fast") met a comparison
        raise ValueError(f"preset {preset_.name!r}: a run setting has the wrong type ({error})") from None
    for study in studies:
        for config in study.configs:
            check_run_config(config)
    configs = {config_hash(c.to_dict()): c for study in studies for c in study.configs}
    for device in sorted({c.device for c in configs.values()}):
        _check_device(device)
    for study in studies:
        where = f"preset {preset_.name!r} [analysis] of study {study.name!r}"
        check_settings(study.analysis, methods=sorted({*METHODS, *(c.method for c in study.configs)}), where=where)
        check_study_analysis(study.configs, study.analysis, where=where)

    out = Path(out)
    db = Path(db) if db else out / "results.sqlite"
    out_dirs = [out if len(studies) == 1 else out / study.name for study in studies]
    check_no_overwrite({"db": db}, out_dirs)
    for folder in out_dirs:
        check_writable_folder(folder, "out")
    try:
        existing = identify(db) in ("affdiv", "legacy")
    except (ValueError, IsADirectoryError) as error:
        raise type(error)(_option_named("db", error)) from None
    check_writable_file(db, "db")

    # Bad batch sizes, bad data options and missing data files are reported before any training
    # starts; so is data that differs from the data of the runs the store already holds.
    fingerprints: dict[str, set[str]] = {}
    expected: dict[str, str] = {}
    expected_raw: dict[str, str] = {}
    for config in configs.values():
        data = dataset_for(config, data_dir)
        fingerprints.setdefault(config.dataset, set()).add(str(data.fingerprint))
        expected[data_key(config.to_dict())] = str(data.fingerprint)
        expected_raw[raw_key(config.to_dict())] = str(data.config["raw_sha256"])
        steps_per_epoch(config, len(data.train.y))
    if existing:
        try:
            with ResultStore(db, read_only=True) as store:
                store.verify()
                store.check_fingerprints(expected)
                store.check_raw_data(expected_raw)
                check_measurement_resume(store, list(configs), intervals, origin)
        except ValueError as error:
            raise ValueError(_option_named("db", error)) from None

    measurements = [MEASURE[key][1].measurement(every=every) for key, every in intervals.items() if every is not None]
    print(f"affdiv falsify: preset {preset_.name}: {len(configs)} runs -> {db}", file=sys.stderr)
    written = {}
    try:
        writer = ResultStore(db)  # the writer's lock: a second sweep on this store stops here
    except ValueError as error:
        raise type(error)(_option_named("db", error)) from None
    with writer as store:
        outcome = run_sweep(list(configs.values()), store, data_dir=data_dir, workers=workers, stack=stack,
                            ensemble_memory=ensemble_memory, measurements=measurements, executor=executor,
                            scheduler=scheduler, retries=retries,
                            progress=sys.stderr)  # as it is now (run_sweep's default is bound at its import)
        if outcome.failed:
            print(f"affdiv falsify: {len(outcome.failed)} run(s) failed on every attempt; the report lists them and "
                  "leaves them out (the same command tries them again)", file=sys.stderr)
        for study in studies:
            # The metric follows the budget unless the preset names one: steps under "target".
            analysis_settings = AnalysisSettings.from_mapping({"metric": study_metric(study.configs), **study.analysis})
            metric = analysis_settings.metric
            hashes = sorted(config_hash(c.to_dict()) for c in study.configs)
            records = store.records(hashes, metric=metric)
            study_out = out if len(studies) == 1 else out / study.name
            record = provenance(
                preset=preset_.name,
                preset_settings=preset_.raw,
                study=study.name,
                metric=metric,
                config_hash=hashlib.sha256("".join(hashes).encode()).hexdigest(),
                runs=len(hashes),
                seeds=sorted({c.seed for c in study.configs}),
                data_fingerprint={c.dataset: sorted(fingerprints[c.dataset]) for c in study.configs},
                results_db=relative_path(Path(db).resolve(), study_out),
                hardware=_hardware(outcome, {c.device for c in study.configs}),
                wall_time_s=round(time.monotonic() - started, 1),
                compute_time_s=round(store.seconds(hashes), 1),
                runs_this_invocation=outcome.ran,
                runs_resumed_from_db=outcome.skipped,
                run_code=code_versions(store, hashes),
                # how this invocation trained its runs (resumed runs may have trained otherwise)
                this_invocation={"stack": stack, "ensemble_memory": ensemble_memory if stack else None},
                **intervals,
                failed_runs=[{k: f[k] for k in ("config_hash", "error", "kind", "attempts")}
                             | {k: f["config"].get(k) for k in ("method", "batch_size", "seed", "lr_rule")}
                             for f in store.failures(hashes)],
            )
            written[study.name] = analyse_and_report(
                study_out, records, store.curves(hashes), analysis_settings, record, calibration_sims,
                progress=_progress(started) if len(records) >= PROGRESS_FROM else None,
            )
    return written


def default_metric(budgets: set[str], *, database: bool, where: str) -> str:
    """The metric ``affdiv analyse`` takes when none is given: ``steps_to_target`` when every
    record is of a ``budget = "target"`` run, else ``test_accuracy`` of a store or the column
    ``metric`` of a CSV. Records of target runs mixed with others raise ValueError asking for
    ``--metric``."""
    if budgets == {"target"}:
        return TARGET_METRIC
    if "target" in budgets:
        others = sorted(b or "(empty)" for b in budgets - {"target"})
        raise ValueError(f"{where}: records of budget 'target' mixed with budget(s) {others}; pass --metric (e.g. "
                         f"{TARGET_METRIC} or {'test_accuracy' if database else 'metric'}) to choose what to analyse")
    return "test_accuracy" if database else "metric"


def _read_store(path: Path, metric: str | None) -> tuple[list[dict], list[dict], str, dict]:
    """(records, curves, metric, provenance extras) of a results store, opened read-only: the code
    that trained the runs and the data they were trained on, as the store recorded them."""
    from affdiv.experiments.runs.store import ResultStore, data_key

    try:
        with ResultStore(path, read_only=True) as store:
            if metric is None:
                metric = default_metric(store.budgets(), database=True, where=f"input {path}")
            records, curves = store.records(metric=metric), store.curves()
            extra = {"run_code": code_versions(store)}
    except (ValueError, IsADirectoryError) as error:
        raise ValueError(_option_named("input", error)) from None
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

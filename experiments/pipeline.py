"""The whole study: run (or resume) a preset's sweep, analyse it, calibrate the tests in its
layout, and write the report. ``affdiv falsify`` and ``affdiv analyse`` call these functions."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from affdiv.experiments.analysis.calibration import calibrate_for
from affdiv.experiments.analysis.decision import analyse
from affdiv.experiments.analysis.groups import label_groups
from affdiv.experiments.records import read_csv
from affdiv.experiments.report.writer import write_report
from affdiv.experiments.runs.config import config_hash
from affdiv.experiments.runs.presets import load_preset
from affdiv.experiments.runs.store import ResultStore, is_sqlite
from affdiv.experiments.runs.sweep import available_cpus, dataset_for, run_sweep
from affdiv.experiments.runs.training import steps_per_epoch
from affdiv.provenance import provenance


def _check_calibration_sims(n: int) -> None:
    if n < 0:
        raise ValueError(f"--calibration-sims must be >= 0, got {n}")


def analyse_and_report(out: Path, records: list[dict], curves, settings: Mapping, provenance: Mapping,
                       calibration_sims: int) -> dict[str, Path]:
    """``analyse`` by the groups of ``label_groups``, calibrate the tests in that layout, and
    ``write_report``; returns the written paths."""
    _check_calibration_sims(calibration_sims)
    group_by = label_groups(records)
    if curves:
        label_groups(curves)
    analysis = analyse(records, group_by=group_by, **settings)
    calibration = None
    if calibration_sims:
        print(f"calibrating the tests ({calibration_sims} simulated studies per planted slope) ...", file=sys.stderr)
        try:
            calibration = calibrate_for(analysis, n_sims=calibration_sims)
        except ValueError as error:  # the sweep's layout cannot be simulated (< 3 batch sizes, no fit)
            print(f"calibration left out of the report: {error}", file=sys.stderr)
    return write_report(
        out, analysis, records=records, curves=curves, provenance=provenance, calibration=calibration
    )


def _hardware(outcome, devices: set[str]) -> dict:
    import torch

    info = {"usable_cpus": available_cpus(), "workers": outcome.workers, "threads_per_worker": outcome.threads,
            "devices": sorted(devices)}
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
        calibration_sims: simulated studies per planted slope for the report's calibration (0: none).

    Returns:
        ``{study name: {file kind: path}}`` of the written reports.
    """
    started = time.monotonic()
    _check_calibration_sims(calibration_sims)
    preset_ = load_preset(preset)
    studies = preset_.studies(seeds=seeds, batch_sizes=batch_sizes, methods=methods, run=dict(settings or {}))
    configs = {config_hash(c.to_dict()): c for study in studies for c in study.configs}

    # Bad batch sizes and missing data files are reported before any training starts.
    fingerprints: dict[str, set[str]] = {}
    for config in configs.values():
        data = dataset_for(config, data_dir)
        fingerprints.setdefault(config.dataset, set()).add(str(data.fingerprint))
        steps_per_epoch(config, len(data.train.y))

    out = Path(out)
    db = Path(db) if db else out / "results.sqlite"
    print(f"affdiv falsify: preset {preset_.name}: {len(configs)} runs -> {db}", file=sys.stderr)
    written = {}
    with ResultStore(db) as store:
        outcome = run_sweep(list(configs.values()), store, data_dir=data_dir, workers=workers)
        for study in studies:
            analysis_settings = {"metric": "test_accuracy", **study.analysis}
            metric = analysis_settings["metric"]
            hashes = sorted(config_hash(c.to_dict()) for c in study.configs)
            records = store.records(hashes, metric=metric)
            record = provenance(
                preset=preset_.name,
                preset_settings=preset_.raw,
                study=study.name,
                metric=metric,
                config_hash=hashlib.sha256("".join(hashes).encode()).hexdigest(),
                runs=len(hashes),
                seeds=sorted({c.seed for c in study.configs}),
                data_fingerprint={c.dataset: sorted(fingerprints[c.dataset]) for c in study.configs},
                results_db=str(db),
                hardware=_hardware(outcome, {c.device for c in study.configs}),
                wall_time_s=round(time.monotonic() - started, 1),
                compute_time_s=round(store.seconds(hashes), 1),
                runs_this_invocation=outcome.ran,
                runs_resumed_from_db=outcome.skipped,
            )
            study_out = out if len(studies) == 1 else out / study.name
            written[study.name] = analyse_and_report(
                study_out, records, store.curves(hashes), analysis_settings, record, calibration_sims
            )
    return written


def analyse_file(
    path: str | Path,
    out: str | Path,
    *,
    metric: str | None = None,
    higher_is_better: bool = True,
    corrected: Sequence[str] | None = None,
    baselines: Sequence[str] | None = None,
    margin: float | None = None,
    alpha: float = 0.05,
    calibration_sims: int = 500,
) -> dict[str, Path]:
    """Test the batch-size prediction on existing results: a record CSV (default metric column
    ``metric``) or a results store (default ``test_accuracy``); returns the written paths."""
    _check_calibration_sims(calibration_sims)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    database = is_sqlite(path)
    metric = metric or ("test_accuracy" if database else "metric")
    if database:
        with ResultStore(path) as store:
            records, curves = store.records(metric=metric), store.curves()
    else:
        records, curves = read_csv(path, metric=metric), None
    if not records:
        raise ValueError(f"--input {path}: no records")
    settings = {"metric": metric, "higher_is_better": higher_is_better, "alpha": alpha, "margin": margin}
    if corrected:
        settings["corrected"] = tuple(corrected)
    if baselines:
        settings["baselines"] = tuple(baselines)
    record = provenance(input=str(path), input_sha256=hashlib.sha256(path.read_bytes()).hexdigest(), metric=metric)
    return analyse_and_report(Path(out), records, curves, settings, record, calibration_sims)

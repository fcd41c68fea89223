"""``affdiv falsify`` (run or resume a preset's sweep, then report) and ``affdiv analyse``."""

from __future__ import annotations

import hashlib
import sys
import time
import tomllib
from pathlib import Path

from affdiv.experiments.store import ResultStore, config_hash, is_sqlite

# Config fields that never name a group: the grid's own axes, and the tuned rule's grid (implied
# by lr_rule).
_NOT_GROUPS = {"method", "batch_size", "seed"}


def register(subparsers) -> None:
    falsify = subparsers.add_parser(
        "falsify",
        help="run (or resume) a preset's sweep and write its falsification report",
        description="Run every run of a preset's grid that is not yet in the results database "
        "(re-running the same command resumes), then analyse and write the report.",
    )
    falsify.add_argument("--preset", required=True, help="smoke, fashion, paper, or a path to a TOML preset")
    falsify.add_argument("--out", required=True, type=Path, help="report folder")
    falsify.add_argument("--data-dir", help="folder holding the dataset files (Fashion-MNIST IDX, CIFAR-10 tarball)")
    falsify.add_argument("--workers", type=int, help="worker processes (default: the usable CPUs)")
    falsify.add_argument("--db", type=Path, help="results database (default: OUT/results.sqlite)")
    falsify.add_argument("--seeds", type=int, nargs="+", help="replace the preset's seeds")
    falsify.add_argument("--batch-sizes", type=int, nargs="+", help="replace the preset's batch sizes")
    falsify.add_argument(
        "--methods", nargs="+", help="run only these methods (each study keeps those of its kind, MLP or CNN)"
    )
    falsify.add_argument("--device", help="torch device of every run (cpu, cuda, cuda:1, ...)")
    falsify.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="set a run setting of every run, e.g. --set length=3 (VALUE is read as TOML; "
        "for a grid axis, a value or a list replaces the axis, e.g. --set \"lr_rule=['sqrt']\")",
    )
    _add_calibration_option(falsify)
    falsify.set_defaults(func=_guarded(falsify_command))

    analyse = subparsers.add_parser(
        "analyse",
        help="analyse a CSV (method, batch_size, seed, metric) or a results database",
        description="Test the batch-size prediction on existing results and write the report.",
    )
    analyse.add_argument("--input", required=True, type=Path, help="CSV file or results database")
    analyse.add_argument("--out", required=True, type=Path, help="report folder")
    analyse.add_argument(
        "--metric", help="the metric column (CSV default: metric; database default: test_accuracy)"
    )
    analyse.add_argument("--lower-is-better", action="store_true", help="the metric is a loss, not a score")
    analyse.add_argument("--corrected", nargs="+", help="methods the prediction is about")
    analyse.add_argument("--baselines", nargs="+", help="methods they are compared against")
    analyse.add_argument("--margin", type=float, help="equivalence margin of a flat slope (metric per doubling)")
    analyse.add_argument("--alpha", type=float, default=0.05)
    _add_calibration_option(analyse)
    analyse.set_defaults(func=_guarded(analyse_command))


def _add_calibration_option(parser) -> None:
    parser.add_argument(
        "--calibration-sims", type=int, default=500, metavar="N",
        help="simulated studies per planted slope for the report's calibration of the tests "
        "(in the sweep's own layout; default 500, 0 leaves the calibration out)",
    )


def _guarded(command):
    """Bad input (ValueError, KeyError, missing file) exits with status 2 and a one-line message."""

    def run(args) -> int:
        try:
            return command(args)
        except (ValueError, KeyError, FileNotFoundError) as error:
            print(f"affdiv {args.command}: error: {error}", file=sys.stderr)
            return 2

    return run


def _parse_settings(pairs: list[str]) -> dict:
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            settings[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            settings[key] = value  # a bare word: a string
    return settings


def label_groups(records: list[dict]) -> str:
    """Name each record's group; returns the column to analyse by.

    A group is the set of runs that differ only in method, batch size and seed. If only the LR
    rule varies that is ``lr_rule``; if other settings vary too (depth, width, activation, ...),
    each record gets a ``group`` label such as ``lr_rule=sqrt, depth=3, width=512``. A setting
    varies only if it does among the records that use it (``training.unused_settings``): the grid
    of the tuned rule, or the reference batch size of the scaling rules, names no group by itself.
    """
    from affdiv.experiments.training import RunConfig, unused_settings

    fields = [f for f in RunConfig.__dataclass_fields__ if f not in _NOT_GROUPS]
    unused = [unused_settings(r) for r in records]
    varying = [f for f in fields if len({repr(r.get(f)) for r, idle in zip(records, unused) if f not in idle}) > 1]
    if not varying or varying == ["lr_rule"]:
        return "lr_rule"
    varying = ["lr_rule", *[f for f in varying if f != "lr_rule"]]
    for record, idle in zip(records, unused):
        record["group"] = ", ".join(f"{f}={record.get(f)}" for f in varying if f not in idle)
    return "group"


def _analyse_and_report(
    out: Path, records: list[dict], curves, settings: dict, provenance: dict, calibration_sims: int
) -> dict:
    """``analyse`` by the groups of ``label_groups``, calibrate the tests in that layout, and
    ``write_report``; returns the written paths."""
    from affdiv.experiments.analysis import analyse
    from affdiv.experiments.calibration import calibrate_for
    from affdiv.experiments.report import write_report

    if calibration_sims < 0:
        raise ValueError(f"--calibration-sims must be >= 0, got {calibration_sims}")
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


def _hardware(outcome, device: set[str]) -> dict:
    import torch

    from affdiv.experiments.sweep import available_cpus

    info = {"usable_cpus": available_cpus(), "workers": outcome.workers, "threads_per_worker": outcome.threads,
            "devices": sorted(device)}
    if torch.cuda.is_available() and any(d.startswith("cuda") for d in device):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def falsify_command(args) -> int:
    from affdiv.experiments.presets import load_preset
    from affdiv.experiments.sweep import dataset_for, run_sweep
    from affdiv.experiments.training import steps_per_epoch
    from affdiv.provenance import provenance

    started = time.monotonic()
    preset = load_preset(args.preset)
    run = _parse_settings(args.set)
    if args.device:
        run["device"] = args.device
    studies = preset.studies(seeds=args.seeds, batch_sizes=args.batch_sizes, methods=args.methods, run=run)
    configs = {config_hash(c.to_dict()): c for study in studies for c in study.configs}

    # Bad batch sizes and missing data files are reported before any training starts.
    fingerprints: dict[str, set[str]] = {}
    for config in configs.values():
        data = dataset_for(config, args.data_dir)
        fingerprints.setdefault(config.dataset, set()).add(str(data.fingerprint))
        steps_per_epoch(config, len(data.train.y))

    out = Path(args.out)
    db = args.db or out / "results.sqlite"
    print(f"affdiv falsify: preset {preset.name}: {len(configs)} runs -> {db}", file=sys.stderr)
    with ResultStore(db) as store:
        outcome = run_sweep(list(configs.values()), store, data_dir=args.data_dir, workers=args.workers)
        written = {}
        for study in studies:
            settings = {"metric": "test_accuracy", **study.analysis}
            metric = settings["metric"]
            hashes = sorted(config_hash(c.to_dict()) for c in study.configs)
            records = store.records(hashes, metric=metric)
            study_out = out if len(studies) == 1 else out / study.name
            record = provenance(
                preset=preset.name,
                preset_settings=preset.raw,
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
            paths = _analyse_and_report(
                study_out, records, store.curves(hashes), settings, record, args.calibration_sims
            )
            written[study.name] = paths
    for name, paths in written.items():
        for kind, path in sorted(paths.items()):
            print(f"{name}: {kind}: {path}")
    return 0


def analyse_command(args) -> int:
    from affdiv.experiments.analysis import read_csv
    from affdiv.provenance import provenance

    path = Path(args.input)
    if not path.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    database = is_sqlite(path)
    metric = args.metric or ("test_accuracy" if database else "metric")
    if database:
        with ResultStore(path) as store:
            records, curves = store.records(metric=metric), store.curves()
    else:
        records, curves = read_csv(path, metric=metric), None
    if not records:
        raise ValueError(f"--input {path}: no records")
    settings = {"metric": metric, "higher_is_better": not args.lower_is_better, "alpha": args.alpha,
                "margin": args.margin}
    if args.corrected:
        settings["corrected"] = tuple(args.corrected)
    if args.baselines:
        settings["baselines"] = tuple(args.baselines)
    record = provenance(input=str(path), input_sha256=hashlib.sha256(path.read_bytes()).hexdigest(), metric=metric)
    paths = _analyse_and_report(Path(args.out), records, curves, settings, record, args.calibration_sims)
    for kind, path in sorted(paths.items()):
        print(f"{kind}: {path}")
    return 0

"""``affdiv falsify``, ``affdiv analyse`` and ``affdiv probe``: parsers, and commands that turn the
parsed options into calls of :mod:`affdiv.experiments.pipeline` and :mod:`affdiv.experiments.probe`.

Only argparse is imported here: the work (torch, numpy, matplotlib) is imported when a command
runs, so that ``affdiv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

COMMANDS = ("falsify", "analyse", "probe")


def register(subparsers) -> None:
    falsify = subparsers.add_parser(
        "falsify",
        help="run (or resume) a preset's sweep and write its falsification report",
        description="Run every run of a preset's grid that is not yet in the results database "
        "(re-running the same command resumes), then analyse and write the report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    falsify.add_argument("--preset", required=True, help="smoke, fashion, paper, or a path to a TOML preset")
    falsify.add_argument("--out", required=True, type=Path, help="report folder")
    falsify.add_argument("--data-dir", help="folder holding the dataset files (Fashion-MNIST IDX, CIFAR-10 tarball)")
    falsify.add_argument("--workers", type=int, help="worker processes (default: the usable CPUs)")
    falsify.add_argument("--db", type=Path, help="results database (default: OUT/results.sqlite)")
    _add_seed_options(falsify, seeds_help="replace the preset's seeds by K seeds from --seed")
    falsify.add_argument("--batch-sizes", type=int, nargs="+", help="replace the preset's batch sizes")
    falsify.add_argument(
        "--methods", nargs="+", help="run only these methods (each study keeps those of its kind, MLP or CNN)"
    )
    falsify.add_argument("--device", help="torch device of every run (cpu, cuda, cuda:1, ...)")
    falsify.add_argument("--stack", choices=("on", "off"), default="on",
                         help="train the runs that differ only in seed, data split and learning rate as one "
                         "vmapped ensemble (off: one run at a time)")
    falsify.add_argument("--ensemble-memory", default="2GiB", metavar="SIZE",
                         help="memory budget of one stacked ensemble (each worker trains one at a time), e.g. 512MiB")
    falsify.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="set a run setting of every run, e.g. --set length=3 (VALUE is read as TOML; "
        "for a grid axis, a value or a list replaces the axis, e.g. --set \"lr_rule=['sqrt']\")",
    )
    falsify.add_argument("--executor", choices=("local", "dask"), default="local",
                         help="where the runs train: local worker processes, or tasks on a Dask scheduler "
                         "(pip install 'affdiv[dask]')")
    falsify.add_argument("--scheduler", metavar="ADDRESS",
                         help="with --executor dask: the scheduler's address, e.g. tcp://10.0.0.1:8786 (default: a "
                         "LocalCluster of --workers processes started here, loopback only)")
    falsify.add_argument("--retries", type=int, default=2, metavar="N",
                         help="retries of a unit whose worker died (dask: also of one that raised); then the local "
                         "executor stops, the dask executor records its runs as failed and goes on")
    falsify.add_argument("--probe-every", type=int, metavar="N",
                         help="measure every run with the divergence meter at step 0 and every N steps (kept in "
                         "the database; the records gain off_diagonal_share_init/_last, cosine_*, "
                         "diagonal_scale_cv_*); runs train one at a time")
    _add_calibration_option(falsify)
    falsify.set_defaults(func=falsify_command)

    analyse = subparsers.add_parser(
        "analyse",
        help="analyse a CSV (method, batch_size, seed, metric) or a results database",
        description="Test the batch-size prediction on existing results and write the report.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    analyse.add_argument("--input", required=True, type=Path, help="CSV file or results database")
    analyse.add_argument("--out", required=True, type=Path, help="report folder")
    analyse.add_argument(
        "--metric", help="the metric column (CSV default: metric; database default: test_accuracy)"
    )
    analyse.add_argument("--lower-is-better", action="store_true", help="the metric is a loss, not a score")
    analyse.add_argument("--corrected", nargs="+", help="methods the prediction is about")
    analyse.add_argument("--baselines", nargs="+", help="methods they are compared against")
    analyse.add_argument("--margin", type=float,
                         help="equivalence margin of a flat slope, metric per doubling (descriptive slope only)")
    analyse.add_argument("--contrast-margin", type=float,
                         help="equivalence margin of the primary contrasts, in metric units "
                         "(default: twice the slope margin)")
    analyse.add_argument("--alpha", type=float, default=0.05, help="level of every test")
    _add_calibration_option(analyse)
    analyse.set_defaults(func=analyse_command)

    from affdiv.experiments.probe import __doc__ as probe_doc  # stdlib-only at import: --help stays fast

    probe = subparsers.add_parser(
        "probe", help="measure the update alignment behind the batch-size prediction, per layer, on real data",
        description=probe_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    probe.add_argument("--model", required=True, metavar="NAME[,NAME...]",
                       help="built-in model(s) (affdiv.experiments.runs.zoo), 'all', or package.module:factory")
    probe.add_argument("--data", default="digits", help="digits, fashion-mnist, cifar10 or synthetic (default digits)")
    probe.add_argument("--data-dir", default=None, help="folder holding the dataset files")
    probe.add_argument("--batch-sizes", default="8,32,128,512", metavar="B,B,...",
                       help="comma-separated batch sizes (default 8,32,128,512)")
    probe.add_argument("--seeds", type=int, default=3, metavar="K", help="seeds (model inits) per model (default 3)")
    probe.add_argument("--seed", type=int, default=0, help="first seed; also the data split's (default 0)")
    probe.add_argument("--batches", type=int, default=2, help="random batches per seed and batch size (default 2)")
    probe.add_argument("--scope", choices=("layer", "network"), default="layer",
                       help="layer: only the module's own parameters step; network: all do (default layer)")
    probe.add_argument("--lr", type=float, default=0.1, help="step size η (the metrics do not depend on it)")
    probe.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="default float64")
    probe.add_argument("--no-per-sample", action="store_true",
                       help="batch-level metrics only (no diagonal scale, no off-diagonal share)")
    probe.add_argument("--masked-limit", type=int, default=128, metavar="B",
                       help="network scope: the largest batch whose diagonals may take the masked route (B "
                       "full-batch passes, for networks that couple samples such as BatchNorm; default 128)")
    probe.add_argument("--out", default="reports/probe", help="folder for probe.json, probe.md and the figures "
                       "(default reports/probe)")
    probe.set_defaults(func=probe_command)


def _add_seed_options(parser, *, seeds_help: str) -> None:
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, metavar="K", help=seeds_help)


def _add_calibration_option(parser) -> None:
    parser.add_argument(
        "--calibration-sims", type=int, default=500, metavar="N",
        help="simulated studies per planted effect for the report's calibration of the tests "
        "(in the sweep's own layout; 0 leaves the calibration out)",
    )


def parse_settings(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as a dict; VALUE is read as TOML, a bare word as a string."""
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


MAX_SEED = 2**64 - 1  # torch's seed range (affdiv.experiments.pipeline.MAX_SEED; not imported: --help stays fast)


def _seed_list(args) -> list[int] | None:
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be in [0, 2**64 - 1] (torch's seed range), got {args.seed}")
    if args.seeds is None:
        return None
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    if args.seed + args.seeds - 1 > MAX_SEED:
        raise ValueError(f"--seed {args.seed} --seeds {args.seeds} reaches seed {args.seed + args.seeds - 1}, "
                         "beyond torch's seed range [0, 2**64 - 1]")
    return list(range(args.seed, args.seed + args.seeds))


def _print_paths(paths: dict, prefix: str = "") -> None:
    for kind, path in sorted(paths.items()):
        print(f"{prefix}{kind}: {path}")


def falsify_command(args) -> int:
    from affdiv.experiments.pipeline import falsify

    settings = parse_settings(args.set)
    if args.device:
        settings["device"] = args.device
    written = falsify(
        args.preset, args.out, data_dir=args.data_dir, workers=args.workers, db=args.db, seeds=_seed_list(args),
        batch_sizes=args.batch_sizes, methods=args.methods, settings=settings,
        calibration_sims=args.calibration_sims, stack=args.stack == "on", ensemble_memory=args.ensemble_memory,
        probe_every=args.probe_every, executor=args.executor, scheduler=args.scheduler, retries=args.retries,
    )
    from affdiv.experiments.report.writer import verdict_table

    for name, paths in written.items():
        _print_paths(paths, f"{name}: ")
    for name, paths in written.items():  # the verdicts last, where a reader of the log looks first
        print(f"\n{name}:\n{verdict_table(json.loads(paths['summary_json'].read_text()))}")
    return 0


def analyse_command(args) -> int:
    from affdiv.experiments.pipeline import analyse_file

    _print_paths(analyse_file(
        args.input, args.out, metric=args.metric, higher_is_better=not args.lower_is_better,
        corrected=args.corrected, baselines=args.baselines, margin=args.margin,
        contrast_margin=args.contrast_margin, alpha=args.alpha, calibration_sims=args.calibration_sims,
    ))
    return 0


def probe_command(args) -> int:
    from affdiv.experiments.probe import probe

    _print_paths(probe(args.out, models=args.model, data=args.data, data_dir=args.data_dir,
                       batch_sizes=args.batch_sizes, seeds=args.seeds, seed=args.seed, batches=args.batches,
                       scope=args.scope, lr=args.lr, dtype=args.dtype, per_sample=not args.no_per_sample,
                       masked_limit=args.masked_limit))
    return 0

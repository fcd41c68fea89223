"""``affdiv falsify``, ``affdiv analyse`` and ``affdiv probe``: parsers, and commands that turn the
parsed options into calls of :mod:`affdiv.experiments.pipeline` and :mod:`affdiv.experiments.probe`.

Only argparse is imported here: the work (torch, numpy, matplotlib) is imported when a command
runs, so that ``affdiv --help`` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tomllib

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
    falsify.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="set a run setting of every run, e.g. --set length=3 (VALUE is read as TOML; "
        "for a grid axis, a value or a list replaces the axis, e.g. --set \"lr_rule=['sqrt']\")",
    )
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
    analyse.add_argument("--margin", type=float, help="equivalence margin of a flat slope (metric per doubling)")
    analyse.add_argument("--alpha", type=float, default=0.05, help="level of every test")
    _add_calibration_option(analyse)
    analyse.set_defaults(func=analyse_command)

    from affdiv.experiments.probe import __doc__ as probe_doc

    probe = subparsers.add_parser(
        "probe", help="measure the update alignment behind the batch-size prediction on real data",
        description=probe_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    probe.add_argument("--dataset", default="digits",
                       help="digits, fashion-mnist, cifar10 or synthetic (default digits)")
    probe.add_argument("--data-dir", default=None, help="folder holding the dataset files")
    probe.add_argument("--members", nargs="+", help="members of the affine family (default: all)")
    probe.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16, 64, 256],
                       help="batch sizes (default 1 4 16 64 256)")
    probe.add_argument("--repeats", type=int, default=5, help="random batches per member and size (default 5)")
    probe.add_argument("--seed", type=int, default=0, help="seed of the data split and the batches (default 0)")
    probe.add_argument("--out", default="reports/probe", help="folder for probe.json, probe.md, probe.png "
                       "(default reports/probe)")
    probe.set_defaults(func=probe_command)


def _add_seed_options(parser, *, seeds_help: str) -> None:
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, metavar="K", help=seeds_help)


def _add_calibration_option(parser) -> None:
    parser.add_argument(
        "--calibration-sims", type=int, default=500, metavar="N",
        help="simulated studies per planted slope for the report's calibration of the tests "
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


def _seed_list(args) -> list[int] | None:
    if args.seeds is None:
        return None
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
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
        calibration_sims=args.calibration_sims,
    )
    for name, paths in written.items():
        _print_paths(paths, f"{name}: ")
    return 0


def analyse_command(args) -> int:
    from affdiv.experiments.pipeline import analyse_file

    _print_paths(analyse_file(
        args.input, args.out, metric=args.metric, higher_is_better=not args.lower_is_better,
        corrected=args.corrected, baselines=args.baselines, margin=args.margin, alpha=args.alpha,
        calibration_sims=args.calibration_sims,
    ))
    return 0


def probe_command(args) -> int:
    from affdiv.experiments.probe import probe

    _print_paths(probe(args.out, dataset=args.dataset, data_dir=args.data_dir, members=args.members,
                       batch_sizes=args.batch_sizes, repeats=args.repeats, seed=args.seed))
    return 0

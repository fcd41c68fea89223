"""``affdiv falsify``, ``affdiv analyse``, ``affdiv probe`` and ``affdiv map``: parsers, and commands that turn the
parsed options into calls of :mod:`affdiv.experiments.pipeline` and :mod:`affdiv.experiments.probe`.

Only the standard library is imported here: the work (torch, numpy, matplotlib) is imported when
a command runs, so that ``affdiv --help`` stays fast. The commands build the library's values from
the options once (:func:`_study_overrides`, :func:`_sweep_options`) and say the library's
messages with the options that set each parameter (:func:`_in_flags`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import re
import tomllib
from pathlib import Path

from affdiv.vocabulary import DEFAULT_BASELINES, DEFAULT_CORRECTED

COMMANDS = ("falsify", "analyse", "probe", "map")


def register(subparsers) -> None:
    """Add ``falsify``, ``analyse``, ``probe`` and ``map`` to ``subparsers``."""
    _register_falsify(subparsers)
    _register_analyse(subparsers)
    _register_probe(subparsers)
    _register_map(subparsers)


def _register_falsify(subparsers) -> None:
    falsify = subparsers.add_parser(
        "falsify",
        help="run (or resume) a preset's sweep and write its falsification report",
        description="Run every run of a preset's grid that is not yet in the results database "
        "(re-running the same command resumes), then analyse and write the report.",
    )
    falsify.add_argument("--preset", required=True, metavar="NAME|PATH",
                         help="smoke, fashion-ladder, cnn-ladder, fashion-vit, fashion-target, fashion-steps, "
                         "fashion-cnn, fashion, paper, or a path to a TOML preset")
    falsify.add_argument("--out", required=True, type=Path, metavar="DIR", help="report folder")
    _add_data_dir_option(falsify)
    falsify.add_argument("--workers", type=int, metavar="N", help="worker processes (default: the usable CPUs)")
    falsify.add_argument("--db", type=Path, metavar="PATH", help="results database (default: OUT/results.sqlite)")
    _add_seed_options(falsify, seed_help="first seed of --seeds (default 0)",
                      seeds_help="K seeds counted from --seed, in place of the preset's (default: the preset's)")
    falsify.add_argument("--batch-sizes", type=int, nargs="+", metavar="B",
                         help="batch sizes, in place of the preset's (default: the preset's)")
    falsify.add_argument("--methods", nargs="+", metavar="M",
                         help="run only these methods; each study keeps those of its kind, MLP or CNN "
                         "(default: the preset's)")
    falsify.add_argument("--device", metavar="DEV",
                         help="torch device of every run: cpu, cuda, cuda:1, ... (default: the preset's, else cpu)")
    falsify.add_argument(
        "--set", action="append", default=[], dest="settings", metavar="KEY=VALUE",
        help="set a run setting of every run, e.g. --set length=3 (VALUE is read as TOML; "
        "for a grid axis, a value or a list replaces the axis, e.g. --set \"lr_rule=['sqrt']\"); "
        "repeatable (default: the preset's settings)",
    )
    _add_sweep_options(falsify)
    _add_calibration_option(falsify)
    falsify.set_defaults(func=falsify_command)


def _add_sweep_options(falsify) -> None:
    """The options of :class:`~affdiv.experiments.runs.options.SweepOptions` (how the runs train)."""
    falsify.add_argument("--stack", choices=("on", "off"), default="on", metavar="on|off",
                         help="train the runs that differ only in seed, data split and learning rate as one "
                         "vmapped ensemble; off: one run at a time (default on)")
    falsify.add_argument("--ensemble-memory", metavar="SIZE",
                         help="memory budget of one stacked ensemble (each worker trains one at a time), e.g. "
                         "512MiB (default: the preset's [sweep] ensemble_memory, else 2GiB)")
    falsify.add_argument("--executor", choices=("local", "dask"), default="local", metavar="local|dask",
                         help="where the runs train: local worker processes, or tasks on a Dask scheduler "
                         "(pip install 'affdiv[dask]'; default local)")
    falsify.add_argument("--scheduler", metavar="ADDRESS",
                         help="with --executor dask: the scheduler's address, e.g. tcp://10.0.0.1:8786 (default: a "
                         "LocalCluster of --workers processes started here, loopback only)")
    falsify.add_argument("--retries", type=int, default=2, metavar="N",
                         help="retries of a unit whose worker died (dask: also of one that raised); then the local "
                         "executor stops, the dask executor records its runs as failed and goes on (default 2)")
    falsify.add_argument("--probe-every", type=_integer, metavar="N",
                         help="measure every run with the divergence meter at step 0 and every N steps (kept in "
                         "the database; the records gain off_diagonal_share_init/_last, cosine_*, "
                         "diagonal_scale_cv_*; default: the preset's [measure] probe_every, else off)")
    falsify.add_argument("--noise-scale-every", type=_integer, metavar="N",
                         help="measure every run's gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. "
                         "2018; batches of 32 and 1024 from the training split, 8 draws) at step 0 and every N "
                         "steps (kept in the database; the records gain b_simple_init and b_simple, shown beside "
                         "the fitted B_crit; default: the preset's [measure] noise_scale_every, else off)")


def _register_analyse(subparsers) -> None:
    analyse = subparsers.add_parser(
        "analyse",
        help="analyse a CSV (method, batch_size, seed, metric) or a results database",
        description="Test the batch-size prediction on existing results and write the report.",
    )
    analyse.add_argument("--input", required=True, type=Path, metavar="PATH", help="CSV file or results database")
    analyse.add_argument("--out", required=True, type=Path, metavar="DIR", help="report folder")
    analyse.add_argument(
        "--metric", metavar="M",
        help="the metric column (default: steps_to_target when every record is of a budget = \"target\" run, "
        "else metric for a CSV and test_accuracy for a database; records of target and other budgets mixed "
        "need --metric)",
    )
    analyse.add_argument("--lower-is-better", action="store_true", help="the metric is a loss, not a score")
    analyse.add_argument("--corrected", nargs="+", metavar="M",
                         help="methods the prediction is about (default: " + " ".join(DEFAULT_CORRECTED) + ")")
    analyse.add_argument("--baselines", nargs="+", metavar="M",
                         help="methods they are compared against (default: " + " ".join(DEFAULT_BASELINES) + ")")
    analyse.add_argument("--margin", type=float, metavar="X",
                         help="equivalence margin of a flat slope, metric per doubling (descriptive slope only; "
                         "default: 0.005 for a score in [0, 1], else 1%% of the median |metric|)")
    analyse.add_argument("--contrast-margin", type=float, metavar="X",
                         help="equivalence margin of the primary contrasts, in metric units "
                         "(default: 0.01 for a score in [0, 1], else 2%% of the median |metric|)")
    analyse.add_argument("--alpha", type=float, default=0.05, metavar="A", help="level of every test (default 0.05)")
    analyse.add_argument("--primary-target", type=float, metavar="T",
                         help="steps to target along a ladder: the target whose verdict is the study's (default: the "
                         "preset's, as the runs of a store record it, else the highest target in the input)")
    _add_calibration_option(analyse)
    analyse.set_defaults(func=analyse_command)


def _register_probe(subparsers) -> None:
    probe_doc = ast.get_docstring(ast.parse(Path(__file__).with_name("probe.py").read_text(encoding="utf-8")))
    probe = subparsers.add_parser(
        "probe", help="measure the update alignment behind the batch-size prediction, per layer, on real data",
        description=probe_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    probe.add_argument("--model", required=True, metavar="NAME[,NAME...]",
                       help="built-in model(s) (affdiv.experiments.runs.zoo), 'all', path/to/file.py:factory or "
                       "package.module:factory; the factory is called as factory(input_shape=..., num_classes=...) "
                       "-> torch.nn.Module (see above)")
    probe.add_argument("--data", default="digits", metavar="NAME|PATH.npz",
                       help="digits, fashion-mnist, cifar10, synthetic, or an .npz file with x_train, y_train, "
                       "x_test, y_test (default digits)")
    probe.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                       metavar="cross_entropy|mse", help="the per-sample loss of the measured step (default "
                       "cross_entropy; mse: mean squared error to the target, one-hot where y holds labels)")
    _add_data_dir_option(probe)
    probe.add_argument("--batch-sizes", default="8,32,128,512", metavar="B,B,...",
                       help="comma-separated batch sizes (default 8,32,128,512)")
    probe.add_argument("--seeds", type=int, default=3, metavar="K", help="seeds (model inits) per model (default 3)")
    probe.add_argument("--seed", type=int, default=0, metavar="N",
                       help="first seed; also the data split's (default 0)")
    probe.add_argument("--batches", type=int, default=2, metavar="N",
                       help="random batches per seed and batch size (default 2)")
    probe.add_argument("--scope", choices=("layer", "network"), default="layer", metavar="layer|network",
                       help="layer: only the module's own parameters step; network: all do (default layer)")
    probe.add_argument("--lr", type=float, default=0.1, metavar="LR",
                       help="step size η (default 0.1; the metrics do not depend on it)")
    probe.add_argument("--dtype", choices=("float64", "float32"), default="float64", metavar="float64|float32",
                       help="floating-point type of the models and data (default float64)")
    probe.add_argument("--no-per-sample", action="store_true",
                       help="batch-level metrics only (no diagonal scale, no off-diagonal share)")
    probe.add_argument("--masked-limit", type=int, default=128, metavar="B",
                       help="network scope: the largest batch whose diagonals may take the masked route (B "
                       "full-batch passes, for networks that couple samples such as BatchNorm; default 128)")
    probe.add_argument("--out", default="reports/probe", metavar="DIR",
                       help="folder for probe.json, probe.md and the figures (default reports/probe)")
    probe.set_defaults(func=probe_command)


def _register_map(subparsers) -> None:
    verdicts = subparsers.add_parser(
        "map",
        help="the verdict map: every pair's B_crit ratio at every target of ladder studies",
        description="Tabulate, from the summary.json of steps-to-target studies along a target ladder, "
        "every corrected/baseline pair's B_crit ratio [95% CI] and class at every target (the primary "
        "target in bold) and the trend along the ladder, as Markdown.",
    )
    verdicts.add_argument("studies", nargs="+", type=Path, metavar="STUDY",
                          help="study folders (each with the summary.json of `affdiv falsify` or `affdiv analyse`), "
                          "in row order")
    verdicts.add_argument("--into", type=Path, metavar="FILE",
                          help="write the map between the verdict-map marker lines of this Markdown file "
                          "(default: print it)")
    verdicts.set_defaults(func=map_command)


def _integer(text: str) -> int | str:
    """``text`` as an int where it is one, else unchanged: the command refuses it in one line."""
    try:
        return int(text)
    except ValueError:
        return text


def _add_seed_options(parser, *, seed_help: str, seeds_help: str) -> None:
    parser.add_argument("--seed", type=int, default=0, metavar="N", help=seed_help)
    parser.add_argument("--seeds", type=int, metavar="K", help=seeds_help)


def _add_data_dir_option(parser) -> None:
    parser.add_argument("--data-dir", metavar="D",
                        help="folder holding the dataset files: Fashion-MNIST IDX files, the CIFAR-10 tarball "
                        "(default: $FASHION_MNIST_DIR / $CIFAR10_DIR, else Fashion-MNIST's standard location "
                        "/usr/share/datasets/fashion-mnist)")


def _add_calibration_option(parser) -> None:
    parser.add_argument(
        "--calibration-sims", type=int, default=500, metavar="N",
        help="simulated studies per planted effect for the report's calibration of the tests "
        "(in the sweep's own layout; 0 leaves the calibration out; default 500)",
    )


def parse_settings(pairs: list[str]) -> dict:
    """``--set KEY=VALUE`` pairs as a dict; VALUE is read as one TOML value, a bare word as a
    string. A pair with a line break is refused: its second line would be another setting."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        if "\n" in pair or "\r" in pair:
            raise ValueError(f"--set takes one KEY=VALUE without a line break, got {pair!r}; give each setting its "
                             "own --set")
        try:
            settings[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            settings[key] = value  # a bare word: a string
    return settings


def _seed_list(args) -> list[int] | None:
    from affdiv.experiments.runs.config import MAX_SEED

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
    from affdiv.atomic import cleanup_on_error
    from affdiv.experiments.pipeline import falsify

    overrides, options = _study_overrides(args), _sweep_options(args)
    with cleanup_on_error(args.out, *([args.db.parent] if args.db else [])), _in_flags("falsify"):
        written = falsify(args.preset, args.out, db=args.db, data_dir=args.data_dir, overrides=overrides,
                          options=options, calibration_sims=args.calibration_sims)  # a refused sweep leaves no folder
    from affdiv.experiments.report.writer import verdict_table

    for name, paths in written.items():
        _print_paths(paths, f"{name}: ")
    for name, paths in written.items():  # the verdicts last, where a reader of the log looks first
        print(f"\n{name}:\n{verdict_table(json.loads(paths['summary_json'].read_text()))}")
    return 0


def _study_overrides(args):
    """The study options of ``affdiv falsify`` as :class:`~affdiv.experiments.plan.StudyOverrides`."""
    from affdiv.experiments.plan import StudyOverrides

    settings = parse_settings(args.settings)
    if args.device:
        settings["device"] = args.device
    return StudyOverrides(seeds=_seed_list(args), batch_sizes=args.batch_sizes, methods=args.methods,
                          settings=settings)


def _sweep_options(args):
    """The sweep options of ``affdiv falsify`` as :class:`~affdiv.experiments.runs.options.SweepOptions`
    (its ``dask`` with ``--executor dask``)."""
    from affdiv.experiments.runs.options import DaskOptions, SweepOptions

    if args.scheduler is not None and args.executor != "dask":
        raise ValueError(f"--scheduler {args.scheduler} needs executor 'dask' (the local executor has no scheduler)")
    dask = DaskOptions(scheduler=args.scheduler) if args.executor == "dask" else None
    return SweepOptions(workers=args.workers, stack=args.stack == "on", ensemble_memory=args.ensemble_memory,
                        probe_every=args.probe_every, noise_scale_every=args.noise_scale_every, retries=args.retries,
                        dask=dask)


#: Parameters the library names in the middle of a message, as each command's options set them (a
#: name that leads a message is the root cli's ``flag_named``'s): {command: ((pattern, replacement), ...)}.
_IN_FLAGS = {
    "falsify": ((re.compile(r"^device ('(?:[^'\\]|\\.)*'|\S+): not a torch device"),
                 r"device \1 (--device or --set device=...): not a torch device"),
                (re.compile(r"; use device 'cpu'"), "; use --device cpu"),
                (re.compile(r"\b(with|without) (probe|noise_scale)_every\b"),
                 lambda match: f"{match.group(1)} --{match.group(2).replace('_', '-')}-every")),
    "analyse": ((re.compile(r"; name the metric \("), "; pass --metric ("),),
}


@contextlib.contextmanager
def _in_flags(command: str):
    """Within the block, a ValueError's message is said in ``command``'s options (:data:`_IN_FLAGS`)."""
    try:
        yield
    except ValueError as error:
        if isinstance(error, UnicodeError) or not error.args or not isinstance(error.args[0], str):
            raise  # (a UnicodeError's first argument is its encoding)
        message = error.args[0]
        for pattern, replacement in _IN_FLAGS[command]:
            message = pattern.sub(replacement, message)
        error.args = (message, *error.args[1:])
        raise


def analyse_command(args) -> int:
    from affdiv.atomic import cleanup_on_error
    from affdiv.experiments.analysis.settings import AnalysisSettings
    from affdiv.experiments.pipeline import analyse_file

    given = {"metric": args.metric, "higher_is_better": not args.lower_is_better, "corrected": args.corrected,
             "baselines": args.baselines, "margin": args.margin, "contrast_margin": args.contrast_margin,
             "alpha": args.alpha, "primary_target": args.primary_target}
    settings = AnalysisSettings.from_mapping({key: value for key, value in given.items() if value is not None})
    with cleanup_on_error(args.out), _in_flags("analyse"):
        written = analyse_file(args.input, args.out, settings, calibration_sims=args.calibration_sims)
    _print_paths(written)
    return 0


def probe_command(args) -> int:
    from affdiv.atomic import cleanup_on_error
    from affdiv.experiments.probe import ProbeOptions, probe

    with cleanup_on_error(args.out):
        options = ProbeOptions(batch_sizes=args.batch_sizes, seeds=args.seeds, seed=args.seed, batches=args.batches,
                               scope=args.scope, lr=args.lr, dtype=args.dtype, per_sample=not args.no_per_sample,
                               masked_limit=args.masked_limit, loss=args.loss)
        written = probe(args.out, models=args.model, data=args.data, data_dir=args.data_dir, options=options)
    _print_paths(written)
    return 0


def map_command(args) -> int:
    from affdiv.experiments.report.verdict_map import read_study, verdict_map, write_into

    studies = [(folder, read_study(folder)) for folder in args.studies]
    if args.into is None:
        print(verdict_map(studies), end="")
    else:
        write_into(args.into, verdict_map(studies, relative_to=args.into.parent))
        print(f"verdict map: {args.into}")
    return 0

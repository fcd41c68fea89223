"""Sweep presets: TOML files naming the runs of a falsification study and how to analyse them.

A preset has three tables that apply to every study, and optionally a list of studies that
override them (one report each):

    description = "..."
    caveats = ["...", ...]   what the study cannot tell (printed at the top of its report)
    [run]        settings shared by every run (any ``RunConfig`` field: dataset, depth, budget, ...);
                 ``data_seed = "seed"`` gives every run the data split of its own seed (each seed
                 then replicates the split as well as the init and the shuffles)
    [grid]       axes: lists of values, crossed (method, batch_size, seed, lr_rule, ...)
    [analysis]   metric, corrected, baselines, margin, ... (the fields of ``AnalysisSettings``)
    [measure]    optional, for every study: measurements taken along every run, each an interval
                 in steps (an integer >= 1; absent: not measured), as ``affdiv falsify``'s options:
                   noise_scale_every = N   the gradient noise scale B_simple (``--noise-scale-every``)
                   probe_every = N         the divergence meter (``--probe-every``)
                 Like those options, measurements are not part of a run's key (config hash).
    [method.NAME] optional: run settings for the runs of method NAME only (e.g. a learning-rate
                 grid for a layer whose learning rates are larger), or ``model = "SPEC"``: a
                 method of one's own, its network built by a factory
                 (:mod:`~affdiv.experiments.runs.factories`); a name with "+" is quoted:
                 [method."conv+batchnorm"]. Not grid axes, not ``method``, ``seed``, ``batch_size``
                 or ``data_seed``. Precedence: [run] < [method.NAME] < [study.run] < ``--set``.
                 The analysis compares the method with the others only if the table sets just
                 its step size (``analysis/groups.py``: base_lr, ref_batch_size, momentum and
                 their search); any other setting puts the method in an analysis group of its own.
    [sweep]      optional: how the runs are trained, as ``affdiv falsify``'s option of the same name
                 (which overrides it); not part of a run's key:
                   ensemble_memory = "64MiB"  memory budget of one stacked ensemble
                                              (``--ensemble-memory``); a small budget makes each run
                                              its own unit of work, so that a stopped sweep loses at
                                              most the runs in flight
    [[study]]    name = "...", and its own [study.run] / [study.grid] / [study.analysis]

Command-line overrides replace grid axes (``seed``, ``batch_size``), restrict ``method`` to the
named methods of the right kind (MLP, CNN or ViT) per study, and set run fields (``--set k=v``; when
k is a grid axis, v, or the list v, replaces the axis).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from affdiv.checks import check_choice, check_int, is_int
from affdiv.experiments.runs import divergence_measurement, noise_scale
from affdiv.experiments.runs.config import METHODS, RunConfig, architecture, expand_grid, run_order
from affdiv.experiments.runs.options import parse_memory

_SECTIONS = {"description", "caveats", "run", "grid", "analysis", "measure", "method", "sweep", "study"}
#: ``data_seed = SEED`` in a preset's run settings: every run's data split is drawn from its own seed.
SEED = "seed"
#: The keys of a preset's [measure] table (also the intervals of ``SweepOptions``,
#: :data:`~affdiv.experiments.runs.options.INTERVALS`): the module of each one's measurement (its
#: ``NAME`` in the store, its ``measurement(every=N)``).
MEASURE = {"noise_scale_every": noise_scale, "probe_every": divergence_measurement}
#: Settings a [method.NAME] table may not set: a run's identity and its replication, and what the
#: harness records itself.
_SAME_FOR_EVERY_METHOD = ("method", "seed", "batch_size", "data_seed", "model_digest")

#: The keys of a preset's [sweep] table.
SWEEP = ("ensemble_memory",)


def _kind(method: str) -> tuple[str, str]:
    """What ``--methods`` matches a study by: a built-in method's architecture; a method of one's
    own (a [method.NAME] model) is a kind of its own."""
    return ("built-in", architecture(method)) if method in METHODS else ("own", method)


def check_every(setting: str, value) -> None:
    """Refuse a measurement interval (``setting`` names it) that is neither None nor an integer >= 1."""
    if value is not None:
        check_int(setting, value)


def available_presets() -> list[str]:
    folder = resources.files("affdiv.experiments.runs") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


@dataclass
class Study:
    """One analysed family of runs: its configs and its ``[analysis]`` table (``AnalysisSettings`` keys)."""

    name: str
    configs: list[RunConfig]
    analysis: dict = field(default_factory=dict)


@dataclass
class Preset:
    name: str
    description: str
    raw: dict  # the parsed TOML, recorded in provenance
    ensemble_memory: int | None = None  # the [sweep] table's budget in bytes; None when it sets none

    @property
    def measure(self) -> dict:
        """The [measure] table: {key of ``MEASURE``: interval in steps} (checked at load)."""
        return dict(self.raw.get("measure", {}))

    def studies(
        self,
        *,
        seeds: list[int] | None = None,
        batch_sizes: list[int] | None = None,
        methods: list[str] | None = None,
        run: dict | None = None,
    ) -> list[Study]:
        """The studies of this preset after command-line overrides (see module docstring)."""
        own = {m for m, table in self.raw.get("method", {}).items() if "model" in table}
        for method in methods or ():
            if method not in own:
                check_choice("method", method, (*METHODS, *sorted(own)))
        for size in batch_sizes or ():
            if not is_int(size, 1):
                raise ValueError(f"batch sizes must be integers >= 1, got {size!r}")
        blocks = self.raw.get("study") or [{"name": self.name}]
        studies = []
        for block in blocks:
            grid = {**self.raw.get("grid", {}), **block.get("grid", {})}
            if seeds:
                grid["seed"] = list(seeds)
            if batch_sizes:
                grid["batch_size"] = list(batch_sizes)
            if methods:
                kinds = {_kind(m) for m in grid.get("method", [])}
                grid["method"] = [m for m in methods if _kind(m) in kinds]
                if not grid["method"]:
                    continue  # none of the requested methods belongs to this study
            for key, value in (run or {}).items():
                if key in grid:  # a setting that is a grid axis replaces the axis
                    grid[key] = list(value) if isinstance(value, list) else [value]
            base = {**self.raw.get("run", {}), **block.get("run", {}), **(run or {})}
            base = {k: v for k, v in base.items() if k not in grid}
            split_per_seed = base.get("data_seed") == SEED
            if split_per_seed:
                del base["data_seed"]
            try:
                keep = set(block.get("run", {})) | set(run or {})
                configs = self._with_model_digests(self._expand(base, grid, keep=keep))
            except ValueError as error:
                message = str(error)
                raise ValueError(message if message.startswith("preset ") else f"preset {self.name!r}: {message}") \
                    from None
            if split_per_seed:
                configs = [dataclasses.replace(c, data_seed=c.seed) for c in configs]
            analysis = {**self.raw.get("analysis", {}), **block.get("analysis", {})}
            studies.append(Study(block["name"], configs, analysis))
        if not studies:
            raise ValueError(f"none of the methods {methods} is in preset {self.name!r}")
        return studies

    def _expand(self, base: dict, grid: dict, keep: set[str]) -> list[RunConfig]:
        """The runs of ``grid`` on ``base``, each method's built from ``base`` with its
        [method.NAME] table merged in (the settings in ``keep``, those of [study.run] and of the
        command line, stay as ``base`` has them)."""
        tables = self.raw.get("method", {})
        if not tables:
            return expand_grid(base, grid)
        configs = []
        for method in grid.get("method", [base.get("method")]):
            settings = {k: v for k, v in tables.get(method, {}).items() if k not in keep}
            try:
                configs += expand_grid({**base, **settings}, {**grid, "method": [method]} if "method" in grid else grid)
            except (TypeError, ValueError) as error:
                if not settings:
                    raise
                raise ValueError(f"preset {self.name!r} [method.{method}]: {error}") from None
        return sorted(configs, key=run_order)

    def _with_model_digests(self, configs: list[RunConfig]) -> list[RunConfig]:
        """``configs`` with the SHA-256 of each ``model`` factory's source as ``model_digest``, however
        the model was set ([run], [method.NAME], ``--set``): the factory imported now, so that a wrong
        spec or a module that fails to import is a one-line error before any run."""
        from affdiv.experiments.runs.factories import resolve

        digests = {}
        for spec in sorted({c.model for c in configs if c.model is not None}):
            try:
                digests[spec] = resolve(spec)[1]
            except Exception as error:  # the user's module may raise anything on import
                raise ValueError(f"preset {self.name!r}: model {spec}: {type(error).__name__}: {error}") from None
        return [dataclasses.replace(c, model_digest=digests[c.model]) if c.model is not None else c for c in configs]


def load_preset(name_or_path: str) -> Preset:
    """A packaged preset by name (``smoke``, ``fashion``, ``paper``) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or len(path.parts) > 1:  # a path, not a packaged name
        if not path.is_file():
            raise FileNotFoundError(f"preset {path}: no such file")
        data, name = path.read_bytes(), path.stem
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"preset {path}: not UTF-8 text (byte {data[error.start]:#04x} at offset "
                             f"{error.start}); a TOML preset is UTF-8: save it as UTF-8") from None
    else:
        check_choice("preset", name_or_path, available_presets())
        text = (resources.files("affdiv.experiments.runs") / "presets" / f"{name_or_path}.toml").read_text()
        name = name_or_path
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"preset {name_or_path}: not valid TOML: {error}") from None
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        raise ValueError(f"preset {name!r}: unknown table(s) {unknown}; expected among {sorted(_SECTIONS)}")
    for block in raw.get("study", []):
        if "name" not in block:
            raise ValueError(f"preset {name!r}: every [[study]] needs a name, got {block}")
    measure = raw.get("measure", {})
    if not isinstance(measure, dict) or set(measure) - set(MEASURE):
        raise ValueError(f"preset {name!r}: [measure] takes only {sorted(MEASURE)}, got {measure!r}")
    for key, value in measure.items():
        check_every(f"preset {name!r} [measure] {key}", value)
    _check_method_tables(name, raw)
    sweep = raw.get("sweep", {})
    if not isinstance(sweep, dict) or set(sweep) - set(SWEEP):
        raise ValueError(f"preset {name!r}: [sweep] takes only {list(SWEEP)}, got {sweep!r}")
    memory = sweep.get("ensemble_memory")
    if memory is not None:
        memory = parse_memory(memory, f"preset {name!r} [sweep] ensemble_memory")
    return Preset(name, raw.get("description", ""), raw, memory)


def _check_method_tables(name: str, raw: dict) -> None:
    """Refuse a [method.NAME] table for a method the preset does not run, or one that sets a key
    that is no run setting, a grid axis, or one of ``_SAME_FOR_EVERY_METHOD``. (Its values are
    checked when its runs are built, the error naming the table.)"""
    tables = raw.get("method", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise ValueError(f"preset {name!r}: [method] holds one table of run settings per method ([method.NAME]), "
                         f"got {tables!r}")
    if not tables:
        return
    blocks = [raw, *raw.get("study", [])]
    tables_of = [block.get(table, {}) for block in blocks for table in ("grid", "run")]
    if not all(isinstance(t, dict) for t in tables_of):
        return  # a malformed [grid] or [run]: refused, with its own message, when the runs are built
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    axes = set().union(*(block.get("grid", {}) for block in blocks))
    run = set().union(*(_as_list(block.get(table, {}).get("method")) for block in blocks for table in ("grid", "run")))
    for method, settings in tables.items():
        if method not in run:
            raise ValueError(f"preset {name!r} [method.{method}]: the preset runs no method {method!r}; it runs: "
                             f"{', '.join(sorted(run))}")
        for key in settings:
            if key not in fields:
                why = "is not a run setting"
            elif key in axes:
                why = "is a grid axis"
            elif key in _SAME_FOR_EVERY_METHOD:
                why = "cannot differ by method"
            else:
                continue
            raise ValueError(f"preset {name!r} [method.{method}]: {key!r} {why}")


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]

"""affdiv probe: the divergence meter (affdiv.meter) on real data, per layer and
batch size, for built-in or your own models.

For each model, seed and batch size B, a freshly initialised model (torch.manual_seed(seed), in
train mode, float64 by default) meets --batches random batches of the training split; on each
batch one SGD step on the mean of --loss is measured for every module that owns trainable
parameters (nn.MultiheadAttention included; a module that cannot be measured is warned about
and listed under "Not measured"):

    scale               ⟨u_i, u*_i⟩/‖u*_i‖²: each sample's real update u_i against the ideal
                        u*_i = −η g_i, as a factor (mean over the batch)
    diagonal_scale      the same for the sample's update from its own gradient alone, d_i:
                        ‖x‖²+1 for a plain affine layer (layer scope), 1 for AffineLike
    diagonal_scale_cv   its spread over the batch, std/mean: 0 when every sample is scaled alike
    cosine              cos(u_i, u*_i) (mean over the batch)
    off_diagonal_share  ‖u_i − d_i‖/‖d_i‖: what the other samples of the batch add (mean, median)
    batch_cosine        cos(u, u*) of the whole batch's update
    diagonal_norm_correlation  Pearson correlation of the diagonal scale with ‖x_i‖ (null where
                        the diagonal scale is constant to rounding: nothing to correlate)
    site_diagonal_scale each token's / output position's own factor (layer scope, closed forms:
                        the affine family, Conv, PatchNormConv), mean and spread: 1 for AffineLike
                        and PatchNorm wherever they sit; diagonal_scale also holds the sample's
                        other tokens or positions

under --scope layer (only the module's own parameters step: the theory's quantity) or
--scope network (every parameter steps; the update is read at the module's output). Every number in
probe.json is the mean over seeds of the per-seed mean over batches, with a 95% t interval over
seeds (seeds are the independent units: batches of one seed share its initialisation); null
where undefined (one seed, or a metric undefined in every batch). The off-diagonal shares, the
spreads and, at layer scope, the diagonal scales are averaged on the log scale where every seed's
value is > 0: the geometric mean over seeds and the t interval of the logarithms, transformed back,
so that the interval stays positive (where a seed's value is ≤ 0: the plain mean, its interval cut
at 0 for the shares and spreads, which cannot be negative). At network scope a diagonal scale is
signed (another parameter's step can oppose a sample's own): there it is averaged on the plain
scale, in every cell.

Written to --out: probe.json (rows per model, layer and batch size; per layer kind and batch
size; per-sample diagonal scales and input norms at one batch size for the scatter figure;
provenance), probe.md, share_vs_batch.png (off-diagonal share and cosine against batch size,
one line per layer kind, told apart by marker and line style) and diagonal_vs_norm.png (each
sample's diagonal scale against ‖x‖, plain layers open markers, corrected ones filled).

Models (--model, comma-separated): the built-ins of affdiv.experiments.runs.zoo (layer-<member>,
mlp-<method>, cnn-<method>, vit[-<variant>], resnet[-conv|-patchnorm],
transformer[-affine_like][-qknorm]), 'all'
(every built-in), or a model of your own as path/to/file.py:factory or package.module:factory (a
module in the current directory is found without PYTHONPATH). The factory is called as

    factory(input_shape=(...), num_classes=K) -> torch.nn.Module

when its signature takes those two names (or **kwargs), else as factory(). input_shape is one
sample's shape without the batch (digits (1, 8, 8), an .npz file's x_train.shape[1:]); K is the
number of outputs the model must give per sample: the classes (cross_entropy, or mse on one-hot
labels) or the target values (mse on real targets). The model maps a batch (B, *input_shape) to
(B, K) logits (cross_entropy) or to B outputs of K values (mse).

Data (--data): digits, fashion-mnist, cifar10, synthetic (standardised on the training split), or
an .npz file of your own with arrays x_train, y_train, x_test, y_test (x: (N, *input_shape) real;
y: integer class labels (N,), or real targets (N, ...) for mse), used as given.

Loss (--loss): cross_entropy (class labels) or mse (per sample, the mean over its outputs of the
squared difference to the target; to the one-hot label where y holds class labels).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from affdiv.atomic import atomic_write
from affdiv.checks import check_int, is_int
from affdiv.provenance import relative_path
from affdiv.reporting import write_json

SCOPES = ("layer", "network")
DTYPES = ("float64", "float32")
LOSSES = ("cross_entropy", "mse")
DEFAULT_BATCH_SIZES = (8, 32, 128, 512)
DEFAULT_LR = 0.1  # the metrics do not depend on it (first order: u, d and u* all scale with η)
SUMMARY_METRICS = (
    "scale_mean", "diagonal_scale_mean", "diagonal_scale_cv", "cosine_mean", "off_diagonal_share_mean",
    "off_diagonal_share_median", "batch_cosine", "diagonal_norm_correlation", "site_diagonal_scale_mean",
    "site_diagonal_scale_cv",
)
# the summaries averaged over seeds on the log scale where every seed's value is > 0 (the module
# docstring): the spreads and shares, which cannot be negative, and the diagonal scales, which are
# positive at layer scope but signed at network scope (another parameter's step can oppose a
# sample's own), so averaged there on the plain scale (SIGNED_AT_NETWORK_SCOPE)
LOG_SCALE_METRICS = frozenset({
    "diagonal_scale_mean", "diagonal_scale_cv", "off_diagonal_share_mean", "off_diagonal_share_median",
    "site_diagonal_scale_mean", "site_diagonal_scale_cv",
})
SIGNED_AT_NETWORK_SCOPE = frozenset({"diagonal_scale_mean", "site_diagonal_scale_mean"})
# of those, the ones that cannot be negative: where a seed's value is 0, their interval is cut at 0
NON_NEGATIVE_METRICS = frozenset({
    "diagonal_scale_cv", "off_diagonal_share_mean", "off_diagonal_share_median", "site_diagonal_scale_cv",
})
CI_TEXT = ("95% t interval over seeds of the per-seed means over batches; for the shares, the spreads and the "
           "layer-scope diagonal scales where every seed's value is > 0, the geometric mean and the t interval of "
           "the logarithms, transformed back")
SAMPLES_MAX_BATCH = 128  # the per-sample scatter is stored at the largest batch size up to this

# (plain model, corrected model, layer, what): the pairs the scatter figure draws when measured
SCATTER_PAIRS = (
    ("layer-affine", "layer-affine_like", "1", "one layer"),
    ("layer-affine", "layer-norm_l2", "1", "one layer"),
    ("mlp-affine", "mlp-affine_like", "3", "MLP, second hidden layer"),
    ("mlp-affine", "mlp-norm_l2", "3", "MLP, second hidden layer"),
)


# ---------------------------------------------------------------------------------------------
# input


def parse_int_list(text: str | Sequence[int], what: str) -> list[int]:
    """``"8,32,128"`` (or a list of ints) as sorted distinct positive ints; a ValueError otherwise."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}") from None
    else:
        values = list(text)
    if not values or not all(is_int(v, 1) for v in values):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def model_list(spec: str | Sequence[str]) -> list[str]:
    """``"all"``, one name, or a comma-separated list of built-in names, path/to/file.py:factory
    and package.module:factory."""
    from affdiv.experiments.runs import zoo

    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise ValueError(f"models must name at least one model, got {spec!r}")
    out = []
    for name in names:
        out += list(zoo.BUILTIN) if name == "all" else [name]
    for name in out:
        zoo.resolve(importable(name))  # unknown names and failed imports fail here, before any work
    return list(dict.fromkeys(out))


def _cwd_relative_spec(spec: str) -> str:
    """A ``path/to/file.py:factory`` spec with its path relative to the working directory."""
    where, colon, name = spec.rpartition(":")
    return f"{relative_path(where, os.getcwd())}:{name}" if colon and where.endswith(".py") else spec


def importable(spec: str) -> str:
    """``spec`` as :func:`affdiv.experiments.runs.zoo.resolve` takes it: a built-in name as it is;
    for ``path/to/file.py:factory`` or ``package.module:factory`` the module loaded as the harness
    loads a model factory (:func:`affdiv.experiments.runs.factories.load_module`: a file by its path
    and content, a module of the working directory first) and named by its module's name."""
    from affdiv.experiments.runs.factories import load_module

    module_part, colon, attribute = spec.rpartition(":")
    if not colon:
        return spec
    return f"{load_module(module_part).__name__}:{attribute}"


def build_model(spec: str, dataset):
    """The model ``spec`` names, built for ``dataset`` (errors name ``spec`` as the user gave it)."""
    from affdiv.experiments.runs import zoo

    target = importable(spec)
    try:
        return zoo.build(target, input_shape=tuple(dataset.input_shape), num_classes=dataset.num_classes)
    except ValueError as error:
        raise ValueError(str(error).replace(repr(target), repr(spec))) from None


def load_data(data: str, *, data_dir: str | None, seed: int):
    """A built-in dataset by name (:func:`affdiv.experiments.data.dataset.load_dataset`), or a path
    ending in .npz (:func:`affdiv.experiments.data.npz.load_npz`)."""
    if str(data).endswith(".npz"):
        from affdiv.experiments.data.npz import load_npz

        return load_npz(data)
    from affdiv.experiments.data.dataset import load_dataset

    return load_dataset(data, data_dir=data_dir, seed=seed)


def per_sample_loss(name: str, dataset):
    """ℓ(out, y) -> (B,) for the loss ``name``: ``cross_entropy`` −log softmax(out_i)[y_i];
    ``mse`` the mean over sample i's outputs of (out_i − t_i)², t_i its target (the one-hot label
    where the data hold class labels)."""
    import torch.nn.functional as F

    labels = getattr(dataset, "labels", True)  # the built-in datasets hold class labels
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {name!r}")
    if name == "cross_entropy":
        if not labels:
            raise ValueError(f"loss cross_entropy needs integer class labels; {dataset.name} holds real targets "
                             "(use loss mse)")
        return lambda out, y: F.cross_entropy(out, y, reduction="none")
    classes = dataset.num_classes

    def mse(out, y):
        target = F.one_hot(y, classes).to(out.dtype) if labels else y.to(out.dtype)
        return (out.reshape(len(out), -1) - target.reshape(len(target), -1)).pow(2).mean(1)

    return mse


def check_output(spec: str, model, dataset, loss: str, dtype) -> None:
    """One forward on two training samples, before any measurement: it runs (else a ValueError naming
    the model, the batch's shape and the error) and its output has the shape ``loss`` needs (else a
    ValueError naming the expected and the actual shape)."""
    import torch

    x = dataset.train.x[:2].to(dtype)
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as error:  # noqa: BLE001  (the user's code: whatever its forward raises is bad input)
        reason = str(error).splitlines()[0] if str(error) else ""
        raise ValueError(f"model {spec!r}: its forward failed on a batch of shape {tuple(x.shape)}: "
                         f"{type(error).__name__}: {reason}") from None
    k = dataset.num_classes
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"model {spec!r} must return one tensor, got {type(out).__name__}")
    if loss == "cross_entropy" and (out.dim() != 2 or out.shape[0] != len(x) or out.shape[1] < k):
        raise ValueError(f"model {spec!r} with loss cross_entropy must return logits of shape (B, {k}) "
                         f"(B = {len(x)}), got {tuple(out.shape)}")
    if loss == "mse" and (out.dim() == 0 or out.shape[0] != len(x) or out[0].numel() != k):
        raise ValueError(f"model {spec!r} with loss mse must return {k} value(s) per sample (B = {len(x)}), got "
                         f"shape {tuple(out.shape)}")


# ---------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class ProbeOptions:
    """What ``affdiv probe`` measures and how; every field is checked when the options are made
    (a one-line ValueError naming the field).

    Args:
        batch_sizes: the batch sizes B, a sequence of ints or ``"8,32,128"``; kept sorted and distinct.
        seeds: how many seeds (fresh model initialisations), starting at ``seed``.
        seed: the first seed (>= 0); it also seeds the split of a built-in dataset.
        batches: random training batches per seed and batch size.
        scope: ``"layer"`` (only the module's own parameters step) or ``"network"`` (all do).
        lr: η > 0 of the SGD step (the metrics do not depend on it).
        dtype: ``"float64"`` or ``"float32"``, of the models and the batches.
        per_sample: also each sample's own update d_i (diagonal scale, off-diagonal share).
        masked_limit: in network scope, the largest B for which the masked route runs (None: no limit).
        loss: ``"cross_entropy"`` (class labels) or ``"mse"``.
    """

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    seeds: int = 3
    seed: int = 0
    batches: int = 2
    scope: str = "layer"
    lr: float = DEFAULT_LR
    dtype: str = "float64"
    per_sample: bool = True
    masked_limit: int | None = 128
    loss: str = "cross_entropy"

    def __post_init__(self):
        object.__setattr__(self, "batch_sizes", tuple(parse_int_list(self.batch_sizes, "batch_sizes")))
        for name, minimum in (("seeds", 1), ("seed", 0), ("batches", 1)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=minimum))
        from affdiv.experiments.runs.config import MAX_SEED

        if self.seed + self.seeds - 1 > MAX_SEED:
            raise ValueError(f"seed must be <= {MAX_SEED} - seeds + 1 (the last seed in torch's seed range), "
                             f"got {self.seed} with seeds {self.seeds}")
        for name, valid in (("scope", SCOPES), ("dtype", DTYPES), ("loss", LOSSES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}")
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and math.isfinite(self.lr)
                and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not isinstance(self.per_sample, bool):
            raise ValueError(f"per_sample must be True or False, got {self.per_sample!r}")
        if self.masked_limit is not None:
            object.__setattr__(self, "masked_limit", check_int("masked_limit", self.masked_limit))

    @property
    def seed_list(self) -> list[int]:
        """The seeds: ``seeds`` consecutive integers from ``seed``."""
        return list(range(self.seed, self.seed + self.seeds))


# ---------------------------------------------------------------------------------------------
# measuring


def measure(dataset, models: Sequence[str], options: ProbeOptions = ProbeOptions(),
            progress: Callable[[str, int, int, float], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Every (model, seed, batch size, batch) of ``options``: one :func:`affdiv.meter.divergence`
    report; ``progress(model, seed, batch_size, seconds)`` after each model, seed and batch size.

    Returns (measurements, samples): one row per module and measurement with its summary, and the
    per-sample (‖x_i‖, diagonal scale) of every module of the models the scatter figure draws
    (``SCATTER_PAIRS``; else the first four models) at one batch size (the first seed's first
    batch at the largest B ≤ ``SAMPLES_MAX_BATCH``)."""
    import torch

    if not isinstance(options, ProbeOptions):
        raise TypeError(f"options must be a ProbeOptions, got {type(options).__name__}")
    torch_dtype = {"float64": torch.float64, "float32": torch.float32}[options.dtype]
    batch_sizes, seeds = options.batch_sizes, options.seed_list
    n_train = len(dataset.train)
    too_big = [b for b in batch_sizes if b > n_train]
    if too_big:
        raise ValueError(f"batch size {too_big[0]} exceeds the {n_train} training samples of {dataset.name}")
    criterion = per_sample_loss(options.loss, dataset)
    for name in models:  # every model must build on this data, and fit the loss, before any measurement
        check_output(name, build_model(name, dataset).to(torch_dtype), dataset, options.loss, torch_dtype)
    scatter_batch = max([b for b in batch_sizes if b <= SAMPLES_MAX_BATCH] or [min(batch_sizes)])
    paired = {m for pair in SCATTER_PAIRS for m in pair[:2]} & set(models)
    scatter_models = paired or set(models[:4])
    rows, samples = [], []
    for name in models:
        for seed in seeds:
            torch.manual_seed(seed)
            model = build_model(name, dataset).to(torch_dtype).train()
            for batch_size in batch_sizes:
                start = time.perf_counter()
                scatter = seed == seeds[0] and batch_size == scatter_batch and name in scatter_models
                _measure_batches(model, dataset, criterion, (name, seed, batch_size), options,
                                 rows, samples if scatter else None)
                if progress:
                    progress(name, seed, batch_size, time.perf_counter() - start)
    return rows, samples


def _measure_batches(model, dataset, criterion, where: tuple[str, int, int], options: ProbeOptions,
                     rows: list[dict], samples: list[dict] | None) -> None:
    """The ``options.batches`` batches of one (model name, seed, batch size) = ``where``: their
    rows appended to ``rows``, and the first batch's per-sample scatter to ``samples`` (unless None)."""
    import numpy as np
    import torch

    from affdiv.meter import MeterOptions, divergence

    name, seed, batch_size = where
    split, torch_dtype = dataset.train, next(model.parameters()).dtype
    rng = np.random.default_rng([seed, batch_size])
    for b in range(options.batches):
        index = torch.from_numpy(rng.choice(len(split), size=batch_size, replace=False))
        x, y = split.x[index].to(torch_dtype), split.y[index]
        report = divergence(
            model, x, lambda out, y=y: criterion(out, y), lr=options.lr, scope=options.scope,
            per_sample=options.per_sample, options=MeterOptions(masked_limit=options.masked_limit),
        )
        for record in report.records():
            rows.append({"model": name, "seed": seed, "batch": b, **record, "skipped": len(report.skipped)})
        for layer, reason in report.skipped.items():
            rows.append({"model": name, "seed": seed, "batch": b, "layer": layer, "skipped_reason": reason,
                         "batch_size": batch_size})
        if b == 0 and samples is not None:
            for layer_name, layer in report.layers.items():
                if layer.diagonal_scale is None:
                    continue
                samples.append({
                    "model": name, "layer": layer_name, "kind": layer.kind, "batch_size": batch_size,
                    "scope": options.scope,
                    "input_norm": [_round(v) for v in layer.input_norm.tolist()],
                    "diagonal_scale": [_round(v) for v in layer.diagonal_scale.tolist()],
                })


def _round(value: float) -> float | None:
    return float(f"{value:.4g}") if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------------
# aggregating: per seed over batches, then over seeds

GROUP_KEYS = ("model", "layer", "kind", "batch_size")


@dataclass(frozen=True)
class Cell:
    """One metric of a group over seeds: ``value`` (None where undefined) and its 95% interval
    ``ci`` = (low, high) (None with one seed)."""

    value: float | None
    ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class Group:
    """The measurements that share ``keys`` (some of ``GROUP_KEYS``, in the order given), summed up
    over seeds: ``seeds`` (how many measured it) and one :class:`Cell` per metric of
    ``SUMMARY_METRICS`` in ``cells``. ``kind`` is set with ``layer`` (the layer's kind)."""

    keys: tuple[str, ...]
    model: str | None = None
    layer: str | None = None
    kind: str | None = None
    batch_size: int | None = None
    seeds: int = 0
    cells: Mapping[str, Cell] = field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        return self.cells[metric].value

    def ci(self, metric: str) -> tuple[float, float] | None:
        return self.cells[metric].ci

    def to_json(self) -> dict:
        """The group as a probe.json row: its keys, its kind (with ``layer``), ``seeds``, and per
        metric ``<metric>`` and ``<metric>_ci`` ([low, high] or null)."""
        row = {key: getattr(self, key) for key in self.keys}
        if "layer" in self.keys and "kind" not in self.keys:
            row["kind"] = self.kind
        row["seeds"] = self.seeds
        for metric in SUMMARY_METRICS:
            cell = self.cells[metric]
            row[metric], row[f"{metric}_ci"] = cell.value, (None if cell.ci is None else list(cell.ci))
        return row


@dataclass(frozen=True)
class Summary:
    """What ``affdiv probe`` reports: ``by_kind`` (per layer kind and batch size), ``by_layer``
    (per model, layer and batch size), ``skipped`` ((model, layer) -> why it was not measured),
    ``routes`` (kind -> how its updates were computed) and ``samples`` (the per-sample scatter)."""

    by_kind: tuple[Group, ...]
    by_layer: tuple[Group, ...]
    skipped: Mapping[tuple[str, str], str]
    routes: Mapping[str, str]
    samples: tuple[dict, ...] = ()

    @classmethod
    def of(cls, rows: Sequence[dict], samples: Sequence[dict] = ()) -> Summary:
        """The summary of :func:`measure`'s (rows, samples)."""
        skipped = {(r["model"], r["layer"]): r["skipped_reason"] for r in rows if "skipped_reason" in r}
        routes: dict[str, str] = {}
        for r in rows:
            if "kind" in r:
                routes.setdefault(r["kind"], f"{r['route']}; diagonal: {r['diagonal_route']}")
        return cls(tuple(aggregate(rows, ("kind", "batch_size"))),
                   tuple(aggregate(rows, ("model", "layer", "batch_size"))), skipped, routes, tuple(samples))

    def layers_per_kind(self) -> dict[str, int]:
        """Kind -> how many (model, layer) of that kind were measured."""
        layers: dict[str, set] = defaultdict(set)
        for g in self.by_layer:
            layers[g.kind].add((g.model, g.layer))
        return {kind: len(names) for kind, names in layers.items()}

    def to_json(self) -> dict:
        return {"by_kind": [g.to_json() for g in self.by_kind], "rows": [g.to_json() for g in self.by_layer],
                "skipped": [{"model": m, "layer": layer, "reason": why}
                            for (m, layer), why in sorted(self.skipped.items())],
                "samples": list(self.samples)}


def interval(values: Sequence[float | None], *, log_scale: bool = False, non_negative: bool = False) -> Cell:
    """The mean of ``values`` with its 95% t interval (:func:`affdiv.experiments.analysis.stats.t_interval`;
    None where undefined; non-finite values left out). ``log_scale``: where every value is > 0,
    the geometric mean and the t interval of log(values) mapped back by exp (so inside (0, ∞));
    otherwise the plain mean and interval, its lower end cut at 0 for a ``non_negative``
    quantity."""
    from affdiv.experiments.analysis.stats import t_interval

    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return Cell(None)
    if len(values) < 2:
        return Cell(values[0])
    if log_scale and all(v > 0 for v in values):
        mean, low, high = t_interval([math.log(v) for v in values], 0.95)
        return Cell(math.exp(mean), (math.exp(low), math.exp(high)))
    mean, low, high = t_interval(values, 0.95)
    return Cell(mean, (max(low, 0.0) if non_negative else low, high))


def _seed_means(rows: Sequence[dict], keys: tuple[str, ...]) -> dict[tuple, dict[int, dict[str, float]]]:
    """(group key) -> seed -> metric -> mean over that seed's measurements (layers and batches)."""
    acc: dict[tuple, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for row in rows:
        if "skipped_reason" in row:
            continue
        for metric in SUMMARY_METRICS:
            value = row.get(metric)
            if value is not None:
                acc[tuple(row[k] for k in keys)][row["seed"]][metric].append(value)
    return {key: {seed: {m: sum(v) / len(v) for m, v in metrics.items()} for seed, metrics in by_seed.items()}
            for key, by_seed in acc.items()}


def aggregate(rows: Sequence[dict], keys: tuple[str, ...]) -> list[Group]:
    """One :class:`Group` per distinct ``keys`` (some of ``GROUP_KEYS``), ordered by them: for
    every metric its mean over seeds and 95% interval (:func:`interval`)."""
    unknown = [k for k in keys if k not in GROUP_KEYS]
    if unknown or not keys:
        raise ValueError(f"keys must be some of {', '.join(GROUP_KEYS)}, got {keys!r}")
    scopes = {r["scope"] for r in rows if "scope" in r}
    if len(scopes) > 1:  # (which scale a diagonal scale is averaged on depends on the scope)
        raise ValueError(f"rows of one scope only, got rows of scopes {sorted(scopes)}")
    kinds = {(r["model"], r["layer"]): r.get("kind") for r in rows if "kind" in r}
    network = scopes == {"network"}
    log_scale = LOG_SCALE_METRICS - (SIGNED_AT_NETWORK_SCOPE if network else frozenset())

    def order(item):  # numbers (batch sizes) as numbers, names as text
        return tuple((0, k, "") if isinstance(k, (int, float)) else (1, 0, str(k)) for k in item[0])

    out = []
    for key, by_seed in sorted(_seed_means(rows, keys).items(), key=order):
        fields = dict(zip(keys, key))
        if "layer" in keys and "kind" not in keys:
            fields["kind"] = kinds.get((fields["model"], fields["layer"]))
        cells = {metric: interval([s.get(metric) for s in by_seed.values()], log_scale=metric in log_scale,
                                   non_negative=metric in NON_NEGATIVE_METRICS)
                 for metric in SUMMARY_METRICS}
        out.append(Group(keys=tuple(keys), seeds=len(by_seed), cells=cells, **fields))
    return out


# ---------------------------------------------------------------------------------------------
# writing


def _cell(cell: Cell, with_ci: bool = False) -> str:
    from affdiv.experiments.report.writer import format_interval, format_number

    if cell.value is None or not with_ci or cell.ci is None:
        return format_number(cell.value)
    return f"{format_number(cell.value)} {format_interval(*cell.ci)}"


def to_markdown(summary: Summary, *, data: str, models: Sequence[str], options: ProbeOptions,
                provenance: Mapping) -> str:
    """probe.md: the tables per layer kind and per model and layer, what was not measured, how
    each kind was computed, and the provenance (:func:`affdiv.experiments.report.writer.markdown_document`)."""
    from affdiv.experiments.report.writer import markdown_document

    intro = (f"Models: {', '.join(models)}. Batch sizes {list(options.batch_sizes)}, {options.seeds} seeds × "
             f"{options.batches} batches, {options.dtype}, fresh models in train mode, loss: mean "
             f"{options.loss}, η = {options.lr}. Each cell: mean over seeds of the per-seed mean over batches "
             "[95% t interval over seeds]. The off-diagonal shares, the spreads and, at layer scope, the diagonal "
             "scales are averaged on the log scale where every seed's value is > 0: the geometric mean over seeds "
             "and the t interval of the logarithms, transformed back, so the interval stays positive. At network "
             "scope a diagonal scale is signed and averaged on the plain scale.")
    layers = summary.layers_per_kind()
    by_kind = [[g.kind, g.batch_size, layers.get(g.kind, 0), _cell(g.cells["off_diagonal_share_median"], True),
                _cell(g.cells["cosine_mean"], True), _cell(g.cells["diagonal_scale_mean"]),
                _cell(g.cells["diagonal_scale_cv"]),
                f"{_cell(g.cells['site_diagonal_scale_mean'])} ({_cell(g.cells['site_diagonal_scale_cv'])})",
                _cell(g.cells["diagonal_norm_correlation"])] for g in summary.by_kind]
    by_layer = [[g.model, f"`{g.layer}`", g.kind, g.batch_size,
                 f"{_cell(g.cells['off_diagonal_share_mean'], True)} ({_cell(g.cells['off_diagonal_share_median'])})",
                 *[_cell(g.cells[m]) for m in ("cosine_mean", "scale_mean", "diagonal_scale_mean",
                                                "diagonal_scale_cv", "batch_cosine", "diagonal_norm_correlation")]]
                for g in summary.by_layer]
    blocks = [
        ("h", 1, f"affdiv probe — {data}, {options.scope} scope"), ("p", intro),
        ("h", 2, "Per layer kind"),
        ("table", ["kind", "B", "layers", "off-diagonal share, median", "cosine", "diagonal scale",
                   "diagonal scale CV", "site diagonal scale (CV)", "corr(diag, ‖x‖)"], by_kind),
        ("h", 2, "Per model and layer"),
        ("table", ["model", "layer", "kind", "B", "off-diagonal share (median)", "cosine", "scale",
                   "diagonal scale", "diagonal scale CV", "batch cosine", "corr(diag, ‖x‖)"], by_layer),
    ]
    if summary.skipped:
        blocks += [("h", 2, "Not measured"),
                   ("list", [f"{model} `{layer}`: {why}" for (model, layer), why in sorted(summary.skipped.items())])]
    if summary.routes:
        blocks += [("h", 2, "How each kind was computed"),
                   ("list", [f"{kind}: {route}" for kind, route in sorted(summary.routes.items())])]
    return markdown_document([*blocks, ("provenance", provenance)])


# The figures: matplotlib (imported when a figure is drawn) through the report's figure helpers,
# so they follow the same rules: at most MAX_WIDTH_PX wide, words with units on the axes, series
# told apart by marker and line style as well as colour.
_SHARE_PANELS = (
    ("off_diagonal_share_median", "off-diagonal share ‖u_i − d_i‖ / ‖d_i‖\n(ratio, median over samples; log scale)"),
    ("cosine_mean", "cosine of real and ideal update\n(−1 to 1, mean over samples)"),
)
_BATCH_WORDS = "batch size B (samples per step; log₂ scale)"


def figure_share_vs_batch(by_kind: Sequence[Group], path: Path, *, data: str, options: ProbeOptions) -> Path:
    """Off-diagonal share and cosine against batch size, one line (marker, line style) per kind."""
    from affdiv.experiments.report import figures

    return figures._save(_build_share_vs_batch(by_kind, data, options), path)


def _build_share_vs_batch(by_kind: Sequence[Group], data: str, options: ProbeOptions):
    from affdiv.experiments.report import figures

    figure, axes = figures._grid(2, 5.0, 3.8)
    kinds = list(dict.fromkeys(g.kind for g in by_kind))
    for ax, (metric, label) in zip(axes, _SHARE_PANELS):
        for k, kind in enumerate(kinds):
            mine = [g for g in by_kind if g.kind == kind and g.value(metric) is not None]
            if not mine:
                continue
            xs, ys = [g.batch_size for g in mine], [g.value(metric) for g in mine]
            low = [y - g.ci(metric)[0] if g.ci(metric) else 0.0 for y, g in zip(ys, mine)]
            high = [g.ci(metric)[1] - y if g.ci(metric) else 0.0 for y, g in zip(ys, mine)]
            ax.errorbar(xs, ys, yerr=[low, high], ms=5, capsize=2, label=kind, **figures._style(k))
        ax.set_xscale("log", base=2)
        if metric.startswith("off"):
            ax.set_yscale("log")
        ax.set_xlabel(_BATCH_WORDS, fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.set_title("the other samples' part of each update" if metric.startswith("off")
                     else "alignment with the ideal update", fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, title="layer kind", title_fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    figure.suptitle(f"{data}, {options.scope} scope: mean over the layers of each kind, "
                    f"95% interval over {options.seeds} seeds", fontsize=9)
    return figure


def _scatter_panels(samples: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    index = {(s["model"], s["layer"]): s for s in samples}
    panels = [(what, [index[(a, layer)], index[(b, layer)]]) for a, b, layer, what in SCATTER_PAIRS
              if (a, layer) in index and (b, layer) in index]
    if panels:
        return panels
    firsts = {}
    for s in samples:
        firsts.setdefault(s["model"], s)
    return [(f"{s['model']} `{s['layer']}`", [s]) for s in list(firsts.values())[:4]]


def figure_diagonal_vs_norm(samples: Sequence[dict], path: Path, *, data: str, options: ProbeOptions) -> Path:
    """Each sample's diagonal scale against the norm of the layer's input, plain vs corrected."""
    from affdiv.experiments.report import figures

    return figures._save(_build_diagonal_vs_norm(samples, data, options), path)


def _build_diagonal_vs_norm(samples: Sequence[dict], data: str, options: ProbeOptions):
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from affdiv.experiments.report import figures

    panels = _scatter_panels(samples)
    figure, axes = figures._grid(max(1, len(panels)), 4.4, 3.4, max_cols=2)
    for ax, (what, series) in zip(axes, panels):
        for k, s in enumerate(series):
            pairs = [(x, d) for x, d in zip(s["input_norm"], s["diagonal_scale"]) if x and d and d > 0]
            style = figures._style(k)  # the plain layer open, the corrected one filled, other markers
            ax.plot([p[0] for p in pairs], [p[1] for p in pairs], ls="none", marker=style["marker"],
                    ms=3.5, mfc="none" if k == 0 else style["color"], mec=style["color"], mew=0.8, alpha=0.8,
                    color=style["color"], label=f"{s['model']}: {s['kind']}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # ticks at 1, 2, 5 × 10^k, labelled plainly: never crowded
            axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("norm of the layer's input ‖x_i‖ (input units; log scale)", fontsize=8)
        ax.set_ylabel("diagonal scale: d_i relative to −η g_i\n(factor, 1 = ideal; log scale)", fontsize=8)
        ax.set_title(f"{what}, B = {series[0]['batch_size']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.suptitle(f"{data}, {options.scope} scope: one point per sample of one batch", fontsize=9)
    return figure


def write_probe(out: str | Path, summary: Summary, *, data: str, models: Sequence[str], options: ProbeOptions,
                provenance: Mapping) -> dict[str, Path]:
    """probe.json, probe.md and the two figures under ``out``; returns the written paths."""
    out = Path(out)
    record = {
        "schema_version": 3, "data": data, "models": list(models), "batch_sizes": list(options.batch_sizes),
        "seeds": options.seed_list, "batches": options.batches, "scope": options.scope, "lr": options.lr,
        "dtype": options.dtype, "per_sample": options.per_sample, "masked_limit": options.masked_limit,
        "loss": options.loss, "ci": CI_TEXT, "routes": dict(summary.routes), "provenance": dict(provenance),
        **summary.to_json(),
    }
    markdown = to_markdown(summary, data=data, models=models, options=options, provenance=provenance)
    paths = {"json": write_json(out / "probe.json", record, indent=1),
             "markdown": atomic_write(out / "probe.md", markdown)}
    paths["share_figure"] = figure_share_vs_batch(summary.by_kind, out / "share_vs_batch.png", data=data,
                                                  options=options)
    if summary.samples:
        paths["diagonal_figure"] = figure_diagonal_vs_norm(summary.samples, out / "diagonal_vs_norm.png", data=data,
                                                           options=options)
    return paths


def _print_progress(name: str, seed: int, batch_size: int, seconds: float) -> None:
    print(f"{name:<32} seed {seed} B={batch_size:<5} {seconds:7.2f} s", flush=True)


def probe(out: str | Path, *, models: str | Sequence[str], data: str = "digits", data_dir: str | None = None,
          options: ProbeOptions = ProbeOptions(), quiet: bool = False) -> dict[str, Path]:
    """Measure every model at every batch size of ``options`` (:class:`ProbeOptions`); write
    probe.json, probe.md and the two figures under ``out``; returns the written paths. Bad input
    raises a one-line ValueError before any measurement (the data are loaded first, to check the
    batch sizes and the models against them)."""
    if not isinstance(options, ProbeOptions):
        raise TypeError(f"options must be a ProbeOptions, got {type(options).__name__}")
    names = [_cwd_relative_spec(name) for name in model_list(models)]  # as recorded: no absolute path
    data = relative_path(data, os.getcwd()) if str(data).endswith(".npz") else data
    from affdiv.provenance import provenance

    start = time.perf_counter()
    dataset = load_data(data, data_dir=data_dir, seed=options.seed)
    rows, samples = measure(dataset, names, options, None if quiet else _print_progress)
    summary = Summary.of(rows, samples)
    written = provenance(seed=options.seed, data_fingerprint=dataset.fingerprint,
                         wall_time_s=round(time.perf_counter() - start, 2))
    return write_probe(out, summary, data=data, models=names, options=options, provenance=written)

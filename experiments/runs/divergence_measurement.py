"""The divergence meter as a training measurement: the mechanism behind the batch-size prediction
(off-diagonal share, cosine, diagonal spread per layer) along every run of a sweep, beside its
outcome.

:func:`measurement` gives a :class:`~affdiv.experiments.runs.training.Measurement` named
``divergence`` for ``run_sweep(..., measurements=[...])`` / ``train_run``: at step 0 and every
``every`` steps it draws ``batches`` batches of the training split (a generator seeded by
``seed``, the step and the batch size: every run of a sweep sees the same batches at the same
step) and measures the run's model copy with
:func:`affdiv.meter.divergence` (plain SGD step on the mean cross-entropy; the metrics do not
depend on η, nor on the run's optimizer), at each of ``batch_sizes``, or at the run's own batch
size when none are given.

Each call returns one flat dict of JSON numbers (None where undefined):

    B<b>:<metric>               mean over the measured layers (layers weigh equally)
    B<b>:<layer>:<metric>       per layer (its name in ``named_modules``)

for the metrics in ``METRICS`` (summaries of :meth:`affdiv.meter.LayerDivergence.summary`,
averaged over the batches). :func:`record_columns` turns a run's measurement dicts into record
columns for the report: ``off_diagonal_share_init`` / ``off_diagonal_share_last`` and the same for
``cosine`` and ``diagonal_scale_cv`` (mean over layers, at step 0 and at the last measured step).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from affdiv.checks import check_int, is_int

NAME = "divergence"
METRICS = ("off_diagonal_share_median", "off_diagonal_share_mean", "cosine_mean", "scale_mean",
           "diagonal_scale_mean", "diagonal_scale_cv", "batch_cosine", "diagonal_norm_correlation")
COLUMNS = {"off_diagonal_share": "off_diagonal_share_median", "cosine": "cosine_mean",
           "diagonal_scale_cv": "diagonal_scale_cv"}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class MeasurementOptions:
    """What the divergence measurement measures at each measured step (picklable: it reaches a
    sweep's workers). Bad settings raise a ValueError when it is made, not in a worker.

    Args:
        batch_sizes: the batch sizes measured (empty: the run's own).
        batches: batches drawn per batch size (the metrics are their means).
        scope: ``"layer"`` or ``"network"`` (:func:`affdiv.meter.divergence`).
        per_sample: also the per-sample diagonals (``diagonal_scale``, ``off_diagonal_share``).
        seed: seeds the batches drawn, with the step and the batch size.
        masked_limit: the meter's :attr:`~affdiv.meter.MeterOptions.masked_limit`.
    """

    batch_sizes: tuple[int, ...] = ()
    batches: int = 1
    scope: str = "layer"
    per_sample: bool = True
    seed: int = 0
    masked_limit: int | None = 128

    def __post_init__(self):
        if self.scope not in ("layer", "network"):
            raise ValueError(f"divergence measurement: scope must be 'layer' or 'network', got {self.scope!r}")
        check_int("divergence measurement: batches", self.batches)
        check_int("divergence measurement: masked_limit", self.masked_limit, allow_none=True)
        if isinstance(self.batch_sizes, (str, bytes)) or not all(is_int(b, 1) for b in self.batch_sizes):
            raise ValueError(f"divergence measurement: batch sizes must be integers >= 1, got {list(self.batch_sizes)}")
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))


def measure(model: torch.nn.Module, step: int, data, config,
            options: MeasurementOptions = MeasurementOptions()) -> dict:
    """The :class:`Measurement` callback (see the module docstring)."""
    from affdiv.meter import MeterOptions, divergence

    sizes = list(options.batch_sizes) or [int(config.batch_size)]
    parameter = next(model.parameters())
    x_all = torch.as_tensor(data.train.x, device=parameter.device, dtype=parameter.dtype)
    y_all = torch.as_tensor(data.train.y, device=parameter.device)
    meter_options = MeterOptions(masked_limit=options.masked_limit)
    out: dict = {}
    for size in sizes:
        if size > len(y_all):
            raise ValueError(f"divergence measurement: batch size {size} exceeds the {len(y_all)} training samples")
        generator = torch.Generator().manual_seed((options.seed * 1_000_003 + step) * 100_003 + size)
        per_layer: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for _ in range(options.batches):
            index = torch.randperm(len(y_all), generator=generator)[:size].to(x_all.device)
            y = y_all[index]
            report = divergence(model, x_all[index], lambda out, y=y: F.cross_entropy(out, y, reduction="none"),
                                lr=1.0, scope=options.scope, per_sample=options.per_sample, options=meter_options)
            for row in report.records():
                for metric in METRICS:
                    per_layer[row["layer"]][metric].append(row.get(metric))
        for layer, metrics in per_layer.items():
            for metric, values in metrics.items():
                out[f"B{size}:{layer}:{metric}"] = _mean(values)
        for metric in METRICS:
            out[f"B{size}:{metric}"] = _mean([out[f"B{size}:{layer}:{metric}"] for layer in per_layer])
    return out


def measurement(*, every: int, batch_sizes: Sequence[int] = (), batches: int = 1, scope: str = "layer",
                per_sample: bool = True, seed: int = 0, masked_limit: int | None = 128):
    """A :class:`~affdiv.experiments.runs.training.Measurement` named ``divergence`` (picklable:
    it reaches a sweep's workers) with these :class:`MeasurementOptions`. Bad settings raise a
    ValueError now, not in a worker."""
    from affdiv.experiments.runs.training import Measurement

    options = MeasurementOptions(batch_sizes=tuple(batch_sizes), batches=batches, scope=scope,
                                 per_sample=per_sample, seed=seed, masked_limit=masked_limit)
    return Measurement(NAME, every, functools.partial(measure, options=options))


def record_columns(measurements: Sequence[Mapping], batch_size: int | None = None) -> dict:
    """``<name>_init`` (step 0) and ``<name>_last`` (the last measured step) for the ``COLUMNS``,
    mean over layers at ``batch_size`` (default: the first batch size measured); {} when the run
    has no ``divergence`` measurements."""
    mine = sorted((m for m in measurements if m.get("measurement") == NAME), key=lambda m: m["step"])
    if not mine:
        return {}
    if batch_size is None:
        keys = [k for k in mine[0] if k.startswith("B") and k.count(":") == 1]
        batch_size = int(keys[0][1:].split(":")[0]) if keys else None
    out = {}
    for column, metric in COLUMNS.items():
        key = f"B{batch_size}:{metric}"
        if mine[0]["step"] == 0:
            out[f"{column}_init"] = mine[0].get(key)
        out[f"{column}_last"] = mine[-1].get(key)
    out["divergence_last_step"] = mine[-1]["step"]
    return out

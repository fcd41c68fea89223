"""The meter as a training callback: :class:`DivergenceRecorder` measures every ``every`` steps
and keeps per-layer summaries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from affdiv.checks import check_int
from affdiv.meter.measure import divergence
from affdiv.meter.options import SCOPES, MeterOptions
from affdiv.verify.functional import check_lr


def _batch_of(data) -> tuple[Tensor, Tensor]:
    """(x, y) from a tuple/list (x, y), a mapping with "x" and "y", or an object with .x and .y."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    if isinstance(data, Mapping) and "x" in data and "y" in data:
        return data["x"], data["y"]
    if hasattr(data, "x") and hasattr(data, "y"):
        return data.x, data.y
    raise TypeError(f"the callback's data must be (x, y), a mapping with 'x' and 'y', or an object with .x and .y; "
                    f"got {type(data).__name__}")


class DivergenceRecorder:
    """A training callback that measures the divergence every ``every`` steps and keeps per-layer
    summaries: ``recorder(model, step, data)`` with ``data`` the step's batch (x, y) (or a mapping /
    object with x and y), called before the optimizer steps on it.

    It changes nothing the training depends on (parameters, buffers, ``.grad``, the RNG state, the
    train/eval mode: see :func:`divergence`), so a run with the recorder takes bit-identical steps.
    The measured step is plain SGD on ``loss`` (default: mean cross-entropy on class labels),
    whatever optimizer the run uses: the theory's object; the metrics do not depend on η.

    ``records``: one JSON-ready dict per (measured step, module): ``step``, ``layer``, ``kind``,
    ``scope``, ``batch_size``, the routes, and :meth:`LayerDivergence.summary` with NaN as None.
    ``skipped``: module -> reason, from the last measurement. ``options``: how the meter computes
    (:class:`~affdiv.meter.options.MeterOptions`); default ``MeterOptions(masked_limit=128)``, so that
    network scope on a network that couples samples stops at batch 128 (the masked route costs B
    full-batch passes); an ``options`` given whole replaces that default, ``masked_limit`` included.
    """

    def __init__(self, every: int, *, scope: str = "layer", per_sample: bool = True,
                 loss: Callable[[Tensor, Tensor], Tensor] | None = None, lr: float = 1.0,
                 options: MeterOptions | None = None):
        check_int("every", every)  # steps between measurements
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.every, self.scope, self.per_sample = every, scope, per_sample
        self.lr = check_lr(lr)
        self.loss = loss or (lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"))
        self.options = MeterOptions(masked_limit=128) if options is None else options
        self.records: list[dict] = []
        self.skipped: dict[str, str] = {}

    def due(self, step: int) -> bool:
        """Whether ``step`` is a measurement step (0, every, 2·every, ...)."""
        return step % self.every == 0

    def __call__(self, model: nn.Module, step: int, data) -> None:
        if not self.due(step):
            return
        x, y = _batch_of(data)
        report = divergence(model, x, lambda out: self.loss(out, y), lr=self.lr, scope=self.scope,
                            per_sample=self.per_sample, options=self.options)
        self.skipped = dict(report.skipped)
        self.records += [{"step": int(step), **row} for row in report.records()]

"""What the meter returns: per module, the per-sample alignment of the effective update with
the ideal one (:class:`LayerDivergence`), and the whole network's (:class:`DivergenceReport`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from affdiv.meter.capture import MeasuredModule
from affdiv.meter.routes import Update, site_factors
from affdiv.verify.metrics import cosine, off_diagonal_share, scale_factor

PER_SAMPLE_METRICS = ("scale", "diagonal_scale", "cosine", "off_diagonal_share")


@dataclass(frozen=True)
class LayerDivergence:
    r"""The alignment of one module's effective update with the ideal one, per sample.

    Args:
        name: the module's name in ``model.named_modules()``.
        kind: its class name.
        scope: ``"layer"`` or ``"network"``.
        scale, cosine: per sample, shape (B,).
        diagonal_scale, off_diagonal_share: per sample, shape (B,); None without ``per_sample``.
        batch_cosine: cos(u, u*) of the whole batch's update.
        input_norm: ‖x_i‖ of the module's first tensor input, per sample, shape (B,).
        route, diagonal_route: how u and d were computed (closed form, jvp, vmap, masked, ...).
        site_diagonal_scale: per sample, shape (B,), layer scope and closed forms only (the affine
            family, Conv, PatchNormConv): the scale of each *site*'s own update (one token, one
            output position), Σ_s k_s‖g_s‖²/Σ_s‖g_s‖² over the sample's sites with k_s the site's
            kernel diagonal (‖x_s‖²+1, ‖P_s‖²+1; 1 for AffineLike and PatchNorm). For one-row
            samples it equals ``diagonal_scale``; with tokens or positions, ``diagonal_scale``
            also holds the same sample's other sites.
        parameters: the names (relative to the module) of the parameters that step: its own, and
            those of a child whose forward it bypasses (``out_proj.weight`` of MultiheadAttention).
        effective, ideal, diagonal: u, u* = −ηg and d, shaped like the output (``keep_updates``);
            for an output that is a tuple, its tensors that reach the loss, each flattened per
            sample and joined, shape (B, ·).

    NaN in a per-sample metric marks a sample whose ideal update (or own update) is 0: no factor
    is defined there.
    """

    name: str
    kind: str
    scope: str
    scale: Tensor
    cosine: Tensor
    batch_cosine: float
    input_norm: Tensor
    route: str
    diagonal_scale: Tensor | None = None
    off_diagonal_share: Tensor | None = None
    diagonal_route: str | None = None
    site_diagonal_scale: Tensor | None = None
    parameters: tuple[str, ...] = ()
    effective: Tensor | None = field(default=None, repr=False)
    ideal: Tensor | None = field(default=None, repr=False)
    diagonal: Tensor | None = field(default=None, repr=False)

    @property
    def diagonal_norm_correlation(self) -> float:
        """Pearson correlation of the diagonal scale with ‖x_i‖ over the batch; NaN where it is
        undefined: no per-sample diagonals, fewer than 3 samples, or a diagonal scale constant to
        rounding (relative spread ≤ 10³ ε of the dtype: the corrections' claim)."""
        if self.diagonal_scale is None:
            return math.nan
        return correlation(self.diagonal_scale, self.input_norm)

    def summary(self) -> dict[str, float]:
        """Batch summaries (floats; NaN where undefined): per-sample metrics' mean and median
        over the samples where they are defined, the spread (std/|mean|) of the two scales, the
        batch cosine, the correlation with ‖x‖, and how many samples had an undefined metric."""
        out: dict[str, float] = {}
        defined = torch.ones_like(self.scale, dtype=torch.bool)
        for metric in PER_SAMPLE_METRICS:
            values = getattr(self, metric)
            if values is None:
                continue
            values = values.detach().double().cpu()
            finite = torch.isfinite(values)
            defined &= finite
            v = values[finite]
            out[f"{metric}_mean"] = float(v.mean()) if len(v) else math.nan
            out[f"{metric}_median"] = float(v.median()) if len(v) else math.nan
            if metric in ("scale", "diagonal_scale"):
                out[f"{metric}_cv"] = spread(v)
        if self.site_diagonal_scale is not None:
            v = self.site_diagonal_scale.detach().double().cpu()
            v = v[torch.isfinite(v)]
            out["site_diagonal_scale_mean"] = float(v.mean()) if len(v) else math.nan
            out["site_diagonal_scale_cv"] = spread(v)
        out["batch_cosine"] = self.batch_cosine
        out["diagonal_norm_correlation"] = self.diagonal_norm_correlation
        out["undefined_samples"] = float((~defined).sum())
        return out


@dataclass(frozen=True)
class DivergenceReport:
    """What :func:`divergence` returns.

    ``layers``: module name -> :class:`LayerDivergence`, in ``named_modules`` order;
    ``skipped``: module name -> why it was not measured; ``scope``, ``lr``, ``reduction``,
    ``batch_size``, ``per_sample``; ``network_diagonal_route``: how the network scope's diagonals
    were computed (None in layer scope or without ``per_sample``).
    """

    layers: dict[str, LayerDivergence]
    skipped: dict[str, str]
    scope: str
    lr: float
    reduction: str
    batch_size: int
    per_sample: bool
    network_diagonal_route: str | None = None

    def summary(self) -> dict[str, dict[str, float]]:
        """Per module, :meth:`LayerDivergence.summary`."""
        return {name: layer.summary() for name, layer in self.layers.items()}

    def records(self) -> list[dict]:
        """One JSON-ready dict per module: name, kind, scope, batch size, routes and its summary,
        with NaN written as None (JSON has no NaN)."""
        rows = []
        for name, layer in self.layers.items():
            row = {"layer": name, "kind": layer.kind, "scope": self.scope, "batch_size": self.batch_size,
                   "route": layer.route, "diagonal_route": layer.diagonal_route}
            row.update({k: finite_or_none(v) for k, v in layer.summary().items()})
            rows.append(row)
        return rows


def finite_or_none(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def spread(values: Tensor) -> float:
    """std/|mean| (population std) of the finite values; NaN for an empty set or a zero mean."""
    v = values[torch.isfinite(values)].double()
    if len(v) == 0 or float(v.mean()) == 0:
        return math.nan
    return float(v.std(unbiased=False) / v.mean().abs()) if len(v) > 1 else 0.0


def correlation(values: Tensor, norms: Tensor) -> float:
    """Pearson correlation of ``values`` with ``norms`` over the samples where both are finite;
    NaN where undefined (fewer than 3 samples, or either constant to rounding: relative spread
    ≤ 10³ ε of ``values``' dtype)."""
    eps = torch.finfo(values.dtype).eps if values.is_floating_point() else 2.0**-52
    keep = torch.isfinite(values) & torch.isfinite(norms)
    a, b = values[keep].double(), norms[keep].double()
    if len(a) < 3 or not spread(a) > 1e3 * eps or not spread(b) > 1e3 * eps:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def layer_metrics(m: MeasuredModule, scope: str, lr: float, update: Update, diagonal: Update | None,
                  keep: bool) -> LayerDivergence:
    """The :class:`LayerDivergence` of module ``m`` in ``scope`` under the step of rate ``lr``:
    ``update`` its effective update u of the batch, ``diagonal`` its per-sample diagonals d (None
    where not computed), each with its route; ``keep``: keep u, u* and d in the record."""
    ideal = -lr * m.grad
    u = update.value.detach()
    d = None if diagonal is None else diagonal.value
    x = next((a for a in m.record.args if isinstance(a, Tensor)), None)
    batch = ideal.shape[0]
    if x is not None and x.dim() > 0 and x.shape[0] == batch and x.is_floating_point():
        input_norm = x.reshape(batch, -1).norm(dim=-1)
    else:
        input_norm = torch.full((batch,), math.nan, dtype=ideal.dtype, device=ideal.device)
    site = None
    if scope == "layer" and d is not None and x is not None and not m.record.kwargs:
        try:
            k = site_factors(m.module, x, m.grad)
        except Exception:  # a geometry theory.conv does not model: no site scale, never a guess
            k = None
        if k is not None:
            site = scale_factor(k * ideal, ideal)
    return LayerDivergence(
        name=m.name,
        kind=type(m.module).__name__,
        scope=scope,
        scale=scale_factor(u, ideal),
        cosine=cosine(u, ideal),
        batch_cosine=float(cosine(u.reshape(1, -1), ideal.reshape(1, -1))[0]),
        input_norm=input_norm,
        route=update.route,
        diagonal_scale=None if d is None else scale_factor(d, ideal),
        off_diagonal_share=None if d is None else off_diagonal_share(u, d),
        diagonal_route=None if diagonal is None else diagonal.route,
        site_diagonal_scale=site,
        parameters=tuple(m.step),
        effective=u if keep else None,
        ideal=ideal if keep else None,
        diagonal=d if keep else None,
    )

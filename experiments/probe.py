"""`affdiv probe`: the mechanism behind the batch-size prediction, measured on real data.

For each member of the affine family (theory's reference layers, float64) and each batch size B,
a freshly initialised layer maps a batch of real inputs to class logits; one SGD step on the
mean cross-entropy is measured with :func:`affdiv.verify.effective_update`, and its alignment with
the ideal activation step −η g is summarised over ``repeats`` random batches:

    diagonal_scale_cv    std/mean over samples of each sample's own factor, the scale of −ηΘ_ii g_i
                         against u*_i (K_ii for this family): 0 when every sample is scaled alike,
                         the corrections' claim
    scale_cv             the same for the whole update u_i (off-diagonal terms included)
    cosine               mean over samples of cos(u_i, u*_i)
    batch_cosine         cos(u, u*) of the whole batch's update
    off_diagonal_share   mean over samples of ‖Σ_{j≠i} Θ_ij g_j‖ / ‖Θ_ii g_i‖

The theory predicts scale_cv ≈ 0 for the corrections at every B, and an off-diagonal share that
grows with B for correlated inputs for every member: what the corrections cannot remove.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from affdiv.atomic import atomic_write
from affdiv.experiments.data.dataset import load_dataset
from affdiv.provenance import provenance
from affdiv.theory.affine import MEMBERS, ReferenceAffineFamily
from affdiv.verify.engine import effective_update
from affdiv.verify.metrics import alignment, cosine

METRICS = ("diagonal_scale_cv", "scale_cv", "cosine", "batch_cosine", "off_diagonal_share")
LR = 0.1


def coefficient_of_variation(values: torch.Tensor) -> float:
    return float(values.std(unbiased=False) / values.mean().abs()) if len(values) > 1 else 0.0


def probe_once(member: str, x: torch.Tensor, y: torch.Tensor, classes: int, seed: int) -> dict[str, float]:
    """The five alignment metrics (``METRICS``) of one SGD step of a fresh layer on the batch (x, y)."""
    torch.manual_seed(seed)
    layer = ReferenceAffineFamily(member, x.shape[1], classes)

    def per_sample_loss(z: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(z, y, reduction="none")

    update = effective_update(layer, x, loss=per_sample_loss, reduction="mean", lr=LR)
    metrics = alignment(layer, x, update.grad_output, LR, update.linear)
    return {
        "diagonal_scale_cv": coefficient_of_variation(metrics.diagonal_scale),
        "scale_cv": coefficient_of_variation(metrics.scale),
        "cosine": float(metrics.cosine.mean()),
        "batch_cosine": float(cosine(update.linear.reshape(1, -1), update.ideal.reshape(1, -1))),
        "off_diagonal_share": float(metrics.off_diagonal_share.mean()),
    }


def run_probe(dataset, members, batch_sizes, repeats: int, seed: int, progress=None) -> list[dict]:
    """One row per (member, batch size): mean and standard error of each metric over repeats."""
    split = dataset.train.flat()
    x_all, y_all = split.x.double(), split.y
    rng = np.random.default_rng(seed)
    rows, total, done = [], len(members) * len(batch_sizes), 0
    for member in members:
        for batch in batch_sizes:
            if batch > len(y_all):
                raise ValueError(f"batch size {batch} exceeds the {len(y_all)} training samples of {dataset.name}")
            samples = []
            for r in range(repeats):
                index = torch.from_numpy(rng.choice(len(y_all), size=batch, replace=False))
                samples.append(probe_once(member, x_all[index], y_all[index], dataset.num_classes, seed + r))
            row = {"member": member, "batch_size": batch, "repeats": repeats}
            for name in METRICS:
                values = np.array([s[name] for s in samples])
                row[name] = float(values.mean())
                row[f"{name}_se"] = float(values.std(ddof=1) / np.sqrt(repeats)) if repeats > 1 else float("nan")
            rows.append(row)
            done += 1
            if progress:
                progress(done, total, row)
    return rows


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# affdiv probe — {meta['dataset']}",
        "",
        "Alignment of one SGD step's effective activation update with the ideal −ηg, per layer and batch size "
        f"(mean ± s.e. over {meta['repeats']} random batches; fresh layer, mean cross-entropy, η = {LR}).",
        "",
        "| layer | B | diagonal scale CV | scale CV | cosine | batch cosine | off-diagonal share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r[m]:.4g} ± {r[m + '_se']:.2g}" for m in METRICS)
        lines.append(f"| {r['member']} | {r['batch_size']} | {cells} |")
    lines += ["", "```json", json.dumps(meta["provenance"], indent=2), "```", ""]
    return "\n".join(lines)


def probe(out: str | Path, *, dataset: str = "digits", data_dir: str | None = None,
          members: list[str] | None = None, batch_sizes: list[int] = (1, 4, 16, 64, 256), repeats: int = 5,
          seed: int = 0) -> dict[str, Path]:
    """Measure every member at every batch size and write ``probe.json``, ``probe.md`` and
    ``probe.png`` under ``out``; returns the written paths."""
    members = list(members or [m.name for m in MEMBERS])
    unknown = sorted(set(members) - {m.name for m in MEMBERS})
    if unknown:
        raise ValueError(f"--members: unknown member(s) {unknown}; expected among {[m.name for m in MEMBERS]}")
    if repeats < 1 or not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"--repeats and --batch-sizes must be >= 1, got {repeats}, {list(batch_sizes)}")
    start = time.perf_counter()
    data = load_dataset(dataset, data_dir=data_dir, seed=seed)

    def progress(done, total, row):
        print(
            f"[{done}/{total}] {row['member']:<12} B={row['batch_size']:<5} "
            + " ".join(f"{m}={row[m]:.4g}" for m in METRICS),
            flush=True,
        )

    rows = run_probe(data, members, sorted(set(batch_sizes)), repeats, seed, progress)
    out = Path(out)
    meta = {
        "dataset": dataset,
        "repeats": repeats,
        "provenance": provenance(
            seed=seed, data_fingerprint=data.fingerprint, wall_time_s=round(time.perf_counter() - start, 2)
        ),
    }
    paths = {
        "json": atomic_write(out / "probe.json", json.dumps({**meta, "rows": rows}, indent=2) + "\n"),
        "markdown": atomic_write(out / "probe.md", to_markdown(rows, meta)),
    }
    from affdiv.experiments.report import figures  # here: matplotlib only when a figure is drawn

    paths["figure"] = figures.probe_alignment(rows, METRICS, out / "probe.png")
    return paths

"""Seconds `affdiv analyse` takes on a large record CSV (target: 100k rows in under 30 s).

    python benchmarks/analyse_scaling.py [--seeds 5000] [--methods 4] [--batch-sizes 5]
                                         [--calibration-sims 0] [--reference-seeds 1000]

Writes a CSV of seeds x methods x batch sizes records (a planted fall for the corrected layers,
seed effects and noise) to a temporary folder, then times each stage of ``analyse_file`` in this
process: reading and checking the CSV, the analysis (every test and sensitivity analysis), the
calibration (when --calibration-sims > 0) and the report. Prints seconds per stage and the
1-minute load average before and after (on a shared machine the stages stretch with it); asserts
nothing (timing is never a test).

Baseline in the same run: the leave-one-seed-out jackknife of the cross-fitted contrast
(``contrast._jackknife_replicates``, vectorised over the left-out seeds) against its definition, the
cross-fit redone on the table with each seed deleted (what the analysis did before: O(seeds^2 x
batch sizes)), on the first ``--reference-seeds`` seeds of each method: the ratio of their times
and the largest relative difference of the replicates.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

METHODS = ("affine_like", "norm_l2", "affine", "batchnorm", "layernorm", "rmsnorm")
BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024)


def write_records(path: Path, n_seeds: int, n_methods: int, n_batch_sizes: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    batch_sizes = BATCH_SIZES[:n_batch_sizes]
    x = np.log2(batch_sizes)
    rows = 0
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["method", "batch_size", "seed", "metric"])
        for method in METHODS[:n_methods]:
            slope = -0.01 if method in ("affine_like", "norm_l2") else 0.0
            values = 0.9 + rng.normal(0, 0.01, (n_seeds, 1)) + slope * x + rng.normal(0, 0.005, (n_seeds, x.size))
            for s in range(n_seeds):
                for b, value in zip(batch_sizes, values[s]):
                    writer.writerow([method, b, s, repr(float(value))])
                    rows += 1
    return rows


def jackknife_by_refitting(table: np.ndarray) -> np.ndarray:
    """The definition: for each seed t, the cross-fitted estimate on the table without row t."""
    from affdiv.experiments.analysis import contrast

    replicates = []
    for t in range(table.shape[0]):
        d, _ = contrast._cross_fit(np.delete(table, t, axis=0))
        replicates.append(float(np.mean(d[np.isfinite(d)])) if np.isfinite(d).any() else math.nan)
    return np.array(replicates)


def jackknife_baseline(records: list[dict], n_seeds: int) -> list[tuple[str, int, float, float, float]]:
    """(method, seeds, seconds vectorised, seconds by refitting, largest difference of the replicates
    relative to the largest replicate) per method, on the seeds below ``n_seeds``."""
    from affdiv.experiments.analysis import contrast

    by_method: dict[str, list] = {}
    for record in records:
        if record["seed"] < n_seeds:
            by_method.setdefault(record["method"], []).append(record)
    rows = []
    for method, method_rows in by_method.items():
        _, _, table = contrast._table(method_rows, "metric", 1.0)
        d, _ = contrast._cross_fit(table)
        start = time.perf_counter()
        fast = contrast._jackknife_replicates(table, d)
        fast_seconds = time.perf_counter() - start
        start = time.perf_counter()
        slow = jackknife_by_refitting(table)
        slow_seconds = time.perf_counter() - start
        scale = max(float(np.max(np.abs(slow))), np.finfo(np.float64).tiny)
        rows.append((method, table.shape[0], fast_seconds, slow_seconds, float(np.max(np.abs(fast - slow))) / scale))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5000)
    parser.add_argument("--methods", type=int, default=4, choices=range(2, len(METHODS) + 1))
    parser.add_argument("--batch-sizes", type=int, default=5, choices=range(3, len(BATCH_SIZES) + 1))
    parser.add_argument("--calibration-sims", type=int, default=0)
    parser.add_argument("--reference-seeds", type=int, default=1000,
                        help="seeds of the jackknife baseline (the refit takes seconds per 1000; 0: none)")
    args = parser.parse_args()

    from affdiv.experiments.analysis.calibration import calibrate_for
    from affdiv.experiments.analysis.decision import analyse
    from affdiv.experiments.analysis.groups import label_groups
    from affdiv.experiments.analysis.settings import AnalysisSettings
    from affdiv.experiments.records import read_csv
    from affdiv.experiments.report.writer import write_report

    class Times(dict):
        """Stage -> seconds, each printed (to stderr) as it finishes."""

        def __setitem__(self, stage, seconds):
            super().__setitem__(stage, seconds)
            print(f"  {stage}: {seconds:.2f} s", file=sys.stderr, flush=True)

    times = Times()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "records.csv"
        rows = write_records(path, args.seeds, args.methods, args.batch_sizes)
        print(f"{rows} records: {args.seeds} seeds x {args.methods} methods x {args.batch_sizes} batch sizes",
              file=sys.stderr)
        start = time.perf_counter()
        records = read_csv(path)
        times["read and check the CSV"] = time.perf_counter() - start

        start = time.perf_counter()
        settings = AnalysisSettings(group_by=label_groups(records))
        analysis = analyse(records, settings)
        times["analyse (all tests and sensitivity analyses)"] = time.perf_counter() - start

        start = time.perf_counter()
        analyse(records, settings.replace(sensitivity=False))
        times["analyse without the sensitivity analyses"] = time.perf_counter() - start

        calibration = None
        if args.calibration_sims:
            start = time.perf_counter()
            calibration = calibrate_for(analysis, n_sims=args.calibration_sims)
            times[f"calibration ({args.calibration_sims} sims per slope)"] = time.perf_counter() - start

        start = time.perf_counter()
        write_report(Path(folder) / "report", analysis, records=records, provenance={}, calibration=calibration)
        times["write the report"] = time.perf_counter() - start

    load_after = os.getloadavg()[0]
    baseline = jackknife_baseline(records, args.reference_seeds) if args.reference_seeds > 0 else []

    width = max(map(len, times))
    for stage, seconds in times.items():
        print(f"{stage:<{width}}  {seconds:8.2f} s")
    core = sum(v for k, v in times.items() if not k.startswith("analyse without"))
    print(f"{'total of `affdiv analyse`':<{width}}  {core:8.2f} s")
    print(f"load average (1 min) before / after the stages: {load_before:.2f} / {load_after:.2f} on "
          f"{os.cpu_count()} cores")
    for method, seeds, fast, slow, difference in baseline:
        print(f"jackknife of {method}, {seeds} seeds: {fast:.4f} s vectorised, {slow:.2f} s by "
              f"refitting per left-out seed ({slow / fast:.0f}x); largest relative difference {difference:.1e}")


if __name__ == "__main__":
    main()

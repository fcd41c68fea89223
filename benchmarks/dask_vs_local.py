"""Throughput of the dask executor against the local process pool, measured in one run.

    python benchmarks/dask_vs_local.py [--seeds K] [--workers 2] [--rounds 1] [--json PATH]

The sweep is the ``smoke`` preset (digits, its grid as packaged; ``--seeds K`` keeps its first K
seeds, a reduced grid, and says so). Each round trains it twice from scratch, each time into a
fresh results store in a temporary folder, with ``run_sweep``: once with the local process pool
(``executor="local"``, ``--workers`` processes) and once with the dask executor on a
``LocalCluster`` of ``--workers`` one-thread worker processes started by ``run_sweep``
(``executor="dask"``, loopback only); one torch thread per worker in both. Each is timed end to end,
from the call to its return: worker start-up, dataset loading, training and storing. The
throughput is runs per second; the ratio dask / local (target >= 0.8) is printed per
round and, over rounds, as the median of the paired ratios. The order alternates between rounds
so that a machine's drift hits both. The stored numbers of the two executors are compared as well.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from affdiv.experiments.runs.options import DaskOptions, SweepOptions
from affdiv.experiments.runs.presets import load_preset
from affdiv.experiments.runs.store import ResultStore
from affdiv.experiments.runs.sweep import run_sweep
from affdiv.provenance import provenance
from affdiv.reporting import write_json

TARGET = 0.8


def _configs(seeds: int | None):
    preset = load_preset("smoke")
    chosen = None if seeds is None else sorted(preset.raw["grid"]["seed"])[:seeds]
    (study,) = preset.studies(seeds=chosen)
    return study.configs


def _time(executor: str, configs, workers: int, folder: Path) -> tuple[float, list]:
    store = ResultStore(folder / f"{executor}.sqlite")
    start = time.perf_counter()
    options = SweepOptions(workers=workers, threads=1, dask=DaskOptions() if executor == "dask" else None)
    outcome = run_sweep(configs, store, options, progress=None)
    seconds = time.perf_counter() - start
    if outcome.ran != len(configs) or getattr(outcome, "failed", []):
        raise SystemExit(f"{executor}: {outcome.ran} of {len(configs)} runs trained, failures {outcome.failed}")
    records = [repr(r) for r in store.records()]
    store.close()
    return seconds, records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, help="keep the preset's first K seeds (default: all 8)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the measurements there")
    args = parser.parse_args(argv)
    configs = _configs(args.seeds)
    load_before = os.getloadavg()
    grid = "the full smoke grid" if args.seeds is None else f"the smoke grid reduced to its first {args.seeds} seeds"
    print(f"{len(configs)} runs ({grid}), {args.workers} workers, {args.rounds} round(s)", flush=True)
    rounds = []
    for index in range(args.rounds):
        order = ("local", "dask") if index % 2 == 0 else ("dask", "local")
        seconds, records = {}, {}
        for executor in order:
            with tempfile.TemporaryDirectory(prefix="affdiv-bench-") as folder:
                seconds[executor], records[executor] = _time(executor, configs, args.workers, Path(folder))
            print(f"round {index + 1}: {executor:5s} {seconds[executor]:7.1f} s  "
                  f"{len(configs) / seconds[executor]:.3f} runs/s", flush=True)
        ratio = seconds["local"] / seconds["dask"]  # = (runs/s of dask) / (runs/s of local)
        same = records["local"] == records["dask"]
        print(f"round {index + 1}: dask / local throughput = {ratio:.3f}; stored numbers identical: {same}", flush=True)
        rounds.append({"local_s": seconds["local"], "dask_s": seconds["dask"], "ratio": ratio, "identical": same})
    ratio = statistics.median(r["ratio"] for r in rounds)
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"dask / local throughput: {ratio:.3f} (median of {len(rounds)} round(s); target >= {TARGET}: {verdict})")
    if args.json:
        import distributed

        record = {"runs": len(configs), "grid": grid, "workers": args.workers, "rounds": rounds, "ratio": ratio,
                  "target": TARGET, "dask_distributed": distributed.__version__,
                  "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
                  "provenance": provenance()}
        write_json(args.json, record)
    return 0


if __name__ == "__main__":  # the LocalCluster's and the pool's workers are spawned: they import this file
    sys.exit(main())

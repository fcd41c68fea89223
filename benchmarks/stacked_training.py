"""Runs per hour of stacked (vmapped) training against one model at a time, measured in one run.

    python benchmarks/stacked_training.py [--threads 2] [--rounds 3] [--seconds 1.5] [--json PATH]
                                          [--arms mlp cnn vit ...] [--batch-sizes B ...] [--members K ...]

A *cell* is a batch size of a Fashion-MNIST study with 8 seeds × 6 learning rates = 48 models:
the MLP arm (784-256-256-256-10, tanh) at B = 16, 64, 256, 1024 and a CNN arm (3 blocks of 32
channels, relu) at B = 16, 128; on request (``--arms``) an arm per vit method (width 32, depth 1,
gelu: 16 patch tokens, 4 heads) at B = 16, 64, 256. Both variants are the harness's own engines
(``training.OneAtATime``, ``stacked.StackedEnsemble``) taking SGD steps on real batches (each
model its own shuffle), so a model-step costs what it costs in a sweep; whole runs differ only
by their evaluations (a few per run). The stacked ensemble holds as many of the cell's models as
fit the default ensemble memory (``grouping.member_bytes``), at most 48; one at a time is timed
on 8 models (its cost per model-step does not depend on how many there are); its step is the
bare loop (forward, ``zero_grad``, ``backward``, ``torch.optim`` step, the loss kept).
``--members K ...`` times K stacked models instead, a row per K (how the gain grows with K). Each round times
one measurement of each variant (a fixed number of steps, about ``--seconds`` long), rounds
interleaved so that the machine's drifts hit both; the speed-up is the median over rounds of
the paired ratio (one-at-a-time / stacked time per model-step) = the ratio of runs per hour.
Targets (issue 13): ≥ 5× at B ≤ 64, ≥ 2× at B = 256, ≥ 1× everywhere. The process keeps freed
memory for reuse as the sweep's workers do (``sweep.keep_freed_memory``), for both variants.

The floor: the arithmetic of a stacked step (K × the FLOPs of one model's step, counted by
``torch.utils.flop_counter`` on forward + backward) at the machine's GEMM rate, measured in the
same run by a ``torch.mm`` of square matrices with the same FLOPs; printed as stacked time /
floor time (1 would be every FLOP at the rate of one large GEMM; above it: memory traffic,
small-GEMM inefficiency, elementwise work and Python/dispatch overhead).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs.config import VIT_METHODS, RunConfig
from affdiv.experiments.runs.grouping import DEFAULT_ENSEMBLE_MEMORY, member_bytes
from affdiv.experiments.runs.stacked import StackedEnsemble
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.experiments.runs.training import OneAtATime, build_member
from affdiv.provenance import provenance

CELL = 48  # 8 seeds × 6 learning rates
ONE_AT_A_TIME_MODELS = 8
LRS = (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4)
ARMS = {
    "mlp": (dict(method="affine", depth=3, width=256, activation="tanh"), (16, 64, 256, 1024)),
    "cnn": (dict(method="conv", depth=3, width=32, activation="relu"), (16, 128)),
    **{method: (dict(method=method, depth=1, width=32, activation="gelu"), (16, 64, 256)) for method in VIT_METHODS},
}
DEFAULT_ARMS = ("mlp", "cnn")
TARGETS = {16: 5.0, 64: 5.0, 128: 2.0, 256: 2.0, 1024: 1.0}  # issue 13's; other batch sizes: never slower


def _engine(kind, config, data, models: int):
    """The first ``models`` of the cell's 48 (seed, lr) models as an engine, and their shuffles."""
    members = [(seed, lr) for seed in range(CELL // len(LRS)) for lr in LRS][:models]
    nets = [build_member(config, data, seed) for seed, _lr in members]
    split = (data.train.x, data.train.y)
    engine = kind(nets, "sgd", [lr for _s, lr in members], [None] * models, [split] * models, [split] * models)
    orders = torch.stack([torch.randperm(len(data.train.y), generator=torch.Generator().manual_seed(seed))
                          for seed, _lr in members])
    return engine, orders


def _time_steps(engine, orders, batch: int, steps: int, start: int) -> float:
    """Seconds for ``steps`` steps from batch number ``start`` of each model's permutation."""
    per_epoch = orders.shape[1] // batch
    begin = time.perf_counter()
    for i in range(start, start + steps):
        j = i % per_epoch
        engine.step(orders[:, j * batch : (j + 1) * batch])
    return time.perf_counter() - begin


def _step_flops(config, data) -> int:
    """FLOPs of one SGD step (forward + backward) of one model at the config's batch size."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_member(config, data, 0)
    x, y = data.train.x[: config.batch_size], data.train.y[: config.batch_size]
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops()


def _gemm_seconds(flops: int) -> float:
    """Seconds of a torch.mm of square float32 matrices with ``flops`` FLOPs (median of 3)."""
    n = max(16, round((flops / 2) ** (1 / 3)))
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(3):
        begin = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * flops / (2 * n**3)


def measure(arm: str, batch: int, data, rounds: int, seconds: float, members: int | None = None) -> dict:
    """One row: ``members`` stacked models (default: as many as fit the default ensemble memory,
    at most the cell's 48) against one at a time."""
    settings, _sizes = ARMS[arm]
    config = RunConfig(dataset="fashion-mnist", batch_size=batch, seed=0, **settings)
    fit = DEFAULT_ENSEMBLE_MEMORY // member_bytes(config, data.input_shape, data.num_classes)
    stacked_models = members or max(1, min(CELL, fit))
    stacked, stacked_orders = _engine(StackedEnsemble, config, data, stacked_models)
    alone, alone_orders = _engine(OneAtATime, config, data, ONE_AT_A_TIME_MODELS)
    # Steps per measurement: about ``seconds`` of the slower variant, from one warm-up step each.
    warm = {name: _time_steps(e, o, batch, 1, 0) for name, (e, o) in
            {"stacked": (stacked, stacked_orders), "alone": (alone, alone_orders)}.items()}
    steps = max(1, round(seconds / max(warm.values())))
    per_model = {"alone": [], "stacked": []}
    for r in range(rounds):
        start = 1 + r * steps
        alone_seconds = _time_steps(alone, alone_orders, batch, steps, start)
        stacked_seconds = _time_steps(stacked, stacked_orders, batch, steps, start)
        per_model["alone"].append(alone_seconds / (steps * ONE_AT_A_TIME_MODELS))
        per_model["stacked"].append(stacked_seconds / (steps * stacked_models))
    ratios = [a / s for a, s in zip(per_model["alone"], per_model["stacked"])]
    flops = _step_flops(config, data) * stacked_models
    floor = _gemm_seconds(flops)
    stacked_step = statistics.median(per_model["stacked"]) * stacked_models
    target = None if members else TARGETS.get(batch, 1.0)  # issue 13's targets are for the default ensembles
    return {
        "arm": arm, "batch_size": batch, "stacked_models": stacked_models, "steps_per_round": steps, "rounds": rounds,
        "alone_ms_per_model_step": 1e3 * statistics.median(per_model["alone"]),
        "stacked_ms_per_model_step": 1e3 * statistics.median(per_model["stacked"]),
        "speedup": statistics.median(ratios), "speedup_rounds": ratios, "target": target,
        "met": None if target is None else statistics.median(ratios) >= target,
        "stacked_step_gflop": flops / 1e9, "gemm_gflops_per_s": flops / floor / 1e9,
        "stacked_over_floor": stacked_step / floor,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (default 3)")
    parser.add_argument("--seconds", type=float, default=1.5, help="about how long one measurement runs")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS),
                        help=f"default: {' '.join(DEFAULT_ARMS)}")
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="of each arm (default: the arm's, listed above)")
    parser.add_argument("--members", nargs="+", type=int,
                        help="stacked ensemble sizes to time, a row each (default: as many as fit the default "
                             "ensemble memory, at most 48)")
    parser.add_argument("--json", help="write the rows and provenance here")
    args = parser.parse_args(argv)
    if not all(1 <= k <= CELL for k in args.members or []):
        parser.error(f"--members: each K must be in 1..{CELL} (a cell's models), got {args.members}")
    if not all(b >= 1 for b in args.batch_sizes or []):
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the sweep's workers do
    started = time.monotonic()
    data = load_dataset("fashion-mnist")
    rows = []
    name_width = max(len(arm) for arm in args.arms)
    print(f"{'arm':{name_width}} {'B':>5} {'K':>3} {'alone ms':>9} {'stacked ms':>10} {'speed-up':>9} {'target':>7} "
          f"{'rounds':>22} {'GEMM GFLOP/s':>12} {'stacked/floor':>13}")
    for arm in args.arms:
        for batch, members in itertools.product(args.batch_sizes or ARMS[arm][1], args.members or [None]):
            row = measure(arm, batch, data, args.rounds, args.seconds, members)
            rows.append(row)
            spread = " ".join(f"{r:.2f}" for r in row["speedup_rounds"])
            target = "—" if row["target"] is None else f"{row['target']:.1f}x"
            print(f"{arm:{name_width}} {batch:5d} {row['stacked_models']:3d} {row['alone_ms_per_model_step']:9.3f} "
                  f"{row['stacked_ms_per_model_step']:10.3f} {row['speedup']:8.2f}x {target:>7} "
                  f"{spread:>22} {row['gemm_gflops_per_s']:12.1f} {row['stacked_over_floor']:13.2f}", flush=True)
    if args.json:
        from affdiv.atomic import atomic_write

        record = {"rows": rows, "provenance": provenance(threads=args.threads, rounds=args.rounds,
                                                         wall_time_s=round(time.monotonic() - started, 1))}
        atomic_write(args.json, json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The weight-gradient pass against oneDNN's product, shape by shape.

    python benchmarks/row_outer_sums.py [--rows 64 256 1024 4096] [--models 48] [--rounds 5]
                                        [--threads 1] [--json PATH]

A stacked linear layer's weight gradient is c = aᵀ b per model, a (K, M, L) the layer's input rows
and b (K, M, N) its output gradient. ``experiments.runs.stacked_matmul.product`` computes it with
the package's pass (``affdiv.layers._fused.row_outer_sums``) where ``_outer_sums_pay`` says so, and
else with oneDNN's matmul of the transposed view aᵀ, as the engine did before. For each M and each
(L, N) of ``SHAPES`` (the vision transformer's layers at width 32 as its engine asks for their
gradients; then larger layers, outside the pass's limits) both are timed on the same operands in
interleaved rounds, each round in the other order; printed: the median over rounds of the paired
ratio oneDNN / pass (above 1: the pass is faster) and whether the engine takes the pass there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from affdiv.atomic import atomic_write, check_writable_file
from affdiv.experiments.runs import stacked_matmul
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.layers import _fused, _native
from affdiv.provenance import provenance

#: (L, N) as the vit's engine asks for them: q, k, v and o (32, 32), the MLP's (32, 64) and (64, 32),
#: the patch embedding (32, 49), the read-out (10, 32); larger layers, which the pass does not take.
SHAPES = ((32, 32), (32, 64), (64, 32), (32, 49), (10, 32), (64, 64), (128, 128), (256, 256))


def _seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(rows: int, left: int, right: int, models: int, rounds: int) -> dict:
    a, b = torch.randn(models, rows, left), torch.randn(models, rows, right)
    out = torch.empty(models, left, right)
    variants = {"onednn": lambda: _native.onednn_bmm_(out, a.transpose(1, 2), b),
                "pass": lambda: _fused.row_outer_sums(a, b)}
    times = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(_seconds(variants[name]))
    ratios = [o / p for o, p in zip(times["onednn"], times["pass"])]
    return {"rows": rows, "left": left, "right": right, "models": models,
            "onednn_ms": 1e3 * statistics.median(times["onednn"]), "pass_ms": 1e3 * statistics.median(times["pass"]),
            "onednn_over_pass": statistics.median(ratios), "rounds": ratios,
            "engine_takes_pass": stacked_matmul._outer_sums_pay(a.transpose(1, 2), b)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 256, 1024, 4096])
    parser.add_argument("--models", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows and provenance here")
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.models < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--rows, --models, --rounds and --threads must be at least 1")
    if not (_fused.available() and _native.onednn_enabled()):
        parser.error("needs the package's compiled passes and oneDNN's matmul, which are not both here")
    if args.json:
        check_writable_file(args.json, "--json")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    results = []
    for rows in args.rows:
        for left, right in SHAPES:
            results.append(measure(rows, left, right, args.models, args.rounds))
            r = results[-1]
            print(f"M={rows:<5d} L={left:<4d} N={right:<4d} oneDNN {r['onednn_ms']:8.3f} ms  "
                  f"pass {r['pass_ms']:8.3f} ms  oneDNN/pass {r['onednn_over_pass']:.2f}  "
                  f"engine takes the pass: {r['engine_takes_pass']}", flush=True)
    if args.json:
        atomic_write(args.json, json.dumps({"rows": results, "provenance": provenance(
            threads=args.threads, rounds=args.rounds, models=args.models)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each of the stacked engine's compiled passes buys in the training step, one pass at a time.

    python benchmarks/fused_passes.py [--arms cnn conv+batchnorm mlp-affine_like vit-affine_like]
                                      [--batch-sizes 16 64 256] [--members K ...] [--passes NAME ...]
                                      [--rounds 5] [--threads 1] [--json PATH]

For an arm of the training roofline (``stacked_training.ARMS``) at each batch size, with as many
stacked models as the roofline holds (or each ``--members`` count: a study's run stacks its few
learning-rate candidates), the stacked engine is built twice for each pass the arm's layers take
(or each of ``--passes``): as it is, and with that pass routed off (a CNN's first block,
``experiments.runs.conv_pool``; its later max-pools with their ReLU, ``experiments.runs.pool_relu``;
the AffineLike and NormLike Functions, ``experiments.runs.stacked_dense``; the vision transformer's
attention, ``experiments.runs.stacked_attention``, and LayerNorms,
``experiments.runs.stacked_layer_norm``; the MLP arms' tanh, ``experiments.runs.activations``), so
that those layers run unfused (the dense layers, attention and LayerNorms in torch operations, tanh
as torch's; with the first block off, its pool and ReLU take the later pools' pass); every other
pass stays on in both. Three routes of the products (``experiments.runs.stacked_matmul``), one of
tanh and one of the update are timed the same way: "thin input gradient", the column layers' Wᵀ g with few
columns computed as (gᵀ W)ᵀ (off: Wᵀ g); "small on torch", the products below ``ONEDNN_MIN_FLOPS``
on torch's ops (off: every product on oneDNN; on an Intel processor with MKL, where no product is
oneDNN's, the two variants of these two are the same code); "MKL on Intel", every product (and the fused SGD
step) on torch's BLAS and the MLP arms' tanh torch's where the BLAS is MKL on an Intel processor
(``ONEDNN_PREFERRED``; off: the products on oneDNN from the line up, the fused step within
oneDNN's lines of bytes and rows, and tanh on its pass, as on other processors, where the two
variants are the same code; the runs of this pass made before tanh and the step's lines followed
the rule measured the products and the step's product alone); "torch's tanh on Intel", that tanh alone
(``activations.takes_pass``; off: the pass wherever it may run; on other processors, and for the
pass "tanh" on such a processor, the two variants are the same code); and "step
in backward", the MLP arms' dense layers making their weights' SGD step in their backward
(``experiments.runs.batched.sgd_stepped``; off: the optimiser's update of those weights, chosen
when the engine is built). Their SGD steps are
timed in interleaved rounds, the two in turn first (each model its own shuffle, as in
``stacked_training``); the printed figure is the median over rounds of the paired ratio without /
with the pass (above 1: the pass makes the step faster). Both engines
train the same models, so the figure is of the step alone, not of a study.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import unittest.mock
from collections.abc import Sequence
from pathlib import Path

import torch

from affdiv.atomic import atomic_write, check_writable_file
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs import (
    activations,
    batched,
    conv_pool,
    pool_relu,
    stacked_attention,
    stacked_dense,
    stacked_layer_norm,
    stacked_matmul,
)
from affdiv.experiments.runs.config import VIT_METHODS, RunConfig
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.provenance import provenance

sys.path.insert(0, str(Path(__file__).parent))
from stacked_training import ARMS, CELL, _engine, _time_steps, cell_models  # noqa: E402  (the roofline's arms and engines)

#: The passes, each as the routing function (or value) that, patched to say "no", sends its layers
#: unfused, and the methods whose layers (in the roofline's arms, ``ARMS``) take it.
CNN_METHODS = ("conv", "conv+batchnorm", "patchnorm")
DENSE_METHODS = ("affine_like", "norm_l2", "vit-affine_like", "vit-affine_like-qknorm")
TANH_METHODS = ("affine", "affine_like", "norm_l2")  # (the MLP arms: tanh)
PASSES = {"first block": (conv_pool, "first_block_length", lambda layers: 0, CNN_METHODS),
          "later pools": (pool_relu, "takes", lambda pool: False, CNN_METHODS),
          "dense scale": (stacked_dense, "usable", lambda *tensors: False, DENSE_METHODS),
          "attention": (stacked_attention, "usable", lambda *tensors: False, VIT_METHODS),
          "layer norm": (stacked_layer_norm, "usable", lambda *tensors: False,
                         tuple(method for method in VIT_METHODS if method != "vit-nonorm")),
          "tanh": (activations, "usable", lambda x: False, TANH_METHODS),
          "thin input gradient": (stacked_matmul, "thin_input_gradient", lambda left, right: False, ("affine",)),
          "small on torch": (stacked_matmul, "ONEDNN_MIN_FLOPS", 0, (*TANH_METHODS, *CNN_METHODS, *VIT_METHODS)),
          "MKL on Intel": (stacked_matmul, "ONEDNN_PREFERRED", True, (*TANH_METHODS, *CNN_METHODS, *VIT_METHODS)),
          "torch's tanh on Intel": (activations, "takes_pass", activations.usable, TANH_METHODS),
          "step in backward": (batched, "sgd_stepped", lambda layers, optimizer, params: (), TANH_METHODS)}


def routed_off(name: str) -> contextlib.AbstractContextManager:
    """Inside the block, the pass ``name`` of PASSES sends its layers unfused: engines built there
    (the CNN passes are chosen when the engine is built) and steps taken there (the others are
    chosen at every call)."""
    module, routing, off, _methods = PASSES[name]
    return unittest.mock.patch.object(module, routing, off)


def measure(arm: str, batch: int, data, rounds: int, members: int | None = None,
            passes: Sequence[str] = tuple(PASSES)) -> list[dict]:
    """A row per pass of ``passes`` that the arm takes: the step's ms with and without it, and the
    median paired ratio; ``members`` stacked models (default: as many as the roofline holds)."""
    settings, _sizes = ARMS[arm]
    taken = [name for name in passes if settings["method"] in PASSES[name][-1]]
    if not taken:
        return []
    config = RunConfig(dataset="fashion-mnist", batch_size=batch, seed=0, **settings)
    models = members or cell_models(config, data)
    kind = stacked_engine(build_member(config, data, 0))
    steps = max(2, 400 // batch)
    with_pass, orders = _engine(kind, config, data, models)
    _time_steps(with_pass, orders, batch, 2, 0)  # (warmed up as each engine without a pass is)
    rows = []
    for name in taken:
        with routed_off(name):
            without, _orders = _engine(kind, config, data, models)
            _time_steps(without, orders, batch, 2, 0)
        times = {"with": [], "without": []}
        engines = (("with", with_pass, contextlib.nullcontext()), ("without", without, routed_off(name)))
        for r in range(rounds):  # (each round in the other order: neither variant always runs first)
            for label, engine, routes in engines[:: 1 if r % 2 == 0 else -1]:
                with routes:
                    times[label].append(_time_steps(engine, orders, batch, steps, 2 + r * steps) / steps * 1000)
        ratios = [b / a for a, b in zip(times["with"], times["without"])]
        rows.append({"arm": arm, "batch_size": batch, "stacked_models": models, "pass": name,
                     "with_ms_per_step": statistics.median(times["with"]),
                     "without_ms_per_step": statistics.median(times["without"]),
                     "without_over_with": statistics.median(ratios), "rounds": ratios})
        print(f"{arm:16s} B={batch:<5d} K={models:<3d} {name:19s} with {rows[-1]['with_ms_per_step']:8.1f} ms  "
              f"without {rows[-1]['without_ms_per_step']:8.1f} ms  without/with {rows[-1]['without_over_with']:.3f}",
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    arms = [arm for arm, (settings, _sizes) in ARMS.items()
            if any(settings["method"] in methods for *_pass, methods in PASSES.values())]
    parser.add_argument("--arms", nargs="+", choices=arms, default=arms)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--members", nargs="+", type=int,
                        help="stacked models per cell, one row each (default: as many as the roofline holds, "
                             "within the default ensemble memory; a count given here is not held to it)")
    parser.add_argument("--passes", nargs="+", choices=list(PASSES), default=list(PASSES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows and provenance here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1 or min(args.batch_sizes) < 1:
        parser.error("--rounds, --threads and every batch size must be at least 1")
    if not all(1 <= k <= CELL for k in args.members or []):
        parser.error(f"--members: each K must be in 1..{CELL} (a cell's models), got {args.members}")
    if args.json:
        check_writable_file(args.json, "--json")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    data = load_dataset("fashion-mnist")
    rows = [row for arm in args.arms for batch in args.batch_sizes for members in args.members or [None]
            for row in measure(arm, batch, data, args.rounds, members, args.passes)]
    if args.json:
        atomic_write(args.json, json.dumps({"rows": rows, "provenance": provenance(threads=args.threads,
                                                                                    rounds=args.rounds)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

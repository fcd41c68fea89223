"""Where a stacked CNN step's time goes, and the first block fused against unfused.

    python benchmarks/cnn_first_block.py [--batch-sizes 16 ...] [--method conv] [--rounds 5]
                                         [--threads 1] [--json PATH]

For the training roofline's CNN arm (``stacked_training.ARMS``: 3 blocks of 32 channels on
Fashion-MNIST's 28×28 images, relu; ``--method patchnorm`` for PatchNorm convolutions) at each batch
size, with as many stacked models as the roofline holds (at most 48):

* **the step, op by op** (the first block unfused): one stacked SGD step run under a dispatch mode
  that times every torch op on its own (ms per step, summed by op and the shape of its first
  argument; the mode's own overhead is left out of each op's time), with the ops of the first
  block (its convolution, forward and backward, and its max-pool, forward and backward) summed
  apart, and the step's convolution FLOPs, the first block's share of them;
* **the first block alone**, fused (``experiments.runs.conv_pool``) against the same block as the
  batched engine runs it unfused (a grouped convolution, then ``max_pool2d`` and the ReLU after it),
  forward + backward on the step's own shapes, rounds interleaved: the median over rounds of the
  paired ratio (unfused / fused).

The dispatch mode takes the step off the fused pass (a mode would not see it), so the op-by-op
table is of the unfused step, which is what it is for.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs.config import RunConfig
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.experiments.runs.training import build_member, stacked_engine
from affdiv.provenance import provenance

sys.path.insert(0, str(Path(__file__).parent))
from stacked_training import ARMS, CONV_OPS, _engine, cell_models  # noqa: E402  (the roofline's arm and engine)


class OpTimer(TorchDispatchMode):
    """Seconds per (op name, shape of its first tensor argument), each op timed on its own."""

    def __init__(self):
        super().__init__()
        self.seconds = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        begin = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.seconds[(func.overloadpacket.__name__, None if first is None else tuple(first.shape))] += \
            time.perf_counter() - begin
        return out


def in_first_block(name: str, shape: tuple | None, batch: int, size: tuple[int, int]) -> bool:
    """Whether an op of an unfused stacked step belongs to its first block: every op on the
    full-resolution planes of the batch (first argument (B, …, H, W), or (K, B, 1, H, W): the
    input's copy, the convolutions, PatchNorm's scale, the first pool; not the gather of the
    batch from the training split), and the first pool's backward (its first argument the pooled
    gradient, (B, K·C, H/2, W/2))."""
    if shape is None or len(shape) < 4 or not (shape[0] == batch or (len(shape) == 5 and shape[1] == batch)):
        return False
    half = (size[0] // 2, size[1] // 2)
    return shape[-2:] == size or (name == "max_pool2d_with_indices_backward" and shape[-2:] == half)


def op_table(engine, orders, batch: int, size: tuple[int, int], steps: int = 3) -> dict:
    """The step's ops timed one by one (the unfused step: see the module docstring); ``size`` the
    images' (H, W)."""
    engine.step(orders[:, :batch])
    timer = OpTimer()
    with timer:
        for i in range(1, steps + 1):
            engine.step(orders[:, i * batch : (i + 1) * batch])
    per_step = {key: 1e3 * s / steps for key, s in timer.seconds.items()}
    in_block = {key: ms for key, ms in per_step.items() if in_first_block(*key, batch, size)}
    return {"ops_ms_per_step": sorted(([name, shape, ms] for (name, shape), ms in per_step.items()),
                                      key=lambda row: -row[2]),
            "total_ms": sum(per_step.values()), "first_block_ms": sum(in_block.values()),
            "first_block_ops": sorted(([name, shape, ms] for (name, shape), ms in in_block.items()),
                                      key=lambda row: -row[2])}


def conv_flops(config, data, models: int) -> dict[str, float]:
    """GFLOP of one stacked step's convolutions, and of its first convolution's (forward and
    weight gradient), counted by torch.utils.flop_counter on one model."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_member(config, data, 0)
    x, y = data.train.x[: config.batch_size], data.train.y[: config.batch_size]
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    total = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op).split(".")[-1] in CONV_OPS)
    first = model[0]
    with FlopCounterMode(display=False) as counter:
        first(x).sum().backward()
    return {"conv_gflop": models * total / 1e9, "first_conv_gflop": models * counter.get_total_flops() / 1e9}


def block_timing(engine, orders, batch: int, rounds: int) -> dict:
    """The first block alone, fused and unfused, forward + backward on the step's shapes."""
    xs, _ys = engine._gather(orders[:, :batch])
    name, _block, fused_layer = engine.layers[0]
    state = {key[len(name) + 1:]: t.detach().requires_grad_() for key, t in engine.params.items()
             if key.startswith(name + ".")}
    grad = torch.randn_like(fused_layer(xs, state, len(engine), True))

    def run():
        for t in state.values():
            t.grad = None
        fused_layer(xs, state, len(engine), True).backward(grad)

    from affdiv.layers import _fused

    def unfused():
        with _fused.disabled():
            run()

    for fn in (run, unfused):
        fn()
    fused_ms, unfused_ms = [], []
    for _ in range(rounds):
        for fn, into in ((run, fused_ms), (unfused, unfused_ms)):
            begin = time.perf_counter()
            fn()
            into.append(1e3 * (time.perf_counter() - begin))
    return {"fused_ms": statistics.median(fused_ms), "unfused_ms": statistics.median(unfused_ms),
            "unfused_over_fused": statistics.median(u / f for u, f in zip(unfused_ms, fused_ms))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 256])
    parser.add_argument("--method", choices=["conv", "patchnorm"], default="conv")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows and provenance here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not all(b >= 1 for b in args.batch_sizes):
        parser.error(f"--rounds and --batch-sizes must be >= 1, got {args.rounds} and {args.batch_sizes}")
    if args.json:
        from affdiv.atomic import check_writable_file

        check_writable_file(args.json, "--json")
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    data = load_dataset("fashion-mnist")
    rows = []
    for batch in args.batch_sizes:
        settings = {**ARMS["cnn"][0], "method": args.method}
        config = RunConfig(dataset="fashion-mnist", batch_size=batch, seed=0, **settings)
        models = cell_models(config, data)
        engine, orders = _engine(stacked_engine(build_member(config, data, 0)), config, data, models)
        if type(engine.layers[0][1]) is not torch.nn.Sequential:  # (batched_layers' entry of a fused block)
            parser.error(f"the {args.method} CNN's first block does not fuse here")
        row = {"method": args.method, "batch_size": batch, "stacked_models": models, **conv_flops(config, data, models),
               **op_table(engine, orders, batch, tuple(data.input_shape[1:])),
               **block_timing(engine, orders, batch, args.rounds)}
        rows.append(row)
        print(f"{args.method} B={batch} K={models}: step {row['total_ms']:.1f} ms op by op, first block "
              f"{row['first_block_ms']:.1f} ms ({100 * row['first_block_ms'] / row['total_ms']:.0f}%) for "
              f"{100 * row['first_conv_gflop'] / row['conv_gflop']:.1f}% of the convolutions' FLOPs; the block "
              f"alone fused {row['fused_ms']:.1f} ms, unfused {row['unfused_ms']:.1f} ms "
              f"({row['unfused_over_fused']:.2f}x)", flush=True)
    if args.json:
        from affdiv.atomic import atomic_write

        atomic_write(args.json, json.dumps({"rows": rows, "provenance": provenance(threads=args.threads,
                                                                                    rounds=args.rounds)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

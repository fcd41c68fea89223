"""The corrected layers are not a learning-rate drop-in: test accuracy of a converted MLP against the
plain one over a learning-rate grid, on the harness's default data (digits).

A tanh MLP 64 → 128 → 128 → 10, each nn.Linear converted by ``affdiv.layers.convert`` (or not),
trained by plain SGD for 100 steps of batch 32 (cross-entropy), from the same initial weights per
seed; the mean test accuracy over 5 seeds per (layer, lr). The README quotes the result.

The per-sample factor of the update (the diagonal of the layer's kernel) sets the effective step:
‖x‖² + 1 for nn.Linear (65 on the standardised 64-pixel input here, about 29 on the hidden tanh
layer), 1 for AffineLike, 2 for NormLike("l2"), in + 1 for NormLike("rms"); so at one learning rate
AffineLike steps tens of times less than the plain layer, NormLike("rms") about as much.

    python benchmarks/lr_rule_of_thumb.py [--seeds 5] [--steps 100] [--json PATH]

Takes about 2 minutes on one core.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch import nn

from affdiv.experiments.data import load_dataset
from affdiv.layers import convert
from affdiv.reporting import write_json

LRS = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
KINDS = (None, "affine_like", "norm_l2", "norm_rms")


def mlp(d_in: int, width: int, classes: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, classes))


def accuracy(kind: str | None, lr: float, seed: int, data, steps: int, batch: int) -> float | None:
    """Test accuracy after ``steps`` SGD steps; None if the outputs are not finite (diverged)."""
    torch.manual_seed(seed)
    model = mlp(data.train.x.shape[1], 128, data.num_classes)
    if kind is not None:
        convert(model, linear=kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, len(data.train), (batch,), generator=generator)
        loss = nn.functional.cross_entropy(model(data.train.x[index]), data.train.y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        out = model(data.test.x)
    return float((out.argmax(1) == data.test.y).float().mean()) if torch.isfinite(out).all() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="seeds per (layer, lr)")
    parser.add_argument("--steps", type=int, default=100, help="SGD steps")
    parser.add_argument("--batch", type=int, default=32, help="batch size")
    parser.add_argument("--json", default=None, help="also write the accuracies here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("digits", seed=0).flat()
    torch.manual_seed(0)
    with torch.no_grad():
        hidden = mlp(data.train.x.shape[1], 128, data.num_classes)[:2](data.train.x)
    print(f"mean ‖x‖² of the input {float((data.train.x ** 2).sum(1).mean()):.1f}, "
          f"of the first hidden layer {float((hidden ** 2).sum(1).mean()):.1f}")
    results, start = {}, time.perf_counter()
    for kind, lr in itertools.product(KINDS, LRS):
        accs = [accuracy(kind, lr, seed, data, args.steps, args.batch) for seed in range(args.seeds)]
        finite = [a for a in accs if a is not None]
        mean = sum(finite) / len(finite) if len(finite) == len(accs) else None
        results.setdefault(kind or "plain", {})[str(lr)] = {"mean": mean, "per_seed": accs}
        shown = "diverged" if mean is None else f"{mean:.3f}"
        print(f"{kind or 'plain':<12} lr={lr:<5} test accuracy {shown}", flush=True)
    print(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(args.json, {"steps": args.steps, "batch": args.batch, "seeds": args.seeds, "results": results})


if __name__ == "__main__":
    main()

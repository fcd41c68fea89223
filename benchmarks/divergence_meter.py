"""Timing and memory of the divergence meter (affdiv.meter), ratios measured in one run.

    python benchmarks/divergence_meter.py [--json PATH] [--threads 1] [--rounds 11] [--quick]

1. Against one training step. For each network, every round times one forward+backward of the
   network (mean cross-entropy, ``loss.backward()``, gradients reset to None; no optimizer
   update) and then each meter variant on the same batch, interleaved; it prints the median over
   rounds of the paired ratio t(variant)/t(step) with its distribution-free 95% interval
   (``affdiv.layers.benchmark.median_interval``). Targets: batch-level quantities
   (per_sample=False) ≤ 4×, per-sample diagonals ≤ 20×. Networks, float32, batch 256, train mode:
     - MLP 784-512-512-512-10, ReLU;
     - the probe's small ResNet on 1×28×28 images, with BatchNorm (``resnet``) and with
       PatchNormConv2d (``resnet-patchnorm``);
     - the probe's pre-norm transformer block on 28 tokens × 28 features (``transformer``) and
       with AffineLike projections and QK-norm (``transformer-affine_like-qknorm``).
   A network with BatchNorm in train mode couples samples: its network-scope diagonals take the
   masked route (B full-batch passes), O(B) training steps by construction; that row is timed at
   a small batch and reported per pass, not against the target.

2. Against the naive route: the per-layer empirical NTK by vmap(jacrev) (``verify.ntk``, as
   neural-tangents' jacobian contraction) on each module alone at its recorded input, contracted
   with the output gradients for u, its diagonal blocks for d, on an MLP IN-W-W-W-10 at batch B
   (default IN = 64, W = 64, B = 64: ``--naive-size IN,W,B``). The NTK of a layer with n outputs
   and P parameters costs (B·n)²·P multiply-adds and its Jacobian B·n·P floats: at W = 128 and
   B = 64 that is 1.1·10¹² per hidden layer (minutes per call on one core), which is why the
   default is smaller. Each route runs in a fresh subprocess, one warm-up call on a batch of 2
   then timed calls (3 for the meter, 1 for the naive route); the peak memory is the largest
   resident set above the subprocess's resident set before the timed calls (a sampling thread
   reads /proc/self/statm every millisecond), with glibc told to map every allocation of 4 KiB
   or more on its own and to unmap it when freed (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=
   4096``), so that the resident set follows the live tensors instead of the allocator's cache.
   Target: ≥ 100× faster. The two routes' numbers are
   checked against each other (max relative difference printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = (  # (label, scope, per_sample, target)
    ("layer, batch-level", "layer", False, 4.0),
    ("network, batch-level", "network", False, 4.0),
    ("layer, per-sample", "layer", True, 20.0),
    ("network, per-sample", "network", True, 20.0),
)


def mlp(widths=(784, 512, 512, 512, 10)) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def networks(quick: bool):
    from affdiv.experiments.runs import zoo

    batch = 32 if quick else 256
    torch.manual_seed(0)
    yield "MLP 784-512-512-512-10", mlp(), (batch, 784)
    for name in ("resnet", "resnet-patchnorm", "transformer", "transformer-affine_like-qknorm"):
        torch.manual_seed(0)
        yield name, zoo.build(name, input_shape=(1, 28, 28), num_classes=10), (batch, 1, 28, 28)


def time_against_step(name, model, shape, rounds: int, warmup: int = 2) -> list[dict]:
    from affdiv.layers.benchmark import median_interval
    from affdiv.meter import divergence

    model.train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)

    def loss(out):
        return F.cross_entropy(out, y, reduction="none")

    def step():
        for p in model.parameters():
            p.grad = None
        F.cross_entropy(model(x), y).backward()

    coupled = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    calls = {"training step": step}
    routes = {}
    for label, scope, per_sample, _ in VARIANTS:
        if coupled and scope == "network" and per_sample:
            continue  # the masked route: timed separately, at a small batch

        def call(scope=scope, per_sample=per_sample, label=label):
            report = divergence(model, x, loss, lr=0.1, scope=scope, per_sample=per_sample)
            routes[label] = report.network_diagonal_route or next(
                (f"{r.diagonal_route or r.route}" for r in report.layers.values()), "")
            return report

        calls[label] = call
    times = {k: [] for k in calls}
    for _ in range(warmup):
        for f in calls.values():
            f()
    for _ in range(rounds):
        for k, f in calls.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times["training step"])
    rows = []
    for label, _scope, per_sample, target in VARIANTS:
        if label not in times:
            continue
        ratios = [t / s for t, s in zip(times[label], times["training step"])]
        low, high = median_interval(ratios)
        median = statistics.median(ratios)
        rows.append({"network": name, "batch": shape[0], "variant": label, "target": target,
                     "step_ms": 1e3 * base, "meter_ms": 1e3 * statistics.median(times[label]),
                     "ratio": median, "ci": [low, high], "met": median <= target,
                     "verdict": "met" if (high is not None and high <= target) else
                     ("missed" if (low is not None and low > target) else ("within noise" if low is not None else
                                                                           ("met" if median <= target else "missed"))),
                     "diagonal_route": routes.get(label) if per_sample else None})
    if coupled:
        small = 16
        xs, ys = x[:small], y[:small]
        rows.append(_masked_row(name, model, xs, ys, rounds=3))
    return rows


def _masked_row(name, model, x, y, rounds):
    from affdiv.meter import divergence

    def step():
        for p in model.parameters():
            p.grad = None
        F.cross_entropy(model(x), y).backward()

    def meter():
        return divergence(model, x, lambda out: F.cross_entropy(out, y, reduction="none"), lr=0.1,
                          scope="network", per_sample=True)

    step(), meter()
    s, m = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        s.append(time.perf_counter() - start)
        start = time.perf_counter()
        report = meter()
        m.append(time.perf_counter() - start)
    ratio = statistics.median(m) / statistics.median(s)
    return {"network": name, "batch": x.shape[0], "variant": "network, per-sample (masked route)",
            "target": None, "step_ms": 1e3 * statistics.median(s), "meter_ms": 1e3 * statistics.median(m),
            "ratio": ratio, "ci": [None, None], "met": None,
            "verdict": f"O(B): {ratio / x.shape[0]:.2f}× a step per sample",
            "diagonal_route": report.network_diagonal_route}


# ---------------------------------------------------------------------------------------------
# naive route vs the meter, each in a fresh subprocess

_CHILD = r"""
import json, os, sys, threading, time, statistics
import torch, torch.nn.functional as F
torch.set_num_threads(int(sys.argv[3]))
route = sys.argv[1]
n_in, width, batch = (int(v) for v in sys.argv[2].split(","))
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[4])))
from divergence_meter import mlp, naive_route, meter_route
torch.manual_seed(0)
model = mlp((n_in, width, width, width, 10)).train()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(batch, n_in, generator=g), torch.randint(0, 10, (batch,), generator=g)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
fn = naive_route if route == "naive" else meter_route
fn(model, x[:2], y[:2])  # warm-up (imports, first calls)
peak = [0]; stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.001)
base = rss(); thread = threading.Thread(target=sample); thread.start()
times = []
for _ in range(1 if route == "naive" else 3):
    start = time.perf_counter(); out = fn(model, x, y); times.append(time.perf_counter() - start)
stop.set(); thread.join()
torch.save(out, sys.argv[5])
print(json.dumps({"seconds": statistics.median(times), "peak_bytes": max(0, peak[0] - base)}))
"""


def _captured(model, x, y):
    """Each Linear's input and output gradient (mean cross-entropy), by plain hooks."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, (i[0].detach(), o)))
             for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [o for _, o in seen.values()])
    for h in hooks:
        h.remove()
    return {n: (inp, g) for (n, (inp, _)), g in zip(seen.items(), grads)}


def naive_route(model, x, y, lr=0.1):
    """Per layer: Θ by vmap(jacrev), then u = −ηΘg and d_i = −ηΘ_ii g_i."""
    from affdiv.verify.ntk import empirical_ntk, ntk_update

    out = {}
    for name, (inp, g) in _captured(model, x, y).items():
        module = dict(model.named_modules())[name]
        ntk = empirical_ntk(module, inp)  # (B, B, out, out)
        u = ntk_update(ntk, g, lr)
        blocks = torch.diagonal(ntk, dim1=0, dim2=1).permute(2, 0, 1)  # (B, out, out)
        d = -lr * torch.einsum("bij,bj->bi", blocks, g)
        out[name] = (u, d)
        del ntk
    return out


def meter_route(model, x, y, lr=0.1):
    from affdiv.meter import MeterOptions, divergence

    report = divergence(model, x, lambda o: F.cross_entropy(o, y, reduction="none"), lr=lr,
                        options=MeterOptions(keep_updates=True))
    return {name: (layer.effective, layer.diagonal) for name, layer in report.layers.items()}


def naive_comparison(threads: int, size: tuple[int, int, int] = (64, 64, 64)) -> dict:
    import tempfile

    n_in, width, batch = size
    results, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for route in ("meter", "naive"):
            path = os.path.join(tmp, f"{route}.pt")
            env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}
            done = subprocess.run([sys.executable, "-c", _CHILD, route, f"{n_in},{width},{batch}", str(threads),
                                   __file__, path],
                                  capture_output=True, text=True, check=True, env=env)
            results[route] = json.loads(done.stdout.strip().splitlines()[-1])
            outputs[route] = torch.load(path)
    diff = max(float((outputs["meter"][k][i] - outputs["naive"][k][i]).abs().max()
                     / outputs["naive"][k][i].abs().max()) for k in outputs["naive"] for i in (0, 1))
    return {"network": f"MLP {n_in}-{width}-{width}-{width}-10", "batch": batch,
            "naive_s": results["naive"]["seconds"], "meter_s": results["meter"]["seconds"],
            "speedup": results["naive"]["seconds"] / results["meter"]["seconds"],
            "naive_peak_bytes": results["naive"]["peak_bytes"], "meter_peak_bytes": results["meter"]["peak_bytes"],
            "max_rel_difference": diff, "target_speedup": 100.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds per network (default 11)")
    parser.add_argument("--quick", action="store_true", help="batch 32, 6 rounds: a smoke test of the script")
    parser.add_argument("--naive-size", default="64,64,64", metavar="IN,W,B",
                        help="input size, width and batch of the naive comparison (default 64,64,64)")
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--only-naive", action="store_true", help="the naive comparison alone")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 6 if args.quick else args.rounds
    start = time.perf_counter()
    rows = []
    for name, model, shape in ([] if args.only_naive else networks(args.quick)):
        for row in time_against_step(name, model, shape, rounds):
            rows.append(row)
            ci = row["ci"]
            interval = f"[{ci[0]:.2f}–{ci[1]:.2f}]" if ci[0] is not None else ""
            target = f"(≤ {row['target']:g}: {row['verdict']})" if row["target"] else row["verdict"]
            print(f"{row['network']:<32} B={row['batch']:<4} {row['variant']:<36} step {row['step_ms']:7.1f} ms  "
                  f"meter {row['meter_ms']:8.1f} ms  ratio {row['ratio']:6.2f} {interval} {target}", flush=True)
    naive = None
    if not args.skip_naive:
        naive = naive_comparison(args.threads, tuple(int(v) for v in args.naive_size.split(",")))
        print(f"naive route vs meter, {naive['network']}, B={naive['batch']}: naive {naive['naive_s']:.3f} s, "
              f"meter {naive['meter_s'] * 1e3:.1f} ms, speed-up {naive['speedup']:.0f}× (target ≥ 100); peak memory "
              f"naive {naive['naive_peak_bytes'] / 2**20:.0f} MiB, meter {naive['meter_peak_bytes'] / 2**20:.1f} MiB; "
              f"max relative difference {naive['max_rel_difference']:.1e}", flush=True)
    if args.json:
        from affdiv.provenance import provenance

        record = {"rows": rows, "naive": naive, "threads": args.threads, "rounds": rounds,
                  "provenance": provenance(wall_time_s=round(time.perf_counter() - start, 1))}
        from affdiv.reporting import write_json

        write_json(args.json, record)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

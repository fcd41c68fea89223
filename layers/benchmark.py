"""CPU timing of the corrected layers against the layers and composites they would replace.

Each case times forward+backward (x requires grad, so dx is computed, as for an inner layer) of
every variant, interleaved: one call of each variant per round, ``repeats`` rounds after
``warmup``. It reports each variant's median time and, per baseline, the median over rounds of
the paired ratio t(layer)/t(baseline) (paired within a round, so slow drifts of the machine's
load cancel) with its distribution-free 95% confidence interval (order statistics of the
rounds' ratios, ``scipy.stats.quantile_test``; it needs ≥ 6 rounds). A target is met when the
median ratio is at most the target; the verdict is *resolved* when the interval lies wholly on
one side of the target, and *within noise* when it contains it. The interval's coverage assumes
independent rounds, which a shared machine only approximates (two runs can differ by more than
one run's interval), and the "fastest composite" is chosen by the same rounds' medians, which
biases that comparison against the layer. Float32, ``threads`` intra-op threads. Targets:

* AffineLike ≤ 1.05 × nn.Linear at (B=512, 1024→1024);
* each corrected layer ≤ 1 × the fastest normaliser composite it would replace and ≤ 1 ×
  torch.compile of its own naive composite, at (512, 1024→1024), (4096, 256→256) and, for
  PatchNormConv2d, (N=64, 64→64, 32×32, k=3, padding 1).

The convolution case runs twice: on contiguous (NCHW) tensors and on channels_last ones, every
variant in that layout (channels_last is the faster layout for CPU convolutions; torch.compile
switches its convolutions to it by itself, see docs/FINDINGS.md). PatchNormConv2d(recompute)
is the memory-saving mode (one more convolution in backward), timed for information.

Two more cases time the fixed cost of a call, for information (no target): a dense layer at
(B=2, 8→4) and a convolution at (N=2, 3→4, 6×6, k=3), each round running ``OVERHEAD_CALLS``
calls of each variant, on one thread (the Python, autograd and dispatch work of a small model).
So do the dense layers at the falsification harness's sizes (``HARNESS_DENSE_SIZES``: its MLPs'
first layer 784→128 and hidden 128→128 at batch sizes 16-1024), each layer's per-call time a
ratio to nn.Linear's in the same rounds (``OVERHEAD_CALLS``·16/B calls a round, at least 5), and
the convolutions at the CNN presets' sizes (``HARNESS_CONV_SIZES``: width 8, 28×28 and 14×14, at
batch sizes 16 and 256; ``OVERHEAD_CALLS``·4/N calls a round, at least 3) against nn.Conv2d. The
dense per-call cases also time a reference, "nn.Linear+Python Function": nn.Linear followed by an
identity autograd.Function whose forward and backward are Python. Its ratio to nn.Linear is about
the least a layer written as a Python autograd.Function costs over nn.Linear at that size, whatever
its arithmetic (about: it also pays a second module call and a ``view``, which a layer need not).
Where the C++ autograd nodes are built (``affdiv.layers._native``), every dense case also times
AffineLike and NormLike(l2), and every convolution case PatchNormConv2d, on their Python Functions
("… (Python Function)", the path taken without the nodes), for information.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from affdiv._extras import missing_extra

try:
    from scipy.stats import quantile_test
except ModuleNotFoundError as error:
    raise missing_extra(error, extra="bench", feature="affdiv bench (affdiv.layers.benchmark)") from None

from affdiv.layers import _fused, _native
from affdiv.layers.modules import AffineLike, NormLike, PatchNormConv2d
from affdiv.reporting import nonfinite_to_null, write_json

DENSE_SIZES = ((512, 1024, 1024), (4096, 256, 256))
CONV_SIZE = (64, 64, 64, 32, 3)  # N, C_in, C_out, H=W, k
QUICK_DENSE_SIZES = ((16, 32, 32),)
AFFINE_LIKE_VS_LINEAR = 1.05  # the one target against the plain layer: AffineLike at DENSE_SIZES[0]
QUICK_CONV_SIZE = (2, 4, 4, 8, 3)
OVERHEAD_DENSE_SIZE, OVERHEAD_CONV_SIZE = (2, 8, 4), (2, 3, 4, 6, 3)
OVERHEAD_CALLS = 200  # calls per round and variant in the overhead cases
HARNESS_DENSE_SIZES = ((16, 784, 128), (16, 128, 128), (256, 128, 128), (1024, 784, 128), (1024, 128, 128))
# N, C_in, C_out, H = W (k = 3, padding 1): the CNN presets' first layer and the one after a pooling
HARNESS_CONV_SIZES = ((16, 1, 8, 28), (16, 8, 8, 14), (256, 1, 8, 28), (256, 8, 8, 14))


@dataclass
class Variant:
    name: str
    module: Callable
    # "layer", "mode" (a layer's other mode: timed, no target), "plain", "composite", "compiled" or
    # "reference" (timed against the plain layer, no target)
    role: str
    # entered around each round of the variant's calls (not timed per call)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class _PythonIdentity(torch.autograd.Function):
    """z ↦ z with a Python forward and backward: the fixed cost of any Python autograd.Function (in
    the old style, ``forward(ctx, ...)``, which the corrected layers' eager twins use)."""

    @staticmethod
    def forward(ctx, z):
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ThenPythonIdentity(nn.Module):
    """A layer followed by :class:`_PythonIdentity`."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return _PythonIdentity.apply(self.layer(x))


class _Normalize(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1)


class _Naive(nn.Module):
    """A corrected layer written naively from its definition (for torch.compile to fuse)."""

    def __init__(self, layer: nn.Module, kind: str):
        super().__init__()
        self.layer, self.kind = layer, kind

    def forward(self, x):
        w, b = self.layer.weight, self.layer.bias
        if self.kind == "affine_like":
            return (x @ w.t() + b) / torch.sqrt((x * x).sum(-1, keepdim=True) + 1)
        if self.kind == "patchnorm":
            layer, padding = self.layer, self.layer.padding
            if layer.padding_mode != "zeros":
                x, padding = F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode), 0
            geometry = {"stride": layer.stride, "padding": padding, "dilation": layer.dilation}
            groups = layer.groups
            conv = F.conv2d(x, w, b, groups=groups, **geometry)
            group_squares = x.square().unflatten(1, (groups, -1)).sum(2)  # (N, groups, H, W)
            ones = torch.ones(groups, 1, *w.shape[2:], dtype=x.dtype, device=x.device)
            patch_sq = F.conv2d(group_squares, ones, groups=groups, **geometry)  # (N, groups, H', W')
            scale = torch.rsqrt(patch_sq + 1).repeat_interleave(w.shape[0] // groups, dim=1)
            return conv * scale
        k = 1.0 if self.kind == "norm_l2" else math.sqrt(x.shape[-1])
        return F.linear(k * x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12), w, b)


def dense_variants(m: int, n: int, backend: str | None, reference: bool = False) -> list[Variant]:
    """The dense case's variants; ``backend`` None: without the compiled naive composites;
    ``reference``: with nn.Linear+Python Function (see the module docstring)."""
    affine_like, norm_l2, norm_rms = AffineLike(m, n), NormLike(m, n, mode="l2"), NormLike(m, n, mode="rms")
    variants = [
        Variant("nn.Linear", nn.Linear(m, n), "plain"),
        Variant("LayerNorm->Linear", nn.Sequential(nn.LayerNorm(m), nn.Linear(m, n)), "composite"),
        Variant("RMSNorm->Linear", nn.Sequential(nn.RMSNorm(m), nn.Linear(m, n)), "composite"),
        Variant("F.normalize->Linear", nn.Sequential(_Normalize(), nn.Linear(m, n)), "composite"),
        Variant("Linear->LayerNorm", nn.Sequential(nn.Linear(m, n), nn.LayerNorm(n)), "composite"),
        Variant("AffineLike", affine_like, "layer"),
        Variant("NormLike(l2)", norm_l2, "layer"),
        Variant("NormLike(rms)", norm_rms, "layer"),
    ]
    if _native.available():
        variants += [Variant("AffineLike (Python Function)", affine_like, "mode", _native.disabled),
                     Variant("NormLike(l2) (Python Function)", norm_l2, "mode", _native.disabled)]
    if reference:
        variants.append(Variant("nn.Linear+Python Function", _ThenPythonIdentity(nn.Linear(m, n)), "reference"))
    if backend is None:
        return variants
    return variants + [
        Variant("compiled naive AffineLike", torch.compile(_Naive(affine_like, "affine_like"), backend=backend),
                "compiled"),
        Variant("compiled naive NormLike(l2)", torch.compile(_Naive(norm_l2, "norm_l2"), backend=backend), "compiled"),
        Variant("compiled naive NormLike(rms)", torch.compile(_Naive(norm_rms, "norm_rms"), backend=backend),
                "compiled"),
    ]


def conv_variants(c_in: int, c_out: int, k: int, backend: str | None,
                  memory_format: torch.memory_format = torch.contiguous_format) -> list[Variant]:
    """The convolution case's variants in ``memory_format``; ``backend`` None: without the
    compiled naive composite."""
    patch = PatchNormConv2d(c_in, c_out, k, padding=k // 2)
    recompute = PatchNormConv2d(c_in, c_out, k, padding=k // 2, recompute=True)
    variants = [
        Variant("nn.Conv2d", nn.Conv2d(c_in, c_out, k, padding=k // 2), "plain"),
        Variant("Conv2d->BatchNorm2d", nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.BatchNorm2d(c_out)),
                "composite"),
        Variant("PatchNormConv2d", patch, "layer"),
        Variant("PatchNormConv2d(recompute)", recompute, "mode"),
    ]
    if _native.available():
        variants.append(Variant("PatchNormConv2d (Python Function)", patch, "mode", _native.disabled))
    if backend is not None:
        compiled = torch.compile(_Naive(patch, "patchnorm"), backend=backend)
        variants.append(Variant("compiled naive PatchNormConv2d", compiled, "compiled"))
    for v in variants:
        v.module.to(memory_format=memory_format)
    return variants


# the naive composite and the plain layer each corrected layer is compared with
OWN = {
    "AffineLike": ("compiled naive AffineLike", "nn.Linear"),
    "NormLike(l2)": ("compiled naive NormLike(l2)", "nn.Linear"),
    "NormLike(rms)": ("compiled naive NormLike(rms)", "nn.Linear"),
    "PatchNormConv2d": ("compiled naive PatchNormConv2d", "nn.Conv2d"),
    "PatchNormConv2d(recompute)": ("compiled naive PatchNormConv2d", "nn.Conv2d"),
    "PatchNormConv2d (Python Function)": ("compiled naive PatchNormConv2d", "nn.Conv2d"),
    "AffineLike (Python Function)": ("compiled naive AffineLike", "nn.Linear"),
    "NormLike(l2) (Python Function)": ("compiled naive NormLike(l2)", "nn.Linear"),
    "nn.Linear+Python Function": (None, "nn.Linear"),
}


def time_case(variants: list[Variant], x: torch.Tensor, warmup: int, repeats: int,
              calls: int = 1) -> dict[str, list[float]]:
    """Interleaved forward+backward timings (seconds per call) of each variant on x, each
    round timing ``calls`` consecutive calls of a variant."""
    grad = torch.randn_like(variants[0].module(x))
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(warmup + repeats):
        for v in variants:
            inputs = [x.detach().requires_grad_(True) for _ in range(calls)]
            with v.context():
                start = time.perf_counter()
                for xi in inputs:
                    v.module(xi).backward(grad)
                elapsed = (time.perf_counter() - start) / calls
            for p in getattr(v.module, "parameters", lambda: [])():
                p.grad = None
            if round_ >= warmup:
                times[v.name].append(elapsed)
    return times


def summarise(case: str, variants: list[Variant], times: dict[str, list[float]],
              plain_target: float | None = None, targets: bool = True) -> list[dict]:
    """Rows: each corrected layer against the plain layer (AffineLike held to ``plain_target``,
    if given), the fastest composite and its compiled naive form (where timed); ``targets``
    False: every row for information."""
    median = {name: statistics.median(ts) for name, ts in times.items()}
    composites = [v.name for v in variants if v.role == "composite"]
    fastest = min(composites, key=median.__getitem__)
    rows = []
    for v in (v for v in variants if v.role in ("layer", "mode", "reference")):
        compiled, plain = OWN[v.name]
        checks = [(plain, plain_target if v.name == "AffineLike" else None),
                  *(((fastest, 1.0), (compiled, 1.0)) if v.role != "reference" else ())]
        checks = [(baseline, target if targets and v.role == "layer" else None)
                  for baseline, target in checks if baseline in times]
        for baseline, target in checks:
            ratios = [a / b for a, b in zip(times[v.name], times[baseline])]
            ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
            rows.append({
                "case": case, "layer": v.name, "baseline": baseline, "layer_ms": 1e3 * median[v.name],
                "baseline_ms": 1e3 * median[baseline], "ratio": ratio,
                "ratio_ci95": None if low is None else [low, high], "target": target,
                "met": None if target is None else ratio <= target,
                "resolved": None if target is None or low is None else not low <= target <= high,
            })
    return rows


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float | None, float | None]:
    """Distribution-free confidence interval of the median of ``values``: the order statistics
    v_(k), v_(n+1-k) with P(Binomial(n, ½) < k) ≤ (1 − confidence)/2 (exact coverage ≥
    ``confidence`` for independent draws from any continuous distribution). (None, None) when
    n is too small for one (n < 6 at 95%)."""
    interval = quantile_test(values, q=statistics.median(values), p=0.5).confidence_interval(confidence)
    if math.isnan(interval.low) or math.isnan(interval.high):
        return None, None
    return float(interval.low), float(interval.high)


def run(quick: bool = False, threads: int = 2, repeats: int | None = None, warmup: int | None = None,
        backend: str = "inductor", progress: Callable[[str], None] = print) -> dict:
    """All cases; returns {"config", "medians_ms", "rows"} (JSON-ready)."""
    repeats = (3 if quick else 25) if repeats is None else repeats
    warmup = (1 if quick else 3) if warmup is None else warmup
    if repeats < 1 or warmup < 0:
        raise ValueError(
            f"benchmark.run: expected repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    medians: dict[str, dict[str, float]] = {}
    rows: list[dict] = []
    # (name, variants, input, AffineLike's target vs the plain layer, calls per round, threads)
    cases = [(f"dense B={b} {m}->{n}", dense_variants(m, n, backend), torch.randn(b, m),
              AFFINE_LIKE_VS_LINEAR if (b, m, n) == DENSE_SIZES[0] else None, 1, threads)
             for b, m, n in (QUICK_DENSE_SIZES if quick else DENSE_SIZES)]
    batch, c_in, c_out, hw, k = QUICK_CONV_SIZE if quick else CONV_SIZE
    for layout, label in ((torch.contiguous_format, ""), (torch.channels_last, " channels_last")):
        cases.append((f"conv N={batch} {c_in}->{c_out} {hw}x{hw} k={k} pad={k // 2}{label}",
                      conv_variants(c_in, c_out, k, backend, layout),
                      torch.randn(batch, c_in, hw, hw).contiguous(memory_format=layout), None, 1, threads))
    calls = 5 if quick else OVERHEAD_CALLS
    (b, m, n), (batch, c_in, c_out, hw, k) = OVERHEAD_DENSE_SIZE, OVERHEAD_CONV_SIZE
    cases += [(f"per call: dense B={b} {m}->{n}, 1 thread", dense_variants(m, n, None, reference=True),
               torch.randn(b, m), None, calls, 1),
              (f"per call: conv N={batch} {c_in}->{c_out} {hw}x{hw} k={k}, 1 thread",
               conv_variants(c_in, c_out, k, None), torch.randn(batch, c_in, hw, hw), None, calls, 1)]
    if not quick:
        cases += [(f"per call: dense B={b} {m}->{n} (harness), 1 thread", dense_variants(m, n, None, reference=True),
                   torch.randn(b, m), None, max(5, OVERHEAD_CALLS * 16 // b), 1) for b, m, n in HARNESS_DENSE_SIZES]
        cases += [(f"per call: conv N={b} {c_in}->{c_out} {hw}x{hw} k=3 (harness), 1 thread",
                   conv_variants(c_in, c_out, 3, None), torch.randn(b, c_in, hw, hw), None,
                   max(3, OVERHEAD_CALLS * 4 // b), 1) for b, c_in, c_out, hw in HARNESS_CONV_SIZES]
    try:
        for case, variants, x, plain_target, case_calls, case_threads in cases:
            progress(f"timing {case}: {len(variants)} variants x {repeats} rounds ...")
            torch.set_num_threads(case_threads)
            times = time_case(variants, x, warmup, repeats, case_calls)
            medians[case] = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
            rows.extend(summarise(case, variants, times, plain_target, targets=case_calls == 1))
    finally:
        torch.set_num_threads(threads)
    config = {"quick": quick, "threads": threads, "repeats": repeats, "warmup": warmup,
              "compile_backend": backend, "dtype": "float32", "what": "forward+backward, x.requires_grad",
              "overhead_calls_per_round": calls, "fused_cpu_kernels": _fused.available(),
              "cpp_autograd_nodes": _native.available()}
    return {"config": config, "medians_ms": medians, "rows": rows}


def format_table(rows: list[dict]) -> str:
    wc, wl, wb = (max([len(title)] + [len(r[key]) for r in rows])
                  for key, title in (("case", "case"), ("layer", "layer"), ("baseline", "vs baseline")))
    head = (f"{'case':<{wc}} {'layer':<{wl}} {'vs baseline':<{wb}} {'layer ms':>9} {'base ms':>9} {'ratio':>6} "
            f"{'95% CI':>13}  target")
    lines = [head, "-" * len(head)]
    for r in rows:
        ci = "" if r["ratio_ci95"] is None else f"{r['ratio_ci95'][0]:.3f}-{r['ratio_ci95'][1]:.3f}"
        target = ""
        if r["target"] is not None:
            target = f"<= {r['target']:.2f} {'met' if r['met'] else 'NOT met'}"
            target += {True: "", False: " (within noise)", None: " (too few rounds for a CI)"}[r["resolved"]]
        lines.append(f"{r['case']:<{wc}} {r['layer']:<{wl}} {r['baseline']:<{wb}} {r['layer_ms']:>9.3f} "
                     f"{r['baseline_ms']:>9.3f} {r['ratio']:>6.3f} {ci:>13}  {target}")
    return "\n".join(lines)


def write_result(path, result: dict, provenance: dict) -> Path:
    """Write :func:`run`'s result with ``provenance`` to ``path`` as JSON, atomically.

    A non-finite number (a zero-time round, say) is written as null and listed under the top-level
    ``"nonfinite"``: {key path: "inf"|"-inf"|"nan"}; JSON never holds NaN/inf (affdiv.reporting)."""
    record, nonfinite = nonfinite_to_null({**result, "provenance": provenance})
    if nonfinite:
        record["nonfinite"] = nonfinite
    return write_json(path, record)

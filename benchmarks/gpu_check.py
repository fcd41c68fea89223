"""GPU check and benchmark of the Triton AffineLike kernels (layers/_triton_affine_like.py).

One run on a CUDA machine:
  1. correctness: forward and backward of the kernels against float64 autograd of the plain
     formula z = (x W^T + b) / sqrt(||x||^2 + 1), on fresh random inputs per trial, into outputs
     poisoned with NaN beforehand (an unwritten element fails), in bfloat16 and float32, with
     rows of |x| ~ 1e30 (overflow of sum x^2) in one trial; each error is held to the bound
     `error_bound` states;
  2. timing, forward+backward in bfloat16 at 8192x4096x4096 and 4096x2048x2048: the kernels,
     nn.Linear (cuBLAS), the eager composite, affdiv.layers.functional.affine_like (if present),
     and torch.compile(mode="max-autotune-no-cudagraphs") of the composite in a child process
     with a time budget; CUDA-event medians (triton.testing.do_bench, L2 flushed before each
     run) over interleaved rounds, printed as ratios to nn.Linear and written as JSON (--json).

Without CUDA or Triton it prints why and exits 0 (the JSON, if asked for, says "skipped").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

LAMBDA = 6.0  # probabilistic rounding-error bound (Higham & Mary 2019): lambda * sqrt(n) * u
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ACCUMULATOR_ROUNDOFF = 2.0**-24  # every kernel accumulates in float32
TIMED_SHAPES = [(8192, 4096, 4096), (4096, 2048, 2048)]  # (rows B, in_features K, out_features N)
# (B, K, N, dtype, bias, rows of |x| ~ 1e30, trials): ragged and aligned shapes, the timed one.
CASES = [
    (1000, 520, 777, torch.bfloat16, True, 0, 2),
    (1000, 520, 777, torch.bfloat16, True, 3, 1),
    (512, 768, 1024, torch.bfloat16, False, 0, 1),
    (512, 768, 1024, torch.float32, True, 0, 2),
    (512, 768, 1024, torch.float32, True, 3, 1),
    (8192, 4096, 4096, torch.bfloat16, True, 0, 1),
]
TARGET_RATIO = 1.05  # the target: <= 1.05 x nn.Linear forward+backward in bf16 at 8192x4096x4096


def naive(x, weight, bias):
    """The composite the layer replaces, as a user would write it."""
    y = F.linear(x, weight, bias)
    return y / torch.sqrt((x * x).sum(-1, keepdim=True) + 1)


def reference(x, weight, bias, grad_z):
    """float64 autograd of `naive`, with the magnitudes the error bounds need.

    Returns {name: (value, abs_eval, mid_eval, n)}: abs_eval is the formula evaluated on absolute
    values (|sum| <= sum |terms|: the accumulation-error scale), mid_eval the sensitivity to the
    kernels' intermediate roundings to the storage dtype (gy = r gz before the dW and u products,
    u = gy W before the row pass), n the length of the chained float32 reductions.
    """
    x, w, gz = (t.detach().double() for t in (x, weight, grad_z))
    b = None if bias is None else bias.detach().double()
    leaves = [t.requires_grad_() for t in (x, w) + (() if b is None else (b,))]
    z = naive(x, w, b)
    grads = torch.autograd.grad(z, leaves, gz)
    (M, K), N = x.shape, w.shape[0]
    with torch.no_grad():
        r = 1 / torch.sqrt((x * x).sum(-1, keepdim=True) + 1)
        gy = gz * r
        u = gy @ w
        absb = 0 if b is None else b.abs()
        gyb = torch.zeros_like(r) if b is None else (gy.abs() * absb).sum(-1, keepdim=True)
        out = {
            "z": (z.detach(), (x.abs() @ w.abs().T + absb) * r, None, 2 * K),
            "dW": (grads[1], gy.abs().T @ x.abs(), LAMBDA * torch.sqrt((gy * gy).T @ (x * x)), M + 2 * K),
            "dx": (grads[0],
                   gy.abs() @ w.abs() + r * r * ((u.abs() * x.abs()).sum(-1, keepdim=True) + gyb) * x.abs(),
                   u.abs() + LAMBDA * torch.sqrt((gy * gy) @ (w * w))
                   + LAMBDA * r * r * torch.sqrt((u * u * x * x).sum(-1, keepdim=True)) * x.abs(),
                   2 * N + 2 * K),
        }
        if b is not None:
            out["db"] = (grads[2], gy.abs().sum(0), None, M + 2 * K)
    return out


def error_bound(dtype, ref, abs_eval, mid_eval, n):
    """Normwise relative error bound ||out - ref|| / ||ref|| for one kernel output.

    u_s (the storage dtype's unit roundoff) for rounding the result itself, plus
    lambda * sqrt(n) * 2^-24 * ||abs_eval|| / ||ref|| for the float32 accumulation (probabilistic
    bound: rounding errors as independent mean-zero variables), plus u_s * ||mid_eval|| / ||ref||
    for the intermediates rounded to the storage dtype (none in float32 beyond 2^-24).
    """
    u_s = UNIT_ROUNDOFF[dtype]
    scale = ref.norm().item()
    bound = u_s + LAMBDA * math.sqrt(n) * ACCUMULATOR_ROUNDOFF * abs_eval.norm().item() / scale
    if mid_eval is not None:
        bound += u_s * mid_eval.norm().item() / scale
    return bound


def random_inputs(M, K, N, dtype, device, seed, bias=True, huge_rows=0):
    """x, W (nn.Linear's init scale), b, grad_z; the first `huge_rows` rows of x scaled to ~1e30."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=gen)
    x[:huge_rows] *= 1e30
    w = torch.randn(N, K, device=device, generator=gen) / math.sqrt(K)
    b = torch.randn(N, device=device, generator=gen) / math.sqrt(K) if bias else None
    gz = torch.randn(M, N, device=device, generator=gen)
    return tuple(None if t is None else t.to(dtype) for t in (x, w, b, gz))


def poisoned(*shapes_dtypes, device):
    """NaN-filled tensors for each (shape, dtype) (None stays None): unwritten elements show."""
    return tuple(None if sd is None else torch.full(sd[0], float("nan"), dtype=sd[1], device=device)
                 for sd in shapes_dtypes)


def check_kernels(tk, cases, device, log):
    """Run each case (M, K, N, dtype, bias, huge_rows, trials) against the float64 reference."""
    records = []
    for M, K, N, dtype, bias, huge_rows, trials in cases:
        for trial in range(trials):
            x, w, b, gz = random_inputs(M, K, N, dtype, device, seed=1000 * trial + M + K + N, bias=bias,
                                        huge_rows=huge_rows)
            z, r = tk.forward(x, w, b, out=poisoned(((M, N), dtype), ((M,), torch.float32), device=device))
            bshape = ((N,), dtype) if bias else None
            dx, dw, db = tk.backward(gz, x, w, b, r,
                                     out=poisoned(((M, K), dtype), ((N, K), dtype), bshape, device=device))
            if x.is_cuda:
                torch.cuda.synchronize()
            got = {"z": z, "dx": dx, "dW": dw, "db": db}
            for name, (ref, abs_eval, mid_eval, n) in reference(x, w, b, gz).items():
                out = got[name].double()
                err = ((out - ref).norm() / ref.norm()).item()
                bound = error_bound(dtype, ref, abs_eval, mid_eval, n)
                ok = bool(torch.isfinite(out).all()) and err <= bound
                records.append(dict(shape=[M, K, N], dtype=str(dtype), bias=bias, huge_rows=huge_rows,
                                    trial=trial, output=name, rel_error=err, bound=bound, ok=ok))
                log(f"  {str(dtype):15s} B={M:5d} K={K:5d} N={N:5d} bias={bias!s:5s} huge={huge_rows} "
                    f"{name:3s} rel_err={err:.2e} bound={bound:.2e} {'ok' if ok else 'FAIL'}")
    return records


def bench(fn, rep_ms):
    """Median ms of `fn` over `rep_ms` of repeats (CUDA events; L2 flushed before each run)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def fwd_bwd(fn, x, w, b, gz):
    """A step computing fn(x, w, b) and its gradients for all of x, w, b (fresh, not accumulated)."""
    x, w = (t.detach().requires_grad_() for t in (x, w))
    b = None if b is None else b.detach().requires_grad_()
    leaves = (x, w) if b is None else (x, w, b)

    def step():
        torch.autograd.grad(fn(x, w, b), leaves, gz)

    return step


def time_variants(variants, rounds=3, rep_ms=150):
    """{name: median ms}: each round times every variant once, in turn (interleaved)."""
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(bench(fn, rep_ms))
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def kernel_variants(tk, x, w, b, gz):
    """The kernels' forward+backward, and each launch alone beside the cuBLAS product it wraps."""
    z, r = tk.forward(x, w, b)
    dx, dw, db = tk.backward(gz, x, w, b, r)
    gy, t, _ = tk._scale_grad(gz, r, b)

    def ours():
        z, r = tk.forward(x, w, b)
        tk.backward(gz, x, w, b, r)

    return {"triton kernels": ours}, {
        "fwd: triton forward (row pass + GEMM)": lambda: tk.forward(x, w, b),
        "fwd: triton row-scale pass alone": lambda: tk._row_scale(x, r),
        "fwd: cuBLAS F.linear": lambda: F.linear(x, w, b),
        "fwd: cuBLAS F.linear, then * r (torch)": lambda: F.linear(x, w, b) * r[:, None].to(x.dtype),
        "bwd: triton backward (all launches)": lambda: tk.backward(gz, x, w, b, r),
        "bwd: triton gy = r gz pass (+db, <gy,b>)": lambda: tk._scale_grad(gz, r, b),
        "bwd: cuBLAS gy^T x": lambda: gy.T @ x,
        "bwd: cuBLAS gy W": lambda: gy @ w,
        "bwd: triton row pass (dx -= ...)": lambda: tk._remove_x_component(dx, x, r, t),
    }


def time_shape(tk, M, K, N, rep_ms):
    """Forward+backward medians in bf16 at one shape, ratios to nn.Linear, and the per-launch split."""
    x, w, b, gz = random_inputs(M, K, N, torch.bfloat16, "cuda", seed=11)
    ours, parts = kernel_variants(tk, x, w, b, gz)
    variants = {"nn.Linear (cuBLAS)": fwd_bwd(F.linear, x, w, b, gz), **ours,
                "eager composite": fwd_bwd(naive, x, w, b, gz)}
    functional_step, why_not = functional_variant(x, w, b, gz)
    if functional_step is not None:
        variants["functional.affine_like"] = functional_step
    for step in (*variants.values(), *parts.values()):  # compile and autotune outside the timed region
        step()
    torch.cuda.synchronize()
    times = time_variants(variants, rep_ms=rep_ms)
    split = time_variants(parts, rounds=1, rep_ms=rep_ms)
    flops = 6.0 * M * K * N
    return dict(shape=[M, K, N], ms=times, split_ms=split,
                ratio_to_linear={k: v / times["nn.Linear (cuBLAS)"] for k, v in times.items()},
                tflops={k: flops / (v * 1e-3) / 1e12 for k, v in times.items()},
                functional_skipped=why_not)


def functional_variant(x, w, b, gz):
    """affdiv.layers.functional.affine_like through autograd, or (None, why) when it cannot run."""
    try:
        from affdiv.layers import functional
        affine_like = functional.affine_like
    except Exception as exc:  # the CPU engineer's module may not exist yet: say so
        return None, f"affdiv.layers.functional.affine_like unavailable: {exc!r}"
    return fwd_bwd(affine_like, x, w, b, gz), None


def compile_child(M, K, N, rep_ms):
    """Time torch.compile(max-autotune-no-cudagraphs) of `naive` and nn.Linear (printed as JSON)."""
    x, w, b, gz = random_inputs(M, K, N, torch.bfloat16, "cuda", seed=7)
    compiled = torch.compile(naive, mode="max-autotune-no-cudagraphs", dynamic=False)
    start = time.time()
    step = fwd_bwd(compiled, x, w, b, gz)
    step()
    torch.cuda.synchronize()
    compile_s = time.time() - start
    times = time_variants({"nn.Linear (cuBLAS)": fwd_bwd(F.linear, x, w, b, gz), "torch.compile composite": step},
                          rep_ms=rep_ms)
    print(json.dumps({"compile_s": compile_s, "ms": times}))


def run_compile_child(M, K, N, budget_s, rep_ms):
    """The compile timing in a child process, killed past `budget_s` (max-autotune can take minutes)."""
    if budget_s < 30:
        return {"skipped": f"no time left in the script's budget ({budget_s:.0f} s < 30 s)"}
    cmd = [sys.executable, __file__, "--compile-child", str(M), str(K), str(N), "--rep-ms", str(rep_ms)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"torch.compile max-autotune compile+timing exceeded its {budget_s:.0f} s budget"}
    if done.returncode != 0:
        return {"skipped": f"child failed (rc {done.returncode}): {done.stderr[-1500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_kernels():
    """The kernel module: through the package, or by path if the package does not import."""
    try:
        from affdiv.layers import _triton_affine_like as tk
        return tk, None
    except Exception as exc:
        path = pathlib.Path(__file__).resolve().parents[1] / "layers" / "_triton_affine_like.py"
        spec = importlib.util.spec_from_file_location("_triton_affine_like", path)
        tk = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tk)
        return tk, f"affdiv.layers did not import ({exc!r}); loaded {path}"


def environment():
    import triton

    props = torch.cuda.get_device_properties(0)
    return dict(gpu=props.name, sm_count=props.multi_processor_count,
                capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), float32_matmul_precision=torch.get_float32_matmul_precision())


def _measure(tk, result: dict, args, save, log, start: float) -> bool:
    """Correctness against float64 autograd, then the timings (eager, then torch.compile children
    within the budget), into ``result`` (saved after each part); True when something failed."""
    failed = False
    log("correctness against float64 autograd (outputs poisoned with NaN)")
    try:
        result["correctness"] = check_kernels(tk, CASES, "cuda", log)
        failed = not all(rec["ok"] for rec in result["correctness"])
    except Exception as exc:  # keep going to the timing, but the run fails
        import traceback

        result["correctness_error"] = traceback.format_exc()
        log(f"correctness raised: {exc!r}")
        failed = True
    save()

    result["timing"] = []
    for M, K, N in TIMED_SHAPES:
        log(f"timing forward+backward, bf16, B={M} K={K} N={N}")
        try:
            rec = time_shape(tk, M, K, N, args.rep_ms)
        except Exception:  # record it and go on to the next shape
            import traceback

            rec = dict(shape=[M, K, N], error=traceback.format_exc())
            log(rec["error"])
            failed = True
        result["timing"].append(rec)
        save()
    for rec in result["timing"]:  # after all eager timings: max-autotune compiles take minutes
        budget = min(200.0, args.budget_s - (time.time() - start) - 20)
        log(f"torch.compile child for B,K,N={rec['shape']}, budget {budget:.0f} s")
        rec["torch.compile"] = run_compile_child(*rec["shape"], budget, args.rep_ms)
        if "ms" in rec["torch.compile"] and "ms" in rec:
            c = rec["torch.compile"]["ms"]
            ratios = rec["ratio_to_linear"]
            ratios["torch.compile composite (child)"] = c["torch.compile composite"] / c["nn.Linear (cuBLAS)"]
            ratios["triton kernels / torch.compile"] = rec["ms"]["triton kernels"] / c["torch.compile composite"]
        save()

    result["forward_autotuned_configs"] = {str(k): str(v) for tuned in tk._FORWARD_TUNED.values()
                                           for k, v in getattr(tuned, "cache", {}).items()}
    log(f"forward GEMM autotuned: {result['forward_autotuned_configs']}")
    save()

    return failed


def _print_summary(result: dict, failed: bool) -> None:
    """The worst error per dtype and output against its bound, and every timing ratio."""
    print("\ncorrectness (worst rel. error / its bound per dtype and output):")
    worst = {}
    for rec in result.get("correctness", []):
        key = (rec["dtype"], rec["output"])
        if key not in worst or rec["rel_error"] / rec["bound"] > worst[key]["rel_error"] / worst[key]["bound"]:
            worst[key] = rec
    for (dtype, name), rec in sorted(worst.items()):
        print(f"  {dtype:15s} {name:3s} {rec['rel_error']:.2e} / {rec['bound']:.2e}  {'ok' if rec['ok'] else 'FAIL'}")
    print("\nforward+backward bf16, median ms and ratio to nn.Linear:")
    for rec in result["timing"]:
        print(f"  B={rec['shape'][0]} K={rec['shape'][1]} N={rec['shape'][2]}")
        if "error" in rec:
            print(f"    timing failed: {rec['error'][-300:]}")
            continue
        for name, ratio in rec["ratio_to_linear"].items():
            ms = rec["ms"].get(name)
            print(f"    {name:42s} {'' if ms is None else f'{ms:8.3f} ms'} {ratio:7.3f}")
        for name, ms in rec["split_ms"].items():
            print(f"    {name:42s} {ms:8.3f} ms")
        if "skipped" in rec["torch.compile"]:
            print(f"    torch.compile: skipped: {rec['torch.compile']['skipped'][:300]}")
        if rec["functional_skipped"]:
            print(f"    functional: skipped: {rec['functional_skipped'][:300]}")
    if "ratio_to_linear" in result["timing"][0]:
        big = result["timing"][0]["ratio_to_linear"]["triton kernels"]
        print(f"\ntarget: triton kernels <= {TARGET_RATIO} x nn.Linear at 8192x4096x4096: {big:.3f} "
              f"({'met' if big <= TARGET_RATIO else 'missed'})")
    print("correctness:", "FAILED" if failed else "all within bounds")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, help="write all results here")
    parser.add_argument("--budget-s", type=float, default=360.0, help="wall-clock budget of the whole script")
    parser.add_argument("--rep-ms", type=int, default=150, help="do_bench repetition time per measurement")
    parser.add_argument("--compile-child", nargs=3, type=int, metavar=("B", "K", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_child:
        compile_child(*args.compile_child, rep_ms=args.rep_ms)
        return 0
    start = time.time()
    log = lambda msg: print(f"[{time.time() - start:6.1f}s] {msg}", flush=True)  # noqa: E731

    why = None
    if not torch.cuda.is_available():
        why = "no CUDA device (torch.cuda.is_available() is False)"
    elif importlib.util.find_spec("triton") is None:
        why = "Triton is not installed"
    if why:
        print(f"SKIPPED: {why}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": why}, indent=2))
        return 0

    tk, load_note = load_kernels()
    result = {"environment": environment(), "notes": [load_note] if load_note else []}
    log(f"environment: {result['environment']}")
    # The layer's dispatch condition, checked rather than assumed.
    result["environment"]["kernels_available"] = tk.available()

    def save():
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))

    failed = _measure(tk, result, args, save, log, start)
    _print_summary(result, failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

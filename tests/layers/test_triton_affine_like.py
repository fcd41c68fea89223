"""The Triton AffineLike kernels (layers/_triton_affine_like.py) against float64 autograd.

Two backends, each skipped with the reason when absent:
- "cuda": the compiled kernels, in bfloat16, float16 and float32.
- "interpreter": Triton's CPU interpreter on CPU tensors, running the same kernel code, to test
  its logic (tiling, masks, the fused norm, the backward algebra) without a GPU. Triton reads
  TRITON_INTERPRET when it is imported, so `test_kernels_under_the_interpreter` runs this file
  again in a child process with TRITON_INTERPRET=1, where "interpreter" is the only backend.
  float32 and float16 only: Triton 3.9's interpreter gets bfloat16 dots wrong (about 1e10
  relative error on inputs where float16 is right), a limitation of the interpreter.
Errors are held to `error_bound` of benchmarks/gpu_check.py, which states the bound (the unit
roundoff of the storage dtype for the final rounding, a probabilistic float32 accumulation term,
the intermediates rounded to the storage dtype); the reference is float64 autograd of the plain
formula, independent of the kernels and of the hand-derived backward.
"""

import importlib.util
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton", reason="Triton is not installed: the GPU kernels are optional (pip install triton)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("affdiv_benchmarks_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.fixture(scope="module", params=["interpreter"] if INTERPRETING else ["cuda"])
def backend(request):
    """(kernel module, device, dtypes) for one backend."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the compiled kernels run on CUDA only (the interpreter covers the logic)")
    from affdiv.layers import _triton_affine_like as tk

    if request.param == "cuda":
        return tk, "cuda", (torch.float32, torch.float16, torch.bfloat16)
    return tk, "cpu", (torch.float32, torch.float16)


@pytest.mark.skipif(INTERPRETING, reason="this is the child process")
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-x", "-p", "no:cacheprovider",
                            "-k", "not test_kernels_under_the_interpreter"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout[-2000:]


def run_kernels(tk, x, w, b, gz):
    """Forward and backward into outputs poisoned with NaN (an unwritten element shows as NaN)."""
    (M, K), N = x.shape, w.shape[0]
    nan = lambda *shape, dtype=x.dtype: torch.full(shape, math.nan, dtype=dtype, device=x.device)  # noqa: E731
    z, r = tk.forward(x, w, b, out=(nan(M, N), nan(M, dtype=torch.float32)))
    dx, dw, db = tk.backward(gz, x, w, b, r, out=(nan(M, K), nan(N, K), None if b is None else nan(N)))
    return {"z": z, "dx": dx, "dW": dw, "db": db}, r


def assert_within_bounds(tk, x, w, b, gz, outputs=("z", "dx", "dW", "db")):
    got, _ = run_kernels(tk, x, w, b, gz)
    for name, (ref, abs_eval, mid_eval, n) in gpu_check.reference(x, w, b, gz).items():
        if name not in outputs:
            continue
        out = got[name].double().cpu()
        ref = ref.cpu()
        assert torch.isfinite(out).all(), f"{name}: non-finite or unwritten elements"
        err = ((out - ref).norm() / ref.norm()).item()
        bound = gpu_check.error_bound(x.dtype, ref, abs_eval.cpu(), None if mid_eval is None else mid_eval.cpu(), n)
        assert err <= bound, f"{name} ({x.dtype}, shape {tuple(x.shape)}x{tuple(w.shape)}): {err:.3e} > {bound:.3e}"


@settings(max_examples=6, deadline=None)
@given(M=st.integers(1, 70), K=st.integers(1, 90), N=st.integers(1, 70), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1), dtype_index=st.integers(0, 2))
def test_forward_and_backward_match_float64_autograd(backend, M, K, N, bias, seed, dtype_index):
    tk, device, dtypes = backend
    dtype = dtypes[dtype_index % len(dtypes)]
    x, w, b, gz = gpu_check.random_inputs(M, K, N, dtype, device, seed, bias=bias)
    assert_within_bounds(tk, x, w, b, gz)


def test_wide_rows_take_the_looping_paths(backend, monkeypatch):
    # K = 1100 loops the row-scale pass (512 columns a step); a 256-wide row block makes the
    # input-grad row pass take its two-sweep path (rows wider than _ROW_BLOCK_MAX).
    tk, device, _ = backend
    monkeypatch.setattr(tk, "_ROW_BLOCK_MAX", 256)
    x, w, b, gz = gpu_check.random_inputs(5, 1100, 7, torch.float32, device, seed=9)
    assert_within_bounds(tk, x, w, b, gz)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
def test_rows_beyond_float32_square_range(backend):
    # |x| ~ 1e30 overflows sum x^2 in float32 (1e60); the kernel re-sums those rows scaled.
    tk, device, _ = backend
    x, w, b, gz = gpu_check.random_inputs(40, 33, 20, torch.float32, device, seed=3, huge_rows=4)
    assert_within_bounds(tk, x, w, b, gz)
    # An entry at float32's maximum: the forward stays finite and right (the backward's r^2 is
    # below float32's range there).
    x[5, 7] = torch.finfo(torch.float32).max
    assert_within_bounds(tk, x, w, b, gz, outputs=("z",))


def test_zero_rows_give_the_bias(backend):
    tk, device, _ = backend
    x, w, b, _ = gpu_check.random_inputs(9, 17, 5, torch.float32, device, seed=4)
    x[2:5] = 0
    z, r = tk.forward(x, w, b)
    assert torch.equal(r[2:5].cpu(), torch.ones(3))  # 1/sqrt(0 + 1) is exact
    assert torch.equal(z[2:5].cpu(), b.expand(3, -1).cpu())  # (0 W^T + b) * 1 is exact


def test_degenerate_shapes(backend):
    tk, device, _ = backend
    x, w, b, _ = gpu_check.random_inputs(6, 8, 3, torch.float32, device, seed=5)
    z, r = tk.forward(x[:0], w, b)
    assert z.shape == (0, 3) and r.shape == (0,)
    # No out-features: z is empty but r is still the row scale.
    z, r = tk.forward(x, w[:0], b[:0])
    expected_r = 1 / torch.sqrt((x.double() ** 2).sum(-1) + 1)
    assert z.shape == (6, 0)
    assert torch.allclose(r.double(), expected_r, rtol=4 * 8 * 2**-24, atol=0)  # float32 sum of 8 squares
    # No in-features: x is empty, r = 1 and z = b.
    z, r = tk.forward(x[:, :0], w[:, :0], b)
    assert torch.equal(z.cpu(), b.expand(6, -1).cpu()) and torch.equal(r.cpu(), torch.ones(6))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns on inf * 0
def test_non_finite_input_stays_in_its_row(backend):
    tk, device, _ = backend
    x, w, b, _ = gpu_check.random_inputs(10, 12, 7, torch.float32, device, seed=6)
    x[3, 4] = math.nan
    x[6, 1] = math.inf
    z, _ = tk.forward(x, w, b)
    bad = torch.zeros(10, dtype=torch.bool)
    bad[[3, 6]] = True
    assert torch.isnan(z[bad]).all()  # NaN propagates; an infinite entry gives (inf * 0 =) NaN
    assert torch.isfinite(z[~bad]).all()


def test_backward_is_deterministic(backend):
    # The <gy, b> and <u, x> reductions use per-tile partial buffers, not atomics.
    tk, device, _ = backend
    x, w, b, gz = gpu_check.random_inputs(70, 40, 130, torch.float32, device, seed=7)
    first, r = run_kernels(tk, x, w, b, gz)
    second, _ = run_kernels(tk, x, w, b, gz)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_bad_input_names_expected_and_actual(backend):
    tk, device, _ = backend
    x, w, b, gz = gpu_check.random_inputs(4, 6, 5, torch.float32, device, seed=8)
    _, r = tk.forward(x, w, b)
    with pytest.raises(TypeError, match=r"x: expected dtype in .*, got torch.float64"):
        tk.forward(x.double(), w.double(), b.double())
    with pytest.raises(TypeError, match=r"weight: expected dtype torch.float32, got torch.float16"):
        tk.forward(x, w.half(), b)
    with pytest.raises(ValueError, match=r"weight: expected shape \(5, 6\), got \(5, 7\)"):
        tk.forward(x, torch.zeros(5, 7, device=device), b)
    with pytest.raises(ValueError, match=r"bias: expected shape \(5,\), got \(4,\)"):
        tk.forward(x, w, b[:4])
    with pytest.raises(ValueError, match=r"x: expected a 2-D .* got shape \(2, 2, 6\)"):
        tk.forward(x[:4].reshape(2, 2, 6), w, b)
    with pytest.raises(ValueError, match=r"out z: expected shape \(4, 5\), got \(4, 4\)"):
        tk.forward(x, w, b, out=(torch.empty(4, 4, device=device), torch.empty(4, device=device)))
    with pytest.raises(ValueError, match=r"grad_z: expected shape \(4, 5\), got \(5, 4\)"):
        tk.backward(gz.T, x, w, b, r)
    with pytest.raises(TypeError, match=r"r: expected dtype torch.float32, got torch.float64"):
        tk.backward(gz, x, w, b, r.double())
    with pytest.raises(ValueError, match=r"out dx: expected a contiguous tensor"):
        tk.backward(gz, x, w, b, r, out=(torch.empty(6, 4, device=device).T, torch.empty_like(w), torch.empty_like(b)))


def test_available_is_triton_and_cuda(backend):
    tk, _, _ = backend
    assert tk.available() == torch.cuda.is_available()  # Triton imported: the module-level skip

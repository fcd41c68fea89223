"""Triton kernels for AffineLike on CUDA: z = (x W^T + b) * r with r = 1/sqrt(||x||^2 + 1) per row.

Forward, two launches: a row pass computes r (one read of x), then a tiled GEMM x W^T whose
epilogue adds b and scales each row by r. Only r (one float32 per row) is kept for the backward.

Backward, with gy = r * gz and u = gy W:
    dW = gy^T x,   db = sum_rows gy,
    dx = u - r^2 * (<u, x> + <gy, b>) * x,
since dz/dr contributes <gz, y> = <gz W, x> + <gz, b> (y = x W^T + b, so y need not be saved) and
dr/dx = -r^3 x. Launches:
  1. a pass over gz writing gy = r * gz (storage dtype) and the float32 partial sums of db
     (per row tile) and <gy, b> (per column tile): deterministic, no atomics;
  2. dW = gy^T x and u = gy W as plain cuBLAS products (torch.mm), u written into dx;
  3. a row pass that forms <u, x>, adds the <gy, b> partials and subtracts the x component in
     place. <u, x> needs the whole row of u, which no GEMM tile holds, so it is this light pass:
     it reads u and x once and writes dx once.

Why not fused further (measured on an H200, Triton 3.6, bf16, B=8192, 4096 -> 4096): a forward
GEMM that also accumulated sum(x^2) from the x tiles of its K-loop took 0.60 ms (and gave wrong z
with two of its three tile configs), against 0.51 ms for the separate row pass (0.03 ms, one more
read of x) plus the GEMM with the scale in its epilogue; a weight-grad GEMM that scaled gz by r
as it loaded it took 0.86 ms, against 0.38 ms for cuBLAS on gy plus 0.10 ms for the pass that
writes gy. Both GEMM operands left untouched in shared memory is what keeps the tensor cores fed.

Accumulation is float32 for bf16/fp16/fp32 inputs; float32 matmuls follow
torch.get_float32_matmul_precision() ("highest": IEEE fp32, otherwise tf32), as nn.Linear does.

Overflow: sum(x^2) is accumulated in float32. For bf16/fp32 inputs beyond about 1e19 it
overflows; the rows where it does are summed again from x scaled by 2^-96 (a branch that normal
inputs never take), so r stays right for every finite x (a subnormal float32 when ||x|| > 2^126,
keeping 11 or more significant bits for K <= 2^20). The gradients stay exact to rounding while
r, hence gy = r gz, is a normal number (||x|| < 2^126; checked at |x| ~ 1e30): r^2 is never
formed. The GEMM overflows where nn.Linear's does. Non-finite inputs: NaN propagates; an
infinite x entry gives NaN in its row.

This module imports without Triton; `available()` says whether the kernels can run.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch path serves CPUs and Triton-less installs
    triton = None

__all__ = ["SUPPORTED_DTYPES", "available", "forward", "backward"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (tests only)
_ROW_BLOCK_MAX = 8192  # input-grad row pass: whole rows up to this width in registers, else two sweeps
_SCALE_TILE = (32, 256)  # (rows, columns) of a program of the gy = r * gz pass


def available() -> bool:
    """True iff Triton imports and a CUDA device is present."""
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped tile order: GROUP_M row tiles share each column tile while it is in L2."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.maximum(tl.cdiv(N, BN), 1)  # one (masked) column tile when N == 0
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        return pid_m, pid_n

    @triton.jit
    def _sum_of_squares(x_ptr, rows, M, K, stride_xm, scale, BM: tl.constexpr, BK: tl.constexpr):
        """sum((scale * x)^2) over each row, accumulated in float32."""
        ks = tl.arange(0, BK)
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        total = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            mask = (rows[:, None] < M) & (ks[None, :] < K - k0)
            xs = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * scale
            total += tl.sum(xs * xs, axis=1)
            ptrs += BK
        return total

    @triton.jit
    def _row_scale_kernel(x_ptr, r_ptr, M, K, stride_xm, BM: tl.constexpr, BK: tl.constexpr):
        """r = 1/sqrt(sum x^2 + 1) for BM rows; rows whose sum overflows are summed again scaled."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        sumsq = _sum_of_squares(x_ptr, rows, M, K, stride_xm, 1.0, BM, BK)
        r = 1.0 / tl.sqrt_rn(sumsq + 1.0)
        if tl.max(sumsq, axis=0) == float("inf"):  # only for |x| beyond ~1e19 (or an infinite x)
            two_m96 = 1.2621774483536189e-29  # 2^-96: (2^-96 x)^2 cannot overflow for finite x
            scaled = _sum_of_squares(x_ptr, rows, M, K, stride_xm, two_m96, BM, BK)
            r = tl.where(sumsq == float("inf"), two_m96 / tl.sqrt_rn(scaled), r)
        tl.store(r_ptr + rows, r, mask=rows < M)

    @triton.jit
    def _forward_kernel(
        x_ptr, w_ptr, b_ptr, r_ptr, z_ptr, M, N, K, stride_xm, stride_wn, stride_zm,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """z = (x W^T + b) * r: a tiled GEMM with the bias and the row scale in its epilogue."""
        pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # W^T tile (BK, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            k_in = ks < K - k0
            xt = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_in[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
            x_ptrs += BK
            w_ptrs += BK
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
        z_ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_zm + cols[None, :]
        tl.store(z_ptrs, (acc * r[:, None]).to(z_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _scale_grad_kernel(
        g_ptr, r_ptr, b_ptr, gy_ptr, t_ptr, dbp_ptr, M, N, stride_gm, stride_gym, stride_tn, stride_dbm,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    ):
        """gy = r * gz on a (BM, BN) tile; with a bias also the tile's partial <gy, b> per row
        (row pid_n of t) and partial column sums of gy (row pid_m of dbp), both from float32 gy."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        gz = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_gm + cols[None, :], mask=mask, other=0.0)
        gy = gz.to(tl.float32) * tl.load(r_ptr + rows, mask=rows < M, other=0.0)[:, None]
        tl.store(gy_ptr + rows[:, None].to(tl.int64) * stride_gym + cols[None, :], gy.to(gy_ptr.dtype.element_ty),
                 mask=mask)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(t_ptr + pid_n * stride_tn + rows, tl.sum(gy * bias[None, :], axis=1), mask=rows < M)
            tl.store(dbp_ptr + pid_m * stride_dbm + cols, tl.sum(gy, axis=0), mask=cols < N)

    @triton.jit
    def _remove_x_component_kernel(
        dx_ptr, x_ptr, r_ptr, t_ptr, K, T, stride_dxm, stride_xm, stride_tn,
        BLOCK: tl.constexpr, T_BLOCK: tl.constexpr, ONE_SWEEP: tl.constexpr,
    ):
        """dx = u - r^2 (<u, x> + sum of the T <gy, b> partials) x for one row; u is read from dx.

        r^2 is applied as (r * dot) * (r * x): for rows with |x| near 1e30 r^2 underflows float32.
        """
        row = tl.program_id(0).to(tl.int64)
        dx_row = dx_ptr + row * stride_dxm
        x_row = x_ptr + row * stride_xm
        r = tl.load(r_ptr + row)
        ts = tl.arange(0, T_BLOCK)
        dot = tl.sum(tl.load(t_ptr + ts * stride_tn + row, mask=ts < T, other=0.0), axis=0)
        offs = tl.arange(0, BLOCK)
        if ONE_SWEEP:  # the whole row in registers: one read of u and x, one write of dx
            u = tl.load(dx_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            coef = r * (dot + tl.sum(u * x, axis=0))
            tl.store(dx_row + offs, (u - coef * (r * x)).to(dx_ptr.dtype.element_ty), mask=offs < K)
        else:
            for k0 in range(0, K, BLOCK):
                mask = offs < K - k0
                u = tl.load(dx_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(u * x, axis=0)
            coef = r * dot
            for k0 in range(0, K, BLOCK):
                mask = offs < K - k0
                u = tl.load(dx_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_row + k0 + offs, (u - coef * (r * x)).to(dx_ptr.dtype.element_ty), mask=mask)

    def _config(bm, bn, bk, stages, warps):
        return triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=stages, num_warps=warps)

    # Hopper (sm_90) tiles for 16-bit operands: 128x256 and 256x128 with BK=64 are the wgmma
    # shapes Triton's own Hopper matmuls use (3-4 stages fit in 228 KB of shared memory); the
    # smaller ones win for narrow or short problems.
    _CONFIGS_16BIT = [
        _config(128, 256, 64, 3, 8),
        _config(128, 256, 64, 4, 8),
        _config(256, 128, 64, 3, 8),
        _config(256, 128, 64, 4, 8),
        _config(128, 128, 64, 4, 8),
        _config(64, 128, 64, 4, 4),
    ]
    # IEEE float32 dots run on the FMA units (tf32 on tensor cores): smaller tiles, fewer stages.
    _CONFIGS_32BIT = [
        _config(128, 128, 32, 3, 8),
        _config(128, 64, 32, 3, 4),
        _config(64, 64, 32, 3, 4),
    ]
    _INTERPRETER_META = {"BM": 64, "BN": 64, "BK": 16, "GROUP_M": 2}
    _FORWARD_TUNED = {  # keyed by "operands are float32"
        False: triton.autotune(configs=_CONFIGS_16BIT, key=["M", "N", "K"])(_forward_kernel),
        True: triton.autotune(configs=_CONFIGS_32BIT, key=["M", "N", "K"])(_forward_kernel),
    }


def _check(name: str, tensor: torch.Tensor, shape: tuple, like: torch.Tensor, dtype=None) -> None:
    """Raise unless `tensor` has `shape`, `dtype` (default like's) and like's device."""
    dtype = like.dtype if dtype is None else dtype
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name}: expected device {like.device}, got {tensor.device}")


def _check_out(name: str, tensor: torch.Tensor, shape: tuple, like: torch.Tensor, dtype=None) -> None:
    _check(name, tensor, shape, like, dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tensor.stride()}")


def _check_inputs(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if triton is None:
        raise RuntimeError("the Triton AffineLike kernels need Triton: pip install triton")
    if x2d.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x: expected dtype in {SUPPORTED_DTYPES}, got {x2d.dtype}")
    if x2d.dim() != 2:
        raise ValueError(f"x: expected a 2-D (rows, in_features) tensor, got shape {tuple(x2d.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D (out_features, in_features) tensor, got shape {tuple(weight.shape)}")
    _check("weight", weight, (weight.shape[0], x2d.shape[1]), x2d)
    if bias is not None:
        _check("bias", bias, (weight.shape[0],), x2d)


def forward(x2d, weight, bias=None, *, out=None):
    """(z, r): z = (x W^T + b) * r and r = 1/sqrt(sum x^2 + 1) per row (float32).

    x2d (B, K), weight (N, K), bias (N,) or None, all of one dtype in SUPPORTED_DTYPES on one
    device. `out`, if given, is a preallocated (z, r) pair that the kernels write into.
    """
    _check_inputs(x2d, weight, bias)
    x2d, weight = x2d.contiguous(), weight.contiguous()
    (M, K), N = x2d.shape, weight.shape[0]
    if out is None:
        out = (x2d.new_empty((M, N)), torch.empty(M, device=x2d.device, dtype=torch.float32))
    z, r = out
    _check_out("out z", z, (M, N), x2d)
    _check_out("out r", r, (M,), x2d, torch.float32)
    _row_scale(x2d, r)
    if M == 0 or N == 0:
        return z, r
    precision = "ieee" if x2d.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"
    args = (x2d, weight, r if bias is None else bias, r, z, M, N, K, x2d.stride(0), weight.stride(0), z.stride(0))
    if _INTERPRET:
        meta = _INTERPRETER_META
        grid = (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)
        _forward_kernel[grid](*args, HAS_BIAS=bias is not None, PRECISION=precision, **meta)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)  # noqa: E731
        _FORWARD_TUNED[x2d.dtype == torch.float32][grid](*args, HAS_BIAS=bias is not None, PRECISION=precision)
    return z, r


def backward(grad_z2d, x2d, weight, bias, r, *, out=None):
    """(dx, dW, db) of z = (x W^T + b) * r from the saved r alone (db is None without bias).

    `out`, if given, is a preallocated (dx, dW, db) triple (db None without bias).
    """
    _check_inputs(x2d, weight, bias)
    (M, K), N = x2d.shape, weight.shape[0]
    _check("grad_z", grad_z2d, (M, N), x2d)
    _check("r", r, (M,), x2d, torch.float32)
    grad_z2d, x2d, weight, r = grad_z2d.contiguous(), x2d.contiguous(), weight.contiguous(), r.contiguous()
    if out is None:
        out = (torch.empty_like(x2d), torch.empty_like(weight), None if bias is None else torch.empty_like(bias))
    dx, dw, db = out
    _check_out("out dx", dx, (M, K), x2d)
    _check_out("out dW", dw, (N, K), x2d)
    if bias is not None:
        _check_out("out db", db, (N,), x2d)
    gy, t, db_partials = _scale_grad(grad_z2d, r, bias)
    torch.mm(gy.T, x2d, out=dw)
    torch.mm(gy, weight, out=dx)
    if bias is not None:
        db.copy_(db_partials.sum(dim=0))  # float32 sum, then one rounding to db
    _remove_x_component(dx, x2d, r, t)
    return dx, dw, db


def _row_scale(x2d, r):
    """Launch: r = 1/sqrt(sum x^2 + 1) per row, into r."""
    M, K = x2d.shape
    rows = 8  # 8 rows x 512 columns: 16 elements per thread over 4 warps, loads 16 bytes wide
    _row_scale_kernel[(triton.cdiv(M, rows),)](x2d, r, M, K, x2d.stride(0), BM=rows, BK=512, num_warps=4)


def _scale_grad(grad_z2d, r, bias):
    """Launch: gy = r * gz, and with a bias the <gy, b> partials (tiles, B) and db partials (tiles, N)."""
    M, N = grad_z2d.shape
    BM, BN = _SCALE_TILE
    gy = torch.empty_like(grad_z2d)
    tiles_m, tiles_n = triton.cdiv(M, BM), triton.cdiv(N, BN)
    if bias is None:
        t = db_partials = None
    else:
        t = torch.empty((tiles_n, M), device=gy.device, dtype=torch.float32)
        db_partials = torch.empty((max(tiles_m, 1), N), device=gy.device, dtype=torch.float32)
        if M == 0:
            db_partials.zero_()
    _scale_grad_kernel[(tiles_m, tiles_n)](
        grad_z2d, r, r if bias is None else bias, gy, r if t is None else t, r if t is None else db_partials,
        M, N, grad_z2d.stride(0), gy.stride(0), 0 if t is None else t.stride(0),
        0 if t is None else db_partials.stride(0), HAS_BIAS=bias is not None, BM=BM, BN=BN, num_warps=8)
    return gy, t, db_partials


def _remove_x_component(dx, x2d, r, t):
    """Launch, in place: dx = u - r^2 (<u, x> + <gy, b>) x, with <gy, b> summed from the partials t."""
    M, K = x2d.shape
    block = min(triton.next_power_of_2(max(K, 1)), _ROW_BLOCK_MAX)
    t_rows = 0 if t is None else t.shape[0]
    _remove_x_component_kernel[(M,)](
        dx, x2d, r, r if t is None else t, K, t_rows, dx.stride(0), x2d.stride(0), 0 if t is None else t.stride(0),
        BLOCK=block, T_BLOCK=triton.next_power_of_2(max(t_rows, 1)), ONE_SWEEP=K <= block,
        num_warps=8 if block >= 2048 else 4)

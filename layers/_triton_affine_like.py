"""Triton kernels for AffineLike on CUDA: z = (x W^T + b) * r with r = 1/sqrt(||x||^2 + 1) per row.

Forward (one launch): a tiled GEMM that also accumulates sum(x^2) from the x tiles it loads for
the product (one pass over x); the epilogue adds b and scales each row by r. Only r (one float32
per row) is kept for the backward.

Backward, with gy = r * gz and u = gy W:
    dW = gy^T x,   db = sum_rows gy,
    dx = u - r^2 * (<u, x> + <gy, b>) * x,
since dz/dr contributes <gz, y> = <gz W, x> + <gz, b> (y = x W^T + b, so y need not be saved) and
dr/dx = -r^3 x. Three launches:
  1. weight-grad GEMM: gz tiles are scaled by r as they are loaded (the A operand, in registers);
     the programs of the first in-feature tile also reduce db and the partial <gy, b> of their
     out-feature tile (written to a (tiles, B) buffer: deterministic, no atomics);
  2. input-grad GEMM gz W with the row scale r applied in the epilogue (u, stored into dx);
  3. a row pass that forms <u, x>, adds the <gy, b> partials and subtracts the x component in
     place. <u, x> needs the whole row of u, which no GEMM tile holds, so it is this light pass:
     it reads u and x once and writes dx once.

Accumulation is float32 for bf16/fp16/fp32 inputs; float32 matmuls follow
torch.get_float32_matmul_precision() ("highest": IEEE fp32, otherwise tf32), as nn.Linear does.

Overflow: sum(x^2) is accumulated in float32. For bf16/fp32 inputs beyond about 1e19 it
overflows; the rows where it does are summed again from x scaled by 2^-96 (a branch that normal
inputs never take), so r stays right for every finite x. The GEMM itself overflows where
nn.Linear's does. Non-finite inputs: NaN propagates; an infinite x entry gives NaN in its row.

This module imports without Triton; `available()` says whether the kernels can run.
"""

from __future__ import annotations

import functools
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
_PARTIAL_TILE = 64  # smallest out-feature tile of the weight-grad kernel: rows of the <gy, b> buffer
_ROW_BLOCK_MAX = 8192  # row pass: whole rows up to this width in registers, else two sweeps


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
    def _scaled_sumsq(x_ptr, rows, M, K, stride_xm, BM: tl.constexpr, BK: tl.constexpr):
        """sum((x * 2^-96)^2) per row: the overflow-free sum of squares for huge rows."""
        ks = tl.arange(0, BK)
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        total = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            mask = (rows[:, None] < M) & (ks[None, :] < K - k0)
            xs = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * 1.2621774483536189e-29  # 2^-96
            total += tl.sum(xs * xs, axis=1)
            ptrs += BK
        return total

    @triton.jit
    def _forward_kernel(
        x_ptr, w_ptr, b_ptr, z_ptr, r_ptr, M, N, K, stride_xm, stride_wn, stride_zm,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # W^T tile (BK, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        sumsq = tl.zeros((BM,), tl.float32)
        for k0 in range(0, K, BK):
            k_in = ks < K - k0
            xt = tl.load(x_ptrs, mask=(rows[:, None] < M) & k_in[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
            xf = xt.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)
            x_ptrs += BK
            w_ptrs += BK
        # r = scale * inv_norm; scale is 1 except in rows whose sum of squares overflowed, where
        # it is 2^-96 and applied to acc first, so z never passes through a subnormal r.
        inv_norm = 1.0 / tl.sqrt_rn(sumsq + 1.0)
        scale = tl.full((BM,), 1.0, tl.float32)
        if tl.max(sumsq, axis=0) == float("inf"):  # only for |x| beyond ~1e19 (or an infinite x)
            overflow = sumsq == float("inf")
            rescaled = 1.0 / tl.sqrt_rn(_scaled_sumsq(x_ptr, rows, M, K, stride_xm, BM, BK))
            inv_norm = tl.where(overflow, rescaled, inv_norm)
            scale = tl.where(overflow, 1.2621774483536189e-29, scale)  # 2^-96
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        z = (acc * scale[:, None]) * inv_norm[:, None]
        r = scale * inv_norm
        z_ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_zm + cols[None, :]
        tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))
        if pid_n == 0:
            tl.store(r_ptr + rows, r, mask=rows < M)

    @triton.jit
    def _weight_grad_loop(
        g_ptr, x_ptr, r_ptr, bias, t_ptr, outs, ins, M, N, K, stride_gm, stride_xm,
        WITH_BIAS_TERMS: tl.constexpr, PRECISION: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
    ):
        """acc = (r*gz)^T x over all rows; with WITH_BIAS_TERMS also db and the <gy, b> partials."""
        bs = tl.arange(0, BM)
        g_ptrs = g_ptr + bs[None, :].to(tl.int64) * stride_gm + outs[:, None]  # gz^T tile (BN, BM)
        x_ptrs = x_ptr + bs[:, None].to(tl.int64) * stride_xm + ins[None, :]  # x tile (BM, BK)
        acc = tl.zeros((BN, BK), tl.float32)
        db = tl.zeros((BN,), tl.float32)
        for m0 in range(0, M, BM):
            b_in = bs < M - m0
            gt = tl.load(g_ptrs, mask=(outs[:, None] < N) & b_in[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=b_in[:, None] & (ins[None, :] < K), other=0.0)
            gy = gt.to(tl.float32) * tl.load(r_ptr + m0 + bs, mask=b_in, other=0.0)[None, :]
            acc = tl.dot(gy.to(xt.dtype), xt, acc, input_precision=PRECISION)
            if WITH_BIAS_TERMS:
                db += tl.sum(gy, axis=1)
                tl.store(t_ptr + m0 + bs, tl.sum(gy * bias[:, None], axis=0), mask=b_in)
            g_ptrs += BM * stride_gm
            x_ptrs += BM * stride_xm
        return acc, db

    @triton.jit
    def _weight_grad_kernel(
        g_ptr, x_ptr, r_ptr, b_ptr, dw_ptr, db_ptr, t_ptr, M, N, K,
        stride_gm, stride_xm, stride_dwn, stride_tn,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # Tiles of dW (N, K): BM here tiles out-features and BK the reduction over rows (batch).
        pid_n, pid_k = _tile_ids(N, K, BM, BN, GROUP_M)
        outs = pid_n * BM + tl.arange(0, BM)
        ins = pid_k * BN + tl.arange(0, BN)
        t_row = t_ptr + pid_n * (BM // 64) * stride_tn  # rows of 64 (_PARTIAL_TILE) out-features
        if (pid_k == 0) & HAS_BIAS:
            bias = tl.load(b_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)
            acc, db = _weight_grad_loop(g_ptr, x_ptr, r_ptr, bias, t_row, outs, ins, M, N, K,
                                        stride_gm, stride_xm, True, PRECISION, BM, BN, BK)
            tl.store(db_ptr + outs, db.to(db_ptr.dtype.element_ty), mask=outs < N)
        else:
            acc, db = _weight_grad_loop(g_ptr, x_ptr, r_ptr, b_ptr, t_row, outs, ins, M, N, K,
                                        stride_gm, stride_xm, False, PRECISION, BM, BN, BK)
        dw_ptrs = dw_ptr + outs[:, None].to(tl.int64) * stride_dwn + ins[None, :]
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(outs[:, None] < N) & (ins[None, :] < K))

    @triton.jit
    def _input_grad_kernel(
        g_ptr, w_ptr, r_ptr, u_ptr, M, N, K, stride_gm, stride_wn, stride_um,
        PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # u = r * (gz W): tiles of (M, K), reduction over the N out-features in steps of BK.
        pid_m, pid_k = _tile_ids(M, K, BM, BN, GROUP_M)
        rows = pid_m * BM + tl.arange(0, BM)
        ins = pid_k * BN + tl.arange(0, BN)
        js = tl.arange(0, BK)
        g_ptrs = g_ptr + rows[:, None].to(tl.int64) * stride_gm + js[None, :]  # gz tile (BM, BK)
        w_ptrs = w_ptr + js[:, None].to(tl.int64) * stride_wn + ins[None, :]  # W tile (BK, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for j0 in range(0, N, BK):
            j_in = js < N - j0
            gt = tl.load(g_ptrs, mask=(rows[:, None] < M) & j_in[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=j_in[:, None] & (ins[None, :] < K), other=0.0)
            acc = tl.dot(gt, wt, acc, input_precision=PRECISION)
            g_ptrs += BK
            w_ptrs += BK * stride_wn
        r = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
        u_ptrs = u_ptr + rows[:, None].to(tl.int64) * stride_um + ins[None, :]
        tl.store(u_ptrs, (acc * r[:, None]).to(u_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (ins[None, :] < K))

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
    # smaller ones win for narrow or short problems. Every BM/BN is a multiple of _PARTIAL_TILE.
    _CONFIGS_16BIT = [
        _config(128, 256, 64, 3, 8),
        _config(128, 256, 64, 4, 8),
        _config(256, 128, 64, 3, 8),
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

    @functools.cache
    def _tuned(kernel, float32: bool):
        """The autotuned launcher of `kernel` for 16-bit or float32 operands."""
        configs = _CONFIGS_32BIT if float32 else _CONFIGS_16BIT
        return triton.autotune(configs=configs, key=["M", "N", "K"])(kernel)

    def _launch_gemm(kernel, tiles, dtype, *args, **constexprs):
        """Launch a GEMM kernel over `tiles(meta)` programs, autotuned (or fixed under the interpreter)."""
        precision = "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"
        if _INTERPRET:
            meta = _INTERPRETER_META
            return kernel[(tiles(meta),)](*args, PRECISION=precision, **constexprs, **meta)
        tuned = _tuned(kernel, dtype == torch.float32)
        return tuned[lambda meta: (tiles(meta),)](*args, PRECISION=precision, **constexprs)


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
    device. `out`, if given, is a preallocated (z, r) pair that the kernel writes into.
    """
    _check_inputs(x2d, weight, bias)
    x2d, weight = x2d.contiguous(), weight.contiguous()
    (M, K), N = x2d.shape, weight.shape[0]
    if out is None:
        out = (x2d.new_empty((M, N)), torch.empty(M, device=x2d.device, dtype=torch.float32))
    z, r = out
    _check_out("out z", z, (M, N), x2d)
    _check_out("out r", r, (M,), x2d, torch.float32)
    if M == 0:
        return z, r
    # At least one column tile, so that r is written even when N == 0.
    tiles = lambda meta: triton.cdiv(M, meta["BM"]) * triton.cdiv(max(N, 1), meta["BN"])  # noqa: E731
    _launch_gemm(_forward_kernel, tiles, x2d.dtype,
                 x2d, weight, bias if bias is not None else z, z, r, M, N, K,
                 x2d.stride(0), weight.stride(0), z.stride(0), HAS_BIAS=bias is not None)
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
    has_bias = bias is not None
    if out is None:
        out = (torch.empty_like(x2d), torch.empty_like(weight), torch.empty_like(bias) if has_bias else None)
    dx, dw, db = out
    _check_out("out dx", dx, (M, K), x2d)
    _check_out("out dW", dw, (N, K), x2d)
    if has_bias:
        _check_out("out db", db, (N,), x2d)
    if M == 0:
        dw.zero_()
        if has_bias:
            db.zero_()
        return dx, dw, db
    t = _weight_grad(grad_z2d, x2d, r, bias, dw, db)
    _input_grad_gemm(grad_z2d, weight, r, dx)
    _remove_x_component(dx, x2d, r, t)
    return dx, dw, db


def _weight_grad(grad_z2d, x2d, r, bias, dw, db):
    """Launch 1: dW = (r gz)^T x and db; returns the (tiles, B) <gy, b> partials (None without bias)."""
    (M, K), N = x2d.shape, grad_z2d.shape[1]
    # One row of partials per out-feature tile of _PARTIAL_TILE, the smallest tile any config uses;
    # a program with a larger tile fills its first row, the others stay zero.
    t = torch.zeros((triton.cdiv(N, _PARTIAL_TILE), M), device=x2d.device, dtype=torch.float32) if bias is not None else None
    tiles = lambda meta: triton.cdiv(N, meta["BM"]) * triton.cdiv(max(K, 1), meta["BN"])  # noqa: E731
    _launch_gemm(_weight_grad_kernel, tiles, x2d.dtype,
                 grad_z2d, x2d, r, r if bias is None else bias, dw, r if bias is None else db, r if t is None else t,
                 M, N, K, grad_z2d.stride(0), x2d.stride(0), dw.stride(0), 0 if t is None else t.stride(0),
                 HAS_BIAS=bias is not None)
    return t


def _input_grad_gemm(grad_z2d, weight, r, dx):
    """Launch 2: u = r * (gz W), written into dx."""
    (M, N), K = grad_z2d.shape, weight.shape[1]
    tiles = lambda meta: triton.cdiv(M, meta["BM"]) * triton.cdiv(K, meta["BN"])  # noqa: E731
    _launch_gemm(_input_grad_kernel, tiles, dx.dtype,
                 grad_z2d, weight, r, dx, M, N, K, grad_z2d.stride(0), weight.stride(0), dx.stride(0))


def _remove_x_component(dx, x2d, r, t):
    """Launch 3, in place: dx = u - r^2 (<u, x> + <gy, b>) x, with <gy, b> summed from the partials t."""
    M, K = x2d.shape
    block = min(triton.next_power_of_2(max(K, 1)), _ROW_BLOCK_MAX)
    t_rows = 0 if t is None else t.shape[0]
    _remove_x_component_kernel[(M,)](
        dx, x2d, r, r if t is None else t, K, t_rows, dx.stride(0), x2d.stride(0), 0 if t is None else t.stride(0),
        BLOCK=block, T_BLOCK=triton.next_power_of_2(max(t_rows, 1)), ONE_SWEEP=K <= block,
        num_warps=8 if block >= 2048 else 4)

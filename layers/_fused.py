"""ctypes bindings of the fused CPU passes (``_fused_cpu.c``) of the corrected layers.

Dense layers, each one pass over row-major (rows, cols) tensors, every row in cache:

    scale_outputs(z, x, …)          s_i = 1/√(‖x_i‖² + 1) or k/max(‖x_i‖, eps);
                                    z_i ← (z_i + pre)·s_i  or  z_i·s_i + post
    scale_grad(g, s, …)             gy_i = s_i·g_i, with Σ_i gy_i (or Σ_i g_i) and ⟨gy_i, v⟩
    minus_radial_(u, x, s, m, …)    u_i ← u_i − a_i·(⟨u_i, x_i⟩ + c_i)·x_i,
                                    a_i = (m·s_i)² where s_i < limit, else 0

PatchNorm convolutions, on (N, C, *spatial) tensors with the channels of each of ``groups``
groups summed per position (1-D as height 1):

    group_squares(x, groups)        Σ_{c∈g} x_c²                          (N, groups, *S)
    box(sq, geometry)               1/√(box(sq) + 1): box sums over each receptive field
    box_transpose(e, geometry)      boxᵀ(e): each position's e spread over its field
    scale_and_dot(gz, z, r, groups) gy = r·gz per group, e = −r²·Σ_{o∈g} gz_o·z_o
    group_update_(t, r, groups, src) t ← t·r, or t ← t + src·r, each group's r over its channels

and, for an NCHW layer whose backward convolution runs channels_last (4-D), the same passes
writing across the layouts (blocks transposed in vector registers):

    scale_and_dot(…, to_channels_last=True)   gy written channels_last
    channels_last_copy(t, into)                 t itself, channels_last (channels_last_view: a
                                                buffer's storage read so, without copying)
    group_update_from_channels_last(d, r, …)   d + src·r, from channels_last d to contiguous

The stacked CNN engine's first block (``affdiv.experiments.runs.conv_pool``), K models'
one-channel convolutions each followed by a 2×2 max-pool:

    conv_pool(xp, wt, bias, …)      maxpool((conv(x_k, W_k) + b_k)·r), r = 1 or PatchNorm's
                                    1/√(‖patch‖² + 1), and each maximum's position
    conv_pool_backward(xp, g, …)    dW_k, db_k: g·r times the patch at each maximum

and its later 2×2 max-pools, each with the ReLU after it:

    max_pool2(x, relu, …)           relu(maxpool(x)), and each maximum's position
    max_pool2_backward(g, which, …) dx: g at each maximum, 0 elsewhere

The stacked vision transformer's attention, on rows (N·T, H·d_h) of N sequences of T tokens,
each (sequence, head) on its own:

    attention_scores(q, k, …)       s = q kᵀ/√d_h                          (N, H, T, T)
    attention_probabilities(q, k, …)
                                    softmax(s) row-wise, in float32 at T = 16, d_h = 8
    attention_values(p, v, …)       y = p v, in the rows' layout
    attention_backward(q, k, v, p, gy, …)
                                    gv = pᵀ gy, ds = p ⊙ (gy vᵀ − Σ_u p ⊙ gy vᵀ)/√d_h,
                                    gq = ds k, gk = dsᵀ q

and its LayerNorms, on K models' rows (K, M, d) with each model's γ_k, β_k:

    layer_norm(x, γ, β, eps)        y = x̂·γ_k + β_k, x̂ = (x − mean)·rstd, rstd = 1/√(var + eps)
    layer_norm_backward(x, gy, …)   ∂x = rstd·(g − ⟨g⟩/d − x̂·⟨g, x̂⟩/d), g = gy·γ_k;
                                    ∂γ_k = Σ_rows gy·x̂, ∂β_k = Σ_rows gy

and the stacked engine's tanh activation in float32, ``tanh(x)``, each element computed in double
(within 1e-15 of tanh(x), relative) and rounded once: the correctly rounded tanh on every float32
input (``benchmarks/tanh_accuracy.py`` checks each non-negative one; the pass is odd by
construction; the derivation in _fused_cpu.c).

The row passes' dot products are accumulated in 16 partial sums in the tensors' dtype, combined
pairwise (float32 rounding for float32, as torch's own vectorised sums), their tails in double; box
sums in double; ``conv_pool``'s convolution outputs and PatchNorm's patch norms in tap order in the
dtype, its gradients per sample, then over samples, in the dtype; the attention's sums in the dtype,
in the order written (its heads of 16 tokens and 8 entries: ⟨p_t, dp_t⟩ pairwise; the float32
softmax's maxima and sums pairwise, e^x by its own polynomial, each row times the reciprocal of its
sum); the LayerNorm's row sums as the row passes' dot products (rows of 32 entries in the same tree,
16 rows at a time), its column sums in the dtype over blocks of rows, the blocks in double. The
extension is optional (built at install where a C compiler with OpenMP is present); ``usable`` says
whether a call may take it: the library loaded and not ``disabled``, every tensor a contiguous (or,
for the convolutions, channels_last) plain CPU float32/float64 tensor of one dtype, in eager mode
(not traced, not under torch.func, no dispatch mode but one that only observes, no forward-mode AD)
and not recording a graph (a double backward needs the differentiable torch formulas, forward mode
their tangents). Otherwise the layers run the same passes as torch ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import math
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from affdiv.layers._torch_internals import (
    dispatch_mode_active,
    forward_ad_active,
    is_compiling,
    is_functorch_wrapped,
    is_legacy_batched,
    untraced_eager,
)

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
#: The interface version this module is written for (``AFFDIV_FUSED_ABI`` of _fused_cpu.h): a
#: library built from other sources is not loaded.
FUSED_ABI = 5
_MAX = {dtype: torch.finfo(dtype).max for dtype in _SUFFIX}
_state = {"disabled": False}  # process-wide (``disabled`` is for tests and benchmarks)


def _load() -> ctypes.CDLL | None:
    """The compiled library, or None where it was not built. Loaded after torch, it shares
    torch's libgomp (its OpenMP thread pool)."""
    spec = importlib.util.find_spec("affdiv.layers._fused_cpu")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.affdiv_fused_abi.restype = ctypes.c_int
        if (abi := lib.affdiv_fused_abi()) != FUSED_ABI:
            raise OSError(f"built with interface version {abi}, this is version {FUSED_ABI}")
        return _declared(lib)
    except (OSError, AttributeError) as error:  # not loadable here, or a stale build: torch ops still work
        warnings.warn(f"affdiv.layers: the fused CPU kernels did not load ({error}); using torch ops", stacklevel=2)
        return None


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with every kernel's argument and result types set (AttributeError if one is missing)."""
    p, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    for suffix in _SUFFIX.values():
        _declare(lib, f"scale_outputs_{suffix}", i64, [p, p, i64, i64, i64, i32, f64, f64, f64, f64, p, p, p, i32])
        _declare(lib, f"scale_grad_{suffix}", i32, [p, p, i64, i64, p, p, i32, p, p, i32])
        _declare(lib, f"minus_radial_{suffix}", None, [p, p, i64, i64, p, f64, f64, p, i32])
        _declare(lib, f"box_{suffix}", None, [p, p, i64, p, i32, i32])
        for layout in ("", "_cl"):
            _declare(lib, f"group_squares{layout}_{suffix}", i64, [p, i64, i64, i64, i64, f64, p, i32])
            _declare(lib, f"scale_and_dot{layout}_{suffix}", None, [p, p, p, i64, i64, i64, i64, p, p, i32])
            _declare(lib, f"group_update{layout}_{suffix}", None, [p, p, p, i64, i64, i64, i64, i32])
        _declare(lib, f"scale_and_dot_to_cl_{suffix}", None, [p, p, p, i64, i64, i64, i64, p, p, i32])
        _declare(lib, f"group_update_from_cl_{suffix}", None, [p, p, p, i64, i64, i64, i64, p, i32])
        sizes = [i64] * 7  # models, batch, channels, hq, wq, kh, kw
        _declare(lib, f"conv_pool_{suffix}", i32, [p, *sizes, p, p, i32, i32, p, p, i32])
        _declare(lib, f"conv_pool_backward_{suffix}", i32, [p, p, p, *sizes, i32, p, p, i32])
        _declare(lib, f"max_pool2_{suffix}", None, [p, i64, i64, i64, i64, i32, p, p, i32])
        _declare(lib, f"max_pool2_backward_{suffix}", None, [p, p, i64, i64, i64, i64, p, i32])
        shape = [i64] * 4  # sequences, tokens, heads, size
        _declare(lib, f"attention_scores_{suffix}", None, [p, p, *shape, f64, p, p, i32])
        _declare(lib, f"attention_values_{suffix}", None, [p, p, *shape, p, i32])
        _declare(lib, f"attention_backward_{suffix}", None, [p, p, p, p, p, *shape, f64, p, p, p, p, i32])
        _declare(lib, f"layer_norm_{suffix}", None, [p, p, p, i64, i64, i64, f64, p, p, p, i32])
        _declare(lib, f"layer_norm_backward_{suffix}", None, [p, p, p, p, p, i64, i64, i64, p, p, p, p, i32])
    _declare(lib, "tanh_f32", None, [p, p, i64, i32])
    _declare(lib, "attention_probabilities_f32", i32, [p, p, i64, i64, i64, i64, f64, p, i32])
    return lib


def _declare(lib: ctypes.CDLL, name: str, restype, argtypes) -> None:
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, argtypes


_LIB = _load()


def available() -> bool:
    """Whether the compiled passes were built and loaded."""
    return _LIB is not None


def library_path() -> str | None:
    """The loaded library's file (for the C++ nodes of ``_native``, which bind its passes by name)."""
    return None if _LIB is None else _LIB._name


def is_disabled() -> bool:
    """Whether the calling code runs inside ``disabled``."""
    return _state["disabled"]


@contextlib.contextmanager
def flag_raised(state: dict, key: str) -> Iterator[None]:
    """state[key] True inside the block, its previous value after (the layers' path switches)."""
    previous = state[key]
    state[key] = True
    try:
        yield
    finally:
        state[key] = previous


def disabled() -> contextlib.AbstractContextManager:
    """Run the plain-torch passes inside the block (for tests and benchmarks of both paths)."""
    return flag_raised(_state, "disabled")


def eager_kernels_allowed() -> bool:
    """Whether the mode lets a call take a compiled pass at all: the library loaded and not
    ``disabled``, not traced by torch.compile, no dispatch mode active (FakeTensorMode,
    FlopCounterMode, …: it would not see the pass; a mode that only observes,
    ``affdiv_observes_only``, does not count) and no forward-mode AD (tangents the pass
    would drop). ``usable`` adds that no graph is being recorded, and the tensors' checks."""
    return not (_LIB is None or _state["disabled"] or is_compiling() or dispatch_mode_active() or forward_ad_active())


def functions_usable(*tensors: Tensor | None) -> bool:
    """Whether an autograd Function of the stacked engine built on these passes may take these
    tensors (None entries ignored; the first is not None): an untraced eager call
    (``untraced_eager``) that ``eager_kernels_allowed``, CPU autocast off (its products would come
    out in another dtype), and plain non-empty CPU tensors of one dtype, float32 or float64. A graph
    may be recorded: such a Function's backward routes itself (``usable`` at that time)."""
    if not untraced_eager() or not eager_kernels_allowed() or torch.is_autocast_enabled("cpu"):
        return False
    dtype = tensors[0].dtype
    return dtype in _SUFFIX and all(
        t is None or (plain(t) and t.is_cpu and t.dtype == dtype and t.numel() > 0) for t in tensors)


def usable(*tensors: Tensor | None, memory_format: torch.memory_format | None = torch.contiguous_format) -> bool:
    """Whether these tensors (None entries ignored; the first is not None) may go through the
    compiled passes: no graph being recorded, no dispatch mode active but one that only observes
    (``eager_kernels_allowed``), no forward-mode AD (tangents), and each a ``plain`` CPU tensor of one
    float32/float64 dtype, contiguous in ``memory_format`` (None: the first tensor's own, see
    ``layout_of``)."""
    if torch.is_grad_enabled() or not eager_kernels_allowed():
        return False
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX:
        return False
    if memory_format is None:  # (asked only now: not of a tensor being traced or under vmap)
        memory_format = layout_of(tensors[0])
    for t in tensors:  # (a loop, not all() over a generator: this runs several times a layer call)
        if t is not None and not (
            plain(t) and t.dtype == dtype and t.is_cpu and t.is_contiguous(memory_format=memory_format)
        ):
            return False
    return True


PLAIN_TYPES = (Tensor, torch.nn.Parameter)  # torch's own tensor types (no subclass)


def plain(t: Tensor) -> bool:
    """A tensor with its own storage, which holds its values as they read: not a subclass
    (FakeTensor, …), not wrapped by torch.func, not a batched gradient (``is_grads_batched``,
    vectorised jacobians), not a lazily negated or conjugated view (the imaginary part of a
    conjugate, ``torch._neg_view``: its storage holds the values before the negation)."""
    return (type(t) in PLAIN_TYPES and not is_functorch_wrapped(t) and not is_legacy_batched(t)
            and not t.is_neg() and not t.is_conj())


def layout_of(x: Tensor) -> torch.memory_format:
    """channels_last for a plain 4-D tensor stored so (and not also contiguous), else contiguous
    (also for tensors the layout cannot be asked of, e.g. under vmap)."""
    if plain(x) and x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _call(name: str, dtype: torch.dtype):
    return getattr(_LIB, f"{name}_{_SUFFIX[dtype]}")


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def scale_outputs(
    z: Tensor, x: Tensor, mode: str, pre: Tensor | None = None, post: Tensor | None = None,
    k: float = 1.0, eps: float = 0.0, small: float = 0.0,
) -> tuple[Tensor, bool]:
    """(s, safe) for z = x Wᵀ: s (rows, 1) = 1/√(‖x_i‖² + 1) (mode "affine_like") or
    k/max(‖x_i‖, eps) (mode "norm_like"), and in place z_i ← (z_i + pre)·s_i or z_i·s_i + post
    (pre, post: (cols,), at most one of them). safe is False where some ‖x_i‖² exceeds x's
    dtype's maximum (the GEMM may have overflowed) or is NaN, or some ‖x_i‖ < ``small``: then z
    and s must be discarded."""
    if pre is not None and post is not None:
        raise ValueError("scale_outputs: a bias before the scale (pre) or after it (post), not both")
    rows, in_cols = x.shape
    s = torch.empty((rows, 1), dtype=x.dtype)
    unsafe = _call("scale_outputs", x.dtype)(
        z.data_ptr(), x.data_ptr(), rows, in_cols, z.shape[1], 0 if mode == "affine_like" else 1, k, eps, small,
        _MAX[x.dtype], _ptr(pre), _ptr(post), s.data_ptr(), torch.get_num_threads(),
    )
    return s, unsafe == 0


def scale_grad(
    g: Tensor, scale: Tensor, column_sum: str | None = None, v: Tensor | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(gy, colsum, dot): gy = s·g row-wise; colsum = Σ_i gy_i (``column_sum="scaled"``) or
    Σ_i g_i (``"input"``) or None; dot = ⟨gy_i, v⟩ as (rows, 1), or None without v."""
    rows, cols = g.shape
    gy = torch.empty_like(g)
    colsum = None if column_sum is None else torch.empty(cols, dtype=g.dtype)
    dot = None if v is None else torch.empty((rows, 1), dtype=g.dtype)
    failed = _call("scale_grad", g.dtype)(
        g.data_ptr(), scale.data_ptr(), rows, cols, gy.data_ptr(), _ptr(colsum), int(column_sum == "input"),
        _ptr(v), _ptr(dot), torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"scale_grad: could not allocate the column-sum partials ({cols} columns)")
    return gy, colsum, dot


def minus_radial_(
    u: Tensor, x: Tensor, s: Tensor, m: float = 1.0, limit: float = math.inf, c: Tensor | None = None
) -> Tensor:
    """u_i ← u_i − a_i·(⟨u_i, x_i⟩ + c_i)·x_i in place, a_i = (m·s_i)² where s_i < ``limit``
    else 0 (s, c: (rows, 1); c None: 0); returns u."""
    rows, cols = u.shape
    _call("minus_radial", u.dtype)(
        u.data_ptr(), x.data_ptr(), rows, cols, s.data_ptr(), m, limit, _ptr(c), torch.get_num_threads()
    )
    return u


def group_squares(x: Tensor, groups: int) -> tuple[Tensor, bool]:
    """(sq, safe): sq (N, groups, *S) = Σ over each group's channels of x² (x contiguous or
    channels_last); safe is False where some sample's Σ x² exceeds x's dtype's maximum (the
    convolution may overflow) or is NaN."""
    batch, channels = x.shape[:2]
    sq = torch.empty((batch, groups, *x.shape[2:]), dtype=x.dtype)
    unsafe = _call(f"group_squares{_layout(x)}", x.dtype)(
        x.data_ptr(), batch, channels, math.prod(x.shape[2:]), groups, _MAX[x.dtype], sq.data_ptr(),
        torch.get_num_threads(),
    )
    return sq, unsafe == 0


def _layout(t: Tensor) -> str:
    """The C suffix of t's storage: "" (contiguous) or "_cl" (channels_last)."""
    return "_cl" if layout_of(t) == torch.channels_last else ""


def box(sq: Tensor, out_spatial, kernel, stride, padding, dilation) -> Tensor:
    """1/√(box(sq) + 1) (N, groups, *out_spatial): box sums of sq (N, groups, *S) over each
    output position's receptive field (zero padding)."""
    out = torch.empty((*sq.shape[:2], *out_spatial), dtype=sq.dtype)
    geometry = _geometry(*map(tuple, (sq.shape[2:], out_spatial, kernel, stride, padding, dilation)))
    _box(sq, out, geometry, transpose=False)
    return out


def box_transpose(e: Tensor, in_spatial, kernel, stride, padding, dilation) -> Tensor:
    """boxᵀ(e) (N, groups, *in_spatial): each output position's e (N, groups, *out) added over
    its receptive field; the adjoint of the box sum."""
    out = torch.empty((*e.shape[:2], *in_spatial), dtype=e.dtype)
    geometry = _geometry(*map(tuple, (in_spatial, e.shape[2:], kernel, stride, padding, dilation)))
    _box(e, out, geometry, transpose=True)
    return out


@functools.lru_cache(maxsize=1024)
def _geometry(in_spatial, out_spatial, kernel, stride, padding, dilation) -> ctypes.Array:
    """The int64[12] box geometry of the C side (tuples in; a 1-D convolution as height 1).
    Cached (a model's layers see a few geometries; building it costs more than a small layer's
    box pass), so the array is shared: read-only."""
    lead = [(1, 1, 1, 1, 0, 1)] if len(kernel) == 1 else []
    per_dim = lead + list(zip(in_spatial, out_spatial, kernel, stride, padding, dilation))
    return (ctypes.c_int64 * 12)(*(int(v) for field in zip(*per_dim) for v in field))


def _box(source: Tensor, out: Tensor, geometry: ctypes.Array, transpose: bool) -> None:
    planes = source.shape[0] * source.shape[1]
    threads = torch.get_num_threads()
    _call("box", source.dtype)(source.data_ptr(), out.data_ptr(), planes, geometry, int(transpose), threads)


def scale_and_dot(
    gz: Tensor, z: Tensor | None, r: Tensor, groups: int, with_dot: bool = True, to_channels_last: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(gy, e): gy = r·gz, each group's r (N, groups, *S) over its channels of gz (N, O, *S);
    e (N, groups, *S) = −r²·Σ_{o∈g} gz_o·z_o (None unless ``with_dot``; z may then be None).
    gz and z share one layout (contiguous or channels_last), which gy keeps, or, with
    ``to_channels_last`` (gz and z contiguous and 4-D), gy is written channels_last."""
    if with_dot and z is None:
        raise ValueError("scale_and_dot: e = −r²·Σ gz·z needs z, got None")
    e = torch.empty_like(r) if with_dot else None
    if to_channels_last:
        return _to_channels_last(gz, r, groups, z, e), e
    batch, channels = gz.shape[:2]
    gy = torch.empty_like(gz)
    _call(f"scale_and_dot{_layout(gz)}", gz.dtype)(
        gz.data_ptr(), _ptr(z), r.data_ptr(), batch, channels, math.prod(r.shape[2:]), groups, gy.data_ptr(),
        _ptr(e), torch.get_num_threads(),
    )
    return gy, e


def group_update_(t: Tensor, r: Tensor, groups: int, src: Tensor | None = None) -> Tensor:
    """t (N, C, *S) in place: t·r, or t + src·r with ``src`` (t's shape and layout); r (N,
    groups, *S), each group's over its channels. Returns t."""
    batch, channels = t.shape[:2]
    _call(f"group_update{_layout(t)}", t.dtype)(
        t.data_ptr(), _ptr(src), r.data_ptr(), batch, channels, math.prod(r.shape[2:]), groups, torch.get_num_threads()
    )
    return t


def conv_pool_width(channels: int, dtype: torch.dtype) -> int:
    """``channels`` rounded up to whole vectors of the C pass (32 bytes): the row width of its
    weights, bias and their gradients (the spare channels zero)."""
    lanes = 256 // torch.finfo(dtype).bits  # (32 bytes)
    return -(-channels // lanes) * lanes


def conv_pool(xp: Tensor, wt: Tensor, bias: Tensor | None, channels: int, kernel: tuple[int, int],
              patchnorm: bool, keep_argmax: bool, relu: bool = False) -> tuple[Tensor, Tensor | None]:
    """(out, argmax): out (B, K·C, Hp, Wp), channels_last, = maxpool₂ₓ₂((conv(xp_k, W_k) + b_k)·r)
    for K models' one-channel inputs of C = ``channels`` output channels each, r = 1/√(‖patch‖² + 1)
    at each convolution output with ``patchnorm`` (PatchNormConv2d), else 1; then ReLU with
    ``relu`` (as ``max_pool2``'s). xp (K, B, Hq, Wq)
    contiguous, zero-padded beforehand; wt (K, kh·kw, Cp) contiguous, each tap's channels side by
    side and Cp = ``conv_pool_width(C)`` with the spare channels zero; bias (K·Cp,) likewise, or
    None. Hp = (Hq − kh + 1) // 2, as max_pool2d(2) floors. argmax (B, Hp, Wp, K·C) uint8, the
    window position (2a + b) of each maximum (the first, or the last NaN), ``POOL_NO_GRADIENT``
    where the ReLU passes none, or None without ``keep_argmax``. A MemoryError where PatchNorm's
    scales (one row of windows per thread, every model) cannot be allocated."""
    models, batch, hq, wq = xp.shape
    kh, kw = kernel
    width = conv_pool_width(channels, xp.dtype)
    if wt.shape != (models, kh * kw, width) or (bias is not None and bias.shape != (models * width,)):
        raise ValueError(f"conv_pool: wt must be ({models}, {kh * kw}, {width}) and bias ({models * width},) (the "
                         f"channels padded to whole vectors), got {tuple(wt.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    out = torch.empty((batch, (hq - kh + 1) // 2, (wq - kw + 1) // 2, models * channels), dtype=xp.dtype)
    argmax = torch.empty(out.shape, dtype=torch.uint8) if keep_argmax else None
    failed = _call("conv_pool", xp.dtype)(
        xp.data_ptr(), models, batch, channels, hq, wq, kh, kw, wt.data_ptr(), _ptr(bias), int(patchnorm),
        int(relu), out.data_ptr(), _ptr(argmax), torch.get_num_threads(),
    )
    if failed == -2:
        raise MemoryError(f"conv_pool: could not allocate PatchNorm's scales ({models} models, {wq} columns)")
    return out.permute(0, 3, 1, 2), argmax


#: The most taps (kh·kw) ``conv_pool_backward`` takes (the C pass's MAX_TAPS: it refuses more).
CONV_POOL_MAX_TAPS = 49


def conv_pool_backward(xp: Tensor, g: Tensor, argmax: Tensor, kernel: tuple[int, int], patchnorm: bool,
                       with_bias: bool) -> tuple[Tensor, Tensor | None]:
    """(dwt, db) of ``conv_pool`` at the gradient g of its output (the output's shape,
    channels_last): dwt (K, kh·kw, Cp) as wt, db (K·Cp,) or None without ``with_bias`` (the spare
    channels' entries are to be dropped). A kernel of more than ``CONV_POOL_MAX_TAPS`` taps is a
    ValueError; a MemoryError where PatchNorm's scales (a model's windows per thread) cannot be
    allocated."""
    models, batch, hq, wq = xp.shape
    (kh, kw), channels = kernel, g.shape[1] // models
    width = conv_pool_width(channels, xp.dtype)
    dwt = torch.empty((models, kh * kw, width), dtype=xp.dtype)
    db = torch.empty(models * width, dtype=xp.dtype) if with_bias else None
    refused = _call("conv_pool_backward", xp.dtype)(
        xp.data_ptr(), g.data_ptr(), argmax.data_ptr(), models, batch, channels, hq, wq, kh, kw, int(patchnorm),
        dwt.data_ptr(), _ptr(db), torch.get_num_threads(),
    )
    if refused == -1:
        raise ValueError(f"conv_pool_backward takes at most {CONV_POOL_MAX_TAPS} taps, got a {kh}x{kw} kernel")
    if refused == -2:
        raise MemoryError(f"conv_pool_backward: could not allocate PatchNorm's scales ({batch} samples of {hq}x{wq})")
    return dwt, db


#: The position byte of a pooled value whose ReLU passes no gradient (``max_pool2``, ``conv_pool``).
POOL_NO_GRADIENT = 4


def max_pool2(x: Tensor, relu: bool, keep_which: bool) -> tuple[Tensor, Tensor | None]:
    """(out, which) of a 2×2 max-pool (stride 2, floor mode) of x (B, C, H, W), channels_last, then
    ReLU with ``relu``: out (B, C, H // 2, W // 2) channels_last, each window's maximum (the first
    in row order, or the last NaN, as max_pool2d), then 0 where it is negative (−0 and NaN kept,
    as torch's relu); which (B, H // 2, W // 2, C) uint8, the maximum's window position 2a + b,
    ``POOL_NO_GRADIENT`` where the ReLU passes none (its output neither > 0 nor NaN, as its
    backward reads it), or None without ``keep_which``."""
    batch, channels, h, w = x.shape
    out = torch.empty((batch, h // 2, w // 2, channels), dtype=x.dtype)
    which = torch.empty(out.shape, dtype=torch.uint8) if keep_which else None
    _call("max_pool2", x.dtype)(x.data_ptr(), batch, h, w, channels, int(relu), out.data_ptr(), _ptr(which),
                                torch.get_num_threads())
    return out.permute(0, 3, 1, 2), which


def max_pool2_backward(g: Tensor, which: Tensor, input_shape: torch.Size) -> Tensor:
    """dx (``input_shape`` (B, C, H, W), channels_last) of ``max_pool2`` at its output's gradient g
    (channels_last): g at each window's position ``which``, 0 at every other element."""
    batch, channels, h, w = input_shape
    dx = torch.empty((batch, h, w, channels), dtype=g.dtype)
    _call("max_pool2_backward", g.dtype)(g.data_ptr(), which.data_ptr(), batch, h, w, channels, dx.data_ptr(),
                                         torch.get_num_threads())
    return dx.permute(0, 3, 1, 2)


def channels_last_copy(t: Tensor, into: Tensor | None = None) -> Tensor:
    """t (N, C, H, W) contiguous, copied channels_last into ``into`` (a contiguous tensor of t's
    shape, not t itself, allocated if None): returns ``channels_last_view(into)``."""
    if into is not None and t.numel() and into.data_ptr() == t.data_ptr():
        raise ValueError("channels_last_copy: `into` must not be t's own storage")
    return _to_channels_last(t, into=into)


def channels_last_view(buffer: Tensor) -> Tensor:
    """A contiguous (N, C, H, W) buffer's storage read as (N, H, W, C) rows: the same-shaped
    channels_last view; ``buffer`` stays usable in its own layout afterwards."""
    batch, channels, height, width = buffer.shape
    return buffer.view(batch, height, width, channels).permute(0, 3, 1, 2)


def _to_channels_last(t, r=None, groups=1, z=None, e=None, into=None) -> Tensor:
    """``channels_last_copy``; with r: t·r (see ``scale_and_dot``), with z and e: e too."""
    batch, channels, height, width = t.shape
    out = channels_last_view(torch.empty_like(t) if into is None else into)
    _call("scale_and_dot_to_cl", t.dtype)(
        t.data_ptr(), _ptr(z), _ptr(r), batch, channels, height * width, groups, out.data_ptr(), _ptr(e),
        torch.get_num_threads(),
    )
    return out


def group_update_from_channels_last(d: Tensor, r: Tensor, groups: int, src: Tensor, out: Tensor) -> Tensor:
    """out = d + src·r (``group_update_`` with src, across layouts): d channels_last (N, C, H,
    W), src and out contiguous; r (N, groups, H, W), each group's over its channels. Returns out."""
    batch, channels, height, width = d.shape
    _call("group_update_from_cl", d.dtype)(
        d.data_ptr(), src.data_ptr(), r.data_ptr(), batch, channels, height * width, groups, out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def attention_scores(q: Tensor, k: Tensor, tokens: int, heads: int) -> Tensor:
    """s (N, heads, tokens, tokens) = q_h k_hᵀ/√d_h for each of the N sequences and each head h, from
    rows q, k (N·tokens, heads·d_h) contiguous, head h's entries h·d_h … (h + 1)·d_h − 1 of each row."""
    rows, width = q.shape
    size, sequences = width // heads, rows // tokens
    s = torch.empty((sequences, heads, tokens, tokens), dtype=q.dtype)
    threads = torch.get_num_threads()
    scratch = _scratch(threads, size, tokens, q.dtype)  # (held until the pass returns)
    _call("attention_scores", q.dtype)(
        q.data_ptr(), k.data_ptr(), sequences, tokens, heads, size, 1 / math.sqrt(size), s.data_ptr(),
        scratch.data_ptr(), threads,
    )
    return s


def attention_probabilities(q: Tensor, k: Tensor, tokens: int, heads: int) -> Tensor:
    """p = softmax(q_h k_hᵀ/√d_h) row-wise (N, heads, tokens, tokens) for rows q, k as
    ``attention_scores`` takes them, where ``attention_probabilities_take`` (float32, 16 tokens,
    heads of 8 entries): the scores never written, e^x by the pass's own polynomial. Each p is
    within (|s − max| + a few) units of float32's roundoff u, relative, of the float64 softmax of
    the pass's float32 scores (the rounding of s − max, then e^x's, the sum's and the product's;
    a score's own rounding δ softmax turns into up to 2δ more), except where e^(s − max) is under
    e^−87: 0 there, an absolute error under 1.7e-38. Not recorded by autograd (the attention's
    Function calls it). Other calls are a ValueError."""
    if not attention_probabilities_take(q, k, tokens, heads):
        raise ValueError(f"attention_probabilities: needs contiguous float32 CPU rows q, k of one shape, heads of "
                         f"8 entries, 16 tokens a sequence and a library built with the pass, got {q.dtype} "
                         f"{tuple(q.shape)} and {k.dtype} {tuple(k.shape)}, {tokens} tokens, {heads} heads")
    sequences = q.shape[0] // tokens
    p = torch.empty((sequences, heads, tokens, tokens), dtype=q.dtype)
    if _LIB.attention_probabilities_f32(q.data_ptr(), k.data_ptr(), sequences, tokens, heads, 8, 1 / math.sqrt(8),
                                        p.data_ptr(), torch.get_num_threads()) != 0:
        raise AssertionError("attention_probabilities: the pass refused what attention_probabilities_take took")
    return p


def attention_probabilities_take(q: Tensor, k: Tensor, tokens: int, heads: int) -> bool:
    """Whether ``attention_probabilities`` takes these rows: plain contiguous float32 CPU tensors q and
    k of one shape (N·16, 8·heads), and a library built with the pass."""
    return (q.dtype == k.dtype == torch.float32 and q.dim() == 2 and q.shape == k.shape and tokens == 16
            and q.shape[0] % 16 == 0 and q.shape[1] == 8 * heads and q.is_cpu and k.is_cpu and plain(q)
            and plain(k) and q.is_contiguous() and k.is_contiguous() and attention_probabilities_built())


def attention_probabilities_built() -> bool:
    """Whether the loaded library computes ``attention_probabilities`` (built by a compiler with the
    shuffle builtin)."""
    return _LIB is not None and _answers_probabilities(_LIB)


@functools.cache
def _answers_probabilities(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s softmax pass runs (asked once per library, of no sequences)."""
    return lib.attention_probabilities_f32(None, None, 0, 16, 1, 8, 1.0, None, 1) == 0


def attention_values(p: Tensor, v: Tensor) -> Tensor:
    """y (N·tokens, heads·d_h) = p_h v_h for each sequence and head h (entries as ``attention_scores``),
    from probabilities p (N, heads, tokens, tokens) and rows v, both contiguous."""
    sequences, heads, tokens, _ = p.shape
    y = torch.empty_like(v)
    _call("attention_values", v.dtype)(
        p.data_ptr(), v.data_ptr(), sequences, tokens, heads, v.shape[1] // heads, y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


def attention_backward(q: Tensor, k: Tensor, v: Tensor, p: Tensor, gy: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(gq, gk, gv), the gradients of y = softmax(q kᵀ/√d_h) v per sequence and head (the rows and
    p = the softmax as ``attention_values`` takes them) at the gradient gy of y: gv = pᵀ gy,
    ds = p ⊙ (gy vᵀ − Σ_u p ⊙ gy vᵀ)/√d_h, gq = ds k, gk = dsᵀ q; all contiguous, in the rows' layout."""
    sequences, heads, tokens, _ = p.shape
    size = q.shape[1] // heads
    gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    threads = torch.get_num_threads()
    scratch = _scratch(threads, size, tokens, q.dtype)  # (held until the pass returns)
    _call("attention_backward", q.dtype)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), p.data_ptr(), gy.data_ptr(), sequences, tokens, heads, size,
        1 / math.sqrt(size), gq.data_ptr(), gk.data_ptr(), gv.data_ptr(), scratch.data_ptr(), threads,
    )
    return gq, gk, gv


def _scratch(threads: int, size: int, tokens: int, dtype: torch.dtype) -> Tensor:
    """The working memory of the attention passes for each of ``threads`` threads (the count the
    pass is given): a head's keys or values transposed and the gradient of its scores."""
    return torch.empty(threads * (size + tokens) * tokens, dtype=dtype)


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) of each model's LayerNorm with its affine over the last dimension: x (K, M,
    d), gamma and beta (K, d), all contiguous of one dtype; y like x, mean and rstd (K, M)."""
    models, rows, d = x.shape
    y = torch.empty_like(x)
    mean, rstd = (x.new_empty((models, rows)) for _ in range(2))
    _call("layer_norm", x.dtype)(x.data_ptr(), gamma.data_ptr(), beta.data_ptr(), models, rows, d, eps, y.data_ptr(),
                                 mean.data_ptr(), rstd.data_ptr(), torch.get_num_threads())
    return y, mean, rstd


def layer_norm_backward(x: Tensor, gy: Tensor, gamma: Tensor, mean: Tensor, rstd: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """(∂x, ∂γ, ∂β) of ``layer_norm`` at the gradient gy of its output (contiguous, like x); ∂γ
    and ∂β (K, d) in x's dtype, summed over blocks of rows in it and over the blocks in float64."""
    models, rows, d = x.shape
    gx = torch.empty_like(x)
    dgamma, dbeta = (torch.empty((models, d), dtype=torch.float64) for _ in range(2))
    partial = x.new_empty((models, 2, d))  # (held until the pass returns)
    _call("layer_norm_backward", x.dtype)(
        x.data_ptr(), gy.data_ptr(), gamma.data_ptr(), mean.data_ptr(), rstd.data_ptr(), models, rows, d,
        gx.data_ptr(), dgamma.data_ptr(), dbeta.data_ptr(), partial.data_ptr(), torch.get_num_threads(),
    )
    return gx, dgamma.to(x.dtype), dbeta.to(x.dtype)


def non_overlapping_and_dense(t: Tensor) -> bool:
    """Whether t's elements fill a block of its storage one each, in some order of its dimensions
    (a permutation of a contiguous tensor: its strides, sorted, are those of a contiguous tensor);
    true for an empty tensor."""
    if t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted((pair for pair in zip(t.shape, t.stride()) if pair[0] != 1), key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def tanh(x: Tensor) -> Tensor:
    """tanh(x) of a ``plain`` float32 CPU tensor stored densely in any order of its dimensions
    (``non_overlapping_and_dense``), in x's layout (module docstring). Another tensor is a
    ValueError."""
    if x.dtype != torch.float32 or not x.is_cpu or not plain(x) or not non_overlapping_and_dense(x):
        raise ValueError(f"tanh: needs a plain dense float32 CPU tensor, got a {type(x).__name__} of {x.dtype} on "
                         f"{x.device}, shape {tuple(x.shape)}, strides {x.stride()}, negated or conjugated view "
                         f"{x.is_neg() or x.is_conj()}")
    y = torch.empty_like(x)  # (a dense tensor's strides: element i of y's storage is tanh of x's)
    _LIB.tanh_f32(x.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
    return y

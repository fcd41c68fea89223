"""The corrected layers' autograd nodes in C++ (``_autograd_nodes.cpp``), and oneDNN's batched matmul.

A Python ``autograd.Function`` costs a small layer's call more than its arithmetic: an identity
Function after ``nn.Linear`` alone takes 1.1-1.35× the time of ``nn.Linear`` at batch 16 and 1.4×
at batch 2 (see ``affdiv bench layers``). The extension defines AffineLikeFunction and
NormLikeFunction of ``_autograd`` as C++ autograd nodes, branch for branch: the fused row passes of
``_fused`` where those may run (the nodes bind them by name from the library ``_fused`` loaded, of
the interface version they were compiled with), the plain-torch passes, op for op, elsewhere. So
the same numbers to the bit as the Python Functions, double backward included. Two differences:
a node's backward computes only the gradients the backward asks for (a Python Function's, those
whose inputs required one at forward time), which changes no number; and it decides per call
whether its passes may run by each tensor (no forward-mode tangent, not wrapped), not by
``_fused.disabled`` or a forward-mode level entered after the forward, where the Function's backward
would take its plain-torch passes (the same formulas; the last bits may differ).

PatchNormConvFunction's fused branch is a node too (``patchnorm_conv``): a 2-D convolution (4-D
x) that the Function would run on its fused passes without rescaling, with the same passes and
convolutions, so the same numbers to the bit; its backward takes the fused branch where the
Function's would and otherwise calls the Function's own (``_autograd.patchnorm_conv_grads``).

The extension is optional (built at install where torch's headers and a C++ compiler are
present) and tied to the torch it was compiled against: it is used only when that is the running
torch. ``affine_like`` and ``norm_like`` run a call on a node, or return None where it may not take
one: the extension not loaded, ``disabled`` or ``_fused.disabled`` (which asks for the plain-torch
passes: the Python Functions run them), not eager mode (traced, under a torch.func transform, a
dispatch mode other than one that only observes, or forward-mode AD: those need the Python
Functions' vmap rules and jvp; under an observing mode the nodes run, their fused passes not), a
tensor of a subclass (whose overrides a node would skip), or x not a 2-D plain CPU float32/float64
tensor with weight and bias of its dtype (checked in C++, where it costs a fraction of a
microsecond).
A graph may be recorded: the nodes' backward is itself differentiable.

The extension also binds torch's own call of oneDNN's matmul (``at::native::mkldnn_matmul``, not
declared in the headers torch installs: bound by its symbol, and kept only if a small product
through it matches torch's), for the stacked training engine's float32 batched products
(``onednn_bmm_``; see ``affdiv.experiments.runs.stacked_matmul``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from affdiv.layers import _fused
from affdiv.layers._torch_internals import saved_tensors_hooks_active, untraced_eager

_state = {"disabled": False}  # process-wide (``disabled`` is for tests and benchmarks)
#: The version of the extension's interface with the Python side (``_autograd.patchnorm_conv_grads``'s
#: signature, the extension's functions), its ``PYTHON_INTERFACE``: raise both with any change of it.
PYTHON_INTERFACE = 2


def _running_torch() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the running torch, None where its version does not say."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__)
    return None if match is None else tuple(int(part) for part in match.groups())


def _load():
    """The compiled module, or None where it was not built or was built for another torch."""
    if importlib.util.find_spec("affdiv.layers._autograd_nodes") is None:
        return None
    try:
        module = importlib.import_module("affdiv.layers._autograd_nodes")
    except ImportError as error:  # (undefined symbols: compiled against another torch)
        warnings.warn(f"affdiv.layers: the C++ autograd nodes did not load ({error}); using the Python Functions",
                      stacklevel=2)
        return None
    if getattr(module, "PYTHON_INTERFACE", None) != PYTHON_INTERFACE:
        warnings.warn("affdiv.layers: the C++ autograd nodes were built from other sources (a stale build); using "
                      "the Python Functions (reinstall affdiv to rebuild them)", stacklevel=2)
        return None
    built_for = tuple(module.BUILT_FOR_TORCH)
    if built_for != _running_torch():
        warnings.warn(
            f"affdiv.layers: the C++ autograd nodes were built for torch {'.'.join(map(str, built_for))}, "
            f"this is torch {torch.__version__}; using the Python Functions (reinstall affdiv with "
            "--no-build-isolation to build them for this torch)", stacklevel=2,
        )
        return None
    if _fused.available() and not module.bind_passes(_fused.library_path()):
        warnings.warn("affdiv.layers: the C++ autograd nodes could not bind the fused passes (a library of "
                      "another interface version?); they run their torch ops", stacklevel=2)
    return module


_MODULE = _load()
_onednn = {"bound": None}  # whether the extension bound oneDNN's matmul: asked at the first use


def available() -> bool:
    """Whether the C++ nodes were built for this torch and loaded."""
    return _MODULE is not None


def passes_bound() -> bool:
    """Whether the C++ nodes have the fused passes (else the dense nodes run their torch ops and the
    PatchNorm convolution's serves no call)."""
    return _MODULE is not None and _MODULE.passes_bound()


def onednn_enabled() -> bool:
    """Whether the extension bound this torch's oneDNN matmul (it passed its self-test: on x86 the
    float32 path needs AVX-512 or AVX-NE-CONVERT) and ``disabled`` is not in force. The self-test
    runs at the first call, which should come in eager mode with no dispatch mode active (as
    ``stacked_matmul.usable`` calls it): a mode active then would see its products."""
    if _state["disabled"] or _MODULE is None:
        return False
    if _onednn["bound"] is None:  # (the extension's self-test, once: a few small products)
        _onednn["bound"] = bool(_MODULE.onednn_bound())
    return _onednn["bound"]


def onednn_bmm_(out: Tensor, a: Tensor, b: Tensor, beta: float = 0.0, alpha: float = 1.0) -> Tensor:
    """out = beta·out + alpha·(a b) by oneDNN, for float32 CPU tensors a (K, M, L), b (K, L, N) and
    out (K, M, N), out contiguous and overlapping neither (a and b may be transposed in their last
    two dimensions); with beta = 0 out's values are not read, with alpha = 0 out is left as it is.
    Returns out. Private: call only where :func:`onednn_enabled`."""
    _MODULE.onednn_bmm_(out, a, b, beta, alpha)
    return out


def disabled() -> contextlib.AbstractContextManager:
    """Run the Python Functions inside the block, and torch's products instead of oneDNN's (for
    tests and benchmarks of both paths)."""
    return _fused.flag_raised(_state, "disabled")


@contextlib.contextmanager
def without_passes() -> Iterator[None]:
    """The C++ nodes run without the fused passes inside the block (for tests of that branch)."""
    if _MODULE is None:
        raise RuntimeError("without_passes: the C++ autograd nodes are not available")
    _MODULE.bind_passes("")
    try:
        yield
    finally:
        if _fused.available():
            _MODULE.bind_passes(_fused.library_path())


def _servable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the state lets a call take the C++ nodes and the tensors are of torch's own types:
    built and not disabled; no trace, torch.func transform, dispatch mode (but one that only
    observes) or forward-mode AD active;
    no subclass (the extension checks the rest of the tensors)."""
    return not (_MODULE is None or _state["disabled"] or _fused.is_disabled() or not untraced_eager()
                or type(x) not in _fused.PLAIN_TYPES or type(weight) not in _fused.PLAIN_TYPES
                or (bias is not None and type(bias) not in _fused.PLAIN_TYPES))


def affine_like(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """z = (x Wᵀ + b)/√(‖x‖² + 1) per row by the C++ node; None where it does not serve the call
    (``_servable``; or x not 2-D, not all CPU tensors of x's dtype, float32 or float64, not plain:
    the extension checks those)."""
    return _MODULE.affine_like(x, weight, bias) if _servable(x, weight, bias) else None


def norm_like(x: Tensor, weight: Tensor, bias: Tensor | None, k: float, eps: float) -> Tensor | None:
    """z = q·(x Wᵀ) + b, q = k/max(‖x‖, eps) per row by the C++ node; None where it does not serve the
    call (see ``affine_like``)."""
    return _MODULE.norm_like(x, weight, bias, k, eps) if _servable(x, weight, bias) else None


def patchnorm_conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Sequence[int], padding: Sequence[int],
                   dilation: Sequence[int], groups: int) -> Tensor | None:
    """z = r·(conv(x, W) + b), r = 1/√(‖P‖² + 1) per group and position, by the C++ node; None where
    it does not serve the call (``_servable``; saved-tensor hooks active, which a held z would
    escape; or, checked by the extension, x not 4-D, not all CPU tensors of x's dtype, float32 or
    float64, not plain, the fused passes not bound or not usable on x, or some sample's squares
    not finite: the Function's branches that rescale)."""
    if not _servable(x, weight, bias) or saved_tensors_hooks_active():
        return None
    return _MODULE.patchnorm_conv(x, weight, bias, stride, padding, dilation, groups)

"""The dense corrected layers' autograd nodes in C++ (``_dense_autograd.cpp``).

A Python ``autograd.Function`` costs a small layer's call more than its arithmetic: an identity
Function after ``nn.Linear`` alone takes 1.1-1.5× the time of ``nn.Linear`` at batch 16 (see
``affdiv bench layers``). The extension defines AffineLikeFunction and NormLikeFunction of
``_autograd`` as C++ autograd nodes, branch for branch: the fused row passes of ``_fused`` where
those may run (the nodes bind them by name from the library ``_fused`` loaded), the plain-torch
passes, op for op, elsewhere. So the same numbers to the bit as the Python Functions, double
backward included.

The extension is optional (built at install where torch's headers and a C++ compiler are
present) and tied to the torch it was compiled against: it is used only when that is the running
torch. ``usable`` says whether a call may take it: the extension loaded and neither ``disabled``
nor ``_fused.disabled`` (which asks for the plain-torch passes: the Python Functions run them), x
a 2-D plain CPU float32/float64 tensor with weight and bias of its dtype, in eager mode (not
traced, not under a torch.func transform, no dispatch mode, no forward-mode AD: those need the
Python Functions' vmap rules and jvp). A graph may be recorded: the nodes' backward is itself
differentiable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from affdiv.layers import _fused
from affdiv.layers._fused import plain
from affdiv.layers._torch_internals import (
    dispatch_mode_active,
    forward_ad_active,
    functorch_transforms_active,
    is_compiling,
)

_DTYPES = (torch.float32, torch.float64)
_state = {"disabled": False}  # process-wide (``disabled`` is for tests and benchmarks)


def _running_torch() -> tuple[int, int, int] | None:
    """(major, minor, patch) of the running torch, None where its version does not say."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", torch.__version__)
    return None if match is None else tuple(int(part) for part in match.groups())


def _load():
    """The compiled module, or None where it was not built or was built for another torch."""
    if importlib.util.find_spec("affdiv.layers._dense_autograd") is None:
        return None
    try:
        module = importlib.import_module("affdiv.layers._dense_autograd")
    except ImportError as error:  # (undefined symbols: compiled against another torch)
        warnings.warn(f"affdiv.layers: the C++ autograd nodes did not load ({error}); using the Python Functions",
                      stacklevel=2)
        return None
    built_for = tuple(module.BUILT_FOR_TORCH)
    if built_for != _running_torch():
        warnings.warn(
            f"affdiv.layers: the C++ autograd nodes were built for torch {'.'.join(map(str, built_for))}, "
            f"this is torch {torch.__version__}; using the Python Functions (reinstall affdiv with "
            "--no-build-isolation to build them for this torch)", stacklevel=2,
        )
        return None
    if _fused.available():
        module.bind_row_passes(_fused.library_path())
    return module


_MODULE = _load()


def available() -> bool:
    """Whether the C++ nodes were built for this torch and loaded."""
    return _MODULE is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the Python Functions inside the block (for tests and benchmarks of both paths)."""
    previous = _state["disabled"]
    _state["disabled"] = True
    try:
        yield
    finally:
        _state["disabled"] = previous


@contextlib.contextmanager
def without_row_passes() -> Iterator[None]:
    """The C++ nodes take their plain-torch passes inside the block (for tests of that branch)."""
    if _MODULE is None:
        raise RuntimeError("without_row_passes: the C++ autograd nodes are not available")
    _MODULE.bind_row_passes("")
    try:
        yield
    finally:
        if _fused.available():
            _MODULE.bind_row_passes(_fused.library_path())


def usable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a dense layer's call on (x, weight, bias) may take the C++ node (module docstring)."""
    if (_MODULE is None or _state["disabled"] or _fused.is_disabled() or is_compiling() or functorch_transforms_active()
            or dispatch_mode_active() or forward_ad_active()):
        return False
    dtype = x.dtype
    if dtype not in _DTYPES or x.dim() != 2:
        return False
    for t in (x, weight, bias):  # (a loop, not all() over a generator: this runs at every call)
        if t is not None and not (plain(t) and t.dtype == dtype and t.is_cpu):
            return False
    return True


def affine_like(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """z = (x Wᵀ + b)/√(‖x‖² + 1) per row, by the C++ node (``usable`` must hold)."""
    return _MODULE.affine_like(x, weight, bias)


def norm_like(x: Tensor, weight: Tensor, bias: Tensor | None, k: float, eps: float) -> Tensor:
    """z = q·(x Wᵀ) + b, q = k/max(‖x‖, eps) per row, by the C++ node (``usable`` must hold)."""
    return _MODULE.norm_like(x, weight, bias, k, eps)

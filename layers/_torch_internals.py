"""Every query of torch's private state that the layers branch on, in one place.

The layers take their fastest path (fused C kernels, in-place updates of their own temporaries,
data-dependent branches, holding the output for backward) only on plain tensors in plain eager
mode. Telling that apart needs a few of torch's private functions, which may change between
torch releases; ``tests/layers/test_torch_internals.py`` pins what each answers in eager mode,
under ``torch.func.vmap``, under ``torch.compile``, under a dispatch mode, in forward-mode AD and
under saved-tensor hooks, so that a torch upgrade that changes one fails there first.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_compiling() -> bool:
    """True while torch.compile (dynamo) traces the calling code: then no data-dependent Python
    branch, no ctypes call and no version counter may be used."""
    return torch.compiler.is_compiling()


def functorch_transforms_active() -> bool:
    """True inside a torch.func transform (vmap, grad, vjp, jvp, jacrev, jacfwd, functional
    autograd of an autograd.Function): autograd.Functions must then be applied through
    ``Function.apply`` with ``setup_context``, which the transforms require."""
    return torch._C._are_functorch_transforms_active()


def is_functorch_wrapped(t: Tensor) -> bool:
    """True for a tensor wrapped by a torch.func transform (a vmap BatchedTensor, a grad or jvp
    wrapper): it has no storage of its own to hand to a C kernel or to update in place."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_legacy_batched(t: Tensor) -> bool:
    """True for a tensor batched by the legacy vmap that ``torch.autograd.grad(...,
    is_grads_batched=True)`` (vectorised Jacobians) runs a backward under."""
    return torch._C._functorch.is_legacy_batchedtensor(t)


def forward_ad_active() -> bool:
    """True inside ``torch.autograd.forward_ad.dual_level`` (also torch.func.jvp's): tensors may
    carry tangents, which a ctypes kernel would drop (forward-over-reverse through a backward
    without ``create_graph`` runs its passes on dual tensors)."""
    return torch.autograd.forward_ad._current_level >= 0


def dispatch_mode_active() -> bool:
    """True while a TorchDispatchMode (FakeTensorMode, FlopCounterMode, …) intercepts every op:
    a ctypes kernel would bypass it. A mode with ``affdiv_observes_only = True`` (a class attribute:
    it runs every op on the real tensors unchanged and only looks at them, as a benchmark's recorder
    of the ops a step runs) does not count: the package's kernels run under it, unseen by it."""
    depth = torch._C._len_torch_dispatch_stack()
    if not depth:  # (the common case, before any generator)
        return False
    return any(not getattr(torch._C._get_dispatch_stack_at(i), "affdiv_observes_only", False) for i in range(depth))


def untraced_eager() -> bool:
    """True where a call runs eagerly on real tensors: not traced by torch.compile, under no
    torch.func transform, dispatch mode or forward-mode AD, whose rules only torch's ops have (the
    condition for a kernel of the package's own, C or C++, to run at all)."""
    return not (is_compiling() or functorch_transforms_active() or dispatch_mode_active() or forward_ad_active())


def saved_tensors_hooks_active() -> bool:
    """True inside ``torch.autograd.graph.saved_tensors_hooks`` (activation checkpointing,
    ``save_on_cpu``): a tensor kept for backward outside ``save_for_backward`` would escape them."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None

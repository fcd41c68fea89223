"""The probes of torch's private state (layers/_torch_internals.py) answer right in every mode the
layers branch on: a torch upgrade that changes one of the private functions fails here first."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import TorchDispatchMode

from affdiv.layers import _torch_internals as probes

PROBES = ("is_compiling", "functorch_transforms_active", "is_functorch_wrapped", "is_legacy_batched",
          "forward_ad_active", "dispatch_mode_active", "saved_tensors_hooks_active")


def _ask(t: torch.Tensor) -> dict[str, bool]:
    """Every probe's answer here, about t where it takes a tensor."""
    return {name: bool(getattr(probes, name)(t) if name in ("is_functorch_wrapped", "is_legacy_batched")
                       else getattr(probes, name)()) for name in PROBES}


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Observer(_PassThrough):
    affdiv_observes_only = True


def _answers() -> dict[str, dict[str, bool]]:
    x = torch.randn(3, 2)
    seen = {"eager": _ask(x)}

    def under_vmap(row):
        seen["vmap"] = _ask(row)
        return row

    torch.func.vmap(under_vmap)(x)
    with _PassThrough():
        seen["dispatch mode"] = _ask(x)
    with _Observer():
        seen["observing dispatch mode"] = _ask(x)
    with _Observer(), _PassThrough():
        seen["dispatch mode inside an observing one"] = _ask(x)
    with _PassThrough(), _Observer():
        seen["observing dispatch mode inside another"] = _ask(x)
    with fwAD.dual_level():
        seen["forward AD"] = _ask(fwAD.make_dual(x, torch.ones_like(x)))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        seen["saved-tensor hooks"] = _ask(x)
    leaf = x.clone().requires_grad_(True)
    y = leaf * 2
    y.register_hook(lambda grad: seen.update({"is_grads_batched": _ask(grad)}))
    torch.autograd.grad(y, leaf, torch.ones(4, 3, 2), is_grads_batched=True)
    # traced: dynamo evaluates the probes it can trace at trace time and bakes the answers in
    traced = torch.compile(lambda t: torch.stack([t.new_tensor(float(probes.is_compiling())),
                                                  t.new_tensor(float(probes.functorch_transforms_active()))]),
                           backend="eager", fullgraph=True)
    torch._dynamo.reset()
    compiled, transforms = traced(x).tolist()
    seen["torch.compile"] = {"is_compiling": bool(compiled), "functorch_transforms_active": bool(transforms)}
    return seen


def test_each_probe_answers_right_in_eager_vmap_compile_dispatch_forward_ad_hooks_and_batched_grads():
    answers = _answers()
    torch._dynamo.reset()
    only = {  # the probes that answer True in each mode; every other probe answers False
        "eager": set(),
        "vmap": {"functorch_transforms_active", "is_functorch_wrapped"},
        "dispatch mode": {"dispatch_mode_active"},
        "observing dispatch mode": set(),  # (affdiv_observes_only: the package's kernels run under it)
        "dispatch mode inside an observing one": {"dispatch_mode_active"},
        "observing dispatch mode inside another": {"dispatch_mode_active"},
        "forward AD": {"forward_ad_active"},
        "saved-tensor hooks": {"saved_tensors_hooks_active"},
        "is_grads_batched": {"is_legacy_batched"},
    }
    for mode, true in only.items():
        assert answers[mode] == {name: name in true for name in PROBES}, mode
    assert answers["torch.compile"] == {"is_compiling": True, "functorch_transforms_active": False}

"""The capture pass: hooks that record every measured module's inputs, output and output
gradient in one forward and one backward; calling one module alone as a function of its
parameters; the tensors of a module's output that reach the loss; what makes a module
unmeasurable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from affdiv.meter.kinds import linear_in_parameters
from affdiv.verify.functional import ModuleFunction


@dataclass
class Record:
    """What the capture pass saw of one module."""

    module: nn.Module
    calls: int = 0
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: object = None
    versions: list = field(default_factory=list)  # (tensor, version) of its tensor inputs
    rng_state: Tensor | None = None
    entry_versions: list = field(default_factory=list)  # the same when the call began
    modifies_input: bool = False
    selected: tuple[int, ...] | None = None  # the output's tensors that reach the loss (once measured)


class Hooks:
    """Forward hooks on every module; what they do depends on ``mode``:

    capture  record inputs and output of the measured modules (and hand on a copy of the output)
    tangent  read each measured module's output tangent (forward-mode AD)
    inject   add the module's diagonal d to its output tangent, then read it
    collect  keep each measured module's output (the functions vmapped by the masked route)
    compare  keep each measured module's output (the sub-batch independence check)
    None     do nothing (the module-alone passes)
    """

    def __init__(self, model: nn.Module, measured: Mapping[str, nn.Module]):
        self.mode: str | None = None
        self.records = {name: Record(module) for name, module in measured.items()}
        self.stack: list[str] = []
        self.seen: dict[str, object] = {}
        self.inject: dict[str, Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            if self.mode is None:
                return None
            self.stack.append(name)
            if self.mode == "capture" and name in self.records:
                record = self.records[name]
                if not linear_in_parameters(module):
                    record.rng_state = torch.get_rng_state()
                record.entry_versions = [(a, a._version) for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            return None

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            if self.mode is None:
                return None
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if name not in self.records:
                return None
            record = self.records[name]
            if self.mode == "capture":
                record.calls += 1
                if record.calls == 1:
                    record.modifies_input = any(t._version != v for t, v in record.entry_versions)
                    record.args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
                    record.kwargs = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
                    record.versions = [(a, a._version) for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
                    record.output = output
            elif record.selected is None:  # not measured
                return None
            elif self.mode == "tangent":
                self.seen[name] = _tangent(output, record.selected)
            elif self.mode == "inject":
                d = self.inject.get(name)
                if d is not None:
                    leaves, spec = tree_flatten(output)
                    for i, part in zip(record.selected, _split(d, [leaves[i] for i in record.selected])):
                        leaves[i] = leaves[i] + fwAD.make_dual(torch.zeros_like(part), part)
                    output = tree_unflatten(leaves, spec)
                self.seen[name] = _tangent(output, record.selected)
            else:  # collect, compare
                self.seen[name] = joined_output(output_leaves(output), record.selected)
            # the rest of the network gets a copy: an in-place op downstream (ReLU(inplace=True))
            # must not change what was recorded here
            return tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, output)

        return hook

    @contextlib.contextmanager
    def active(self, mode: str) -> Iterator[None]:
        previous = self.mode
        self.mode, self.stack, self.seen = mode, [], {}
        try:
            yield
        finally:
            self.mode = previous

    def where(self) -> str:
        return self.stack[-1] if self.stack else "<model>"


def direct_params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in module._parameters.items() if p is not None}


def trainable_params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in direct_params(module).items() if p.requires_grad}


def _call_alone(module: nn.Module, values: Mapping[str, Tensor], args: tuple, kwargs: dict,
                rng_state: Tensor | None) -> Tensor:
    """``module`` on (args, kwargs) with its direct parameters replaced by ``values`` (children
    keep theirs), fresh copies of its buffers, from ``rng_state`` when given."""
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        return functional_call(module, {**values, **buffers}, args, kwargs, tie_weights=False, strict=False)


def output_leaves(output) -> list:
    """The leaves of a (possibly nested) output: a Tensor is its own one leaf."""
    return tree_flatten(output)[0]


def joined_output(leaves: Sequence | Mapping[int, Tensor], selected: tuple[int, ...]) -> Tensor:
    """The measured output z: the one selected leaf as it is, or several selected leaves side by
    side per sample, each flattened to (B, ·) (nn.MultiheadAttention with need_weights=True and
    its weights used downstream; an LSTM's output and final state)."""
    if len(selected) == 1:
        return leaves[selected[0]]
    return torch.cat([leaves[i].reshape(leaves[i].shape[0], -1) for i in selected], dim=1)


def _tangent(output, selected: tuple[int, ...]) -> Tensor | None:
    """The forward-mode tangent of the measured output (None where no selected tensor has one)."""
    leaves = output_leaves(output)
    tangents = {i: fwAD.unpack_dual(leaves[i]).tangent for i in selected}
    if all(t is None for t in tangents.values()):
        return None
    return joined_output({i: torch.zeros_like(leaves[i]) if t is None else t for i, t in tangents.items()}, selected)


def _split(z: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The inverse of :func:`joined_output` on the selected leaves ``like``."""
    if len(like) == 1:
        return [z]
    parts = z.split([t[0].numel() for t in like], dim=1)
    return [part.reshape(t.shape) for part, t in zip(parts, like)]


@contextlib.contextmanager
def differentiable_kernels() -> Iterator[None]:
    """Attention computed by its math path while the meter runs: scaled dot-product attention on
    SDPBackend.MATH (torch.nn.attention.sdpa_kernel) and the fast path of nn.MultiheadAttention
    and nn.TransformerEncoderLayer off (torch.backends.mha). The fused kernels have no
    forward-mode AD, and the encoder layer's fast path would bypass its submodules' hooks; the
    math path computes the same function (to rounding) with every operation differentiable."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


@dataclass
class MeasuredModule:
    name: str
    module: nn.Module
    record: Record
    grad: Tensor
    step: dict[str, Tensor]  # its trainable parameters -> −η ∇L
    values: dict[str, Tensor]  # its parameters -> their values (detached)
    output: Tensor  # z as recorded (detached; the selected tensors of a tuple output, joined)

    def __call__(self, values: Mapping[str, Tensor], args: tuple, kwargs: dict,
                 rng_state: Tensor | None) -> Tensor:
        """z of the module alone on (args, kwargs) with ``values`` as its parameters."""
        leaves = output_leaves(_call_alone(self.module, values, args, kwargs, rng_state))
        return joined_output(leaves, self.record.selected)


@dataclass
class CapturePass:
    """What the capture pass gives, and what every later pass of the same measurement reuses: the
    network as a function of its parameters (``function``, its module ``function.module``), the
    ``hooks`` on it and its inputs (``args``, batch first), the measurable ``modules`` (those that
    cannot be measured are dropped from it as they are found), the step −η ∇θL of every parameter
    (``step``, by its name in ``function.params``), ∂L/∂out (``grad_out``) and η (``lr``)."""

    function: ModuleFunction
    hooks: Hooks
    args: tuple
    modules: dict[str, MeasuredModule]
    step: dict[str, Tensor]
    grad_out: Tensor
    lr: float

    @property
    def batch(self) -> int:
        return self.args[0].shape[0]


def error_reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def capture_problem(name, module, record: Record, owners, leaf_grads: Mapping[int, Tensor],
                     batch: int) -> str | None:
    """Why the capture pass cannot stand for this module, or None. ``leaf_grads``: the output
    gradient of each of its output's tensors that reaches the loss, by position in the output."""
    if record.calls == 0:
        return ("its forward was not called, and no parent module that is measured owns it (its parameters are "
                "used by another module directly, or not at all)")
    if record.calls > 1:
        return (f"called {record.calls} times in one forward (a shared module): its output is not one "
                "tensor per sample, so there is no one update to measure")
    for pname, p in direct_params(module).items():
        others = [o for o in owners[id(p)] if o != name]
        if others:
            return (f"its parameter {pname!r} is tied to module {others[0]!r}: its step carries that module's "
                    "gradient too")
    leaves = output_leaves(record.output)
    if not any(isinstance(t, Tensor) for t in leaves):
        return f"its output ({type(record.output).__name__}) holds no tensor"
    if not leaf_grads:
        return "its output does not reach the loss (no output gradient)"
    if any(leaves[i].dim() == 0 for i in leaf_grads):
        return "its output is a scalar, not batched"
    firsts = {leaves[i].shape[0] for i in leaf_grads}
    if len(leaf_grads) > 1 and firsts != {batch}:
        return (f"the tensors of its output that reach the loss have first dimensions {sorted(firsts)}, not all "
                f"the batch ({batch}): they cannot be joined per sample")
    if record.modifies_input:
        return "it modifies its input in place (the recorded input is not the one it read)"
    for tensor, version in record.versions:
        if tensor._version != version:
            return "its input was modified in place after the call (the recorded input is not the one it saw)"
    return None


def absorbed_children(measured: Mapping[str, nn.Module], records: Mapping[str, Record], owners) -> dict[str, str]:
    """Modules whose forward is never called but whose parent, called in the forward, uses their parameters
    directly (nn.MultiheadAttention's ``out_proj``): child -> parent. Their parameters are measured
    as the parent's (the parent's output is where they act)."""
    out = {}
    for name in measured:
        parent = name.rpartition(".")[0]
        if (name and records[name].calls == 0 and parent in measured and records[parent].calls >= 1
                and all(owners[id(p)] == [name] for p in direct_params(measured[name]).values())):
            out[name] = parent
    return out


def measured_params(name: str, module: nn.Module, absorbed: Mapping[str, str]) -> dict[str, Tensor]:
    """The parameters measured as this module's, by their name relative to it: its own, and those
    of the children it absorbs (``out_proj.weight``)."""
    params = dict(direct_params(module))
    children = dict(module.named_children())
    for child, parent in absorbed.items():
        if parent == name:
            local = child.rpartition(".")[2]
            params.update({f"{local}.{n}": p for n, p in direct_params(children[local]).items()})
    return params

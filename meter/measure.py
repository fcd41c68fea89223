"""The meter: :func:`divergence` measures every parameter-owning module of a network under one
SGD step (see :mod:`affdiv.meter`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from affdiv.meter.capture import (
    CapturePass,
    Hooks,
    MeasuredModule,
    absorbed_children,
    capture_problem,
    differentiable_kernels,
    direct_params,
    error_reason,
    joined_output,
    measured_params,
    output_leaves,
    trainable_params,
)
from affdiv.meter.options import REDUCTIONS, SCOPES, MeterOptions, UnmeasuredModuleWarning, UnsupportedModuleError
from affdiv.meter.report import DivergenceReport, layer_metrics
from affdiv.meter.routes import Update, layer_diagonal, layer_update, network_diagonals
from affdiv.verify.functional import ModuleFunction, as_inputs, check_lr


def divergence(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    loss: Callable[[Tensor], Tensor],
    *,
    lr: float,
    scope: str = "layer",
    per_sample: bool = True,
    reduction: str = "mean",
    options: MeterOptions | None = None,
) -> DivergenceReport:
    r"""Measure, for every parameter-owning module of ``model``, the alignment of its effective
    activation update under one SGD step with the ideal one (see the module docstring).

    Args:
        model: any ``nn.Module``; run in its current mode (train/eval), never modified.
        inputs: its positional input(s), batch first: a Tensor or a tuple of Tensors.
        loss: a function of the model output returning the per-sample losses, shape (B,).
        lr: η > 0 (the metrics do not depend on it; the kept updates scale with it).
        scope: ``"layer"`` (only the module's own parameters step) or ``"network"`` (all do).
        per_sample: also compute each sample's own update d_i (``diagonal_scale``,
            ``off_diagonal_share``).
        reduction: L = ``"mean"`` (default) or ``"sum"`` of the per-sample losses.
        options: how the meter computes and what it keeps (:class:`MeterOptions`; default: its
            defaults), never what it measures.

    Returns:
        :class:`DivergenceReport`.

    Example::

        >>> import torch
        >>> from affdiv.meter import divergence
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> report = divergence(net, x, lambda out: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        ...                     lr=0.1)
        >>> sorted(report.layers), report.layers["0"].off_diagonal_share.shape
        (['0', '2'], torch.Size([16]))
    """
    options = MeterOptions() if options is None else options
    lr, args, batch = _checked(model, inputs, loss, lr, scope, reduction, options)
    unsupported = _Unsupported(model, options.on_unsupported)
    measured = {name: m for name, m in model.named_modules() if trainable_params(m)}
    if not measured:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: there is no step to measure")
    function = ModuleFunction(model, args)
    with Hooks(model, measured) as hooks, differentiable_kernels():
        captured = _capture(function, hooks, measured, args, loss, lr, reduction, unsupported)
        modules = captured.modules
        effective = _batch_updates(captured, scope, unsupported)
        diagonals, network_route = {}, None
        if per_sample:
            layer_diagonals: dict[str, Update] = {}
            for name, m in list(modules.items()):
                try:
                    layer_diagonals[name] = layer_diagonal(m, lr, batch, options.memory_budget)
                except Exception as error:  # torch.func cannot run it: in layer scope, named, never a number
                    if scope == "layer":
                        unsupported(name, error_reason(error))
                        del modules[name]
            if scope == "layer":
                diagonals = layer_diagonals
            else:
                values, network_route = network_diagonals(
                    captured, {n: d.value for n, d in layer_diagonals.items()}, unsupported.skipped, options)
                diagonals = {n: Update(t, network_route) for n, t in values.items()}
    layers = {name: layer_metrics(m, scope, lr, effective[name], diagonals.get(name), options.keep_updates)
              for name, m in modules.items()}
    return DivergenceReport(layers, unsupported.skipped, scope, lr, reduction, batch, per_sample, network_route)


def _checked(model, inputs, loss, lr, scope, reduction, options) -> tuple[float, tuple[Tensor, ...], int]:
    """(lr, the inputs as a tuple, the batch size), every argument of :func:`divergence` checked."""
    lr = check_lr(lr)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(options, MeterOptions):
        raise TypeError(f"options must be a MeterOptions, got {type(options).__name__}")
    if not callable(loss):
        raise TypeError(f"loss must be a function of the model output, got {type(loss).__name__}")
    args = as_inputs(inputs)
    if not args or args[0].dim() == 0:
        raise ValueError("inputs must be batched: the first dimension of the first input is the batch")
    if args[0].shape[0] < 1:
        raise ValueError("inputs hold an empty batch")
    return lr, args, args[0].shape[0]


_METER = str(Path(__file__).resolve().parent)


class _Unsupported:
    """The modules left out: ``skipped`` {name: reason}, and ``absorbed`` {child whose forward is
    not called: the parent measured with its parameters}. Calling it with (name, reason) raises
    UnsupportedModuleError (``on_unsupported="raise"``) or records and warns, and leaves out the
    children the module absorbed too."""

    def __init__(self, model: nn.Module, on_unsupported: str):
        self.kinds = {name: type(module).__name__ for name, module in model.named_modules()}
        self.on_unsupported = on_unsupported
        self.skipped: dict[str, str] = {}
        self.absorbed: dict[str, str] = {}

    def __call__(self, name: str, reason: str) -> None:
        message = f"module {name!r} ({self.kinds[name]}): {reason}"
        if self.on_unsupported == "raise":
            raise UnsupportedModuleError(message)
        self.skipped[name] = reason
        warnings.warn(f"affdiv divergence meter: not measured: {message}", UnmeasuredModuleWarning,
                      stacklevel=_outside_the_meter())
        for child in [c for c, parent in self.absorbed.items() if parent == name]:
            self(child, f"its parameters are used by its parent module {name!r}, which is not measured")


def _outside_the_meter() -> int:
    """The ``stacklevel`` of a warning issued here that names the first caller outside this package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_METER):
        frame, level = frame.f_back, level + 1
    return level


def _capture(function: ModuleFunction, hooks: Hooks, measured: Mapping[str, nn.Module], args: tuple, loss,
             lr: float, reduction: str, unsupported: _Unsupported) -> CapturePass:
    """One forward and one backward: every measured module's inputs, output and output gradient
    (the tensors of its output that reach the loss) and the step; the modules that cannot be
    measured are left to ``unsupported``."""
    batch = args[0].shape[0]
    leaves = {n: t.detach().requires_grad_(True) for n, t in function.params.items()}
    with hooks.active("capture"), torch.enable_grad():
        out = function(leaves, args)
        if not isinstance(out, Tensor):
            raise ValueError(f"the model must return one tensor, got {type(out).__name__}")
        losses = loss(out)
        if not isinstance(losses, Tensor) or losses.shape != (batch,):
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(f"loss must return the per-sample losses, shape ({batch},), got {shape}")
        total = losses.mean() if reduction == "mean" else losses.sum()
        outputs = {(name, i): t for name, r in hooks.records.items() if r.calls == 1
                   for i, t in enumerate(output_leaves(r.output)) if isinstance(t, Tensor) and t.requires_grad}
        grads = torch.autograd.grad(total, [*leaves.values(), *outputs.values(), out], allow_unused=True)
    step = {n: -lr * (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(leaves, grads)}
    leaf_grads: dict[str, dict[int, Tensor]] = {}
    for (name, i), g in zip(outputs, grads[len(leaves):-1]):
        if g is not None:
            leaf_grads.setdefault(name, {})[i] = g.detach()

    owners: dict[int, list[str]] = {}
    for name, m in measured.items():
        for p in direct_params(m).values():
            owners.setdefault(id(p), []).append(name)
    canonical = {id(p): n for n, p in function.module.named_parameters()}
    unsupported.absorbed.update(absorbed_children(measured, hooks.records, owners))
    modules: dict[str, MeasuredModule] = {}
    for name, module in measured.items():
        if name in unsupported.absorbed:
            continue
        record = hooks.records[name]
        reason = capture_problem(name, module, record, owners, leaf_grads.get(name, {}), batch)
        if reason:
            unsupported(name, reason)
            continue
        record.selected = tuple(sorted(leaf_grads[name]))
        params = measured_params(name, module, unsupported.absorbed)
        own = {n: step[canonical[id(p)]] for n, p in params.items() if p.requires_grad}
        modules[name] = MeasuredModule(
            name, module, record, joined_output(leaf_grads[name], record.selected), own,
            {n: p.detach() for n, p in params.items()},
            joined_output(output_leaves(record.output), record.selected).detach(),
        )
    return CapturePass(function, hooks, args, modules, step, grads[-1], lr)


def _batch_updates(captured: CapturePass, scope: str, unsupported: _Unsupported) -> dict[str, Update]:
    """{module: u, its effective update of the whole batch, with how it was computed}: in layer
    scope the module alone under its own step; in network scope one forward-mode pass of the
    network with the full step as tangent."""
    modules, function, hooks, args = captured.modules, captured.function, captured.hooks, captured.args
    effective: dict[str, Update] = {}
    if scope == "layer":
        for name, m in list(modules.items()):
            try:
                effective[name] = layer_update(m)
            except Exception as error:  # torch.func cannot run it: named, never a number
                unsupported(name, error_reason(error))
                del modules[name]
        return effective
    with fwAD.dual_level():
        dual_params = {n: fwAD.make_dual(t, captured.step[n]) for n, t in function.params.items()}
        with hooks.active("tangent"):
            try:
                function(dual_params, args)
            except Exception as error:
                raise UnsupportedModuleError(f"module {hooks.where()!r}: forward-mode AD through the network failed: "
                                             f"{error_reason(error)}") from error
            tangents = dict(hooks.seen)
    for name, m in modules.items():
        t = tangents.get(name)
        effective[name] = Update(t.detach() if t is not None else torch.zeros_like(m.grad),
                                 "network jvp (forward-mode AD, full step)")
    return effective

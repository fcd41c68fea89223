r"""A divergence meter for any network: per layer, how far each sample's real activation update is
from the ideal −η g, measured from one forward and one backward pass.

For every module that owns trainable parameters (its own ``_parameters``: Linear, Conv, the
corrected layers, MultiheadAttention, norm layers with affine parameters, …) and one plain
gradient step Δθ = −η ∇θL on a batch, L = mean (or sum) of the per-sample losses:

    u*_i = −η g_i,  g = ∂L/∂z                        the ideal update of the module's output z
    u_i                                               the first-order effective update of z_i
    d_i                                               sample i's update from its own gradient alone

with the metrics of :mod:`affdiv.verify.metrics` per sample: ``scale`` ⟨u_i,u*_i⟩/‖u*_i‖²,
``diagonal_scale`` ⟨d_i,u*_i⟩/‖u*_i‖², ``cosine`` cos(u_i, u*_i), ``off_diagonal_share``
‖u_i − d_i‖/‖d_i‖, and per module ``batch_cosine`` cos(u, u*) of the whole batch and the
correlation of the diagonal scale with the input norm ‖x_i‖ (the affine divergence itself). All
of them are independent of η (first order: u, d and u* are all proportional to η).

Two scopes (``scope``):

* ``"layer"``: only that module's own parameters step; u = J_θ(−η J_θᵀ g) of the module alone at
  its recorded input, d_i = −η Θ_ii g_i its own kernel's diagonal block. This is the theory's
  quantity (K_ii = 1 for AffineLike wherever the layer sits).
* ``"network"``: every parameter steps; u is the change of the module's output through the whole
  network (upstream layers move its input too), d_i the same when only sample i's gradient at
  the network output is kept (cotangent e_i ⊙ ∂L/∂out).

How it computes (no NTK is ever built):

1. One forward and one backward with hooks: every measured module's inputs, its output and the
   output gradient g; the full step Δθ (the vjp of every module at once).
2. Layer scope, batch: per module one jvp on the module alone with tangent Δθ_M. For a module
   linear in θ (``LINEAR_IN_PARAMETERS``: Linear, Conv, BatchNorm/LayerNorm/GroupNorm/RMSNorm
   affine, Embedding, AffineLike, NormLike, PatchNormConv) the jvp is exactly the forward with the
   step as parameters, f(x; Δθ_M) (one GEMM/convolution): the closed form
   −η K G of :mod:`affdiv.theory.affine` / :mod:`affdiv.theory.conv` without forming K.
3. Network scope, batch: one forward in forward-mode AD (``torch.autograd.forward_ad``, dual
   parameters with the full step as tangent); every module's output tangent is read by a hook.
4. Per-sample diagonals (``per_sample=True``):
   * layer scope: closed forms where the theory has them: the dense affine family (nn.Linear,
     AffineLike, NormLike; also with token dimensions, per sample −η(ΦΦᵀ + ψψᵀ)G with Φ, ψ the
     member's input and bias features) and BatchNorm's affine parameters (batch statistics
     included); otherwise per-sample vjp→jvp of the module alone under ``torch.func.vmap``, in
     chunks, once a forward on a sub-batch has shown that the module treats samples
     independently; a module that couples samples gets the masked route: per sample i the full
     batch's vjp with cotangent e_i ⊙ g, then the jvp, vmapped over i in chunks (B passes).
   * network scope: when the network treats samples independently (no BatchNorm using batch
     statistics, and a forward on a sub-batch reproduces the batch's rows) and every stepping
     parameter belongs to a measured module, ONE more forward-mode pass: each module adds its own
     layer-scope diagonal d_i to the tangent of its output, which then propagates sample-wise to
     every later module (first order is linear, and sample i's tangent only meets sample i).
     Otherwise (BatchNorm in train mode, shared modules, tied weights) the masked route over the
     whole network: per sample i a vjp with cotangent e_i ⊙ ∂L/∂out and a jvp, vmapped over i in
     chunks: B full-batch passes.

Memory of the chunked routes (``memory_budget``, default 256 MiB): a chunk of c items holds about
c·(3·P + 8·A) elements beyond the captured pass, P the parameters stepped (the module's, or the
network's), A the activations one item touches (one sample's input and output for the per-sample
route; the whole batch's for the masked routes); c = max(1, budget // (itemsize·(3P + 8A))), so
the bound holds for c ≥ 2 and one item's working set is the floor. The closed forms and the
network's single pass need no chunks: O(B·T²) for a token kernel, about two forwards' activations
for the dual pass.

Attention and other modules with several outputs: a module whose output is a tuple (nested
tuples, lists, dicts) is measured on the tensors of it that reach the loss, each flattened per
sample and joined side by side (nn.MultiheadAttention: its output; its averaged weights too where
they are used). A child whose forward is never called but whose parent uses its parameters
(MultiheadAttention's ``out_proj``) is measured as part of that parent: the parent's update moves
with every parameter it uses (``LayerDivergence.parameters`` lists them). While the meter runs,
attention takes its math path (:func:`differentiable_kernels`): the fused kernels (flash attention
on CPU, the fast paths of MultiheadAttention and TransformerEncoderLayer) have no forward-mode AD.

What is refused, never turned into a silent number: modules called more than once in one forward
(shared), modules whose parameters are tied to another module's, modules whose output holds no
tensor or does not reach the loss, modules whose input is modified in place after the call, and
modules torch.func cannot differentiate: each is listed in ``DivergenceReport.skipped`` with the
reason and warned (:class:`UnmeasuredModuleWarning`, naming the module and why) under
``on_unsupported="skip"``, the default, or raises :class:`UnsupportedModuleError` naming the module
(``on_unsupported="raise"``). A module's output modified in place downstream
(``ReLU(inplace=True)``) is handled: the hooks hand the rest of the network a copy.

Nothing is changed: every Parameter and buffer keeps its identity and value (BatchNorm in train mode
updates copies of its running statistics; its batch coupling is part of the measured update), no
``.grad`` is written, and every pass runs from the same RNG state, which is restored afterwards.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.func import functional_call, jvp, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from affdiv.checks import check_int
from affdiv.verify._measurement import ModuleFunction, as_inputs, check_lr
from affdiv.verify.metrics import cosine, off_diagonal_share, scale_factor

SCOPES = ("layer", "network")
REDUCTIONS = ("mean", "sum")
ON_UNSUPPORTED = ("skip", "raise")
DEFAULT_MEMORY_BUDGET = 256 * 2**20
PER_SAMPLE_METRICS = ("scale", "diagonal_scale", "cosine", "off_diagonal_share")


class UnsupportedModuleError(ValueError):
    """A module the meter cannot measure; the message names it and says why."""


class UnmeasuredModuleWarning(UserWarning):
    """Warned for every module the meter leaves out (``on_unsupported="skip"``), naming it and why;
    the same reason is in ``DivergenceReport.skipped``."""


# ---------------------------------------------------------------------------------------------
# which modules are linear in their parameters, and which have closed-form diagonals


def _linear_forwards() -> dict:
    """forward function -> a predicate on the module: f(x; θ) is homogeneous linear in θ, so
    J_θ Δθ = f(x; Δθ) exactly. Keyed by the forward function itself, so that a subclass that
    overrides forward takes the generic jvp."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.conv import _ConvNd
    from torch.nn.modules.instancenorm import _InstanceNorm

    from affdiv.layers.modules import AffineLike, NormLike, _PatchNormConvNd

    always = lambda m: True  # noqa: E731
    table = {
        nn.Linear.forward: always,
        nn.Bilinear.forward: always,
        nn.Conv1d.forward: always,
        nn.Conv2d.forward: always,
        nn.Conv3d.forward: always,
        nn.ConvTranspose1d.forward: always,
        nn.ConvTranspose2d.forward: always,
        nn.ConvTranspose3d.forward: always,
        _BatchNorm.forward: always,
        _InstanceNorm.forward: always,
        nn.LayerNorm.forward: always,
        nn.GroupNorm.forward: always,
        nn.Embedding.forward: lambda m: m.max_norm is None,  # max_norm renormalises W in place
        AffineLike.forward: always,
        NormLike.forward: always,
        _PatchNormConvNd.forward: always,
    }
    if hasattr(nn, "RMSNorm"):
        table[nn.RMSNorm.forward] = always
    del _ConvNd
    return table


_LINEAR_TABLE: dict | None = None


def linear_in_parameters(module: nn.Module) -> bool:
    """True when ``module``'s forward is a known map linear (homogeneous) in its parameters."""
    global _LINEAR_TABLE
    if _LINEAR_TABLE is None:
        _LINEAR_TABLE = _linear_forwards()
    predicate = _LINEAR_TABLE.get(getattr(type(module), "forward", None))
    return bool(predicate and predicate(module))


def _dense_member(module: nn.Module) -> str | None:
    """The affine-family member a dense module is ("affine", "affine_like", "norm_like"), or None."""
    from affdiv.layers.modules import AffineLike, NormLike

    forward = getattr(type(module), "forward", None)
    if forward is nn.Linear.forward:
        return "affine"
    if forward is AffineLike.forward:
        return "affine_like"
    if forward is NormLike.forward:
        return "norm_like"
    return None


def _is_batchnorm(module: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm) and type(module).forward is _BatchNorm.forward


def _uses_batch_statistics(module: nn.Module) -> bool:
    from torch.nn.modules.batchnorm import _BatchNorm

    return isinstance(module, _BatchNorm) and (module.training or module.running_mean is None)


def _active_dropout(model: nn.Module) -> list[str]:
    from torch.nn.modules.dropout import _DropoutNd

    return [name for name, m in model.named_modules() if m.training and (
        (isinstance(m, _DropoutNd) and m.p > 0) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0))]


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class LayerDivergence:
    r"""The alignment of one module's effective update with the ideal one, per sample.

    Args:
        name: the module's name in ``model.named_modules()``.
        kind: its class name.
        scope: ``"layer"`` or ``"network"``.
        scale, cosine: per sample, shape (B,).
        diagonal_scale, off_diagonal_share: per sample, shape (B,); None without ``per_sample``.
        batch_cosine: cos(u, u*) of the whole batch's update.
        input_norm: ‖x_i‖ of the module's first tensor input, per sample, shape (B,).
        route, diagonal_route: how u and d were computed (closed form, jvp, vmap, masked, ...).
        site_diagonal_scale: per sample, shape (B,), layer scope and closed forms only (the affine
            family, Conv, PatchNormConv): the scale of each *site*'s own update (one token, one
            output position), Σ_s k_s‖g_s‖²/Σ_s‖g_s‖² over the sample's sites with k_s the site's
            kernel diagonal (‖x_s‖²+1, ‖P_s‖²+1; 1 for AffineLike and PatchNorm). For one-row
            samples it equals ``diagonal_scale``; with tokens or positions, ``diagonal_scale``
            also holds the same sample's other sites.
        parameters: the names (relative to the module) of the parameters that step: its own, and
            those of a child whose forward it bypasses (``out_proj.weight`` of MultiheadAttention).
        effective, ideal, diagonal: u, u* = −ηg and d, shaped like the output (``keep_updates``);
            for an output that is a tuple, its tensors that reach the loss, each flattened per
            sample and joined, shape (B, ·).

    NaN in a per-sample metric marks a sample whose ideal update (or own update) is 0: no factor
    is defined there.
    """

    name: str
    kind: str
    scope: str
    scale: Tensor
    cosine: Tensor
    batch_cosine: float
    input_norm: Tensor
    route: str
    diagonal_scale: Tensor | None = None
    off_diagonal_share: Tensor | None = None
    diagonal_route: str | None = None
    site_diagonal_scale: Tensor | None = None
    parameters: tuple[str, ...] = ()
    effective: Tensor | None = field(default=None, repr=False)
    ideal: Tensor | None = field(default=None, repr=False)
    diagonal: Tensor | None = field(default=None, repr=False)

    @property
    def diagonal_norm_correlation(self) -> float:
        """Pearson correlation of the diagonal scale with ‖x_i‖ over the batch; NaN where it is
        undefined: no per-sample diagonals, fewer than 3 samples, or a diagonal scale constant to
        rounding (relative spread ≤ 10³ ε of the dtype: the corrections' claim)."""
        if self.diagonal_scale is None:
            return math.nan
        return correlation(self.diagonal_scale, self.input_norm)

    def summary(self) -> dict[str, float]:
        """Batch summaries (floats; NaN where undefined): per-sample metrics' mean and median
        over the samples where they are defined, the spread (std/|mean|) of the two scales, the
        batch cosine, the correlation with ‖x‖, and how many samples had an undefined metric."""
        out: dict[str, float] = {}
        defined = torch.ones_like(self.scale, dtype=torch.bool)
        for metric in PER_SAMPLE_METRICS:
            values = getattr(self, metric)
            if values is None:
                continue
            values = values.detach().double().cpu()
            finite = torch.isfinite(values)
            defined &= finite
            v = values[finite]
            out[f"{metric}_mean"] = float(v.mean()) if len(v) else math.nan
            out[f"{metric}_median"] = float(v.median()) if len(v) else math.nan
            if metric in ("scale", "diagonal_scale"):
                out[f"{metric}_cv"] = spread(v)
        if self.site_diagonal_scale is not None:
            v = self.site_diagonal_scale.detach().double().cpu()
            v = v[torch.isfinite(v)]
            out["site_diagonal_scale_mean"] = float(v.mean()) if len(v) else math.nan
            out["site_diagonal_scale_cv"] = spread(v)
        out["batch_cosine"] = self.batch_cosine
        out["diagonal_norm_correlation"] = self.diagonal_norm_correlation
        out["undefined_samples"] = float((~defined).sum())
        return out


@dataclass(frozen=True)
class DivergenceReport:
    """What :func:`divergence` returns.

    ``layers``: module name -> :class:`LayerDivergence`, in ``named_modules`` order;
    ``skipped``: module name -> why it was not measured; ``scope``, ``lr``, ``reduction``,
    ``batch_size``, ``per_sample``; ``network_diagonal_route``: how the network scope's diagonals
    were computed (None in layer scope or without ``per_sample``).
    """

    layers: dict[str, LayerDivergence]
    skipped: dict[str, str]
    scope: str
    lr: float
    reduction: str
    batch_size: int
    per_sample: bool
    network_diagonal_route: str | None = None

    def summary(self) -> dict[str, dict[str, float]]:
        """Per module, :meth:`LayerDivergence.summary`."""
        return {name: layer.summary() for name, layer in self.layers.items()}

    def records(self) -> list[dict]:
        """One JSON-ready dict per module: name, kind, scope, batch size, routes and its summary,
        with NaN written as None (JSON has no NaN)."""
        rows = []
        for name, layer in self.layers.items():
            row = {"layer": name, "kind": layer.kind, "scope": self.scope, "batch_size": self.batch_size,
                   "route": layer.route, "diagonal_route": layer.diagonal_route}
            row.update({k: finite_or_none(v) for k, v in layer.summary().items()})
            rows.append(row)
        return rows


def finite_or_none(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def spread(values: Tensor) -> float:
    """std/|mean| (population std) of the finite values; NaN for an empty set or a zero mean."""
    v = values[torch.isfinite(values)].double()
    if len(v) == 0 or float(v.mean()) == 0:
        return math.nan
    return float(v.std(unbiased=False) / v.mean().abs()) if len(v) > 1 else 0.0


def correlation(values: Tensor, norms: Tensor) -> float:
    """Pearson correlation of ``values`` with ``norms`` over the samples where both are finite;
    NaN where undefined (fewer than 3 samples, or either constant to rounding: relative spread
    ≤ 10³ ε of ``values``' dtype)."""
    eps = torch.finfo(values.dtype).eps if values.is_floating_point() else 2.0**-52
    keep = torch.isfinite(values) & torch.isfinite(norms)
    a, b = values[keep].double(), norms[keep].double()
    if len(a) < 3 or not spread(a) > 1e3 * eps or not spread(b) > 1e3 * eps:
        return math.nan
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


# ---------------------------------------------------------------------------------------------
# the hooks


@dataclass
class _Record:
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


class _Hooks:
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
        self.records = {name: _Record(module) for name, module in measured.items()}
        self.stack: list[str] = []
        self.seen: dict[str, object] = {}
        self.inject: dict[str, Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))

    def __enter__(self) -> _Hooks:
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
                self.seen[name] = _joined(_leaves(output), record.selected)
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


# ---------------------------------------------------------------------------------------------
# calling one module alone


def _direct_params(module: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in module._parameters.items() if p is not None}


def _trainable(module: nn.Module) -> dict[str, Tensor]:
    return {n: p for n, p in _direct_params(module).items() if p.requires_grad}


def _call_alone(module: nn.Module, values: Mapping[str, Tensor], args: tuple, kwargs: dict,
                rng_state: Tensor | None) -> Tensor:
    """``module`` on (args, kwargs) with its direct parameters replaced by ``values`` (children
    keep theirs), fresh copies of its buffers, from ``rng_state`` when given."""
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        if rng_state is not None:
            torch.set_rng_state(rng_state)
        return functional_call(module, {**values, **buffers}, args, kwargs, tie_weights=False, strict=False)


def _batched(t: object, batch: int) -> bool:
    return isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch


def _chunk(budget: int, itemsize: int, params: int, activations: int, items: int) -> int:
    per_item = itemsize * (3 * params + 8 * activations)
    return int(max(1, min(items, budget // max(per_item, 1))))


def _onehots(batch: int, like: Tensor) -> Tensor:
    return torch.eye(batch, dtype=like.dtype, device=like.device)


def _select(t: Tensor, onehot: Tensor) -> Tensor:
    """Row i of t (batch first), written as a contraction so that it vmaps over one-hots."""
    return (t * onehot.reshape((-1,) + (1,) * (t.dim() - 1))).sum(0)


# ---------------------------------------------------------------------------------------------
# a module's output: one tensor, or the tensors of a tuple (nested) that reach the loss


def _leaves(output) -> list:
    """The leaves of a (possibly nested) output: a Tensor is its own one leaf."""
    return tree_flatten(output)[0]


def _joined(leaves: Sequence | Mapping[int, Tensor], selected: tuple[int, ...]) -> Tensor:
    """The measured output z: the one selected leaf as it is, or several selected leaves side by
    side per sample, each flattened to (B, ·) (nn.MultiheadAttention with need_weights=True and
    its weights used downstream; an LSTM's output and final state)."""
    if len(selected) == 1:
        return leaves[selected[0]]
    return torch.cat([leaves[i].reshape(leaves[i].shape[0], -1) for i in selected], dim=1)


def _tangent(output, selected: tuple[int, ...]) -> Tensor | None:
    """The forward-mode tangent of the measured output (None where no selected tensor has one)."""
    leaves = _leaves(output)
    tangents = {i: fwAD.unpack_dual(leaves[i]).tangent for i in selected}
    if all(t is None for t in tangents.values()):
        return None
    return _joined({i: torch.zeros_like(leaves[i]) if t is None else t for i, t in tangents.items()}, selected)


def _split(z: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The inverse of :func:`_joined` on the selected leaves ``like``."""
    if len(like) == 1:
        return [z]
    parts = z.split([t[0].numel() for t in like], dim=1)
    return [part.reshape(t.shape) for part, t in zip(parts, like)]


# ---------------------------------------------------------------------------------------------
# closed forms


def _dense_features(member: str, module: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """(φ, ψ) per row for the affine family: z = W φ(x) + b ψ(x) (theory.affine's α c x and α β)."""
    if member == "affine":
        return x, torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)
    sq = (x * x).sum(-1)
    if member == "affine_like":
        r = torch.rsqrt(sq + 1)
        return x * r.unsqueeze(-1), r
    k = 1.0 if module.mode == "l2" else math.sqrt(x.shape[-1])
    norm = sq.sqrt().clamp_min(module.eps)
    return x * (k / norm).unsqueeze(-1), torch.ones_like(sq)


def dense_diagonal(member: str, module: nn.Module, x: Tensor, g: Tensor, lr: float) -> Tensor:
    """−η Θ_ii g_i per sample for a dense affine-family module on x (B, *, m), g (B, *, n):
    −η (w ΦᵢΦᵢᵀ + b ψᵢψᵢᵀ) Gᵢ over the rows (tokens) of sample i, w and b 1 where the weight and
    the bias are trainable (the family theorem of theory.affine, one sample's block)."""
    params = _trainable(module)
    w_on, b_on = "weight" in params, "bias" in params
    batch = x.shape[0]
    phi, psi = _dense_features(member, module, x)
    phi = phi.reshape(batch, -1, x.shape[-1])
    psi = psi.reshape(batch, -1)
    grads = g.reshape(batch, -1, g.shape[-1])
    rows, m, n = phi.shape[1], phi.shape[2], grads.shape[2]
    if rows == 1:
        factor = (phi * phi).sum(-1) * w_on + psi * psi * b_on  # (B, 1)
        return (-lr * factor.unsqueeze(-1) * grads).reshape(g.shape)
    if rows * (m + n) <= 2 * m * n:  # the T×T kernel of each sample
        kernel = torch.bmm(phi, phi.transpose(1, 2)) * w_on + psi.unsqueeze(2) * psi.unsqueeze(1) * b_on
        out = torch.bmm(kernel, grads)
    else:  # each sample's own weight gradient
        out = torch.zeros_like(grads)
        if w_on:
            out = out + torch.bmm(phi, torch.bmm(grads.transpose(1, 2), phi).transpose(1, 2))
        if b_on:
            out = out + psi.unsqueeze(-1) * (psi.unsqueeze(-1) * grads).sum(1, keepdim=True)
    return (-lr * out).reshape(g.shape)


def site_factors(module: nn.Module, x: Tensor, output: Tensor) -> Tensor | None:
    """k_s, each site's kernel diagonal (Θ_ss = k_s I), broadcastable to the output, for the
    affine family (sites: rows) and zero-padded Conv1d/2d / PatchNormConv1d/2d (sites: output
    positions; theory.conv); None where no closed form applies."""
    from affdiv.layers.modules import _PatchNormConvNd
    from affdiv.theory import conv as theory_conv

    params = _trainable(module)
    w_on, b_on = float("weight" in params), float("bias" in params)
    member = _dense_member(module)
    if member is not None:
        phi, psi = _dense_features(member, module, x)
        return ((phi * phi).sum(-1) * w_on + psi * psi * b_on).unsqueeze(-1)
    forward = getattr(type(module), "forward", None)
    plain = forward in (nn.Conv1d.forward, nn.Conv2d.forward)
    patchnorm = isinstance(module, _PatchNormConvNd)
    if not (plain or patchnorm) or isinstance(module.padding, str) or module.padding_mode != "zeros":
        return None
    if patchnorm and w_on and b_on:
        return torch.ones((), dtype=output.dtype, device=output.device)
    geometry = theory_conv.Geometry.of(module.weight.dim() - 2, tuple(module.kernel_size), tuple(module.stride),
                                       tuple(module.padding), tuple(module.dilation), module.groups)
    sq = theory_conv.patch_sq_norms_box(x, geometry)  # (B, groups, *out)
    k = sq * w_on + b_on
    if patchnorm:
        k = k / (sq + 1)
    return k.repeat_interleave(output.shape[1] // geometry.groups, dim=1)


def batchnorm_diagonal(module: nn.Module, x: Tensor, g: Tensor, lr: float) -> Tensor:
    """−η Θ_ii g_i per sample for BatchNorm's affine parameters, z = γ x̂ + β with x̂ from the batch
    (train mode) or the running statistics: per channel −η(⟨x̂_i, g_i⟩ x̂_i + Σ g_i), the sums over
    sample i's positions. x̂ depends on the whole batch but not on θ: the coupling is in x̂."""
    params = _trainable(module)
    dims = [0, *range(2, x.dim())]
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if _uses_batch_statistics(module):
        mean, var = x.mean(dims), x.var(dims, unbiased=False)
    else:
        mean, var = module.running_mean, module.running_var
    xhat = (x - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + module.eps)
    spatial = list(range(2, x.dim()))

    def per_channel(t: Tensor) -> Tensor:
        return t.sum(spatial, keepdim=True) if spatial else t

    out = torch.zeros_like(g)
    if "weight" in params:
        out = out + per_channel(xhat * g) * xhat
    if "bias" in params:
        out = out + per_channel(g)
    return -lr * out


# ---------------------------------------------------------------------------------------------
# the meter


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
class _Module:
    name: str
    module: nn.Module
    record: _Record
    grad: Tensor
    step: dict[str, Tensor]  # its trainable parameters -> −η ∇L
    values: dict[str, Tensor]  # its parameters -> their values (detached)
    output: Tensor  # z as recorded (detached; the selected tensors of a tuple output, joined)

    def __call__(self, values: Mapping[str, Tensor], args: tuple, kwargs: dict,
                 rng_state: Tensor | None) -> Tensor:
        """z of the module alone on (args, kwargs) with ``values`` as its parameters."""
        leaves = _leaves(_call_alone(self.module, values, args, kwargs, rng_state))
        return _joined(leaves, self.record.selected)


def divergence(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    loss: Callable[[Tensor], Tensor],
    *,
    lr: float,
    scope: str = "layer",
    per_sample: bool = True,
    reduction: str = "mean",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    on_unsupported: str = "skip",
    keep_updates: bool = False,
    masked_limit: int | None = None,
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
        memory_budget: bytes for each chunked vmap pass (the bound in the module docstring).
        on_unsupported: ``"skip"`` (list the module in ``skipped`` and warn, UnmeasuredModuleWarning) or
            ``"raise"``.
        keep_updates: keep u, u* and d in each record (``effective``, ``ideal``, ``diagonal``).
        masked_limit: in network scope, the largest batch for which the masked route (B
            full-batch passes) is run; above it the network's diagonals are not computed and
            ``network_diagonal_route`` says why. Default None: no limit.

    Returns:
        :class:`DivergenceReport`.

    Example::

        >>> import torch
        >>> from affdiv.verify import divergence
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        >>> report = divergence(net, x, lambda out: torch.nn.functional.cross_entropy(out, y, reduction="none"),
        ...                     lr=0.1)
        >>> sorted(report.layers), report.layers["0"].off_diagonal_share.shape
        (['0', '2'], torch.Size([16]))
    """
    lr = check_lr(lr)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if on_unsupported not in ON_UNSUPPORTED:
        raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {on_unsupported!r}")
    if masked_limit is not None:
        check_int("masked_limit", masked_limit)
    check_int("memory_budget (bytes)", memory_budget)
    if not callable(loss):
        raise TypeError(f"loss must be a function of the model output, got {type(loss).__name__}")
    args = as_inputs(inputs)
    if not args or args[0].dim() == 0:
        raise ValueError("inputs must be batched: the first dimension of the first input is the batch")
    batch = args[0].shape[0]
    if batch < 1:
        raise ValueError("inputs hold an empty batch")

    skipped: dict[str, str] = {}
    absorbed: dict[str, str] = {}  # a module whose forward is not called -> the parent measured with its parameters
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}

    def unsupported(name: str, reason: str) -> None:
        message = f"module {name!r} ({kinds[name]}): {reason}"
        if on_unsupported == "raise":
            raise UnsupportedModuleError(message)
        skipped[name] = reason
        warnings.warn(f"affdiv divergence meter: not measured: {message}", UnmeasuredModuleWarning, stacklevel=3)
        for child in [c for c, parent in absorbed.items() if parent == name]:
            unsupported(child, f"its parameters are used by its parent module {name!r}, which is not measured")

    measured = {name: m for name, m in model.named_modules() if _trainable(m)}
    if not measured:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: there is no step to measure")
    owners: dict[int, list[str]] = {}
    for name, m in measured.items():
        for p in _direct_params(m).values():
            owners.setdefault(id(p), []).append(name)

    function = ModuleFunction(model, args)
    canonical = {id(p): n for n, p in model.named_parameters()}
    with _Hooks(model, measured) as hooks, differentiable_kernels():
        # 1. one forward and one backward: inputs, outputs, output gradients, the step
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
                       for i, t in enumerate(_leaves(r.output)) if isinstance(t, Tensor) and t.requires_grad}
            wrt = [*leaves.values(), *outputs.values(), out]
            grads = torch.autograd.grad(total, wrt, allow_unused=True)
        n_params = len(leaves)
        param_grads = dict(zip(leaves, grads[:n_params]))
        leaf_grads: dict[str, dict[int, Tensor]] = {}
        for (name, i), g in zip(outputs, grads[n_params:-1]):
            if g is not None:
                leaf_grads.setdefault(name, {})[i] = g.detach()
        grad_out = grads[-1]
        step = {n: -lr * (g if g is not None else torch.zeros_like(leaves[n])) for n, g in param_grads.items()}

        absorbed.update(_absorbed(measured, hooks.records, owners))
        modules: dict[str, _Module] = {}
        for name, module in measured.items():
            if name in absorbed:
                continue
            record = hooks.records[name]
            reason = _capture_problem(name, module, record, owners, leaf_grads.get(name, {}), batch)
            if reason:
                unsupported(name, reason)
                continue
            record.selected = tuple(sorted(leaf_grads[name]))
            leaves_out = _leaves(record.output)
            params = _measured_params(name, module, absorbed)
            own = {n: step[canonical[id(p)]] for n, p in params.items() if p.requires_grad}
            modules[name] = _Module(
                name, module, record, _joined(leaf_grads[name], record.selected), own,
                {n: p.detach() for n, p in params.items()}, _joined(leaves_out, record.selected).detach(),
            )

        # 2. the batch update of every module
        effective: dict[str, Tensor] = {}
        routes: dict[str, str] = {}
        if scope == "layer":
            for name, m in list(modules.items()):
                try:
                    effective[name], routes[name] = _layer_update(m)
                except Exception as error:  # torch.func cannot run it: named, never a number
                    unsupported(name, _reason(error))
                    del modules[name]
        else:
            with fwAD.dual_level():
                dual_params = {n: fwAD.make_dual(t, step[n]) for n, t in function.params.items()}
                with hooks.active("tangent"):
                    try:
                        function(dual_params, args)
                    except Exception as error:
                        raise UnsupportedModuleError(
                            f"module {hooks.where()!r}: forward-mode AD through the network failed: {_reason(error)}"
                        ) from error
                    tangents = dict(hooks.seen)
            for name, m in modules.items():
                t = tangents.get(name)
                effective[name] = t.detach() if t is not None else torch.zeros_like(m.grad)
                routes[name] = "network jvp (forward-mode AD, full step)"

        # 3. the per-sample diagonals
        diagonals: dict[str, Tensor] = {}
        diag_routes: dict[str, str] = {}
        network_route = None
        if per_sample:
            layer_diagonals, layer_routes = {}, {}
            for name, m in list(modules.items()):
                try:
                    layer_diagonals[name], layer_routes[name] = _layer_diagonal(m, lr, batch, memory_budget)
                except Exception as error:
                    if scope == "layer":
                        unsupported(name, _reason(error))
                        del modules[name]
            if scope == "layer":
                diagonals, diag_routes = layer_diagonals, layer_routes
            else:
                diagonals, network_route = _network_diagonals(
                    model, function, hooks, args, modules, layer_diagonals, skipped, step, grad_out, lr, batch,
                    memory_budget, masked_limit,
                )
                diag_routes = {name: network_route for name in diagonals}

    layers = {}
    for name, m in modules.items():
        layers[name] = _metrics(name, m, scope, lr, effective[name], diagonals.get(name), routes[name],
                                diag_routes.get(name), keep_updates)
    return DivergenceReport(layers, skipped, scope, lr, reduction, batch, per_sample, network_route)


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def _capture_problem(name, module, record: _Record, owners, leaf_grads: Mapping[int, Tensor],
                     batch: int) -> str | None:
    """Why the capture pass cannot stand for this module, or None. ``leaf_grads``: the output
    gradient of each of its output's tensors that reaches the loss, by position in the output."""
    if record.calls == 0:
        return ("its forward was not called, and no parent module that is measured owns it (its parameters are "
                "used by another module directly, or not at all)")
    if record.calls > 1:
        return (f"called {record.calls} times in one forward (a shared module): its output is not one "
                "tensor per sample, so there is no one update to measure")
    for pname, p in _direct_params(module).items():
        others = [o for o in owners[id(p)] if o != name]
        if others:
            return (f"its parameter {pname!r} is tied to module {others[0]!r}: its step carries that module's "
                    "gradient too")
    leaves = _leaves(record.output)
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


def _absorbed(measured: Mapping[str, nn.Module], records: Mapping[str, _Record], owners) -> dict[str, str]:
    """Modules whose forward is never called but whose parent, called in the forward, uses their parameters
    directly (nn.MultiheadAttention's ``out_proj``): child -> parent. Their parameters are measured
    as the parent's (the parent's output is where they act)."""
    out = {}
    for name in measured:
        parent = name.rpartition(".")[0]
        if (name and records[name].calls == 0 and parent in measured and records[parent].calls >= 1
                and all(owners[id(p)] == [name] for p in _direct_params(measured[name]).values())):
            out[name] = parent
    return out


def _measured_params(name: str, module: nn.Module, absorbed: Mapping[str, str]) -> dict[str, Tensor]:
    """The parameters measured as this module's, by their name relative to it: its own, and those
    of the children it absorbs (``out_proj.weight``)."""
    params = dict(_direct_params(module))
    children = dict(module.named_children())
    for child, parent in absorbed.items():
        if parent == name:
            local = child.rpartition(".")[2]
            params.update({f"{local}.{n}": p for n, p in _direct_params(children[local]).items()})
    return params


def _layer_update(m: _Module) -> tuple[Tensor, str]:
    """u = J_θ Δθ of the module alone (its own parameters stepping)."""
    record = m.record
    if linear_in_parameters(m.module):
        values = {n: m.step.get(n, torch.zeros_like(v)) for n, v in m.values.items()}
        with torch.no_grad():
            u = m(values, record.args, record.kwargs, None)
        return u, "closed form f(x; Δθ) (linear in θ)"

    def f(p):
        return m({**m.values, **p}, record.args, record.kwargs, record.rng_state)

    primal = {n: m.values[n] for n in m.step}
    _, u = jvp(f, (primal,), (m.step,))
    return u.detach(), "jvp (module alone)"


def _layer_diagonal(m: _Module, lr: float, batch: int, budget: int) -> tuple[Tensor, str]:
    """d_i = −η Θ_ii g_i of the module alone, per sample."""
    record, module, g = m.record, m.module, m.grad
    member = _dense_member(module)
    if member is not None and record.args and isinstance(record.args[0], Tensor) and not record.kwargs:
        return dense_diagonal(member, module, record.args[0], g, lr), f"closed form ({member} family kernel)"
    if _is_batchnorm(module):
        return batchnorm_diagonal(module, record.args[0], g, lr), "closed form (BatchNorm, batch statistics)"
    if batch == 1:
        update, _ = _layer_update(m)
        return update, "B = 1: the batch update"
    trainable_values = {n: m.values[n] for n in m.step}
    linear = linear_in_parameters(module)
    params = sum(v.numel() for v in trainable_values.values())
    itemsize = g.element_size()
    batched_kwargs = any(_batched(v, batch) for v in record.kwargs.values())
    if not batched_kwargs and _independent_module(m, batch):
        in_dims = tuple(0 if _batched(a, batch) else None for a in record.args)
        sample_size = sum(a[0].numel() for a in record.args if _batched(a, batch)) + g[0].numel()

        def one(g_i, *sample):
            sample = tuple(s.unsqueeze(0) if d == 0 else s for s, d in zip(sample, in_dims))

            def f(p):
                return m({**m.values, **p}, sample, record.kwargs, record.rng_state)

            _, pullback = vjp(f, trainable_values)
            (grad,) = pullback(g_i.unsqueeze(0))
            own = {n: -lr * v for n, v in grad.items()}
            if linear:
                out = m({n: own.get(n, torch.zeros_like(v)) for n, v in m.values.items()}, sample, record.kwargs,
                        None)
            else:
                _, out = jvp(f, (trainable_values,), (own,))
            return out.squeeze(0)

        chunk = _chunk(budget, itemsize, params, sample_size, batch)
        d = vmap(one, in_dims=(0, *in_dims), chunk_size=chunk)(g, *record.args)
        return d.detach(), f"vmap per-sample vjp→jvp (module alone, chunks of {chunk})"

    def f(p):
        return m({**m.values, **p}, record.args, record.kwargs, record.rng_state)

    _, pullback = vjp(f, trainable_values)

    def masked(onehot):
        (grad,) = pullback(g * onehot.reshape((-1,) + (1,) * (g.dim() - 1)))
        own = {n: -lr * v for n, v in grad.items()}
        if linear:
            out = m({n: own.get(n, torch.zeros_like(v)) for n, v in m.values.items()}, record.args,
                    record.kwargs, None)
        else:
            _, out = jvp(f, (trainable_values,), (own,))
        return _select(out, onehot)

    size = sum(a.numel() for a in record.args if isinstance(a, Tensor)) + g.numel()
    chunk = _chunk(budget, itemsize, params, size, batch)
    # randomness="same": each pass replays the batch's draws (dropout inside attention), as the batch update did
    d = vmap(masked, chunk_size=chunk, randomness="same")(_onehots(batch, g))
    return d.detach(), f"masked vjp→jvp over the batch (module couples samples; chunks of {chunk})"


def _sub_batch(batch: int) -> list[int]:
    return [0, batch - 1] if batch >= 3 else [0]


def _close(a: Tensor, b: Tensor) -> bool:
    tol = math.sqrt(torch.finfo(b.dtype).eps) if b.is_floating_point() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(((a - b).abs() <= tol * (scale + tol)).all())


def _independent_module(m: _Module, batch: int) -> bool:
    """Whether the module alone maps a sub-batch to the same rows as the batch (no coupling)."""
    index = _sub_batch(batch)
    args = tuple(a[index] if _batched(a, batch) else a for a in m.record.args)
    try:
        with torch.no_grad():
            sub = m(m.values, args, m.record.kwargs, m.record.rng_state)
    except Exception:
        return False  # e.g. BatchNorm1d refuses a batch of one in train mode: it couples samples
    return _close(sub, m.output[index])


def _network_diagonals(model, function, hooks: _Hooks, args, modules, layer_diagonals, skipped, step, grad_out,
                       lr, batch, budget, masked_limit):
    """d_i at every measured module with only sample i's output gradient kept (network scope)."""
    dropout = _active_dropout(model)
    if dropout:
        raise UnsupportedModuleError(
            f"module {dropout[0]!r} (Dropout in train mode, p > 0): per-sample diagonals in network scope need a "
            "deterministic forward (the per-sample passes would draw other masks); call model.eval() or pass "
            "per_sample=False"
        )
    coupled = [n for n, m in model.named_modules() if _uses_batch_statistics(m)]
    canonical = {id(p): n for n, p in model.named_parameters()}
    by_name = dict(model.named_modules())
    stepping_skipped = [n for n in skipped if any(bool(step[canonical[id(p)]].abs().max() > 0)
                                                  for p in _trainable(by_name[n]).values())]
    missing = [n for n in modules if n not in layer_diagonals]
    fast = not coupled and not stepping_skipped and not missing and (batch == 1 or _independent_network(
        function, hooks, args, modules, batch))
    if fast:
        with fwAD.dual_level():
            hooks.inject = {n: layer_diagonals[n] for n in modules}
            with hooks.active("inject"):
                try:
                    function(function.params, args)
                except Exception as error:
                    raise UnsupportedModuleError(
                        f"module {hooks.where()!r}: forward-mode AD through the network failed: {_reason(error)}"
                    ) from error
                tangents = dict(hooks.seen)
            hooks.inject = {}
        out = {n: tangents[n].detach() if tangents.get(n) is not None else layer_diagonals[n] for n in modules}
        return out, "one forward-mode pass injecting each module's own diagonal (samples independent)"

    why = ("BatchNorm " + repr(coupled[0]) + " uses batch statistics" if coupled else
           "module " + repr(stepping_skipped[0]) + " is not measured" if stepping_skipped else
           "module " + repr(missing[0]) + " has no layer diagonal" if missing else
           "a sub-batch does not reproduce the batch's rows")
    if masked_limit is not None and batch > masked_limit:
        return {}, (f"not computed: the masked route ({why}) needs B = {batch} full-batch passes, above "
                    f"masked_limit = {masked_limit}")
    params = function.params
    n_params = sum(t.numel() for t in params.values())
    activations = sum(m.output.numel() for m in modules.values()) * 2 + sum(a.numel() for a in args)

    def forward(p):
        return function(p, args)

    def collected(p):
        with hooks.active("collect"):
            function(p, args)
            return {n: hooks.seen[n] for n in modules}

    _, pullback = vjp(forward, params)

    def masked(onehot):
        (grad,) = pullback(grad_out * onehot.reshape((-1,) + (1,) * (grad_out.dim() - 1)))
        own = {n: -lr * v for n, v in grad.items()}
        _, tangents = jvp(collected, (params,), (own,))
        return {n: _select(t, onehot) for n, t in tangents.items()}

    chunk = _chunk(budget, grad_out.element_size(), n_params, activations, batch)
    try:
        d = vmap(masked, chunk_size=chunk)(_onehots(batch, grad_out))
    except Exception as error:
        raise UnsupportedModuleError(
            f"module {hooks.where()!r}: the masked per-sample pass through the network failed: {_reason(error)}"
        ) from error
    return ({n: t.detach() for n, t in d.items()},
            f"masked vjp→jvp over the whole network ({why}; B passes in chunks of {chunk})")


def _independent_network(function, hooks: _Hooks, args, modules, batch) -> bool:
    """A forward of a sub-batch reproduces the batch's rows at every measured module."""
    index = _sub_batch(batch)
    sub = tuple(a[index] if _batched(a, batch) else a for a in args)
    try:
        with torch.no_grad(), hooks.active("compare"):
            function(function.params, sub)
            seen = dict(hooks.seen)
    except Exception:
        return False
    return all(isinstance(seen.get(n), Tensor) and _close(seen[n], m.output[index])
               for n, m in modules.items())


def _metrics(name, m: _Module, scope, lr, u: Tensor, d: Tensor | None, route, diagonal_route, keep) -> LayerDivergence:
    ideal = -lr * m.grad
    u = u.detach()
    x = next((a for a in m.record.args if isinstance(a, Tensor)), None)
    batch = ideal.shape[0]
    if x is not None and x.dim() > 0 and x.shape[0] == batch and x.is_floating_point():
        input_norm = x.reshape(batch, -1).norm(dim=-1)
    else:
        input_norm = torch.full((batch,), math.nan, dtype=ideal.dtype, device=ideal.device)
    site = None
    if scope == "layer" and d is not None and x is not None and not m.record.kwargs:
        try:
            k = site_factors(m.module, x, m.grad)
        except Exception:  # a geometry theory.conv does not model: no site scale, never a guess
            k = None
        if k is not None:
            site = scale_factor(k * ideal, ideal)
    return LayerDivergence(
        name=name,
        kind=type(m.module).__name__,
        scope=scope,
        scale=scale_factor(u, ideal),
        cosine=cosine(u, ideal),
        batch_cosine=float(cosine(u.reshape(1, -1), ideal.reshape(1, -1))[0]),
        input_norm=input_norm,
        route=route,
        diagonal_scale=None if d is None else scale_factor(d, ideal),
        off_diagonal_share=None if d is None else off_diagonal_share(u, d),
        diagonal_route=diagonal_route,
        site_diagonal_scale=site,
        parameters=tuple(m.step),
        effective=u if keep else None,
        ideal=ideal if keep else None,
        diagonal=d if keep else None,
    )


# ---------------------------------------------------------------------------------------------
# a training callback


def _batch_of(data) -> tuple[Tensor, Tensor]:
    """(x, y) from a tuple/list (x, y), a mapping with "x" and "y", or an object with .x and .y."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    if isinstance(data, Mapping) and "x" in data and "y" in data:
        return data["x"], data["y"]
    if hasattr(data, "x") and hasattr(data, "y"):
        return data.x, data.y
    raise TypeError(f"the callback's data must be (x, y), a mapping with 'x' and 'y', or an object with .x and .y; "
                    f"got {type(data).__name__}")


class DivergenceRecorder:
    """A training callback that measures the divergence every ``every`` steps and keeps per-layer
    summaries: ``recorder(model, step, data)`` with ``data`` the step's batch (x, y) (or a mapping /
    object with x and y), called before the optimizer steps on it.

    It changes nothing the training depends on (parameters, buffers, ``.grad``, the RNG state, the
    train/eval mode: see :func:`divergence`), so a run with the recorder takes bit-identical steps.
    The measured step is plain SGD on ``loss`` (default: mean cross-entropy on class labels),
    whatever optimizer the run uses: the theory's object; the metrics do not depend on η.

    ``records``: one JSON-ready dict per (measured step, module): ``step``, ``layer``, ``kind``,
    ``scope``, ``batch_size``, the routes, and :meth:`LayerDivergence.summary` with NaN as None.
    ``skipped``: module -> reason, from the last measurement.
    """

    def __init__(self, every: int, *, scope: str = "layer", per_sample: bool = True,
                 loss: Callable[[Tensor, Tensor], Tensor] | None = None, lr: float = 1.0,
                 masked_limit: int | None = 128, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        check_int("every", every)  # steps between measurements
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        self.every, self.scope, self.per_sample = every, scope, per_sample
        self.lr = check_lr(lr)
        self.loss = loss or (lambda out, y: torch.nn.functional.cross_entropy(out, y, reduction="none"))
        self.masked_limit, self.memory_budget = masked_limit, memory_budget
        self.records: list[dict] = []
        self.skipped: dict[str, str] = {}

    def due(self, step: int) -> bool:
        """Whether ``step`` is a measurement step (0, every, 2·every, ...)."""
        return step % self.every == 0

    def __call__(self, model: nn.Module, step: int, data) -> None:
        if not self.due(step):
            return
        x, y = _batch_of(data)
        report = divergence(model, x, lambda out: self.loss(out, y), lr=self.lr, scope=self.scope,
                            per_sample=self.per_sample, masked_limit=self.masked_limit,
                            memory_budget=self.memory_budget)
        self.skipped = dict(report.skipped)
        self.records += [{"step": int(step), **row} for row in report.records()]

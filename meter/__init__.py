r"""The divergence meter, for any network: per layer, how far each sample's real activation update is
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

from affdiv.meter.capture import differentiable_kernels
from affdiv.meter.measure import divergence
from affdiv.meter.options import (
    DEFAULT_MEMORY_BUDGET,
    ON_UNSUPPORTED,
    REDUCTIONS,
    SCOPES,
    MeterOptions,
    UnmeasuredModuleWarning,
    UnsupportedModuleError,
)
from affdiv.meter.recorder import DivergenceRecorder
from affdiv.meter.report import PER_SAMPLE_METRICS, DivergenceReport, LayerDivergence

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "ON_UNSUPPORTED",
    "PER_SAMPLE_METRICS",
    "REDUCTIONS",
    "SCOPES",
    "DivergenceRecorder",
    "DivergenceReport",
    "LayerDivergence",
    "MeterOptions",
    "UnmeasuredModuleWarning",
    "UnsupportedModuleError",
    "differentiable_kernels",
    "divergence",
]

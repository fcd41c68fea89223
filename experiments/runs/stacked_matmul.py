"""The stacked engine's batched products, on oneDNN where it is preferred and may run them, else
on torch's.

A stacked linear layer is a batched product with a bias,

    baddbmm(c, a, b) = c + a b,    a (K, M, L), b (K, L, N), c (K, M, 1), (K, 1, N) or none,

and its backward, for the gradient g of the output,

    ∂/∂a = g bᵀ,    ∂/∂b = aᵀ g,    ∂/∂c = g summed over the dimensions c broadcasts.

torch multiplies float32 matrices with its BLAS. The BLAS of torch's CPU wheels is MKL, which on
an AMD processor with AVX-512 runs its AVX2 code: there, on one core, ``torch.mm`` of square
matrices ran at 87-106 GF/s and oneDNN's matmul at 197-233 (``benchmarks/stacked_training.py``
measures both in every round). torch has no op that reaches oneDNN's float32 matmul; the
package's C++ extension binds torch's own call of it (:func:`affdiv.layers._native.onednn_bmm_`),
and :class:`OnednnBaddbmm` is written here around it. Its numbers are the product's up to the order
of summation inside the kernel: float32 rounding, which the engine's batched kernels already allow
(:mod:`~affdiv.experiments.runs.batched`). MKL picks its kernels by the processor's vendor, and
on an Intel processor with AVX-512 runs its AVX-512 code itself: there, on one core of an Intel
Xeon processor (``benchmarks/results/cpu_training_roofline_intel_xeon.json``), ``torch.mm`` of the
floor's square matrices ran 1.10-1.92 times as fast as oneDNN's matmul in every row. The
products therefore take oneDNN everywhere but where torch's BLAS is MKL on an Intel processor
(:data:`ONEDNN_PREFERRED`, a rule of the machine, never a timing, so a run's numbers do not depend
on its load). With as many models as the roofline stacks (48 for the MLPs) that bought the MLP
arms' and the vit's step 1.09-1.20 at B = 16, cost the MLP about 6% at B = 64 (0.95) and read
0.97-1.07 elsewhere (``benchmarks/fused_passes.py``,
the pass "MKL on Intel", paired rounds: ``cpu_fused_passes_mkl_on_intel.json``), and with a
study's stacks of 6 and 12 MLPs at B = 16 and 32 1.13-1.35
(``cpu_fused_passes_mkl_on_intel_small_stacks.json``).

:func:`baddbmm` takes oneDNN where :data:`ONEDNN_PREFERRED`, :func:`usable` and the product has at least
:data:`ONEDNN_MIN_FLOPS` (smaller ones run faster on torch's ops: :func:`takes_onednn`), else
``torch.baddbmm`` / ``torch.bmm``. The backward checks again: a backward that records a graph (a
double backward), carries forward-mode tangents or batched gradients takes torch's products, which
are differentiable and have those rules.

*The SGD step in the backward.* Given ``step``, the per-model −η_k as a (K, 1, 1) column,
:func:`baddbmm` makes plain SGD's update of its weight operand W (a, or b passed as Wᵀ) in the
backward, in place, instead of returning W's gradient (:class:`SgdStepBaddbmm`):

    W_k ← W_k + (−η_k) ∂W_k,   ∂W = g bᵀ (W = a)  or  (aᵀ g)ᵀ = gᵀ a (W = bᵀ),

after the other operands' gradients, which read W before it moves (:func:`sgd_step_`). Where it
pays (:func:`fused_step`) that is one product that adds into W, the factor of ∂W with fewer
entries scaled by −η_k, by oneDNN's sum post-op (torch's in-place ``baddbmm_``, a GEMM with β = 1,
where oneDNN is not :data:`ONEDNN_PREFERRED`): ∂W is never written out and read back, and the
optimiser's pass over W is saved (the engine takes it on oneDNN where its stack stays in cache,
on MKL up to 64 MiB: :func:`~affdiv.experiments.runs.batched.sgd_stepped`).
Its roundings differ from the separate update's: each entry of the scaled factor is rounded, then
the products' sums are added into W, where the optimiser rounds ∂W, then its product with −η_k,
then the sum. Elsewhere the step is
the optimiser's own, bit for bit: ∂W as the backward computes it without the step, then
``addcmul_`` with −η_k. The weight must be used once in the graph and not require a gradient, and
the step must require one (:func:`check_step`: its gradient is zero, :func:`step_gradient`, and
asking for it makes autograd run every stepped backward); a backward that records a graph (a
double backward) cannot make the step and raises, as do saved-tensor hooks and torch.compile. If
a backward raises after some of its products have stepped their weights, those weights have
moved: the step is not atomic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from affdiv.layers import _fused, _native
from affdiv.layers._torch_internals import is_compiling, saved_tensors_hooks_active, untraced_eager
from affdiv.provenance import cpu_vendor, torch_blas


def onednn_preferred(vendor: str | None, mkl: bool) -> bool:
    """The rule for whether the engine's float32 products take oneDNN on a processor of ``vendor``
    (as cpuid names it) whose torch multiplies with MKL (``mkl``) or another BLAS: everywhere but
    where MKL runs on an Intel processor, which it gives its own widest code (module docstring).
    A rule of the machine, not a timing on it."""
    return not (mkl and vendor == "GenuineIntel")


def blas_is_mkl(config: str | None = None) -> bool:
    """Whether torch's BLAS is MKL, as its build configuration (``config``, default
    ``torch.__config__.show()``) says: ``BLAS_INFO=mkl`` (:func:`affdiv.provenance.torch_blas`)."""
    return torch_blas(config) == "mkl"


#: Whether the engine's float32 products and its SGD step's fused product take oneDNN where it may
#: run them (:func:`takes_onednn`, :func:`sgd_step_`): :func:`onednn_preferred` for the processor it
#: runs on. False (MKL on an Intel processor) also sets the fused step's lines (:func:`fuses_step`,
#: :func:`~affdiv.experiments.runs.batched.sgd_stepped`) and puts the MLPs' tanh on torch's
#: (:func:`~affdiv.experiments.runs.activations.takes_pass`): one rule of the machine for all.
ONEDNN_PREFERRED = onednn_preferred(cpu_vendor(), blas_is_mkl())


def usable(*tensors: Tensor | None) -> bool:
    """Whether oneDNN may take a product of these tensors (None entries ignored): torch's own
    oneDNN switch on and its float32 matmul precision full (:func:`_full_float32_precision`); the
    extension bound oneDNN's matmul (its self-test runs at the first call that gets this far) and
    ``affdiv.layers._native.disabled`` is not in force; and :func:`plain_operands`."""
    return plain_operands(*tensors) and torch.backends.mkldnn.enabled and _full_float32_precision() \
        and _native.onednn_enabled()


def plain_operands(*tensors: Tensor | None) -> bool:
    """Whether these tensors (None entries ignored) are operands of a plain eager product: not
    traced by torch.compile, no torch.func transform, dispatch mode or forward-mode AD (whose rules
    only torch's ops have); CPU autocast off (torch's products follow it); each tensor a plain
    strided float32 CPU tensor (no subclass, not wrapped), none empty."""
    if not untraced_eager() or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or (t.dtype == torch.float32 and t.is_cpu and t.layout == torch.strided and t.numel() > 0
                             and _fused.plain(t))
               for t in tensors)


def _full_float32_precision() -> bool:
    """Whether torch asks oneDNN's float32 matmul for full precision: from torch 2.9 its
    ``backends.mkldnn.matmul.fp32_precision`` ("ieee", or "none": inherited), before that the
    float32 matmul precision "highest" (``set_float32_matmul_precision("high")`` or "medium" ask
    for TF32 or bfloat16 products, which oneDNN's matmul would then compute at every size)."""
    setting = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
    return setting in ("none", "ieee") if setting is not None else torch.get_float32_matmul_precision() == "highest"


#: The fewest FLOPs, 2·K·M·L·N, of a product that :func:`baddbmm` and :func:`product` give to oneDNN
#: (see :func:`takes_onednn`).
ONEDNN_MIN_FLOPS = 4_000_000


def takes_onednn(c: Tensor | None, a: Tensor, b: Tensor) -> bool:
    """Whether the product a b (+ c) runs on oneDNN: :data:`ONEDNN_PREFERRED`, :func:`usable`, and
    at least :data:`ONEDNN_MIN_FLOPS`. Below that torch's ops are faster. On one core a call of oneDNN's
    matmul through torch's took about 11 µs where ``torch.bmm`` took 2, and :class:`OnednnBaddbmm`'s
    Python forward and backward add to that: a product's forward and backward (FLOPs counted for
    the forward) took 105 µs on oneDNN and 39 on torch's ops at 0.52 MFLOP (one model's 256 rows
    times a 32 × 32 weight), 121 and 73 at 1.6 (three models), 151 and 126 at 3.1 (six); from 6.3
    MFLOP on, oneDNN was faster, 1.15-1.3× at 6.3 and 1.75-2× from 25-40 MFLOP (a quick
    measurement at the vit's and the MLP's layer shapes). A bare :func:`product` (no
    Function) breaks even lower, oneDNN's call taking 14 µs against torch's 7 at 0.52 MFLOP and 29
    against 34 at 3.1: the one line is the Function's, which every layer of the engine takes. A
    study's run stacks its few learning-rate candidates, whose products at small batches fall
    below the line; the roofline's 48-model cells mostly lie above it. Below it the product and its
    backward are torch's own, so a weight passed as Wᵀ gets its gradient as torch lays it out (a
    transposed view), not in W's layout (:func:`_laid_out_as`)."""
    return ONEDNN_PREFERRED and usable(c, a, b) and 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2] \
        >= ONEDNN_MIN_FLOPS


def baddbmm(c: Tensor | None, a: Tensor, b: Tensor, step: Tensor | None = None, weight: str = "a") -> Tensor:
    """c + a b (a b without c): a (K, M, L), b (K, L, N), c broadcast to (K, M, N); by oneDNN where
    :func:`takes_onednn`, a contiguous (K, M, N) tensor. With ``step`` (the per-model −η, (K, 1, 1)),
    the backward makes the SGD step of the operand named by ``weight`` ("a", or "b" for a weight
    passed as its transpose) in place (module docstring)."""
    if step is not None:
        if weight not in ("a", "b"):
            raise ValueError(f"weight names the stepped operand, 'a' or 'b', got {weight!r}")
        check_step(a if weight == "a" else b, step)
        return SgdStepBaddbmm.apply(c, a, b, step, weight == "a")
    if takes_onednn(c, a, b):
        return OnednnBaddbmm.apply(c, a, b)
    return _torch_baddbmm(c, a, b)


def _torch_baddbmm(c: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """c + a b by torch's ops."""
    return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b)


def product(a: Tensor, b: Tensor) -> Tensor:
    """a b, a (K, M, L), b (K, L, N), by oneDNN where :func:`takes_onednn`, else ``torch.bmm``; not
    recorded by autograd (for backwards: :func:`baddbmm` is the differentiable product)."""
    return _product(a, b) if takes_onednn(None, a, b) else torch.bmm(a, b)


def _product(a: Tensor, b: Tensor) -> Tensor:
    """a b by oneDNN, a new contiguous tensor."""
    return _native.onednn_bmm_(a.new_empty(a.shape[0], a.shape[1], b.shape[2]), a, b)


class OnednnBaddbmm(torch.autograd.Function):
    """:func:`baddbmm` on oneDNN (module docstring)."""

    @staticmethod
    def forward(ctx, c: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.c_shape = None if c is None else c.shape
        return _onednn_baddbmm(c, a, b)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        need_c, need_a, need_b = ctx.needs_input_grad
        # (a graph recorded, tangents or batched gradients: torch's products, differentiable)
        return (g.sum_to_size(ctx.c_shape) if need_c else None,
                *_onednn_gradients(a, b, g, need_a, need_b, torch.is_grad_enabled()))


def _onednn_baddbmm(c: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """c + a b by oneDNN, a new contiguous tensor."""
    if c is None:
        return _product(a, b)
    # c written out (a copy, never c itself), then the product added to it: oneDNN's sum post-op
    out = c.expand(a.shape[0], a.shape[1], b.shape[2]).clone(memory_format=torch.contiguous_format)
    return _native.onednn_bmm_(out, a, b, 1.0)


class SgdStepBaddbmm(torch.autograd.Function):
    """:func:`baddbmm` whose backward makes the SGD step of its weight operand (module docstring);
    its product by :func:`takes_onednn`'s rule, and the gradients of the other operands (and of
    the weight, for a step that is not :func:`fused_step`) as the product without the step
    computes them on that route: :class:`OnednnBaddbmm`'s, or torch's ``baddbmm`` backward."""

    @staticmethod
    def forward(ctx, c: Tensor | None, a: Tensor, b: Tensor, step: Tensor, weight_is_a: bool) -> Tensor:
        ctx.save_for_backward(a, b, step)
        ctx.c_shape, ctx.weight_is_a, ctx.onednn = (None if c is None else c.shape), weight_is_a, takes_onednn(c, a, b)
        return _onednn_baddbmm(c, a, b) if ctx.onednn else _torch_baddbmm(c, a, b)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor | None, ...]:
        a, b, step = ctx.saved_tensors
        check_plain_backward()
        need_c, need_a, need_b = ctx.needs_input_grad[:3]
        grad_c = g.sum_to_size(ctx.c_shape) if need_c else None
        gradients = _onednn_gradients if ctx.onednn else _torch_gradients
        if ctx.weight_is_a:  # ∂W = g bᵀ, after b's gradient (Wᵀ g) has read W
            grad_b = gradients(a, b, g, False, need_b)[1]
            sgd_step_(a, step, g, b.transpose(1, 2), lambda: gradients(a, b, g, True, False)[0])
            return grad_c, None, grad_b, step_gradient(step), None
        # W = bᵀ: ∂W = gᵀ a, after a's gradient (g W) has read W
        grad_a = gradients(a, b, g, need_a, False)[0]
        sgd_step_(b.transpose(1, 2), step, g.transpose(1, 2), a,
                  lambda: gradients(a, b, g, False, True)[1].transpose(1, 2))
        return grad_c, grad_a, None, step_gradient(step), None


def _onednn_gradients(a: Tensor, b: Tensor, g: Tensor, need_a: bool, need_b: bool,
                      recording: bool = False) -> tuple[Tensor | None, ...]:
    """(∂a, ∂b) of a b for g as :class:`OnednnBaddbmm`'s backward computes them: by
    :func:`product`, or by ``torch.bmm`` where the backward records a graph (differentiable)."""
    mm = torch.bmm if recording else product
    return (_laid_out_as(a, mm, g, b.transpose(1, 2)) if need_a else None,
            _input_gradient(b, mm, a.transpose(1, 2), g, not recording) if need_b else None)


def _torch_gradients(a: Tensor, b: Tensor, g: Tensor, need_a: bool, need_b: bool) -> tuple[Tensor | None, ...]:
    """(∂a, ∂b) of a b for g as torch's ``baddbmm`` and ``bmm`` backwards compute them."""
    return (torch.bmm(g, b.transpose(1, 2)) if need_a else None,
            torch.bmm(a.transpose(1, 2), g) if need_b else None)


def check_step(weight: Tensor, step: Tensor) -> None:
    """Raise where a product's backward cannot make the SGD step of ``weight`` by ``step``: a
    weight that requires a gradient (autograd would also want its gradient), a step that does not
    (the product might then not be in the graph, and its backward not run), saved-tensor hooks (a
    hook that copies what a Function saves would have the backward write into the copy), or a
    trace by torch.compile (a compiled backward does not write its inputs)."""
    if weight.requires_grad:
        raise ValueError("a weight stepped in the backward must not require a gradient")
    if not step.requires_grad:
        raise ValueError("an SGD step made in the backward must require a gradient (its zeros), so that the "
                         "product is in the graph")
    if saved_tensors_hooks_active():
        raise RuntimeError("an SGD step in the backward cannot be made under saved-tensor hooks: leave the update "
                           "to the optimiser")
    if is_compiling():
        raise RuntimeError("an SGD step in the backward cannot be compiled: leave the update to the optimiser")


def check_plain_backward() -> None:
    """Raise unless the backward running records no graph and is not compiled: an SGD step made
    in a backward cannot be differentiated (a double backward), nor traced (compiled autograd)."""
    if torch.is_grad_enabled():
        raise RuntimeError("a backward that makes an SGD step cannot record a graph (a double backward)")
    if is_compiling():
        raise RuntimeError("a backward that makes an SGD step cannot be compiled: leave the update to the optimiser")


def step_gradient(step: Tensor) -> Tensor:
    """The gradient of a Function's output with respect to its SGD step: zero, exactly (the forward
    does not read the step). The step requires a gradient (:func:`check_step`), which puts every
    stepped product on the path from the loss to the step, so that autograd runs its backward
    whatever else requires a gradient (a first layer without a bias, whose input is data)."""
    return torch.zeros_like(step)


def sgd_step_(weight: Tensor, step: Tensor, left: Tensor, right: Tensor,
              gradient: Callable[[], Tensor] | None = None) -> Tensor:
    """weight += step ⊙ (left right) in place, weight (K, P, Q), left (K, P, M), right (K, M, Q),
    step (K, 1, 1), left right the weight's gradient: where :func:`fused_step`, the factor with
    fewer entries is scaled by the step and the product added into the weight by one product that
    adds into its output, oneDNN's with its sum post-op where :data:`ONEDNN_PREFERRED`, else
    torch's in-place ``baddbmm_`` (its BLAS's GEMM with β = 1); else the optimiser's update,
    ``addcmul_`` of the gradient with the step, the gradient computed as ``gradient()`` (default
    :func:`product` (left, right)) as the backward without the step would. Returns the weight."""
    if not fused_step(weight, left, right):
        return weight.addcmul_(gradient() if gradient is not None else product(left, right), step)
    if left.shape[1] * left.shape[2] <= right.shape[1] * right.shape[2]:
        left = left * step
    else:
        right = right * step
    if ONEDNN_PREFERRED:
        return _native.onednn_bmm_(weight, left, right, 1.0)
    return weight.baddbmm_(left, right)


#: The most rows M (the sum's length) of a weight's gradient for which :func:`fused_step` adds it
#: into the weight in one product on oneDNN (:data:`ONEDNN_PREFERRED`; :func:`fuses_step`).
FUSED_STEP_MAX_ROWS = 32
#: The same line on torch's ``baddbmm_`` where the BLAS is MKL on an Intel processor.
MKL_FUSED_STEP_MAX_ROWS = 64


def fused_step(weight: Tensor, left: Tensor, right: Tensor) -> bool:
    """Whether :func:`sgd_step_` adds the product into the weight in one product:
    :func:`fuses_step` for the weight and the rows of the sum (its FLOPs are the product's), and
    the product's factors operands it may take (:func:`_step_operands`)."""
    return fuses_step(weight, left.shape[2]) and _step_operands(left, right)


def fuses_step(weight: Tensor, rows: int) -> bool:
    """Whether the SGD step of a stacked weight (K, P, Q) whose gradient sums ``rows`` rows may be
    one product that adds into it (:func:`sgd_step_`): the weight contiguous and an operand that
    product may take (:func:`_step_operands`), the product of at least :data:`ONEDNN_MIN_FLOPS`,
    2·K·P·rows·Q, and at most :data:`FUSED_STEP_MAX_ROWS` rows on oneDNN, at most
    :data:`MKL_FUSED_STEP_MAX_ROWS` on MKL (:data:`ONEDNN_PREFERRED` false).

    The fused product saves the gradient's write and the update's pass over the weight, a fixed
    cost against the product's, which grows with the rows. On oneDNN, on one core of an AMD
    processor with 32 MiB of L3 cache (weights of 128 and 256 rows on 128, 256 and 784 inputs, 3
    to 48 models, their caches warm, a quick measurement), the one product took 0.55–0.91 of the
    time of the separate product and ``addcmul_`` at 16 rows with up to 18 MiB of weight, 0.73–0.93
    at 32 rows, 0.80–0.97 at 64 and 0.93–1.24 at 128 and 256; and oneDNN's sum post-op reads a
    weight that has left the cache slowly (37 MiB of weight: 1.15–1.27 from 32 rows), which the
    engine's line of bytes keeps it from (:func:`~affdiv.experiments.runs.batched.sgd_stepped`).
    On MKL, on one core of an Intel Xeon processor, torch's ``baddbmm_`` took 0.54–0.83 of the
    time of ``bmm`` and ``addcmul_`` at 16 and 32 rows, 6 to 48 models of 784 × 256 weights (a
    quick measurement). In the MLP arms' step (``benchmarks/fused_passes.py``, the pass "step in
    backward", 12 and 48 models, paired rounds, one process;
    ``benchmarks/results/cpu_fused_passes_mkl_step_lines.json``) the fused step read 1.19–1.35 at
    B = 16, 1.05–1.17 at 32, 1.04–1.11 at 64, 1.01–1.09 at 128 and 0.96–1.10 at 256, where the
    identical code of both variants read 0.97–1.03 (at B = 1024, beyond that run's line of 256);
    with two such processes at once, as a sweep's two workers run, 1.04–1.11 at 64 rows and
    0.97–1.07 at 128 (``cpu_fused_passes_mkl_step_lines_two_workers_{1,2}.json``). The line is the
    most rows at which every cell, with one process or two, gained beyond that noise. The line of
    :data:`ONEDNN_MIN_FLOPS` is oneDNN's call's, kept on MKL unmeasured (it leaves only products
    far smaller than the harness's MLPs' to the optimiser)."""
    k, p, q = weight.shape
    most_rows = FUSED_STEP_MAX_ROWS if ONEDNN_PREFERRED else MKL_FUSED_STEP_MAX_ROWS
    return (weight.is_contiguous() and rows <= most_rows and _step_operands(weight)
            and 2 * k * p * rows * q >= ONEDNN_MIN_FLOPS)


def _step_operands(*tensors: Tensor) -> bool:
    """Whether the fused step's product may take these operands: :func:`usable` on oneDNN
    (:data:`ONEDNN_PREFERRED`), else :func:`plain_operands` for torch's ``baddbmm_``."""
    return usable(*tensors) if ONEDNN_PREFERRED else plain_operands(*tensors)


def _laid_out_as(operand: Tensor, mm, left: Tensor, right: Tensor) -> Tensor:
    """left right, the gradient of ``operand``, in its layout: for an operand stored transposed (a
    transposed view of a contiguous tensor, as a weight W passed as Wᵀ), (rightᵀ leftᵀ)ᵀ, so that
    the gradient reaches the weight contiguous, as torch's own 2-D mm backward lays it out."""
    if not operand.is_contiguous() and operand.transpose(1, 2).is_contiguous():
        return _transposed_product(mm, left, right)
    return mm(left, right)


def _transposed_product(mm, left: Tensor, right: Tensor) -> Tensor:
    """left right as (rightᵀ leftᵀ)ᵀ: the same sums, a transposed view."""
    return mm(right.transpose(1, 2), left.transpose(1, 2)).transpose(1, 2)


#: The most columns M of g (K, N, M) for which :func:`_input_gradient` computes Wᵀ g as (gᵀ W)ᵀ.
THIN_COLUMNS = 32
#: The fewest rows N of W (the product's contraction) for which it does.
THIN_MIN_CONTRACTION = 128


def _input_gradient(operand: Tensor, mm, left: Tensor, right: Tensor, may_transpose: bool) -> Tensor:
    """left right, the gradient of the second factor b (:func:`_laid_out_as`). Where the engine's
    column layer zᵀ = W xᵀ gets its input's gradient ∂xᵀ = Wᵀ g with few columns
    (:func:`thin_input_gradient`), ``may_transpose`` and oneDNN takes the product, it is computed
    as (gᵀ W)ᵀ and copied contiguous: the same sums, in another order inside the kernel. On one
    core oneDNN ran Wᵀ g with so few columns at 70-80 GF/s, gᵀ W at twice that; for 48 models with
    W of 256 × 256 the product and its copy took 0.41 / 0.60 / 0.90 of the direct product's time at
    16 / 32 / 64 columns and 1.20 at 128 (a quick measurement). Up to 32 columns it bought the MLP's
    step of 48 models 1.17 and 1.11 (B = 16, 32; ``benchmarks/fused_passes.py``); 64 columns, a tenth saved on
    the product alone, was not measured in the step and is not taken. With fewer than
    :data:`THIN_MIN_CONTRACTION` rows in W (a 10-class head) the copy costs more than it saves."""
    if (may_transpose and operand.is_contiguous() and takes_onednn(None, left, right)
            and thin_input_gradient(left, right)):
        return _transposed_product(_product, left, right).contiguous()
    return _laid_out_as(operand, mm, left, right)


def thin_input_gradient(left: Tensor, right: Tensor) -> bool:
    """Whether left right is Wᵀ g with few columns in g and a long enough contraction
    (:func:`_input_gradient`): ``left`` (K, L, N) a transposed view of a contiguous (K, N, L)
    weight, ``right`` (K, N, M) with M ≤ :data:`THIN_COLUMNS` and N ≥ :data:`THIN_MIN_CONTRACTION`."""
    return (right.shape[2] <= THIN_COLUMNS and left.shape[2] >= THIN_MIN_CONTRACTION
            and not left.is_contiguous() and left.transpose(1, 2).is_contiguous())

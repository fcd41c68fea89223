"""K models of one plain architecture trained as one: batched layers over stacked weights.

For an ``nn.Sequential`` of the layers in :data:`LAYER_NAMES` (every MLP method and the conv,
conv+batchnorm and patchnorm CNNs of :mod:`~affdiv.experiments.runs.models`), :class:`BatchedEnsemble` runs the
K stacked models as one ordinary autograd graph, without ``torch.func``: the activations of an
MLP are (K, B, F) and a linear layer is one batched product, z_kᵀ = W_k x_kᵀ + b_k
(``baddbmm``; in float32 on oneDNN where it is preferred, may run and the product is large enough,
:mod:`~affdiv.experiments.runs.stacked_matmul`);
the activations of a CNN are (B, K·C, H, W) in channels-last memory order, so a
convolution is one grouped convolution (groups = K) and BatchNorm, pooling and the activations
act per channel on that layout unchanged (the running statistics are the stacked buffers seen as
K·C channels, updated in place as each model's would be); a nondecreasing activation followed by
a max-pool runs after it (the same numbers, a quarter of the work), a first convolution of one
input channel (``nn.Conv2d``, with or without a BatchNorm2d after it, or ``PatchNormConv2d``)
followed by a 2×2 max-pool and its ReLU is one C pass (:mod:`~affdiv.experiments.runs.conv_pool`)
that never writes the full-resolution convolution output, and every later 2×2 max-pool with its
ReLU is one C pass too (:mod:`~affdiv.experiments.runs.pool_relu`). The step is

    (L_k)_k = CE(f(X_k; θ_k, β_k), Y_k),   (g_k)_k = ∂(Σ_k L_k)/∂θ

(the models share no parameter, so the gradient of the sum is each model's own gradient; its
seed is 1 for every L_k, exact), then the stacked optimiser's update; with plain SGD, a float32
MLP whose stack stays in cache makes its dense weights' update inside the backward
(:func:`sgd_stepped`). Each model's arithmetic is the formula it has alone, in batched kernels:
its numbers equal those of the same model trained alone (or by the vmapped
:class:`~affdiv.experiments.runs.stacked.StackedEnsemble`) up to the order of summation inside
those kernels and, for the update made in the backward, the roundings of its product
(:mod:`~affdiv.experiments.runs.stacked_matmul`), within the bound the tests state for the
vmapped engine. In float32 they may differ from the vmapped engine's at rounding level (the
products' order of summation, the update made in the backward, and tanh's last bit: the
engine's float32 tanh is the correctly rounded one, :mod:`~affdiv.experiments.runs.activations`,
torch's is not everywhere; where torch's BLAS is MKL on an Intel processor the engine takes
torch's).

Checks, and the runs' test splits after training, evaluate one chunk of samples for all the
models on that split: the first linear layer is then one GEMM with the K weights side by side (in
float32 on oneDNN where it is preferred, may run and the product is large enough, as the engine's other
products: the largest product of an MLP's check), a first convolution on more than one input
channel one dense convolution, and models on different splits of one size are evaluated in one
pass per chunk.

The vision transformer of the vit methods (:mod:`~affdiv.experiments.runs.transformer`) is batched
too (:func:`batched_vit`): its tokens are rows, (K, B·T, d), so that every projection, LayerNorm,
activation and QK-norm is one of the layers above, and attention, softmax(Q_h K_hᵀ/√d_h) V_h for
each of the K·B·H (sequence, head) pairs as the model computes it per sequence, runs in fused
passes over the projections' rows (:mod:`~affdiv.experiments.runs.stacked_attention`).

AffineLike and NormLike are one autograd Function each around the batched product, with the
layers' fused row passes (:mod:`~affdiv.experiments.runs.stacked_dense`); the K models'
PatchNormConv2d is one PatchNorm convolution of K times the groups, with its fused kernels. Any other layer, or a layer
setting not listed (a strided or dilated convolution, a normalisation over more than the last
dimension),
makes :func:`is_batched` false: such a model trains on the vmapped engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from affdiv.experiments.runs import (
    activations,
    conv_pool,
    pool_relu,
    stacked_attention,
    stacked_dense,
    stacked_layer_norm,
    stacked_matmul,
)
from affdiv.experiments.runs.stacked import StackedEnsemble
from affdiv.layers.functional import patchnorm_conv2d

Stacked = Mapping[str, Tensor]
#: One layer, batched: (x, its stacked parameters and buffers by local name, K, training) -> output.
Layer = Callable[[Tensor, Stacked, int, bool], Tensor]
#: A whole model, batched: (its stacked parameters and buffers by name, inputs (K, B, ...), training)
#: -> logits (K, B, classes).
Forward = Callable[[Stacked, Tensor, bool], Tensor]
#: The entry of a layer's state that holds plain SGD's per-model −η, (K, 1, 1), where the layer's
#: backward makes its weight's step itself (:func:`sgd_stepped`); the weight then gets no gradient.
SGD_STEP = "sgd_step"


def _to_rows(x: Tensor, k: int) -> Tensor:
    """Any activation as (K, B, F): from the input (K, B, ...), rows, or a CNN's (B, K·C, H, W)."""
    if x.dim() == 4:
        return x.reshape(x.shape[0], k, -1).transpose(0, 1)
    return x if x.dim() == 3 else x.reshape(k, x.shape[1], -1)


def _to_channels(x: Tensor, k: int) -> Tensor:
    """The input (K, B, C, H, W) as (B, K·C, H, W) in channels-last memory order (which the
    convolutions, BatchNorm and pooling keep: on CPU each is faster on it, max-pooling several
    times); a CNN activation as it is."""
    if x.dim() == 5:
        x = x.transpose(0, 1).reshape(x.shape[1], k * x.shape[2], *x.shape[3:])
        return x.contiguous(memory_format=torch.channels_last)
    return x


def _linear(x: Tensor, p: Stacked, k: int, _training: bool = True) -> Tensor:
    """z = x Wᵀ + b, by :func:`_column_product` (with the weight's SGD step where ``p`` has one:
    :data:`SGD_STEP`)."""
    return _column_product(_to_rows(x, k), p["weight"], p.get("bias"), p.get(SGD_STEP))


def _token_linear(x: Tensor, p: Stacked, k: int, _training: bool = True) -> Tensor:
    """z = x Wᵀ + b with z contiguous (:func:`~affdiv.experiments.runs.stacked_dense.row_product`): for
    many rows of few features (a transformer's tokens), whose activations are then split into heads
    and normalised row by row (the weight, passed as Wᵀ, gets its gradient in W's layout where
    the product runs on oneDNN, as torch lays it out, a transposed view, where torch's product
    takes it: :func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`)."""
    return stacked_dense.row_product(x, p["weight"], p.get("bias"))


def _column_product(x: Tensor, weight: Tensor, bias: Tensor | None, step: Tensor | None = None) -> Tensor:
    """zᵀ = W xᵀ + b, computed in that orientation so that the weight's gradient, dzᵀ x, comes out
    contiguous (the optimiser's update then runs over contiguous memory); z is a transposed view.
    (The products: :func:`~affdiv.experiments.runs.stacked_matmul.baddbmm`, whose backward makes
    the weight's SGD step where ``step`` is given.)"""
    zt = stacked_matmul.baddbmm(None if bias is None else bias.unsqueeze(2), weight, x.transpose(1, 2), step)
    return zt.transpose(1, 2)


def _affine_like(x: Tensor, p: Stacked, k: int, _training: bool, product=_column_product) -> Tensor:
    """z = (W x + b)/√(‖x‖² + 1) (:func:`~affdiv.experiments.runs.stacked_dense.affine_like`; W x + b
    by ``product`` where it runs in torch operations)."""
    return stacked_dense.affine_like(_to_rows(x, k), p["weight"], p.get("bias"), product, p.get(SGD_STEP))


def _norm_like(module: nn.Module) -> Layer:
    """z = W c x/max(‖x‖, ε) + b, c = 1 (l2) or √m (rms)
    (:func:`~affdiv.experiments.runs.stacked_dense.norm_like`)."""
    mode, eps = module.mode, module.eps

    def layer(x: Tensor, p: Stacked, k: int, _training: bool) -> Tensor:
        x = _to_rows(x, k)
        scale = 1.0 if mode == "l2" else x.shape[2] ** 0.5
        return stacked_dense.norm_like(x, p["weight"], p.get("bias"), scale, eps, _column_product, p.get(SGD_STEP))
    return layer


def _batch_norm(module: nn.modules.batchnorm._BatchNorm) -> Layer:
    """BatchNorm on the stacked channels: (K, B, C) rows go to (B, K·C) and back."""
    def layer(x: Tensor, p: Stacked, k: int, training: bool) -> Tensor:
        rows = x.dim() == 3
        if rows:
            b, c = x.shape[1], x.shape[2]
            x = x.transpose(0, 1).reshape(b, k * c)
        else:
            x = _to_channels(x, k)
        if training:
            p["num_batches_tracked"].add_(1)
        out = F.batch_norm(x, p["running_mean"].view(-1), p["running_var"].view(-1), p["weight"].reshape(-1),
                           p["bias"].reshape(-1), training, module.momentum, module.eps)
        return out.view(b, k, c).transpose(0, 1) if rows else out
    return layer


def _layer_norm(module: nn.LayerNorm) -> Layer:
    """LayerNorm over the rows' last dimension with each model's affine: with a weight and a bias,
    one pass each way (:func:`~affdiv.experiments.runs.stacked_layer_norm.layer_norm`)."""
    def layer(x: Tensor, p: Stacked, k: int, _training: bool) -> Tensor:
        if "weight" in p and "bias" in p:
            return stacked_layer_norm.layer_norm(_to_rows(x, k), p["weight"], p["bias"], module.eps)
        z = F.layer_norm(_to_rows(x, k), module.normalized_shape, eps=module.eps)
        z = z * p["weight"].unsqueeze(1) if "weight" in p else z  # elementwise_affine False, or no bias
        return z + p["bias"].unsqueeze(1) if "bias" in p else z
    return layer


def _rms_norm(module: nn.RMSNorm) -> Layer:
    def layer(x: Tensor, p: Stacked, k: int, _training: bool) -> Tensor:
        z = F.rms_norm(_to_rows(x, k), module.normalized_shape, eps=module.eps)
        return z * p["weight"].unsqueeze(1) if "weight" in p else z
    return layer


def _conv2d(module: nn.Conv2d) -> Layer:
    def layer(x: Tensor, p: Stacked, k: int, _training: bool) -> Tensor:
        w = p["weight"]
        bias = p["bias"].reshape(-1) if "bias" in p else None
        return F.conv2d(_to_channels(x, k), w.reshape(-1, *w.shape[2:]), bias, module.stride, module.padding,
                        module.dilation, module.groups * k)
    return layer


def _patchnorm_conv2d(module: nn.Conv2d) -> Layer:
    """PatchNormConv2d, z = (W ⋆ x + b)·r with r = 1/√(‖patch‖² + 1) at each output position, the
    patch being its group's channels: the K models are one PatchNorm convolution with groups =
    K·groups (:func:`affdiv.layers.functional.patchnorm_conv2d`), whose patches are each model's
    (each of its groups') own; its fused passes (the squares summed per group, the box sums, the
    scaling and its backward) run on the stacked channels as on one model's, and it keeps its output
    for backward or recomputes it as the module's ``recompute`` says."""
    def layer(x: Tensor, p: Stacked, k: int, _training: bool) -> Tensor:
        w = p["weight"]
        bias = p["bias"].reshape(-1) if "bias" in p else None
        return patchnorm_conv2d(_to_channels(x, k), w.reshape(-1, *w.shape[2:]), bias, module.stride,
                                module.padding, module.dilation, module.groups * k, module.recompute)
    return layer


def _elementwise(module: nn.Module) -> Layer:
    if type(module) is nn.Tanh:  # (float32: the fused pass, see activations)
        return lambda x, _p, _k, _training: activations.tanh(x)
    return lambda x, _p, _k, _training: module(x)


def _pool(module: nn.Module) -> Layer:
    return lambda x, _p, k, _training: module(_to_channels(x, k))


def _flatten(x: Tensor, _p: Stacked, k: int, _training: bool) -> Tensor:
    return _to_rows(x, k)


def _layer(module: nn.Module) -> Layer | None:
    """The batched form of ``module``, or None where there is none."""
    from affdiv.layers import AffineLike, NormLike, PatchNormConv2d

    kind = type(module)
    if kind is nn.Linear:
        return _linear
    if kind is AffineLike:
        return _affine_like
    if kind is NormLike:
        return _norm_like(module)
    if kind in (nn.Tanh, nn.ReLU, nn.GELU, nn.Identity):
        return _elementwise(module)
    if kind is nn.Flatten and module.start_dim == 1 and module.end_dim == -1:
        return _flatten
    if kind in (nn.BatchNorm1d, nn.BatchNorm2d) and conv_pool.stackable_batch_norm(module):
        return _batch_norm(module)
    if kind is nn.LayerNorm and len(module.normalized_shape) == 1:
        return _layer_norm(module)
    if kind is nn.RMSNorm and len(module.normalized_shape) == 1:
        return _rms_norm(module)
    if kind in (nn.Conv2d, PatchNormConv2d) and module.padding_mode == "zeros" and module.stride == (1, 1) \
            and module.dilation == (1, 1) and not isinstance(module.padding, str):
        return _conv2d(module) if kind is nn.Conv2d else _patchnorm_conv2d(module)
    if kind is nn.MaxPool2d or (kind is nn.AdaptiveAvgPool2d and module.output_size in (1, (1, 1))):
        return _pool(module)
    return None


#: Activations that commute with max-pooling: nondecreasing, so max(f(x)) = f(max(x)) exactly, and
#: the gradient reaches the same element (a window's first maximum, or none where f' = 0 there).
_MONOTONE = (nn.ReLU, nn.Tanh, nn.Identity)


def batched_layers(model: nn.Module) -> list[tuple[str | tuple[str, ...], nn.Module, Layer]] | None:
    """(name, module, batched layer) for each layer of ``model``, an ``nn.Sequential`` of the layers above;
    None for any other model. An activation followed by a max-pool (of :data:`_MONOTONE`) runs after
    it instead, on a quarter of the elements: the same forward (the gradient within rounding: a
    window whose maxima tie after a saturating activation passes it to another element). A
    model's first layers that :func:`~affdiv.experiments.runs.conv_pool.first_block_length` takes
    (a convolution and its max-pool, or a convolution, its BatchNorm2d and its max-pool) are one
    entry, with the ReLU after them if there is one, under the convolution's name (with a
    BatchNorm2d, the tuple of the two names: :func:`_local`); every later 2×2 max-pool is one entry
    with the ReLU after it if there is one (:mod:`~affdiv.experiments.runs.pool_relu`), under the
    pool's name."""
    if type(model) is not nn.Sequential:
        return None
    children = list(model.named_children())
    for i in range(len(children) - 1):
        if type(children[i][1]) in _MONOTONE and type(children[i + 1][1]) is nn.MaxPool2d:
            children[i], children[i + 1] = children[i + 1], children[i]
    first = conv_pool.first_block_length([module for _name, module in children])
    layers, i = [], 0
    while i < len(children):
        name, module = children[i]
        pooled = first if i == 0 else 1 if pool_relu.takes(module) else 0  # layers up to the ReLU
        if not pooled:
            layers.append((name, module, _layer(module)))
            i += 1
            continue
        relu = i + pooled < len(children) and type(children[i + pooled][1]) is nn.ReLU
        names, block = zip(*children[i : i + pooled + relu])
        if i == 0:  # the first block: its parameters are the convolution's (and the BatchNorm's)
            name, layer = (names[:2] if pooled == 3 else name), _first_block(block[:pooled], relu)
        else:
            layer = _pool_relu(relu)
        layers.append((name, nn.Sequential(*block) if len(block) > 1 else module, layer))
        i += pooled + relu
    return None if any(layer is None for _name, _module, layer in layers) else layers


def _first_block(modules: Sequence[nn.Module], relu: bool) -> Layer:
    """A model's first layers, a one-channel convolution, a BatchNorm2d or not, a 2×2 max-pool and,
    with ``relu``, a ReLU, as one C pass (:mod:`~affdiv.experiments.runs.conv_pool`) where it can
    take the call, else as the batched layers. Its entry's module is the layers as an
    ``nn.Sequential``; its parameters are the convolution's, under the convolution's name (with a
    BatchNorm2d, the two modules' names, the BatchNorm's state under "1.")."""
    conv, *batch_norm, _pool = modules
    convolve, max_pool = _layer(conv), _pool_relu(relu)
    normalise = _layer(batch_norm[0]) if batch_norm else None
    patchnorm = type(conv) is not nn.Conv2d

    def layer(x: Tensor, p: Stacked, k: int, training: bool) -> Tensor:
        bn = {key[2:]: t for key, t in p.items() if key.startswith("1.")} if batch_norm else {}
        statistics = [bn[key] for key in ("weight", "bias", "running_mean", "running_var")] if batch_norm else []
        if conv_pool.usable(x, p["weight"], p.get("bias"), conv.padding, *statistics):
            if normalise is None:
                return conv_pool.conv_max_pool(x, p["weight"], p.get("bias"), conv.padding, patchnorm, relu)
            if training:
                bn["num_batches_tracked"].add_(1)
            return conv_pool.conv_batch_norm_max_pool(x, p["weight"], p.get("bias"), bn, conv.padding,
                                                      batch_norm[0].momentum, batch_norm[0].eps, training, relu)
        y = convolve(x, p, k, training)
        return max_pool(y if normalise is None else normalise(y, bn, k, training), p, k, training)
    return layer


def _pool_relu(relu: bool) -> Layer:
    """A 2×2 max-pool and, with ``relu``, the ReLU after it: one C pass where
    :func:`~affdiv.experiments.runs.pool_relu.usable` (the same numbers), else torch's."""
    def layer(x: Tensor, _p: Stacked, k: int, _training: bool) -> Tensor:
        x = _to_channels(x, k)
        if pool_relu.usable(x):
            return pool_relu.max_pool_relu(x, relu)
        y = F.max_pool2d(x, 2)
        return F.relu(y) if relu else y
    return layer


#: The most bytes of a stack's parameters for which :func:`sgd_stepped` steps weights in the backward
#: where the fused step is oneDNN's (:data:`~affdiv.experiments.runs.stacked_matmul.ONEDNN_PREFERRED`).
SGD_STEP_MAX_BYTES = 8 * 2**20
#: The same line where it is torch's ``baddbmm_`` on MKL: the largest stack measured, 61 MiB, within it.
MKL_SGD_STEP_MAX_BYTES = 64 * 2**20


def sgd_stepped(layers: Sequence[tuple[str | tuple[str, ...], nn.Module, Layer]] | None, optimizer: str,
                params: Stacked) -> tuple[str, ...]:
    """The names of the layers whose backward may make their weight's SGD step (:data:`SGD_STEP`;
    :mod:`~affdiv.experiments.runs.stacked_matmul`; :meth:`BatchedEnsemble.step` takes those whose
    step is one product), given the stacked parameters ``params``: with plain SGD and float32
    parameters, every ``nn.Linear``, AffineLike and NormLike of an MLP (:func:`batched_layers`
    whose stacked parameters have at most three dimensions: no convolution), whose batched forms
    take the step, while the parameters hold at most :data:`SGD_STEP_MAX_BYTES` where the fused
    step is oneDNN's, :data:`MKL_SGD_STEP_MAX_BYTES` where it is MKL's; none with momentum or
    Adam, whose updates read their state, in float64, where no product is fused, in a CNN, whose
    read-out was not measured, nor in the vision transformer (its layers are narrow, the update a
    small part of its step).

    oneDNN's step pays where a weight is still in cache at its backward. In the MLP arms' step
    (784-256-256-256-10, 1.28 MiB a model; one thread a process, an AMD processor,
    ``benchmarks/fused_passes.py``) it bought 1.10–1.12 with 6 models (7.7 MiB) and 1.27–1.41 with
    12 (15.3 MiB) at B = 16, 1.04–1.08 and 1.12–1.15 at B = 32, and nothing the rounds could see
    with 3 (identical code read 0.98–1.03 in the same run;
    ``benchmarks/results/cpu_fused_passes_sgd_step.json``); but with two such processes at once,
    as a sweep's two workers share the L3 cache, 6 models read 0.97–1.20 at B = 16 and 0.99–1.12
    at B = 32, and 12 models 1.00–1.12 and 0.90–0.97 (``cpu_fused_passes_sgd_step_two_workers_*``).
    The line is therefore 8 MiB, which holds a study's six learning-rate candidates of that MLP.
    Under an earlier rule that stepped every stack of 24 and 48 models (31 and 61 MiB) the step
    bought at most 3% at B = 16 and cost up to 8% at B = 32 and 64 (a measurement not kept).
    torch's ``baddbmm_`` on MKL (one core of an Intel Xeon processor with a large shared L3) paid
    in the stacks measured: with 12 and 48 models (15 and 61 MiB) it bought 1.19–1.35 at B =
    16 and 1.04–1.11 at B = 64 with one process
    (``benchmarks/results/cpu_fused_passes_mkl_step_lines.json``), and 1.21–1.36 and 1.04–1.11
    with two at once (``cpu_fused_passes_mkl_step_lines_two_workers_{1,2}.json``), so on MKL the
    line is just above the largest stack measured (a stack beyond the L3 cache, which that processor's host
    shares, 300 MiB, was not)."""
    from affdiv.layers import AffineLike, NormLike

    if optimizer != "sgd" or layers is None or any(p.dim() > 3 or p.dtype != torch.float32 for p in params.values()):
        return ()
    line = SGD_STEP_MAX_BYTES if stacked_matmul.ONEDNN_PREFERRED else MKL_SGD_STEP_MAX_BYTES
    if sum(p.numel() * p.element_size() for p in params.values()) > line:
        return ()
    return tuple(name for name, module, _layer in layers if type(module) in (nn.Linear, AffineLike, NormLike))


def _local(state: Stacked, prefix: str | tuple[str, ...]) -> dict[str, Tensor]:
    """The entries of ``state`` under the module ``prefix``, by their names within it; for a block
    of modules (a tuple of names), the first module's entries by their names within it and each
    later module's under its place in the block ("1.weight", "1.running_mean", …)."""
    if isinstance(prefix, tuple):
        first, *rest = prefix
        block = _local(state, first)
        for place, name in enumerate(rest, 1):
            block.update({f"{place}.{key}": t for key, t in _local(state, name).items()})
        return block
    start = prefix + "."
    return {key[len(start):]: t for key, t in state.items() if key.startswith(start)}


def batched_vit(model: nn.Module) -> Forward | None:
    """The batched forward of a :class:`~affdiv.experiments.runs.transformer.VisionTransformer`
    (None for any other model, or one with a layer that has no batched form): the model's forward
    on K models' inputs (K, B, C, H, W) with the tokens of all sequences as rows (module docstring)."""
    from affdiv.experiments.runs.transformer import Patches, PositionEmbedding, VisionTransformer

    if type(model) is not VisionTransformer:
        return None
    from affdiv.layers import AffineLike

    leaves = {name: module for name, module in model.named_modules()
              if name and not any(module.children()) and type(module) not in (Patches, PositionEmbedding, nn.Softmax)}
    projections = {nn.Linear: _token_linear,
                   AffineLike: functools.partial(_affine_like, product=stacked_dense.row_product)}
    layers = {name: projections.get(type(module)) or _layer(module) for name, module in leaves.items()}
    if any(layer is None for layer in layers.values()):
        return None

    def forward(state: Stacked, x: Tensor, training: bool) -> Tensor:
        k, batch = x.shape[:2]

        def run(name: str, h: Tensor) -> Tensor:
            return layers[name](h, _local(state, name), k, training)

        tokens = model.patches(x.flatten(0, 1))  # (K·B, T, features)
        count = tokens.shape[1]
        h = run("embed", tokens.reshape(k, batch * count, -1))
        h = (h.view(k, batch, count, -1) + state["position.weight"].unsqueeze(1)).flatten(1, 2)
        for i, block in enumerate(model.blocks):
            name = f"blocks.{i}"
            h = h + _attention(run, f"{name}.attn", block.attn, run(f"{name}.norm1", h), count)
            u = run(f"{name}.norm2", h)
            for j in range(len(block.mlp)):
                u = run(f"{name}.mlp.{j}", u)
            h = h + u
        return run("head", run("norm", h).view(k, batch, count, -1).mean(2))

    return forward


def _attention(run: Callable[[str, Tensor], Tensor], name: str, attn: nn.Module, x: Tensor, tokens: int) -> Tensor:
    """Multi-head self-attention of ``attn`` (its settings; ``run`` applies its batched
    projections and QK-norms by name) on token rows x (K, B·T, d), T = ``tokens``."""
    k, heads, size = x.shape[0], attn.heads, attn.head_dim
    q, key, v = (run(f"{name}.{part}", x) for part in "qkv")
    if attn.q_norm is not None:  # RMSNorm over each head's d_h entries of each token
        q, key = (run(f"{name}.{norm}", t.reshape(k, -1, size)).reshape(v.shape)
                  for norm, t in (("q_norm", q), ("k_norm", key)))
    return run(f"{name}.o", stacked_attention.attention(q, key, v, tokens, heads))


def is_batched(model: nn.Module) -> bool:
    """Whether ``model`` has a batched form: an ``nn.Sequential`` that :func:`batched_layers`
    takes, or the vision transformer (:func:`batched_vit`)."""
    return batched_layers(model) is not None or batched_vit(model) is not None


def _shared_input(x: Tensor, module: nn.Module, p: Stacked, k: int) -> tuple[Tensor, bool] | None:
    """``module`` on ``x`` (B, ...), one input for all K models: (output, whether it is still one
    for all), or None where it has no such form (the input is then repeated per model). A linear
    layer is one matrix product with the K stacked weights side by side, x [W_1; ...; W_K]ᵀ, and a
    convolution one dense convolution with K·C_out output channels, the (B, K·C, H, W) layout of a
    batched CNN (not on one input channel: the output would then come out in NCHW order, not
    channels-last, and the layers after it run several times slower on it; the input is repeated
    instead); a flatten keeps the input shared."""
    if type(module) is nn.Flatten:
        return x.flatten(1), True
    w = p.get("weight")
    if type(module) is nn.Linear:  # a batch of one (oneDNN's product where it is preferred, may run and is large
        # enough), Wᵀ a view either library reads as is
        bias = p["bias"].reshape(1, 1, -1) if "bias" in p else None
        z = stacked_matmul.baddbmm(bias, x.unsqueeze(0), w.reshape(1, -1, w.shape[2]).transpose(1, 2))
        return z[0].view(x.shape[0], k, -1).transpose(0, 1), False
    if type(module) is nn.Conv2d and module.groups == 1 and x.shape[1] > 1:
        z = F.conv2d(x.contiguous(memory_format=torch.channels_last), w.reshape(-1, *w.shape[2:]),
                     p["bias"].reshape(-1) if "bias" in p else None, module.stride, module.padding, module.dilation)
        return z, False
    return None


class BatchedEnsemble(StackedEnsemble):
    """The stacked ensemble of models that have a batched form (:func:`is_batched`), one autograd graph for
    all; the interface, evaluation chunks, optimiser and state are :class:`StackedEnsemble`'s.
    ``stepped`` maps the weights whose SGD step their layers' backward may make to those layers'
    names (:func:`sgd_stepped`, chosen again when :meth:`keep` drops models; emptied, the optimiser
    makes every update); ``half_stepped`` says that a backward raised after some of those steps."""

    def __init__(self, models: Sequence[nn.Module], optimizer: str, lrs: Sequence[float],
                 momenta: Sequence[float | None], train: Sequence[tuple[Tensor, Tensor]],
                 val: Sequence[tuple[Tensor, Tensor]]):
        if not is_batched(models[0]):
            raise ValueError(f"BatchedEnsemble takes an nn.Sequential of {', '.join(LAYER_NAMES)}, or the vision "
                             f"transformer of the vit methods, got {models[0]}")
        super().__init__(models, optimizer, lrs, momenta, train, val)
        # the parameter-less copy's modules: they hold settings only
        self.layers = batched_layers(self.base)
        self.vit = batched_vit(self.base) if self.layers is None else None
        self._loss_sum = _loss_sums
        self._choose_stepped()
        self.half_stepped = False

    def _choose_stepped(self) -> None:
        """Choose the weights that their layers' backward steps, for the stack as it is now."""
        self.stepped = {f"{name}.weight": name for name in sgd_stepped(self.layers, self.optimizer.optimizer,
                                                                       self.params)}

    def keep(self, index: Sequence[int]) -> None:
        super().keep(index)
        self._choose_stepped()

    def _batched_logits(self, params: Stacked, buffers: Stacked, x: Tensor, training: bool) -> Tensor:
        """(K, B, classes) logits of the K models on their inputs ``x`` (K, B, ...)."""
        everything = {**params, **buffers}
        if self.vit is not None:
            return self.vit(everything, x, training)
        k = x.shape[0]
        for name, _module, layer in self.layers:
            x = layer(x, _local(everything, name), k, training)
        return _to_rows(x, k)

    def _shared_logits(self, params: Stacked, buffers: Stacked, segments: Sequence[tuple[int, int, Tensor]]) -> Tensor:
        """(K, B, classes) logits in eval mode, contiguous, of the K models where models a … b − 1 of
        each segment (a, b, x) share one input x (B, ...); the segments run from model 0 to K − 1
        in order, as :meth:`_segments` gives them. The first layers run on each segment's input by
        :func:`_shared_input` while they have a shared form, then all the models' activations as
        one (K, B, ...) batch (the input itself repeated per model where the first layer has no
        such form)."""
        everything = {**params, **buffers}
        pieces = [x for _a, _b, x in segments]
        if self.vit is not None:  # its first layer takes the input repeated per model
            return self.vit(everything, _repeated(segments, pieces), False).contiguous()
        k, layers = segments[-1][1], iter(self.layers)
        for name, module, layer in layers:
            state = _local(everything, name)
            done = [_shared_input(x, module, {n: t[a:b] for n, t in state.items()}, b - a)
                    for (a, b, _x), x in zip(segments, pieces)]
            if done[0] is None:  # no shared form: this layer on the input repeated per model
                x = layer(_repeated(segments, pieces), state, k, False)
                break
            pieces = [out for out, _shared in done]
            if not done[0][1]:  # no longer one input per segment: all the models as one batch
                # (the models lie along rows' first dimension (K, B, F), a CNN's channels (B, K·C, H, W))
                x = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0 if pieces[0].dim() == 3 else 1)
                break
        for name, _module, layer in layers:
            x = layer(x, _local(everything, name), k, False)
        # (contiguous: the evaluation's argmax over classes is several times slower on a transposed view)
        return _to_rows(x, k).contiguous()

    def step(self, batches: Tensor) -> Tensor:
        """:meth:`StackedEnsemble.step`; the weights of :func:`sgd_stepped`'s layers whose step
        is one product at this batch size (``stacked_matmul.fuses_step``: at most 32 samples on
        oneDNN, 64 on MKL, a product of at least ``stacked_matmul.ONEDNN_MIN_FLOPS``) are stepped
        by their layers' backward, the other parameters by the optimiser. Each layer's −η is a leaf
        whose (zero) gradient is asked for, so that autograd runs every stepped backward, and raises
        if a layer left its step unused. A backward that raises may have stepped some weights and
        not the rest: the ensemble then refuses to go on."""
        if self.half_stepped:
            raise RuntimeError("an earlier step raised in its backward after stepping some weights and not the "
                               "others: this ensemble cannot be trained on")
        xs, ys = self._gather(batches)
        stepped = {weight: layer for weight, layer in self.stepped.items()
                   if stacked_matmul.fuses_step(self.params[weight], batches.shape[1])}
        leaves = {name: p.detach() if name in stepped else p.detach().requires_grad_()
                  for name, p in self.params.items()}
        steps = {f"{layer}.{SGD_STEP}": self.optimizer.sgd_neg_lr(self.params[weight]).detach().requires_grad_()
                 for weight, layer in stepped.items()}
        logits = self._batched_logits(leaves, {**self.buffers, **steps}, xs, True)
        k, b, classes = logits.shape
        losses = F.cross_entropy(logits.reshape(k * b, classes), ys.reshape(-1), reduction="none").view(k, b).mean(1)
        names = [name for name in self.params if name not in stepped]
        try:
            grads = torch.autograd.grad(losses.sum(), [leaves[name] for name in names] + list(steps.values()))
        except BaseException:
            self.half_stepped = bool(stepped)
            raise
        self.optimizer.step({name: self.params[name] for name in names}, dict(zip(names, grads[:len(names)])))
        return losses.detach()

    @torch.no_grad()
    def evaluate(self) -> list[dict]:
        """As :meth:`StackedEnsemble.evaluate` (the same chunks of each split), with all the
        models in one pass per chunk where their validation splits differ but have one size: model
        k's chunk is its own split's samples, the first layers run on each split's chunk once for
        all its models (:meth:`_shared_logits`)."""
        segments = self._segments(self.val_splits)
        sizes = {len(y) for _a, _b, (_x, y) in segments}
        if len(segments) == 1 or len(sizes) > 1:
            return super().evaluate()
        n = sizes.pop()
        if n == 0:
            raise ValueError("evaluate needs at least one sample, got an empty split")
        loss_sum = torch.zeros(len(self), dtype=torch.float64)
        correct = torch.zeros(len(self), dtype=torch.long)
        for start in range(0, n, self.eval_chunk):
            chunks = [(a, b, x[start : start + self.eval_chunk]) for a, b, (x, _y) in segments]
            ys = torch.cat([y[start : start + self.eval_chunk].expand(b - a, -1) for a, b, (_x, y) in segments])
            logits = self._shared_logits(self.params, self.buffers, chunks)
            loss_sum += _loss_sums(logits, ys).double().cpu()
            correct += (logits.argmax(dim=2) == ys).sum(1).cpu()
        return [{"loss": float(s) / n, "accuracy": int(c) / n} for s, c in zip(loss_sum, correct)]

    def _eval_logits(self, params: Stacked, buffers: Stacked, chunk: Tensor, k: int) -> Tensor:
        return self._shared_logits(params, buffers, [(0, k, chunk)])


def _repeated(segments: Sequence[tuple[int, int, Tensor]], inputs: Sequence[Tensor]) -> Tensor:
    """Each segment's input (B, ...) repeated for its models a … b − 1, as one (K, B, ...) batch
    (of one segment: a view, not a copy)."""
    if len(segments) == 1:
        (a, b, _x), x = segments[0], inputs[0]
        return x.expand(b - a, *x.shape)
    return torch.cat([x.expand(b - a, *x.shape) for (a, b, _x), x in zip(segments, inputs)])


def _loss_sums(logits: Tensor, y: Tensor) -> Tensor:
    """Per model (K), the summed cross-entropy of its logits (K, C, classes) against labels y,
    (C,) shared or (K, C) its own."""
    k, c, classes = logits.shape
    losses = F.cross_entropy(logits.reshape(k * c, classes), y.expand(k, c).reshape(-1), reduction="none")
    return losses.view(k, c).sum(1)


#: The layer types :func:`batched_layers` takes (some only in the settings it checks).
LAYER_NAMES = ("Linear", "AffineLike", "NormLike", "Tanh", "ReLU", "GELU", "Identity", "Flatten", "BatchNorm1d",
               "BatchNorm2d", "LayerNorm", "RMSNorm", "Conv2d", "PatchNormConv2d", "MaxPool2d", "AdaptiveAvgPool2d")

"""K models of one architecture trained as one: stacked parameters, one vmapped step for all.

This is the general stacked engine, the fallback: a model with a batched form (every built-in
method: the MLPs, CNNs and the vit methods' vision transformer) trains on
:class:`~affdiv.experiments.runs.batched.BatchedEnsemble`
instead, a subclass that replaces the vmapped step and forward by batched layers (one autograd
graph, no ``torch.func``) and keeps everything else here. Both engines compute each model's own
formulas; float64 numbers agree within the tests' bound, and float32 numbers of runs trained on the
batched engine may differ from the vmapped engine's at rounding level (the kernels sum in other
orders), as they may from one model trained alone.

``torch.func.stack_module_state`` stacks the K models' parameters and buffers along a new dim 0;
one step of all of them is

    (g_k, L_k)_k = vmap(grad_and_value(L))(θ, β, X, Y),   L(θ_k, β_k, X_k, Y_k) = CE(f(X_k; θ_k, β_k), Y_k)

with f the architecture run by ``functional_call`` on a parameter-less copy of the model (on the
meta device), X_k, Y_k model k's own batch (it gathers its own indices from its own split), and
β_k its buffers: BatchNorm's running statistics are updated in place per model inside the vmap,
and the evaluation runs f in eval mode on them, as each model alone would. The K small GEMMs
(convolutions) of every layer become one batched GEMM (a grouped convolution). The optimiser
step is :class:`~affdiv.experiments.runs.optimizers.StackedOptimizer`: an lr (momentum) per model.

Every operation is per model, so model k's numbers equal those of the same model trained alone
up to the order of summation inside the batched kernels (see the tests for the bound). Whether
they also depend on which other models share the stack is up to those kernels, which may pick
their blocking by the total size: the CNN methods' grouped convolutions pick theirs by the total
channel count, so a model's float32 numbers can change at rounding level with its ensemble's size,
and so can affine_like's at width 128 (docs/results/fashion-target-noise/README.md). The batched
engine's products also change library with the stack's size: under
:data:`~affdiv.experiments.runs.stacked_matmul.ONEDNN_MIN_FLOPS` (which counts all the stacked
models) they run on torch's ops, above it on oneDNN's, which round differently, except on an
Intel processor with MKL, where they are torch's at every size
(:data:`~affdiv.experiments.runs.stacked_matmul.ONEDNN_PREFERRED`); and with plain
SGD in float32 an MLP's dense weights take their update inside the backward, as one product
rounded otherwise than the optimiser's update, only while the stack's parameters fit
:data:`~affdiv.experiments.runs.batched.SGD_STEP_MAX_BYTES` (on MKL ``MKL_SGD_STEP_MAX_BYTES``), the
batch has at most 32 samples (on MKL 64) and
the layer's product is at least that line and one the fused step may take
(``stacked_matmul.fuses_step``). In the tests (digits, width 16)
affine_like's do not change, bit for bit.

Measurements (:class:`~affdiv.experiments.runs.training.Measurement`) look at one model at a
time: :meth:`StackedEnsemble.copy` materialises model k as a plain module (a copy of the base
model loaded with its slices of the stacked parameters and buffers), which the callback may
change at will.

:func:`stack_failure` tries one stacked step and one evaluation on two throw-away models; a
model that ``torch.func`` cannot run this way is then trained one at a time (the caller logs it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad_and_value, stack_module_state, vmap

from affdiv.experiments.runs.optimizers import StackedOptimizer

#: Validation samples per evaluation pass at most, and the most elements a model's largest layer
#: output may have in one pass (fewer samples for wide convolutional layers), on a CPU and on
#: other devices. On a CPU a stacked pass's pooling and activations are bound by memory traffic,
#: and smaller chunks measured faster: fashion-cnn's network, 8 models stacked, 3,000 samples,
#: one thread, took 0.51-0.57 s in chunks of 32-128 samples, 0.79 s of 256 and 1.19 s of 668 (the
#: chunk at 2^22; at 2^20 it is 167, between the fast ones and 256). The chunks depend on the
#: architecture and device only, never on how many models are stacked.
EVAL_CHUNK = 1024
EVAL_ELEMENTS = {"cpu": 2**20, "other": 2**22}


@torch.no_grad()
def layer_outputs(model: torch.nn.Module, input_shape: Sequence[int]) -> list[int]:
    """The per-sample output size of every leaf module of ``model``: a forward of one zero sample
    in eval mode (which leaves BatchNorm's statistics alone)."""
    param = next(iter(model.parameters()))
    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: sizes.append(out.numel()))
             for m in model.modules() if not list(m.children())]
    training = model.training
    model.eval()(torch.zeros((1, *input_shape), device=param.device, dtype=param.dtype))
    model.train(training)
    for hook in hooks:
        hook.remove()
    return sizes


def eval_chunk(outputs: Sequence[int], device: torch.device | str) -> int:
    """Samples per evaluation pass on ``device`` for a model with per-sample layer outputs ``outputs``."""
    elements = EVAL_ELEMENTS["cpu" if torch.device(device).type == "cpu" else "other"]
    return max(1, min(EVAL_CHUNK, elements // max(outputs)))


def _gather_rows(t: Tensor, index: Tensor) -> Tensor:
    """t[index] for a 2-D ``index`` of non-negative row numbers: (*index.shape, *t.shape[1:]), by
    ``index_select`` (a row copy each, faster than advanced indexing)."""
    return t.index_select(0, index.reshape(-1)).view(*index.shape, *t.shape[1:])


class StackedEnsemble:
    """K models (built by the caller, same architecture and dtype) trained in lockstep.

    ``train[k]`` and ``val[k]`` are model k's (x, y) tensors; models that share a split share the
    tensor objects, and such models must be contiguous (they are gathered in one indexing op).
    """

    def __init__(self, models: Sequence[torch.nn.Module], optimizer: str, lrs: Sequence[float],
                 momenta: Sequence[float | None], train: Sequence[tuple[Tensor, Tensor]],
                 val: Sequence[tuple[Tensor, Tensor]]):
        self.base = copy.deepcopy(models[0]).to("meta")
        params, buffers = stack_module_state(list(models))
        self.params = {name: p.detach() for name, p in params.items()}
        self.buffers = buffers
        self.optimizer = StackedOptimizer(optimizer, self.params, lrs, momenta)
        self.train_splits, self.val_splits = list(train), list(val)
        self.eval_chunk = eval_chunk(layer_outputs(models[0], train[0][0].shape[1:]), train[0][0].device)
        self._grad = vmap(grad_and_value(self._loss), randomness="error")
        self._forward = vmap(self._logits, randomness="error")
        self._loss_sum = vmap(lambda logits, y: F.cross_entropy(logits, y, reduction="sum"), in_dims=(0, None))

    def _logits(self, params, buffers, x: Tensor) -> Tensor:
        return functional_call(self.base, (params, buffers), (x,))

    def _loss(self, params, buffers, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self._logits(params, buffers, x), y)

    def __len__(self) -> int:
        return len(self.train_splits)

    def _segments(self, splits) -> list[tuple[int, int, tuple[Tensor, Tensor]]]:
        """(start, stop, split) for each run of consecutive models on the same split (the same
        tensor objects; the (x, y) tuples themselves may be distinct)."""
        out: list = []
        for k, split in enumerate(splits):
            if out and all(a is b for a, b in zip(out[-1][2], split)):
                out[-1][1] = k + 1
            else:
                out.append([k, k + 1, split])
        return [tuple(s) for s in out]

    def _gather(self, batches: Tensor) -> tuple[Tensor, Tensor]:
        """Each model's batch (inputs (K, B, ...), labels (K, B)) from its training split."""
        segments = self._segments(self.train_splits)
        if len(segments) == 1:
            x, y = segments[0][2]
            return _gather_rows(x, batches), _gather_rows(y, batches)
        return (torch.cat([_gather_rows(x, batches[a:b]) for a, b, (x, _y) in segments]),
                torch.cat([_gather_rows(y, batches[a:b]) for a, b, (_x, y) in segments]))

    def step(self, batches: Tensor) -> Tensor:
        """One optimiser step of every model on its batch (``batches`` (K, B) sample indices into
        its training split); returns the K mean cross-entropies before the step (detached)."""
        xs, ys = self._gather(batches)
        grads, losses = self._grad(self.params, self.buffers, xs, ys)
        self.optimizer.step(self.params, grads)
        return losses.detach()

    @torch.no_grad()
    def evaluate(self) -> list[dict]:
        """Each model's mean cross-entropy and accuracy on its validation split, in eval mode
        (BatchNorm on its own running statistics); per-chunk sums as in ``training.evaluate``."""
        self.base.eval()
        loss_sum = torch.zeros(len(self), dtype=torch.float64)
        correct = torch.zeros(len(self), dtype=torch.long)
        sizes = [0] * len(self)
        for a, b, (x, y) in self._segments(self.val_splits):
            if len(y) == 0:
                raise ValueError("evaluate needs at least one sample, got an empty split")
            params = {name: p[a:b] for name, p in self.params.items()}
            buffers = {name: t[a:b] for name, t in self.buffers.items()}
            for start in range(0, len(y), self.eval_chunk):
                chunk, target = x[start : start + self.eval_chunk], y[start : start + self.eval_chunk]
                logits = self._eval_logits(params, buffers, chunk, b - a)
                loss_sum[a:b] += self._loss_sum(logits, target).double().cpu()
                correct[a:b] += (logits.argmax(dim=2) == target).sum(1).cpu()
            sizes[a:b] = [len(y)] * (b - a)
        self.base.train()
        return [{"loss": float(s) / n, "accuracy": int(c) / n} for s, c, n in zip(loss_sum, correct, sizes)]

    def _eval_logits(self, params, buffers, chunk: Tensor, k: int) -> Tensor:
        """(k, C, classes) logits of the k models with stacked ``params``, ``buffers`` on one chunk
        (C, ...) of samples, in eval mode."""
        return self._forward(params, buffers, chunk.expand(k, *chunk.shape))

    def model(self, k: int) -> torch.nn.Module:
        """Model k as a plain module (a copy of its parameters and buffers now), in train mode."""
        device = next(iter(self.params.values())).device
        module = copy.deepcopy(self.base).to_empty(device=device)
        state = {name: t[k] for name, t in (*self.params.items(), *self.buffers.items())}
        module.load_state_dict(state)
        return module.train()

    def copy(self, k: int) -> torch.nn.Module:
        """Model k as a new module: :meth:`model` (which copies the state, never aliases it)."""
        return self.model(k)

    @torch.no_grad()
    def finite(self) -> Tensor:
        """Per model (bool, K): whether all its parameters and buffers are finite."""
        stacked = (*self.params.values(), *self.buffers.values())
        return torch.stack([t.reshape(len(t), -1).isfinite().all(1) for t in stacked]).all(0)

    def keep(self, index: Sequence[int]) -> None:
        """Go on with the models at ``index`` only (in that order); the others stop here."""
        device = next(iter(self.params.values())).device
        picked = torch.tensor(list(index), dtype=torch.long, device=device)
        self.params = {name: p.index_select(0, picked) for name, p in self.params.items()}
        self.buffers = {name: t.index_select(0, picked) for name, t in self.buffers.items()}
        self.optimizer.keep(picked)
        self.train_splits = [self.train_splits[i] for i in index]
        self.val_splits = [self.val_splits[i] for i in index]


def stack_failure(build, optimizer: str, sample: tuple[Tensor, Tensor], engine: type | None = None) -> str | None:
    """None if two models from ``build()`` train stacked by ``engine`` (default: this module's
    :class:`StackedEnsemble`; one step and one evaluation on the samples ``sample``), else why not
    ("<error type>: <message>")."""
    models = [build(), build()]
    x, y = sample
    try:
        ensemble = (engine or StackedEnsemble)(models, optimizer, [1e-3, 1e-3], [0.0, 0.0], [(x, y)] * 2,
                                               [(x, y)] * 2)
        ensemble.step(torch.arange(len(y), device=y.device).expand(2, -1))
        ensemble.evaluate()
    except Exception as error:  # any failure means: train these models one at a time
        return f"{type(error).__name__}: {error}"
    return None

"""The training roofline: stacked training against one model at a time and against the arithmetic floor.

    python benchmarks/stacked_training.py [--threads 2] [--rounds 3] [--seconds 1.5] [--json PATH]
                                          [--arms mlp cnn vit ...] [--batch-sizes B ...] [--members K ...]
                                          [--split K ...] [--vmap] [--plain] [--compiled]

A *cell* is a batch size of a Fashion-MNIST study with 8 seeds × 6 learning rates = 48 models: the
MLP arm (784-256-256-256-10, tanh) and the CNN arm (3 blocks of 32 channels, relu), each at B = 16,
64, 256, 1024 by default, and on request (``--arms``) an arm per vit method (width 32, depth 1,
gelu) at B = 16, 64, 256 and the CNN arm with PatchNorm convolutions ("patchnorm") or with a
BatchNorm2d after each convolution ("conv+batchnorm") (an arm is a name → RunConfig settings and
batch sizes in ``ARMS``: another architecture is one more entry). The variants are the harness's own
engines (``training.OneAtATime``; the stacked engine ``training.stacked_engine`` picks for the arm,
named in the table; ``--vmap`` also times ``stacked.StackedEnsemble``, the vmapped fallback;
``--plain`` times the stacked engine again inside ``affdiv.layers._fused.disabled()`` and
``affdiv.layers._native.disabled()``, without the compiled passes (on the CNN arms without the fused
blocks described below) and with torch's products instead of oneDNN's (on an Intel processor with
MKL, where the engine's products are torch's already, it differs by the passes only); ``--compiled``
times it with its batched forward compiled by ``torch.compile`` (inductor; autograd then runs the
compiled backward, and the optimiser makes every update, as a compiled backward cannot make the
dense layers' SGD step in place; the compilation, in an untimed first step, is not counted)) taking SGD
steps on real batches (each model its own shuffle), so a model-step costs what it costs in a sweep;
whole runs differ only by their evaluations (a few per run). The stacked ensemble holds as many of
the cell's models as fit the default ensemble memory (``ensembles.member_bytes``), at most 48; one
at a time is timed on 8 models (its cost per model-step does not depend on how many there are); its
step is the bare loop (forward, ``zero_grad``, ``backward``, ``torch.optim`` step, the loss kept),
its products torch's (``nn.Linear``), so where the stacked engine multiplies on oneDNN the speed-up
holds that change of library too (``--plain`` times the stacked engine on torch's products).
``--members K ...`` times K stacked models instead, a row per K (how the gain grows with K).
``--split K ...`` also times the same stacked models as ⌈models/K⌉ stacks of nearly equal size (at
most K models each), trained one after the other for the same steps, as a sweep's worker trains the
ensembles that a smaller ``--ensemble-memory`` makes (whose plan also cuts balanced pieces, of
whole runs), in the same rounds; the row's ``split`` has, for each K below its stacked models
(``split_left_out``: the others; two K that cut the same stacks are each measured), the stacks'
sizes, the time per model-step, the median over rounds of the paired ratio one stack ÷ the smaller
stacks (above 1: the smaller stacks ran faster) and the time over the floor. A smaller stack pays
its step's fixed cost (Python, dispatch) over fewer models, and may keep its parameters and
activations in caches that the whole stack's overflow. Each round times one measurement of each
variant (a fixed number of steps, about ``--seconds`` long), rounds interleaved so that the
machine's drifts hit all, in reversed order every other round (so that no variant always runs after
the same one; an even ``--rounds`` runs both orders equally); the speed-up is the median over
rounds of the paired ratio (one-at-a-time / stacked time per model-step) = the ratio of runs per
hour.
Speed-up targets: ≥ 5× at B ≤ 64, ≥ 2× at B = 128–256, ≥ 1× everywhere. The process keeps freed
memory for reuse as the sweep's workers do (``sweep.keep_freed_memory``), for both variants.

The floor: the arithmetic of a stacked step (K × the FLOPs of one model's step, counted by
``torch.utils.flop_counter`` on forward + backward), its matrix products at the machine's GEMM rate
(square matrices with the same FLOPs multiplied by ``torch.mm``, torch's BLAS, and by oneDNN's
matmul as the stacked engine calls it, the faster of the two in each round; the table prints both
rates and names the faster: where torch's BLAS does not use the processor's widest vectors, as MKL
on an AMD processor with AVX-512, oneDNN runs up to twice as fast) and its convolutions at the machine's
convolution rate (forward + both backward passes of the arm's widest convolution, one model at batch
256, the faster of the two memory orders), both measured in every round; printed as the median over
rounds of stacked time / floor time (1 would be every FLOP at the rate of one large GEMM or
convolution; above it: memory traffic, small-GEMM inefficiency, elementwise work and Python/dispatch
overhead). Target: ≤ 1.5.

The memory floor: any SGD step reads each parameter in the forward and reads and writes it in the
update, three passes over the stack's parameters (the least traffic of a step: the input gradients
read the weights again, an update outside the backward writes and reads the gradient, and the
activations move too), each at the rate of such a pass over a buffer of the parameters' size on
the run's threads (``memory_timers``: a sum reads it, an in-place add reads and writes it), the
best rate of the run's rounds, so that a round slowed by the host does not raise it. The *roof* is
the larger of the two floors in each round, as in a roofline model (Williams, Waterman and
Patterson, CACM 2009), which bounds a step by its arithmetic or its memory traffic, whichever takes
longer: printed as stacked / roof, with its target met (``roof_met``) at ≤ 1.5 as the floor's.

The step's kernels: the matrix products and convolutions one stacked step ran, as it ran them
(every op that ``torch.utils.flop_counter`` counts and its in-place form, such as the fused SGD
step's ``baddbmm_`` on MKL, recorded with its shapes, strides and arguments by a dispatch mode that
only observes, so that the step takes its own paths under it, and the package's passes that hold
products, which no dispatch mode sees and which are recorded by name: oneDNN's matmul, the fused
attention, the CNN's fused first block with its pool (``PACKAGE_PRODUCTS``)), replayed on random
tensors of the same layouts, which share storage where the step's did (``_like``), and timed in
every round: "kernels ms" per model-step. stacked / kernels is what the step spends outside those
kernels (elementwise work, the optimiser's update, memory traffic between them, Python and
dispatch); kernels / floor is the rate of the kernels at the step's own shapes against the large
GEMM's and convolution's. The replay runs the kernels back to back, without the step's work
between them, so it may run them faster or slower than the step does: where the MLPs' dense layers
make their SGD step in the backward (``batched.sgd_stepped``) the update is part of a product, and
so of the kernels, and stacked / kernels has read below 1 (0.79, the MLP at B = 16 on an Intel
processor's one core).

Checks: ``--checks B ...`` also trains, stacked, one steps-to-target ensemble per batch size B as
the fashion-ladder preset runs it (an affine MLP of width 128, one seed, its tuned grid with
extensions, the ladder's targets, geometric reads at ``--read-spacing``, default 0.05) and prints
the share of its training time spent in checks (``RunResult.check_seconds`` over ``seconds``).
Target: ≤ 10%. It also prints what a read costs in training steps of the run (its seconds per
read over its seconds per model-step; the run's other seconds include its test pass and, with
sparse reads, the stretches trained again, so the figure reads low there) and so how many reads
per candidate the target affords. For comparison: putting each of a ladder's T crossings between
two reads of its own, r·s apart, takes T + 1 reads where the crossings are known in advance, and
reads spaced by r from the start take about log(S)/log(1 + r).
``--sparse-spacing R ...`` trains the same run again with adaptive reads for each R (dense at
``--read-spacing``) and prints their check shares and, per target, the relative difference of
their steps to it from those of the geometric reads.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs.config import VIT_METHODS, RunConfig
from affdiv.experiments.runs.ensembles import member_bytes
from affdiv.experiments.runs.options import DEFAULT_ENSEMBLE_MEMORY
from affdiv.experiments.runs.stacked import StackedEnsemble
from affdiv.experiments.runs.sweep import keep_freed_memory
from affdiv.experiments.runs.training import OneAtATime, build_member, stacked_engine
from affdiv.layers import _fused, _native
from affdiv.provenance import provenance

CELL = 48  # 8 seeds × 6 learning rates
ONE_AT_A_TIME_MODELS = 8
LRS = (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4)
BATCH_SIZES = (16, 64, 256, 1024)
#: arm -> (RunConfig settings, default batch sizes). A new architecture is one more entry here.
ARMS = {
    "mlp": (dict(method="affine", depth=3, width=256, activation="tanh"), BATCH_SIZES),
    # the MLP's corrected layers, on request
    **{f"mlp-{method}": (dict(method=method, depth=3, width=256, activation="tanh"), BATCH_SIZES)
       for method in ("affine_like", "norm_l2")},
    "cnn": (dict(method="conv", depth=3, width=32, activation="relu"), BATCH_SIZES),
    **{method: (dict(method=method, depth=3, width=32, activation="relu"), BATCH_SIZES)  # on request
       for method in ("patchnorm", "conv+batchnorm")},
    # the transformer arm: an arm per vit method (16 patch tokens, 4 heads), on request
    **{method: (dict(method=method, depth=1, width=32, activation="gelu"), (16, 64, 256)) for method in VIT_METHODS},
}
DEFAULT_ARMS = ("mlp", "cnn")
SPEEDUP_TARGETS = {16: 5.0, 64: 5.0, 128: 2.0, 256: 2.0, 1024: 1.0}  # other batch sizes: never slower
FLOOR_TARGET = 1.5
WARM_UP = 3  # untimed steps of each variant before the rounds
#: The ops whose FLOPs count as convolutions (the rest are matrix products).
CONV_OPS = ("convolution", "convolution_backward")


def cell_models(config, data) -> int:
    """How many of a cell's models one stacked ensemble holds: as many as fit the default ensemble
    memory (``ensembles.member_bytes``), at least 1 and at most the cell's 48."""
    return max(1, min(CELL, DEFAULT_ENSEMBLE_MEMORY // member_bytes(config, data.input_shape, data.num_classes)))


def _engine(kind, config, data, models: int, first: int = 0):
    """``models`` of the cell's 48 (seed, lr) models from number ``first`` as an engine, and their
    shuffles."""
    members = [(seed, lr) for seed in range(CELL // len(LRS)) for lr in LRS][first : first + models]
    nets = [build_member(config, data, seed) for seed, _lr in members]
    split = (data.train.x, data.train.y)
    engine = kind(nets, "sgd", [lr for _s, lr in members], [None] * models, [split] * models, [split] * models)
    orders = torch.stack([torch.randperm(len(data.train.y), generator=torch.Generator().manual_seed(seed))
                          for seed, _lr in members])
    return engine, orders


def _time_steps(engine, orders, batch: int, steps: int, start: int) -> float:
    """Seconds for ``steps`` steps from batch number ``start`` of each model's permutation."""
    per_epoch = orders.shape[1] // batch
    begin = time.perf_counter()
    for i in range(start, start + steps):
        j = i % per_epoch
        engine.step(orders[:, j * batch : (j + 1) * batch])
    return time.perf_counter() - begin


def _stacks(kind, config, data, models: int, size: int) -> list[tuple]:
    """The first ``models`` of the cell's models as n = ⌈models/size⌉ consecutive engines of nearly
    equal size (the first (models mod n) engines hold one model more), each with its shuffles: a
    sweep's ensembles of at most ``size`` models."""
    count = -(-models // size)
    sizes = [models // count + (1 if i < models % count else 0) for i in range(count)]
    return [_engine(kind, config, data, n, sum(sizes[:i])) for i, n in enumerate(sizes)]


def _time_stacks(stacks: list[tuple], batch: int, steps: int, start: int) -> float:
    """Seconds for ``steps`` steps of each of ``stacks``' engines, one engine's steps after the
    other's (as a sweep's worker trains its ensembles)."""
    return sum(_time_steps(engine, orders, batch, steps, start) for engine, orders in stacks)


def _step_flops(config, data) -> dict[str, int]:
    """FLOPs of one SGD step (forward + backward) of one model at the config's batch size:
    {"gemm": matrix products, "conv": convolutions}."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_member(config, data, 0)
    x, y = data.train.x[: config.batch_size], data.train.y[: config.batch_size]
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    by_op = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    conv = sum(n for op, n in by_op.items() if op in CONV_OPS)
    return {"gemm": counter.get_total_flops() - conv, "conv": conv}


#: The package's own passes that hold matrix products or convolutions: the stacked engine's calls of
#: oneDNN's matmul and its fused attention and first-block passes. No dispatch mode sees them, so
#: :func:`kernel_calls` records them by name.
PACKAGE_PRODUCTS = ((_native, "onednn_bmm_"), (_fused, "attention_scores"), (_fused, "attention_probabilities"),
                    (_fused, "attention_values"), (_fused, "attention_backward"), (_fused, "conv_pool"),
                    (_fused, "conv_pool_backward"))


def kernel_calls(engine, orders, batch: int) -> list[tuple]:
    """The matrix products and convolutions of one step of ``engine``, as the step ran them, each
    (function, args, kwargs) over tensors laid out as the step's (:func:`_like`): the ops that
    ``torch.utils.flop_counter`` counts and their in-place forms in torch's ``aten`` (the fused SGD
    step's ``baddbmm_`` on MKL, which it does not count), and the package's passes in
    ``PACKAGE_PRODUCTS``, recorded during one step from batch number 0. The recording mode only
    observes (``affdiv_observes_only``), so the step takes the paths it takes unrecorded."""
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import flop_registry

    in_place = (getattr(torch.ops.aten, f"{packet.__name__}_", None) for packet in flop_registry)
    counted = set(flop_registry) | {packet for packet in in_place if packet is not None}
    calls, storages = [], {}

    def like(value):
        return _like(value, storages)

    def recorded(function):
        def call(*args, **kwargs):
            calls.append((function, *tree_map(like, (args, kwargs))))
            return function(*args, **kwargs)

        return call

    class Record(TorchDispatchMode):
        affdiv_observes_only = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket in counted:
                calls.append((func, *tree_map(like, (args, kwargs))))
            return func(*args, **kwargs)

    _native.onednn_enabled()  # (its first call runs oneDNN's self-test, whose products are no step's)
    with contextlib.ExitStack() as stack:
        for module, name in PACKAGE_PRODUCTS:
            stack.enter_context(mock.patch.object(module, name, recorded(getattr(module, name))))
        stack.enter_context(Record())
        engine.step(orders[:, :batch])
    return calls


def replay(calls: list[tuple]) -> None:
    """Run the calls of :func:`kernel_calls` once more."""
    for func, args, kwargs in calls:
        func(*args, **kwargs)


def _like(value, storages: dict):
    """``value`` laid out again for the replay, over memory the step does not own: a tensor of its
    shape, strides and dtype; ``value`` itself if it is no tensor. A floating-point tensor holds
    random numbers at its storage offset, and the floating-point tensors that were views of one
    storage in the step (a weight that the forward, its input's gradient and the fused SGD step
    each read) are views of one random storage of that storage's whole size (``storages``, keyed
    by its address, size and dtype), so that the replay reads memory as the step did (a view of a
    large storage costs the whole storage). An integer tensor (indices, such as a pool's argmax,
    which a pass follows) holds a copy of the stretch of storage it reads, taken at each call: an
    address the step freed may hold other indices later."""
    if not isinstance(value, torch.Tensor):
        return value
    if not value.is_floating_point():
        extent = 1 + sum((n - 1) * s for n, s in zip(value.shape, value.stride()) if n > 0) if value.numel() else 0
        return value.as_strided((extent,), (1,)).clone().as_strided(value.shape, value.stride())
    storage = value.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes(), value.dtype)
    if key not in storages:
        whole = torch.empty(0, dtype=value.dtype, device=value.device).set_(
            storage, 0, (storage.nbytes() // value.element_size(),), (1,))
        storages[key] = torch.randn_like(whole)
    return storages[key].as_strided(value.shape, value.stride(), value.storage_offset())


def _median_seconds(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def gemm_timers(flops: int) -> dict:
    """Products of square float32 matrices with about ``flops`` FLOPs, by library: "BLAS"
    (``torch.mm``, torch's BLAS) and, where the package bound it, "oneDNN" (oneDNN's matmul as the
    stacked engine calls it, ``affdiv.layers._native.onednn_bmm_``); each (function, its FLOPs). The
    floor takes the faster in each round: where the BLAS does not use the processor's widest vectors
    (MKL on an AMD processor with AVX-512) the two differ up to 2×."""
    n = max(16, round((max(flops, 1) / 2) ** (1 / 3)))
    a, b = torch.randn(1, n, n), torch.randn(1, n, n)
    out = torch.empty(1, n, n)
    products = {"BLAS": (lambda: torch.mm(a[0], b[0], out=out[0]), 2 * n**3)}
    if _native.onednn_enabled():
        products["oneDNN"] = (lambda: _native.onednn_bmm_(out, a, b), 2 * n**3)
    return products


def memory_timers(nbytes: int) -> dict:
    """The memory floor's passes over a float32 buffer of about ``nbytes``, each (function, the
    bytes it moves): "read", a sum of it (the forward's read of the parameters), and "update", an
    in-place add to it (the update's read and write)."""
    buffer = torch.randn(max(1, nbytes // 4))
    size = buffer.numel() * buffer.element_size()
    return {"read": (buffer.sum, size), "update": (lambda: buffer.add_(0.5), 2 * size)}


def conv_timer(config, data):
    """(forward + input and weight gradients of the model's widest convolution (most FLOPs per
    sample; a PatchNormConv2d's as an nn.Conv2d of its geometry: the machine's convolution rate),
    one model at batch 256, in the faster of NCHW and channels-last memory order; its FLOPs), or
    None for a model without a convolution."""
    from torch.utils.flop_counter import FlopCounterMode

    from affdiv.layers import PatchNormConv2d

    model = build_member(config, data, 0)
    shapes: list = []
    hooks = [m.register_forward_hook(lambda m, i, _o: shapes.append((m, i[0].shape[1:])))
             for m in model.modules() if isinstance(m, (torch.nn.Conv2d, PatchNormConv2d))]
    with torch.no_grad():
        model(data.train.x[:1])
    for hook in hooks:
        hook.remove()
    if not shapes:
        return None
    widest, shape = max(shapes, key=lambda s: s[0].weight.numel() * s[1][1] * s[1][2])
    conv = torch.nn.Conv2d(widest.in_channels, widest.out_channels, widest.kernel_size, widest.stride, widest.padding,
                           widest.dilation, widest.groups, bias=widest.bias is not None)
    steps = []
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(256, *shape).contiguous(memory_format=layout).requires_grad_()

        def step(x=x):
            out = conv(x)
            out.backward(torch.ones_like(out))  # (the gradients accumulate: the same work every call)

        steps.append(step)
    fastest = min(steps, key=_median_seconds)
    with FlopCounterMode(display=False) as counter:
        fastest()
    return fastest, counter.get_total_flops()


@contextlib.contextmanager
def _variant_context(name: str):
    """The "plain" variant runs without the compiled passes and with torch's products (not
    oneDNN's); the others as they are."""
    if name != "plain":
        yield
        return
    with _fused.disabled(), _native.disabled():
        yield


def compile_forward(engine, backend="inductor") -> None:
    """``engine``'s batched forward replaced by its ``torch.compile`` (with ``backend``), which
    compiles it at the next step."""
    if not hasattr(engine, "_batched_logits"):
        raise ValueError(f"--compiled times the batched engine's forward; {type(engine).__name__} has none")
    torch._dynamo.reset()  # (one compiled forward per engine: the cache limit would cap the cells)
    engine.stepped = {}  # (every update by the optimiser: a compiled backward cannot make one in place)
    engine._batched_logits = torch.compile(engine._batched_logits, backend=backend, dynamic=False)


def _split_name(size: int) -> str:
    """The variant of the stacked models as stacks of at most ``size``."""
    return f"stacks of {size}"


def measure(arm: str, batch: int, data, rounds: int, seconds: float, members: int | None = None,
            vmap: bool = False, plain: bool = False, compiled: bool = False,
            stack_sizes: Sequence[int] = ()) -> dict:
    """One row: ``members`` stacked models (default: as many as fit the default ensemble memory,
    at most the cell's 48) against one at a time (and the vmapped engine if ``vmap``, the stacked
    engine without the compiled passes if ``plain``, with its forward compiled by torch.compile if
    ``compiled``, and the same models as stacks of at most K, trained one after the other, for each
    K in ``stack_sizes`` below the stacked models: the row's ``split``)."""
    if not all(size >= 1 for size in stack_sizes):
        raise ValueError(f"stack_sizes: each stack size must be >= 1, got {list(stack_sizes)}")
    settings, _sizes = ARMS[arm]
    config = RunConfig(dataset="fashion-mnist", batch_size=batch, seed=0, **settings)
    stacked_models = members or cell_models(config, data)
    probe = build_member(config, data, 0)
    sizes = sorted(set(stack_sizes))
    split, left_out = [k for k in sizes if k < stacked_models], [k for k in sizes if k >= stacked_models]
    # variant -> (engine class, models, models a stack)
    engine_kind = stacked_engine(probe)
    kinds = {"alone": (OneAtATime, ONE_AT_A_TIME_MODELS, ONE_AT_A_TIME_MODELS),
             "stacked": (engine_kind, stacked_models, stacked_models)}
    if vmap:
        kinds["vmap"] = (StackedEnsemble, stacked_models, stacked_models)
    if plain:
        kinds["plain"] = kinds["stacked"]
    if compiled:
        kinds["compiled"] = kinds["stacked"]
    for size in split:
        kinds[_split_name(size)] = (engine_kind, stacked_models, size)
    # variant -> ([(engine, its shuffles) for each stack], models)
    engines = {name: (_stacks(kind, config, data, k, size), k) for name, (kind, k, size) in kinds.items()}
    [(stacked, stacked_orders)] = engines["stacked"][0]
    if compiled:
        [(compiled_engine, _orders)] = engines["compiled"][0]
        compile_forward(compiled_engine)
        _time_stacks(engines["compiled"][0], batch, 1, 0)  # (the compilation: not timed)
    # Steps per measurement: about ``seconds`` of the slowest variant, from the last of WARM_UP
    # warm-up steps each, and at least 2 (the first steps of a large cell allocate and fault in
    # their memory: with a single warm-up step, rounds of one step at the vit's B = 256 read 1.6–2.5×
    # the later ones)
    warm = {}
    for name, (stacks, _k) in engines.items():
        with _variant_context(name):
            _time_stacks(stacks, batch, WARM_UP - 1, 0)
            warm[name] = _time_stacks(stacks, batch, 1, WARM_UP - 1)
    steps = max(2, round(seconds / max(warm.values())))
    flops = {kind: n * stacked_models for kind, n in _step_flops(config, data).items()}
    libraries = gemm_timers(flops["gemm"])
    parameter_bytes = stacked_models * sum(p.numel() * p.element_size() for p in probe.parameters())
    passes = memory_timers(parameter_bytes)
    timers = {**libraries, **({"conv": conv_timer(config, data)} if flops["conv"] else {}), **passes}
    calls = kernel_calls(stacked, stacked_orders, batch)
    per_model = {name: [] for name in engines}
    rates = {kind: [] for kind in timers}
    kernels = []
    for r in range(rounds):
        for name, (stacks, k) in list(engines.items())[:: 1 if r % 2 == 0 else -1]:
            with _variant_context(name):
                per_model[name].append(_time_stacks(stacks, batch, steps, WARM_UP + r * steps) / (steps * k))
        for kind, (fn, done) in timers.items():  # in every round too: the floor sees the machine's drifts
            rates[kind].append(done / _median_seconds(fn))
        kernels.append(_median_seconds(lambda: replay(calls)) / stacked_models)
    def paired(over: str, under: str) -> list[float]:  # each round's time of ``over`` / that of ``under``
        return [a / b for a, b in zip(per_model[over], per_model[under])]

    ratios = paired("alone", "stacked")
    gemm_rates = [max(rates[library][r] for library in libraries) for r in range(rounds)]
    floors = [flops["gemm"] / gemm_rates[r] + (flops["conv"] / rates["conv"][r] if "conv" in rates else 0.0)
              for r in range(rounds)]
    best = {name: max(rates[name]) for name in passes}  # (bytes a second)
    memory_floor = parameter_bytes / best["read"] + 2 * parameter_bytes / best["update"]
    roofs = [max(f, memory_floor) for f in floors]
    floor = statistics.median(floors)
    gemm = statistics.median(gemm_rates)
    conv = statistics.median(rates["conv"]) if "conv" in rates else None
    median = {name: statistics.median(times) for name, times in per_model.items()}
    over_floor = {name: statistics.median(t * stacked_models / f for t, f in zip(times, floors))
                  for name, times in per_model.items()}
    target = None if members else SPEEDUP_TARGETS.get(batch, 1.0)  # the targets are for the default ensembles
    row = {
        "arm": arm, "batch_size": batch, "engine": stacked.__class__.__name__,
        "stacked_models": stacked_models, "steps_per_round": steps, "rounds": rounds,
        "alone_ms_per_model_step": 1e3 * median["alone"],
        "stacked_ms_per_model_step": 1e3 * median["stacked"],
        "speedup": statistics.median(ratios), "speedup_rounds": ratios, "target": target,
        "met": None if target is None else statistics.median(ratios) >= target,
        "stacked_step_gflop": (flops["gemm"] + flops["conv"]) / 1e9, "conv_gflop": flops["conv"] / 1e9,
        "gemm_gflops_per_s": gemm / 1e9,
        "gemm_library": max(libraries, key=lambda library: statistics.median(rates[library])),
        **{f"{library.lower()}_gflops_per_s": statistics.median(rates[library]) / 1e9 for library in libraries},
        "conv_gflops_per_s": None if conv is None else conv / 1e9,
        "floor_ms_per_model_step": 1e3 * floor / stacked_models,
        "stacked_over_floor": over_floor["stacked"], "stacked_over_floor_rounds": [
            t * stacked_models / f for t, f in zip(per_model["stacked"], floors)],
        "alone_over_floor": over_floor["alone"],
        "floor_target": FLOOR_TARGET,
        "parameter_mib": parameter_bytes / 2**20,
        **{f"{name}_gib_per_s": rate / 2**30 for name, rate in best.items()},
        **{f"{name}_gib_per_s_rounds": [rate / 2**30 for rate in rates[name]] for name in passes},
        "memory_floor_ms_per_model_step": 1e3 * memory_floor / stacked_models,
        "stacked_over_roof": statistics.median(t * stacked_models / roof
                                               for t, roof in zip(per_model["stacked"], roofs)),
        "kernels_ms_per_model_step": 1e3 * statistics.median(kernels),
        "stacked_over_kernels": statistics.median(t / kt for t, kt in zip(per_model["stacked"], kernels)),
        "kernels_over_floor": statistics.median(kt * stacked_models / f for kt, f in zip(kernels, floors)),
    }
    row["floor_met"] = row["stacked_over_floor"] <= FLOOR_TARGET
    row["roof_met"] = row["stacked_over_roof"] <= FLOOR_TARGET
    if vmap:
        row["vmap_ms_per_model_step"] = 1e3 * median["vmap"]
        row["vmap_over_stacked"] = statistics.median(paired("vmap", "stacked"))
    for name in ("plain", "compiled"):
        if name in per_model:
            row[f"{name}_ms_per_model_step"] = 1e3 * median[name]
            row[f"{name}_over_stacked"] = statistics.median(paired(name, "stacked"))
            row[f"{name}_over_floor"] = over_floor[name]
    row["split"], row["split_left_out"] = [], left_out
    for size in split:
        name = _split_name(size)
        speedups = paired("stacked", name)  # > 1: the smaller stacks ran faster
        row["split"].append({"max_models_per_stack": size, "stack_sizes": [len(o) for _e, o in engines[name][0]],
                             "ms_per_model_step": 1e3 * median[name],
                             "speedup_over_stacked": statistics.median(speedups),
                             "speedup_over_stacked_rounds": speedups, "over_floor": over_floor[name]})
    return row


COLUMNS = (("arm", "4", "arm"), ("B", ">5", "batch_size"), ("engine", "16", "engine"), ("K", ">3", "stacked_models"),
           ("alone ms", ">9.3f", "alone_ms_per_model_step"), ("stacked ms", ">10.3f", "stacked_ms_per_model_step"),
           ("floor ms", ">9.3f", "floor_ms_per_model_step"), ("speed-up", ">8.2f", "speedup"),
           ("GEMM GF/s", ">9.1f", "gemm_gflops_per_s"), ("BLAS GF/s", ">9.1f", "blas_gflops_per_s"),
           ("oneDNN GF/s", ">11.1f", "onednn_gflops_per_s"), ("GEMM by", ">7", "gemm_library"),
           ("conv GF/s", ">9.1f", "conv_gflops_per_s"),
           ("stacked/floor", ">13.2f", "stacked_over_floor"), ("alone/floor", ">11.2f", "alone_over_floor"),
           ("read GiB/s", ">10.1f", "read_gib_per_s"), ("update GiB/s", ">12.1f", "update_gib_per_s"),
           ("memory floor ms", ">15.3f", "memory_floor_ms_per_model_step"),
           ("stacked/roof", ">12.2f", "stacked_over_roof"),
           ("kernels ms", ">10.3f", "kernels_ms_per_model_step"), ("stacked/kernels", ">15.2f", "stacked_over_kernels"),
           ("kernels/floor", ">13.2f", "kernels_over_floor"),
           ("vmap/stacked", ">12.2f", "vmap_over_stacked"), ("plain/stacked", ">13.2f", "plain_over_stacked"),
           ("plain/floor", ">11.2f", "plain_over_floor"), ("compiled/stacked", ">16.2f", "compiled_over_stacked"),
           ("compiled/floor", ">14.2f", "compiled_over_floor"))


def format_row(row: dict) -> str:
    cells = []
    for _title, spec, key in COLUMNS:
        value = row.get(key)
        width = spec.lstrip("<>").split(".")[0]
        cells.append(f"{'—':>{width}}" if value is None else format(value, spec))
    return " ".join(cells)


def format_split(row: dict) -> list[str]:
    """A line for each stack size of the row's ``split``, and one for those left out."""
    lines = [f"  {row['arm']} B={row['batch_size']} as stacks of {'/'.join(map(str, s['stack_sizes']))}: "
             f"{s['ms_per_model_step']:.3f} ms a model-step; one stack of {row['stacked_models']} over these, "
             f"median of the rounds' paired ratios {s['speedup_over_stacked']:.2f} (rounds "
             f"{min(s['speedup_over_stacked_rounds']):.2f}-{max(s['speedup_over_stacked_rounds']):.2f}); "
             f"{s['over_floor']:.2f}x the floor"
             for s in row.get("split", [])]
    if row.get("split_left_out"):
        lines.append(f"  {row['arm']} B={row['batch_size']}: stacks of at most "
                     f"{', '.join(map(str, row['split_left_out']))} left out: the cell stacks {row['stacked_models']}")
    return lines


def row_lines(row: dict) -> list[str]:
    """A row's line of the table and its ``split`` lines."""
    return [format_row(row), *format_split(row)]


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (— where a value does not apply), each followed by its
    ``split`` lines."""
    header = " ".join(format(title, spec.split(".")[0].rstrip("df")) for title, spec, _key in COLUMNS)
    return "\n".join([header, *(line for row in rows for line in row_lines(row))])


CHECK_SETTINGS = dict(dataset="fashion-mnist", method="affine", depth=3, width=128, activation="tanh",
                      lr_rule="tuned", lr_grid=(0.05, 0.1, 0.2, 0.4, 0.8), grid_extensions=3, budget="target",
                      target=0.84, targets=(0.78, 0.80, 0.82), read_spacing=0.05, length=12000, val_fraction=0.05,
                      seed=8)
CHECK_TARGET = 0.10


def check_share(batch: int, **reading) -> dict:
    """Seconds of one stacked steps-to-target run (``CHECK_SETTINGS`` at ``batch``, with ``reading``:
    ``read_spacing``, ``sparse_spacing``) and of its checks, and its steps to each target."""
    from affdiv.experiments.runs import reads
    from affdiv.experiments.runs.sweep import dataset_for
    from affdiv.experiments.runs.training import train_runs

    config = RunConfig(batch_size=batch, **{**CHECK_SETTINGS, **reading})
    result = train_runs([config], [dataset_for(config)], stacked=True)[0]
    share = result.check_seconds / result.seconds
    best = reads.best_at_targets(result.candidates, config.ladder, max_steps=config.length, interpolate=True,
                                 tuned=True)
    read_counts = [len(c["curve"]) for c in result.candidates]
    rest = result.seconds - result.check_seconds  # training (and the test pass)
    read_s = result.check_seconds / sum(read_counts)
    return {"batch_size": batch, "read_spacing": config.read_spacing, "sparse_spacing": config.sparse_spacing,
            "seconds": result.seconds, "check_seconds": result.check_seconds, "reads": sum(read_counts),
            "reads_per_candidate": sum(read_counts) / len(read_counts),
            "read_in_steps": read_s / (rest / sum(c["curve"][-1]["step"] for c in result.candidates)),
            "reads_per_candidate_within_target": CHECK_TARGET / (1 - CHECK_TARGET) * rest / read_s / len(read_counts),
            "steps_to_targets": {str(t): best[t]["steps_to_target"] for t in config.ladder},
            "check_share": share, "target": CHECK_TARGET, "met": share <= CHECK_TARGET}


def agreement(adaptive: dict, geometric: dict) -> dict[str, float | None]:
    """Per target, adaptive steps / geometric steps − 1 (None where either did not reach it)."""
    return {t: None if s is None or geometric["steps_to_targets"][t] is None
            else s / geometric["steps_to_targets"][t] - 1 for t, s in adaptive["steps_to_targets"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell (default 3)")
    parser.add_argument("--seconds", type=float, default=1.5, help="about how long one measurement runs")
    parser.add_argument("--arms", nargs="*", default=list(DEFAULT_ARMS), choices=list(ARMS),
                        help=f"default: {' '.join(DEFAULT_ARMS)}; patchnorm, conv+batchnorm and the vit methods on "
                             "request; --arms with no name: only the --checks runs")
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="of each arm (default: the arm's, listed above)")
    parser.add_argument("--members", nargs="+", type=int,
                        help="stacked ensemble sizes to time, a row each (default: as many as fit the default "
                             "ensemble memory, at most 48)")
    parser.add_argument("--split", nargs="+", type=int, default=[], metavar="K",
                        help="also time the stacked models as stacks of at most K, trained one after the other "
                             "(as a sweep's smaller ensembles), paired with the one stack in every round")
    parser.add_argument("--vmap", action="store_true", help="also time the vmapped engine (StackedEnsemble)")
    parser.add_argument("--plain", action="store_true",
                        help="also time the stacked engine without the compiled passes (_fused.disabled())")
    parser.add_argument("--compiled", action="store_true",
                        help="also time the stacked engine with its forward compiled by torch.compile (inductor)")
    parser.add_argument("--checks", nargs="*", type=int, default=[], metavar="B",
                        help="also time a steps-to-target run at each batch size B, the share of it in checks")
    parser.add_argument("--read-spacing", type=float, default=CHECK_SETTINGS["read_spacing"], metavar="r",
                        help=f"the checks' runs' read_spacing (default {CHECK_SETTINGS['read_spacing']})")
    parser.add_argument("--sparse-spacing", nargs="*", type=float, default=[], metavar="R",
                        help="also time each check run with adaptive reads at this sparse_spacing")
    parser.add_argument("--json", help="write the rows and provenance here")
    args = parser.parse_args(argv)
    if not all(1 <= k <= CELL for k in args.members or []):
        parser.error(f"--members: each K must be in 1..{CELL} (a cell's models), got {args.members}")
    if not all(1 <= k < CELL for k in args.split):
        parser.error(f"--split: each K must be in 1..{CELL - 1} (fewer than a cell's models), got {args.split}")
    if not all(b >= 1 for b in [*(args.batch_sizes or []), *args.checks]):
        parser.error(f"--batch-sizes and --checks must be >= 1, got {args.batch_sizes} and {args.checks}")
    if args.json:
        from affdiv.atomic import check_writable_file

        check_writable_file(args.json, "--json")
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the sweep's workers do
    started = time.monotonic()
    data = load_dataset("fashion-mnist")
    rows = []
    print(format_table([]), flush=True)
    for arm in args.arms:
        for batch, members in itertools.product(args.batch_sizes or ARMS[arm][1], args.members or [None]):
            rows.append(measure(arm, batch, data, args.rounds, args.seconds, members, args.vmap, args.plain,
                                args.compiled, args.split))
            print("\n".join(row_lines(rows[-1])), flush=True)
    checks = []
    for batch in args.checks:
        geometric = None
        for sparse in [None, *args.sparse_spacing]:
            c = check_share(batch, read_spacing=args.read_spacing, sparse_spacing=sparse)
            reading = f"r={args.read_spacing:g}" + ("" if sparse is None else f" R={sparse:g}")
            if sparse is None:
                geometric = c
            else:
                c["steps_vs_geometric"] = agreement(c, geometric)
            checks.append(c)
            steps = " ".join(f"{t}:{'—' if v is None else format(v, '.1f')}" for t, v in c["steps_to_targets"].items())
            differences = " ".join(f"{'—' if v is None else format(100 * v, '+.1f')}%"
                                   for v in c.get("steps_vs_geometric", {}).values())
            print(f"checks B={batch} {reading}: {c['check_seconds']:.1f} s of {c['seconds']:.1f} s in {c['reads']} "
                  f"reads = {100 * c['check_share']:.1f}% (target <= {100 * CHECK_TARGET:.0f}%); a read costs "
                  f"{c['read_in_steps']:.1f} training steps, so the target affords "
                  f"{c['reads_per_candidate_within_target']:.1f} reads per candidate, against "
                  f"{c['reads_per_candidate']:.1f} made; steps {steps}"
                  + (f"; vs geometric {differences}" if differences else ""), flush=True)
    if args.json:
        from affdiv.atomic import atomic_write

        record = {"rows": rows, "checks": checks, "table": format_table(rows).splitlines(),
                  "provenance": provenance(threads=args.threads, rounds=args.rounds,
                                           wall_time_s=round(time.monotonic() - started, 1))}
        atomic_write(args.json, json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

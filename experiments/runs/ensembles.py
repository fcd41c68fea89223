"""Which runs train together as one stacked ensemble, and how many fit in a memory budget.

Runs that share everything but their seed (init, shuffles), data split and learning-rate settings
(``_FREE``: rule, base lr, grids, momentum, target, grid extensions) train the same architecture
for the same steps at the same batch size: :func:`ensemble_key` is equal for them, and all their
candidates (every lr, momentum of every run) can be one :class:`~affdiv.experiments.runs.stacked.
StackedEnsemble`. :func:`plan_ensembles` cuts each such group into ensembles whose estimated
memory (:func:`member_bytes` per model) stays within a budget; a run's candidates are never split
(they stop together under the target budget). The plan is a function of the configs and the
budget only, never of the worker count, so a sweep's numbers do not depend on how it was run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from affdiv.experiments.runs.config import RunConfig, candidates, canonical_json, config_hash
from affdiv.experiments.runs.models import build_network
from affdiv.experiments.runs.options import DEFAULT_ENSEMBLE_MEMORY
from affdiv.experiments.runs.stacked import eval_chunk, layer_outputs

# Settings in which runs of one ensemble may differ.
_FREE = ("seed", "data_seed", "lr_rule", "base_lr", "ref_batch_size", "lr_grid", "momentum", "momentum_grid",
         "target", "grid_extensions")

# Tensors of the size of the parameters per model while it trains: the parameters, their
# gradients, and the optimiser's state.
_PARAMETER_COPIES = {"sgd": 2, "momentum": 3, "adam": 4}


def ensemble_key(config: RunConfig) -> str:
    """Equal for runs that can train in one ensemble: every setting but those in ``_FREE``."""
    settings = config.to_dict()
    return canonical_json({k: v for k, v in settings.items() if k not in _FREE})


def member_bytes(config: RunConfig, input_shape: Sequence[int], num_classes: int) -> int:
    """Estimated peak memory of one model of an ensemble, in bytes:

        s·(c·P + max(3·A(B) + B·I, 2·max_l a_l(C) + C·I))

    with s the element size, P the parameter count, c = 2, 3, 4 copies of it (parameters,
    gradients, optimiser state for sgd, momentum, adam), A(B) the summed outputs of every layer
    at batch size B (kept for backward, plus their gradients and temporaries: ×3), I the input
    size, and, for an evaluation chunk of C samples (``stacked.eval_chunk``), the largest layer
    output a_l(C) (with its input) and the chunk of inputs. Sizes come from a forward pass of one
    sample.
    """
    with torch.random.fork_rng(devices=[]):  # (building initialises: leave the global generator alone)
        model = build_network(config, tuple(input_shape), num_classes)
    outputs = layer_outputs(model, input_shape)
    params = sum(p.numel() for p in model.parameters())
    sample = math.prod(input_shape)
    train = 3 * sum(outputs) * config.batch_size + config.batch_size * sample
    chunk = eval_chunk(outputs, config.device)
    evaluation = (2 * max(outputs) + sample) * chunk
    element = torch.finfo(getattr(torch, config.dtype)).bits // 8
    return element * (_PARAMETER_COPIES[config.optimizer] * params + max(train, evaluation))


def plan_ensembles(configs: Sequence[RunConfig], shape_of: Callable[[RunConfig], tuple[tuple[int, ...], int]],
                   budget: int = DEFAULT_ENSEMBLE_MEMORY) -> list[list[RunConfig]]:
    """``configs`` cut into ensembles: runs of one :func:`ensemble_key`, sorted by (seed, data
    seed, config hash), in as few ensembles of balanced size as keep each within ``budget`` bytes
    (a run larger than the budget alone is an ensemble by itself). ``shape_of(config)`` gives
    the (input shape, number of classes) of a run's data."""
    if budget <= 0:
        raise ValueError(f"the ensemble memory budget must be > 0 bytes, got {budget}")
    groups: dict[str, list[RunConfig]] = {}
    for config in configs:
        groups.setdefault(ensemble_key(config), []).append(config)
    plan = []
    for key in sorted(groups):
        runs = sorted(groups[key], key=lambda c: (c.seed, c.data_seed, config_hash(c.to_dict())))
        per_model = member_bytes(runs[0], *shape_of(runs[0]))
        plan += _balanced([len(candidates(c)) * per_model for c in runs], runs, budget)
    return plan


def _balanced(sizes: Sequence[int], runs: Sequence[RunConfig], budget: int) -> list[list[RunConfig]]:
    """``runs`` cut into the fewest consecutive pieces of about equal total size (a run goes to
    piece ⌊(size before it + half its size)/share⌋) that each fit ``budget`` or hold one run."""
    total = sum(sizes)
    for count in range(math.ceil(total / budget), len(runs) + 1):
        share, before = total / count, 0
        pieces: list[list] = [[] for _ in range(count)]
        for run, size in zip(runs, sizes):
            pieces[min(count - 1, int((before + size / 2) / share))].append((run, size))
            before += size
        if all(len(p) == 1 or sum(size for _, size in p) <= budget for p in pieces if p):
            return [[run for run, _ in p] for p in pieces if p]
    return [[run] for run in runs]

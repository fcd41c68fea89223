"""What determines a run: its config, the config's key, and grids of configs.

A run's numbers are a function of its :class:`RunConfig` (and the data files it names). Its key
in the results store is :func:`config_hash`, the SHA-256 of the canonical JSON of
:meth:`RunConfig.to_dict`, in which settings the run ignores (:func:`unused_settings`) sit at
their defaults, so two configs that train the same run share one key.

The learning rate for batch size B follows ``lr_rule`` (:func:`learning_rates`):

    constant   lr = base_lr
    linear     lr = base_lr * B / ref_batch_size
    sqrt       lr = base_lr * sqrt(B / ref_batch_size)
    tuned      every lr in ``lr_grid`` is trained; the one with the best validation accuracy is kept
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from affdiv.experiments.data.dataset import check_fraction
from affdiv.experiments.runs.models import ACTIVATIONS, METHODS, check_choice

LR_RULES = ("constant", "linear", "sqrt", "tuned")
OPTIMIZERS = ("sgd", "momentum", "adam")
BUDGETS = ("epochs", "steps")

@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers (its hash is the run's key in the store)."""

    dataset: str
    method: str
    batch_size: int
    seed: int
    lr_rule: str = "constant"
    depth: int = 2
    width: int = 64
    activation: str = "tanh"
    optimizer: str = "sgd"
    base_lr: float = 0.05
    ref_batch_size: int = 32
    lr_grid: tuple[float, ...] = ()
    momentum: float = 0.9
    budget: str = "epochs"
    length: int = 10
    data_seed: int = 0
    val_fraction: float = 0.1
    data_options: dict = field(default_factory=dict)
    device: str = "cpu"

    def __post_init__(self):
        check_choice("method", self.method, METHODS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("lr_rule", self.lr_rule, LR_RULES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("budget", self.budget, BUDGETS)
        for name in ("batch_size", "ref_batch_size", "length", "depth", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.base_lr > 0:
            raise ValueError(f"base_lr must be > 0, got {self.base_lr!r}")
        object.__setattr__(self, "lr_grid", tuple(float(lr) for lr in self.lr_grid))
        if self.lr_rule == "tuned" and not self.lr_grid:
            raise ValueError("lr_rule 'tuned' needs a non-empty lr_grid")
        check_fraction("val_fraction", self.val_fraction, allow_zero=True)
        if self.lr_rule == "tuned" and self.val_fraction == 0:
            raise ValueError("lr_rule 'tuned' selects the lr on the validation split: it needs val_fraction > 0, got 0")
        if any(not lr > 0 for lr in self.lr_grid):
            raise ValueError(f"every lr in lr_grid must be > 0, got {self.lr_grid}")

    def to_dict(self) -> dict:
        """JSON-ready, with every setting in :func:`unused_settings` at its default value: two configs
        that differ only there train the same run, so they get the same dict (and the same hash)."""
        out = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        out.update({name: defaults[name] for name in unused_settings(out)})
        out["lr_grid"] = list(out["lr_grid"])
        return out

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown run setting(s) {unknown}; expected among: {sorted(names)}")
        return cls(**values)


# Settings that cannot change a run's numbers, by the value of the setting that makes them idle.
_UNUSED = {
    ("lr_rule", "constant"): ("lr_grid", "ref_batch_size"),
    ("lr_rule", "linear"): ("lr_grid",),
    ("lr_rule", "sqrt"): ("lr_grid",),
    ("lr_rule", "tuned"): ("base_lr", "ref_batch_size"),
    ("optimizer", "sgd"): ("momentum",),
    ("optimizer", "adam"): ("momentum",),
}


def unused_settings(settings: Mapping) -> set[str]:
    """The names among a run's ``settings`` (a config dict or a record) that its numbers ignore.

    The grid unless ``lr_rule`` is tuned; ``ref_batch_size`` under the constant and tuned rules;
    ``base_lr`` under tuned; ``momentum`` unless the optimizer is momentum SGD. A record without
    ``lr_rule`` or ``optimizer`` is taken to use every setting those would idle.
    """
    return {name for key in ("lr_rule", "optimizer") for name in _UNUSED.get((key, settings.get(key)), ())}


def learning_rates(config: RunConfig) -> tuple[float, ...]:
    """The learning rate(s) to train with: one for a scaling rule, the grid for ``tuned``."""
    ratio = config.batch_size / config.ref_batch_size
    if config.lr_rule == "constant":
        return (config.base_lr,)
    if config.lr_rule == "linear":
        return (config.base_lr * ratio,)
    if config.lr_rule == "sqrt":
        return (config.base_lr * math.sqrt(ratio),)
    return config.lr_grid


def canonical_json(value) -> str:
    """JSON with sorted keys, no whitespace, ASCII only: equal values give equal strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: dict) -> str:
    """sha256 (hex) of the canonical JSON of ``config``: the run's key."""
    return hashlib.sha256(canonical_json(config).encode("ascii")).hexdigest()


def expand_grid(base: dict, axes: dict[str, Sequence]) -> list[RunConfig]:
    """Every combination of the ``axes`` values on top of ``base``, in a fixed (sorted) order."""
    names = sorted(axes)
    for name in names:
        if not isinstance(axes[name], (list, tuple)) or not axes[name]:
            raise ValueError(f"grid axis {name!r} must be a non-empty list, got {axes[name]!r}")
    configs = {}
    for values in itertools.product(*(axes[name] for name in names)):
        config = RunConfig.from_dict({**base, **dict(zip(names, values))})
        configs[config_hash(config.to_dict())] = config  # duplicates collapse (e.g. grids of unused keys)
    return sorted(configs.values(), key=lambda c: (c.method, c.batch_size, c.seed, config_hash(c.to_dict())))

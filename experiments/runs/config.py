"""What determines a run: its config, the config's key, and grids of configs.

A run's numbers are a function of its :class:`RunConfig` (and the data files it names). Its key
in the results store is :func:`config_hash`, the SHA-256 of the canonical JSON of
:meth:`RunConfig.to_dict`, in which settings the run ignores (:func:`unused_settings`) sit at
their defaults, so two configs that train the same run share one key. Settings added after the
first stored runs (``_ADDED``) are left out of the dict where they are idle or at the value that
reproduces what earlier versions did, so every earlier config keeps its key.

The learning rate for batch size B follows ``lr_rule`` (:func:`learning_rates`):

    constant   lr = base_lr
    linear     lr = base_lr * B / ref_batch_size
    sqrt       lr = base_lr * sqrt(B / ref_batch_size)
    tuned      every lr in ``lr_grid`` is trained (with momentum SGD and a ``momentum_grid``, every
               (lr, momentum) pair: :func:`candidates`); the best on the validation split is kept

The budget is ``length`` epochs, ``length`` steps, or (``budget = "target"``) steps until the
validation accuracy reaches ``target``, read every ``eval_every`` steps or, with ``read_spacing``
= r, at steps spaced by a fraction r of the steps so far (:mod:`~affdiv.experiments.runs.reads`),
at most ``length`` (= max_steps) steps; ``sparse_spacing`` = R > r reads at spacing R where no
target is near and at r where one is (adaptive reads, :mod:`~affdiv.experiments.runs.reads`).
``targets`` adds a ladder: the run trains until the highest of ``target`` and ``targets`` is reached
(``target`` is the primary one), and every candidate's curve is kept, so that steps to each target
can be read from one set of runs. Under the target budget a tuned grid must be spaced by at most x2,
and a chosen lr on its edge (at any target) extends it outward by x2 steps, at most
``grid_extensions`` times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from affdiv.checks import check_choice, check_fraction, check_int

#: The hidden layers' kinds by architecture (what each one is: ``runs/models.py``).
MLP_METHODS = ("affine", "batchnorm", "layernorm", "rmsnorm", "norm_l2", "affine_like")
CNN_METHODS = ("conv", "conv+batchnorm", "patchnorm")
VIT_METHODS = ("vit", "vit-qknorm", "vit-affine_like", "vit-affine_like-qknorm", "vit-nonorm")
METHODS = (*MLP_METHODS, *CNN_METHODS, *VIT_METHODS)
#: The methods of each architecture, by its name.
ARCHITECTURES = {"mlp": MLP_METHODS, "cnn": CNN_METHODS, "vit": VIT_METHODS}
ACTIVATIONS = ("tanh", "relu", "gelu", "identity")
LR_RULES = ("constant", "linear", "sqrt", "tuned")
OPTIMIZERS = ("sgd", "momentum", "adam")
BUDGETS = ("epochs", "steps", "target")
DTYPES = ("float32", "float64")
#: Largest ratio between neighbouring lrs of a tuned grid under the target budget.
MAX_GRID_RATIO = 2.0
#: torch's seed range (``torch.manual_seed``; a negative seed s is taken as s + 2**64, so it is refused).
MAX_SEED = 2**64 - 1

@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run's numbers; ``config_hash(config.to_dict())`` is the run's
    key in the store.

    Args (defaults in the signature): ``dataset``, ``method`` (the hidden layers' kind, one of
    ``METHODS``), ``batch_size``, ``seed`` (init and shuffles), the learning-rate rule
    (``lr_rule``, ``base_lr``, ``ref_batch_size``, ``lr_grid``, ``momentum_grid``,
    ``grid_extensions``), the network (``depth``, ``width``, ``activation``), the optimizer
    (``optimizer``, ``momentum``), the budget (``budget`` = "epochs" | "steps" | "target",
    ``length``, ``target``, ``eval_every``), the data (``data_seed``, ``val_fraction``,
    ``data_options``), ``device`` and ``dtype``. Settings a run ignores (:func:`unused_settings`)
    do not enter its hash.

    Example::

        >>> config = RunConfig(dataset="digits", method="affine_like", batch_size=32, seed=0)
        >>> len(config_hash(config.to_dict()))
        64
    """

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
    # Added later; see ``_ADDED`` for when each enters the dict.
    target: float | None = None
    eval_every: int = 100
    momentum_grid: tuple[float, ...] = ()
    grid_extensions: int = 3
    dtype: str = "float32"
    targets: tuple[float, ...] = ()
    read_spacing: float | None = None
    model: str | None = None
    model_digest: str | None = None
    sparse_spacing: float | None = None

    def __post_init__(self):
        if self.model is None:
            check_choice("method", self.method, METHODS)
        else:
            from affdiv.experiments.runs.factories import check_spec

            check_spec(self.model)
            if self.method in METHODS:
                raise ValueError(f"method {self.method!r} is built in; a method with its own model needs another name")
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("lr_rule", self.lr_rule, LR_RULES)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("budget", self.budget, BUDGETS)
        check_choice("dtype", self.dtype, DTYPES)
        for name in ("batch_size", "ref_batch_size", "length", "depth", "width", "eval_every"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))  # a NumPy int as an int
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
        object.__setattr__(self, "momentum_grid", tuple(float(m) for m in self.momentum_grid))
        if any(not 0 <= m < 1 for m in self.momentum_grid):
            raise ValueError(f"every momentum in momentum_grid must be in [0, 1), got {self.momentum_grid}")
        object.__setattr__(self, "grid_extensions", check_int("grid_extensions", self.grid_extensions, minimum=0))
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.budget == "target":
            self._check_target()

    def check(self) -> RunConfig:
        """Refuse what the constructor lets through (configs read back from a store keep loading)
        but a run, or its key, cannot take: a seed outside torch's range (:data:`MAX_SEED`), a
        non-finite number anywhere (a key is JSON, which has no inf or nan), a learning rate that is
        not a finite number > 0, a momentum outside [0, 1), ``data_options`` that are not a table, a
        ``device`` that is not a string. Returns the config; raises ValueError naming the setting."""
        for name in ("seed", "data_seed"):
            check_int(f"run setting {name} (torch's seed range)", getattr(self, name), minimum=0, maximum=MAX_SEED)
        check_finite(dataclasses.asdict(self), "run setting ")
        for name, low, high, text in (("base_lr", 0, None, "a finite number > 0"),
                                      ("momentum", 0, 1, "a number in [0, 1)")):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, int | float)
            if not (number and low <= value and (high is None or value < high)):
                raise ValueError(f"{name} must be {text}, got {value!r}")
        if not isinstance(self.data_options, dict):
            raise ValueError(f"data_options must be a table of dataset options (e.g. {{standardize = \"none\"}}), "
                             f"got {self.data_options!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device must be a string such as 'cpu' or 'cuda:0', got {self.device!r}")
        return self

    @property
    def ladder(self) -> tuple[float, ...]:
        """The targets a run of the target budget reads, increasing: ``target`` and ``targets``."""
        return tuple(sorted({self.target, *self.targets}))

    def _check_target(self) -> None:
        def accuracy(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1

        if not accuracy(self.target):
            raise ValueError(f"budget 'target' needs a target validation accuracy in (0, 1], got {self.target!r}")
        if not all(map(accuracy, self.targets)):
            raise ValueError(f"targets must be validation accuracies in (0, 1], got {list(self.targets)!r}")
        # One spelling per ladder (so one key): sorted, without the primary target.
        object.__setattr__(self, "targets", tuple(sorted({float(t) for t in self.targets} - {float(self.target)})))
        spacing = self.read_spacing
        if spacing is not None and (isinstance(spacing, bool) or not isinstance(spacing, (int, float))
                                    or not 0 < spacing <= 1):
            raise ValueError(f"read_spacing must be None (a read every eval_every steps) or a fraction in (0, 1], "
                             f"got {spacing!r}")
        sparse = self.sparse_spacing
        if sparse is not None and (spacing is None or isinstance(sparse, bool) or not isinstance(sparse, (int, float))
                                   or not spacing < sparse <= 1):
            raise ValueError(f"sparse_spacing must be None (reads at read_spacing throughout) or a fraction in "
                             f"(read_spacing, 1] with read_spacing set, got sparse_spacing={sparse!r} and "
                             f"read_spacing={spacing!r}")
        for name in ("read_spacing", "sparse_spacing"):  # one spelling, one key: 1 and 1.0 alike
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.val_fraction == 0:
            raise ValueError("budget 'target' checks the validation accuracy: it needs val_fraction > 0, got 0")
        grid = sorted(self.lr_grid)
        if self.lr_rule == "tuned" and any(b / a > MAX_GRID_RATIO * (1 + 1e-9) for a, b in zip(grid, grid[1:])):
            ratio = max(b / a for a, b in zip(grid, grid[1:]))
            raise ValueError(f"budget 'target' tunes on an lr_grid spaced by at most x{MAX_GRID_RATIO:g}; "
                             f"{list(grid)} has a step of x{ratio:g}")

    def to_dict(self) -> dict:
        """JSON-ready, with every setting in :func:`unused_settings` at its default value: two configs
        that differ only there train the same run, so they get the same dict (and the same hash)."""
        out = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unused = unused_settings(out)
        out.update({name: defaults[name] for name in unused})
        for name, legacy in _ADDED.items():
            if name in unused or out[name] == legacy:
                del out[name]
        for name in ("lr_grid", "momentum_grid", "targets"):
            if name in out:
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, values: dict) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown run setting(s) {unknown}; expected among: {sorted(names)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"run setting(s) {missing} missing; every run needs {required} (a preset sets them in "
                             "[run] or as [grid] axes)")
        return cls(**values)


# Settings added after runs had been stored, with the value that trains as earlier versions did
# (None: no such value; the setting is idle for every earlier run). ``to_dict`` leaves them out
# where they are idle or at that value, so the key of every earlier config stays what it was.
_ADDED = {"target": None, "eval_every": None, "momentum_grid": (), "grid_extensions": None, "dtype": "float32",
          "targets": (), "read_spacing": None, "model": None, "model_digest": None, "sparse_spacing": None}

# Settings that cannot change a run's numbers, by the value of the setting that makes them idle.
_UNUSED = {
    ("lr_rule", "constant"): ("lr_grid", "ref_batch_size", "momentum_grid", "grid_extensions"),
    ("lr_rule", "linear"): ("lr_grid", "momentum_grid", "grid_extensions"),
    ("lr_rule", "sqrt"): ("lr_grid", "momentum_grid", "grid_extensions"),
    ("lr_rule", "tuned"): ("base_lr", "ref_batch_size"),
    ("optimizer", "sgd"): ("momentum", "momentum_grid"),
    ("optimizer", "adam"): ("momentum", "momentum_grid"),
    ("budget", "epochs"): ("target", "eval_every", "grid_extensions", "targets", "read_spacing", "sparse_spacing"),
    ("budget", "steps"): ("target", "eval_every", "grid_extensions", "targets", "read_spacing", "sparse_spacing"),
}


def check_finite(settings: Mapping, where: str) -> None:
    """Refuse inf and nan anywhere in run ``settings`` (nested tables and lists too): ValueError
    naming ``where`` and the setting's path, e.g. ``settings data_options.noise[1]: nan is not a
    finite number``."""
    def walk(value, name):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}{name}: {value!r} is not a finite number")
        for key, item in (value.items() if isinstance(value, Mapping) else
                          enumerate(value) if isinstance(value, list | tuple) else ()):
            walk(item, f"{name}.{key}" if isinstance(value, Mapping) else f"{name}[{key}]")

    for key, value in settings.items():
        walk(value, key)


def architecture(method: str) -> str:
    """The name (a key of ``ARCHITECTURES``) of the architecture ``method`` belongs to."""
    check_choice("method", method, METHODS)
    return next(name for name, methods in ARCHITECTURES.items() if method in methods)


def unused_settings(settings: Mapping) -> set[str]:
    """The names among a run's ``settings`` (a config dict or a record) that its numbers ignore.

    The grids unless ``lr_rule`` is tuned; ``ref_batch_size`` under the constant and tuned rules;
    ``base_lr`` under tuned; ``momentum`` and ``momentum_grid`` unless the optimizer is momentum
    SGD, and ``momentum`` when a ``momentum_grid`` is tuned; ``target``, ``eval_every`` and
    ``grid_extensions`` unless the budget is ``target`` (the last also unless tuned), and so are
    ``targets``, ``read_spacing`` and ``sparse_spacing``; ``eval_every`` when ``read_spacing`` spaces the reads;
    ``depth``, ``width`` and ``activation`` when a ``model`` factory builds the network. A record
    without ``lr_rule``, ``optimizer`` or ``budget`` is taken to use every setting those would idle.
    """
    unused = {name for key in ("lr_rule", "optimizer", "budget") for name in _UNUSED.get((key, settings.get(key)), ())}
    if "momentum_grid" not in unused and settings.get("momentum_grid"):
        unused.add("momentum")
    if "read_spacing" not in unused and settings.get("read_spacing") is not None:
        unused.add("eval_every")
    if settings.get("model") is not None:
        unused.update(("depth", "width", "activation"))  # the factory builds the whole network
    return unused


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


def candidates(config: RunConfig) -> list[tuple[float, float | None]]:
    """The (lr, momentum) pairs the run trains before any grid extension: every lr of
    :func:`learning_rates` with every value of ``momentum_grid`` (tuned momentum SGD), else with
    ``momentum`` (momentum SGD) or None (plain SGD, Adam)."""
    if config.optimizer != "momentum":
        momenta: tuple[float | None, ...] = (None,)
    elif config.lr_rule == "tuned" and config.momentum_grid:
        momenta = config.momentum_grid
    else:
        momenta = (config.momentum,)
    return [(lr, momentum) for lr in learning_rates(config) for momentum in momenta]


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
    return sorted(configs.values(), key=run_order)


def run_order(config: RunConfig) -> tuple:
    """The order of a preset's runs: method, batch size, seed, then config hash."""
    return config.method, config.batch_size, config.seed, config_hash(config.to_dict())

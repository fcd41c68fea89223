"""Training runs: configs in, metrics, curves (and measurements) out.

Optimisation is plain SGD as in the paper (no weight decay, no gradient clipping); momentum SGD
and Adam are options (:mod:`~affdiv.experiments.runs.optimizers`). Every step is on a full batch
of ``batch_size`` samples drawn without replacement: each epoch is a fresh permutation of the
training split (``torch.randperm`` from a generator seeded with the run's seed), cut into
batches, its last partial batch dropped. The budget (``budget``, ``length``):

    epochs   length epochs
    steps    length optimizer steps
    target   steps until the validation accuracy reaches ``target``, at most length (= max_steps)

*Checks* (reads) evaluate the validation split: at the end of every epoch (and of the last,
partial one of a ``steps`` budget), or under ``target`` at the reads of ``eval_every`` or
``read_spacing`` (:mod:`~affdiv.experiments.runs.reads`). Each check adds a curve point {"epoch"
(the epoch it falls in, from 1), "step", "train_loss" (mean over the steps since the previous
check), "val_loss", "val_metric" (accuracy)}. Under the target budget, ``steps_to_target`` is the
step of the first read with val accuracy >= target (interpolated between reads under
``read_spacing``); a run that never gets there within max_steps is *censored*.

*Candidates*: a run trains one model per (lr, momentum) of :func:`~affdiv.experiments.runs.
config.candidates` (one for a scaling rule; the grid for ``tuned``), all from the same init
(``torch.manual_seed(seed)`` before building) with the same shuffles, in lockstep. The kept one
ranks highest by :func:`~affdiv.experiments.runs.reads.rank` (reached the target, else not
diverged; fewer steps to it; validation accuracy, then −loss at its last read; smaller lr; smaller
momentum), at the primary target under the target budget, and only then is the test split
evaluated, once. Under the target budget the run reads every target of its ladder
(``config.ladder``: ``target`` and ``targets``), at the reads of
:func:`~affdiv.experiments.runs.reads.read_steps`; a candidate stops once, for every target it has
not reached, another candidate of its run already has (no candidate could reach it in fewer steps:
all are read at the same steps), so with one target all of a run's candidates stop at the first
read that reaches it. When the best lr at some target is the smallest or largest tried, the grid
grows by one ×2 step that way (for every momentum), at most ``grid_extensions`` times; the new
candidates stop by the same rule, measured against every candidate before them.
``lr_at_grid_edge`` = 1 marks a tuned run whose kept lr still sits on an edge of the lrs tried: it
may not be the optimum. Every candidate's curve is kept (``RunResult.candidates``), so the best lr
and steps at each target are read from the store (:func:`~affdiv.experiments.runs.reads.
best_at_targets`).

A candidate whose training or validation loss becomes non-finite is *diverged* at that check and
stops: a result, not an error. A diverged run's test accuracy is recorded as chance,
1/num_classes (a number, not NaN, so that every run keeps a row in the records), its test loss
as NaN (null in the store), and ``diverged`` = 1 marks it (its ``steps_to_target`` is None and
``censored`` 0). The analysis never lets such a run decide a verdict
(:mod:`affdiv.experiments.analysis.decision`). ``val_fraction`` = 0 trains without validation
numbers (None) and judges divergence on the training loss alone; ``tuned`` and ``target`` need
a validation split.

*Engines*: the loop (:func:`_lockstep`) is the same for one run and for many; what takes a step
differs. :class:`OneAtATime` keeps each model a module with its own torch.optim optimizer and
steps them one after the other (:func:`train_run`: the numbers a run has always had);
:class:`~affdiv.experiments.runs.stacked.StackedEnsemble` steps all of them as one vmapped
model. :func:`train_group` trains runs of one :func:`~affdiv.experiments.runs.ensembles.
ensemble_key` stacked, or one at a time where stacking is off or impossible (logged).

*Measurements*: a :class:`Measurement` ``fn(model, step, data, config) -> dict`` is called at step 0 and
every ``every`` steps (after that step's update, before its check) for every *active* candidate:
one still training whose parameters and buffers are all finite (a non-finite loss makes the
update, and so the parameters, non-finite: such a candidate has diverged, and the next check
stops it). The outputs can overflow a step before the parameters do (an update that leaves them
near the largest float), so a callback must return, not raise, on a model whose outputs are not
finite. ``model`` is a fresh module holding the candidate's parameters and buffers at that step
(no ``.grad``), in train mode: a deep copy of the module under :class:`OneAtATime`, model k
materialised from its slices of the stacked state under the stacked ensemble, so a callback sees
the same module either way (up to the engines' rounding, :mod:`~affdiv.experiments.runs.stacked`).
The callbacks run with the global random generators forked (restored afterwards; a callback draws
from its own generator: its values must be a function of its arguments). A run's candidates start
from one init (its seed), so at step 0 each measurement is taken once per run, on its first
candidate, and shared. Nothing a callback does reaches training: a run's numbers with and without
measurements are bit-identical. Its dicts are kept with the run (``RunResult.measurements``, the
kept candidate's).

Determinism: on CPU with a fixed thread count the same configs give the same numbers.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from affdiv.checks import check_int
from affdiv.experiments.runs import reads
from affdiv.experiments.runs.batched import BatchedEnsemble, is_batched
from affdiv.experiments.runs.config import RunConfig, candidates
from affdiv.experiments.runs.ensembles import ensemble_key
from affdiv.experiments.runs.models import build_network
from affdiv.experiments.runs.optimizers import make_optimizer
from affdiv.experiments.runs.reads import read_steps
from affdiv.experiments.runs.stacked import StackedEnsemble, stack_failure

if TYPE_CHECKING:
    from affdiv.experiments.data.dataset import Dataset

_EVAL_CHUNK = 4096
#: The metrics every run records (``RunResult.metrics``), and those runs of the ``target`` budget add.
METRICS = ("test_accuracy", "test_loss", "val_accuracy", "val_loss", "train_loss", "diverged", "lr",
           "lr_at_grid_edge", "steps", "epochs")
TARGET_METRICS = ("steps_to_target", "censored", "max_steps", "target")

log = logging.getLogger(__name__)


def metric_names(config: RunConfig) -> tuple[str, ...]:
    """The metrics a run of ``config`` records: what a preset's ``[analysis] metric`` may name."""
    tuned_momentum = config.optimizer == "momentum" and config.lr_rule == "tuned" and bool(config.momentum_grid)
    return (*METRICS, *(("tuned_momentum",) if tuned_momentum else ()),
            *(TARGET_METRICS if config.budget == "target" else ()))


@dataclass
class RunResult:
    """A finished run: final metrics, one curve point per read, seconds taken (of them
    ``check_seconds`` in checks: its candidates' shares of the ensemble's evaluations of the
    validation split), measurements, and (target budget) every candidate's curve."""

    metrics: dict
    curves: list[dict]
    seconds: float
    data_fingerprint: str
    measurements: list[dict] = field(default_factory=list)
    candidates: list[dict] = field(default_factory=list)  # target budget: every candidate's lr and curve
    check_seconds: float = 0.0


class MeasurementFn(Protocol):
    """The one call signature of every measurement taken along training (see :class:`Measurement`)."""

    def __call__(self, model: torch.nn.Module, step: int, data: Dataset, config: RunConfig) -> Mapping: ...


@dataclass(frozen=True)
class Measurement:
    """``fn(model, step, data, config) -> dict`` of JSON numbers (:class:`MeasurementFn`), called
    at step 0 and every ``every`` steps of every run (after that step's update; see the module
    docstring). ``model`` is a copy, in train mode, so nothing the callback does (a forward in
    train mode updates BatchNorm's statistics) reaches training; ``data`` is the run's
    :class:`~affdiv.experiments.data.dataset.Dataset` (all its splits), ``config`` its
    :class:`RunConfig`. ``fn`` must be picklable (a module-level function) to reach a sweep's
    workers."""

    name: str
    every: int
    fn: MeasurementFn

    def __post_init__(self):
        check_int(f"measurement {self.name!r}: every", self.every)


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Mean cross-entropy and accuracy in eval mode (BatchNorm uses its running statistics)."""
    if len(y) == 0:
        raise ValueError("evaluate needs at least one sample, got an empty split")
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = 0
    for start in range(0, len(y), _EVAL_CHUNK):
        logits = model(x[start : start + _EVAL_CHUNK])
        target = y[start : start + _EVAL_CHUNK]
        loss_sum += F.cross_entropy(logits, target, reduction="sum").double()
        correct += int((logits.argmax(dim=1) == target).sum())
    model.train()
    return {"loss": float(loss_sum) / len(y), "accuracy": correct / len(y)}


def steps_per_epoch(config: RunConfig, n_train: int) -> int:
    """Full batches per pass over ``n_train`` samples (at least one, else a ValueError)."""
    if config.batch_size > n_train:
        raise ValueError(
            f"batch_size {config.batch_size} exceeds the {n_train} training samples of {config.dataset}"
        )
    return n_train // config.batch_size


def max_steps(config: RunConfig, n_train: int) -> int:
    """The steps a run may take: length epochs of full batches, or length steps."""
    return config.length * steps_per_epoch(config, n_train) if config.budget == "epochs" else config.length


def build_member(config: RunConfig, data, seed: int) -> torch.nn.Module:
    """The network of ``config`` for ``data`` (a built-in method's, or its ``model`` factory's),
    initialised under ``torch.manual_seed(seed)``, on the config's device and dtype, in train mode."""
    torch.manual_seed(seed)
    # (the dtype always: a factory may build its network in another)
    model = build_network(config, tuple(data.input_shape), data.num_classes).to(config.device,
                                                                                  getattr(torch, config.dtype))
    return model.train()


class OneAtATime:
    """K models as separate modules, each with its torch.optim optimizer, stepped one after the
    other: the arithmetic of a model trained alone. Same interface as ``StackedEnsemble``."""

    def __init__(self, models, optimizer: str, lrs, momenta, train, val):
        self.models = list(models)
        self.optimizers = [make_optimizer(optimizer, m.parameters(), lr, mu) for m, lr, mu in zip(models, lrs, momenta)]
        self.train_splits, self.val_splits = list(train), list(val)

    def __len__(self) -> int:
        return len(self.models)

    def step(self, batches: torch.Tensor) -> torch.Tensor:
        losses = []
        for model, optimizer, (x, y), batch in zip(self.models, self.optimizers, self.train_splits, batches):
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    def evaluate(self) -> list[dict]:
        return [evaluate(model, *split) for model, split in zip(self.models, self.val_splits)]

    def model(self, k: int) -> torch.nn.Module:
        return self.models[k]

    def copy(self, k: int) -> torch.nn.Module:
        """Model k as a new module (its parameters and buffers now; a deep copy of a Parameter
        leaves its ``.grad`` behind), in train mode."""
        return copy.deepcopy(self.models[k]).train()

    def finite(self) -> torch.Tensor:
        """Per model (bool, K): whether all its parameters and buffers are finite."""
        return torch.tensor([all(bool(t.isfinite().all()) for t in (*m.parameters(), *m.buffers()))
                             for m in self.models])

    def keep(self, index: Sequence[int]) -> None:
        for name in ("models", "optimizers", "train_splits", "val_splits"):
            setattr(self, name, [getattr(self, name)[i] for i in index])


@dataclass(eq=False)
class Candidate:
    """One model a run trains: its lr and momentum, the steps it may take, what it did."""

    run: _Run
    lr: float
    momentum: float | None
    max_steps: int
    curves: list[dict] = field(default_factory=list)
    measurements: list[dict] = field(default_factory=list)
    diverged: bool = False
    reached: dict[float, int] = field(default_factory=dict)  # target -> the read at which it was first reached
    check_seconds: float = 0.0  # its share of the checks' evaluations (each split evenly among the models)
    model: torch.nn.Module | None = None  # the final model, once it stopped
    # A ladder above the primary target: the model as it was at the read that reached the primary one.
    at_primary: torch.nn.Module | None = None

    def check(self, epoch: int, step: int, train_loss: float, val: dict) -> None:
        """Record a read: its curve point, divergence, and the targets it reached."""
        self.curves.append({"epoch": epoch, "step": step, "train_loss": train_loss,
                            "val_loss": val["loss"], "val_metric": val["accuracy"]})
        self.diverged = not all(math.isfinite(v) for v in (train_loss, val["loss"]) if v is not None)
        if self.diverged:
            return
        for target in self.run.ladder:
            if target not in self.reached and val["accuracy"] >= target:
                self.reached[target] = step
                first = self.run.first_reached
                first[target] = min(first.get(target, step), step)

    def done(self, step: int) -> bool:
        """Whether it stops at this read: diverged, out of steps, or, for every target it has not
        reached, another candidate of its run already has (at this read or before: none of the
        rest could reach it in fewer steps)."""
        if self.diverged or step >= self.max_steps:
            return True
        first = self.run.first_reached
        return bool(self.run.ladder) and all(t in self.reached or first.get(t, step + 1) <= step
                                              for t in self.run.ladder)

    def stored(self) -> dict:
        """What the store keeps of it: lr, momentum, whether it diverged, its curve."""
        return {"lr": self.lr, "momentum": self.momentum, "diverged": int(self.diverged), "curve": self.curves}


class _Run:
    """A run being trained: its config, data and candidates (grid extensions included)."""

    def __init__(self, config: RunConfig, data):
        self.config, self.data = config, data
        self.per_epoch = steps_per_epoch(config, len(data.train.y))
        self.max_steps = max_steps(config, len(data.train.y))
        self.ladder = config.ladder if config.budget == "target" else ()
        self.beyond_primary = bool(self.ladder) and self.ladder[-1] > config.target
        self.interpolate = config.read_spacing is not None
        self.adaptive = config.budget == "target" and config.sparse_spacing is not None
        self.reads = set(read_steps(self.max_steps, eval_every=config.eval_every, read_spacing=config.read_spacing)) \
            if config.budget == "target" and not self.adaptive else set()
        self.first_reached: dict[float, int] = {}  # target -> the first read at which a candidate reached it
        self.candidates = [Candidate(self, lr, mu, self.max_steps) for lr, mu in candidates(config)]
        self.extensions = 0
        self.at_init: dict[str, Mapping] = {}  # step-0 measurements by name, shared by its candidates

    def best(self, target: float | None = None) -> Candidate:
        """The best candidate at ``target`` (default: the primary one; none outside the target
        budget), by :func:`~affdiv.experiments.runs.reads.rank`."""
        if self.config.budget != "target":
            return max(self.candidates, key=lambda c: reads.rank(c.stored(), None))
        index, _steps = reads.choose([c.stored() for c in self.candidates],
                                     self.config.target if target is None else target, interpolate=self.interpolate)
        return self.candidates[index]

    def lrs(self) -> list[float]:
        return sorted({c.lr for c in self.candidates})

    def extend(self) -> list[Candidate]:
        """New candidates one ×2 step beyond each edge that the best lr at some target sits on
        (target budget, tuned, extensions left); else none. They train until beaten at every
        target (:meth:`Candidate.done`)."""
        config = self.config
        if config.budget != "target" or config.lr_rule != "tuned" or self.extensions >= config.grid_extensions:
            return []
        chosen, lrs = {self.best(t).lr for t in self.ladder}, self.lrs()
        new = [lr for lr, edge in ((lrs[-1] * 2, lrs[-1]), (lrs[0] / 2, lrs[0])) if edge in chosen]
        if not new:
            return []
        self.extensions += 1
        momenta = list(dict.fromkeys(mu for _lr, mu in candidates(config)))
        fresh = [Candidate(self, lr, mu, self.max_steps) for lr in new for mu in momenta]
        self.candidates += fresh
        return fresh

    def tested(self) -> tuple[torch.nn.Module | None, dict]:
        """The model whose test split :meth:`result` reports (None: it diverged, nothing to
        evaluate) and the read its metrics come from: the primary target's chosen candidate at its
        last read, or, when it trained on towards a higher target after reaching the primary one,
        at the read that reached it (its model kept then)."""
        config, best = self.config, self.best()
        model, last = best.model, best.curves[-1]
        if best.at_primary is not None:
            model = best.at_primary
            last = next(p for p in best.curves if p["step"] == best.reached[config.target])
        return (None if model is best.model and best.diverged else model), last

    def result(self, last: dict, test: dict | None) -> RunResult:
        """The chosen candidate's metrics and curves (seconds: 0), every candidate's curve under
        the target budget, from :meth:`tested`'s read ``last`` and its model's test loss and
        accuracy ``test`` (None where it diverged: loss nan, accuracy at chance)."""
        config, best, diverged = self.config, self.best(), test is None
        if diverged:
            test = {"loss": float("nan"), "accuracy": 1.0 / self.data.num_classes}
        lrs = self.lrs()
        metrics = {
            "test_accuracy": test["accuracy"],
            "test_loss": test["loss"],
            "val_accuracy": last["val_metric"],
            "val_loss": last["val_loss"],
            "train_loss": last["train_loss"],
            "diverged": int(diverged),
            "lr": best.lr,
            # A tuned LR on the edge of the lrs tried may not be the optimum.
            "lr_at_grid_edge": int(config.lr_rule == "tuned" and best.lr in (lrs[0], lrs[-1])),
            "steps": last["step"],
            "epochs": last["epoch"],
        }
        if "tuned_momentum" in metric_names(config):
            metrics["tuned_momentum"] = best.momentum
        stored = []
        if config.budget == "target":
            stored = [c.stored() for c in self.candidates]
            primary = reads.best_at_targets(stored, [config.target], max_steps=self.max_steps,
                                            interpolate=self.interpolate, tuned=config.lr_rule == "tuned")
            # (its "diverged" is the one above: the kept model diverged before reaching the target)
            metrics.update(target=config.target,
                           **{k: primary[config.target][k] for k in ("steps_to_target", "censored", "max_steps")})
            if not self.interpolate and metrics["steps_to_target"] is not None:
                metrics["steps_to_target"] = int(metrics["steps_to_target"])  # a read's step, as ever
        return RunResult(metrics, best.curves, 0.0, str(self.data.fingerprint), best.measurements, stored)


class _Tensors:
    """Each dataset's splits as tensors on one device and dtype, made once per dataset."""

    def __init__(self, config: RunConfig):
        self.device, self.dtype = torch.device(config.device), getattr(torch, config.dtype)
        self._made: dict = {}

    def __call__(self, data, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(data), split)
        if key not in self._made:
            part = getattr(data, split)
            x = torch.as_tensor(part.x, device=self.device)
            x = x if x.dtype == self.dtype else x.to(self.dtype)
            self._made[key] = (data, x, torch.as_tensor(part.y, device=self.device))  # data: keeps id(data) valid
        return self._made[key][1:]


def _is_check(run: _Run, step: int, epoch_end: bool, last: int) -> bool:
    if run.config.budget == "target":
        return step in run.reads
    return epoch_end or step == last


def _lockstep(cands: list[Candidate], engine_type, tensors: _Tensors, measurements: Sequence[Measurement]) -> None:
    """Train ``cands`` (of runs sharing one ensemble key) together; each stops when it diverges,
    reaches its max steps, or its run stops (target reached). Sets their curves, flags, models."""
    first = [id(c.run.data) for c in cands]
    cands = sorted(cands, key=lambda c: first.index(id(c.run.data)))  # models on one split together
    config, run = cands[0].run.config, cands[0].run
    models = [build_member(c.run.config, c.run.data, c.run.config.seed) for c in cands]
    engine = engine_type(models, config.optimizer, [c.lr for c in cands], [c.momentum for c in cands],
                         [tensors(c.run.data, "train") for c in cands], [tensors(c.run.data, "val") for c in cands])
    del models
    shuffles = [torch.Generator().manual_seed(c.run.config.seed) for c in cands]
    n, batch, last = len(cands[0].run.data.train.y), config.batch_size, max(c.max_steps for c in cands)
    has_val = len(cands[0].run.data.val.y) > 0
    train_dtype = tensors(run.data, "train")[0].dtype

    def measure(step: int) -> None:
        due = [m for m in measurements if step % m.every == 0]
        if not due:
            return
        active = engine.finite().tolist()
        with torch.random.fork_rng(devices=[tensors.device] if tensors.device.type == "cuda" else []):
            for k, cand in enumerate(cands):
                for m in due if active[k] else ():
                    values = cand.run.at_init.get(m.name) if step == 0 else None
                    if values is None:
                        values = m.fn(engine.copy(k), step, cand.run.data, cand.run.config)
                        if step == 0:
                            cand.run.at_init[m.name] = values
                    cand.measurements.append({"measurement": m.name, "step": step, **values})

    step, since, epoch, i = 0, 0, 0, run.per_epoch
    loss_sum = torch.zeros(len(cands), dtype=train_dtype, device=tensors.device)
    adaptive = _AdaptiveReads(run) if run.adaptive else None
    measure(0)
    while cands:
        if i == run.per_epoch:  # a new epoch: a fresh shuffle per model
            epoch, i = epoch + 1, 0
            orders = torch.stack([torch.randperm(n, generator=g) for g in shuffles]).to(tensors.device)
        if adaptive is not None and adaptive.last == step and adaptive.sparse_next:  # the state to re-train from
            begin = time.perf_counter()
            adaptive.save(engine, (step, epoch, i, orders, shuffles), cands)
            _charge(cands, time.perf_counter() - begin)
        loss_sum += engine.step(orders[:, i * batch : (i + 1) * batch])
        step, since, i = step + 1, since + 1, i + 1
        measure(step)
        is_check = step == adaptive.next if adaptive is not None else _is_check(run, step, i == run.per_epoch, last)
        if not is_check:
            continue
        sums = loss_sum.tolist()  # one device sync per check
        begin = time.perf_counter()
        val = engine.evaluate() if has_val else [{"loss": None, "accuracy": None}] * len(cands)
        _charge(cands, time.perf_counter() - begin)
        if adaptive is not None and adaptive.missed(step, cands, val):  # re-train the stretch, read densely
            engine, (step, epoch, i, orders, shuffles) = adaptive.restore(cands)
            loss_sum, since = torch.zeros(len(cands), dtype=train_dtype, device=tensors.device), 0
            continue
        for cand, total, point in zip(cands, sums, val):
            cand.check(epoch, step, total / since, point)
        for k, cand in enumerate(cands):  # the primary target's result is the model there, not past it
            if cand.run.beyond_primary and cand.reached.get(cand.run.config.target) == step:
                cand.at_primary = engine.copy(k)
        going = [k for k, c in enumerate(cands) if not c.done(step)]
        if len(going) < len(cands):
            for k in set(range(len(cands))) - set(going):
                cands[k].model = engine.model(k)
            engine.keep(going)
            cands, shuffles = [cands[k] for k in going], [shuffles[k] for k in going]
            orders = orders[torch.tensor(going, dtype=torch.long, device=orders.device)]
        if adaptive is not None:
            adaptive.read(step, cands)
        loss_sum = torch.zeros(len(cands), dtype=train_dtype, device=tensors.device)
        since = 0


def _charge(cands: Sequence[Candidate], seconds: float) -> None:
    """Add ``seconds`` of checking to ``cands``' check times, split evenly among them."""
    for cand in cands:
        cand.check_seconds += seconds / len(cands)


class _AdaptiveReads:
    """The reads of a lockstep under ``sparse_spacing`` (:mod:`~affdiv.experiments.runs.reads`,
    *Adaptive reads*): where the next one falls, the training state at the last one, and the
    re-training of a sparse stretch in which some run first reached a target.

    The state kept at each read followed by a sparse gap is the engine (its models and optimiser state; the data splits
    are shared, not copied), the position in the epoch, the epoch's shuffles and their
    generators' states, and how many measurements each candidate has: training from it again
    takes the same steps on the same batches, so the re-trained stretch ends where the first
    pass did, now read at the dense spacing. Nothing of a read is recorded before it is known
    not to be re-trained."""

    def __init__(self, run: _Run):
        config = run.config
        self.dense, self.sparse, self.max_steps = config.read_spacing, config.sparse_spacing, run.max_steps
        self.last, self.next, self.dense_until = 0, 1, 0
        self.sparse_next = False  # whether the gap after the last read is sparse (then its state is kept)
        self._saved = None

    def _gap(self, step: int, spacing: float) -> int:
        return reads.next_read(step, self.max_steps, spacing) - step

    def save(self, engine, position: tuple, cands: Sequence[Candidate]) -> None:
        step, epoch, i, orders, shuffles = position
        data = [t for split in (*engine.train_splits, *engine.val_splits) for t in split]
        engine_copy = copy.deepcopy(engine, memo={id(t): t for t in data})
        self._saved = (engine_copy, (step, epoch, i, orders.clone(), list(shuffles)),
                       [g.get_state() for g in shuffles], [len(c.measurements) for c in cands])

    def missed(self, step: int, cands: Sequence[Candidate], val: Sequence[dict]) -> bool:
        """Whether this read came after a sparse gap and some candidate reached a target that no
        candidate of its run had reached at an earlier read (a grid extension's candidates train
        after the others, so "earlier" is by step): its crossing must be located by dense reads."""
        if not self.sparse_next:
            return False
        return any(point["accuracy"] is not None and point["accuracy"] >= t
                   for cand, point in zip(cands, val) for t in cand.run.ladder
                   if t not in cand.reached and cand.run.first_reached.get(t, math.inf) >= step
                   and math.isfinite(point["loss"]))

    def restore(self, cands: Sequence[Candidate]) -> tuple:
        """The engine and position saved at the last read (the stretch since then re-read densely)."""
        engine, (step, epoch, i, orders, shuffles), states, lengths = self._saved
        for g, state in zip(shuffles, states):
            g.set_state(state)
        for cand, length in zip(cands, lengths):
            del cand.measurements[length:]
        self.dense_until, self.next = self.next, step + self._gap(step, self.dense)
        self.sparse_next, self._saved = False, None
        return engine, (step, epoch, i, orders, shuffles)

    def read(self, step: int, cands: Sequence[Candidate]) -> None:
        """After a read at ``step``: the next one, at the dense spacing while a target may be near."""
        near = step < self.dense_until or any(
            reads.near_target(c.curves, c.run.ladder, c.run.first_reached, self._gap(step, self.sparse))
            for c in cands)
        self.last, self.next = step, step + self._gap(step, self.dense if near else self.sparse)
        self.sparse_next = self.next - step > self._gap(step, self.dense)


def train_runs(configs: Sequence[RunConfig], datasets: Sequence, *, stacked: bool = False,
               measurements: Sequence[Measurement] = ()) -> list[RunResult]:
    """Train ``configs`` (one :func:`~affdiv.experiments.runs.ensembles.ensemble_key`; each on its
    dataset) in lockstep, all candidates as one stacked ensemble or as separate modules; one
    result per config. A run's seconds are the training time in proportion to its model-steps,
    plus an equal share of the test evaluation (one pass for all the runs when stacked) unless it
    diverged (then it has no test evaluation)."""
    if len({ensemble_key(c) for c in configs}) > 1:
        raise ValueError("train_runs needs runs that differ only in seed, data split and learning-rate settings; "
                         f"got {len({ensemble_key(c) for c in configs})} kinds")
    start = time.perf_counter()
    runs = [_Run(config, data) for config, data in zip(configs, datasets, strict=True)]
    tensors = _Tensors(configs[0])
    pending = [cand for run in runs for cand in run.candidates]
    while pending:
        _lockstep(pending, _stacked if stacked else OneAtATime, tensors, measurements)
        pending = [cand for run in runs for cand in run.extend()]
    trained = time.perf_counter() - start
    model_steps = [sum(c.curves[-1]["step"] for c in run.candidates) for run in runs]
    chosen = [run.tested() for run in runs]
    begin = time.perf_counter()
    tests = _test([model for model, _last in chosen], [run.data for run in runs], tensors, stacked)
    share = (time.perf_counter() - begin) / max(1, sum(test is not None for test in tests))
    results = []
    for run, steps, (_model, last), test in zip(runs, model_steps, chosen, tests):
        result = run.result(last, test)
        result.seconds = trained * steps / sum(model_steps) + (0.0 if test is None else share)
        result.check_seconds = sum(c.check_seconds for c in run.candidates)
        results.append(result)
    return results


def _test(models: Sequence[torch.nn.Module | None], datasets: Sequence, tensors: _Tensors,
          stacked: bool) -> list[dict | None]:
    """Each model (:meth:`_Run.tested`'s) evaluated on its dataset's test split, None for None (a
    diverged run): stacked, all of them in one evaluation by the stacked engine (its checks' code;
    the optimiser it is built with never steps), else one at a time."""
    index = [i for i, model in enumerate(models) if model is not None]
    splits = [tensors(datasets[i], "test") for i in index]
    if stacked and index:
        picked = [models[i] for i in index]
        engine = _stacked(picked, "sgd", [0.0] * len(picked), [None] * len(picked), splits, splits)
        metrics = engine.evaluate()
    else:
        metrics = [evaluate(models[i], *split) for i, split in zip(index, splits)]
    tests: list[dict | None] = [None] * len(models)
    for i, metric in zip(index, metrics):
        tests[i] = metric
    return tests


def train_run(config: RunConfig, data, measurements: Sequence[Measurement] = ()) -> RunResult:
    """Train ``config`` on ``data`` (an ``affdiv.experiments.data.Dataset``) one candidate model
    at a time, and test it once."""
    return train_runs([config], [data], measurements=measurements)[0]


_STACKABLE: dict[tuple, str | None] = {}


def stacked_engine(model: torch.nn.Module, input_shape: Sequence[int] | None = None) -> type:
    """The engine that trains models like ``model`` stacked: batched layers where the model has a
    batched form (:func:`~affdiv.experiments.runs.batched.is_batched`) and a sample is a vector
    or an image (C, H, W) (``input_shape``; None: assumed so), else the vmapped ensemble."""
    batched = is_batched(model) and (input_shape is None or len(input_shape) in (1, 3))
    return BatchedEnsemble if batched else StackedEnsemble


def _stacked(models, optimizer, lrs, momenta, train, val):
    """The stacked engine of :func:`stacked_engine` for ``models`` on their training inputs."""
    engine = stacked_engine(models[0], tuple(train[0][0].shape[1:]))
    return engine(models, optimizer, lrs, momenta, train, val)


def train_group(configs: Sequence[RunConfig], datasets: Sequence, *, stack: bool = True,
                measurements: Sequence[Measurement] = ()) -> list[RunResult]:
    """Train runs of one ensemble key (with their ``measurements``): stacked if ``stack``, else
    (and where ``torch.func`` cannot stack the model, which is logged) each run by :func:`train_run`."""
    config, data = configs[0], datasets[0]
    reason = None
    if stack:
        key = (ensemble_key(config), tuple(data.input_shape), data.num_classes)
        if key not in _STACKABLE:  # tried on the engine that will train them, 3 samples (not K = 2)
            x = torch.as_tensor(data.train.x[:3], device=config.device).to(getattr(torch, config.dtype))
            y = torch.as_tensor(data.train.y[:3], device=config.device)
            engine = stacked_engine(build_member(config, data, 0), tuple(data.input_shape))
            _STACKABLE[key] = stack_failure(lambda: build_member(config, data, 0), config.optimizer, (x, y), engine)
        reason = _STACKABLE[key] and f"torch.func cannot stack it ({_STACKABLE[key]})"
    if stack and not reason:
        return train_runs(configs, datasets, stacked=True, measurements=measurements)
    if stack:
        log.warning("training %d run(s) of method %s one at a time, not stacked: %s",
                    len(configs), config.method, reason)
    return [train_run(c, d, measurements) for c, d in zip(configs, datasets, strict=True)]

"""One training run: a config in, its metrics and per-epoch curves out.

Optimisation is plain SGD as in the paper (no weight decay, no gradient clipping); momentum SGD
and Adam are options. The budget is explicit: ``length`` epochs or ``length`` optimizer steps,
every step on a full batch (the last partial batch of an epoch is dropped, so every update sees
exactly ``batch_size`` samples). The learning rate for batch size B follows ``lr_rule``:

    constant   lr = base_lr
    linear     lr = base_lr * B / ref_batch_size
    sqrt       lr = base_lr * sqrt(B / ref_batch_size)
    tuned      every lr in ``lr_grid`` is trained (same init, same shuffles); the one with the best
               validation accuracy is kept, and only then is the test split evaluated, once.

A run whose training or validation loss becomes non-finite is *diverged*: that is a result, not
an error. Its test accuracy is recorded as chance, 1/num_classes (a network with non-finite
weights predicts nothing better than a guess; a number, not NaN, so that every run keeps a row in
the records), its test loss as NaN (null in the store), and ``diverged`` = 1 marks it. The
analysis never lets such a run decide a verdict: a method with a diverged run in a group is
inconclusive there (:mod:`affdiv.experiments.analysis.decision`).

``val_fraction`` = 0 trains without a validation split: the curves and metrics then carry no
validation numbers (None), and divergence is judged on the training loss alone. The ``tuned``
rule selects on validation accuracy, so it requires ``val_fraction`` > 0.

Determinism: the init is seeded by ``torch.manual_seed(seed)`` and the shuffles by their own
``torch.Generator``; on CPU with a fixed thread count the same config gives the same numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from affdiv.experiments.runs.config import RunConfig, learning_rates
from affdiv.experiments.runs.models import build_model

_EVAL_CHUNK = 4096


@dataclass
class RunResult:
    """A finished run: final metrics, one curve point per (possibly partial) epoch, seconds taken."""

    metrics: dict
    curves: list[dict]
    seconds: float
    data_fingerprint: str


def make_optimizer(config: RunConfig, params, lr: float) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=0.0)
    if config.optimizer == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=0.0)
    return torch.optim.Adam(params, lr=lr, weight_decay=0.0)


def _tensors(split, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(split.x, device=device), torch.as_tensor(split.y, device=device)


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


def _fit(config: RunConfig, data, lr: float, train, val) -> tuple[torch.nn.Module, list[dict], bool, int]:
    """Train one model at ``lr``; returns (model, per-epoch curves, diverged, steps taken)."""
    (x, y), (x_val, y_val) = train, val
    n = len(y)
    per_epoch = steps_per_epoch(config, n)
    total = config.length * per_epoch if config.budget == "epochs" else config.length

    torch.manual_seed(config.seed)
    model = build_model(
        config.method,
        input_shape=tuple(data.input_shape),
        num_classes=data.num_classes,
        depth=config.depth,
        width=config.width,
        activation=config.activation,
    ).to(config.device)
    optimizer = make_optimizer(config, model.parameters(), lr)
    shuffle = torch.Generator().manual_seed(config.seed)
    model.train()

    curves: list[dict] = []
    step, epoch, diverged = 0, 0, False
    while step < total and not diverged:
        order = torch.randperm(n, generator=shuffle).to(config.device)
        loss_sum = torch.zeros((), device=config.device)
        taken = min(per_epoch, total - step)
        for i in range(taken):
            batch = order[i * config.batch_size : (i + 1) * config.batch_size]
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        step += taken
        epoch += 1
        train_loss = float(loss_sum) / taken  # one device sync per epoch
        val_metrics = evaluate(model, x_val, y_val) if len(y_val) else {"loss": None, "accuracy": None}
        diverged = not all(math.isfinite(v) for v in (train_loss, val_metrics["loss"]) if v is not None)
        curves.append(
            {
                "epoch": epoch,
                "step": step,
                "train_loss": train_loss,
                "val_loss": val_metrics["loss"],
                "val_metric": val_metrics["accuracy"],
            }
        )
    return model, curves, diverged, step


def train_run(config: RunConfig, data) -> RunResult:
    """Train ``config`` on ``data`` (an ``affdiv.experiments.data.Dataset``) and test it once."""
    start = time.perf_counter()
    device = torch.device(config.device)
    train, val = _tensors(data.train, device), _tensors(data.val, device)

    # Candidates are ranked by (not diverged, val accuracy, -val loss, -lr): larger is better.
    best = None  # (rank, lr, model, curves, diverged, steps)
    for lr in learning_rates(config):
        model, curves, diverged, steps = _fit(config, data, lr, train, val)
        last = curves[-1]
        if diverged or last["val_loss"] is None:  # no validation split: a single-lr rule, nothing to rank
            key = (not diverged, 0.0, 0.0, -lr)
        else:
            key = (True, last["val_metric"], -last["val_loss"], -lr)
        if best is None or key > best[0]:
            best = (key, lr, model, curves, diverged, steps)
    _key, lr, model, curves, diverged, steps = best

    if diverged:
        test = {"loss": float("nan"), "accuracy": 1.0 / data.num_classes}
    else:
        test = evaluate(model, *_tensors(data.test, device))
    last = curves[-1]
    metrics = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "val_accuracy": last["val_metric"],
        "val_loss": last["val_loss"],
        "train_loss": last["train_loss"],
        "diverged": int(diverged),
        "lr": lr,
        # A tuned LR on the edge of its grid may not be the optimum: the grid should be widened.
        "lr_at_grid_edge": int(config.lr_rule == "tuned" and lr in (min(config.lr_grid), max(config.lr_grid))),
        "steps": steps,
        "epochs": len(curves),
    }
    return RunResult(metrics, curves, time.perf_counter() - start, str(data.fingerprint))

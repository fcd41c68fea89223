"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al., "An Empirical Model of
Large-Batch Training", arXiv 1812.06162, appendix A), measured during training.

G is the full-batch gradient and Sigma the per-example gradient covariance. For a batch of B
examples drawn independently (with replacement) the mean gradient G_B has

    E |G_B|^2 = |G|^2 + tr(Sigma) / B,

so two batch sizes B_small < B_big give unbiased estimates of both terms:

    |G|^2   ~  (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

:func:`estimate` averages |G_small|^2 and |G_big|^2 over repeated draws *before* forming the two
estimates and their ratio (each estimate is unbiased; the ratio is not, but its bias shrinks as
the averages settle, which is why McCandlish et al. average first). Batches are drawn with
replacement from the training split, so the formulas hold exactly for that split's own gradient
mean and covariance (without replacement tr(Sigma) would carry the factor (N - B)/(N - 1)).

B_simple predicts the critical batch size B_crit of the steps-to-target curve when the Hessian is
well conditioned (McCandlish et al.: B_crit ~ B_simple up to a factor of a few); the report puts
the two side by side.

Use in a sweep: :func:`measurement` gives a
:class:`~affdiv.experiments.runs.training.Measurement` for ``run_sweep(..., measurements=[...])``
(``affdiv falsify --noise-scale-every N``, or a preset's ``[measure] noise_scale_every = N``);
:func:`record_columns` turns a run's measurement dicts into the record columns ``b_simple_init``
(at step 0) and ``b_simple`` (at the last measured step) that the critical-batch analysis reports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "noise_scale"


@dataclass(frozen=True)
class NoiseScale:
    """Estimates from averaged squared gradient norms at two batch sizes."""

    b_simple: float  # tr(Sigma) / |G|^2; nan when the |G|^2 estimate is not positive
    grad_sq: float  # estimate of |G|^2
    trace: float  # estimate of tr(Sigma)
    b_small: int
    b_big: int
    n_draws: int

    def to_dict(self) -> dict:
        return {"b_simple": self.b_simple, "grad_sq": self.grad_sq, "trace": self.trace, "b_small": self.b_small,
                "b_big": self.b_big, "n_draws": self.n_draws}


def estimate(sq_small: float, sq_big: float, b_small: int, b_big: int, n_draws: int = 1) -> NoiseScale:
    """The two unbiased estimates and B_simple from mean |G_small|^2 and mean |G_big|^2.

    A non-positive |G|^2 estimate (gradient noise swamping the signal, e.g. near a minimum) or a
    negative tr(Sigma) estimate gives B_simple = nan rather than a negative or infinite number; a
    non-finite squared norm (a diverging model whose gradients overflowed) gives nan for all three.
    """
    if not (isinstance(b_small, int) and isinstance(b_big, int) and 0 < b_small < b_big):
        raise ValueError(f"need integer batch sizes 0 < b_small < b_big, got {b_small!r} and {b_big!r}")
    if sq_small < 0 or sq_big < 0:
        raise ValueError(f"squared norms must be >= 0, got {sq_small!r} and {sq_big!r}")
    if not (math.isfinite(sq_small) and math.isfinite(sq_big)):
        return NoiseScale(math.nan, math.nan, math.nan, b_small, b_big, n_draws)
    grad_sq = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    b_simple = trace / grad_sq if grad_sq > 0 and trace >= 0 else math.nan
    return NoiseScale(b_simple, grad_sq, trace, b_small, b_big, n_draws)


def _cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def squared_gradient_norm(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> float:
    """|grad of the mean loss over (x, y)|^2 w.r.t. every trainable parameter (float64 sum)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss_fn(model, x, y), params)
    return float(sum(g.detach().double().pow(2).sum() for g in grads))


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, b_small: int, b_big: int, draws: int,
            generator: torch.Generator, loss_fn: Callable = _cross_entropy) -> NoiseScale:
    """B_simple of ``model`` on the examples (x, y): ``draws`` independent pairs of batches (with
    replacement), |G|^2 of each averaged, then :func:`estimate`. The model is used as given
    (train or eval mode is the caller's choice; BatchNorm in train mode couples a batch's
    examples, so its "per-example" gradients are not independent: measure such models in eval mode)."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    n = len(y)
    small = big = 0.0
    for _ in range(draws):
        index = torch.randint(n, (b_big,), generator=generator).to(x.device)
        big += squared_gradient_norm(model, loss_fn, x[index], y[index])
        index = torch.randint(n, (b_small,), generator=generator).to(x.device)
        small += squared_gradient_norm(model, loss_fn, x[index], y[index])
    return estimate(small / draws, big / draws, b_small, b_big, draws)


def _measure_run(model: torch.nn.Module, step: int, data, config, *, b_small: int, b_big: int, draws: int,
                 seed: int) -> dict:
    """The :class:`Measurement` callback: B_simple on the run's training split, in eval mode."""
    model.eval()
    parameter = next(model.parameters())
    x = torch.as_tensor(data.train.x, device=parameter.device, dtype=parameter.dtype)
    y = torch.as_tensor(data.train.y, device=parameter.device)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return measure(model, x, y, b_small=b_small, b_big=b_big, draws=draws, generator=generator).to_dict()


def measurement(*, every: int, b_small: int = 32, b_big: int = 1024, draws: int = 8, seed: int = 0):
    """A :class:`~affdiv.experiments.runs.training.Measurement` named ``noise_scale`` that measures
    B_simple at step 0 and every ``every`` steps (picklable: it reaches a sweep's workers)."""
    from affdiv.experiments.runs.training import Measurement

    estimate(1.0, 0.5, b_small, b_big)  # checks the batch sizes now, not in a worker
    return Measurement(NAME, every, functools.partial(_measure_run, b_small=b_small, b_big=b_big, draws=draws,
                                                      seed=seed))


def record_columns(measurements: Sequence[Mapping]) -> dict:
    """``b_simple_init`` (step 0) and ``b_simple`` (the last measured step) of a run's measurements
    (dicts {"measurement", "step", "b_simple", ...}); {} when it has none named ``noise_scale``."""
    mine = sorted((m for m in measurements if m.get("measurement") == NAME), key=lambda m: m["step"])
    if not mine:
        return {}
    out = {"b_simple": mine[-1]["b_simple"], "b_simple_step": mine[-1]["step"]}
    if mine[0]["step"] == 0:
        out["b_simple_init"] = mine[0]["b_simple"]
    return out

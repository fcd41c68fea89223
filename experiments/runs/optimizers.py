"""The optimisers of a run: torch.optim for one model, and the same updates on stacked tensors.

A stacked tensor holds K models' copies of one parameter along dim 0; every hyperparameter that
a run tunes (lr, momentum) is one value per model. For model k, with gradient g and step t ≥ 1
(no weight decay, no dampening, no Nesterov: the settings of :func:`make_optimizer`):

    sgd        θ ← θ − η_k g
    momentum   b ← g (t = 1),  b ← μ_k b + g (t > 1);   θ ← θ − η_k b
    adam       m ← m + (1−β₁)(g − m),  v ← β₂ v + (1−β₂) g²,
               θ ← θ − (η_k / (1−β₁ᵗ)) · m / (√v / √(1−β₂ᵗ) + ε)      (β₁, β₂, ε = 0.9, 0.999, 1e-8)

:class:`StackedOptimizer` runs these with the operations of torch.optim's single-tensor loops
(torch's default on CPU; here as ``torch._foreach_*`` calls over all the stacked tensors, which
run the same per-tensor kernels in one call), where a per-model value replaces the scalar: ``add_(g, alpha=−η)``
becomes ``addcmul_(g, −η_k)``, ``addcdiv_(m, d, value=−s)`` becomes ``addcdiv_(−s_k·m, d)``:
per element the same roundings in the same order (torch's kernels compute value·t1 before the
division). The test checks equality with torch.optim bit for bit on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def make_optimizer(optimizer: str, params, lr: float, momentum: float | None = None) -> torch.optim.Optimizer:
    """torch.optim for one model: plain SGD, momentum SGD (``momentum``) or Adam; no weight decay."""
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=0.0)
    if optimizer == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=0.0)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    raise ValueError(f"unknown optimizer {optimizer!r}; expected one of: sgd, momentum, adam")


class StackedOptimizer:
    """One optimiser step for K stacked models at once, each with its own lr (and momentum).

    ``params`` maps names to stacked tensors (K, ...), updated in place by :meth:`step`. Its state
    (momentum buffers, Adam moments) is stacked the same way; :meth:`keep` drops models from it.
    """

    def __init__(self, optimizer: str, params: Mapping[str, Tensor], lrs: Sequence[float],
                 momenta: Sequence[float | None] | None = None):
        if optimizer not in ("sgd", "momentum", "adam"):
            raise ValueError(f"unknown optimizer {optimizer!r}; expected one of: sgd, momentum, adam")
        first = next(iter(params.values()))
        self.optimizer, self.steps, self.state = optimizer, 0, {}
        self.lrs = [float(lr) for lr in lrs]
        self.momenta = [float(m) for m in momenta] if optimizer == "momentum" else None
        if len(self.lrs) != first.shape[0] or (self.momenta is not None and len(self.momenta) != first.shape[0]):
            raise ValueError(f"need one lr (and momentum) per stacked model: {first.shape[0]} models, "
                             f"got {len(self.lrs)} lrs and {None if momenta is None else len(momenta)} momenta")
        self._columns: dict = {}  # per-model values as broadcastable tensors, see ``_column``

    def _column(self, name: str, values: list[float], like: Tensor) -> Tensor:
        """``values`` (one per model, computed in double as torch.optim computes its scalars) as a
        tensor of ``like``'s dtype and device that broadcasts over it; cached until they change."""
        key = (name, like.dtype, like.device, like.dim())
        cached = self._columns.get(key)
        if cached is None or cached[0] != values:
            column = torch.tensor(values, dtype=like.dtype, device=like.device).reshape(-1, *([1] * (like.dim() - 1)))
            self._columns[key] = cached = (values, column)
        return cached[1]

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> None:
        """θ ← update(θ, g) for every stacked parameter (see the module docstring)."""
        self.steps += 1
        if self.optimizer == "adam":
            for name, param in params.items():
                self._adam(name, param, grads[name])
            return
        names = list(params)
        if not names:  # (every weight stepped in the backward)
            return
        tensors = [params[name] for name in names]
        neg_lrs = [self._neg_lrs(t) for t in tensors]
        step = [grads[name] for name in names]
        if self.optimizer == "momentum":
            if names[0] in self.state:
                buffers = [self.state[name] for name in names]
                torch._foreach_mul_(buffers, [self._column("momentum", self.momenta, t) for t in tensors])
                torch._foreach_add_(buffers, step)
            else:
                self.state.update((name, g.detach().clone()) for name, g in zip(names, step))
            step = [self.state[name] for name in names]
        torch._foreach_addcmul_(tensors, step, neg_lrs)

    def sgd_neg_lr(self, like: Tensor) -> Tensor:
        """Plain SGD's per-model −η as a column that broadcasts over ``like`` (K, ...), for a
        backward that makes the step θ ← θ + (−η_k) g of that parameter itself (the parameter
        then left out of :meth:`step`)."""
        if self.optimizer != "sgd":
            raise ValueError(f"only plain SGD's step is made in a backward, not {self.optimizer}'s")
        return self._neg_lrs(like)

    def _neg_lrs(self, like: Tensor) -> Tensor:
        """The per-model −η as a column that broadcasts over ``like``."""
        return self._column("lr", [-lr for lr in self.lrs], like)

    def _adam(self, name: str, param: Tensor, grad: Tensor) -> None:
        beta1, beta2 = ADAM_BETAS
        if name not in self.state:
            self.state[name] = (torch.zeros_like(param), torch.zeros_like(param))
        exp_avg, exp_avg_sq = self.state[name]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**self.steps
        bias_correction2_sqrt = (1 - beta2**self.steps) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(ADAM_EPS)
        # torch.optim: θ.addcdiv_(m, denom, value=s) = θ + s·m/denom with s = −lr/bias_correction1;
        # here s is per model, so it multiplies m first, as the kernel does with its scalar.
        neg_steps = [-lr / bias_correction1 for lr in self.lrs]
        param.addcdiv_(exp_avg * self._column("step", neg_steps, param), denom)

    def keep(self, index: Tensor) -> None:
        """Keep only the models at ``index`` (a 1-D long tensor), in that order."""
        picked = index.tolist()
        self.lrs = [self.lrs[i] for i in picked]
        if self.momenta is not None:
            self.momenta = [self.momenta[i] for i in picked]
        self._columns.clear()
        for name, value in self.state.items():
            if isinstance(value, tuple):
                self.state[name] = tuple(v.index_select(0, index.to(v.device)) for v in value)
            else:
                self.state[name] = value.index_select(0, index.to(value.device))

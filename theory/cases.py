"""Building numerical cases: site reshapes, seeds, correlated inputs, size validation (shared by
every derivation).

A *site* is one output vector that the theory treats as a unit: one spatial position of one
sample (conv: all output channels there), one token of one sequence (attention); a derivation's
``sites`` maps its output to one row per site.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


def channels_first_sites(t: Tensor) -> Tensor:
    """(B, C, *spatial) -> (B·∏spatial, C): one row per position of each sample."""
    return t.movedim(1, -1).reshape(-1, t.shape[1])


def channels_last_sites(t: Tensor) -> Tensor:
    """(B, T, C) -> (B·T, C): one row per token of each sequence."""
    return t.reshape(-1, t.shape[-1])


def seed_from(generator: torch.Generator) -> int:
    """A torch seed drawn from ``generator`` (so module initialisation follows the case seed)."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def correlated_rows(shape: tuple[int, ...], generator: torch.Generator, spread: float = 1.0) -> Tensor:
    """Float64 samples sharing a common offset (so kernels are far from diagonal), with per-sample
    norms spread over exp(±spread) (so diagonal factors vary)."""
    batch = shape[0]
    scale = torch.exp(torch.empty(batch, dtype=torch.float64).uniform_(-spread, spread, generator=generator))
    offset = torch.randn((1,) + shape[1:], dtype=torch.float64, generator=generator)
    noise = torch.randn(shape, dtype=torch.float64, generator=generator)
    return scale.reshape((batch,) + (1,) * (len(shape) - 1)) * (0.7 * noise + 0.5 * offset)


def require(sizes: Mapping[str, int], *keys: str) -> None:
    """Bad sizes name what was expected and what was given."""
    missing = [k for k in keys if k not in sizes]
    if missing:
        raise ValueError(f"sizes must give {keys}; missing {missing} in {dict(sizes)}")

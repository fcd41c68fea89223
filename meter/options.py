"""The meter's choices (scope, loss reduction, what to do with a module it cannot measure, the
memory of its chunked passes) and its errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from affdiv.checks import check_int

SCOPES = ("layer", "network")

REDUCTIONS = ("mean", "sum")

ON_UNSUPPORTED = ("skip", "raise")

DEFAULT_MEMORY_BUDGET = 256 * 2**20


class UnsupportedModuleError(ValueError):
    """A module the meter cannot measure; the message names it and says why."""


class UnmeasuredModuleWarning(UserWarning):
    """Warned for every module the meter leaves out (``on_unsupported="skip"``), naming it and why;
    the same reason is in ``DivergenceReport.skipped``."""


@dataclass(frozen=True)
class MeterOptions:
    """How the meter computes and what it keeps, never what it measures.

    Args:
        memory_budget: bytes for each chunked vmap pass (the bound in :mod:`affdiv.meter`'s docstring).
        masked_limit: in network scope, the largest batch for which the masked route (B full-batch
            passes) is run; above it the network's diagonals are not computed and
            ``network_diagonal_route`` says why. Default None: no limit.
        on_unsupported: ``"skip"`` (list the module in ``skipped`` and warn,
            :class:`UnmeasuredModuleWarning`) or ``"raise"`` (:class:`UnsupportedModuleError`).
        keep_updates: keep u, u* and d in each record (``effective``, ``ideal``, ``diagonal``).
    """

    memory_budget: int = DEFAULT_MEMORY_BUDGET
    masked_limit: int | None = None
    on_unsupported: str = "skip"
    keep_updates: bool = False

    def __post_init__(self):
        object.__setattr__(self, "memory_budget", check_int("memory_budget", self.memory_budget))  # bytes
        object.__setattr__(self, "masked_limit", check_int("masked_limit", self.masked_limit, allow_none=True))
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"on_unsupported must be one of {ON_UNSUPPORTED}, got {self.on_unsupported!r}")
        if not isinstance(self.keep_updates, bool):
            raise ValueError(f"keep_updates must be True or False, got {self.keep_updates!r}")

"""How a sweep trains its runs, as two values checked when they are made: :class:`SweepOptions`
(workers, threads, stacking, the ensembles' memory, the measurements along every run, retries)
and :class:`DaskOptions` (where the dask executor sends the units). Neither is part of a run's
key: they change how, where and with what measurements the runs train, never their numbers.

Torch-free and dask-free, so that the command line builds them before the work is imported.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from affdiv.checks import check_int, is_int

#: Default memory budget of one ensemble (each worker trains one at a time).
DEFAULT_ENSEMBLE_MEMORY = 2 * 2**30
#: Where the units of a sweep train: worker processes here, or tasks on a Dask scheduler.
EXECUTORS = ("local", "dask")
#: The measurements along every run, by the interval that turns each on (the keys of a preset's
#: [measure] table).
INTERVALS = ("noise_scale_every", "probe_every")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(value: int | str, setting: str = "ensemble_memory") -> int:
    """Bytes from an int or a size such as "2GiB", "512MiB", "1.5GB", "100000"; > 0."""
    if is_int(value):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{setting} must be a size such as 2GiB, 512MiB or 100000 (bytes), got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{setting} must be more than 0 bytes, got {value!r}")
    return size


@dataclass(frozen=True)
class DaskOptions:
    """Where the dask executor runs a sweep's units.

    ``scheduler``: a Dask scheduler's address, e.g. ``tcp://10.0.0.1:8786`` (None: a LocalCluster
    of the sweep's ``workers`` processes started here, loopback only). ``max_in_flight``: units
    submitted and not yet finished (None: the cluster's task slots).
    """

    scheduler: str | None = None
    max_in_flight: int | None = None

    def __post_init__(self):
        if self.scheduler is not None and (not isinstance(self.scheduler, str) or not self.scheduler.strip()):
            raise ValueError(f"scheduler must be None or an address such as tcp://host:8786, got {self.scheduler!r}")
        check_int("max_in_flight", self.max_in_flight, allow_none=True)


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep trains its runs (no setting here changes a run's key).

    ``workers``: worker processes (None: the usable CPUs; 1 trains in this process), ``threads``:
    torch threads per worker (None: 1). ``stack``: train the runs that can share one as a stacked
    ensemble of at most ``ensemble_memory`` bytes, or a size such as "2GiB" (None: the preset's
    [sweep] ensemble_memory, else :data:`DEFAULT_ENSEMBLE_MEMORY`). ``probe_every``,
    ``noise_scale_every``: measure every run with the divergence meter / its gradient noise scale
    at step 0 and every so many steps (None: the preset's [measure] interval, else not measured).
    ``retries``: retries of a unit whose worker died (dask: also of one that raised). ``dask``:
    run the units on a Dask cluster (None: local worker processes).
    """

    workers: int | None = None
    threads: int | None = None
    stack: bool = True
    ensemble_memory: int | str | None = None
    probe_every: int | None = None
    noise_scale_every: int | None = None
    retries: int = 2
    dask: DaskOptions | None = None

    def __post_init__(self):
        for name in ("workers", "threads", *INTERVALS):  # None, or an integer >= 1
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if not isinstance(self.stack, bool):
            raise ValueError(f"stack must be True or False, got {self.stack!r}")
        if self.ensemble_memory is not None:
            object.__setattr__(self, "ensemble_memory", parse_memory(self.ensemble_memory))
        check_int("retries", self.retries, minimum=0)
        if self.dask is not None and not isinstance(self.dask, DaskOptions):
            raise ValueError(f"dask must be None or DaskOptions, got {self.dask!r}")

    @property
    def executor(self) -> str:
        """One of :data:`EXECUTORS`: ``"dask"`` with :attr:`dask` options, else ``"local"``."""
        return "local" if self.dask is None else "dask"

    @property
    def intervals(self) -> dict[str, int | None]:
        """{key of :data:`INTERVALS`: its interval in steps, None for not measured}."""
        return {name: getattr(self, name) for name in INTERVALS}

    def with_defaults(self, *, ensemble_memory: int | None, intervals: dict) -> SweepOptions:
        """These options with each setting left None taken from ``ensemble_memory`` (else
        :data:`DEFAULT_ENSEMBLE_MEMORY`) and ``intervals`` (a preset's [measure] table)."""
        memory = self.ensemble_memory if self.ensemble_memory is not None else ensemble_memory
        given = {name: intervals.get(name) for name in INTERVALS if getattr(self, name) is None}
        return dataclasses.replace(self, ensemble_memory=DEFAULT_ENSEMBLE_MEMORY if memory is None else memory,
                                   **given)

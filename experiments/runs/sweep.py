"""Sweeps that survive: a grid of runs, executed in parallel, resumed after any interruption.

Every run is keyed by the hash of its full config (``store.config_hash``). ``run_sweep`` skips
the runs already in the store and trains the rest in local worker processes; the parent is the
only writer and commits each result in its own transaction the moment it arrives. Why a single
writer: SQLite serialises writers anyway, so worker-side writes would only add lock waits and
busy-timeouts, and a worker killed while holding the write lock could stall the others; with the
parent writing, a ``kill -9`` of anything loses at most the runs still being computed.

Workers never outlive the parent: on Linux each asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), elsewhere a watchdog thread polls the parent's pid; and a SIGTERM to
the parent raises SystemExit there, so leaving the ``with Pool`` block terminates the workers.

Workers are sized to the machine: by default one worker per usable CPU, each with one torch
thread. One thread per run is deliberate: the numbers of a run then do not depend on how many
workers ran the sweep (a float reduction split over threads may round differently), and small
networks gain nothing from intra-op threads (on a loaded machine, spinning OpenMP threads made a
digits run 20-70x slower in our measurement).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from affdiv.experiments.runs.config import RunConfig, config_hash
from affdiv.experiments.runs.store import ResultStore
from affdiv.experiments.runs.training import train_run


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- worker side

_DATASETS: dict = {}
_DATA_DIR: str | None = None


def dataset_for(config: RunConfig, data_dir: str | None = None):
    """The dataset a run trains on (loaded once per process and cached)."""
    from affdiv.experiments.data.dataset import load_dataset

    key = (config.dataset, config.data_seed, config.val_fraction, tuple(sorted(config.data_options.items())), data_dir)
    if key not in _DATASETS:
        _DATASETS[key] = load_dataset(
            config.dataset, data_dir=data_dir, seed=config.data_seed,
            val_fraction=config.val_fraction, **config.data_options,
        )
    return _DATASETS[key]


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """Exit this worker when process ``parent`` is gone (a worker reparented to init is an orphan)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: no prctl
        armed = False
    if os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="affdiv-parent-watchdog", daemon=True).start()


def _init_worker(threads: int, data_dir: str | None, parent: int | None = None) -> None:
    global _DATA_DIR
    if parent is not None:
        _die_with_parent(parent)
    _DATA_DIR = data_dir
    # cuBLAS is deterministic only with a fixed workspace; set before this process touches CUDA.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _run_one(config: RunConfig) -> tuple[RunConfig, dict]:
    result = train_run(config, dataset_for(config, _DATA_DIR))
    return config, {
        "metrics": result.metrics,
        "curves": result.curves,
        "seconds": result.seconds,
        "data_fingerprint": result.data_fingerprint,
    }


# ----------------------------------------------------------------------------- parent side


class Progress:
    """A plain-text progress bar with ETA on a stream (redrawn in place on a terminal)."""

    def __init__(self, total: int, skipped: int, stream: TextIO | None, width: int = 30):
        self.total, self.skipped, self.stream, self.width = total, skipped, stream, width
        self.done, self.start = 0, time.monotonic()
        self.tty = bool(stream) and hasattr(stream, "isatty") and stream.isatty()
        self._last_line = -1.0
        self._show()

    def advance(self) -> None:
        self.done += 1
        self._show()

    def _show(self) -> None:
        if self.stream is None:
            return
        elapsed = time.monotonic() - self.start
        fraction = self.done / self.total if self.total else 1.0
        if not self.tty and self.done not in (0, self.total) and elapsed - self._last_line < 10:
            return  # in a log file: one line every 10 s at most, plus the first and the last
        self._last_line = elapsed
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        filled = int(round(self.width * fraction))
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} runs"
            f" ({self.skipped} already done) elapsed {_clock(elapsed)} ETA {_clock(eta)}"
        )
        end = "" if self.tty and self.done < self.total else "\n"
        print(("\r" if self.tty else "") + line, end=end, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing finished yet
        return "--:--"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


@dataclass
class SweepOutcome:
    hashes: list[str]  # every run of the sweep, finished now
    ran: int  # trained by this call
    skipped: int  # found finished in the store
    workers: int
    threads: int


def run_sweep(
    configs: Sequence[RunConfig],
    store: ResultStore,
    *,
    data_dir: str | None = None,
    workers: int | None = None,
    threads: int | None = None,
    progress: TextIO | None = sys.stderr,
    on_result: Callable[[RunConfig], None] | None = None,
) -> SweepOutcome:
    """Train every config not yet in ``store``; commit each as it finishes.

    ``workers`` defaults to the usable CPUs, ``threads`` (torch threads per worker) to 1.
    ``workers=1`` trains in this process (no pool).
    """
    workers = available_cpus() if workers is None else workers
    threads = 1 if threads is None else threads
    if workers < 1 or threads < 1:
        raise ValueError(f"workers and threads must be >= 1, got workers={workers}, threads={threads}")
    hashes = [config_hash(c.to_dict()) for c in configs]
    done = store.finished()
    # Smallest batches first: under an epoch budget they take the most steps, so starting them
    # early balances the workers; the order never reaches the results.
    pending = sorted((c for c, h in zip(configs, hashes) if h not in done), key=lambda c: c.batch_size)
    bar = Progress(len(pending), len(configs) - len(pending), progress)

    def commit(config: RunConfig, result: dict) -> None:
        store.put(config.to_dict(), **result)
        bar.advance()
        if on_result is not None:
            on_result(config)

    workers = min(workers, max(1, len(pending)))
    if workers == 1:
        previous = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())
        _init_worker(threads, data_dir)
        try:
            for config in pending:
                commit(*_run_one(config))
        finally:
            torch.set_num_threads(previous[0])
            torch.use_deterministic_algorithms(previous[1], warn_only=previous[2])
    elif pending:
        context = multiprocessing.get_context("spawn")
        with _sigterm_exits(), context.Pool(workers, initializer=_init_worker,
                                            initargs=(threads, data_dir, os.getpid())) as pool:
            for config, result in pool.imap_unordered(_run_one, pending, chunksize=1):
                commit(config, result)
    return SweepOutcome(hashes, len(pending), len(configs) - len(pending), workers, threads)


@contextlib.contextmanager
def _sigterm_exits():
    """Within the block, SIGTERM raises SystemExit(143) (so ``with Pool`` terminates its workers).

    Only the main thread can install handlers; elsewhere the block runs with the handler unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_sigterm(signum, _frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

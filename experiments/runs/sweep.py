"""Sweeps that survive: a grid of runs, executed in parallel, resumed after any interruption.

Every run is keyed by the hash of its full config (``store.config_hash``). ``run_sweep`` skips
the runs already in the store and trains the rest in local worker processes; the parent is the
only writer and commits each result in its own transaction the moment it arrives. Why a single
writer: SQLite serialises writers anyway, so worker-side writes would only add lock waits and
busy-timeouts, and a worker killed while holding the write lock could stall the others; with the
parent writing, a ``kill -9`` of anything loses at most the runs still being computed.

Units of work: with ``stack`` (the default) the runs that can train together
(:mod:`~affdiv.experiments.runs.ensembles`: same everything but seed, data split and
learning-rate settings) go to a worker as one ensemble, cut to fit ``ensemble_memory``; without,
each run is a unit. A unit's runs are committed when it finishes.

A worker that dies (the out-of-memory killer's SIGKILL, a segfault) breaks the process pool:
every unit in flight fails with ``BrokenProcessPool``. The parent then starts a fresh pool and
submits those units again; at most ``workers`` units are in flight at a time, so exactly those
are retried. A unit in flight at ``retries`` + 1 such deaths stops the sweep with an error that
names its runs; finished units are never lost.

Workers never outlive the parent: on Linux each asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), elsewhere a watchdog thread polls the parent's pid; a SIGTERM to
the parent raises SystemExit there, and leaving the pool on any exception kills the workers.

With :class:`~affdiv.experiments.runs.options.DaskOptions` (``SweepOptions.dask``) the same units
go to a Dask distributed scheduler instead (:mod:`~affdiv.experiments.runs.dask_executor`: a
``LocalCluster`` started here, or the scheduler at its ``scheduler``). The parent is still the
only writer: each unit's results come back and are committed here as it completes. A unit whose
worker died, or which raised, is retried up to ``retries`` times; after the last attempt its runs
are recorded as failed (:meth:`ResultStore.put_failure`) and the sweep goes on
(``SweepOutcome.failed`` lists them).

Workers are sized to the machine: by default one worker per usable CPU, each with one torch
thread. One thread per run is deliberate: the numbers of a run then do not depend on how many
workers ran the sweep (a float reduction split over threads may round differently), and small
networks gain nothing from intra-op threads (on a loaded machine, spinning OpenMP threads made a
digits run 20-70x slower in our measurement).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TextIO

import torch

from affdiv._extras import require
from affdiv.experiments.runs.config import RunConfig, config_hash
from affdiv.experiments.runs.ensembles import plan_ensembles
from affdiv.experiments.runs.options import DEFAULT_ENSEMBLE_MEMORY, SweepOptions
from affdiv.experiments.runs.store import ResultStore, StoredRun
from affdiv.experiments.runs.training import Measurement, train_group

log = logging.getLogger(__name__)


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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from <malloc.h>


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of returning it to the kernel.

    By default glibc serves blocks above a (dynamic, at most 32 MiB) threshold with mmap and
    unmaps them when freed, so the next allocation of that size faults in fresh zeroed pages. A
    stacked step allocates gradients and activations of K models (tens of MB) every step, and
    those page faults cost as much as the GEMMs: a 48×256×784 float32 ``bmm`` ran at 9 GFLOP/s into
    fresh memory and at 18-19 GFLOP/s into reused memory (one thread, on the project's 2-core
    machine). With ``M_MMAP_THRESHOLD`` 1 GiB and ``M_TRIM_THRESHOLD`` 2 GiB the heap keeps them:
    the process's resident memory stays at its peak instead. Changes no number. A no-op without
    glibc.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, 2**30)
    mallopt(_M_TRIM_THRESHOLD, 2**31)


def _init_worker(threads: int, data_dir: str | None, parent: int | None = None) -> None:
    """Set up a process that trains runs; a pool worker (``parent`` given) also dies with its
    parent and keeps freed memory (:func:`keep_freed_memory`)."""
    global _DATA_DIR
    if parent is not None:
        _die_with_parent(parent)
        keep_freed_memory()
    _DATA_DIR = data_dir
    # cuBLAS is deterministic only with a fixed workspace; set before this process touches CUDA.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _init_dask_worker(threads: int, data_dir: str | None) -> None:
    """Set up a Dask worker process (run once in each, before its first unit): keep freed memory
    and :func:`_init_worker`. Its nanny, not this process, watches the parent."""
    keep_freed_memory()
    _init_worker(threads, data_dir)


_SET_UP = object()  # _run_unit's default data folder: the one _init_worker set in this process


def _run_unit(unit: Sequence[RunConfig], stack: bool, measurements: Sequence[Measurement],
              data_dir: str | None | object = _SET_UP) -> list[tuple[RunConfig, StoredRun]]:
    """Train one unit (runs of one ensemble key); returns (config, what to store) per run, with the
    raw data's hash and the code identity of the process that trained it and of its machine
    (``provenance.machine_identity`` of the run's device). ``data_dir`` travels with a Dask task (a
    worker may serve several sweeps); pool workers use their own."""
    from affdiv.provenance import code_identity, machine_identity

    folder = _DATA_DIR if data_dir is _SET_UP else data_dir
    datasets = [dataset_for(c, folder) for c in unit]
    results = train_group(unit, datasets, stack=stack, measurements=measurements)
    return [(config, StoredRun(result.metrics, result.curves, result.seconds, result.data_fingerprint,
                               measurements=result.measurements or None, candidates=result.candidates or None,
                               check_seconds=result.check_seconds, raw_sha256=data.config.get("raw_sha256"),
                               code={**code_identity(), "cpu": machine_identity(config.device)}))
            for config, data, result in zip(unit, datasets, results)]


# ----------------------------------------------------------------------------- parent side


class Progress:
    """The sweep's progress on a stream: a tqdm bar on a terminal, a line at most every 10 s in a log
    (the same text, no carriage-return debris), with runs done, elapsed time and ETA.

    ETA = elapsed x remaining cost / finished cost, each run weighing :meth:`cost`. It is unbiased
    when the runs finished so far are a fair sample of the sweep's: the sweep trains its units in
    a fixed pseudo-random order (:func:`_units`), never grid-sorted, where the first runs would all
    be of one method or batch size. ``runs``: the pending runs' configs (None: every run weighs the
    same); ``advance(config=...)`` names the run that finished. No ETA until a run has finished.
    ``clock``: seconds, monotonic (a test passes a fake one).
    """

    LOG_EVERY_S = 10.0
    FORMAT = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} runs{postfix}"

    def __init__(self, total: int, skipped: int, stream: TextIO | None, *,
                 runs: Sequence[RunConfig] | None = None, clock: Callable[[], float] = time.monotonic):
        self.total, self.skipped, self.stream = total, skipped, stream
        self.clock = clock
        self.done, self.failed, self.start = 0, 0, clock()
        costs = [self.cost(config) for config in runs or ()]
        self.total_cost = float(sum(costs)) if costs else float(total)
        self.mean_cost = self.total_cost / total if total else 1.0  # of a run advance() does not name
        self.done_cost = 0.0
        tty = bool(stream) and hasattr(stream, "isatty") and stream.isatty()
        self.bar = None
        if tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=stream, bar_format=self.FORMAT, dynamic_ncols=True, leave=True,
                            mininterval=0)
        self._last_line = -1.0
        self._show()

    @staticmethod
    def cost(config: RunConfig) -> float:
        """The expected work of a run, up to a factor shared by the sweep's runs, x its learning-rate
        candidates: batch_size x steps under the ``steps`` budget; ``length`` under ``epochs`` (every
        batch size passes over the same split ``length`` times); 1 under ``target``, whose runs stop
        at the target: ``length`` (max_steps) is a cap, not the work, and weighing by it made a
        batch of 1024 count 64 times one of 16 (an ETA of 95 hours for a sweep of 4). A function
        of the config alone, so that the total and the finished work are counted alike."""
        from affdiv.experiments.runs.config import candidates

        if config.budget == "target":
            work = 1
        else:
            work = config.length if config.budget == "epochs" else config.batch_size * config.length
        return float(max(work, 1) * max(len(candidates(config)), 1))

    def advance(self, failed: bool = False, config: RunConfig | None = None) -> None:
        self.done += 1
        self.failed += failed
        self.done_cost += self.mean_cost if config is None else self.cost(config)
        self._show()

    def eta(self) -> float:
        """Seconds left, estimated from the time per unit of cost so far; NaN before any run finished."""
        if not self.done or self.done_cost <= 0:
            return float("nan")
        if self.done >= self.total:
            return 0.0
        return (self.clock() - self.start) * max(self.total_cost - self.done_cost, 0.0) / self.done_cost

    def status(self) -> str:
        """``2 already done, 1 failed, elapsed 11:21, ETA 4:05:00`` (after the run count)."""
        failed = f", {self.failed} failed" if self.failed else ""
        return (f", {self.skipped} already done{failed}, elapsed {_clock(self.clock() - self.start)}, "
                f"ETA {_clock(self.eta())}")

    def _show(self) -> None:
        if self.stream is None:
            return
        if self.bar is not None:
            self.bar.n = self.done
            self.bar.set_postfix_str(self.status().removeprefix(", "), refresh=True)
            if self.done >= self.total:
                self.close()
            return
        elapsed = self.clock() - self.start
        if self.done not in (0, self.total) and elapsed - self._last_line < self.LOG_EVERY_S:
            return  # in a log file: one line every 10 s at most, plus the first and the last
        self._last_line = elapsed
        from tqdm import tqdm

        line = tqdm.format_meter(self.done, self.total, elapsed, ncols=100, bar_format=self.FORMAT,
                                 postfix=self.status().removeprefix(", "))
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Leave the bar on the terminal as it stands (a no-op in a log)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _clock(seconds: float) -> str:
    """``mm:ss`` or ``h:mm:ss`` (tqdm's format); ``--:--`` for NaN (nothing finished yet)."""
    from tqdm import tqdm

    return "--:--" if seconds != seconds else tqdm.format_interval(seconds)


@dataclass
class SweepOutcome:
    hashes: list[str]  # every run of the sweep, finished now
    ran: int  # trained by this call
    skipped: int  # found finished in the store
    workers: int
    threads: int
    units: int = 0  # units of work (ensembles, or single runs without stacking)
    restarts: int = 0  # process pools started again after a worker died
    executor: str = "local"
    scheduler: str | None = None  # the dask scheduler's address
    # runs that failed on their last attempt (dask executor; recorded in the store's failures):
    # {config_hash, method, batch_size, seed, lr_rule, error, kind, attempts}
    failed: list[dict] = field(default_factory=list)


def check_executor(options: SweepOptions) -> None:
    """Refuse the dask executor without its extra (MissingExtra, naming it); the options' values
    are checked when they are made."""
    if options.executor == "dask":
        require("dask", "distributed", extra="dask", feature="affdiv falsify --executor dask")


def run_sweep(
    configs: Sequence[RunConfig],
    store: ResultStore,
    options: SweepOptions | None = None,
    *,
    data_dir: str | None = None,
    progress: TextIO | None = sys.stderr,
    on_result: Callable[[RunConfig], None] | None = None,
    measurements: Sequence[Measurement] = (),
) -> SweepOutcome:
    """Train every config not yet in ``store``; commit each as it finishes.

    ``options`` (:class:`~affdiv.experiments.runs.options.SweepOptions`; default: its defaults):
    ``workers`` defaults to the usable CPUs, ``threads`` (torch threads per worker) to 1;
    ``workers=1`` trains in this process (no pool). ``stack``: train the runs that can share an
    ensemble stacked (:func:`~affdiv.experiments.runs.training.train_group`), each ensemble
    within ``ensemble_memory`` bytes; the measurements its intervals turn on, and
    ``measurements``, are taken along every run (stacked or not) and kept with it. A unit is tried
    at most ``retries`` + 1 times when workers die under it; then the sweep stops with an error
    naming its runs.

    With ``options.dask``, the units run on the Dask scheduler at its ``scheduler`` (None: a
    LocalCluster of ``workers`` processes started here); each is tried ``retries`` + 1 times for
    worker deaths and for exceptions alike, then its runs are recorded as failed and the sweep
    goes on.
    """
    options = options or SweepOptions()
    check_executor(options)
    workers = available_cpus() if options.workers is None else options.workers
    threads = 1 if options.threads is None else options.threads
    measurements = [*_measurements(options), *measurements]
    hashes = [config_hash(c.to_dict()) for c in configs]
    done = store.finished()
    pending = [c for c, h in zip(configs, hashes) if h not in done]
    memory = DEFAULT_ENSEMBLE_MEMORY if options.ensemble_memory is None else options.ensemble_memory
    units = _units(pending, options.stack, memory, data_dir)
    bar = Progress(len(pending), len(configs) - len(pending), progress, runs=pending)

    def commit(config: RunConfig, result: StoredRun) -> None:
        store.put(config.to_dict(), result)
        bar.advance(config=config)
        if on_result is not None:
            on_result(config)

    failed: list[dict] = []

    def fail(config: RunConfig, failure) -> None:
        key = store.put_failure(config.to_dict(), error=failure.error, kind=failure.kind, attempts=failure.attempts,
                                detail=failure.detail)
        failed.append({"config_hash": key, "method": config.method, "batch_size": config.batch_size,
                       "seed": config.seed, "lr_rule": config.lr_rule, "error": failure.error, "kind": failure.kind,
                       "attempts": failure.attempts})
        bar.advance(failed=True, config=config)

    resolved = dataclasses.replace(options, workers=min(workers, max(1, len(units))), threads=threads)
    try:  # the bar is closed however the sweep ends, so that an error's line starts a line of its own
        workers, restarts, address = _execute(units, resolved, measurements, (commit, fail, failed), data_dir)
    finally:
        bar.close()
    return SweepOutcome(hashes, len(pending), len(configs) - len(pending), workers, threads, len(units), restarts,
                        options.executor, address, failed)


def _measurements(options: SweepOptions) -> list[Measurement]:
    """The measurements ``options``' intervals turn on (:data:`~affdiv.experiments.runs.presets.MEASURE`)."""
    if all(every is None for every in options.intervals.values()):
        return []
    from affdiv.experiments.runs.presets import MEASURE

    return [MEASURE[key].measurement(every=every) for key, every in options.intervals.items() if every is not None]


def _execute(units: list[tuple], options: SweepOptions, measurements: Sequence[Measurement], sinks: tuple,
             data_dir: str | None) -> tuple[int, int, str | None]:
    """Train ``units`` as ``options`` say (its ``workers`` and ``threads`` resolved), committing
    each finished run (``sinks``: commit, fail and the list of failed runs); returns (workers,
    worker restarts, the Dask scheduler's address or None)."""
    commit, fail, failed = sinks
    stack, workers, threads = options.stack, options.workers, options.threads
    restarts = 0
    address = None
    executor = options.executor
    if executor == "dask":
        if units:
            with _sigterm_exits():
                ran = _run_on_dask(units, options, measurements, (commit, fail), data_dir)
            address, workers = ran.scheduler, workers if ran.in_process else ran.slots
        if failed:
            log.warning("%d run(s) failed on every attempt, recorded as failed (a resumed sweep tries them again): %s",
                        len(failed), "; ".join(f"{f['method']} B={f['batch_size']} seed={f['seed']} "
                                               f"lr_rule={f['lr_rule']}: {f['error']}" for f in failed))
    elif workers == 1:
        previous = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled())
        _init_worker(threads, data_dir)
        try:
            for unit in units:
                for config, result in _run_unit(unit, stack, measurements):
                    commit(config, result)
        finally:
            torch.set_num_threads(previous[0])
            torch.use_deterministic_algorithms(previous[1], warn_only=previous[2])
    elif units:
        with _sigterm_exits():
            restarts = _run_in_pools(units, (stack, measurements), commit, workers, (threads, data_dir, os.getpid()),
                                     options.retries + 1)
    return workers, restarts, address


def _run_on_dask(units: list[tuple], options: SweepOptions, measurements: Sequence[Measurement], sinks: tuple,
                 data_dir: str | None):
    """Run ``units`` with :func:`~affdiv.experiments.runs.dask_executor.run_units` as ``options``
    say; ``commit`` each finished run here, ``fail`` each run of a unit that failed on its last
    attempt (``sinks``: commit, fail). Units of CUDA runs each take one ``GPU`` of the workers'
    resources."""
    from affdiv.experiments.runs.dask_executor import UnitFailed, run_units

    commit, fail = sinks
    workers, stack = options.workers, options.stack

    def on_done(unit, result) -> None:
        if isinstance(result, UnitFailed):
            for config in unit:
                fail(config, result)
        else:
            for config, fields in result:
                commit(config, fields)

    cuda = any(str(config.device).startswith("cuda") for unit in units for config in unit)
    if cuda and options.dask.scheduler is None and workers > 1:
        # Every in-process worker would see the same device: one worker, so one unit on the GPU at a
        # time. For several GPUs, start one worker per GPU (CUDA_VISIBLE_DEVICES, --resources GPU=1).
        log.warning("device cuda with the in-process cluster: 1 worker instead of %d (one GPU)", workers)
        workers = 1
    work = functools.partial(_run_unit, stack=stack, measurements=tuple(measurements), data_dir=data_dir)
    setup = functools.partial(_init_dask_worker, options.threads, data_dir)
    return run_units(units, work, on_done, options.dask, workers=workers, setup=setup, retries=options.retries,
                     resources={"GPU": 1} if cuda else None)


def _units(pending: Sequence[RunConfig], stack: bool, memory: int, data_dir: str | None) -> list[tuple]:
    """The units of work: ensembles (``stack``) or single runs, in a fixed pseudo-random order (by
    the config hash of each unit's first run: the same on every resume). Never grid-sorted: the
    runs finished at any point are then a fair sample of the sweep's, so the ETA that
    :class:`Progress` extrapolates from them holds from the first runs on. The order never reaches
    the results."""
    if stack:
        def shape_of(config):
            data = dataset_for(config, data_dir)
            return tuple(data.input_shape), data.num_classes

        units = [tuple(unit) for unit in plan_ensembles(pending, shape_of, memory)]
    else:
        units = [(config,) for config in pending]
    return sorted(units, key=lambda unit: config_hash(unit[0].to_dict()))


def _run_in_pools(units: list[tuple], options: tuple, commit, workers: int, initargs: tuple,
                  max_attempts: int) -> int:
    """Run ``units`` in process pools of ``workers`` workers, at most ``workers`` in flight,
    committing each unit's results as it finishes; after a worker's death, a fresh pool retries
    the units that were in flight. A death between units, which the pool may report only when the
    next unit is submitted, costs a fresh pool and no attempt once the pool has noticed it (a unit
    submitted before then fails with the pool and counts an attempt, as one in flight does).
    Returns the number of restarts."""
    queue = collections.deque(range(len(units)))
    attempts = collections.Counter()
    restarts = 0
    while queue:
        lost, exits, broken, processes = [], [], False, []
        with _pool(workers, initargs) as executor:
            in_flight: dict = {}
            while not lost and (in_flight or (queue and not broken)):
                while queue and len(in_flight) < workers and not broken:
                    index = queue.popleft()
                    try:
                        in_flight[executor.submit(_run_unit, units[index], *options)] = index
                    except BrokenProcessPool:  # a worker died since the last wait: this pool takes no more
                        queue.appendleft(index)
                        broken = True
                if not in_flight:
                    continue
                processes = _worker_processes(executor)
                finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                if any(isinstance(f.exception(), BrokenProcessPool) for f in finished):
                    finished, _ = wait(in_flight)  # the break fails every unit in flight: collect them all
                    exits = _exit_codes(processes)
                for future in finished:
                    index = in_flight.pop(future)
                    if isinstance(future.exception(), BrokenProcessPool):
                        lost.append(index)
                        continue
                    for config, result in future.result():
                        commit(config, result)
        restarts += bool(lost or broken)
        if lost:
            _after_worker_death(lost, units, attempts, exits, max_attempts)
            queue.extendleft(reversed(lost))
        elif broken:  # (the pool itself ends the other workers with SIGTERM)
            died = [code for code in _exit_codes(processes) if code not in (None, 0, -signal.SIGTERM)]
            log.warning("a worker process died between units (exit codes %s; -9 is SIGKILL, as sent by the "
                        "out-of-memory killer); restarting the workers", died)
    return restarts


def _exit_codes(processes: list) -> list:
    """The processes' exit codes, each reaped first (its exit code is None until then)."""
    for process in processes:
        process.join(timeout=10)
    return [process.exitcode for process in processes]


def _after_worker_death(lost: list[int], units: list[tuple], attempts: collections.Counter, exits: list,
                        max_attempts: int) -> None:
    """Count the attempt of every lost unit; raise if one has had ``max_attempts``, else log."""
    attempts.update(lost)
    died = [code for code in exits if code not in (None, 0, -signal.SIGTERM)] or exits
    runs = sum(len(units[i]) for i in lost)
    exhausted = [i for i in lost if attempts[i] >= max_attempts]
    if exhausted:
        names = "; ".join(f"{c.method} B={c.batch_size} seed={c.seed} lr_rule={c.lr_rule}"
                          for i in exhausted for c in units[i])
        raise RuntimeError(f"a worker process died {max_attempts} times while training these runs (exit codes "
                           f"{died}; -9 is SIGKILL, which the out-of-memory killer sends): {names}. Lower the "
                           "ensemble memory or the number of workers, or train these runs without stacking")
    log.warning("a worker process died (exit codes %s; -9 is SIGKILL, as sent by the out-of-memory killer) with "
                "%d run(s) in flight; restarting the workers and training them again (attempt %d of %d)",
                died, runs, max(attempts[i] for i in lost) + 1, max_attempts)


@contextlib.contextmanager
def _pool(workers: int, initargs: tuple):
    """A spawn-context ProcessPoolExecutor; leaving it by an exception kills its workers first
    (``shutdown`` alone would wait for the units they are training)."""
    context = multiprocessing.get_context("spawn")
    executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=initargs)
    try:
        yield executor
    except BaseException:
        for process in _worker_processes(executor):
            process.kill()
        executor.shutdown(wait=False, cancel_futures=True)
        raise
    executor.shutdown(wait=True)


def _worker_processes(executor: ProcessPoolExecutor) -> list:
    """The executor's worker processes (its ``_processes``: private, present since Python 3.2;
    the only way to kill them or read their exit codes)."""
    return list((executor._processes or {}).values())


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

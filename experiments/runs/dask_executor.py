"""Units of work on a Dask distributed cluster, their results handed back to the submitting process.

:func:`run_units` is the whole interface: it submits picklable ``units`` to a Dask scheduler as
tasks of a picklable top-level function ``fn(unit) -> result`` and calls ``on_done(unit,
result)`` in the submitting process as each one completes, or ``on_done(unit, UnitFailed)``
for a unit that failed on every attempt. Workers write nothing shared: whatever ``on_done``
does with a result (the sweep commits it to its SQLite store) happens here, in one process.

The cluster: at ``scheduler`` (an address such as ``tcp://10.0.0.1:8786``), or, without one, a
``LocalCluster`` started in this process for the duration of the call (``workers`` worker
processes of one thread each, no memory limit, listening on the loopback interface only, no
dashboard: Dask's plain HTTP endpoints, such as ``/health``, stay on loopback too).

Per-worker set-up: ``setup`` (a picklable callable) runs once in every worker process, through a
worker plugin, before that worker trains anything -- also in the workers that join later,
among them the replacement the nanny starts after a worker died. The sweep sets torch's threads,
deterministic algorithms and glibc's memory reuse there (the data folder travels with each unit);
each worker loads a dataset by name and folder the first time a unit needs it and keeps it
(``sweep.dataset_for`` caches per process), so a dataset reaches each worker once. A plugin is
unregistered when the call ends on a scheduler at an address (the workers keep its settings).

A bounded queue: at most ``max_in_flight`` units are submitted and not yet finished, by default
as many as the cluster has task slots (worker threads; with ``resources``, the number of tasks
the workers' resources admit at once), counted again as workers come and go. Only the units
being trained sit on the workers, and the scheduler never holds thousands of futures. (It matters
for retries too: the scheduler counts a worker's death against every task assigned to it, waiting
ones included.)

Two kinds of failure, each retried ``retries`` times:

* a worker process dies while it trains a unit (the out-of-memory killer's SIGKILL, a segfault,
  a lost node): the scheduler marks the task *suspicious* and reschedules it on another worker
  (the nanny restarts the dead one), until ``distributed.scheduler.allowed-failures`` workers
  have died under it; then the task errs with ``KilledWorker``. That setting belongs to the
  scheduler: the in-process cluster is started with it equal to ``retries``; a scheduler at an
  address keeps its own, and a warning says so when it differs (start it with
  ``DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=N``).
* the unit raises an exception (a CUDA out-of-memory error, a missing file): the worker reports
  the error and the scheduler runs the task again ``retries`` times
  (``Client.submit(retries=...)``). Such retries do not count worker deaths, and deaths do not
  count them.

After its last attempt a unit is handed to ``on_done`` as a :class:`UnitFailed` naming the kind
and the error; the other units go on. A unit the scheduler cancels (it restarted, or the
connection to it was lost) is no unit's failure: the call stops with a RuntimeError.

Interrupting the submitting process (Ctrl-C, SIGTERM raised as SystemExit) cancels the units in
flight and closes the in-process cluster; after a ``kill -9`` its workers exit with it (each
Dask process exits when its parent's pipe closes). Results not yet handed to ``on_done`` are
lost, and only those.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import queue
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError
from typing import Any

from affdiv._extras import require
from affdiv.checks import check_int
from affdiv.experiments.runs.options import DaskOptions

#: What needs the ``dask`` extra (named in the error when it is missing).
FEATURE = "the dask executor (affdiv falsify --executor dask)"

require("dask", "distributed", extra="dask", feature=FEATURE)

import dask  # noqa: E402  (after the check that names the extra)
import distributed  # noqa: E402
import distributed.comm  # noqa: E402
from distributed.diagnostics.plugin import WorkerPlugin  # noqa: E402
from distributed.scheduler import KilledWorker  # noqa: E402

log = logging.getLogger(__name__)

#: Seconds between two counts of the cluster's task slots while nothing completes.
RECOUNT_EVERY = 2.0
#: Seconds to wait for the scheduler at an address before giving up (connect, handshake and identity
#: together; a live scheduler answers in well under a second, and the whole refusal stays under 35 s).
CONNECT_TIMEOUT = 20.0


class UnitFailed(Exception):
    """A unit that failed on its last attempt.

    ``kind`` is ``"worker died"`` (a worker process died under it every time: ``KilledWorker``)
    or ``"exception"`` (it raised); ``error`` is one line (``Type: message``), ``detail`` the
    traceback (or the scheduler's whole message), ``attempts`` how many times it ran.
    """

    def __init__(self, error: str, *, kind: str, attempts: int, detail: str = ""):
        super().__init__(error)
        self.error, self.kind, self.attempts, self.detail = error, kind, attempts, detail

    def __reduce__(self):
        return _unit_failed, (self.error, self.kind, self.attempts, self.detail)


def _unit_failed(error, kind, attempts, detail):
    return UnitFailed(error, kind=kind, attempts=attempts, detail=detail)


@dataclasses.dataclass
class DaskOutcome:
    scheduler: str  # the scheduler's address
    in_process: bool  # a LocalCluster started by this call
    slots: int  # task slots when the last unit was submitted
    submitted: int  # units submitted
    failed: int  # units handed to on_done as UnitFailed


class _Setup(WorkerPlugin):
    """Runs ``fn()`` once in every worker process, before that worker's first task."""

    idempotent = False

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def setup(self, worker) -> None:
        self.fn()


@contextlib.contextmanager
def connect(scheduler: str | None = None, *, workers: int = 2, retries: int = 2,
            worker_resources: Mapping[str, float] | None = None) -> Iterator[distributed.Client]:
    """A client of the scheduler at ``scheduler``, or of a LocalCluster started here (loopback
    only, no dashboard, ``workers`` processes of one thread, ``allowed-failures`` = ``retries``,
    each worker offering ``worker_resources``); both are closed on leaving."""
    if scheduler is None:
        check_int("workers", workers)
        with dask.config.set({"distributed.scheduler.allowed-failures": retries}):
            # memory_limit=0: no pausing or restarting at a share of the machine's memory (the runs
            # keep freed memory for reuse, so a worker's resident size stays at its peak)
            cluster = distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=None, memory_limit=0, resources=dict(worker_resources or {}) or None,
            )
        try:
            client = distributed.Client(cluster, set_as_default=False)
        except BaseException:
            cluster.close()
            raise
        try:
            yield client
        finally:
            client.close()
            cluster.close()
        return
    check_scheduler(scheduler)
    try:
        client = distributed.Client(scheduler, timeout=CONNECT_TIMEOUT, set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"scheduler {scheduler}: cannot connect to a Dask scheduler there ({reason})") from None
    try:
        yield client
    finally:
        client.close()


def check_scheduler(address: str, timeout: float | None = None) -> None:
    """Refuse ``address`` unless a Dask scheduler answers there within ``timeout`` seconds
    (default :data:`CONNECT_TIMEOUT`), counted over the whole exchange: the connection, Dask's
    handshake and an ``identity`` request. ``distributed.Client`` bounds only the connection, so
    a listener that accepts and never answers (or an HTTP server) would hold it forever; this
    check runs first. Raises ValueError naming the address and what went wrong."""
    timeout = CONNECT_TIMEOUT if timeout is None else timeout

    async def identity() -> object:
        comm = await distributed.comm.connect(address, timeout=timeout)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    def ask():
        return asyncio.run(asyncio.wait_for(identity(), timeout))

    try:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread (the command line): ask here
            reply = ask()
        else:  # called from a running loop (a notebook): ask on a thread of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                reply = pool.submit(ask).result()
    except TimeoutError:
        reason = f"no answer within {timeout:g} s"
    except Exception as error:  # noqa: BLE001  (a refused connection, a bad address, bytes that are no Dask message)
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    else:
        if isinstance(reply, dict) and reply.get("type") == "Scheduler":
            return
        reason = f"it answered, but not as a Dask scheduler ({str(reply)[:80]!r})"
    raise ValueError(f"scheduler {address}: cannot connect to a Dask scheduler there ({reason}); check the address, "
                     "or leave the scheduler out to start a local cluster")


def _workers(client: distributed.Client) -> dict:
    """The scheduler's description of every worker (``scheduler_info``, all workers)."""
    parameters = inspect.signature(client.scheduler_info).parameters
    info = client.scheduler_info(n_workers=-1) if "n_workers" in parameters else client.scheduler_info()
    return info.get("workers", {})


def task_slots(client: distributed.Client, resources: Mapping[str, float] | None = None) -> int:
    """How many tasks the cluster runs at once: the workers' threads, or, for tasks that each need
    ``resources``, the tasks each worker's resources admit (at most its threads)."""
    total = 0
    for worker in _workers(client).values():
        slots = int(worker.get("nthreads", 0))
        for name, need in (resources or {}).items():
            slots = min(slots, int(worker.get("resources", {}).get(name, 0) // need))
        total += slots
    return total


class _Slots:
    """The bound on units in flight: fixed, or the cluster's task slots, counted at most every
    ``RECOUNT_EVERY`` seconds (workers join and leave); at least 1."""

    def __init__(self, client, resources, fixed: int | None):
        self.client, self.resources, self.fixed = client, resources, fixed
        self.counted_at, self.slots, self.warned = -float("inf"), 0, False

    def __call__(self) -> int:
        if self.fixed is not None:
            return self.fixed
        now = time.monotonic()
        if now - self.counted_at >= RECOUNT_EVERY:
            self.counted_at, self.slots = now, task_slots(self.client, self.resources)
            if self.slots == 0 and not self.warned:
                self.warned = True
                need = f" offering {dict(self.resources)} (dask worker --resources)" if self.resources else ""
                log.warning("no worker%s has joined the scheduler at %s yet; waiting for one", need,
                            self.client.scheduler.address)
        return max(1, self.slots)


def run_units(
    units: Iterable[Any],
    fn: Callable[[Any], Any],
    on_done: Callable[[Any, Any], None],
    options: DaskOptions | None = None,
    *,
    workers: int = 2,
    setup: Callable[[], None] | None = None,
    retries: int = 2,
    resources: Mapping[str, float] | None = None,
    name: str = "affdiv-unit",
) -> DaskOutcome:
    """Run ``fn(unit)`` for every unit on a Dask cluster; ``on_done(unit, result)`` here as each
    finishes (``result`` a :class:`UnitFailed` after the last failed attempt).

    Args:
        units: picklable units of work, submitted in this order.
        fn: a picklable top-level function (or ``functools.partial`` of one); the workers import it.
        on_done: called in this process, one unit at a time, in the order they complete. An
            exception from it cancels the units in flight and propagates.
        options: where the units go (:class:`~affdiv.experiments.runs.options.DaskOptions`):
            its ``scheduler``'s address (None, the default: a LocalCluster of ``workers``
            processes started here) and ``max_in_flight``, the units submitted and not yet
            finished (None: the cluster's task slots).
        setup: run once in each worker process before its first unit (see the module docstring).
        retries: attempts after the first, for a worker's death and for an exception each.
        resources: what each task needs of the workers' resources, e.g. ``{"GPU": 1}``; the
            in-process cluster's workers then offer that much each.
        name: the prefix of the task keys (what the dashboard shows).
    """
    check_int("retries", retries, minimum=0)
    options = options or DaskOptions()
    scheduler, max_in_flight = options.scheduler, options.max_in_flight
    units = list(units)
    resources = dict(resources or {})
    with connect(scheduler, workers=workers, retries=retries, worker_resources=resources) as client:
        address = client.scheduler.address
        if scheduler is not None:
            _check_allowed_failures(client, retries)
        plugin = f"{name}-setup-{uuid.uuid4().hex[:12]}"  # its own: sweeps may share a scheduler
        if setup is not None:
            client.register_plugin(_Setup(setup), name=plugin)
        outcome = DaskOutcome(address, scheduler is None, 0, 0, 0)
        try:
            if units:
                _drive(client, units, fn, on_done, retries, resources, _Slots(client, resources, max_in_flight),
                       name, outcome)
        finally:
            if setup is not None and scheduler is not None:  # leave a shared scheduler as it was
                with contextlib.suppress(Exception):
                    client.unregister_worker_plugin(plugin)
        return outcome


def _check_allowed_failures(client: distributed.Client, retries: int) -> None:
    try:  # the function travels by value: the scheduler need not have affdiv installed
        allowed = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
    except Exception as error:  # the scheduler refuses pickled functions: nothing to compare
        log.debug("cannot read the scheduler's allowed-failures: %s", error)
        return
    if allowed != retries:
        log.warning("the scheduler at %s retries a task %d time(s) after a worker died under it (its "
                    "distributed.scheduler.allowed-failures), not retries %d; retries still applies to "
                    "exceptions. Start the scheduler with DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=%d to match",
                    client.scheduler.address, allowed, retries, retries)


def _drive(client, units: list, fn, on_done, retries: int, resources: dict, slots: _Slots, name: str,
           outcome: DaskOutcome) -> None:
    """Submit the units through a bounded queue and hand each to ``on_done`` as it completes."""
    finished: queue.Queue = queue.Queue()  # futures, put there by their done callbacks (a client thread)
    in_flight: dict = {}  # task key -> (future, unit index)
    nonce = uuid.uuid4().hex[:12]  # a sweep's keys never meet another client's on a shared scheduler
    next_unit = 0

    def top_up() -> None:
        nonlocal next_unit
        bound = slots()
        while next_unit < len(units) and len(in_flight) < bound:
            future = client.submit(fn, units[next_unit], key=f"{name}-{nonce}-{next_unit}", pure=False,
                                   retries=retries, resources=resources or None)
            in_flight[future.key] = (future, next_unit)
            future.add_done_callback(finished.put)
            next_unit += 1
            outcome.submitted, outcome.slots = next_unit, bound

    try:
        while next_unit < len(units) or in_flight:
            top_up()
            try:
                future = finished.get(timeout=RECOUNT_EVERY)
            except queue.Empty:
                continue
            entry = in_flight.pop(future.key, None)
            if entry is None:  # a callback for a future handled already
                continue
            top_up()  # the next unit starts before this one's result is fetched and stored
            index = entry[1]
            result = _result(future, retries)
            future.release()
            if isinstance(result, UnitFailed):
                outcome.failed += 1
                log.debug("unit %d failed after %d attempt(s) (%s): %s", index, result.attempts, result.kind,
                          result.error)
            on_done(units[index], result)
    except BaseException:
        pending = [future for future, _ in in_flight.values()]
        if pending:
            with contextlib.suppress(Exception):
                client.cancel(pending, force=True)
        raise


def _result(future, retries: int):
    """The unit's result, or its :class:`UnitFailed` after its last attempt. (A result whose worker
    died before it was fetched is computed again by the scheduler; ``result()`` waits for that.)"""
    try:
        return future.result()
    except KilledWorker as error:  # allowed-failures + 1 workers died under it
        attempts = error.allowed_failures + 1
        last = getattr(error.last_worker, "address", error.last_worker)
        return UnitFailed(f"KilledWorker: the worker training it died on each of {attempts} attempt(s) (the last on "
                          f"{last}; SIGKILL from the out-of-memory killer is the usual cause)", kind="worker died",
                          attempts=attempts, detail=str(error))
    except CancelledError as error:  # not the unit's fault: the scheduler restarted or the connection was lost
        raise RuntimeError(f"the Dask scheduler cancelled a unit ({error}): it restarted, or the connection to it "
                           "was lost. The finished runs are stored; run the same command again to resume") from None
    except Exception as error:  # raised by the unit on its last attempt (with the worker's traceback)
        detail = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        first = str(error).splitlines()[0] if str(error) else ""
        return UnitFailed(f"{type(error).__name__}: {first}" if first else type(error).__name__, kind="exception",
                          attempts=retries + 1, detail=detail)

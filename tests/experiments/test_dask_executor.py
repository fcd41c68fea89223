"""The sweep on a Dask cluster (``run_sweep`` with ``SweepOptions(dask=DaskOptions())``, ``affdiv falsify
--executor dask``): the same stored numbers as the local executor, a worker killed mid-sweep, units that fail every
attempt, and the submitting process interrupted (SIGINT, kill -9) then resumed.

Real ``LocalCluster``s of two one-thread worker processes, tiny sweeps on digits (width 8)."""

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from affdiv._extras import available
from affdiv.cli import main
from affdiv.experiments.runs.config import config_hash, expand_grid
from affdiv.experiments.runs.options import DaskOptions, SweepOptions
from affdiv.experiments.runs.store import ResultStore
from affdiv.experiments.runs.sweep import run_sweep

LINUX = Path("/proc/self/stat").exists()
pytestmark = pytest.mark.skipif(not available("distributed"), reason="needs the dask extra: pip install 'affdiv[dask]'")
# 2 methods x 2 batch sizes x 2 seeds, one epoch each
CONFIGS = expand_grid(dict(dataset="digits", depth=1, width=8, length=1),
                      {"method": ["affine", "batchnorm"], "batch_size": [16, 32], "seed": [0, 1]})
RETRIES = 1  # the test cluster's allowed-failures, and --retries


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local executor's stores of CONFIGS, stacked and one run at a time (in this process)."""
    folder = tmp_path_factory.mktemp("local")
    stores = {}
    for stack in (True, False):
        stores[stack] = ResultStore(folder / f"stack-{stack}.sqlite")
        run_sweep(CONFIGS, stores[stack], SweepOptions(workers=1, threads=1, stack=stack), progress=None)
    return stores


# A worker plugin that a module in a temporary folder provides to the workers (they import it by
# name: the cluster's worker processes inherit this process's sys.path when they are spawned, also
# the ones the nanny starts after a death). On every worker, it makes a BatchNorm unit kill its
# worker and a norm_l2 unit raise.
_HELPERS = '''
import os, signal, time
from distributed.diagnostics.plugin import WorkerPlugin


class Sabotage(WorkerPlugin):
    def setup(self, worker):
        from affdiv.experiments.runs import sweep

        original = self.original = sweep.train_group

        def train_group(configs, *args, **kwargs):
            if configs[0].method == "batchnorm":
                os.kill(os.getpid(), signal.SIGKILL)
            if configs[0].method == "norm_l2":
                raise RuntimeError("a run that always raises")
            return original(configs, *args, **kwargs)

        sweep.train_group = train_group

    def teardown(self, worker):
        from affdiv.experiments.runs import sweep

        sweep.train_group = self.original


class RaiseOnSeed0(WorkerPlugin):
    """A norm_l2 unit of seed 0 raises, on every worker."""

    def setup(self, worker):
        from affdiv.experiments.runs import sweep

        original = self.original = sweep.train_group

        def train_group(configs, *args, **kwargs):
            if (configs[0].method, configs[0].seed) == ("norm_l2", 0):
                raise RuntimeError("seed 0 always raises")
            return original(configs, *args, **kwargs)

        sweep.train_group = train_group

    def teardown(self, worker):
        from affdiv.experiments.runs import sweep

        sweep.train_group = self.original


def hold(seconds):
    """A task that occupies its worker for ``seconds``; returns (pid, start, end) on the system clock."""
    start = time.monotonic()
    time.sleep(seconds)
    return os.getpid(), start, time.monotonic()
'''


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    """The folder of ``affdiv_dask_test_helpers``, on sys.path while the module's tests run."""
    folder = tmp_path_factory.mktemp("helpers")
    (folder / "affdiv_dask_test_helpers.py").write_text(_HELPERS)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


@pytest.fixture(scope="module")
def cluster(helpers):
    """A LocalCluster of two one-thread worker processes, allowed-failures = RETRIES, and a client."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": RETRIES}):
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None) as local_cluster, Client(local_cluster) as client:
            yield local_cluster, client


def test_a_dask_sweep_stores_the_numbers_of_the_local_executor(tmp_path, local, sweep_util):
    # the in-process LocalCluster (no --scheduler): two worker processes, one torch thread each
    store = ResultStore(tmp_path / "dask.sqlite")
    outcome = run_sweep(CONFIGS, store, SweepOptions(workers=2, threads=1, dask=DaskOptions()), progress=None)
    assert (outcome.ran, outcome.skipped, outcome.failed) == (len(CONFIGS), 0, [])
    assert sweep_util.counts(store) == (len(CONFIGS), len(CONFIGS))
    assert sweep_util.records(store) == sweep_util.records(local[True])  # number for number


@pytest.mark.skipif(not LINUX, reason="kills a worker process by its pid")
def test_a_worker_killed_mid_sweep_is_retried_and_nothing_is_lost(tmp_path, local, cluster, sweep_util):
    _cluster, client = cluster
    killed: list[int] = []

    def kill_a_busy_worker(_config) -> None:  # on the first stored run: the other units are in flight
        if killed:
            return
        pids = client.run(os.getpid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            busy = [address for address, keys in client.processing().items() if keys and address in pids]
            if busy:
                os.kill(pids[busy[0]], signal.SIGKILL)
                killed.append(pids[busy[0]])
                return
            time.sleep(0.01)

    store = ResultStore(tmp_path / "killed.sqlite")
    options = SweepOptions(retries=RETRIES, threads=1, stack=False,
                           dask=DaskOptions(scheduler=client.scheduler.address))
    outcome = run_sweep(CONFIGS, store, options, progress=None, on_result=kill_a_busy_worker)
    assert killed, "no busy worker to kill"
    assert outcome.failed == [] and outcome.ran == len(CONFIGS)
    assert sweep_util.counts(store) == (len(CONFIGS), len(CONFIGS))  # nothing lost, nothing twice
    assert sweep_util.records(store) == sweep_util.records(local[False])  # the retried run's numbers too
    assert killed[0] not in client.run(os.getpid).values()
    # the dataset reached each worker once: one cached dataset per worker process
    cached = client.run(lambda: len(__import__("affdiv.experiments.runs.sweep", fromlist=["_DATASETS"])._DATASETS))
    assert set(cached.values()) <= {0, 1}


@pytest.mark.skipif(not LINUX, reason="kills a worker process from inside a run")
def test_units_that_fail_every_attempt_are_recorded_and_the_sweep_goes_on(tmp_path, cluster):
    import affdiv_dask_test_helpers

    _cluster, client = cluster
    configs = expand_grid(dict(dataset="digits", depth=1, width=8, length=1, batch_size=32, seed=0),
                          {"method": ["affine", "batchnorm", "norm_l2"]})
    store = ResultStore(tmp_path / "failing.sqlite")
    client.register_plugin(affdiv_dask_test_helpers.Sabotage(), name="sabotage")
    try:
        options = SweepOptions(retries=RETRIES, dask=DaskOptions(scheduler=client.scheduler.address))
        outcome = run_sweep(configs, store, options, progress=None)
    finally:
        client.unregister_worker_plugin("sabotage")
    by_method = {c.method: config_hash(c.to_dict()) for c in configs}
    assert store.finished() == {by_method["affine"]}  # the sweep went on
    failures = {f["config_hash"]: f for f in store.failures()}
    assert set(failures) == {by_method["batchnorm"], by_method["norm_l2"]}
    died, raised = failures[by_method["batchnorm"]], failures[by_method["norm_l2"]]
    assert died["error"].startswith("KilledWorker") and died["attempts"] == RETRIES + 1
    assert raised["error"] == "RuntimeError: a run that always raises" and raised["attempts"] == RETRIES + 1
    assert sorted(f["config_hash"] for f in outcome.failed) == sorted(failures)


def test_the_report_lists_the_runs_that_failed(tmp_path, cluster, sweep_util):
    import affdiv_dask_test_helpers

    _cluster, client = cluster
    grid = ["--preset", "smoke", "--methods", "affine", "norm_l2", "--batch-sizes", "32", "128", "--seeds", "3",
            "--set", "lr_rule=constant", "--set", "length=5", "--set", "width=8", "--stack", "off",
            "--calibration-sims", "0", "--executor", "dask", "--scheduler", client.scheduler.address, "--retries", "0"]
    client.register_plugin(affdiv_dask_test_helpers.RaiseOnSeed0(), name="raise-on-seed-0")
    try:
        assert main(["falsify", *grid, "--out", str(tmp_path)]) == 0
    finally:
        client.unregister_worker_plugin("raise-on-seed-0")
    failed = json.loads((tmp_path / "summary.json").read_text())["provenance"]["failed_runs"]
    assert sorted((f["method"], f["batch_size"], f["seed"], f["error"], f["attempts"]) for f in failed) == [
        ("norm_l2", 32, 0, "RuntimeError: seed 0 always raises", 1),
        ("norm_l2", 128, 0, "RuntimeError: seed 0 always raises", 1)]
    report = (tmp_path / "report.md").read_text()
    assert "2 run(s) failed on every attempt and are missing from the analysis" in report
    assert "norm_l2 B=32 seed=0 lr_rule=constant: RuntimeError: seed 0 always raises" in report
    assert len(sweep_util.rows(tmp_path / "results.sqlite")) == 10


def test_a_worker_runs_at_most_its_share_of_gpu_units(helpers):
    # the mechanism of --device cuda, on CPU: a worker of two threads offering GPU=1 runs the units
    # that each need GPU=1 one at a time, and the bound on units in flight counts one slot
    import affdiv_dask_test_helpers
    from distributed import Client, LocalCluster

    from affdiv.experiments.runs.dask_executor import run_units, task_slots

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1", dashboard_address=None,
                      resources={"GPU": 1}) as local_cluster, Client(local_cluster) as client:
        assert (task_slots(client), task_slots(client, {"GPU": 1}), task_slots(client, {"GPU": 2})) == (2, 1, 0)
        spans = []
        outcome = run_units([0.3] * 4, affdiv_dask_test_helpers.hold, lambda _unit, span: spans.append(span),
                            DaskOptions(scheduler=local_cluster.scheduler_address, max_in_flight=4), retries=0,
                            resources={"GPU": 1})
    assert outcome.submitted == 4 and outcome.failed == 0 and len({pid for pid, _, _ in spans}) == 1
    spans.sort(key=lambda span: span[1])
    assert all(end <= start for (_, _, end), (_, start, _) in zip(spans, spans[1:])), spans  # never two at once


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (its Dask nannies and their workers), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


# constant lr, at most 300 steps to the target: about a second a run, so the interruptions land mid-sweep
GRID = ["--preset", "smoke", "--methods", "affine", "batchnorm", "--batch-sizes", "8", "64", "--seeds", "3",
        "--set", "lr_rule=constant", "--set", "length=300", "--set", "eval_every=20", "--set", "width=8",
        "--stack", "off", "--calibration-sims", "0"]
TOTAL = 12


def _start(out: Path) -> subprocess.Popen:
    """The sweep as a foreground command: with SIGINT at its default even where this process ignores
    it (a shell starts a background job with SIGINT ignored, children inherit that, and Python then
    never raises KeyboardInterrupt). A handled signal, unlike an ignored one, is reset on exec."""
    command = [sys.executable, "-m", "affdiv", "falsify", *GRID, "--out", str(out), "--executor", "dask",
               "--workers", "2"]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_after(sweep_util, process, db: Path, rows: int, signum: int, *, group: bool) -> tuple[list[int], str]:
    """Wait until ``rows`` runs are stored, then send ``signum`` (to the process group: Ctrl-C;
    or to the process alone); returns the processes below it at that moment and its stderr."""
    try:
        assert sweep_util.wait(lambda: len(sweep_util.rows(db)) >= rows or process.poll() is not None, 240)
        assert process.poll() is None, "the sweep ended before the interruption: " + process.stderr.read().decode()
        below = _descendants(process.pid)
        (os.killpg if group else os.kill)(process.pid, signum)
        process.wait(60)
        return below, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stderr.close()


@pytest.mark.skipif(not LINUX, reason="reads the process table from /proc")
def test_an_interrupted_dask_sweep_resumes_without_rerunning_or_duplicating(tmp_path, sweep_util):
    out = tmp_path / "out"
    db = out / "results.sqlite"
    below, _ = _interrupt_after(sweep_util, _start(out), db, 2, signal.SIGINT, group=True)  # Ctrl-C
    assert sweep_util.exited(below, 60), "Dask processes outlived Ctrl-C"
    first = sweep_util.rows(db)
    assert 2 <= len(first) < TOTAL and not (out / "summary.json").exists()

    below, err = _interrupt_after(sweep_util, _start(out), db, len(first) + 2, signal.SIGKILL, group=False)  # kill -9
    assert f"0/{TOTAL - len(first)} runs, {len(first)} already done" in err  # resumed: only the missing runs
    assert sweep_util.exited(below, 60), "Dask processes outlived their kill -9'd parent"
    second = sweep_util.rows(db)
    assert len(first) + 2 <= len(second) < TOTAL
    assert all(second[key] == row for key, row in first.items())  # finished runs kept, untouched

    # resume to the end (here, in this process, by the local executor: the store is the same)
    assert main(["falsify", *GRID, "--out", str(out), "--workers", "1"]) == 0
    provenance = json.loads((out / "summary.json").read_text())["provenance"]
    assert (provenance["runs_this_invocation"], provenance["runs_resumed_from_db"]) == (TOTAL - len(second),
                                                                                        len(second))
    final = sweep_util.rows(db)
    assert len(final) == TOTAL and all(final[key] == row for key, row in second.items())
    connection = sqlite3.connect(db)
    try:
        assert connection.execute("SELECT COUNT(*), COUNT(DISTINCT config_hash) FROM runs").fetchone() == (TOTAL,) * 2
    finally:
        connection.close()
    assert provenance["failed_runs"] == []


@pytest.mark.parametrize(("extra", "message"), [
    (["--scheduler", "tcp://127.0.0.1:1"], "--scheduler tcp://127.0.0.1:1 needs executor 'dask'"),
    (["--executor", "dask", "--retries", "-1"], "--retries must be an integer >= 0, got -1"),
])
def test_bad_executor_options_are_refused_before_the_store_exists(tmp_path, capsys, extra, message):
    assert main(["falsify", "--preset", "smoke", "--out", str(tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.sqlite").exists()


def test_without_the_extra_the_error_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    assert main(["falsify", "--preset", "smoke", "--out", str(tmp_path), "--executor", "dask"]) == 2
    assert "pip install 'affdiv[dask]'" in capsys.readouterr().err
    assert not (tmp_path / "results.sqlite").exists()


def test_an_unreachable_scheduler_is_named(monkeypatch):
    from affdiv.experiments.runs import dask_executor

    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT", 1.0)
    with pytest.raises(ValueError, match="^scheduler tcp://127.0.0.1:9: cannot connect to a Dask scheduler there"):
        dask_executor.run_units([1], abs, lambda *_: None, DaskOptions(scheduler="tcp://127.0.0.1:9"))


def test_an_unreachable_scheduler_is_refused_before_the_store_exists(tmp_path, capsys, monkeypatch):
    from affdiv.experiments.runs import dask_executor

    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT", 1.0)
    argv = ["falsify", *GRID, "--out", str(tmp_path), "--executor", "dask", "--scheduler", "tcp://127.0.0.1:9"]
    assert main(argv) == 2
    assert "--scheduler tcp://127.0.0.1:9: cannot connect to a Dask scheduler there" in capsys.readouterr().err
    assert not (tmp_path / "results.sqlite").exists()


@pytest.fixture
def listener():
    """A TCP listener on the loopback interface that accepts every connection and answers each with
    ``reply`` (None: never a byte), holding it open; yields ``start(reply) -> address``."""
    import socket
    import threading

    sockets = []

    def start(reply: bytes | None) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        sockets.append(server)

        def serve() -> None:
            while True:
                try:
                    connection, _ = server.accept()
                except OSError:  # closed at teardown
                    return
                sockets.append(connection)
                if reply is not None:
                    connection.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        return f"tcp://127.0.0.1:{server.getsockname()[1]}"

    yield start
    for item in sockets:
        item.close()


# A listener that says nothing; an HTTP server's answer; eight bytes that read as a frame count of
# 3.5e18 (which distributed would try to allocate).
SILENT, HTTP, HUGE_FRAME = None, b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n", b"\xff" * 64


@pytest.mark.parametrize(("reply", "reason"), [(SILENT, "no answer within 1 s"), (HTTP, ""), (HUGE_FRAME, "")])
def test_a_listener_that_is_no_scheduler_is_refused_within_the_timeout(tmp_path, capsys, monkeypatch, listener,
                                                                       reply, reason):
    from affdiv.experiments.runs import dask_executor

    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT", 1.0)
    address = listener(reply)
    started = time.monotonic()
    argv = ["falsify", *GRID, "--out", str(tmp_path / "out"), "--executor", "dask", "--scheduler", address]
    assert main(argv) == 2
    assert time.monotonic() - started < 20  # the 1 s deadline plus building the sweep; no hang
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "error:" in line)
    assert f"--scheduler {address}: cannot connect to a Dask scheduler there ({reason}" in line
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "results.sqlite").exists()


def test_a_scheduler_that_is_no_address_is_refused_and_the_process_exits_at_once(tmp_path):
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "affdiv", "falsify", *GRID, "--out", str(tmp_path / "out"),
                           "--executor", "dask", "--scheduler", "not a url"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("affdiv falsify: error: --scheduler not a url: cannot "
                                                           "connect to a Dask scheduler there")
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert time.monotonic() - started < 30  # no wait for a client's threads at exit


def test_a_real_scheduler_passes_the_check():
    from distributed import LocalCluster

    from affdiv.experiments.runs.dask_executor import check_scheduler

    with LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as scheduler_only:
        check_scheduler(scheduler_only.scheduler_address, timeout=10)

        async def from_a_running_loop():  # as in a notebook: the check runs on a thread of its own
            check_scheduler(scheduler_only.scheduler_address, timeout=10)

        asyncio.run(from_a_running_loop())

"""What the tests of sweeps share: the runs a results store holds, and the processes a sweep
starts (read from /proc, Linux).

Used by the tests of the sweep, the Dask executor and ``affdiv falsify`` through the ``sweep_util``
fixture of ``tests/conftest.py``::

    def test_resumes(sweep_util, tmp_path):
        assert sweep_util.wait(lambda: len(sweep_util.rows(tmp_path / "results.sqlite")) >= 2, 60)
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path


def rows(db: Path) -> dict:
    """Every run stored in the SQLite file ``db``, by config hash ({} while the file or its table
    does not exist yet: a sweep in another process may be about to create them)."""
    if not db.exists():
        return {}
    connection = sqlite3.connect(db)
    try:
        return {row[0]: row for row in connection.execute("SELECT * FROM runs")}
    except sqlite3.OperationalError:  # created, table not yet
        return {}
    finally:
        connection.close()


def records(store) -> tuple[list[str], str]:
    """A ResultStore's records and curves as text, to compare two stores number for number."""
    return [repr(r) for r in store.records()], repr(store.curves())


def counts(store) -> tuple[int, int]:
    """(runs, distinct config hashes) in a ResultStore: equal when no run is stored twice."""
    return store._db.execute("SELECT COUNT(*), COUNT(DISTINCT config_hash) FROM runs").fetchone()


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, state Z, has exited: it only waits to be reaped
    by whoever adopted it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait(condition, timeout: float) -> bool:
    """Poll ``condition()`` until it holds (True) or ``timeout`` seconds have passed (then its last value)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def exited(pids, timeout: float) -> bool:
    """Whether every process of ``pids`` has exited within ``timeout`` seconds."""
    return wait(lambda: not any(map(alive, pids)), timeout)

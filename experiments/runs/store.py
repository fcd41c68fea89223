"""The results store: one SQLite row per finished run, keyed by the hash of the run's full config.

Durability: WAL journal with ``synchronous=FULL``, and each finished run is written in one
transaction, so a ``kill -9`` at any moment leaves every committed run intact and no half-written
one. A single process (the sweep's parent) writes; readers may look at the file concurrently.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from affdiv.experiments.runs.config import canonical_json, config_hash

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    config_hash      TEXT PRIMARY KEY,
    config           TEXT NOT NULL,
    metrics          TEXT NOT NULL,
    curves           TEXT NOT NULL,
    seconds          REAL NOT NULL,
    data_fingerprint TEXT NOT NULL,
    finished_utc     TEXT NOT NULL
)
"""

SQLITE_MAGIC = b"SQLite format 3\x00"


def _finite_or_none(value):
    """JSON has no NaN/inf: non-finite floats are stored as null (a diverged run says so itself)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def is_sqlite(path: str | Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


class ResultStore:
    """Finished runs in an SQLite file. ``put`` commits one run; everything else reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def finished(self) -> set[str]:
        """The config hashes of every run in the store."""
        return {row[0] for row in self._db.execute("SELECT config_hash FROM runs")}

    def put(
        self,
        config: dict,
        *,
        metrics: dict,
        curves: list[dict],
        seconds: float,
        data_fingerprint: str,
    ) -> str:
        """Commit one finished run in one transaction; returns its config hash.

        A run already present (same hash) is left as it is: a finished run is never overwritten.
        """
        key = config_hash(config)
        row = (
            key,
            canonical_json(config),
            canonical_json({k: _finite_or_none(v) for k, v in metrics.items()}),
            canonical_json([{k: _finite_or_none(v) for k, v in c.items()} for c in curves]),
            float(seconds),
            data_fingerprint,
            _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )
        with self._db:  # BEGIN ... COMMIT (rolled back on error)
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("INSERT OR IGNORE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        return key

    def _rows(self, hashes: Iterable[str] | None):
        rows = self._db.execute(
            "SELECT config_hash, config, metrics, curves, seconds, data_fingerprint FROM runs"
        ).fetchall()
        if hashes is not None:
            wanted = set(hashes)
            rows = [row for row in rows if row[0] in wanted]
        return sorted(rows)  # by config hash: the order of the file never leaks into a report

    def records(self, hashes: Iterable[str] | None = None, *, metric: str = "test_accuracy") -> list[dict]:
        """One flat dict per run: its config, its metrics, ``metric`` copied to key "metric".

        Sorted by (method, batch_size, seed, config hash); timing is left out, so the records
        of a sweep do not depend on when or in what order its runs finished.
        """
        out = []
        for key, config, metrics, _curves, _seconds, fingerprint in self._rows(hashes):
            record = {**json.loads(config), **json.loads(metrics)}
            if metric not in record:
                raise KeyError(f"metric {metric!r} not in run {key}; it has: {sorted(record)}")
            record.update(metric=record[metric], config_hash=key, data_fingerprint=fingerprint)
            out.append(record)
        return sorted(out, key=_record_order)

    def curves(self, hashes: Iterable[str] | None = None) -> list[dict]:
        """Per-epoch points of every run, each tagged with its run's config and hash."""
        out = []
        for key, config, _metrics, curves, _seconds, _fingerprint in self._rows(hashes):
            tags = {**json.loads(config), "config_hash": key}
            out += [{**tags, **point} for point in json.loads(curves)]
        return sorted(out, key=lambda c: (*_record_order(c), c["epoch"]))

    def seconds(self, hashes: Iterable[str] | None = None) -> float:
        """Total compute time of the runs (for provenance, never for a report's numbers)."""
        return sum(row[4] for row in self._rows(hashes))

    def export_csv(
        self, path: str | Path, hashes: Iterable[str] | None = None, *, metric: str = "test_accuracy"
    ) -> Path:
        """Write ``records`` as CSV (method, batch_size, seed, metric, then the other columns sorted)."""
        from affdiv.experiments.records import write_csv

        return write_csv(path, self.records(hashes, metric=metric))


def _record_order(record: dict) -> tuple:
    return (str(record["method"]), int(record["batch_size"]), int(record["seed"]), record.get("config_hash", ""))

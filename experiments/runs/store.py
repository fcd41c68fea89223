"""The results store: one SQLite row per finished run, keyed by the hash of the run's full config.

Durability: WAL journal with ``synchronous=FULL``, and each finished run is written in one
transaction, so a ``kill -9`` at any moment leaves every committed run intact and no half-written
one. A single process (the sweep's parent) writes; readers may look at the file concurrently.

Identity: an affdiv store carries ``PRAGMA application_id`` = :data:`APPLICATION_ID`
(0x41464456, the ASCII bytes "AFDV"; SQLite keeps it at offset 68 of the file header, where
``file(1)`` can see it). Stores written before the mark existed are recognised by their schema
(exactly the ``runs`` table below and nothing else) and still read; a writer marks them. Any other
SQLite file is refused, so a results database is never written into another program's file.

Reading without side effects: ``ResultStore(path, read_only=True)`` opens the file through an
SQLite URI with ``mode=ro`` (no journal-mode switch, no table creation, nothing written): when
no ``-wal`` or ``-journal`` file sits next to it (no writer is live and nothing is left to
recover), also with ``immutable=1``, so that not even the ``-shm``/``-wal`` side files a WAL
reader would create appear, and a read-only file in a read-only folder can be read.

Integrity: every row's config must hash to its key (a changed config is caught) and its JSON
must parse; a truncated or damaged file fails SQLite's ``quick_check``. Both are reported as a
``ValueError`` naming the file. The metrics of a row carry no checksum of their own.

Measurements: a run trained with training measurements (``run_sweep(..., measurements=...)``)
keeps their dicts (``RunResult.measurements``: ``{"measurement": name, "step": step, ...}``) as
JSON in the nullable ``measurements`` column (null: none taken); like metrics, a non-finite
number in them is stored as null. Stores written before that column existed lack it: a writer
adds it (``ALTER TABLE``), a read-only reader reads such a store as it is (no run has
measurements). Measurements are not part of a run's key.

Check time: each run keeps, in the nullable ``check_seconds`` column, the seconds of its
``seconds`` that went to reading its validation split (``RunResult.check_seconds``), so a study can
say what share of its time its checks took (:meth:`ResultStore.check_time`); runs stored before
the column existed have none. Like ``seconds``, it is never part of a run's records.

Candidates: a target-budget run keeps every learning-rate candidate's curve in the nullable
``candidates`` column, as zlib-compressed canonical JSON (a BLOB: the curves of a run's candidates
are some hundreds of KB of text and compress about 4.5 times); a row written as plain JSON text
by an earlier version is read as it is.

One dataset per data definition: runs whose data settings (:data:`DATA_SETTINGS`) are equal were
trained on the same data only if their data fingerprints are equal (the fingerprint hashes the
raw data bytes with those settings). :meth:`ResultStore.put` refuses a run whose fingerprint
differs from the one the store holds for the same data settings, and
:meth:`ResultStore.check_fingerprints` tells before a sweep starts.

One version of the raw data: a data fingerprint also hashes the split, so runs whose data seeds
differ (``data_seed = "seed"``) never share one. The SHA-256 of the raw data itself (before any
split) is kept per :func:`raw_key` in the ``raw_data`` table, from the first run that brings it;
:meth:`ResultStore.put` refuses a run whose raw data hashes otherwise, and
:meth:`ResultStore.check_raw_data` tells before a sweep starts. Runs stored before that table
existed have no such record (the first run put after them sets it).

The code behind each run: the ``run_code`` table keeps the affdiv version, git commit and
dirty flag of the process that trained each run (:func:`affdiv.provenance.code_identity`), and
its machine (:func:`affdiv.provenance.machine_identity`: processor vendor and instruction set,
torch's version and BLAS, oneDNN, and on a CUDA GPU the GPU and the CUDA and cuDNN versions; in
the ``cpu`` column, added to a store of an earlier version with the first run that has it), which
decide the kernels and so the roundings of its numbers;
:meth:`ResultStore.code_versions` reads them (None for a run stored before that table existed;
its ``cpu`` None for one stored before that column).

Both tables are created by a writer and read when present; a store without them is read as it is.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import math
import sqlite3
import urllib.parse
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from affdiv.experiments.records import is_sqlite, write_csv
from affdiv.experiments.runs import reads
from affdiv.experiments.runs.config import canonical_json, config_hash

APPLICATION_ID = 0x41464456  # "AFDV"

_COLUMNS = (
    ("config_hash", "TEXT", 0, 1),  # (name, type, not null, primary key)
    ("config", "TEXT", 1, 0),
    ("metrics", "TEXT", 1, 0),
    ("curves", "TEXT", 1, 0),
    ("seconds", "REAL", 1, 0),
    ("data_fingerprint", "TEXT", 1, 0),
    ("finished_utc", "TEXT", 1, 0),
)
# Added later, nullable (name -> declared type): stores without them are read as they are, and a
# writer adds them (candidates and check_seconds with the first run that has them, so a store of
# only earlier runs keeps its schema).
_ADDED_COLUMNS = {"measurements": "TEXT", "candidates": "TEXT", "check_seconds": "REAL"}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    config_hash      TEXT PRIMARY KEY,
    config           TEXT NOT NULL,
    metrics          TEXT NOT NULL,
    curves           TEXT NOT NULL,
    seconds          REAL NOT NULL,
    data_fingerprint TEXT NOT NULL,
    finished_utc     TEXT NOT NULL,
    measurements     TEXT,
    candidates       TEXT,
    check_seconds    REAL
)
"""

# Runs that failed on their last attempt in a sweep (the dask executor records them and goes on).
# Created by the first failure, so a store without failures has the runs table alone.
_FAILURES = """
CREATE TABLE IF NOT EXISTS failures (
    config_hash TEXT PRIMARY KEY,
    config      TEXT NOT NULL,
    error       TEXT NOT NULL,
    kind        TEXT NOT NULL,
    attempts    INTEGER NOT NULL,
    detail      TEXT NOT NULL,
    failed_utc  TEXT NOT NULL
)
"""

#: Seconds an SQLite call waits for a lock another process holds before the store says it is locked.
BUSY_TIMEOUT = 10.0


class StoreLocked(ValueError):
    """Another process holds the store: a lock SQLite waited :data:`BUSY_TIMEOUT` s for, or the
    writer's lock of another sweep."""


def _database_error(path: Path, error: sqlite3.DatabaseError) -> Exception:
    """The one-line error for an SQLite error on ``path``: locked (another process holds it), full
    (an OSError ENOSPC) or damaged."""
    text = str(error)
    if "locked" in text or "busy" in text:
        return StoreLocked(f"{path}: locked by another process for {BUSY_TIMEOUT:g} s (SQLite: {text}); the store is "
                           "not damaged: let that process finish, then run the command again")
    if "full" in text:
        return OSError(errno.ENOSPC, f"no space left for the results store (SQLite: {text}); the runs committed "
                                     "before are kept", str(path))
    return ValueError(f"{path}: damaged SQLite file ({text})")


#: The run settings that define the data a run trains on (the arguments of its dataset loader).
DATA_SETTINGS = ("dataset", "data_seed", "val_fraction", "data_options")
#: Datasets whose raw arrays are generated from the data seed (``experiments/data/synthetic.py``):
#: for them the seed is part of what defines the raw data (:func:`raw_key`).
GENERATED_FROM_SEED = ("synthetic",)

# The SHA-256 of each raw dataset the store's runs trained on, by raw_key (one version per key).
_RAW_DATA = """
CREATE TABLE IF NOT EXISTS raw_data (
    raw_key    TEXT PRIMARY KEY,
    raw_sha256 TEXT NOT NULL,
    first_utc  TEXT NOT NULL
)
"""
# The code that trained each run: affdiv's version, git commit and dirty flag, and its machine
# (affdiv.provenance.machine_identity) as JSON (null: not known).
_RUN_CODE = """
CREATE TABLE IF NOT EXISTS run_code (
    config_hash TEXT PRIMARY KEY,
    version     TEXT NOT NULL,
    git_commit  TEXT,
    git_dirty   INTEGER,
    cpu         TEXT
)
"""


def _finite_or_none(value):
    """JSON has no NaN/inf: non-finite floats are stored as null (a diverged run says so itself)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _finite_json(value):
    """``value`` with every non-finite float in it (in lists and dicts, at any depth) as null."""
    if isinstance(value, Mapping):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return _finite_or_none(value)


def data_key(config: Mapping) -> str:
    """The data settings of a run's config, as canonical JSON (runs with equal keys share data)."""
    return canonical_json({name: config.get(name) for name in DATA_SETTINGS})


def raw_key(config: Mapping) -> str:
    """What defines the raw data of a run (before any split or standardisation), as canonical JSON:
    its dataset and data options, and its data seed when the dataset is generated from it
    (:data:`GENERATED_FROM_SEED`). Runs with equal keys must train on raw data with the same hash."""
    settings = {"dataset": config.get("dataset"), "data_options": config.get("data_options")}
    if config.get("dataset") in GENERATED_FROM_SEED:
        settings["data_seed"] = config.get("data_seed")
    return canonical_json(settings)


def _describe(key: str) -> str:
    settings = json.loads(key)
    others = ", ".join(f"{k}={v!r}" for k, v in settings.items() if k != "dataset")
    return f"dataset {settings.get('dataset')!r} ({others})"


def _uri(path: Path, *, immutable: bool) -> str:
    return f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro" + ("&immutable=1" if immutable else "")


def _side_files(path: Path) -> bool:
    """Whether a ``-wal`` or ``-journal`` file is next to ``path`` (a live writer or work to recover)."""
    return any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-journal"))


def _stamp(path: Path) -> tuple:
    status = path.stat()
    return status.st_size, status.st_mtime_ns, _side_files(path)


def identify(path: str | Path) -> str:
    """What ``path`` is, without writing anything: ``"missing"``, ``"empty"`` (a 0-byte file or an
    SQLite file without tables), ``"affdiv"`` (marked with :data:`APPLICATION_ID`) or ``"legacy"``
    (an unmarked store of an earlier version: exactly the ``runs`` table).

    Raises ``IsADirectoryError`` for a folder and ``ValueError`` (naming the file) for anything
    else: not SQLite, damaged, or another program's SQLite database.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a folder, expected a results database file")
    if not path.exists():
        return "missing"
    if path.stat().st_size == 0:
        return "empty"
    if not is_sqlite(path):
        raise ValueError(f"{path}: not an SQLite database (an affdiv results store is one)")
    db = _connect_read_only(path)
    try:
        application_id = db.execute("PRAGMA application_id").fetchone()[0]
        tables = sorted(row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        columns = tuple(tuple(row[1:4]) + (row[5],) for row in db.execute("PRAGMA table_info(runs)"))
    except sqlite3.DatabaseError as error:
        raise _database_error(path, error) from None
    finally:
        db.close()
    expected = tuple((name, kind, notnull, pk) for name, kind, notnull, pk in _COLUMNS)
    added = {(name, kind, 0, 0) for name, kind in _ADDED_COLUMNS.items()}
    if columns[:len(expected)] == expected and set(columns[len(expected):]) <= added:
        columns = expected  # the nullable columns added later, those its version had
    if application_id == APPLICATION_ID:
        if "runs" not in tables:
            raise ValueError(f"{path}: an affdiv results store without its runs table (damaged); tables {tables}")
        if columns != expected:
            found = [column[0] for column in columns]
            raise ValueError(f"{path}: an affdiv results store whose runs table has columns {found}; this version of "
                             f"affdiv reads {[column[0] for column in expected]} (and {', '.join(_ADDED_COLUMNS)}): a "
                             "store of another version of affdiv, or one changed outside it; open it with the version "
                             "that wrote it")
        return "affdiv"
    if application_id == 0 and not tables:
        return "empty"
    if application_id == 0 and tables == ["runs"] and columns == expected:
        return "legacy"
    raise ValueError(f"{path}: not an affdiv results store (SQLite application_id {application_id:#x}, "
                     f"tables {tables}); an affdiv store has application_id {APPLICATION_ID:#x} and a 'runs' table")


def _writer_lock(path: Path):
    """An open handle of ``path`` (created empty if missing) holding an exclusive ``flock``: the
    lock of the one process that writes the store. Another process that asks for it is refused at
    once (:class:`StoreLocked`), so two sweeps on one store never train the same runs. The kernel
    releases it when the process ends, however it ends. Without ``fcntl`` (Windows): None, no lock."""
    try:
        import fcntl
    except ImportError:
        return None
    handle = open(path, "ab")  # noqa: SIM115  (held open for the store's lifetime; closed by _release)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()  # before this store opens SQLite: no lock of its connection is dropped
        raise StoreLocked(f"{path}: another process is writing this results store (a sweep on it is running); "
                          "wait for it to finish, then run the command again (it resumes), "
                          "or use another results store") from None
    return handle


def _connect_read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(_uri(path, immutable=not _side_files(path)), uri=True, timeout=BUSY_TIMEOUT,
                           isolation_level=None)


@dataclass(frozen=True)
class StoredRun:
    """What a finished run leaves in the store (:meth:`ResultStore.put`), besides its config.

    ``metrics``, ``curves`` (validation reads), ``seconds`` (its training time) and
    ``data_fingerprint`` (of the split it trained on); ``measurements``: its measurement dicts
    (``RunResult.measurements``), kept as JSON (non-finite numbers as null; None or [] stores
    null); ``candidates``: likewise, every candidate's lr and curve (``RunResult.candidates``; the
    first run with candidates adds their column to a store of an earlier version);
    ``raw_sha256``: the SHA-256 of the raw data it trained on (``Dataset.config["raw_sha256"]``),
    checked against and added to the ``raw_data`` table; ``code``: ``{"version", "git_commit",
    "git_dirty"}`` of the process that trained it, and optionally ``"cpu"``, its machine's
    :func:`affdiv.provenance.machine_identity` (None: this process's, both, on the config's
    device: a run trained elsewhere passes its own); ``check_seconds``: the
    part of ``seconds`` spent reading the validation split (None: not recorded).
    """

    metrics: Mapping
    curves: Sequence[Mapping]
    seconds: float
    data_fingerprint: str
    measurements: Sequence[Mapping] | None = None
    candidates: Sequence[Mapping] | None = None
    raw_sha256: str | None = None
    code: Mapping | None = None
    check_seconds: float | None = None


class ResultStore:
    """Finished runs in an SQLite file. ``put`` commits one run; everything else reads.

    ``read_only=True`` reads an existing store without changing a byte of it (see the module
    docstring); otherwise the file is created if missing, switched to WAL and marked as an affdiv
    store. Either way a file that is not an affdiv store is refused (``ValueError`` naming it).
    """

    def __init__(self, path: str | Path, *, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        kind = identify(self.path)
        if read_only and kind == "missing":
            raise FileNotFoundError(f"{self.path}: no such results database")
        self._known: dict[str, str] | None = None  # data key -> fingerprint, loaded on first use
        self._empty = kind in ("missing", "empty")
        self._lock = None
        try:
            if read_only:
                self._stamp = _stamp(self.path) if kind != "empty" else None
                self._db = _connect_read_only(self.path)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._lock = _writer_lock(self.path)  # before SQLite opens it: one writer per store
                self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.execute(_SCHEMA)
                self._db.execute(_RAW_DATA)
                self._db.execute(_RUN_CODE)
                if not self._has_column("measurements"):  # a store of an earlier version: add the column
                    self._db.execute("ALTER TABLE runs ADD COLUMN measurements TEXT")
                self._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            if kind not in ("missing", "empty"):
                self._check_integrity()
        except sqlite3.DatabaseError as error:
            self._release()
            raise _database_error(self.path, error) from None
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        """Close the connection (if open), then give up the writer's lock (after: closing a file
        SQLite has open would drop SQLite's own locks)."""
        if getattr(self, "_db", None) is not None:
            self._db.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _has_column(self, name: str, table: str = "runs") -> bool:
        """Whether ``table`` has the column ``name`` (stores of earlier versions lack the nullable
        ones added later)."""
        return any(row[1] == name for row in self._query(f"PRAGMA table_info({table})"))

    def _check_integrity(self) -> None:
        problems = [" ".join(str(row[0]).split()) for row in self._db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise ValueError(f"{self.path}: damaged SQLite file (quick_check: {'; '.join(problems)[:300]})")

    def close(self) -> None:
        self._release()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _query(self, sql: str, parameters=()) -> list[tuple]:
        """Rows of a read; an SQLite error means a damaged file. A read-only store opened as
        immutable is read again without that promise if the file changed meanwhile."""
        if self.read_only and self._empty:  # a 0-byte file or an SQLite file without tables: no runs
            return []
        try:
            rows = self._db.execute(sql, parameters).fetchall()
            if self.read_only and self._stamp is not None and _stamp(self.path) != self._stamp:
                self._db.close()  # a writer changed it while we read: read through SQLite's locks
                self._db = sqlite3.connect(_uri(self.path, immutable=False), uri=True, timeout=BUSY_TIMEOUT,
                                           isolation_level=None)
                self._stamp = None
                rows = self._db.execute(sql, parameters).fetchall()
        except sqlite3.DatabaseError as error:
            raise _database_error(self.path, error) from None
        return rows

    def verify(self) -> int:
        """Read every row and check it (key, JSON, types; see the module docstring); returns the
        number of runs. Raises ValueError naming the file and the run."""
        self.measurements()
        self.candidates()
        self.check_time()
        return len(self._rows(None))

    def _lists(self, column: str, hashes: Iterable[str] | None) -> dict[str, list[dict]]:
        """{config hash: the run's list of dicts in the nullable ``column``} of the runs
        (``hashes``: of these only) that have one; {} for a store without that column."""
        if (self.read_only and self._empty) or not self._has_column(column):
            return {}
        rows = self._query(f"SELECT config_hash, {column} FROM runs WHERE {column} IS NOT NULL")
        wanted = None if hashes is None else set(hashes)
        out = {}
        for key, text in sorted(rows):
            if wanted is not None and key not in wanted:
                continue
            values = self._json(text, key, column)
            if not isinstance(values, list) or not all(isinstance(v, dict) for v in values):
                raise ValueError(f"{self.path}: run {key}: malformed {column} (damaged store)")
            out[key] = values
        return out

    def measurements(self, hashes: Iterable[str] | None = None) -> dict[str, list[dict]]:
        """{config hash: the run's measurement dicts} of the runs (``hashes``: of these only) that
        have measurements; {} for a store of an earlier version (no ``measurements`` column)."""
        return self._lists("measurements", hashes)

    def candidates(self, hashes: Iterable[str] | None = None) -> dict[str, list[dict]]:
        """{config hash: every candidate of the run} (``{"lr", "momentum", "diverged", "curve"}``,
        :attr:`~affdiv.experiments.runs.training.RunResult.candidates`) of the target-budget runs
        that kept them; {} for a store of an earlier version."""
        return self._lists("candidates", hashes)

    def finished(self) -> set[str]:
        """The config hashes of every run in the store."""
        return {row[0] for row in self._query("SELECT config_hash FROM runs")}

    # ------------------------------------------------------------------------- data fingerprints
    def fingerprints(self) -> dict[str, str]:
        """{data key (:func:`data_key`): fingerprint} of the runs in the store.

        Raises ValueError if the store already mixes two fingerprints for one data key (written
        before this check existed).
        """
        if self._known is None:
            known: dict[str, str] = {}
            for key, config, fingerprint in self._query("SELECT config_hash, config, data_fingerprint FROM runs"):
                data = data_key(self._json(config, key, "config"))
                if known.setdefault(data, fingerprint) != fingerprint:
                    raise ValueError(f"{self.path}: already mixes runs on different data for {_describe(data)}: "
                                     f"data fingerprints {known[data]} and {fingerprint}")
            self._known = known
        return self._known

    def check_fingerprints(self, expected: Mapping[str, str]) -> None:
        """Refuse data that differs from the data of the runs in the store.

        ``expected``: {data key: fingerprint of the data as it is now}. Raises ValueError naming
        the dataset, its settings and both fingerprints for the first key whose stored
        fingerprint differs.
        """
        known = self.fingerprints()
        for key in sorted(expected):
            if key in known and known[key] != expected[key]:
                raise ValueError(
                    f"{self.path} holds runs on {_describe(key)} with data fingerprint {known[key]}, but the data "
                    f"now gives {expected[key]}: the data files changed since those runs; restore them, or give "
                    "runs on the new data their own --db")

    # ----------------------------------------------------------------- raw data and code versions
    def _tables(self) -> set[str]:
        return {row[0] for row in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def raw_data(self) -> dict[str, str]:
        """{raw key (:func:`raw_key`): SHA-256 of the raw data} recorded by the store's runs ({} for
        a store written before the record existed)."""
        if "raw_data" not in self._tables():
            return {}
        return dict(self._query("SELECT raw_key, raw_sha256 FROM raw_data"))

    def check_raw_data(self, expected: Mapping[str, str]) -> None:
        """Refuse raw data that differs from the raw data of the runs in the store.

        ``expected``: {raw key: SHA-256 of the raw data as it is now}. Raises ValueError naming the
        dataset and both hashes for the first key whose recorded hash differs.
        """
        _refuse_other_raw_data(self.path, self.raw_data(), expected)

    def code_versions(self, hashes: Iterable[str] | None = None) -> dict[str, dict | None]:
        """{config hash: {"version", "git_commit", "git_dirty", "cpu"} of the code that trained the
        run and its machine (``cpu``: :func:`affdiv.provenance.machine_identity`, None where not
        recorded), or None when the store did not record the code (a run stored before the record
        existed)}."""
        known = {}
        if "run_code" in self._tables():
            cpu = "cpu" if self._has_column("cpu", "run_code") else "NULL"
            for key, version, commit, dirty, machine in self._query(
                    f"SELECT config_hash, version, git_commit, git_dirty, {cpu} FROM run_code"):
                known[key] = {"version": version, "git_commit": commit,
                              "git_dirty": None if dirty is None else bool(dirty),
                              "cpu": None if machine is None else self._cpu(machine, key)}
        runs = self.finished() if hashes is None else set(hashes) & self.finished()
        return {key: known.get(key) for key in sorted(runs)}

    def put(self, config: dict, run: StoredRun) -> str:
        """Commit one finished run (``config``: its config dict, ``run``: what it produced) in one
        transaction; returns its config hash.

        A run already present (same hash) is left as it is: a finished run is never overwritten.
        A run whose data fingerprint differs from that of the stored runs with the same data
        settings, or whose raw data hashes otherwise than that of the stored runs with the same
        :func:`raw_key`, is refused (ValueError), so one store never mixes two versions of a dataset.
        """
        if self.read_only:
            raise PermissionError(f"{self.path}: opened read-only")
        from affdiv.provenance import code_identity, machine_identity

        if not isinstance(run, StoredRun):
            raise ValueError(f"run must be a StoredRun, got {type(run).__name__}")
        if run.check_seconds is not None and not 0 <= run.check_seconds < math.inf:
            raise ValueError(f"a run's check_seconds must be a finite number of seconds >= 0, got {run.check_seconds}")
        key = config_hash(config)
        data = data_key(config)
        self.check_fingerprints({data: run.data_fingerprint})
        code = dict(run.code or {**code_identity(), "cpu": machine_identity(config.get("device", "cpu"))})
        row = (
            key,
            canonical_json(config),
            canonical_json({k: _finite_or_none(v) for k, v in run.metrics.items()}),
            canonical_json([{k: _finite_or_none(v) for k, v in c.items()} for c in run.curves]),
            float(run.seconds),
            run.data_fingerprint,
            _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            canonical_json(_finite_json(list(run.measurements))) if run.measurements else None,
            zlib.compress(canonical_json(_finite_json(list(run.candidates))).encode(), 9) if run.candidates else None,
            None if run.check_seconds is None else float(run.check_seconds),
        )
        try:
            self._commit_run(key, config, row, run.raw_sha256, code)
        except sqlite3.DatabaseError as error:  # a full disk, a lock held too long: the transaction rolled back
            raise _database_error(self.path, error) from None
        self.fingerprints().setdefault(data, run.data_fingerprint)
        return key

    def _commit_run(self, key: str, config: dict, row: tuple, raw_sha256: str | None, code: Mapping) -> None:
        """The transaction of :meth:`put`: the raw data's record, the run and its code, or none."""
        with self._db:  # BEGIN ... COMMIT (rolled back on error)
            self._db.execute("BEGIN IMMEDIATE")
            if raw_sha256 is not None:
                raw = raw_key(config)
                known = dict(self._db.execute("SELECT raw_key, raw_sha256 FROM raw_data WHERE raw_key = ?", (raw,)))
                _refuse_other_raw_data(self.path, known, {raw: raw_sha256})
                self._db.execute("INSERT OR IGNORE INTO raw_data VALUES (?, ?, ?)", (raw, raw_sha256, row[6]))
            columns = ["config_hash", "config", "metrics", "curves", "seconds", "data_fingerprint", "finished_utc",
                       "measurements"]
            values = list(row[:len(columns)])
            for name, value in zip(("candidates", "check_seconds"), row[len(columns):]):
                if value is None:
                    continue
                if not self._has_column(name):  # a store of an earlier version: the column is added
                    self._db.execute(f"ALTER TABLE runs ADD COLUMN {name} {_ADDED_COLUMNS[name]}")
                columns.append(name)
                values.append(value)
            self._db.execute(f"INSERT OR IGNORE INTO runs ({', '.join(columns)}) "
                             f"VALUES ({', '.join('?' * len(columns))})", values)
            dirty = code.get("git_dirty")
            columns, values = ["config_hash", "version", "git_commit", "git_dirty"], \
                [key, str(code["version"]), code.get("git_commit"), None if dirty is None else int(dirty)]
            if code.get("cpu") is not None:
                if not self._has_column("cpu", "run_code"):  # a store of an earlier version: the column is added
                    self._db.execute("ALTER TABLE run_code ADD COLUMN cpu TEXT")
                columns.append("cpu")
                values.append(canonical_json(dict(code["cpu"])))
            self._db.execute(f"INSERT OR IGNORE INTO run_code ({', '.join(columns)}) "
                             f"VALUES ({', '.join('?' * len(columns))})", values)

    def put_failure(self, config: dict, *, error: str, kind: str, attempts: int, detail: str = "") -> str:
        """Record that a run failed on its last attempt (``kind``: "worker died", "exception", ...;
        ``error`` one line, ``detail`` a traceback), in one transaction; returns its config hash.

        The run stays unfinished, so a resumed sweep trains it again. A later failure of the same
        run replaces its record; once the run is finished, :meth:`failures` leaves it out.
        """
        if self.read_only:
            raise PermissionError(f"{self.path}: opened read-only")
        key = config_hash(config)
        row = (key, canonical_json(config), str(error), str(kind), int(attempts), str(detail),
               _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(_FAILURES)
                self._db.execute("INSERT OR REPLACE INTO failures VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.DatabaseError as error:
            raise _database_error(self.path, error) from None
        return key

    def failures(self, hashes: Iterable[str] | None = None) -> list[dict]:
        """The recorded failures of runs that are still unfinished (``hashes``: of these runs only):
        ``{config_hash, config, error, kind, attempts, detail, failed_utc}`` each, in the order of
        :meth:`records`."""
        tables = {row[0] for row in self._query("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "failures" not in tables:
            return []
        rows = self._query("SELECT config_hash, config, error, kind, attempts, detail, failed_utc FROM failures "
                           "WHERE config_hash NOT IN (SELECT config_hash FROM runs)")
        wanted = None if hashes is None else set(hashes)
        out = []
        for key, config, error, kind, attempts, detail, failed_utc in rows:
            if wanted is None or key in wanted:
                config = self._json(config, key, "config")
                out.append({"config_hash": key, "config": config, "error": error, "kind": kind,
                            "attempts": attempts, "detail": detail, "failed_utc": failed_utc})
        return sorted(out, key=lambda f: _record_order({**f["config"], "config_hash": f["config_hash"]}))

    # ---------------------------------------------------------------------------------- reading
    def _cpu(self, text: str, key: str) -> dict:
        """The ``cpu`` cell of run ``key``'s code: a JSON object (:func:`affdiv.provenance.machine_identity`)."""
        value = self._json(text, key, "cpu")
        if not isinstance(value, dict):
            raise ValueError(f"{self.path}: run {key}: column 'cpu' is not a JSON object (damaged store)")
        return value

    def _json(self, text, key: str, column: str):
        """The JSON value of one cell: text, or (``candidates`` only) zlib-compressed JSON bytes."""
        try:
            return json.loads(zlib.decompress(text) if column == "candidates" and isinstance(text, bytes) else text)
        except (TypeError, ValueError, zlib.error):
            raise ValueError(f"{self.path}: run {key}: column {column!r} is not valid JSON (damaged store)") from None

    def _rows(self, hashes: Iterable[str] | None):
        """(key, config, metrics, curves, seconds, fingerprint), JSON parsed and the key checked."""
        rows = self._query("SELECT config_hash, config, metrics, curves, seconds, data_fingerprint FROM runs")
        if hashes is not None:
            wanted = set(hashes)
            rows = [row for row in rows if row[0] in wanted]
        out = []
        for key, config, metrics, curves, seconds, fingerprint in sorted(rows):  # the file's order never leaks
            config = self._json(config, key, "config")
            if not isinstance(config, dict) or config_hash(config) != key:
                raise ValueError(f"{self.path}: run {key}: its config does not hash to its key (the store was "
                                 "modified outside affdiv)")
            metrics, curves = self._json(metrics, key, "metrics"), self._json(curves, key, "curves")
            if not isinstance(metrics, dict) or not isinstance(curves, list) or not isinstance(seconds, int | float):
                raise ValueError(f"{self.path}: run {key}: malformed metrics, curves or seconds (damaged store)")
            out.append((key, config, metrics, curves, seconds, fingerprint))
        return out

    def records(self, hashes: Iterable[str] | None = None, *, metric: str = "test_accuracy") -> list[dict]:
        """One flat dict per run: its config, its metrics, ``metric`` copied to key "metric", and for
        a run with measurements the columns of
        :func:`~affdiv.experiments.runs.divergence_measurement.record_columns` (at its batch size)
        and :func:`~affdiv.experiments.runs.noise_scale.record_columns`. With ``metric``
        ``steps_to_target``, a run of a target ladder (``targets``) gives one dict per target
        instead, read from its candidates' curves (:func:`ladder_records`).

        Sorted by (method, batch_size, seed, target, config hash); timing is left out, so the
        records of a sweep do not depend on when or in what order its runs finished.
        """
        out = []
        measured = self.measurements(hashes)
        kept = self.candidates(hashes) if metric == "steps_to_target" else {}
        if measured:
            from affdiv.experiments.runs import divergence_measurement, noise_scale
        for key, config, metrics, _curves, _seconds, fingerprint in self._rows(hashes):
            record = {**config, **metrics}
            if metric not in record:
                raise ValueError(f"{self.path}: metric {metric!r} not in run {key}; it has: {sorted(record)}")
            record.update(metric=record[metric], config_hash=key, data_fingerprint=fingerprint)
            if key in measured:  # each measurement's columns (none when the run has no such measurements)
                record.update(divergence_measurement.record_columns(measured[key], batch_size=record["batch_size"]))
                record.update(noise_scale.record_columns(measured[key]))
            if config.get("targets") and metric == "steps_to_target":
                if key not in kept:
                    raise ValueError(f"{self.path}: run {key} reads targets {config['targets']} but kept no "
                                     "candidates' curves (damaged store)")
                out += ladder_records(record, kept[key])
            else:
                out.append(record)
        return sorted(out, key=_record_order)

    def budgets(self) -> set[str]:
        """The budget kinds of the stored runs ("" for a run that names none), from their configs
        alone: what ``affdiv analyse`` chooses its default metric by before reading the runs."""
        budgets = set()
        for key, text in self._query("SELECT config_hash, config FROM runs"):
            config = self._json(text, key, "config")
            if not isinstance(config, dict):
                raise ValueError(f"{self.path}: run {key}: its config is not a JSON object (damaged store)")
            budgets.add(str(config.get("budget", "")))
        return budgets

    def curves(self, hashes: Iterable[str] | None = None) -> list[dict]:
        """Per-epoch points of every run, each tagged with its run's config and hash."""
        out = []
        for key, config, _metrics, curves, _seconds, _fingerprint in self._rows(hashes):
            tags = {**config, "config_hash": key}
            out += [{**tags, **point} for point in curves if isinstance(point, dict)]
        return sorted(out, key=lambda c: (*_record_order(c), c.get("epoch", 0)))

    def seconds(self, hashes: Iterable[str] | None = None) -> float:
        """Total compute time of the runs (for provenance and a report's cost, never for its analysis)."""
        return sum(self._times("seconds", hashes).values())

    def _times(self, column: str, hashes: Iterable[str] | None) -> dict[str, float]:
        """{config hash: the run's ``column`` (seconds or check_seconds)} of the runs (``hashes``: of
        these only) where it is not null, read without parsing the runs' JSON; a value that is no
        finite time >= 0 is named as damage."""
        wanted = None if hashes is None else set(hashes)
        rows = sorted(self._query(f"SELECT config_hash, {column} FROM runs WHERE {column} IS NOT NULL"))
        times = {key: value for key, value in rows if wanted is None or key in wanted}
        bad = [key for key, value in times.items() if not isinstance(value, int | float) or not 0 <= value < math.inf]
        if bad:
            raise ValueError(f"{self.path}: run {bad[0]}: malformed {column} (damaged store)")
        return times

    def check_time(self, hashes: Iterable[str] | None = None) -> dict:
        """The runs' time in checks (for provenance and a report's cost, never for its analysis):
        ``check_s`` summed over the runs that recorded it (``runs_recorded`` of ``runs``), and
        ``share``, their check seconds over their seconds (None where no run recorded it or they
        took no time)."""
        seconds = self._times("seconds", hashes)
        recorded = self._times("check_seconds", hashes) if self._has_column("check_seconds") else {}
        checks, of = sum(recorded.values()), sum(seconds[key] for key in recorded)
        return {"check_s": checks, "runs_recorded": len(recorded), "runs": len(seconds),
                "share": checks / of if recorded and of > 0 else None}

    def export_csv(
        self, path: str | Path, hashes: Iterable[str] | None = None, *, metric: str = "test_accuracy"
    ) -> Path:
        """Write ``records`` as CSV (method, batch_size, seed, metric, then the other columns sorted)."""
        return write_csv(path, self.records(hashes, metric=metric))


def _refuse_other_raw_data(path: Path, known: Mapping[str, str], expected: Mapping[str, str]) -> None:
    for key in sorted(expected):
        if key in known and known[key] != expected[key]:
            settings = json.loads(key)
            seed = f", data_seed {settings['data_seed']}" if "data_seed" in settings else ""
            raise ValueError(
                f"{path} holds runs trained on dataset {settings['dataset']!r}{seed} whose raw data had SHA-256 "
                f"{known[key][:16]}..., but the data now gives {expected[key][:16]}...: the data files changed "
                "since those runs; restore them, or give runs on the new data their own --db")


def ladder_records(record: Mapping, candidates: list[dict]) -> list[dict]:
    """One record per target of a ladder run (``record``: its config and metrics, flat), from its
    candidates' curves (:func:`~affdiv.experiments.runs.reads.best_at_targets`): ``target``,
    ``steps_to_target`` (and ``metric``), ``censored``, ``diverged``, ``lr``, ``lr_at_grid_edge``
    at that target; ``primary_target`` is the run's ``target``. The other columns are the run's."""
    from affdiv.experiments.runs.config import RunConfig

    config = RunConfig.from_dict({k: record[k] for k in RunConfig.__dataclass_fields__ if k in record})
    best = reads.best_at_targets(candidates, config.ladder, max_steps=int(record["max_steps"]),
                                 interpolate=config.read_spacing is not None, tuned=config.lr_rule == "tuned")
    out = []
    for target, chosen in best.items():
        row = {**record, **{k: v for k, v in chosen.items() if k != "momentum"}, "target": target,
               "primary_target": config.target, "metric": chosen["steps_to_target"]}
        if "tuned_momentum" in record:
            row["tuned_momentum"] = chosen["momentum"]
        out.append(row)
    return out


def _record_order(record: dict) -> tuple:
    return (str(record["method"]), int(record["batch_size"]), int(record["seed"]), float(record.get("target") or 0),
            record.get("config_hash", ""))


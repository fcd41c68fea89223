"""Records: the one place that reads and writes record CSVs and checks a record's types.

A record is one run's row: ``method``, ``batch_size``, ``seed``, the metric column, and any other
columns (``lr_rule``, ``diverged``, ...). Floats are written with ``repr``, so a CSV round trip
gives back the same numbers bit for bit.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from affdiv.atomic import atomic_write

REQUIRED_COLUMNS = ("method", "batch_size", "seed")
# Method names of earlier versions, read as today's (0.1 called the norm-like layer "l2").
RENAMED_METHODS = {"l2": "norm_l2"}


def _as_int(value, column: str, where: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{where}: column {column!r} must be an integer, got {value!r}")
    return int(number)


def _validate_record(record: Mapping, metric: str, where: str) -> dict:
    missing = [c for c in (*REQUIRED_COLUMNS, metric) if c not in record or record[c] in (None, "")]
    if missing:
        raise ValueError(f"{where}: missing value for column(s) {missing}; expected columns "
                         f"{[*REQUIRED_COLUMNS, metric]}, got {sorted(record)}")
    row = dict(record)
    method = str(record["method"]).strip()
    row["method"] = RENAMED_METHODS.get(method, method)
    row["batch_size"] = _as_int(record["batch_size"], "batch_size", where)
    if row["batch_size"] <= 0:
        raise ValueError(f"{where}: batch_size must be > 0, got {record['batch_size']!r}")
    row["seed"] = _as_int(record["seed"], "seed", where)
    try:
        row[metric] = float(record[metric])
    except (TypeError, ValueError):
        row[metric] = math.nan
    if not math.isfinite(row[metric]):
        raise ValueError(f"{where}: column {metric!r} must be a finite number, got {record[metric]!r}")
    if record.get("diverged") not in (None, ""):
        row["diverged"] = _as_int(record["diverged"], "diverged", where)
        if row["diverged"] not in (0, 1):
            raise ValueError(f"{where}: column 'diverged' must be 0 or 1, got {record['diverged']!r}")
    return row


def validate_records(records: Sequence[Mapping], *, metric: str = "metric") -> list[dict]:
    """Copies of ``records`` with method:str, batch_size:int > 0, seed:int, metric:finite float,
    and diverged: 0 or 1 where the record has it.

    Other keys are kept unchanged. Raises ValueError naming the record, the column, the expected
    and the actual value.
    """
    return [_validate_record(record, metric, f"record {i}") for i, record in enumerate(records, start=1)]


def read_csv(path, *, metric: str = "metric") -> list[dict]:
    """Records from a CSV with (at least) columns method, batch_size, seed and ``metric``.

    Typed as in :func:`validate_records`; other columns (lr_rule, ...) stay text.
    """
    path = Path(path)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        missing = [c for c in (*REQUIRED_COLUMNS, metric) if c not in header]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; expected {[*REQUIRED_COLUMNS, metric]}, "
                             f"got header {header}")
        rows = list(reader)
    if not rows:
        raise ValueError(f"{path}: no data rows below the header")
    # Line numbers count the header as line 1.
    return [_validate_record(row, metric, f"{path} line {i}") for i, row in enumerate(rows, start=2)]


def write_csv(path, records: Sequence[Mapping], *, metric: str = "metric") -> Path:
    """Write records with the required columns first, then the others in sorted order.

    Floats are written with repr, so :func:`read_csv` gives back the same numbers bit for bit.
    """
    extra = sorted({key for record in records for key in record} - {*REQUIRED_COLUMNS, metric})
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=[*REQUIRED_COLUMNS, metric, *extra])
    writer.writeheader()
    for record in records:
        writer.writerow({key: (repr(v) if isinstance(v, float) else v) for key, v in record.items()})
    return atomic_write(path, buffer.getvalue())

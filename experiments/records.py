"""Records: the one place that reads and writes record CSVs, checks a record's types and tells a CSV from
a results store (:func:`is_sqlite`).

A record is one run's row: ``method``, ``batch_size``, ``seed``, the metric column, and any other
columns (``lr_rule``, ``diverged``, ...). Runs of the ``target`` budget add ``steps_to_target``
(empty when the run was censored), ``censored`` (0/1), ``max_steps`` and ``target``; with
``steps_to_target`` as the metric an empty value is a censored run, not a missing one. Floats are
written with ``repr``, so a CSV round trip gives back the same numbers bit for bit.

Reading accepts what spreadsheets write: UTF-8 with or without a BOM, UTF-16/32 with a BOM,
comma-, tab- or semicolon-separated; seeds are exact integers of any size.
"""

from __future__ import annotations

import codecs
import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from affdiv.atomic import atomic_write
from affdiv.checks import is_int
from affdiv.vocabulary import TARGET_METRIC

REQUIRED_COLUMNS = ("method", "batch_size", "seed")
# Method names of earlier versions, read as today's (0.1 called the norm-like layer "l2").
RENAMED_METHODS = {"l2": "norm_l2"}
#: Metrics that may be empty: the run was censored (it did not reach the target within max_steps).
CENSORED_METRICS = (TARGET_METRIC,)
#: The optional columns of target-budget runs (typed by :func:`_target_columns`).
_TARGET_COLUMNS = ("censored", "max_steps", "target")


def _as_int(value, column: str, where: str) -> int:
    """``value`` as an exact int: an int, an integral float, or text of either ("7", "7.0", "1e3")."""
    if is_int(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())  # exact, however large (a float would round above 2**53)
        except ValueError:
            pass
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{where}: column {column!r} must be an integer, got {value!r}")
    return int(number)


def _is_empty(value) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def _target_columns(row: dict, record: Mapping, metric: str, where: str) -> None:
    """Type the optional columns of target-budget runs in ``row``; with ``steps_to_target`` as the
    metric, also check that each run is either reached (steps in (0, max_steps]) or censored."""
    if not _is_empty(record.get("censored")):
        row["censored"] = _as_int(record["censored"], "censored", where)
        if row["censored"] not in (0, 1):
            raise ValueError(f"{where}: column 'censored' must be 0 or 1, got {record['censored']!r}")
    if not _is_empty(record.get("max_steps")):
        row["max_steps"] = _as_int(record["max_steps"], "max_steps", where)
        if row["max_steps"] <= 0:
            raise ValueError(f"{where}: max_steps must be > 0, got {record['max_steps']!r}")
    if not _is_empty(record.get("target")):
        try:
            row["target"] = float(record["target"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: column 'target' must be a number, got {record['target']!r}") from None
    if metric not in CENSORED_METRICS:
        return
    if "max_steps" not in row:
        raise ValueError(f"{where}: missing value for column 'max_steps'; a {metric} record needs it (the "
                         "censoring bound)")
    if _is_empty(record.get(metric)):
        if row.get("censored") == 0:
            raise ValueError(f"{where}: censored = 0 but no {metric}; a run that reached the target records "
                             "its steps")
        row[metric], row["censored"] = None, 1
        return
    try:
        steps = float(record[metric])
    except (TypeError, ValueError):
        steps = math.nan
    if not (math.isfinite(steps) and steps > 0):
        raise ValueError(f"{where}: column {metric!r} must be a positive number of steps, or empty for a "
                         f"censored run, got {record[metric]!r}")
    if steps > row["max_steps"]:
        raise ValueError(f"{where}: {metric} = {steps:g} exceeds max_steps = {row['max_steps']}")
    if row.get("censored") == 1:
        raise ValueError(f"{where}: censored = 1 but {metric} = {steps:g}; a censored run has no steps to target")
    row[metric], row["censored"] = steps, 0


def _validate_record(record: Mapping, metric: str, where: str) -> dict:
    required = REQUIRED_COLUMNS if metric in CENSORED_METRICS else (*REQUIRED_COLUMNS, metric)
    missing = [c for c in required if c not in record or record[c] in (None, "")]
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
    if not _is_empty(record.get("data_seed")):  # compared with seed (analysis/groups.py)
        row["data_seed"] = _as_int(record["data_seed"], "data_seed", where)
    if metric in CENSORED_METRICS or not record.keys().isdisjoint(_TARGET_COLUMNS):
        _target_columns(row, record, metric, where)
    if metric not in CENSORED_METRICS:
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
    and data_seed:int and diverged: 0 or 1 where the record has them.

    Other keys are kept unchanged. Raises ValueError naming the record, the column, the expected
    and the actual value.
    """
    return [_validate_record(record, metric, f"record {i}") for i, record in enumerate(records, start=1)]


# Byte-order marks, longest first (UTF-32's little-endian mark starts with UTF-16's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_DELIMITERS = (",", "\t", ";")
#: The first bytes of every SQLite file.
SQLITE_MAGIC = b"SQLite format 3\x00"


def is_sqlite(path: str | Path) -> bool:
    """Whether the file starts as every SQLite database does (a results store, not a CSV)."""
    with open(path, "rb") as handle:
        return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC


_WIDE = (("utf-16-le", "UTF-16 (little-endian)"), ("utf-16-be", "UTF-16 (big-endian)"),
         ("utf-32-le", "UTF-32 (little-endian)"), ("utf-32-be", "UTF-32 (big-endian)"))


def _nul_reason(head: bytes) -> str:
    """Why a file whose ``head`` holds a NUL byte is not read: text in a wide encoding without a
    byte-order mark (its head decodes to printable text with a line break or a delimiter), or
    binary."""
    for codec, name in _WIDE:
        try:
            text = codecs.getincrementaldecoder(codec)().decode(head, final=False)  # a cut last unit waits
        except UnicodeDecodeError:
            continue
        printable = all(c.isprintable() or c in "\r\n\t" for c in text)
        if text and printable and any(mark in text for mark in ("\n", *_DELIMITERS)):
            return (f"not UTF-8 text: it looks like {name} without a byte-order mark; save it as UTF-8, or as "
                    "UTF-16 with a BOM")
    return f"a binary file (a NUL byte at offset {head.index(0)}), not a text CSV"


def decode_text(data: bytes, where) -> tuple[str, str]:
    """(text, encoding) of a text file as spreadsheets write it: UTF-8 with or without a BOM, or
    UTF-16/UTF-32 with a BOM. Anything else raises ValueError naming the file and the encoding."""
    encoding = next((name for bom, name in _BOMS if data.startswith(bom)), "utf-8")
    if encoding == "utf-8" and b"\x00" in data[:4096]:  # no text CSV holds a NUL
        raise ValueError(f"{where}: {_nul_reason(data[:4096])}")
    try:
        return data.decode(encoding), encoding
    except UnicodeDecodeError as error:
        hint = "; save it as UTF-8 (or UTF-16 with a BOM)"
        raise ValueError(f"{where}: not valid {encoding} text (byte {data[error.start]:#04x} at offset "
                         f"{error.start}){hint}") from None


def read_csv_rows(path, data: bytes | None = None) -> tuple[list[str], list[dict]]:
    """(header, rows) of a CSV, the values as text, read as spreadsheets write it: UTF-8 (a BOM is
    skipped), or UTF-16/32 with a BOM; comma-, tab- or semicolon-separated (the delimiter is the one
    the header line uses); column names stripped of surrounding spaces. A malformed file, no data
    rows or a row with more fields than the header raise ValueError naming the file and the line.
    ``data``: the file's bytes when the caller has read them already (``path`` then only names it)."""
    path = Path(path)
    text, _encoding = decode_text(path.read_bytes() if data is None else data, path)
    first = text.split("\n", 1)[0]
    delimiter = max(_DELIMITERS, key=first.count) if any(d in first for d in _DELIMITERS) else ","
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = [name.strip() for name in reader.fieldnames or []]
        reader.fieldnames = header
        rows = list(reader)
    except csv.Error as error:  # e.g. a field over csv.field_size_limit() characters
        raise ValueError(f"{path} line {reader.line_num + 1}: {error}") from None  # the line being read
    if not rows:
        raise ValueError(f"{path}: no data rows below the header")
    for number, row in enumerate(rows, start=2):  # line numbers count the header as line 1
        if None in row:
            raise ValueError(f"{path} line {number}: {len(row[None])} more field(s) than the {len(header)} "
                             f"columns of the header")
    return header, rows


def read_csv(path, *, metric: str = "metric", table: tuple[list[str], list[dict]] | None = None) -> list[dict]:
    """Records from a CSV with (at least) columns method, batch_size, seed and ``metric``, read by
    :func:`read_csv_rows` (``table``: its result, when the file was already read). Typed as in
    :func:`validate_records`; other columns (lr_rule, ...) stay text. Any problem raises ValueError
    naming the file and the line.
    """
    header, rows = table if table is not None else read_csv_rows(path)
    missing = [c for c in (*REQUIRED_COLUMNS, metric) if c not in header]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; expected {[*REQUIRED_COLUMNS, metric]}, "
                         f"got header {header}")
    return [_validate_record(row, metric, f"{path} line {number}") for number, row in enumerate(rows, start=2)]


def write_csv(path, records: Sequence[Mapping], *, metric: str = "metric") -> Path:
    """Write records with the required columns first, then the others in sorted order.

    Floats (numpy's too) are written with float's repr, so :func:`read_csv` gives back the same
    numbers bit for bit.
    """
    extra = sorted({key for record in records for key in record} - {*REQUIRED_COLUMNS, metric})
    columns = [*REQUIRED_COLUMNS, metric, *extra]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(columns)
    writer.writerows([float.__repr__(v) if isinstance(v, float) else v for v in map(record.get, columns)]
                     for record in records)  # a missing key (None) is written as an empty field
    return atomic_write(path, buffer.getvalue())

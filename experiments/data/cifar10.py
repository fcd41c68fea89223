"""CIFAR-10 (Krizhevsky 2009) from the official python-pickle release, checksummed, read without extracting.

The release ``cifar-10-python.tar.gz`` holds ``cifar-10-batches-py/`` with ``data_batch_1`` ...
``data_batch_5`` (the 50k training pool), ``test_batch`` (10k) and ``batches.meta``; each batch is a
pickled dict with ``b"data"`` (uint8, (N, 3072): 1024 red, then green, then blue values, each a
32x32 image in row-major order) and ``b"labels"`` (N ints in [0, 10)). The pickles are read by a
restricted unpickler: it resolves only the numpy globals an ndarray needs, so a tampered file
cannot execute code.

Accepted locations (``data_dir``, else ``$CIFAR10_DIR``): the tarball itself; a folder holding
``cifar-10-python.tar.gz``; an extracted ``cifar-10-batches-py`` folder or a folder holding one.
The tarball is checked against its md5 (``md5``); an extracted folder file by file (``member_md5``).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tarfile
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from affdiv.experiments.data.raw import RawData

ENV_VAR = "CIFAR10_DIR"
ARCHIVE = "cifar-10-python.tar.gz"
FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META = "batches.meta"
MEMBERS = (*TRAIN_BATCHES, TEST_BATCH, META)
#: md5 of the official tarball and of its members (as published with the dataset and by torchvision).
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
MEMBER_MD5 = {
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10

# numpy's array-rebuilding functions (pickle protocols <= 4, and 5), whatever module holds them now.
_RECONSTRUCT = np.zeros(0).__reduce_ex__(2)[0]
_FROMBUFFER = np.zeros(0).__reduce_ex__(5)[0]
#: (module, name) -> object: everything a pickled uint8 ndarray needs, under numpy 1.x and 2.x names.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            allowed = ", ".join(f"{m}.{n}" for m, n in _ALLOWED_GLOBALS)
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name} (only {allowed} are allowed)"
            ) from None


def restricted_loads(data: bytes, *, source: str) -> object:
    """``pickle.loads`` that resolves only numpy's ndarray/dtype reconstruction (bytes stay bytes).

    Raises ``ValueError`` naming ``source`` for any unreadable pickle or any other global it names.
    """
    try:
        return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as error:  # any failure on untrusted bytes is reported as bad data, with its cause
        raise ValueError(f"{source}: not a readable CIFAR pickle ({type(error).__name__}: {error})") from error


def md5_of_file(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _check_md5(actual: str, expected: str, what: str) -> None:
    if not isinstance(expected, str) or len(expected) != 32 or not set(expected.lower()) <= set("0123456789abcdef"):
        raise ValueError(f"{what}: an md5 is 32 hexadecimal digits, got {expected!r}")
    if actual != expected.lower():
        raise ValueError(f"{what}: md5 mismatch, expected {expected.lower()}, actual {actual}")


def locate_cifar10(data_dir: str | Path | None = None) -> Path:
    """The tarball or the extracted ``cifar-10-batches-py`` folder that ``data_dir`` designates."""
    given = data_dir if data_dir is not None else os.environ.get(ENV_VAR)
    if not given:
        raise FileNotFoundError(
            f"CIFAR-10 needs a local copy: pass data_dir / --data-dir (or set ${ENV_VAR}) to {ARCHIVE},"
            f" a folder holding it, or an extracted {FOLDER} folder"
        )
    path = Path(given)
    for candidate in (path, path / ARCHIVE, path / FOLDER):
        if candidate.is_file() or (candidate / TRAIN_BATCHES[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"CIFAR-10 not found at {path}: expected the file {ARCHIVE}, a folder holding it,"
        f" or a {FOLDER} folder with {', '.join(MEMBERS)}"
    )


def _read_archive(archive: Path, md5: str) -> dict[str, bytes]:
    _check_md5(md5_of_file(archive), md5, str(archive))
    members: dict[str, bytes] = {}
    wanted = {f"{FOLDER}/{name}": name for name in MEMBERS}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:  # one forward pass: seeking backwards in a gzip stream re-decompresses
                if info.name in wanted and info.isfile():
                    members[wanted[info.name]] = tar.extractfile(info).read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise ValueError(f"{archive}: not a readable .tar.gz ({type(error).__name__}: {error})") from error
    missing = [f"{FOLDER}/{name}" for name in MEMBERS if name not in members]
    if missing:
        raise ValueError(f"{archive}: missing member(s) {', '.join(missing)}")
    return members


def _read_folder(folder: Path, member_md5: Mapping[str, str]) -> dict[str, bytes]:
    missing = [name for name in MEMBERS if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder}: missing file(s) {', '.join(missing)}")
    members = {name: (folder / name).read_bytes() for name in MEMBERS}
    for name, data in members.items():
        _check_md5(hashlib.md5(data, usedforsecurity=False).hexdigest(), member_md5[name], str(folder / name))
    return members


def _field(record: Mapping, key: str, source: str):
    for candidate in (key.encode(), key):  # bytes keys as released; str keys if re-pickled by Python 3
        if candidate in record:
            return record[candidate]
    raise ValueError(f"{source}: missing key {key!r}; found {sorted(map(repr, record))}")


def _batch(data: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    record = restricted_loads(data, source=source)
    if not isinstance(record, dict):
        raise ValueError(f"{source}: expected a pickled dict, got {type(record).__name__}")
    pixels, labels = _field(record, "data", source), _field(record, "labels", source)
    width = int(np.prod(IMAGE_SHAPE))
    if not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != width:
        got = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise ValueError(f"{source}: expected data as uint8 array (N, {width}), got {got}")
    if not isinstance(labels, list | np.ndarray) or not all(isinstance(v, int | np.integer) for v in labels):
        raise ValueError(f"{source}: expected labels as a list of ints")
    if len(labels) != len(pixels):
        raise ValueError(f"{source}: {len(pixels)} images but {len(labels)} labels")
    return pixels.reshape(-1, *IMAGE_SHAPE), np.asarray(labels, dtype=np.int64)


def _class_names(data: bytes, source: str) -> tuple[str, ...]:
    record = restricted_loads(data, source=source)
    names = _field(record, "label_names", source) if isinstance(record, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES or not all(isinstance(n, bytes | str) for n in names):
        raise ValueError(f"{source}: expected label_names as a list of {NUM_CLASSES} strings, got {names!r}")
    return tuple(n.decode() if isinstance(n, bytes) else n for n in names)


def load_cifar10(
    data_dir: str | Path | None = None,
    *,
    md5: str | None = None,
    member_md5: Mapping[str, str] | None = None,
) -> RawData:
    """The 50k training pool (batches 1-5 in order) and the 10k test batch as uint8 (N, 3, 32, 32).

    ``md5`` (tarball) and ``member_md5`` (extracted folder, one per member) default to the official sums.
    """
    location = locate_cifar10(data_dir)
    if location.is_file():
        if member_md5 is not None:
            raise ValueError(f"{location} is a tarball: member_md5 applies to an extracted folder, use md5")
        members = _read_archive(location, ARCHIVE_MD5 if md5 is None else md5)
    else:
        if md5 is not None:
            raise ValueError(f"{location} is an extracted folder: md5 applies to the tarball, use member_md5")
        expected = MEMBER_MD5 if member_md5 is None else member_md5
        if set(expected) != set(MEMBERS):
            raise ValueError(f"member_md5 must have keys {sorted(MEMBERS)}, got {sorted(expected)}")
        members = _read_folder(location, expected)
    where = f"{location}:{FOLDER}" if location.is_file() else str(location)
    batches = [_batch(members[name], f"{where}/{name}") for name in TRAIN_BATCHES]
    x_test, y_test = _batch(members[TEST_BATCH], f"{where}/{TEST_BATCH}")
    names = _class_names(members[META], f"{where}/{META}")
    x_pool = np.concatenate([x for x, _ in batches])
    y_pool = np.concatenate([y for _, y in batches])
    return RawData("cifar10", x_pool, y_pool, x_test, y_test, names)

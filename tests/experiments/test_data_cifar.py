"""CIFAR-10 from the python-pickle release: a tiny archive built here in the release's exact format.

The official batches were written by Python 2's cPickle (protocol 2): py2 strings as BINSTRING
opcodes, arrays through ``numpy.core.multiarray._reconstruct``. ``py2_pickle`` writes those opcodes
by hand, so the loader is tested on the same bytes the real files hold, not on its own output.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from affdiv.experiments.data.cifar10 import ARCHIVE_MD5, load_cifar10, restricted_loads
from affdiv.experiments.data.dataset import load_dataset

NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
PER_BATCH = 4


def _str(data: bytes) -> bytes:  # py2 str: SHORT_BINSTRING or BINSTRING
    return b"U" + bytes([len(data)]) + data if len(data) < 256 else b"T" + struct.pack("<i", len(data)) + data


def _int(value: int) -> bytes:  # BININT1 / BININT2 / BININT
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    return b"J" + struct.pack("<i", value)


def _value(value) -> bytes:
    if isinstance(value, bytes):
        return _str(value)
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, list):
        return b"](" + b"".join(_value(v) for v in value) + b"e"
    assert isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 2
    return (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + _int(0) + b"\x85" + _str(b"b") + b"\x87R"
        + b"(" + _int(1) + _int(value.shape[0]) + _int(value.shape[1]) + b"\x86"
        + b"cnumpy\ndtype\n" + _str(b"u1") + _int(0) + _int(1) + b"\x87R"
        + b"(" + _int(3) + _str(b"|") + b"NNN" + _int(-1) + _int(-1) + _int(0) + b"tb"
        + b"\x89" + _str(value.tobytes()) + b"tb"
    )  # fmt: skip


def py2_pickle(record: dict[bytes, object]) -> bytes:
    """``record`` as Python 2's cPickle.dump(record, f, 2) writes it (no memo opcodes)."""
    return b"\x80\x02}(" + b"".join(_str(k) + _value(v) for k, v in record.items()) + b"u."


def batches(seed: int = 0) -> dict[str, dict[bytes, object]]:
    rng = np.random.default_rng(seed)
    out = {}
    for index, name in enumerate([*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]):
        out[name] = {
            b"batch_label": f"batch {index}".encode(),
            b"labels": [int(v) for v in (np.arange(PER_BATCH) + index) % 10],
            b"data": rng.integers(0, 256, size=(PER_BATCH, 3072), dtype=np.uint8),
            b"filenames": [f"img_{index}_{k}.png".encode() for k in range(PER_BATCH)],
        }
    out["batches.meta"] = {b"num_cases_per_batch": PER_BATCH, b"label_names": NAMES, b"num_vis": 3072}
    return out


def write_archive(path: Path, members: dict[str, bytes]) -> str:
    """A .tar.gz with ``cifar-10-batches-py/<name>`` members; returns its md5."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {"readme.html": b"<html></html>", **members}.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture
def records():
    return batches()


@pytest.fixture
def archive(tmp_path, records):
    path = tmp_path / "cifar-10-python.tar.gz"
    md5 = write_archive(path, {name: py2_pickle(r) for name, r in records.items()})
    return path, md5


def test_tiny_archive_loads_in_release_layout(archive, records):
    path, md5 = archive
    raw = load_cifar10(path, md5=md5)
    assert raw.x_pool.shape == (5 * PER_BATCH, 3, 32, 32) and raw.x_test.shape == (PER_BATCH, 3, 32, 32)
    first = records["data_batch_1"][b"data"][0]
    # Channel-major rows: green (channel 1) pixel at row 2, column 5 is entry 1024 + 2 * 32 + 5.
    assert raw.x_pool[0, 1, 2, 5] == first[1024 + 2 * 32 + 5]
    assert raw.x_pool[0, 2, 31, 31] == first[3071]
    last = records["data_batch_5"][b"data"][-1]
    np.testing.assert_array_equal(raw.x_pool[-1].reshape(-1), last)  # batches concatenated in order 1..5
    assert raw.y_pool.tolist() == sum((records[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert raw.y_test.tolist() == records["test_batch"][b"labels"]
    assert raw.class_names == tuple(n.decode() for n in NAMES)

    data = load_dataset("cifar10", data_dir=path.parent, md5=md5, val_fraction=0.25)
    assert (len(data.train), len(data.val), len(data.test)) == (15, 5, PER_BATCH)
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10


def test_extracted_folder_with_member_checksums(tmp_path, records):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    sums = {}
    for name, record in records.items():
        data = py2_pickle(record)
        (folder / name).write_bytes(data)
        sums[name] = hashlib.md5(data).hexdigest()
    for location in (folder, tmp_path):  # the folder itself, or the folder holding it
        raw = load_cifar10(location, member_md5=sums)
        np.testing.assert_array_equal(raw.y_test, records["test_batch"][b"labels"])
    official = "c99cafc152244af753f735de768cd75f"
    with pytest.raises(ValueError, match=f"data_batch_1: md5 mismatch, expected {official}, actual"):
        load_cifar10(folder)  # the official per-file sums
    with pytest.raises(ValueError, match="md5 applies to the tarball, use member_md5"):
        load_cifar10(folder, md5="0" * 32)


def test_python3_repickled_batches_load(tmp_path, records):
    members = {name: pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for name, r in records.items()}
    path = tmp_path / "cifar-10-python.tar.gz"
    raw = load_cifar10(path.parent, md5=write_archive(path, members))
    np.testing.assert_array_equal(raw.x_test.reshape(PER_BATCH, -1), records["test_batch"][b"data"])


def test_default_checksum_is_the_official_one(archive):
    path, md5 = archive
    with pytest.raises(ValueError, match=f"md5 mismatch, expected {ARCHIVE_MD5}, actual {md5}"):
        load_dataset("cifar10", data_dir=path)


def test_malformed_md5_option_is_rejected(archive):
    with pytest.raises(ValueError, match="an md5 is 32 hexadecimal digits, got 'abc'"):
        load_cifar10(archive[0], md5="abc")


def test_missing_member_is_named(tmp_path, records):
    members = {name: py2_pickle(r) for name, r in records.items() if name != "test_batch"}
    path = tmp_path / "cifar-10-python.tar.gz"
    md5 = write_archive(path, members)
    with pytest.raises(ValueError, match=r"missing member\(s\) cifar-10-batches-py/test_batch"):
        load_cifar10(path, md5=md5)


def test_truncated_archive_is_reported(tmp_path, archive):
    path, _ = archive
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cut.tar.gz: not a readable .tar.gz"):
        load_cifar10(cut, md5=hashlib.md5(cut.read_bytes()).hexdigest())


@pytest.mark.parametrize(
    "change, message",
    [
        ({b"data": np.zeros((PER_BATCH, 3071), np.uint8)}, r"uint8 array \(N, 3072\), got uint8 \(4, 3071\)"),
        ({b"labels": [0, 1, 2]}, "4 images but 3 labels"),
        ({b"labels": [0, 1, 2, 10]}, r"labels must lie in \[0, 10\), found \[0, 10\]"),
    ],
    ids=["width", "count", "range"],
)
def test_malformed_batch_is_reported(tmp_path, records, change, message):
    records["data_batch_3"] = {**records["data_batch_3"], **change}
    path = tmp_path / "cifar-10-python.tar.gz"
    md5 = write_archive(path, {name: py2_pickle(r) for name, r in records.items()})
    with pytest.raises(ValueError, match=message):
        load_cifar10(path, md5=md5)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_pickle_cannot_execute_code(tmp_path, records):
    marker = tmp_path / "pwned"
    evil = pickle.dumps({b"data": _Exploit(marker), b"labels": []}, protocol=3)
    with pytest.raises(ValueError, match=r"refusing to load global (posix|nt|os)\.mkdir"):
        restricted_loads(evil, source="evil")
    members = {name: py2_pickle(r) for name, r in records.items()}
    members["data_batch_2"] = evil
    path = tmp_path / "cifar-10-python.tar.gz"
    md5 = write_archive(path, members)
    with pytest.raises(ValueError, match="data_batch_2: not a readable CIFAR pickle"):
        load_cifar10(path, md5=md5)
    assert not marker.exists()
    pickle.loads(evil)  # the same bytes under plain pickle do run code: the refusal above is not vacuous
    assert marker.is_dir()


def test_location_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("CIFAR10_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match=r"pass data_dir / --data-dir \(or set \$CIFAR10_DIR\)"):
        load_dataset("cifar10")
    with pytest.raises(FileNotFoundError, match=re.escape(f"CIFAR-10 not found at {tmp_path}: expected the file")):
        load_dataset("cifar10", data_dir=tmp_path)

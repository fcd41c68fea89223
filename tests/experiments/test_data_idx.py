"""The IDX parser and the Fashion-MNIST loader: files written here byte by byte, and the real files.

The IDX bytes are produced by ``idx_bytes`` below, written from the format's definition (big-endian
header, type codes 0x08-0x0E), not by the code under test.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.data.fashion_mnist import FILES, SYSTEM_DIR, find_fashion_mnist, load_fashion_mnist
from affdiv.experiments.data.idx import parse_idx, read_idx

# The format's type codes (http://yann.lecun.com/exdb/mnist/), as big-endian numpy dtypes.
SPEC_CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def idx_bytes(array: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=SPEC_CODES[code]).tobytes()


@st.composite
def idx_arrays(draw):
    code = draw(st.sampled_from(sorted(SPEC_CODES)))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple))
    dtype = np.dtype(SPEC_CODES[code]).newbyteorder("=")
    elements = st.floats(-1e6, 1e6, width=dtype.itemsize * 8) if dtype.kind == "f" else None
    return code, draw(arrays(dtype, shape, elements=elements))


@given(idx_arrays())
def test_parse_round_trip_over_dtypes_and_shapes(case):
    code, array = case
    parsed = parse_idx(idx_bytes(array, code))
    assert parsed.shape == array.shape
    assert parsed.dtype == array.dtype and parsed.dtype.isnative
    np.testing.assert_array_equal(parsed, array)  # exact: bytes are reinterpreted, never converted


def test_parse_known_bytes():
    # uint8 2x3 matrix 0..5 and int16 vector [258, -2], written out by hand.
    u8 = b"\x00\x00\x08\x02" + b"\x00\x00\x00\x02\x00\x00\x00\x03" + bytes(range(6))
    np.testing.assert_array_equal(parse_idx(u8), [[0, 1, 2], [3, 4, 5]])
    i16 = b"\x00\x00\x0b\x01" + b"\x00\x00\x00\x02" + b"\x01\x02\xff\xfe"
    assert parse_idx(i16).tolist() == [258, -2]
    f32 = b"\x00\x00\x0d\x01" + b"\x00\x00\x00\x01" + b"\x3f\xc0\x00\x00"
    assert parse_idx(f32).tolist() == [1.5]


@pytest.mark.parametrize("compress", [False, True])
def test_read_file_raw_and_gzip(tmp_path, compress):
    array = np.arange(24, dtype=np.int32).reshape(2, 3, 4) - 7
    data = idx_bytes(array, 0x0C)
    path = tmp_path / "x.idx"
    path.write_bytes(gzip.compress(data) if compress else data)
    np.testing.assert_array_equal(read_idx(path), array)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x00\x00\x08", "needs 4 bytes, file has 3"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x00", "must start with bytes 0x00 0x00, got 0x01 0x00"),
        (b"\x00\x00\x0a\x01\x00\x00\x00\x00", "unknown IDX type code 0x0A"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x01", "2 dimensions needs 12 bytes, file has 8"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02", r"shape \(3,\) of uint8 needs 3 bytes .* has 2"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", r"shape \(1,\) of uint8 needs 1 bytes .* has 2"),
        (b"\x00\x00\x0c\x01\x00\x00\x00\x01\x00\x00\x01", r"needs 4 bytes .* has 3"),
    ],
    ids=["short", "magic", "code", "header", "truncated", "trailing", "itemsize"],
)
def test_malformed_idx_raises_naming_expected_and_actual(data, message):
    with pytest.raises(ValueError, match=message):
        parse_idx(data, source="bad.idx")


def test_corrupt_gzip_raises(tmp_path):
    path = tmp_path / "bad.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.zeros(100, np.uint8), 0x08))[:30])
    with pytest.raises(ValueError, match="bad.gz: corrupt gzip stream"):
        read_idx(path)


# ----------------------------------------------------------------------------- Fashion-MNIST files


def write_fashion(directory: Path, n_train: int = 12, n_test: int = 5, *, image_shape=(28, 28), top_label=9):
    """A tiny Fashion-MNIST in the real layout; training files gzipped, test files raw (both accepted)."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for part, n, compress in (("train", n_train, True), ("test", n_test, False)):
        images = rng.integers(0, 256, size=(n, *image_shape), dtype=np.uint8)
        labels = (np.arange(n) % (top_label + 1)).astype(np.uint8)
        for key, array in ((f"{part}_images", images), (f"{part}_labels", labels)):
            data = idx_bytes(array, 0x08)
            name = FILES[key] + (".gz" if compress else "")
            (directory / name).write_bytes(gzip.compress(data) if compress else data)
            arrays[key] = array
    return arrays


def test_fashion_loader_on_tiny_files(tmp_path):
    arrays = write_fashion(tmp_path)
    raw = load_fashion_mnist(tmp_path)
    np.testing.assert_array_equal(raw.x_pool[:, 0], arrays["train_images"])
    np.testing.assert_array_equal(raw.y_pool, arrays["train_labels"])
    np.testing.assert_array_equal(raw.x_test[:, 0], arrays["test_images"])
    np.testing.assert_array_equal(raw.y_test, arrays["test_labels"])
    data = load_dataset("fashion-mnist", data_dir=tmp_path, val_fraction=0.25)
    assert (len(data.train), len(data.val), len(data.test)) == (9, 3, 5)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10


def test_fashion_found_in_subfolder_and_through_environment(tmp_path, monkeypatch):
    write_fashion(tmp_path / "fashion-mnist")
    assert find_fashion_mnist(tmp_path)["train_images"].parent == tmp_path / "fashion-mnist"
    monkeypatch.setenv("FASHION_MNIST_DIR", str(tmp_path))
    assert load_fashion_mnist().y_pool.shape == (12,)


def test_missing_fashion_files_name_directory_and_files(tmp_path):
    write_fashion(tmp_path)
    (tmp_path / (FILES["test_labels"])).unlink()
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("fashion-mnist", data_dir=tmp_path)
    assert str(tmp_path) in str(error.value)
    assert all(f"{stem}[.gz]" in str(error.value) for stem in FILES.values())


def test_fashion_with_wrong_image_shape_or_labels_raises(tmp_path):
    write_fashion(tmp_path / "shape", image_shape=(27, 28))
    with pytest.raises(ValueError, match=r"expected uint8 images of shape \(N, 28, 28\), got uint8 \(12, 27, 28\)"):
        load_fashion_mnist(tmp_path / "shape")
    write_fashion(tmp_path / "labels", top_label=10)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\), found \[0, 10\]"):
        load_fashion_mnist(tmp_path / "labels")


# ----------------------------------------------------------------------------- the real files

REAL_FILES = [SYSTEM_DIR / f"{stem}.gz" for stem in FILES.values()]
needs_real_fashion = pytest.mark.skipif(
    not all(p.is_file() for p in REAL_FILES),
    reason=f"real Fashion-MNIST absent from {SYSTEM_DIR} (apt-get install dataset-fashion-mnist);"
    " the tiny-file loader tests above still ran",
)


@needs_real_fashion
def test_real_fashion_mnist():
    raw = load_fashion_mnist(SYSTEM_DIR)
    assert raw.x_pool.shape == (60000, 1, 28, 28) and raw.x_test.shape == (10000, 1, 28, 28)
    # Published property of the dataset: 6000 training and 1000 test images per class.
    assert np.bincount(raw.y_pool).tolist() == [6000] * 10
    assert np.bincount(raw.y_test).tolist() == [1000] * 10
    # Against the bytes read directly: labels start at offset 8, images at offset 16.
    labels = gzip.decompress((SYSTEM_DIR / "train-labels-idx1-ubyte.gz").read_bytes())
    images = gzip.decompress((SYSTEM_DIR / "train-images-idx3-ubyte.gz").read_bytes())
    assert raw.y_pool[:100].tolist() == list(labels[8:108])
    assert raw.x_pool[1].tobytes() == images[16 + 784 : 16 + 2 * 784]

    data = load_dataset("fashion-mnist", seed=3)
    assert (len(data.train), len(data.val), len(data.test)) == (54000, 6000, 10000)
    assert np.bincount(data.val.y.numpy()).tolist() == [600] * 10  # stratified: exact shares here
    x = data.train.x.double()
    # One channel: mean 0 and std 1 over the training split; float32 storage bounds the error at ~1e-6.
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std(correction=0)) - 1) < 1e-5

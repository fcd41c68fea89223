"""The IDX file format (LeCun's MNIST container, also used by Fashion-MNIST), gzip or raw.

Layout, all big-endian:

    bytes 0-1   0x00 0x00
    byte  2     element type code (see ``IDX_DTYPES``)
    byte  3     number of dimensions n
    4n bytes    the dimensions, one unsigned 32-bit integer each
    the rest    prod(dims) elements in row-major (C) order
"""

from __future__ import annotations

import gzip
import zlib
from math import prod
from pathlib import Path

import numpy as np

#: type code -> big-endian numpy dtype, as in the format's definition.
IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"


def parse_idx(data: bytes | bytearray | memoryview, *, source: str = "<bytes>") -> np.ndarray:
    """The array stored in the IDX bytes ``data``, in native byte order (a read-only view for bytes).

    Raises ``ValueError`` naming ``source``, the expected and the actual value for a malformed
    header, an unknown type code, or a payload whose length is not prod(dims) * itemsize.
    """
    buffer = memoryview(data).cast("B")
    if len(buffer) < 4:
        raise ValueError(f"{source}: IDX header needs 4 bytes, file has {len(buffer)}")
    zero0, zero1, code, ndim = buffer[:4]
    if (zero0, zero1) != (0, 0):
        raise ValueError(
            f"{source}: IDX magic must start with bytes 0x00 0x00, got 0x{zero0:02x} 0x{zero1:02x}"
            " (not an IDX file, or a compressed file that is not gzip)"
        )
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X} ({d.name})" for c, d in IDX_DTYPES.items())
        raise ValueError(f"{source}: unknown IDX type code 0x{code:02X}; expected one of {known}")
    header = 4 + 4 * ndim
    if len(buffer) < header:
        raise ValueError(
            f"{source}: IDX header with {ndim} dimensions needs {header} bytes, file has {len(buffer)}"
        )
    shape = tuple(int(d) for d in np.frombuffer(buffer, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[code]
    expected = prod(shape) * dtype.itemsize
    actual = len(buffer) - header
    if actual != expected:
        raise ValueError(
            f"{source}: IDX payload for shape {shape} of {dtype.name} needs {expected} bytes"
            f" after the {header}-byte header, file has {actual}"
        )
    array = np.frombuffer(buffer, dtype=dtype, count=prod(shape), offset=header).reshape(shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def read_idx(path: str | Path) -> np.ndarray:
    """The array in the IDX file at ``path``; gzip-compressed files are recognised by their magic."""
    path = Path(path)
    data = path.read_bytes()
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise ValueError(f"{path}: corrupt gzip stream ({error})") from error
    return parse_idx(data, source=str(path))

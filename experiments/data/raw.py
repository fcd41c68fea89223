"""The arrays a data source hands over before splitting and standardisation, checked once for all sources."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RawData:
    """A source's samples: a training pool (validation is carved from it) and, where the source
    defines one, its official test set (``x_test is None``: the test set is carved from the pool too).

    ``x_*`` have shape (N, *input_shape) and a real or unsigned dtype; ``y_*`` are integer class
    labels in [0, len(class_names)).
    """

    source: str
    x_pool: np.ndarray
    y_pool: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    class_names: tuple[str, ...]

    def __post_init__(self) -> None:
        if (self.x_test is None) != (self.y_test is None):
            raise ValueError(f"{self.source}: test inputs and test labels must be given together")
        self._check("pool", self.x_pool, self.y_pool)
        if self.x_test is not None:
            self._check("test", self.x_test, self.y_test)
            if self.x_test.shape[1:] != self.x_pool.shape[1:]:
                raise ValueError(
                    f"{self.source}: test inputs have sample shape {self.x_test.shape[1:]},"
                    f" the training pool {self.x_pool.shape[1:]}"
                )

    def _check(self, part: str, x: np.ndarray, y: np.ndarray) -> None:
        where = f"{self.source} ({part})"
        if x.ndim < 2 or x.dtype.kind not in "uif":
            raise ValueError(f"{where}: inputs must be a numeric array (N, *shape), got {x.dtype} {x.shape}")
        if y.ndim != 1 or y.dtype.kind not in "ui":
            raise ValueError(f"{where}: labels must be a 1-D integer array, got {y.dtype} {y.shape}")
        if len(x) != len(y):
            raise ValueError(f"{where}: {len(x)} inputs but {len(y)} labels")
        if len(y) == 0:
            raise ValueError(f"{where}: no samples")
        low, high = int(y.min()), int(y.max())
        if low < 0 or high >= len(self.class_names):
            raise ValueError(
                f"{where}: labels must lie in [0, {len(self.class_names)}), found [{low}, {high}]"
            )
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            raise ValueError(f"{where}: inputs contain NaN or infinity")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_pool.shape[1:])

    def sha256(self) -> str:
        """SHA-256 of the arrays' dtypes, shapes and bytes: the data's identity, whatever file held it."""
        digest = hashlib.sha256()
        for array in (self.x_pool, self.y_pool, self.x_test, self.y_test):
            if array is None:
                digest.update(b"none;")
                continue
            array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))  # portable bytes
            digest.update(f"{array.dtype.str}{array.shape};".encode())
            digest.update(memoryview(array).cast("B"))
        return digest.hexdigest()

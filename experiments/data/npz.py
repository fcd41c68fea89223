"""A dataset of your own for ``affdiv probe --data PATH.npz``: four arrays, used as given.

The file (``numpy.savez``) holds ``x_train``, ``y_train``, ``x_test`` and ``y_test``:

* ``x_*``: real numbers, shape (N, *input_shape) with the same ``input_shape`` in both splits
  (features (N, d), images (N, C, H, W), tokens (N, T, d), ...); no standardisation is applied.
* ``y_*``: class labels, integers 0..C−1 of shape (N,) (``cross_entropy``, or ``mse`` against the
  one-hot label), or real targets of shape (N,) or (N, *target_shape) (``mse`` only).

Every check runs on load and fails with one line naming the key, the expected and the actual
value. The fingerprint is the SHA-256 of the file's bytes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

KEYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass(frozen=True)
class ArraySplit:
    """Inputs ``x`` (float32, (N, *input_shape)) and targets ``y`` (int64 labels or float32)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class ArrayDataset:
    """What ``affdiv probe`` reads of a dataset: ``name``, ``train``, ``test``, ``input_shape``,
    ``num_classes`` (the model's outputs: classes, or target values per sample) and ``fingerprint``."""

    name: str
    train: ArraySplit
    test: ArraySplit
    input_shape: tuple[int, ...]
    num_classes: int
    fingerprint: str
    labels: bool  # y holds class labels (integers), not real targets


def load_npz(path: str | Path) -> ArrayDataset:
    """Read and check ``path`` (see the module docstring); a ValueError names what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            found = sorted(archive.files)
            missing = [k for k in KEYS if k not in found]
            if missing:
                raise ValueError(f"--data {path}: needs arrays {', '.join(KEYS)}; missing {', '.join(missing)} "
                                 f"(found: {', '.join(found) or 'none'})")
            arrays = {k: archive[k] for k in KEYS}
    except (OSError, EOFError) as error:
        raise ValueError(f"--data {path}: not a readable .npz file ({error})") from None
    for key in ("x_train", "x_test"):
        a = arrays[key]
        if a.dtype.kind not in "fiub" or a.ndim < 2 or len(a) == 0:
            raise ValueError(f"--data {path}: {key} must be a non-empty real array of shape (N, *input_shape), "
                             f"got dtype {a.dtype} shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"--data {path}: {key} must be finite, got NaN or inf")
    if arrays["x_test"].shape[1:] != arrays["x_train"].shape[1:]:
        raise ValueError(f"--data {path}: x_test's sample shape must be x_train's {arrays['x_train'].shape[1:]}, "
                         f"got {arrays['x_test'].shape[1:]}")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim < 1 or len(y) != len(x):
            raise ValueError(f"--data {path}: y_{split} must have one entry per sample of x_{split} ({len(x)}), "
                             f"got shape {y.shape}")
    y_train, y_test = arrays["y_train"], arrays["y_test"]
    labels = y_train.dtype.kind in "iub" and y_test.dtype.kind in "iub"
    if labels:
        for key, y in (("y_train", y_train), ("y_test", y_test)):
            if y.ndim != 1 or (len(y) and y.min() < 0):
                raise ValueError(f"--data {path}: {key} as class labels must be integers >= 0 of shape (N,), "
                                 f"got shape {y.shape}, smallest {y.min()}")
        num_classes = int(max(y_train.max(), y_test.max())) + 1
    else:
        for key, y in (("y_train", y_train), ("y_test", y_test)):
            if y.dtype.kind != "f" or not np.isfinite(y).all():
                raise ValueError(f"--data {path}: {key} must be integer class labels or finite real targets, "
                                 f"got dtype {y.dtype}")
        if y_test.shape[1:] != y_train.shape[1:]:
            raise ValueError(f"--data {path}: y_test's target shape must be y_train's {y_train.shape[1:]}, "
                             f"got {y_test.shape[1:]}")
        num_classes = math.prod(y_train.shape[1:])

    def split(name: str) -> ArraySplit:
        y = arrays[f"y_{name}"]
        return ArraySplit(torch.from_numpy(np.ascontiguousarray(arrays[f"x_{name}"], dtype=np.float32)),
                          torch.from_numpy(y.astype(np.int64) if labels else y.astype(np.float32)))

    return ArrayDataset(
        name=path.name, train=split("train"), test=split("test"), input_shape=tuple(arrays["x_train"].shape[1:]),
        num_classes=num_classes, fingerprint=hashlib.sha256(path.read_bytes()).hexdigest(), labels=labels,
    )

"""A dataset of your own: an ``.npz`` file (``numpy.savez``) with ``x_train``, ``y_train``,
``x_test`` and ``y_test``:

* ``x_*``: real numbers, shape (N, *input_shape) with the same ``input_shape`` in both splits
  (features (N, d), images (N, C, H, W), tokens (N, T, d), ...);
* ``y_*``: class labels, integers 0..C−1 of shape (N,), or (``affdiv probe`` with ``mse`` only)
  real targets of shape (N,) or (N, *target_shape).

Two readers share the checks of :func:`read_arrays`, which run on load and fail with one line
naming the key, the expected and the actual value; the file is read without pickles:

* :func:`load_npz`, for ``affdiv probe --data PATH.npz``: the arrays used as given (no
  standardisation), fingerprinted by the SHA-256 of the file's bytes;
* :func:`raw_npz`, for the harness (``dataset = "npz"``, ``data_options = {path = ...}``): class
  labels only, handed to :func:`~affdiv.experiments.data.dataset.load_dataset` as
  :class:`~affdiv.experiments.data.raw.RawData` to be split and standardised like any dataset; a
  relative path is taken from ``data_dir`` when one is given, else from the working directory.
"""

from __future__ import annotations

import hashlib
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from affdiv.experiments.data.raw import RawData

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


def read_arrays(path: Path, where: str) -> tuple[dict[str, np.ndarray], bool, int]:
    """The four arrays of ``path``, checked (see the module docstring), whether ``y`` holds class
    labels, and the number of classes (of target values per sample for real targets). ``where``
    begins every error's line."""
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            found = sorted(archive.files)
            missing = [k for k in KEYS if k not in found]
            if missing:
                raise ValueError(f"{where}: needs arrays {', '.join(KEYS)}; missing {', '.join(missing)} "
                                 f"(found: {', '.join(found) or 'none'})")
            arrays = {k: archive[k] for k in KEYS}
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{where}: not a readable .npz file ({error})") from None
    except ValueError as error:
        if str(error).startswith(where):
            raise
        raise ValueError(f"{where}: an array holds Python objects, which are not read (no pickles); store plain "
                         "numeric arrays") from None
    for key in ("x_train", "x_test"):
        a = arrays[key]
        if a.dtype.kind not in "fiub" or a.ndim < 2 or len(a) == 0:
            raise ValueError(f"{where}: {key} must be a non-empty real array of shape (N, *input_shape), "
                             f"got dtype {a.dtype} shape {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"{where}: {key} must be finite, got NaN or inf")
    if arrays["x_test"].shape[1:] != arrays["x_train"].shape[1:]:
        raise ValueError(f"{where}: x_test's sample shape must be x_train's {arrays['x_train'].shape[1:]}, "
                         f"got {arrays['x_test'].shape[1:]}")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim < 1 or len(y) != len(x):
            raise ValueError(f"{where}: y_{split} must have one entry per sample of x_{split} ({len(x)}), "
                             f"got shape {y.shape}")
    y_train, y_test = arrays["y_train"], arrays["y_test"]
    labels = y_train.dtype.kind in "iub" and y_test.dtype.kind in "iub"
    if labels != (y_train.dtype.kind in "iub" or y_test.dtype.kind in "iub"):
        raise ValueError(f"{where}: y_train and y_test must both be integer class labels or both real targets, "
                         f"got dtypes {y_train.dtype} and {y_test.dtype}")
    if labels:
        for key, y in (("y_train", y_train), ("y_test", y_test)):
            if y.ndim != 1 or (len(y) and y.min() < 0):
                raise ValueError(f"{where}: {key} as class labels must be integers >= 0 of shape (N,), "
                                 f"got shape {y.shape}, smallest {y.min()}")
        num_classes = int(max(y_train.max(), y_test.max())) + 1
    else:
        for key, y in (("y_train", y_train), ("y_test", y_test)):
            if y.dtype.kind != "f" or not np.isfinite(y).all():
                raise ValueError(f"{where}: {key} must be integer class labels or finite real targets, "
                                 f"got dtype {y.dtype}")
        if y_test.shape[1:] != y_train.shape[1:]:
            raise ValueError(f"{where}: y_test's target shape must be y_train's {y_train.shape[1:]}, "
                             f"got {y_test.shape[1:]}")
        num_classes = math.prod(y_train.shape[1:])
    return arrays, labels, num_classes


def load_npz(path: str | Path) -> ArrayDataset:
    """``affdiv probe``'s dataset of ``path`` (see the module docstring)."""
    path = Path(path)
    arrays, labels, num_classes = read_arrays(path, f"data {path}")

    def split(name: str) -> ArraySplit:
        y = arrays[f"y_{name}"]
        return ArraySplit(torch.from_numpy(np.ascontiguousarray(arrays[f"x_{name}"], dtype=np.float32)),
                          torch.from_numpy(y.astype(np.int64) if labels else y.astype(np.float32)))

    return ArrayDataset(
        name=path.name, train=split("train"), test=split("test"), input_shape=tuple(arrays["x_train"].shape[1:]),
        num_classes=num_classes, fingerprint=hashlib.sha256(path.read_bytes()).hexdigest(), labels=labels,
    )


def raw_npz(path: str | Path | None, data_dir: str | Path | None = None) -> RawData:
    """The harness's dataset of ``path`` (relative: from ``data_dir`` if given), class labels only."""
    if not path:
        raise ValueError("npz: data_options needs path = the .npz file with x_train, y_train, x_test, y_test")
    file = Path(path)
    if not file.is_absolute() and data_dir is not None:
        file = Path(data_dir) / file
    arrays, labels, num_classes = read_arrays(file, f"npz {file}")
    if not labels:
        raise ValueError(f"npz {file}: the harness trains classifiers; y_train and y_test must be integer class "
                         f"labels, got dtypes {arrays['y_train'].dtype} and {arrays['y_test'].dtype}")
    return RawData(f"npz {file.name}", arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                   tuple(str(k) for k in range(num_classes)))

"""Datasets for the falsification harness: loaded, split, standardised and fingerprinted one way.

``load_dataset(name, seed=..., val_fraction=...)`` returns train/validation/test tensors:

* Split. A source gives a training pool and (except ``digits``) an official test set. ``digits``
  first carves its test set from all 1797 samples (``test_fraction``, default 0.2). The validation
  set is then carved from the pool: ``round(val_fraction * N_pool)`` samples, stratified by class
  (each class gives its proportional share, largest remainders rounding up), drawn with
  ``numpy.random.default_rng(seed)``. The same seed and fractions give the same split everywhere.
* Standardisation, with statistics from the training split only (zero-std guarded):
  ``"channel"`` (default): one mean and std per channel over samples and positions, (C, H, W)
  inputs; flat inputs count as one channel, so one scalar pair. This keeps the samples' shared
  component (a mean image; the synthetic task's shared direction), i.e. the off-diagonal Gram terms
  x_i . x_j the batch-size prediction is about. ``"feature"``: per input coordinate. ``"none"``.
* Fingerprint: SHA-256 over the raw arrays' bytes, the dataset name, the split/standardisation
  config and the split indices; two different splits never share one.

Datasets: ``digits`` (scikit-learn's 8x8 digits, offline), ``fashion-mnist`` (IDX files from Debian's
dataset-fashion-mnist or ``data_dir``), ``cifar10`` (the python-pickle tarball from ``data_dir``,
md5-checked), ``synthetic`` (teacher-student with tunable input correlation), ``npz`` (one's own
arrays, option ``path``: :mod:`~affdiv.experiments.data.npz`). Nothing is cached.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch

from affdiv.checks import check_fraction, check_int
from affdiv.experiments.data.cifar10 import load_cifar10
from affdiv.experiments.data.fashion_mnist import load_fashion_mnist
from affdiv.experiments.data.npz import raw_npz
from affdiv.experiments.data.raw import RawData
from affdiv.experiments.data.synthetic import DEFAULTS as SYNTHETIC_DEFAULTS
from affdiv.experiments.data.synthetic import make_teacher_student

DATASETS: tuple[str, ...] = ("digits", "fashion-mnist", "cifar10", "synthetic", "npz")
STANDARDIZE_MODES: tuple[str, ...] = ("channel", "feature", "none")
#: Options each dataset accepts besides ``standardize``, with their defaults.
DATASET_OPTIONS: dict[str, dict[str, Any]] = {
    "digits": {"test_fraction": 0.2},
    "fashion-mnist": {},
    "cifar10": {"md5": None, "member_md5": None},
    "synthetic": dict(SYNTHETIC_DEFAULTS),
    "npz": {"path": None},
}
#: Options that check or locate the data rather than define it: left out of the fingerprint (an
#: npz file's identity is its arrays' bytes, wherever it lies).
_VERIFICATION_OPTIONS = frozenset({"md5", "member_md5", "path"})
_FINGERPRINT_FORMAT = "affdiv.experiments.data/1"
_CHUNK_ELEMENTS = 1 << 21  # float64 working set of the variance pass: 16 MiB


@dataclass(frozen=True)
class Split:
    """Inputs ``x`` (float32, (N, *input_shape)) and class labels ``y`` (int64, (N,))."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if self.x.dtype != torch.float32 or self.y.dtype != torch.int64:
            raise ValueError(f"Split needs float32 x and int64 y, got {self.x.dtype} and {self.y.dtype}")
        if self.y.ndim != 1 or len(self.x) != len(self.y):
            shapes = f"{tuple(self.x.shape)} and {tuple(self.y.shape)}"
            raise ValueError(f"Split needs x (N, ...) and y (N,), got {shapes}")

    def __len__(self) -> int:
        return len(self.y)

    def flat(self) -> Split:
        return Split(self.x.reshape(len(self.x), -1), self.y)


@dataclass(frozen=True)
class Dataset:
    """A split, standardised dataset. ``config`` records how it was made (JSON-ready, for provenance)."""

    name: str
    train: Split
    val: Split
    test: Split
    num_classes: int
    input_shape: tuple[int, ...]
    fingerprint: str
    class_names: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)

    def flat(self) -> Dataset:
        """The same data with inputs flattened to (N, prod(input_shape)); same fingerprint (same numbers)."""
        return replace(
            self,
            train=self.train.flat(),
            val=self.val.flat(),
            test=self.test.flat(),
            input_shape=(prod(self.input_shape),),
        )


def stratified_split(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(kept, taken)``, each sorted, partitioning range(len(labels)).

    ``taken`` has round(fraction * N) elements; class k contributes floor or ceil of its quota
    n_k * len(taken) / N (largest fractional parts round up, ties to the lower class), its members
    chosen uniformly at random by ``rng``.
    """
    n = len(labels)
    n_taken = int(np.floor(fraction * n + 0.5))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    quota = counts * (n_taken / n)
    per_class = np.floor(quota).astype(np.int64)
    by_remainder = np.argsort(-(quota - per_class), kind="stable")
    per_class[by_remainder[: n_taken - per_class.sum()]] += 1
    taken = np.sort(
        np.concatenate(
            [rng.permutation(np.flatnonzero(inverse == k))[:count] for k, count in enumerate(per_class)]
        )
    )
    kept = np.setdiff1d(np.arange(n), taken, assume_unique=True)
    return kept, taken


def standardization_stats(x: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Float64 ``(mean, std)`` of training inputs ``x`` (N, *shape), broadcastable against ``x``.

    Two passes (mean, then mean squared deviation, chunked over samples) so the variance has no
    cancellation error. A std of 0, or below float32 resolution of its mean (the feature is constant
    once stored as float32), is replaced by 1 so that the feature maps to 0 rather than to inf/NaN.
    """
    if mode == "none":
        shape = (1,) * x.ndim
        return np.zeros(shape), np.ones(shape)
    if mode == "feature":
        axes: tuple[int, ...] = (0,)
    else:  # "channel": axis 1 of (N, C, ...) is the channel; flat (N, F) is one channel
        axes = (0, *range(2, x.ndim)) if x.ndim > 2 else (0, 1)
    count = prod(x.shape[a] for a in axes)
    mean = x.sum(axis=axes, dtype=np.float64, keepdims=True) / count
    squares = np.zeros_like(mean)
    rows = max(1, _CHUNK_ELEMENTS // max(1, prod(x.shape[1:])))
    for start in range(0, len(x), rows):
        deviation = x[start : start + rows] - mean
        squares += np.square(deviation).sum(axis=axes, keepdims=True)
    std = np.sqrt(squares / count)
    degenerate = std <= np.finfo(np.float32).eps * np.abs(mean)
    return mean, np.where(degenerate | (std == 0), 1.0, std)


def _standardized(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> torch.Tensor:
    out = x.astype(np.float32)  # a fresh array: normalised in place, no float64 copy of the data
    out -= mean.astype(np.float32)
    out /= std.astype(np.float32)
    return torch.from_numpy(out)


def _split_tensor(x: np.ndarray, y: np.ndarray, mean: np.ndarray, std: np.ndarray) -> Split:
    return Split(_standardized(x, mean, std), torch.from_numpy(y.astype(np.int64)))


def _fingerprint(name: str, raw_sha256: str, config: dict[str, Any], indices: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    header = {"format": _FINGERPRINT_FORMAT, "dataset": name, "raw_sha256": raw_sha256, "config": config}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for part in ("train", "val", "test"):
        digest.update(f";{part}:".encode())
        digest.update(np.ascontiguousarray(indices[part], dtype="<i8").tobytes())
    return digest.hexdigest()


def _raw(name: str, data_dir: str | Path | None, seed: int, options: dict[str, Any]) -> RawData:
    if name == "digits":
        from sklearn.datasets import load_digits  # here, not at the top: importing sklearn takes ~1 s

        digits = load_digits()
        names = tuple(str(k) for k in range(10))
        return RawData("digits", digits.images[:, None], digits.target, None, None, names)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir)
    if name == "cifar10":
        return load_cifar10(data_dir, md5=options["md5"], member_md5=options["member_md5"])
    if name == "npz":
        return raw_npz(options["path"], data_dir)
    return make_teacher_student(seed, **{k: options[k] for k in SYNTHETIC_DEFAULTS})


def _checked_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of dataset ``name`` with their defaults filled in, each checked (ValueError
    naming the option and the valid choices)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    allowed = {"standardize": "channel", **DATASET_OPTIONS[name]}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        valid = ", ".join(sorted(allowed))
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; valid options: {valid}")
    options = {**allowed, **options}
    if options["standardize"] not in STANDARDIZE_MODES:
        raise ValueError(f"standardize must be one of {', '.join(STANDARDIZE_MODES)}, got {options['standardize']!r}")
    if name == "synthetic" and options["standardize"] == "feature" and options["correlation"] != 0:
        raise ValueError(
            "synthetic: standardize='feature' subtracts the shared direction that correlation controls;"
            " use standardize='channel' or 'none'"
        )
    if name == "digits":
        options["test_fraction"] = check_fraction("test_fraction", options["test_fraction"], allow_zero=False)
    return options


def load_dataset(
    name: str,
    *,
    data_dir: str | Path | None = None,
    seed: int = 0,
    val_fraction: float = 0.1,
    **options: Any,
) -> Dataset:
    """Load dataset ``name`` (one of ``DATASETS``), split by ``seed``, standardised on its training split:
    x ↦ (x − mean_train)/std_train, per channel by default.

    Args:
        name: ``"digits"``, ``"fashion-mnist"``, ``"cifar10"``, ``"synthetic"`` or ``"npz"``.
        data_dir: where ``fashion-mnist`` and ``cifar10`` are read from (default: each loader's
            search path), and a relative ``npz`` path; ignored by the others.
        seed: the split's seed (default 0); the same seed and fractions give the same split.
        val_fraction: share of the training pool that becomes the validation split (default 0.1;
            0 allowed: an empty one).
        **options: ``standardize`` (one of ``STANDARDIZE_MODES``, default ``"channel"``) and the
            dataset's own options in ``DATASET_OPTIONS``.

    Returns:
        A :class:`Dataset` with ``train``, ``val`` and ``test`` splits (float32 inputs, int64
        labels), ``num_classes`` and a ``fingerprint`` (SHA-256 of the raw data and the split).

    Shape:
        - ``split.x``: (N, *input_shape), e.g. (N, 1, 8, 8) for digits, (N, 1, 28, 28) for Fashion-MNIST.
        - ``split.y``: (N,).

    Bad input raises ``ValueError`` naming the valid choices.

    Example::

        >>> data = load_dataset("digits", seed=0)
        >>> data.num_classes, tuple(data.train.x.shape[1:])
        (10, (1, 8, 8))
    """
    options = _checked_options(name, options)
    check_int("seed", seed, minimum=0)
    val_fraction = check_fraction("val_fraction", val_fraction, allow_zero=True)

    raw = _raw(name, data_dir, int(seed), options)
    rng = np.random.default_rng(int(seed))
    if raw.x_test is None:
        pool, test = stratified_split(raw.y_pool, options["test_fraction"], rng)
        x_pool, y_pool = raw.x_pool[pool], raw.y_pool[pool]
        x_test, y_test = raw.x_pool[test], raw.y_pool[test]
    else:
        test = np.arange(len(raw.y_test))
        x_pool, y_pool, x_test, y_test = raw.x_pool, raw.y_pool, raw.x_test, raw.y_test
    train, val = stratified_split(y_pool, val_fraction, rng)
    if len(train) == 0:
        raise ValueError(f"{name}: val_fraction={val_fraction} leaves no training samples of {len(y_pool)}")

    mean, std = standardization_stats(x_pool[train], options["standardize"])
    definition = {  # JSON-ready: numpy scalars (e.g. from a grid) become Python numbers
        k: v.item() if isinstance(v, np.generic) else v for k, v in options.items() if k not in _VERIFICATION_OPTIONS
    }
    config = {"dataset": name, "seed": int(seed), "val_fraction": val_fraction, **definition}
    raw_sha256 = raw.sha256()
    fingerprint = _fingerprint(name, raw_sha256, config, {"train": train, "val": val, "test": test})
    sizes = {"train": len(train), "val": len(val), "test": len(y_test)}
    return Dataset(
        name=name,
        train=_split_tensor(x_pool[train], y_pool[train], mean, std),
        val=_split_tensor(x_pool[val], y_pool[val], mean, std),
        test=_split_tensor(x_test, y_test, mean, std),
        num_classes=len(raw.class_names),
        input_shape=raw.input_shape,
        fingerprint=fingerprint,
        class_names=raw.class_names,
        config={**config, "raw_sha256": raw_sha256, "sizes": sizes},
    )

"""Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) from its four IDX files, gzip or raw.

Looked for in ``data_dir`` (or its ``fashion-mnist/`` subfolder) when given, else in
``$FASHION_MNIST_DIR``, else where Debian's ``dataset-fashion-mnist`` package installs it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from affdiv.experiments.data.idx import read_idx
from affdiv.experiments.data.raw import RawData

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
ENV_VAR = "FASHION_MNIST_DIR"
FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CLASS_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
IMAGE_SHAPE = (28, 28)


def _file(directory: Path, stem: str) -> Path | None:
    """``directory/stem`` or ``directory/stem.gz``, whichever exists (raw first)."""
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def find_fashion_mnist(data_dir: str | Path | None = None) -> dict[str, Path]:
    """The four files' paths; ``FileNotFoundError`` naming every directory searched when absent."""
    root = Path(data_dir if data_dir is not None else os.environ.get(ENV_VAR) or SYSTEM_DIR)
    searched = (root, root / "fashion-mnist")
    for directory in searched:
        found = {key: _file(directory, stem) for key, stem in FILES.items()}
        if all(found.values()):
            return found
    expected = ", ".join(f"{stem}[.gz]" for stem in FILES.values())
    raise FileNotFoundError(
        f"Fashion-MNIST not found: searched {', '.join(map(str, searched))} for {expected}."
        f" Install Debian's dataset-fashion-mnist (files in {SYSTEM_DIR}),"
        f" or pass data_dir / --data-dir / ${ENV_VAR} pointing at a folder holding them."
    )


def _images_and_labels(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != IMAGE_SHAPE:
        raise ValueError(
            f"{images_path}: expected uint8 images of shape (N, {IMAGE_SHAPE[0]}, {IMAGE_SHAPE[1]}),"
            f" got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(f"{labels_path}: expected uint8 labels of shape (N,), got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels")
    return images[:, None], labels  # (N, 1, 28, 28): one channel


def load_fashion_mnist(data_dir: str | Path | None = None) -> RawData:
    """The 60k training pool and the 10k test set as uint8 images (N, 1, 28, 28) and uint8 labels."""
    paths = find_fashion_mnist(data_dir)
    x_pool, y_pool = _images_and_labels(paths["train_images"], paths["train_labels"])
    x_test, y_test = _images_and_labels(paths["test_images"], paths["test_labels"])
    return RawData("fashion-mnist", x_pool, y_pool, x_test, y_test, CLASS_NAMES)

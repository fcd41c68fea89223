"""A dataset of one's own: an ``.npz`` file with ``x_train``, ``y_train``, ``x_test``, ``y_test``.

The inputs are numeric arrays (N, *shape) with the same sample shape in both parts (images as
(N, C, H, W) for the CNN methods); the labels are integers 0..K-1, K = the number of classes
(the largest label in either part, plus one). The file is read without pickles
(``allow_pickle=False``). A relative path is taken from ``data_dir`` when one is given, else
from the working directory.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from affdiv.experiments.data.raw import RawData

KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_npz(path: str | Path | None, data_dir: str | Path | None = None) -> RawData:
    """The four arrays of ``path`` as :class:`RawData`; a one-line ValueError naming the file and
    what is wrong (missing file, not an npz, a missing or extra array, a pickled object array)."""
    if not path:
        raise ValueError("npz: data_options needs path = the .npz file with x_train, y_train, x_test, y_test")
    file = Path(path)
    if not file.is_absolute() and data_dir is not None:
        file = Path(data_dir) / file
    if not file.is_file():
        raise FileNotFoundError(f"npz: no such file {file}")
    try:
        with np.load(file, allow_pickle=False) as archive:
            names = set(archive.files)
            missing, extra = [k for k in KEYS if k not in names], sorted(names - set(KEYS))
            if missing or extra:
                raise ValueError(f"npz {file}: expected exactly the arrays {list(KEYS)}; missing {missing}, "
                                 f"extra {extra}")
            arrays = {k: archive[k] for k in KEYS}
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ValueError(f"npz {file}: not a readable .npz archive ({error})") from None
    except ValueError as error:
        if str(error).startswith("npz "):
            raise
        raise ValueError(f"npz {file}: an array holds Python objects, which are not read (allow_pickle is "
                         "off); store plain numeric arrays") from None
    labels = [arrays["y_train"], arrays["y_test"]]
    if not all(y.ndim == 1 and y.dtype.kind in "ui" and len(y) for y in labels):
        raise ValueError(f"npz {file}: y_train and y_test must be non-empty 1-D integer arrays, got "
                         f"{[(str(y.dtype), y.shape) for y in labels]}")
    classes = int(max(y.max() for y in labels)) + 1
    return RawData(f"npz {file.name}", arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                   tuple(str(k) for k in range(classes)))

"""A seeded teacher-student classification task whose inputs share a component of tunable weight.

Inputs, with c = ``correlation`` in [0, 1) and d = ``features``:

    x_i = sqrt(c) m + sqrt(1 - c) z_i,    z_i ~ N(0, I_d),

m a fixed random direction (per seed) with zero mean over its entries and ||m||^2 = d. Then
E[x_i . x_j] = c d for i != j and E||x_i||^2 = d: the off-diagonal Gram terms that the affine
divergence's corrections leave in place (G. Bird, arXiv 2512.22247; see the README) have cosine
about c. Because m has zero entry mean, standardising with one scalar mean and std
(``standardize="channel"``, the default) keeps this structure; per-feature standardisation would
subtract m and undo the knob.

Labels: argmax over classes of a random one-hidden-layer tanh teacher's logits, each class's logit
z-scored with its mean and std on an independent calibration sample, so that classes are about
equally frequent at every c. Teacher, calibration, training pool and test set use independent
streams spawned from ``seed``: changing ``n_train`` leaves the teacher and the test set unchanged.
"""

from __future__ import annotations

import numpy as np

from affdiv.checks import check_int
from affdiv.experiments.data.raw import RawData

DEFAULTS = {
    "n_train": 4096,
    "n_test": 1024,
    "features": 64,
    "classes": 10,
    "teacher_width": 32,
    "correlation": 0.0,
}
_CALIBRATION_SAMPLES = 8192


def make_teacher_student(
    seed: int,
    *,
    n_train: int,
    n_test: int,
    features: int,
    classes: int,
    teacher_width: int,
    correlation: float,
) -> RawData:
    """The task above: a float64 training pool (n_train, features) and test set (n_test, features)."""
    for name, value, least in (
        ("n_train", n_train, 1), ("n_test", n_test, 1), ("features", features, 2),
        ("classes", classes, 2), ("teacher_width", teacher_width, 1),
    ):  # fmt: skip
        check_int(f"synthetic: {name}", value, minimum=least)
    if isinstance(correlation, bool) or not isinstance(correlation, int | float) or not 0 <= correlation < 1:
        raise ValueError(f"synthetic: correlation must be a number in [0, 1), got {correlation!r}")

    teacher_rng, calibration_rng, train_rng, test_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    shared = teacher_rng.standard_normal(features)
    shared -= shared.mean()
    shared *= np.sqrt(features) / np.linalg.norm(shared)
    hidden_weight = teacher_rng.standard_normal((teacher_width, features)) / np.sqrt(features)
    output_weight = teacher_rng.standard_normal((classes, teacher_width)) / np.sqrt(teacher_width)

    def inputs(rng: np.random.Generator, n: int) -> np.ndarray:
        return np.sqrt(correlation) * shared + np.sqrt(1 - correlation) * rng.standard_normal((n, features))

    def logits(x: np.ndarray) -> np.ndarray:
        return np.tanh(x @ hidden_weight.T) @ output_weight.T

    calibration = logits(inputs(calibration_rng, _CALIBRATION_SAMPLES))
    center, scale = calibration.mean(axis=0), calibration.std(axis=0)

    def labels(x: np.ndarray) -> np.ndarray:
        return np.argmax((logits(x) - center) / scale, axis=1)

    x_pool, x_test = inputs(train_rng, n_train), inputs(test_rng, n_test)
    names = tuple(f"class {k}" for k in range(classes))
    return RawData("synthetic", x_pool, labels(x_pool), x_test, labels(x_test), names)

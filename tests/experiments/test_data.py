"""load_dataset: splits, standardisation, fingerprints, the digits and synthetic sources, bad input.

Expected values come from scikit-learn's digits read directly, from float64 statistics computed
here, or from the definitions in the docstrings; never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sklearn.datasets import load_digits

from affdiv.experiments.data.dataset import DATASETS, Dataset, Split, load_dataset, stratified_split

SMALL = {"n_train": 60, "n_test": 20, "features": 8, "classes": 3, "teacher_width": 4}


@given(
    labels=st.lists(st.integers(0, 4), min_size=1, max_size=120).map(np.array),
    fraction=st.floats(0, 1, exclude_max=True),
    seed=st.integers(0, 2**32 - 1),
)
def test_stratified_split_partitions_with_class_shares(labels, fraction, seed):
    kept, taken = stratified_split(labels, fraction, np.random.default_rng(seed))
    n = len(labels)
    assert np.array_equal(np.sort(np.concatenate([kept, taken])), np.arange(n))  # a partition
    assert np.all(np.diff(kept) > 0) and np.all(np.diff(taken) > 0)  # sorted, no repeats
    assert len(taken) == int(np.floor(fraction * n + 0.5))
    for k in np.unique(labels):
        quota = np.sum(labels == k) * len(taken) / n
        assert abs(np.sum(labels[taken] == k) - quota) < 1  # floor or ceil of its share
    again = stratified_split(labels, fraction, np.random.default_rng(seed))
    assert np.array_equal(again[1], taken)  # deterministic in the seed


def test_digits_splits_partition_the_dataset():
    digits = load_digits()
    data = load_dataset("digits", seed=5, standardize="none")
    n_test = round(0.2 * 1797)
    assert (len(data.train), len(data.val), len(data.test)) == (1797 - n_test - 144, 144, n_test)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    # The three splits together are exactly the 1797 digits, each once (as a multiset of rows).
    rows = torch.cat([s.x.reshape(len(s), -1) for s in (data.train, data.val, data.test)]).double().numpy()
    labels = torch.cat([data.train.y, data.val.y, data.test.y]).numpy()
    ours = np.column_stack([rows, labels])
    theirs = np.column_stack([digits.data, digits.target])
    assert np.array_equal(ours[np.lexsort(ours.T)], theirs[np.lexsort(theirs.T)])


def test_same_config_same_data_and_fingerprint():
    a, b = load_dataset("digits", seed=3), load_dataset("digits", seed=3)
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 64
    for part in ("train", "val", "test"):
        assert torch.equal(getattr(a, part).x, getattr(b, part).x)
        assert torch.equal(getattr(a, part).y, getattr(b, part).y)


@given(
    first=st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.1, 0.25]), st.sampled_from(["channel", "none"])),
    second=st.tuples(st.integers(0, 3), st.sampled_from([0.0, 0.1, 0.25]), st.sampled_from(["channel", "none"])),
)
def test_fingerprints_differ_exactly_when_configs_differ(first, second):
    def fingerprint(config):
        seed, val_fraction, standardize = config
        data = load_dataset("synthetic", seed=seed, val_fraction=val_fraction, standardize=standardize, **SMALL)
        return data.fingerprint

    assert (fingerprint(first) == fingerprint(second)) == (first == second)


def test_different_splits_of_the_same_data_have_different_fingerprints():
    fingerprints = {load_dataset("digits", seed=s).fingerprint for s in range(3)}
    fingerprints |= {load_dataset("digits", val_fraction=f).fingerprint for f in (0.05, 0.2)}
    fingerprints.add(load_dataset("digits", test_fraction=0.3).fingerprint)
    assert len(fingerprints) == 6


def test_channel_standardisation_uses_training_statistics_only():
    raw = load_dataset("digits", seed=1, standardize="none")
    std = load_dataset("digits", seed=1)
    train = raw.train.x.double()
    mean, scale = train.mean(), train.std(correction=0)
    # float32 storage of values |x| <= ~3: absolute rounding error <= 3 * 2**-24 per operation; 1e-5 bounds a few.
    for part in ("train", "val", "test"):
        expected = (getattr(raw, part).x.double() - mean) / scale
        torch.testing.assert_close(getattr(std, part).x.double(), expected, rtol=0, atol=1e-5)
    assert abs(float(std.train.x.double().mean())) < 1e-6
    assert abs(float(std.train.x.double().std(correction=0)) - 1) < 1e-5
    assert abs(float(std.test.x.double().mean())) > 1e-4  # the test split was not standardised on itself


def test_feature_standardisation_guards_constant_pixels():
    raw = load_dataset("digits", standardize="none").flat()
    data = load_dataset("digits", standardize="feature").flat()
    constant = raw.train.x.double().std(dim=0) == 0
    assert constant.any()  # digits have always-blank border pixels: the guard is exercised
    assert torch.isfinite(data.train.x).all() and torch.isfinite(data.test.x).all()
    assert torch.all(data.train.x[:, constant] == 0)
    x = data.train.x.double()[:, ~constant]
    ones = torch.ones(x.shape[1], dtype=torch.float64)
    torch.testing.assert_close(x.mean(dim=0), 0 * ones, rtol=0, atol=1e-5)  # float32 rounding, as above
    torch.testing.assert_close(x.std(dim=0, correction=0), ones, rtol=0, atol=1e-5)


def test_flat_is_a_view_of_the_same_numbers():
    data = load_dataset("digits")
    flat = data.flat()
    assert flat.input_shape == (64,) and flat.train.x.shape == (len(data.train), 64)
    assert flat.fingerprint == data.fingerprint
    assert torch.equal(flat.test.x, data.test.x.reshape(len(data.test), 64))
    assert flat.train.x.data_ptr() == data.train.x.data_ptr()  # no copy


def test_synthetic_off_diagonal_cosine_grows_with_correlation():
    cosines = []
    for correlation in (0.0, 0.3, 0.6, 0.9):
        x = load_dataset("synthetic", correlation=correlation, n_train=800, features=64).train.x.double()
        unit = x / x.norm(dim=1, keepdim=True)
        gram = unit @ unit.T
        n = len(x)
        cosines.append(float((gram.sum() - gram.diagonal().sum()) / (n * (n - 1))))
        # E[x_i . x_j] = c d and E||x||^2 = d: the mean cosine is c up to the O(1/d) Jensen bias of
        # 1/||x|| and O(1/n) sampling terms, well inside 0.03 at d = 64, n = 720.
        assert abs(cosines[-1] - correlation) < 0.03
    assert all(a < b for a, b in zip(cosines, cosines[1:]))


def test_synthetic_task_is_seeded_and_balanced():
    a = load_dataset("synthetic", seed=2, correlation=0.8)
    assert torch.equal(a.test.x, load_dataset("synthetic", seed=2, correlation=0.8).test.x)
    assert not torch.equal(a.test.x, load_dataset("synthetic", seed=3, correlation=0.8).test.x)
    more = load_dataset("synthetic", seed=2, correlation=0.8, n_train=8192)
    assert torch.equal(more.test.y, a.test.y)  # the teacher and test inputs do not depend on n_train
    shares = torch.bincount(a.train.y, minlength=10).double() / len(a.train)
    assert a.num_classes == 10 and a.input_shape == (64,)
    assert shares.min() > 0.04 and shares.max() < 0.2  # calibrated teacher: no class vanishes or dominates


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: load_dataset("mnist"), "unknown dataset 'mnist'; expected one of " + ", ".join(DATASETS)),
        (lambda: load_dataset("digits", width=3), "unknown option.* width; valid options: standardize, test_fraction"),
        (lambda: load_dataset("digits", standardize="z"), "standardize must be one of channel, feature, none, got 'z'"),
        (lambda: load_dataset("digits", seed=-1), "seed must be an integer >= 0, got -1"),
        (lambda: load_dataset("digits", seed=1.5), "seed must be an integer >= 0, got 1.5"),
        (lambda: load_dataset("digits", val_fraction=1.0), r"val_fraction must be a number in \[0, 1\), got 1.0"),
        (lambda: load_dataset("digits", test_fraction=0), r"test_fraction must be a number in \(0, 1\), got 0"),
        (lambda: load_dataset("synthetic", correlation=1.0), r"correlation must be a number in \[0, 1\), got 1.0"),
        (lambda: load_dataset("synthetic", n_train=0), "n_train must be an integer >= 1, got 0"),
        (lambda: load_dataset("synthetic", correlation=0.5, standardize="feature"), "subtracts the shared direction"),
        (lambda: load_dataset("synthetic", n_train=2, val_fraction=0.9), "leaves no training samples of 2"),
    ],
    ids=["name", "option", "standardize", "seed", "seed-float", "val", "test", "corr", "n", "feature", "empty"],
)
def test_bad_input_names_expected_and_actual(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_split_checks_dtypes_and_lengths():
    with pytest.raises(ValueError, match="float32 x and int64 y, got torch.float64"):
        Split(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x \(N, ...\) and y \(N,\), got \(2, 3\) and \(3,\)"):
        Split(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64))
    assert isinstance(load_dataset("synthetic", **SMALL), Dataset)

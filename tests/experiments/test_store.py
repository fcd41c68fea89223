"""The results store: stable config hashes, one row per finished run, never overwritten."""

import csv
import hashlib
import json
import math
import sqlite3

import pytest
from hypothesis import given
from hypothesis import strategies as st

from affdiv.experiments.runs.config import canonical_json, config_hash
from affdiv.experiments.runs.store import ResultStore, is_sqlite


def test_config_hash_is_sha256_of_the_canonical_json():
    # The canonical form is written out by hand: sorted keys, no spaces, ASCII escapes.
    config = {"seed": 3, "method": "l2", "lr_grid": [0.1, 0.01], "name": "é"}
    text = '{"lr_grid":[0.1,0.01],"method":"l2","name":"\\u00e9","seed":3}'
    assert canonical_json(config) == text
    assert config_hash(config) == hashlib.sha256(text.encode()).hexdigest()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=6), st.randoms())
def test_config_hash_ignores_key_order_and_sees_every_value(config, random):
    items = list(config.items())
    random.shuffle(items)
    assert config_hash(dict(items)) == config_hash(config)
    key = items[0][0]
    assert config_hash({**config, key: [config[key]]}) != config_hash(config)


def test_non_finite_numbers_have_no_canonical_form():
    with pytest.raises(ValueError):
        config_hash({"lr": math.nan})


def _put(store, seed, accuracy, **extra):
    config = {"method": "affine", "batch_size": 32, "seed": seed, "lr_rule": "sqrt", **extra}
    curves = [{"epoch": 1, "train_loss": 2.0, "val_metric": 0.5},
              {"epoch": 2, "train_loss": math.inf, "val_metric": 0.6}]
    key = store.put(config, metrics={"test_accuracy": accuracy, "test_loss": math.nan},
                    curves=curves, seconds=1.5, data_fingerprint="abc")
    return config, key


def test_rows_on_disk(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        config, key = _put(store, seed=0, accuracy=0.75)
    assert is_sqlite(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    rows = db.execute("SELECT config_hash, config, metrics, curves, seconds, data_fingerprint FROM runs").fetchall()
    assert len(rows) == 1
    got_key, got_config, metrics, curves, seconds, fingerprint = rows[0]
    assert got_key == key == hashlib.sha256(canonical_json(config).encode()).hexdigest()
    assert json.loads(got_config) == config
    assert json.loads(metrics) == {"test_accuracy": 0.75, "test_loss": None}  # NaN -> null
    assert json.loads(curves)[1] == {"epoch": 2, "train_loss": None, "val_metric": 0.6}
    assert (seconds, fingerprint) == (1.5, "abc")


def test_a_finished_run_is_never_overwritten(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        _, key = _put(store, seed=0, accuracy=0.75)
        _, again = _put(store, seed=0, accuracy=0.10)
        assert again == key and store.finished() == {key}
        assert [r["metric"] for r in store.records()] == [0.75]


def test_records_curves_and_csv_are_sorted_and_complete(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        for seed, accuracy in [(2, 0.3), (0, 0.1), (1, 0.2)]:
            _put(store, seed=seed, accuracy=accuracy, width=8)
        records = store.records()
        assert [(r["seed"], r["metric"], r["test_accuracy"]) for r in records] == [
            (0, 0.1, 0.1), (1, 0.2, 0.2), (2, 0.3, 0.3)
        ]
        assert all(r["data_fingerprint"] == "abc" and len(r["config_hash"]) == 64 for r in records)
        curves = store.curves()
        assert [(c["seed"], c["epoch"]) for c in curves] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
        assert store.seconds() == 4.5
        with pytest.raises(KeyError, match="metric 'val_accuracy' not in run"):
            store.records(metric="val_accuracy")
        path = store.export_csv(tmp_path / "r.csv")
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["method", "batch_size", "seed", "metric", "config_hash", "data_fingerprint",
                             "lr_rule", "test_accuracy", "test_loss", "width"]
    assert [(row["seed"], row["metric"], row["width"], row["test_loss"]) for row in rows] == [
        ("0", "0.1", "8", ""), ("1", "0.2", "8", ""), ("2", "0.3", "8", "")
    ]


def test_records_restricted_to_given_hashes(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        _, first = _put(store, seed=0, accuracy=0.5)
        _put(store, seed=1, accuracy=0.6)
        assert [r["seed"] for r in store.records([first])] == [0]


def test_is_sqlite_on_a_csv(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("method,batch_size,seed,metric\n")
    assert not is_sqlite(path)

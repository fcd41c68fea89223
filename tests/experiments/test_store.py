"""The results store: stable config hashes, one row per finished run, never overwritten."""

import csv
import hashlib
import json
import math
import sqlite3

import pytest
from hypothesis import given
from hypothesis import strategies as st

from affdiv.experiments.records import is_sqlite
from affdiv.experiments.runs.config import canonical_json, config_hash
from affdiv.experiments.runs.store import GENERATED_FROM_SEED, ResultStore, StoredRun, raw_key


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
    key = store.put(config, StoredRun(metrics={"test_accuracy": accuracy, "test_loss": math.nan}, curves=curves,
                                      seconds=1.5, data_fingerprint="abc"))
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
        with pytest.raises(ValueError, match="metric 'val_accuracy' not in run"):
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


# ------------------------------------------------------------------ identity, read-only, integrity
from affdiv.experiments.runs.store import APPLICATION_ID, data_key, identify  # noqa: E402

LEGACY_SCHEMA = """CREATE TABLE runs (
    config_hash      TEXT PRIMARY KEY,
    config           TEXT NOT NULL,
    metrics          TEXT NOT NULL,
    curves           TEXT NOT NULL,
    seconds          REAL NOT NULL,
    data_fingerprint TEXT NOT NULL,
    finished_utc     TEXT NOT NULL
)"""


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _legacy_store(path, n=3):
    """A store as affdiv 0.1 wrote it: the runs table, rollback journal, no application_id."""
    db = sqlite3.connect(path)
    db.execute(LEGACY_SCHEMA)
    for seed in range(n):
        config = {"method": "l2", "batch_size": 32, "seed": seed, "dataset": "digits"}
        db.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (config_hash(config), canonical_json(config), canonical_json({"test_accuracy": 0.5 + seed / 10}),
                    "[]", 1.0, "fp", "2025-01-01T00:00:00+00:00"))
    db.commit()
    db.close()
    return path


def test_a_new_store_is_marked_with_the_application_id(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        _put(store, seed=0, accuracy=0.5)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA application_id").fetchone() == (APPLICATION_ID,) == (0x41464456,)
    db.close()
    assert path.read_bytes()[68:72] == b"AFDV"  # the header field file(1) reads
    assert identify(path) == "affdiv"


def test_read_only_store_reads_without_changing_a_byte_or_adding_files(tmp_path, unwritable):
    folder = tmp_path / "store"
    folder.mkdir()
    path = folder / "r.sqlite"
    with ResultStore(path) as store:
        for seed in range(3):
            _put(store, seed=seed, accuracy=0.5 + seed / 10)
        expected = store.records()
    before = _sha256(path)
    unwritable(path)
    unwritable(folder)
    with ResultStore(path, read_only=True) as store:
        assert store.records() == expected and store.finished() == {r["config_hash"] for r in expected}
        with pytest.raises(PermissionError, match="opened read-only"):
            _put(store, seed=9, accuracy=0.1)
    assert _sha256(path) == before and sorted(p.name for p in folder.iterdir()) == ["r.sqlite"]


def test_read_only_store_sees_runs_still_in_the_write_ahead_log(tmp_path):
    # A writer that is still open (or was killed) keeps recent commits in r.sqlite-wal.
    path = tmp_path / "r.sqlite"
    writer = ResultStore(path)
    writer._db.execute("PRAGMA wal_autocheckpoint=0")
    _put(writer, seed=0, accuracy=0.5)
    _put(writer, seed=1, accuracy=0.6)
    try:
        with ResultStore(path, read_only=True) as reader:
            assert [r["metric"] for r in reader.records()] == [0.5, 0.6]
    finally:
        writer.close()


def test_legacy_store_is_read_untouched_and_marked_by_a_writer(tmp_path):
    path = _legacy_store(tmp_path / "old.sqlite")
    before = _sha256(path)
    assert identify(path) == "legacy"
    with ResultStore(path, read_only=True) as store:
        assert [r["metric"] for r in store.records()] == [0.5, 0.6, 0.7]
    assert _sha256(path) == before  # no WAL switch, no mark, no table
    with ResultStore(path) as store:
        assert len(store.finished()) == 3
    assert identify(path) == "affdiv"


@pytest.mark.parametrize("read_only", [True, False])
def test_a_foreign_database_is_refused_and_left_alone(tmp_path, read_only):
    path = tmp_path / "other.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    db.execute("INSERT INTO customers VALUES (1, 'x')")
    db.commit()
    db.close()
    before = _sha256(path)
    with pytest.raises(ValueError, match=r"not an affdiv results store \(SQLite application_id 0x0, "
                                         r"tables \['customers'\]\)"):
        ResultStore(path, read_only=read_only)
    assert _sha256(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["other.sqlite"]


def test_a_folder_a_text_file_and_a_missing_file(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        ResultStore(tmp_path)
    text = tmp_path / "x.sqlite"
    text.write_text("method,batch_size\n")
    with pytest.raises(ValueError, match="not an SQLite database"):
        ResultStore(text)
    with pytest.raises(FileNotFoundError, match="no such results database"):
        ResultStore(tmp_path / "none.sqlite", read_only=True)
    assert not (tmp_path / "none.sqlite").exists()


def _store_with_runs(path, n=40):
    with ResultStore(path) as store:
        for seed in range(n):
            _put(store, seed=seed, accuracy=round(0.5 + seed / 100, 2))
        return store.records()


def test_truncated_store_is_named_damaged(tmp_path):
    path = tmp_path / "r.sqlite"
    _store_with_runs(path)
    data = path.read_bytes()
    for size in (len(data) // 2, len(data) - 100, 200):
        path.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"{path}: .*damaged"):
            ResultStore(path, read_only=True).records()


def test_a_changed_config_no_longer_matches_its_key(tmp_path):
    path = tmp_path / "r.sqlite"
    _store_with_runs(path, n=2)
    db = sqlite3.connect(path)
    db.execute("UPDATE runs SET config = replace(config, '\"seed\":1', '\"seed\":7')")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="its config does not hash to its key"):
        ResultStore(path, read_only=True).records()


def test_flipped_bytes_give_an_error_naming_the_file_or_the_same_records(tmp_path):
    # Every 53rd byte of a store flipped in turn: SQLite's checks and the per-row key and JSON
    # checks must turn each into a ValueError naming the file (or, for bytes in unused space,
    # leave the records as they were). Flips inside a metric's digits are not caught: the
    # metrics carry no checksum (module docstring).
    path = tmp_path / "r.sqlite"
    expected = _store_with_runs(path)
    data = path.read_bytes()
    outcomes = {"error": 0, "same": 0, "changed": 0}
    for position in range(0, len(data), 53):
        tampered = bytearray(data)
        tampered[position] ^= 0x5A
        path.write_bytes(bytes(tampered))
        try:
            with ResultStore(path, read_only=True) as store:
                records = store.records()
        except ValueError as error:
            assert str(path) in str(error) and "\n" not in str(error)
            outcomes["error"] += 1
        else:
            outcomes["same" if records == expected else "changed"] += 1
    assert outcomes["error"] > 0 and outcomes["same"] > 0


def test_put_refuses_a_second_version_of_the_data(tmp_path):
    path = tmp_path / "r.sqlite"
    config = {"method": "affine", "batch_size": 32, "seed": 0, "dataset": "digits", "data_seed": 0,
              "val_fraction": 0.1, "data_options": {}}
    with ResultStore(path) as store:
        store.put(config, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0, data_fingerprint="a" * 64))
        # Other data settings are other data: a different fingerprint is expected there.
        store.put({**config, "data_seed": 1}, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0,
                                                        data_fingerprint="c" * 64))
        before = store.finished()
        with pytest.raises(ValueError, match=f"holds runs on dataset 'digits' .*data_seed=0.* with data fingerprint "
                                             f"{'a' * 64}, but the data now gives {'b' * 64}"):
            store.put({**config, "seed": 1}, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0,
                                                       data_fingerprint="b" * 64))
        assert store.finished() == before
    with ResultStore(path, read_only=True) as store:
        store.check_fingerprints({data_key(config): "a" * 64})
        with pytest.raises(ValueError, match="b{64}"):
            store.check_fingerprints({data_key(config): "b" * 64})


# ------------------------------------------------------------------------------- measurements
def _measured(step, batch_size=32, share=0.25):
    return {"measurement": "divergence", "step": step, f"B{batch_size}:off_diagonal_share_median": share,
            f"B{batch_size}:cosine_mean": 0.5, f"B{batch_size}:diagonal_scale_cv": math.nan,
            f"B{batch_size}:fc1:cosine_mean": math.inf}


def test_measurements_round_trip_and_give_the_divergence_record_columns(tmp_path):
    path = tmp_path / "r.sqlite"
    measurements = [_measured(0, share=0.25), _measured(5, share=0.5)]
    with ResultStore(path) as store:
        _, plain = _put(store, seed=0, accuracy=0.5)
        config = {"method": "affine", "batch_size": 32, "seed": 1, "lr_rule": "sqrt"}
        key = store.put(config, StoredRun(metrics={"test_accuracy": 0.6}, curves=[], seconds=1.0,
                                          data_fingerprint="abc", measurements=measurements))
    with ResultStore(path, read_only=True) as store:
        assert store.verify() == 2
        got = store.measurements()
        assert set(got) == {key} and store.measurements([plain]) == {}
        # NaN/inf inside measurements are stored as null, as in metrics and curves
        assert got[key][1] == {**measurements[1], "B32:diagonal_scale_cv": None, "B32:fc1:cosine_mean": None}
        records = {r["config_hash"]: r for r in store.records()}
    assert records[key]["off_diagonal_share_init"] == 0.25 and records[key]["off_diagonal_share_last"] == 0.5
    assert records[key]["cosine_last"] == 0.5 and records[key]["diagonal_scale_cv_last"] is None
    assert records[key]["divergence_last_step"] == 5
    assert "off_diagonal_share_init" not in records[plain]
    db = sqlite3.connect(path)
    assert db.execute("SELECT measurements FROM runs WHERE config_hash = ?", (plain,)).fetchone() == (None,)
    db.close()


@pytest.mark.parametrize("marked", [False, True])
def test_a_store_without_the_measurements_column_reads_read_only_and_a_writer_adds_it(tmp_path, marked):
    path = _legacy_store(tmp_path / "old.sqlite")
    if marked:  # written by the version before the column: marked, same runs table
        db = sqlite3.connect(path)
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.commit()
        db.close()
    before = _sha256(path)
    with ResultStore(path, read_only=True) as store:
        assert store.verify() == 3 and store.measurements() == {}
        assert [r["seed"] for r in store.records()] == [0, 1, 2]
    assert _sha256(path) == before
    with ResultStore(path) as store:
        config = {"method": "l2", "batch_size": 32, "seed": 7, "dataset": "digits"}
        key = store.put(config, StoredRun(metrics={"test_accuracy": 0.9}, curves=[], seconds=1.0,
                                          data_fingerprint="fp", measurements=[_measured(0)]))
    assert identify(path) == "affdiv"
    with ResultStore(path, read_only=True) as store:
        assert list(store.measurements()) == [key] and store.verify() == 4


def test_records_carry_the_noise_scale_columns_of_measured_runs(tmp_path):
    from affdiv.experiments.runs.store import ResultStore

    config = {"method": "affine", "batch_size": 8, "seed": 0}
    measurements = [{"measurement": "noise_scale", "step": 0, "b_simple": 12.5},
                    {"measurement": "noise_scale", "step": 50, "b_simple": 40.0}]
    with ResultStore(tmp_path / "r.sqlite") as store:
        store.put(config, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0, data_fingerprint="abc",
                                    measurements=measurements))
        (record,) = store.records()
    assert (record["b_simple_init"], record["b_simple"], record["b_simple_step"]) == (12.5, 40.0, 50)


def test_budgets_are_read_from_the_configs_alone(tmp_path):
    path = tmp_path / "r.sqlite"
    base = {"method": "affine", "batch_size": 32, "dataset": "digits"}
    with ResultStore(path) as store:
        assert store.budgets() == set()
        for seed, budget in enumerate(("target", "epochs", None)):
            config = {**base, "seed": seed, **({"budget": budget} if budget else {})}
            store.put(config, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0,
                                        data_fingerprint="a" * 64))
    with ResultStore(path, read_only=True) as store:
        assert store.budgets() == {"target", "epochs", ""}


# ------------------------------------------------------------------- raw data and code versions
DIGITS = {"method": "affine", "batch_size": 32, "seed": 0, "dataset": "digits", "data_seed": 0, "val_fraction": 0.1,
          "data_options": {}}


def _put_run(store, config, **extra):
    return store.put(config, StoredRun(metrics={"test_accuracy": 0.5}, curves=[], seconds=1.0,
                                       data_fingerprint=f"{config['data_seed']}" * 64, **extra))


def test_put_refuses_a_run_on_other_raw_data_whatever_its_split(tmp_path):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        _put_run(store, DIGITS, raw_sha256="a" * 64)
        _put_run(store, {**DIGITS, "seed": 1, "data_seed": 1}, raw_sha256="a" * 64)  # another split, same raw data
        before = store.finished()
        with pytest.raises(ValueError, match=f"holds runs trained on dataset 'digits' whose raw data had SHA-256 "
                                             f"{'a' * 16}.*, but the data now gives {'b' * 16}.*the data files "
                                             "changed"):
            _put_run(store, {**DIGITS, "seed": 2, "data_seed": 2}, raw_sha256="b" * 64)
        assert store.finished() == before
    with ResultStore(path, read_only=True) as store:
        assert store.raw_data() == {raw_key(DIGITS): "a" * 64}
        store.check_raw_data({raw_key({**DIGITS, "data_seed": 5}): "a" * 64})
        with pytest.raises(ValueError, match="b{16}"):
            store.check_raw_data({raw_key({**DIGITS, "data_seed": 5}): "b" * 64})


def test_the_raw_key_holds_the_data_seed_exactly_where_the_raw_data_depends_on_it():
    from affdiv.experiments.data.dataset import DATASETS, load_dataset

    small = {"synthetic": {"n_train": 64, "n_test": 32}}
    for name in ("digits", "synthetic"):
        options = small.get(name, {})
        hashes = {load_dataset(name, seed=seed, **options).config["raw_sha256"] for seed in (0, 1)}
        keys = {raw_key({**DIGITS, "dataset": name, "data_seed": seed, "data_options": options}) for seed in (0, 1)}
        assert len(hashes) == len(keys), name  # the seed changes the raw data iff the key holds it
    assert set(GENERATED_FROM_SEED) <= set(DATASETS)


def test_each_run_records_the_code_that_trained_it_and_its_machine(tmp_path):
    from affdiv.provenance import code_identity, cpu_identity

    path = tmp_path / "r.sqlite"
    old = {"version": "0.1.0", "git_commit": "c" * 40, "git_dirty": False}
    amd = {**old, "cpu": {"vendor": "AuthenticAMD", "torch_blas": "mkl", "onednn": True, "torch": "2.13.0",
                          "cpu_capability": "AVX512"}}
    with ResultStore(path) as store:
        first = _put_run(store, DIGITS, code=old)
        second = _put_run(store, {**DIGITS, "seed": 1})
        third = _put_run(store, {**DIGITS, "seed": 2}, code=amd)
    with ResultStore(path, read_only=True) as store:
        assert store.code_versions() == {first: {**old, "cpu": None},
                                         second: {**code_identity(), "cpu": cpu_identity()}, third: amd}
    # a store of an earlier version, whose run_code has no cpu column: read (read-only, leaving every
    # byte) as not recorded, a run without a machine added without the column, which the first run
    # with one adds
    execute = sqlite3.connect(path)
    execute.executescript("ALTER TABLE run_code RENAME TO newer; CREATE TABLE run_code (config_hash TEXT PRIMARY KEY, "
                          "version TEXT NOT NULL, git_commit TEXT, git_dirty INTEGER); INSERT INTO run_code SELECT "
                          "config_hash, version, git_commit, git_dirty FROM newer; DROP TABLE newer;")
    execute.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    unrecorded = {first: {**old, "cpu": None}, second: {**code_identity(), "cpu": None}, third: {**old, "cpu": None}}
    with ResultStore(path, read_only=True) as store:
        assert store.code_versions() == unrecorded
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before

    def columns() -> list[str]:
        with sqlite3.connect(path) as db:
            return [row[1] for row in db.execute("PRAGMA table_info(run_code)")]

    with ResultStore(path) as store:
        fourth = _put_run(store, {**DIGITS, "seed": 3}, code=old)
        assert "cpu" not in columns()
        fifth = _put_run(store, {**DIGITS, "seed": 4}, code=amd)
        assert "cpu" in columns()
        assert store.code_versions() == {**unrecorded, fourth: {**old, "cpu": None}, fifth: amd}
    execute = sqlite3.connect(path)
    execute.execute("DROP TABLE run_code")  # as a store written before runs recorded their code
    execute.commit()
    execute.close()
    with ResultStore(path, read_only=True) as store:
        assert store.code_versions() == {first: None, second: None, third: None, fourth: None, fifth: None}


def test_a_run_put_without_its_code_records_this_machine_on_its_device(tmp_path, monkeypatch):
    # put's default is this process's machine on the run's device: a CUDA run's names the GPU (torch's
    # answers replaced: no GPU here); a device CUDA cannot serve here is refused, naming it
    import torch

    from affdiv.provenance import code_identity, cpu_identity

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "SomeGPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    with ResultStore(tmp_path / "r.sqlite") as store:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ValueError, match=r"^device 'cuda:0': CUDA is not available here"):
            _put_run(store, {**DIGITS, "device": "cuda:0"})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        key = _put_run(store, {**DIGITS, "device": "cuda:0"})
        assert store.code_versions() == {key: {**code_identity(), "cpu": {
            **cpu_identity(), "gpu": "SomeGPU", "gpu_capability": "9.0", "cuda": "12.8", "cudnn": 91002}}}


@pytest.mark.parametrize("cell, message", [("'{'", "column 'cpu' is not valid JSON"),
                                           ("'[1]'", "column 'cpu' is not a JSON object")])
def test_a_damaged_machine_record_is_named(tmp_path, cell, message):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        key = _put_run(store, DIGITS)
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE run_code SET cpu = {cell}")
    with ResultStore(path, read_only=True) as store, pytest.raises(ValueError, match=f"run {key}: {message}"):
        store.code_versions()


# ------------------------------------------------------------- locks, a second writer, a full disk
def _holding_an_exclusive_lock(path):
    """A connection (as another program's) that holds an exclusive lock on the store at ``path``."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    return holder


def test_a_locked_store_is_called_locked_not_damaged(tmp_path, monkeypatch):
    from affdiv.experiments.runs import store as store_module

    monkeypatch.setattr(store_module, "BUSY_TIMEOUT", 0.2)
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        _put_run(store, DIGITS)
    holder = _holding_an_exclusive_lock(path)
    try:
        for read_only in (True, False):
            with pytest.raises(store_module.StoreLocked, match="locked by another process for 0.2 s .*the store is "
                                                               "not damaged: let that process finish"):
                ResultStore(path, read_only=read_only).finished()
    finally:
        holder.close()
    with ResultStore(path, read_only=True) as store:
        assert len(store.finished()) == 1


def test_a_second_writer_is_refused_at_once_and_the_first_goes_on(tmp_path):
    from affdiv.experiments.runs.store import StoreLocked

    path = tmp_path / "r.sqlite"
    with ResultStore(path) as first:
        with pytest.raises(StoreLocked, match="another process is writing this results store"):
            ResultStore(path)
        _put_run(first, DIGITS)
        with ResultStore(path, read_only=True) as reader:  # readers are never refused
            assert len(reader.finished()) == 1
    with ResultStore(path) as again:  # the lock went with the first writer
        assert len(again.finished()) == 1


def test_a_full_disk_is_an_oserror_and_keeps_the_committed_runs(tmp_path):
    import errno

    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        first = _put_run(store, DIGITS)
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's "database or disk is full" from here
        with pytest.raises(OSError, match="no space left for the results store .*database or disk is full") as caught:
            store.put({**DIGITS, "seed": 1}, StoredRun(metrics={"test_accuracy": 0.5}, curves=[{"x": "y" * 100_000}],
                                                       seconds=1.0, data_fingerprint="0" * 64))
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(path)
    with ResultStore(path, read_only=True) as store:
        assert store.finished() == {first} and store.verify() == 1


def test_check_time_sums_the_runs_that_recorded_it_and_an_earlier_store_gains_the_column(tmp_path):
    path = _legacy_store(tmp_path / "old.sqlite")  # 3 runs of 1 s each, stored before check time was recorded
    with ResultStore(path, read_only=True) as store:
        assert store.check_time() == {"check_s": 0, "runs_recorded": 0, "runs": 3, "share": None}
    with ResultStore(path) as store:  # a run without check time leaves the column out
        store.put({"method": "l2", "batch_size": 32, "seed": 6, "dataset": "digits"},
                  StoredRun(metrics={"test_accuracy": 0.9}, curves=[], seconds=1.0, data_fingerprint="fp"))
    columns = [row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(runs)")]
    assert "check_seconds" not in columns and "measurements" in columns
    with ResultStore(path) as store:
        keys = [store.put({"method": "l2", "batch_size": 32, "seed": seed, "dataset": "digits"},
                          StoredRun(metrics={"test_accuracy": 0.9}, curves=[], seconds=seconds,
                                    data_fingerprint="fp", check_seconds=checks))
                for seed, seconds, checks in ((7, 4.0, 1.0), (8, 6.0, 0.5))]
    with ResultStore(path, read_only=True) as store:
        assert store.verify() == 6
        assert store.check_time() == {"check_s": 1.5, "runs_recorded": 2, "runs": 6, "share": 1.5 / 10.0}
        assert store.check_time(keys[:1]) == {"check_s": 1.0, "runs_recorded": 1, "runs": 1, "share": 0.25}
        assert "check_seconds" not in store.records()[-1]  # timing is never part of the records
    assert identify(path) == "affdiv"


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_put_refuses_a_check_time_that_is_no_time(tmp_path, value):
    with ResultStore(tmp_path / "r.sqlite") as store:
        with pytest.raises(ValueError, match="check_seconds must be a finite"):
            store.put({"method": "l2", "batch_size": 32, "seed": 0},
                      StoredRun(metrics={}, curves=[], seconds=1.0, data_fingerprint="fp", check_seconds=value))
        assert store.finished() == set()


@pytest.mark.parametrize("value", ["-1", "9e999", "'soon'"])
def test_a_check_time_that_is_no_time_is_named_damaged(tmp_path, value):
    path = tmp_path / "r.sqlite"
    with ResultStore(path) as store:
        _config, key = _put(store, seed=0, accuracy=0.75)
    db = sqlite3.connect(path)
    db.execute(f"UPDATE runs SET check_seconds = {value}")  # 9e999: SQLite's infinity
    db.commit()
    db.close()
    with ResultStore(path, read_only=True) as store, pytest.raises(ValueError, match=f"run {key}: malformed check"):
        store.verify()

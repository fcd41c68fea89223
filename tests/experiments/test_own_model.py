"""A method of one's own (a model factory named in a preset) on a dataset of one's own (.npz),
end to end through `affdiv falsify`, and the one-line errors around both."""

import json

import numpy as np
import pytest
import torch

from affdiv.cli import main
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.plan import REPORT_FILES
from affdiv.experiments.runs.config import RunConfig, config_hash
from affdiv.experiments.runs.factories import resolve
from affdiv.experiments.runs.models import build_network
from affdiv.experiments.runs.presets import load_preset
from affdiv.experiments.runs.store import ResultStore

FACTORY = '''
from torch import nn


def tiny(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(size, 13), nn.Tanh(), nn.Linear(13, num_classes))


def not_a_module(input_shape, num_classes):
    return "a network"
'''

PRESET = """
description = "A network of one's own against the plain MLP, on arrays of one's own."
[run]
dataset = "npz"
data_options = {path = "DATA"}
depth = 1
width = 16
lr_rule = "tuned"
lr_grid = [0.1, 0.2, 0.4]
grid_extensions = 1
budget = "target"
target = 0.7
targets = [0.5]
read_spacing = 0.1
length = 300
data_seed = "seed"
[grid]
method = ["affine", "mine"]
batch_size = [8, 32, 128]
seed = [0, 1, 2]
[method.mine]
model = "FACTORY:tiny"
[analysis]
corrected = ["mine"]
baselines = ["affine"]
"""


@pytest.fixture
def own(tmp_path, monkeypatch):
    """A folder with a factory file, digits as an .npz and a preset naming both, as the working
    directory (the relative paths of a preset are taken from there)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.images[:, None].astype(np.float32), digits.target
    np.savez(tmp_path / "digits.npz", x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    (tmp_path / "nets.py").write_text(FACTORY)
    (tmp_path / "mine.toml").write_text(PRESET.replace("DATA", "digits.npz").replace("FACTORY", "nets.py"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_preset_with_a_factory_and_an_npz_dataset_runs_end_to_end(own, capsys):
    code = main(["falsify", "--preset", "mine.toml", "--out", str(own / "out"), "--calibration-sims", "0",
                 "--workers", "1"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((own / "out" / "summary.json").read_text())
    written = {p.name for p in (own / "out").iterdir()} - {"results.sqlite", "results.sqlite-wal", "results.sqlite-shm"}
    assert {"bcrit_vs_target.png", "ratio_vs_target.png"} <= written <= set(REPORT_FILES)
    # The provenance names no absolute path: the store is written relative to the results folder.
    assert str(own) not in json.dumps(summary["provenance"]) and summary["provenance"]["results_db"] == "results.sqlite"
    assert set(summary["by_target"]) == {"0.5", "0.7"} and summary["primary_target"] == 0.7
    assert summary["critical_batch"]["mine"]["role"] == "corrected" and summary["groups"].keys() == {"tuned"}
    with ResultStore(own / "out" / "results.sqlite", read_only=True) as store:
        runs = store.records(metric="test_accuracy")
    mine = [r for r in runs if r["method"] == "mine"]
    assert len(mine) == 9 and {r["model"] for r in mine} == {"nets.py:tiny"}
    assert {r["model_digest"] for r in mine} == {resolve("nets.py:tiny")[1]}
    # The stored runs build the factory's network (13 hidden units; the preset's width is 16).
    config = RunConfig.from_dict({k: mine[0][k] for k in RunConfig.__dataclass_fields__ if k in mine[0]})
    data = load_dataset("npz", path="digits.npz", seed=0)
    network = build_network(config, data.input_shape, data.num_classes)
    assert sum(p.numel() for p in network.parameters()) == 64 * 13 + 13 + 13 * 10 + 10
    assert data.num_classes == 10 and data.input_shape == (1, 8, 8)


def test_an_edited_factory_makes_new_runs_and_a_stale_plan_is_refused(own):
    before = load_preset("mine.toml").studies()[0].configs
    (own / "nets.py").write_text(FACTORY + "\n# edited\n")
    after = load_preset("mine.toml").studies()[0].configs
    keys = lambda configs, m: {config_hash(c.to_dict()) for c in configs if c.method == m}  # noqa: E731
    assert keys(before, "affine") == keys(after, "affine") and not keys(before, "mine") & keys(after, "mine")
    stale = next(c for c in before if c.method == "mine")
    with pytest.raises(ValueError, match=r"model nets.py:tiny: its source changed since the runs were planned"):
        build_network(stale, (1, 8, 8), 10)


@pytest.mark.parametrize(
    "table, message",
    [
        ('model = "nets.py"', "model must be 'package.module:function' or 'path/to/file.py:function', got 'nets.py'"),
        ('model = "missing.py:tiny"', "model missing.py: no such file"),
        ('model = "nets.py:absent"', "model nets.py:absent: nets.py has no function 'absent'"),
        ('model = "no_such_module_here:tiny"', "model no_such_module_here: cannot import it"),
        ('model_digest = "0"', "'model_digest' cannot differ by method"),
    ],
)
def test_bad_factories_are_one_line_errors_before_any_run(own, capsys, table, message):
    (own / "mine.toml").write_text(PRESET.replace("DATA", "digits.npz").replace('model = "FACTORY:tiny"', table))
    code = main(["falsify", "--preset", "mine.toml", "--out", "out", "--calibration-sims", "0"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (own / "out" / "results.sqlite").exists()


def test_a_factory_that_returns_no_module_is_named(own):
    config = RunConfig(dataset="npz", method="mine", batch_size=8, seed=0, model="nets.py:not_a_module")
    with pytest.raises(ValueError, match="model nets.py:not_a_module: returned str, expected a torch.nn.Module"):
        build_network(config, (1, 8, 8), 10)


def test_a_built_in_name_cannot_take_a_factory():
    with pytest.raises(ValueError, match="method 'affine' is built in; a method with its own model needs another"):
        RunConfig(dataset="digits", method="affine", batch_size=8, seed=0, model="nets.py:tiny")


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x_train": np.zeros((4, 3)), "y_train": np.zeros(4, int), "x_test": np.zeros((2, 3))},
         "needs arrays x_train, y_train, x_test, y_test; missing y_test"),
        ({"x_train": np.zeros((4, 3)), "y_train": np.zeros(4), "x_test": np.zeros((2, 3)), "y_test": np.zeros(2)},
         "the harness trains classifiers; y_train and y_test must be integer class labels"),
        ({"x_train": np.zeros((4, 3)), "y_train": np.zeros(4), "x_test": np.zeros((2, 3)), "y_test": np.zeros(2, int)},
         "y_train and y_test must both be integer class labels or both real targets, got dtypes float64 and int64"),
        ({"x_train": np.zeros((4, 3)), "y_train": np.zeros(4, int), "x_test": np.zeros((2, 5)),
          "y_test": np.zeros(2, int)}, "x_test's sample shape must be x_train's (3,), got (5,)"),
        ({"x_train": np.array([[np.nan, 0, 0]] * 4), "y_train": np.zeros(4, int), "x_test": np.zeros((2, 3)),
          "y_test": np.zeros(2, int)}, "x_train must be finite, got NaN or inf"),
        ({"x_train": np.array([object()] * 4), "y_train": np.zeros(4, int), "x_test": np.zeros((2, 3)),
          "y_test": np.zeros(2, int)}, "an array holds Python objects, which are not read (no pickles)"),
    ],
)
def test_bad_npz_files_are_named(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match=None) as error:
        load_dataset("npz", path=str(tmp_path / "bad.npz"))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_npz_paths_and_identity(tmp_path):
    with pytest.raises(ValueError, match="npz: data_options needs path"):
        load_dataset("npz")
    with pytest.raises(FileNotFoundError, match="nowhere.npz: no such file"):
        load_dataset("npz", path="nowhere.npz", data_dir=str(tmp_path))
    x = np.arange(60, dtype=np.float32).reshape(20, 3)
    y = np.arange(20) % 2
    np.savez(tmp_path / "a.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    (tmp_path / "sub").mkdir()
    np.savez(tmp_path / "sub" / "b.npz", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4])
    a = load_dataset("npz", path="a.npz", data_dir=str(tmp_path), val_fraction=0.2)
    b = load_dataset("npz", path="sub/b.npz", data_dir=str(tmp_path), val_fraction=0.2)
    # The same arrays in another file are the same data: the path is not in the fingerprint.
    assert a.fingerprint == b.fingerprint and a.num_classes == 2
    torch.testing.assert_close(a.train.x, b.train.x)


def test_a_model_set_anywhere_gets_its_digest_and_an_edit_is_built_anew(own):
    # [run] or --set, not only [method.NAME]: the factory's source is in every such run's key.
    preset = load_preset("mine.toml")
    (config,) = {c.model_digest for s in preset.studies(methods=["affine"], run={"model": "nets.py:tiny",
                                                                               "method": "other"})
                 for c in s.configs}
    assert config == resolve("nets.py:tiny")[1]
    with pytest.raises(ValueError, match=r"model absent.py:tiny: FileNotFoundError"):
        preset.studies(run={"model": "absent.py:tiny", "method": "other"})
    # The same process builds the edited file's network under the edited file's digest.
    (own / "nets.py").write_text(FACTORY.replace("13", "11"))
    factory, digest = resolve("nets.py:tiny")
    assert digest == resolve("nets.py:tiny")[1] != config
    assert factory((1, 8, 8), 10)[1].out_features == 11


def test_a_local_module_named_like_the_standard_library_is_the_local_one(own):
    (own / "code.py").write_text(FACTORY)
    assert resolve("code:tiny")[0]((1, 8, 8), 10)[1].out_features == 13


def test_a_factory_network_takes_the_runs_dtype(own):
    (own / "wide.py").write_text(FACTORY.replace("return nn.Sequential(", "return nn.Sequential(").replace(
        "nn.Linear(13, num_classes))", "nn.Linear(13, num_classes)).double()"))
    from affdiv.experiments.runs.training import build_member

    data = load_dataset("npz", path="digits.npz", seed=0)
    config = RunConfig(dataset="npz", data_options={"path": "digits.npz"}, method="mine", batch_size=8, seed=0,
                       model="wide.py:tiny")
    assert {p.dtype for p in build_member(config, data, 0).parameters()} == {torch.float32}

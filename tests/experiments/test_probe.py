"""`affdiv probe`: the divergence meter on real data behaves as the derivations say it must."""

import hashlib
import json
import math
import os
import sys
import warnings

import pytest

from affdiv import cli
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.probe import ProbeOptions, Summary, aggregate, measure, parse_int_list
from affdiv.experiments.runs.config import VIT_METHODS
from affdiv.meter import UnmeasuredModuleWarning


@pytest.fixture(scope="module")
def correlated():
    return load_dataset("synthetic", seed=0, n_train=600, n_test=50, features=12, classes=3, correlation=0.8)


def _by(rows):
    return {(g.model, g.batch_size): g for g in aggregate(rows, ("model", "batch_size"))}


def test_corrections_equalise_the_diagonal_and_leave_the_cross_terms(correlated):
    models = ["layer-affine", "layer-affine_like", "layer-norm_l2"]
    rows, samples = measure(correlated, models, ProbeOptions(batch_sizes=(1, 8, 64), seeds=2, batches=1))
    by = _by(rows)
    for model in ("layer-affine_like", "layer-norm_l2"):
        # K_ii is constant for the corrections: the spread is rounding only (float64, ~1e-16)
        assert by[(model, 64)].value("diagonal_scale_cv") < 1e-12
        assert by[(model, 64)].value("diagonal_norm_correlation") is None  # nothing to correlate
    assert by[("layer-affine_like", 64)].value("diagonal_scale_mean") == pytest.approx(1.0, abs=1e-12)
    assert by[("layer-norm_l2", 64)].value("diagonal_scale_mean") == pytest.approx(2.0, abs=1e-12)
    assert by[("layer-affine", 64)].value("diagonal_scale_cv") > 1e-3  # ‖x‖² + 1 varies from sample to sample
    assert by[("layer-affine", 64)].value("diagonal_norm_correlation") > 0.9
    for model in models:
        assert by[(model, 1)].value("off_diagonal_share_mean") < 1e-12  # no other sample: rounding only
        assert by[(model, 1)].value("cosine_mean") == pytest.approx(1.0, abs=1e-12)
        # correlated inputs: the cross-sample part grows with the batch
        share = {b: by[(model, b)].value("off_diagonal_share_median") for b in (8, 64)}
        assert share[64] > share[8] > 0
    scatter = {s["model"]: s for s in samples}
    assert set(scatter) == set(models) and all(len(s["input_norm"]) == 64 for s in samples)


def test_network_scope_of_a_one_layer_model_is_its_layer_scope(correlated):
    layer, _ = measure(correlated, ["layer-affine"], ProbeOptions(batch_sizes=(16,), seeds=1, batches=1))
    network, _ = measure(correlated, ["layer-affine"], ProbeOptions(batch_sizes=(16,), seeds=1, batches=1,
                                                                    scope="network"))
    for metric in ("scale_mean", "diagonal_scale_mean", "off_diagonal_share_mean", "cosine_mean"):
        assert network[0][metric] == pytest.approx(layer[0][metric], rel=1e-10)


def test_the_interval_is_over_seeds():
    rows = [{"model": "m", "layer": "0", "kind": "Linear", "batch_size": 8, "seed": s, "batch": b,
             "cosine_mean": v} for s, b, v in [(0, 0, 0.1), (0, 1, 0.3), (1, 0, 0.6), (2, 0, 0.5)]]
    (row,) = aggregate(rows, ("model", "layer", "batch_size"))
    assert row.seeds == 3 and row.value("cosine_mean") == pytest.approx((0.2 + 0.6 + 0.5) / 3)
    low, high = row.ci("cosine_mean")
    assert low < row.value("cosine_mean") < high and (high - low) / 2 == pytest.approx(
        4.302652729911275 * math.sqrt(((0.2 - 13 / 30) ** 2 + (0.6 - 13 / 30) ** 2 + (0.5 - 13 / 30) ** 2) / 2 / 3))
    (one,) = aggregate(rows[:2], ("model", "layer", "batch_size"))
    assert one.ci("cosine_mean") is None and one.value("scale_mean") is None


def test_the_meter_measures_every_vit_method_of_the_harness(digits):
    """The probe's vit built-ins are the harness's networks (test_transformer.py); here every one is
    measured whole at layer scope, and the per-token diagonal scales take their closed forms:
    AffineLike's is 1; an nn.Linear after a LayerNorm at init (gain 1, bias 0) sees tokens of
    ‖x‖² = d·σ²/(σ² + ε) and so has ‖x‖² + 1 in (d, d + 1], d = 32 (ε = 1e-5 moves it by < 1e-3
    for token variances σ² > 1e-2)."""
    rows, _ = measure(digits, list(VIT_METHODS), ProbeOptions(batch_sizes=(4,), seeds=1, batches=1))
    assert {r["model"] for r in rows} == set(VIT_METHODS)
    assert not [r for r in rows if r.get("skipped") or "skipped_reason" in r]  # nothing left unmeasured
    by = {(r["model"], r["layer"]): r for r in rows}
    projections = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.0", "mlp.2")
    for method in VIT_METHODS:
        for name in projections:
            row = by[(method, f"blocks.0.{name}")]
            assert row["kind"] == ("AffineLike" if "affine_like" in method else "Linear")
            assert row["off_diagonal_share_mean"] > 0 and math.isfinite(row["off_diagonal_share_mean"])
            if "affine_like" in method:
                assert row["site_diagonal_scale_mean"] == pytest.approx(1.0, abs=1e-12)
        assert ((method, "blocks.0.attn.q_norm") in by) == method.endswith("qknorm")
        assert ((method, "blocks.0.norm1") in by) == (method != "vit-nonorm")
    for method in ("vit", "vit-qknorm"):
        for name in ("attn.q", "attn.k", "attn.v", "mlp.0"):  # the projections right after a LayerNorm
            assert 32.97 < by[(method, f"blocks.0.{name}")]["site_diagonal_scale_mean"] <= 33 + 1e-9
    # without normalisation the tokens' norms are whatever the embedding gives: not d
    assert abs(by[("vit-nonorm", "blocks.0.attn.q")]["site_diagonal_scale_mean"] - 33) > 1


def test_probe_command_writes_its_reports(tmp_path):
    status = cli.main(
        ["probe", "--model", "mlp-affine_like,cnn-patchnorm,transformer-qknorm", "--data", "digits",
         "--batch-sizes", "4,8", "--seeds", "2", "--batches", "1", "--out", str(tmp_path)]
    )
    assert status == 0
    record = json.loads((tmp_path / "probe.json").read_text(), parse_constant=pytest.fail)  # no NaN/inf
    assert record["schema_version"] == 3 and record["scope"] == "layer" and record["batch_sizes"] == [4, 8]
    assert record["provenance"]["data_fingerprint"]
    layers = {(r["model"], r["layer"]) for r in record["rows"]}
    assert ("transformer-qknorm", "block.attn.q_norm") in layers and ("cnn-patchnorm", "0") in layers
    patchnorm = next(r for r in record["by_kind"] if r["kind"] == "PatchNormConv2d")
    assert patchnorm["site_diagonal_scale_mean"] == pytest.approx(1.0, abs=1e-12)
    assert record["samples"] and {s["batch_size"] for s in record["samples"]} == {8}
    for name in ("share_vs_batch.png", "diagonal_vs_norm.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| PatchNormConv2d | 8 |" in (tmp_path / "probe.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # every file written whole (temporary sibling, then renamed)


def test_network_scope_with_batchnorm_respects_the_masked_limit(tmp_path):
    assert cli.main(["probe", "--model", "mlp-batchnorm", "--batch-sizes", "2,4", "--seeds", "1", "--batches", "1",
                     "--scope", "network", "--masked-limit", "2", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "probe.json").read_text())
    by = {(r["layer"], r["batch_size"]): r for r in record["rows"]}
    assert by[("1", 2)]["off_diagonal_share_mean"] is not None  # masked route, B = 2 passes
    assert by[("1", 4)]["off_diagonal_share_mean"] is None and by[("1", 4)]["cosine_mean"] is not None
    assert "masked" in record["routes"]["Linear"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "no.such.module:f"], "model no.such.module: cannot import it"),
    (["--model", "mlp-affine", "--batch-sizes", "8,0"], "--batch-sizes must be"),
    (["--model", "mlp-affine", "--batch-sizes", "100000"], "exceeds the"),
    (["--model", "mlp-affine", "--seeds", "0"], "--seeds must be"),
    (["--model", "cnn-conv", "--data", "synthetic"], "needs image inputs"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_measurement(tmp_path, capsys, argv, message):
    assert cli.main(["probe", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_model_given_as_a_factory_path(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def tiny(input_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))\n"
        "def no_arguments():\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["probe", "--model", "my_models:tiny,my_models:no_arguments", "--batch-sizes", "4",
                     "--seeds", "1", "--batches", "1", "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert {r["model"] for r in record["rows"]} == {"my_models:tiny", "my_models:no_arguments"}


def test_the_summary_is_typed_and_writes_the_rows_of_probe_json():
    rows = [{"model": "m", "layer": "0", "kind": "Linear", "batch_size": b, "seed": s, "batch": 0,
             "route": "r", "diagonal_route": "d", "cosine_mean": 0.5 + s / 10} for s in (0, 1) for b in (8, 4)]
    rows.append({"model": "m", "layer": "1", "batch_size": 4, "seed": 0, "batch": 0, "skipped_reason": "why"})
    summary = Summary.of(rows)
    assert [(g.kind, g.batch_size) for g in summary.by_kind] == [("Linear", 4), ("Linear", 8)]  # B as a number
    assert summary.layers_per_kind() == {"Linear": 1} and summary.routes == {"Linear": "r; diagonal: d"}
    assert summary.skipped == {("m", "1"): "why"}
    row = summary.to_json()["rows"][0]
    assert list(row)[:5] == ["model", "layer", "batch_size", "kind", "seeds"]
    assert row["cosine_mean"] == pytest.approx(0.55) and len(row["cosine_mean_ci"]) == 2
    assert row["scale_mean"] is None and row["scale_mean_ci"] is None
    with pytest.raises(ValueError, match="keys must be some of model, layer, kind, batch_size"):
        aggregate(rows, ("seed",))


@pytest.mark.parametrize("field, value, message", [
    ("batch_sizes", "8,0", "batch_sizes must be comma-separated positive integers"),
    ("seeds", 0, "seeds must be an integer >= 1, got 0"),
    ("seed", -1, "seed must be an integer >= 0, got -1"),
    ("seed", 2**64 - 2, "seed must be <= 18446744073709551615 - seeds + 1 (the last seed in torch's seed range), "
                        "got 18446744073709551614 with seeds 3"),
    ("batches", 1.5, "batches must be an integer >= 1"),
    ("scope", "model", "scope must be one of layer, network, got 'model'"),
    ("dtype", "float16", "dtype must be one of float64, float32"),
    ("lr", math.inf, "lr must be a finite number > 0, got inf"),
    ("per_sample", "yes", "per_sample must be True or False"),
    ("masked_limit", 0, "masked_limit must be an integer >= 1, got 0"),
    ("loss", "hinge", "loss must be one of cross_entropy, mse"),
])
def test_probe_options_refuse_bad_fields_in_one_line_naming_them(field, value, message):
    with pytest.raises(ValueError) as error:
        ProbeOptions(**{field: value})
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_probe_options_keep_sorted_distinct_batch_sizes_and_list_the_seeds():
    options = ProbeOptions(batch_sizes="512, 8,32,8", seeds=3, seed=5, masked_limit=None)
    assert options.batch_sizes == (8, 32, 512) and options.seed_list == [5, 6, 7]
    assert ProbeOptions(batch_sizes=[4, 2]).batch_sizes == (2, 4)
    with pytest.raises(TypeError, match="options must be a ProbeOptions"):
        measure(None, ["layer-affine"], {"seeds": 1})


def test_batch_sizes_parse():
    assert parse_int_list("512, 8,32,8", "batch_sizes") == [8, 32, 512]
    with pytest.raises(ValueError, match="comma-separated positive integers"):
        parse_int_list("8;32", "batch_sizes")


def test_every_built_in_model_is_measured_whole_in_both_scopes():
    import torch
    import torch.nn.functional as F

    from affdiv.experiments.runs import zoo
    from affdiv.meter import divergence

    data = load_dataset("digits", seed=0)
    x, y = data.train.x[:6].double(), data.train.y[:6]
    for name in zoo.BUILTIN:
        torch.manual_seed(0)
        model = zoo.build(name, input_shape=data.input_shape, num_classes=data.num_classes).double()
        owners = {n for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))}
        for scope in ("layer", "network"):
            report = divergence(model, x, lambda out: F.cross_entropy(out, y, reduction="none"), lr=0.1, scope=scope)
            assert not report.skipped and set(report.layers) == owners, (name, scope)
            assert all(layer.off_diagonal_share is not None for layer in report.layers.values()), (name, scope)


def test_the_divergence_measurement_rides_along_a_training_run():
    from affdiv.experiments.runs import divergence_measurement
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.training import train_run

    data = load_dataset("digits", seed=0)
    config = RunConfig(dataset="digits", method="affine_like", batch_size=32, seed=0, budget="steps", length=4,
                       width=16)
    plain = train_run(config, data)
    probe = divergence_measurement.measurement(every=2, batch_sizes=(8, 32))
    measured = train_run(config, data, measurements=[probe])
    assert measured.metrics == plain.metrics  # the measurement changes nothing the run does
    steps = [m["step"] for m in measured.measurements if m["measurement"] == "divergence"]
    assert steps == [0, 2, 4]
    first = measured.measurements[0]
    assert {"B8:off_diagonal_share_median", "B32:cosine_mean", "B32:1:diagonal_scale_cv"} <= set(first)
    assert first["B32:1:diagonal_scale_cv"] < 1e-5  # AffineLike: K_ii = 1 (float32)
    json.dumps(measured.measurements, allow_nan=False)
    columns = divergence_measurement.record_columns(measured.measurements, batch_size=32)
    assert set(columns) == {"off_diagonal_share_init", "off_diagonal_share_last", "cosine_init", "cosine_last",
                            "diagonal_scale_cv_init", "diagonal_scale_cv_last", "divergence_last_step"}
    with pytest.raises(ValueError, match="scope must be"):
        divergence_measurement.measurement(every=2, scope="model")


def test_the_divergence_measurement_is_picklable_and_checks_its_options():
    import pickle

    from affdiv.experiments.runs import divergence_measurement as dm

    probe = dm.measurement(every=3, batch_sizes=[8, 16], scope="network", masked_limit=None)
    back = pickle.loads(pickle.dumps(probe))  # it reaches a sweep's workers
    assert back.fn.keywords["options"] == dm.MeasurementOptions(batch_sizes=(8, 16), scope="network",
                                                                masked_limit=None)
    with pytest.raises(ValueError, match="batch sizes must be integers >= 1"):
        dm.MeasurementOptions(batch_sizes=(8, 0))
    with pytest.raises(ValueError, match="masked_limit must be None or an integer >= 1"):
        dm.MeasurementOptions(masked_limit=0)


def test_positive_quantities_get_a_positive_interval_from_the_log_scale():
    values = [(0, 4.0), (1, 0.25)]  # two seeds far apart: the plain t interval would reach below 0
    rows = [{"model": "m", "layer": "0", "kind": "Linear", "batch_size": 8, "seed": s, "batch": 0,
             "diagonal_scale_mean": v, "cosine_mean": v - 1} for s, v in values]
    (row,) = aggregate(rows, ("model", "layer", "batch_size"))
    half = 12.706204736174707 * abs(math.log(4.0) - math.log(0.25)) / 2  # t(0.975, 1)·sd/√n, sd = |a − b|/√2
    assert row.value("diagonal_scale_mean") == pytest.approx(1.0)  # the geometric mean of 4 and 1/4
    assert row.ci("diagonal_scale_mean") == pytest.approx((math.exp(-half), math.exp(half)))
    assert row.value("cosine_mean") == pytest.approx((3.0 - 0.75) / 2)  # a signed quantity: the plain mean
    assert row.ci("cosine_mean")[0] < 0
    for row_ in rows:  # a share cannot be negative: with a zero (no logarithm), the plain interval cut at 0
        row_["off_diagonal_share_mean"] = 4.0 * row_["seed"]
    rows[1]["diagonal_scale_mean"] = -0.5  # a network-scope diagonal scale is signed: the plain interval, uncut
    (row,) = aggregate(rows, ("model", "layer", "batch_size"))
    assert row.value("off_diagonal_share_mean") == pytest.approx(2.0)
    assert row.ci("off_diagonal_share_mean")[0] == 0.0
    low, high = row.ci("diagonal_scale_mean")
    assert row.value("diagonal_scale_mean") == pytest.approx(1.75)
    assert low == pytest.approx(1.75 - 12.706204736174707 * 4.5 / 2) and low < 0 < 1.75 < high
    for row_ in rows:  # at network scope a diagonal scale is averaged on the plain scale in every cell
        row_["scope"] = "network"
    rows[1]["diagonal_scale_mean"] = 0.25
    (row,) = aggregate(rows, ("model", "layer", "batch_size"))
    assert row.value("diagonal_scale_mean") == pytest.approx(2.125)  # the plain mean of 4 and 1/4, all > 0
    assert row.value("off_diagonal_share_mean") == pytest.approx(2.0)
    rows[0]["scope"] = "layer"  # rows of two scopes would need two scales: refused
    with pytest.raises(ValueError, match=r"rows of one scope only, got rows of scopes \['layer', 'network'\]"):
        aggregate(rows, ("model", "layer", "batch_size"))


MODELS = """
import torch
def attention(input_shape, num_classes):
    tokens, width = input_shape[-2], input_shape[-1]
    return torch.nn.Sequential(
        torch.nn.Flatten(1, -2), torch.nn.TransformerEncoderLayer(width, 2, dim_feedforward=16, batch_first=True),
        torch.nn.Flatten(), torch.nn.Linear(tokens * width, num_classes))
def three_outputs():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8, 3))
"""


def test_a_model_file_by_path_and_a_module_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "models_here.py").write_text(MODELS)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "elsewhere.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # no PYTHONPATH
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmeasuredModuleWarning)
        assert cli.main(["probe", "--model", "models_here:attention,sub/elsewhere.py:attention", "--batch-sizes",
                         "4", "--seeds", "1", "--batches", "1", "--out", "out"]) == 0
    record = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert not record["skipped"]
    layers = {(r["model"], r["layer"], r["kind"]) for r in record["rows"]}
    for model in ("models_here:attention", "sub/elsewhere.py:attention"):
        assert (model, "1.self_attn", "MultiheadAttention") in layers


def _npz(path, **arrays):
    import numpy as np

    rng = np.random.default_rng(0)
    base = {"x_train": rng.normal(size=(30, 2, 4)), "y_train": rng.normal(size=(30, 3)),
            "x_test": rng.normal(size=(6, 2, 4)), "y_test": rng.normal(size=(6, 3))}
    np.savez(path, **{k: v for k, v in {**base, **arrays}.items() if v is not None})
    return str(path)


def test_an_npz_dataset_with_the_mse_loss(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(MODELS)
    data = _npz(tmp_path / "d.npz")
    assert cli.main(["probe", "--model", f"{tmp_path / 'm.py'}:attention,layer-affine", "--data", data, "--loss",
                     "mse", "--batch-sizes", "4,8", "--seeds", "2", "--batches", "1", "--out",
                     str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert record["loss"] == "mse" and record["data"] == os.path.relpath(data)  # no absolute path recorded
    assert record["provenance"]["data_fingerprint"] == hashlib.sha256((tmp_path / "d.npz").read_bytes()).hexdigest()
    linear = next(r for r in record["rows"] if r["model"] == "layer-affine" and r["batch_size"] == 8)
    assert linear["diagonal_scale_mean"] > 1 and linear["diagonal_scale_mean_ci"][0] > 0  # ‖x‖² + 1
    assert "log scale" in (tmp_path / "out" / "probe.md").read_text()


@pytest.mark.parametrize("arrays, argv, message", [
    ({"x_test": None}, [], "needs arrays x_train, y_train, x_test, y_test; missing x_test"),
    ({"y_train": [1.0, 2.0]}, [], "y_train must have one entry per sample of x_train (30), got shape (2,)"),
    ({"x_test": [[1.0, 2.0]]}, [], "x_test's sample shape must be x_train's (2, 4), got (2,)"),
    ({}, ["--loss", "cross_entropy"], "--loss cross_entropy needs integer class labels"),
    ({"y_train": [[0.0]] * 30, "y_test": [[0.0]] * 6}, ["--model", "m.py:three_outputs"],
     "model 'm.py:three_outputs' with loss mse must return 1 value(s) per sample (B = 2), got shape (2, 3)"),
])
def test_a_bad_npz_dataset_is_one_line(tmp_path, monkeypatch, capsys, arrays, argv, message):
    (tmp_path / "m.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    data = _npz(tmp_path / "d.npz", **arrays)
    argv = ["probe", "--model", "layer-affine", "--data", data, "--loss", "mse", *argv, "--batch-sizes", "4",
            "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_npz_of_class_labels_loads_as_labels(tmp_path):
    import numpy as np
    import torch

    from affdiv.experiments.data.npz import load_npz

    labels = np.array([0, 2, 1, 2] * 5, dtype=np.uint8)
    data = load_npz(_npz(tmp_path / "c.npz", x_train=np.ones((20, 1, 3, 3), dtype=np.float32), y_train=labels,
                         x_test=np.zeros((2, 1, 3, 3)), y_test=np.array([4, 0])))
    assert data.labels and data.num_classes == 5 and data.input_shape == (1, 3, 3)  # 0..4: the test split's 4 too
    assert data.train.y.dtype == torch.int64 and data.train.x.dtype == torch.float32 and len(data.train) == 20
    with pytest.raises(ValueError, match=r"y_train as class labels must be integers >= 0 of shape \(N,\), got shape"):
        load_npz(_npz(tmp_path / "n.npz", y_train=-np.ones(30, dtype=int), y_test=np.zeros(6, dtype=int)))

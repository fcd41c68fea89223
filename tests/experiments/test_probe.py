"""`affdiv probe`: the divergence meter on real data behaves as the derivations say it must."""

import json
import math

import pytest

from affdiv import cli
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.probe import aggregate, measure, parse_int_list


@pytest.fixture(scope="module")
def correlated():
    return load_dataset("synthetic", seed=0, n_train=600, n_test=50, features=12, classes=3, correlation=0.8)


def _by(rows):
    return {(r["model"], r["batch_size"]): r for r in aggregate(rows, ("model", "batch_size"))}


def test_corrections_equalise_the_diagonal_and_leave_the_cross_terms(correlated):
    models = ["layer-affine", "layer-affine_like", "layer-norm_l2"]
    rows, samples = measure(correlated, models, [1, 8, 64], seeds=[0, 1], batches=1, scope="layer")
    by = _by(rows)
    for model in ("layer-affine_like", "layer-norm_l2"):
        # K_ii is constant for the corrections: the spread is rounding only (float64, ~1e-16)
        assert by[(model, 64)]["diagonal_scale_cv"] < 1e-12
        assert by[(model, 64)]["diagonal_norm_correlation"] is None  # nothing to correlate
    assert by[("layer-affine_like", 64)]["diagonal_scale_mean"] == pytest.approx(1.0, abs=1e-12)
    assert by[("layer-norm_l2", 64)]["diagonal_scale_mean"] == pytest.approx(2.0, abs=1e-12)
    assert by[("layer-affine", 64)]["diagonal_scale_cv"] > 1e-3  # ‖x‖² + 1 varies from sample to sample
    assert by[("layer-affine", 64)]["diagonal_norm_correlation"] > 0.9
    for model in models:
        assert by[(model, 1)]["off_diagonal_share_mean"] < 1e-12  # no other sample: rounding only
        assert by[(model, 1)]["cosine_mean"] == pytest.approx(1.0, abs=1e-12)
        # correlated inputs: the cross-sample part grows with the batch
        assert by[(model, 64)]["off_diagonal_share_median"] > by[(model, 8)]["off_diagonal_share_median"] > 0
    scatter = {s["model"]: s for s in samples}
    assert set(scatter) == set(models) and all(len(s["input_norm"]) == 64 for s in samples)


def test_network_scope_of_a_one_layer_model_is_its_layer_scope(correlated):
    kwargs = dict(seeds=[0], batches=1)
    layer, _ = measure(correlated, ["layer-affine"], [16], scope="layer", **kwargs)
    network, _ = measure(correlated, ["layer-affine"], [16], scope="network", **kwargs)
    for metric in ("scale_mean", "diagonal_scale_mean", "off_diagonal_share_mean", "cosine_mean"):
        assert network[0][metric] == pytest.approx(layer[0][metric], rel=1e-10)


def test_the_interval_is_over_seeds():
    rows = [{"model": "m", "layer": "0", "kind": "Linear", "batch_size": 8, "seed": s, "batch": b,
             "cosine_mean": v} for s, b, v in [(0, 0, 0.1), (0, 1, 0.3), (1, 0, 0.6), (2, 0, 0.5)]]
    (row,) = aggregate(rows, ("model", "layer", "batch_size"))
    assert row["seeds"] == 3 and row["cosine_mean"] == pytest.approx((0.2 + 0.6 + 0.5) / 3)
    low, high = row["cosine_mean_ci"]
    assert low < row["cosine_mean"] < high and (high - low) / 2 == pytest.approx(
        4.302652729911275 * math.sqrt(((0.2 - 13 / 30) ** 2 + (0.6 - 13 / 30) ** 2 + (0.5 - 13 / 30) ** 2) / 2 / 3))
    (one,) = aggregate(rows[:2], ("model", "layer", "batch_size"))
    assert one["cosine_mean_ci"] is None and one["scale_mean"] is None


def test_probe_command_writes_its_reports(tmp_path):
    status = cli.main(
        ["probe", "--model", "mlp-affine_like,cnn-patchnorm,transformer-qknorm", "--data", "digits",
         "--batch-sizes", "4,8", "--seeds", "2", "--batches", "1", "--out", str(tmp_path)]
    )
    assert status == 0
    record = json.loads((tmp_path / "probe.json").read_text(), parse_constant=pytest.fail)  # no NaN/inf
    assert record["schema_version"] == 2 and record["scope"] == "layer" and record["batch_sizes"] == [4, 8]
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
    (["--model", "no.such.module:f"], "cannot import 'no.such.module'"),
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


def test_batch_sizes_parse():
    assert parse_int_list("512, 8,32,8", "--batch-sizes") == [8, 32, 512]
    with pytest.raises(ValueError, match="comma-separated positive integers"):
        parse_int_list("8;32", "--batch-sizes")


def test_every_built_in_model_is_measured_whole_in_both_scopes():
    import torch
    import torch.nn.functional as F

    from affdiv.experiments.runs import zoo
    from affdiv.verify import divergence

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

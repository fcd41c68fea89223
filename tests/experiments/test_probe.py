"""`affdiv probe`: the mechanism measurements behave as the derivations say they must."""

import json

import pytest

from affdiv import cli
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.probe import run_probe


@pytest.fixture(scope="module")
def correlated():
    return load_dataset("synthetic", seed=0, n_train=600, n_test=50, features=12, classes=3, correlation=0.8)


def test_corrections_equalise_the_diagonal_and_leave_the_cross_terms(correlated):
    rows = run_probe(correlated, ["affine", "affine_like", "norm_l2"], [1, 8, 64], repeats=2, seed=0)
    by = {(r["member"], r["batch_size"]): r for r in rows}
    for member in ("affine_like", "norm_l2"):
        # K_ii is constant for the corrections: the spread is rounding only (float64, ~1e-16)
        assert by[(member, 64)]["diagonal_scale_cv"] < 1e-12
    assert by[("affine", 64)]["diagonal_scale_cv"] > 1e-3  # ‖x‖² + 1 varies from sample to sample
    for member in ("affine", "affine_like", "norm_l2"):
        assert by[(member, 1)]["off_diagonal_share"] < 1e-12  # no other sample: rounding only
        assert by[(member, 1)]["cosine"] == pytest.approx(1.0, abs=1e-12)
        # correlated inputs: the cross-sample part grows with the batch
        assert by[(member, 64)]["off_diagonal_share"] > by[(member, 8)]["off_diagonal_share"] > 0


def test_probe_command_writes_its_reports(tmp_path):
    status = cli.main(
        ["probe", "--dataset", "digits", "--members", "affine_like", "--batch-sizes", "2", "4",
         "--repeats", "2", "--out", str(tmp_path)]
    )
    assert status == 0
    record = json.loads((tmp_path / "probe.json").read_text())
    assert [r["batch_size"] for r in record["rows"]] == [2, 4]
    assert record["provenance"]["data_fingerprint"]
    assert (tmp_path / "probe.png").stat().st_size > 0 and "| affine_like | 4 |" in (tmp_path / "probe.md").read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # every file written whole (temporary sibling, then renamed)


def test_batch_larger_than_the_data_is_refused(correlated):
    with pytest.raises(ValueError, match="exceeds the"):
        run_probe(correlated, ["affine"], [10_000], repeats=1, seed=0)

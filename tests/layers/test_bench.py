"""`affdiv bench layers --quick` runs end to end and writes valid JSON (timings are never asserted);
the median ratios' confidence intervals and the verdicts built on them."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from affdiv.cli import main
from affdiv.layers import PatchNormConv2d, _native, benchmark


def test_bench_layers_quick_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(["bench", "layers", "--quick", "--repeats", "2", "--warmup", "0", "--threads", "1",
                   "--compile-backend", "eager", "--json", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "AffineLike" in printed and "ratio" in printed
    result = json.loads(out.read_text())
    assert result["config"]["quick"] is True and result["provenance"]["package"] == "affdiv"
    assert (result["config"]["repeats"], result["config"]["warmup"]) == (2, 0)  # 0 is not "the default"
    layers = {row["layer"] for row in result["rows"]}
    on_python = {"AffineLike (Python Function)", "NormLike(l2) (Python Function)",  # where the C++ nodes are built
                 "PatchNormConv2d (Python Function)"}
    assert layers == {"AffineLike", "NormLike(l2)", "NormLike(rms)", "PatchNormConv2d", "PatchNormConv2d(recompute)",
                      "nn.Linear+Python Function"} | (on_python if _native.available() else set())
    assert all(row["target"] is None for row in result["rows"] if row["layer"] in on_python)
    assert result["config"]["cpp_autograd_nodes"] == _native.available()
    assert {row["case"] for row in result["rows"] if row["layer"] == "nn.Linear+Python Function"} == {
        "per call: dense B=2 8->4, 1 thread"}  # the floor of a Python Function, in the per-call dense cases only
    assert all(row["target"] is None for row in result["rows"] if row["layer"] == "PatchNormConv2d(recompute)")
    assert {row["case"] for row in result["rows"] if row["layer"] == "PatchNormConv2d"} == {
        "conv N=2 4->4 8x8 k=3 pad=1", "conv N=2 4->4 8x8 k=3 pad=1 channels_last",
        "per call: conv N=2 3->4 6x6 k=3, 1 thread"}
    per_call = [row for row in result["rows"] if row["case"].startswith("per call")]
    assert {row["layer"] for row in per_call} == layers and all(row["target"] is None for row in per_call)
    assert not any("compiled" in row["baseline"] for row in per_call)  # information only, nothing compiled
    assert result["config"]["overhead_calls_per_round"] == 5
    for row in result["rows"]:
        assert row["ratio"] > 0 and row["layer_ms"] > 0 and row["baseline_ms"] > 0
        assert row["met"] is None or row["met"] == (row["ratio"] <= row["target"])
        assert row["ratio_ci95"] is None and row["resolved"] is None  # 2 rounds: no interval
    assert "too few rounds for a CI" in printed


@pytest.mark.parametrize("option, value, minimum", [("--repeats", "0", 1), ("--warmup", "-1", 0),
                                                    ("--threads", "0", 1), ("--repeats", "2.5", 1)])
def test_bench_layers_rejects_bad_round_counts(option, value, minimum, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "layers", "--quick", option, value])
    assert info.value.code == 2
    assert f"expected an int >= {minimum}, got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("repeats, warmup", [(0, 1), (1, -1)])
def test_benchmark_run_rejects_bad_round_counts(repeats, warmup):
    with pytest.raises(ValueError, match=f"expected repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                                         f"warmup={warmup}"):
        benchmark.run(quick=True, repeats=repeats, warmup=warmup)


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, padding=1), dict(kernel_size=5, padding=2),
                                    dict(kernel_size=3, stride=2, dilation=2, padding=(1, 2), groups=2),
                                    dict(kernel_size=(3, 1), padding="same", padding_mode="reflect", groups=4)])
def test_naive_patchnorm_baseline_computes_the_layer(kwargs):
    # the baseline the benchmark compiles must compute what the layer does, for any geometry;
    # float64, the same closed form in another order of operations: a few ulp of O(1) outputs
    layer = PatchNormConv2d(4, 8, dtype=torch.float64, **kwargs)
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    naive = benchmark._Naive(layer, "patchnorm")
    torch.testing.assert_close(naive(x), layer(x), rtol=1e-12, atol=1e-12)


def test_the_plain_layer_target_applies_to_affine_like_only_where_given():
    variants = benchmark.dense_variants(4, 4, "eager")
    times = {v.name: [1.0, 1.0] for v in variants}
    times["AffineLike"] = [1.04, 1.06]  # paired ratios 1.04, 1.06: median 1.05, met at <= 1.05
    for target in (None, 1.05):
        rows = benchmark.summarise("case", variants, times, plain_target=target)
        vs_plain = {r["layer"]: r for r in rows if r["baseline"] == "nn.Linear"}
        assert vs_plain["AffineLike"]["target"] == target
        assert vs_plain["AffineLike"]["met"] is (None if target is None else True)
        assert vs_plain["NormLike(l2)"]["target"] is None


def _binomial_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 10, 25, 40])
def test_median_interval_is_the_binomial_order_statistic_interval(n):
    # the textbook construction, independently: the largest k with P(Bin(n, 1/2) <= k-1) <= 2.5%
    # gives [v_(k), v_(n+1-k)] (1-based order statistics)
    k = max(j for j in range(1, n + 1) if _binomial_cdf(j - 1, n) <= 0.025)
    values = [random.Random(n).lognormvariate(0, 0.05) for _ in range(n)]
    ordered = sorted(values)
    assert benchmark.median_interval(values) == (ordered[k - 1], ordered[n - k])


def test_median_interval_needs_six_rounds_at_95_percent():
    # P(Bin(5, 1/2) = 0) = 1/32 > 2.5%: even [min, max] of five rounds covers less than 95%
    assert benchmark.median_interval([1.0, 1.1, 0.9, 1.05, 0.95]) == (None, None)


def test_rows_say_whether_the_interval_resolves_the_target():
    variants = [benchmark.Variant("nn.Linear", None, "plain"),
                benchmark.Variant("Linear->LayerNorm", None, "composite"),
                benchmark.Variant("compiled naive AffineLike", None, "compiled"),
                benchmark.Variant("AffineLike", None, "layer")]
    times = {"nn.Linear": [1.0] * 9, "Linear->LayerNorm": [1.0, 1.2] * 4 + [1.0],
             "compiled naive AffineLike": [2.0] * 9, "AffineLike": [1.1] * 9}
    rows = {r["baseline"]: r for r in benchmark.summarise("case", variants, times, plain_target=1.05)}
    plain, composite, compiled = rows["nn.Linear"], rows["Linear->LayerNorm"], rows["compiled naive AffineLike"]
    assert (plain["ratio"], plain["met"], plain["resolved"]) == (1.1, False, True)  # 1.1 every round
    assert composite["ratio"] == 1.1 and composite["ratio_ci95"] == [1.1 / 1.2, 1.1]
    assert (composite["met"], composite["resolved"]) == (False, False)  # 1.0 lies inside the interval
    assert (compiled["ratio"], compiled["met"], compiled["resolved"]) == (0.55, True, True)
    table = benchmark.format_table(list(rows.values()))
    assert "<= 1.05 NOT met\n" in table + "\n" and "<= 1.00 NOT met (within noise)" in table


def test_the_python_function_reference_is_nn_linear_and_is_timed_against_it_without_a_target():
    variants = benchmark.dense_variants(5, 3, None, reference=True)
    reference = next(v for v in variants if v.role == "reference")
    linear = reference.module.layer
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    linear.double()
    out = reference.module(x)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_PythonIdentityBackward"
    grad = torch.randn(4, 3, dtype=torch.float64)
    (dx,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(out, linear(x), rtol=0, atol=0)  # the identity: bit for bit
    torch.testing.assert_close(dx, grad @ linear.weight, rtol=0, atol=0)
    times = {v.name: [1.0] * 6 for v in variants}
    times["nn.Linear+Python Function"] = [1.3] * 6
    rows = [r for r in benchmark.summarise("case", variants, times) if r["layer"] == "nn.Linear+Python Function"]
    assert [(r["baseline"], r["ratio"], r["target"]) for r in rows] == [("nn.Linear", 1.3, None)]
    assert not any(v.role == "reference" for v in benchmark.dense_variants(5, 3, None))

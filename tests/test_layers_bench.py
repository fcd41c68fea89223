"""`affdiv bench layers --quick` runs end to end and writes valid JSON (timings are never asserted)."""

from __future__ import annotations

import json

from affdiv.cli import main


def test_bench_layers_quick_writes_a_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(["bench", "layers", "--quick", "--repeats", "2", "--threads", "1",
                   "--compile-backend", "eager", "--json", str(out)])
    assert status == 0
    printed = capsys.readouterr().out
    assert "AffineLike" in printed and "ratio" in printed
    result = json.loads(out.read_text())
    assert result["config"]["quick"] is True and result["provenance"]["package"] == "affdiv"
    layers = {row["layer"] for row in result["rows"]}
    assert layers == {"AffineLike", "NormLike(l2)", "NormLike(rms)", "PatchNormConv2d"}
    for row in result["rows"]:
        assert row["ratio"] > 0 and row["layer_ms"] > 0 and row["baseline_ms"] > 0
        assert row["met"] is None or row["met"] == (row["ratio"] <= row["target"])

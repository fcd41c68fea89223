"""The verdict map: every pair at every target of ladder studies, read from their summary.json,
the primary target marked, written between the markers of a hand-written Markdown file."""

import json

import pytest

from affdiv.cli import main
from affdiv.experiments.report.verdict_map import BEGIN, END, read_study, verdict_map, write_into


def _ratio(ratio, low, high, kind):
    return {"status": "ok", "ratio": ratio, "ci_low": low, "ci_high": high, "class": kind, "p": 0.01}


def _study(tmp_path, name, primary, by_target, trend=None):
    """A planted summary.json: ``by_target`` {target text: (ratio dict or None)} for the one pair
    affine_like / affine."""
    content = {t: {"critical_batch": {"affine_like": {"n_seeds": 12}, "affine": {"n_seeds": 12}},
                   "ratios": {"affine_like": {"affine": r or {"status": "no ratio: too few batch sizes",
                                                           "class": "unclear"}}}}
               for t, r in by_target.items()}
    summary = {"design": "steps_to_target", "primary_target": primary, "by_target": content,
               "trends": {"affine_like": {"affine": trend or {"status": "no trend"}}},
               **content[repr(primary)]}
    folder = tmp_path / name
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "ratio_vs_target.png").write_bytes(b"png")
    return folder


def test_each_pair_is_a_row_each_target_a_column_and_the_primary_is_bold(tmp_path):
    mlp = _study(tmp_path, "mlp-ladder", 0.84, {
        "0.8": _ratio(0.9, 0.7, 1.2, "unclear"), "0.84": _ratio(0.81, 0.7, 0.94, "smaller_within_margin")},
        trend={"status": "ok", "factor": 0.97, "factor_ci_low": 0.94, "factor_ci_high": 1.01})
    cnn = _study(tmp_path, "cnn-ladder", 0.6, {"0.5": _ratio(1.04, 0.88, 1.22, "equivalent"), "0.6": None})
    text = verdict_map([(mlp, read_study(mlp)), (cnn, read_study(cnn))], relative_to=tmp_path)
    lines = text.splitlines()
    assert lines[0] == "| study | pair (corrected / baseline) | 0.5 | 0.6 | 0.8 | 0.84 | trend per 0.01 |"
    assert lines[2] == ("| mlp-ladder | affine_like / affine | — | — | 0.9 [0.7, 1.2] unclear "
                        "| **0.81 [0.7, 0.94] smaller_within_margin** | ×0.97 [0.94, 1.01] |")
    assert lines[3] == "| cnn-ladder | affine_like / affine | 1.04 [0.88, 1.22] equivalent | — | — | — | — |"
    assert "[ratio_vs_target.png](mlp-ladder/ratio_vs_target.png)" in text
    assert "bcrit_vs_target.png" not in text  # a figure the folder lacks is not linked


def test_the_map_replaces_only_what_lies_between_its_markers(tmp_path, capsys):
    study = _study(tmp_path, "s", 0.84, {"0.84": _ratio(0.5, 0.4, 0.6, "smaller")})
    document = tmp_path / "VERDICTS.md"
    document.write_text(f"# Verdicts\nbefore\n{BEGIN}\nold map\n{END}\nafter\n")
    assert main(["map", str(study), "--into", str(document)]) == 0
    text = document.read_text()
    assert text.startswith(f"# Verdicts\nbefore\n{BEGIN}\n| study |") and text.endswith(f"{END}\nafter\n")
    assert "old map" not in text and "**0.5 [0.4, 0.6] smaller**" in text
    first = text
    assert main(["map", str(study), "--into", str(document)]) == 0
    assert document.read_text() == first  # idempotent
    document.write_text("# Verdicts without markers\n")
    assert main(["map", str(study), "--into", str(document)]) == 2
    assert "needs one line" in capsys.readouterr().err
    assert document.read_text() == "# Verdicts without markers\n"


def test_a_study_without_a_ladder_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "fixed"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"design": "fixed budget"}))
    assert main(["map", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "not a steps-to-target study along a target ladder" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(FileNotFoundError, match="no summary.json"):
        read_study(tmp_path / "missing")
    with pytest.raises(ValueError, match="needs one line"):
        write_into(folder / "summary.json", "x")


def test_the_committed_verdicts_file_has_a_place_for_the_map():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "results" / "VERDICTS.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)

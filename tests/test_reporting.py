"""affdiv.reporting: JSON without NaN/inf, the provenance block, LaTeX that compiles and fits, HTML tables."""

import json
import math

import pytest

from affdiv import reporting
from affdiv.reporting import MIDRULE, Column, Latex, Subheading

PROVENANCE = {"version": "0.1.0", "git_commit": "a" * 40, "git_dirty": True, "git_source": "checkout",
              "time_utc": "2026-12-01T00:00:00+00:00", "command": "affdiv verify --latex x.tex\n--only 100%_a"}


# ------------------------------------------------------------------------------------------ JSON
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_write_json_refuses_nonfinite_naming_the_key_path_and_writes_nothing(tmp_path, bad):
    path = tmp_path / "r.json"
    record = {"checks": [{"errors": {"linear": 1e-16}}, {"errors": {"ntk": bad}}], "ok": [1.0, 2.0]}
    with pytest.raises(ValueError, match=r"checks\[1\]\.errors\.ntk") as caught:
        reporting.write_json(path, record)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    assert not path.exists() and not list(tmp_path.iterdir())


def test_write_json_counts_further_offenders_and_quotes_odd_keys():
    with pytest.raises(reporting.NonFiniteError, match=r'\$|a\["odd key"\]\[0\] \(and 1 more\)'):
        reporting.to_json({"a": {"odd key": [math.nan, math.inf]}})


def test_write_json_writes_finite_records_atomically(tmp_path):
    path = tmp_path / "sub" / "r.json"
    record = {"x": [1.5, None, "η"], "n": 3}
    assert reporting.write_json(path, record) == path
    assert json.loads(path.read_text(encoding="utf-8")) == record
    assert path.read_text(encoding="utf-8").endswith("\n") and "η" in path.read_text(encoding="utf-8")
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temporary left behind


def test_nonfinite_to_null_lists_what_it_replaced():
    clean, found = reporting.nonfinite_to_null({"max": math.inf, "e": {"ntk": math.nan}, "v": [1.0, -math.inf]})
    assert clean == {"max": None, "e": {"ntk": None}, "v": [1.0, None]}
    assert found == {"max": "inf", "e.ntk": "nan", "v[1]": "-inf"}
    reporting.to_json(clean)  # now valid JSON


# ------------------------------------------------------------------------------------ provenance
def test_provenance_line_names_version_commit_and_dirty_flag():
    line = reporting.provenance_line(PROVENANCE)
    assert line.startswith("affdiv 0.1.0, commit " + "a" * 40) and "uncommitted changes" in line
    clean = reporting.provenance_line({**PROVENANCE, "git_dirty": False, "git_source": "build"})
    assert "uncommitted" not in clean and "(build)" in clean
    assert "no git commit" in reporting.provenance_line({"version": "0.1.0", "git_commit": None})


def test_provenance_renderings():
    md = reporting.provenance_markdown(PROVENANCE)
    assert md.startswith("## Provenance\n") and "```json" in md and '"git_dirty": true' in md
    html = reporting.provenance_html({**PROVENANCE, "command": "<script>"})
    assert html.startswith('<details class="provenance"><summary>') and " open" not in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    tex = reporting.provenance_latex(PROVENANCE, what="a table")
    assert all(line.startswith("% ") for line in tex.splitlines())  # a newline in the command stays a comment
    assert "100%_a" in tex and r"\usepackage{booktabs,tabularx}" in tex


# ----------------------------------------------------------------------------------------- LaTeX
def test_latex_escape_specials_unicode_and_minus_signs():
    assert reporting.latex_escape(r"a_b%c&d$e#f{g}h~i^j\k") == (
        r"a\_b\%c\&d\$e\#f\{g\}h\textasciitilde{}i\textasciicircum{}j\textbackslash{}k"
    )
    assert reporting.latex_escape("-0.012") == "$-$0.012"
    assert reporting.latex_escape("[-0.5, -.2]") == "[$-$0.5, $-$.2]"
    assert reporting.latex_escape("norm-l2 x-1 1e-05") == "norm-l2 x-1 1e-05"  # hyphens, not signs
    assert reporting.latex_escape("a − b — c ≤ η") == r"a $-$ b --- c $\le$ $\eta$"


def test_latex_numbers_use_real_minus_signs_and_powers_of_ten():
    assert reporting.latex_number(-0.0123) == "$-0.0123$"
    assert reporting.latex_number(-1.5e-7) == r"$-1.5\times10^{-7}$"
    assert reporting.latex_sci(1.23e-16) == r"$1.2\times10^{-16}$"
    assert reporting.latex_sci(1e-10) == r"$10^{-10}$"
    assert reporting.latex_sci(0.0) == "$0$"
    assert reporting.latex_number(None) == "---"
    assert reporting.latex_number(math.inf) == r"$\infty$" and reporting.latex_number(math.nan) == "NaN"
    assert reporting.latex_cell(-3) == "$-3$" and reporting.latex_cell(7) == "7"


def test_latex_identifier_may_break_after_underscores():
    assert reporting.latex_identifier("a_b") == r"a\_\allowbreak{}b"


def _wide_table() -> str:
    columns = [Column("Name", "X"), Column("Slope", "r"), Column("95% CI"), Column("Verdict\nof the rule")]
    rows = [Subheading("lr_rule = sqrt"),
            ["residual_affine_like_on_affine_like " * 3, -0.0123, "[-0.05, 0.01]", "inconclusive"],
            MIDRULE, Subheading("lr_rule = tuned"), ["affine", 0.5, "[0.1, 0.9]", Latex(r"\textbf{supported}")]]
    return reporting.latex_table(columns, rows, notes="Slope: accuracy points per doubling; − is a fall.",
                                 head=reporting.provenance_latex(PROVENANCE, what="test"))


def test_latex_table_shape():
    tex = _wide_table()
    assert r"\begin{tabularx}{\linewidth}" in tex and r"\toprule" in tex and tex.count(r"\midrule") == 2
    assert "$-0.0123$" in tex and "[$-$0.05, 0.01]" in tex and r"95\% CI" in tex
    assert tex.rstrip().endswith(r"\end{tabularx}}%")  # no stray space after the table
    assert r"\multicolumn{4}{@{}l@{}}{\emph{lr\_rule = tuned}} \\" in tex
    with pytest.raises(ValueError, match="2 cells, expected 4"):
        reporting.latex_table([Column("a")] * 4, [["x", "y"]])
    with pytest.raises(ValueError, match="align"):
        Column("a", "p").spec()
    assert r"\begin{tabular}{@{}lr@{}}" in reporting.latex_table([Column("a"), Column("b", "r")], [["x", 1]])


@pytest.mark.parametrize("font", [r"\small", r"\normalsize"])
def test_latex_table_compiles_and_fits_the_page(latex_page, tmp_path, font):
    measure = latex_page(_wide_table(), tmp_path, font=font)
    assert measure.fits, measure.describe()
    assert abs(measure.width_pt - measure.linewidth_pt) < 0.01  # tabularx: exactly the line


def test_the_width_check_sees_a_table_that_is_too_wide(latex_page, tmp_path):
    too_wide = reporting.latex_table([Column(f"column {i}") for i in range(12)], [[f"value {i}" for i in range(12)]])
    measure = latex_page(too_wide, tmp_path)
    assert not measure.fits and measure.excess_pt > 100 and measure.overfull


# ------------------------------------------------------------------------------------------ HTML
def test_html_table_scrolls_wraps_and_puts_verdicts_first():
    table = reporting.html_table(["method", "slope", "verdict"], [["a<b", 0.5, "supported"], ["c", None, "—"]],
                                 first=["verdict"])
    assert table.startswith('<div class="table-scroll"><table>')
    assert table.index(">verdict<") < table.index(">method<") and "a&lt;b" in table and "<td>—</td>" in table
    assert ".table-scroll{overflow-x:auto" in reporting.HTML_STYLE and "white-space:nowrap" in reporting.HTML_STYLE
    prose = "the fit ended on the edge of the search range: a bound, no CI"
    wide = reporting.html_table(["reason", "B_crit"], [[prose, "1.63e+04"]])
    assert f'<td class="prose">{prose}</td>' in wide and "<td>1.63e+04</td>" in wide  # only prose wraps
    assert "<b>x</b>" in reporting.html_table(["a"], [[reporting.Markup("<b>x</b>")]])
    with pytest.raises(ValueError, match="no column"):
        reporting.reorder(["a"], [], first=["b"])


# ------------------------------------------------------------------------------ the bench JSON
def test_bench_json_writes_nonfinite_ratios_as_null_and_lists_them(tmp_path):
    from affdiv.layers import benchmark

    result = {"config": {"threads": 2}, "medians_ms": {"case": {"nn.Linear": 0.0}},
              "rows": [{"case": "case", "ratio": math.inf, "ratio_ci95": [math.nan, 1.0]}]}
    path = benchmark.write_result(tmp_path / "bench.json", result, {"version": "0.1.0", "git_commit": None})
    written = json.loads(path.read_text())
    assert written["rows"][0]["ratio"] is None and written["rows"][0]["ratio_ci95"] == [None, 1.0]
    assert written["nonfinite"] == {"rows[0].ratio": "inf", "rows[0].ratio_ci95[0]": "nan"}
    assert written["provenance"]["version"] == "0.1.0"


def test_json_ready_turns_numpy_scalars_and_non_finite_floats_into_json():
    import json

    import numpy as np

    from affdiv.reporting import json_ready

    value = {1: (np.float64(0.5), np.int64(3), np.bool_(True)), "x": [float("inf"), np.float32("nan"), 2.0]}
    ready = json_ready(value)
    assert ready == {"1": [0.5, 3, True], "x": [None, None, 2.0]}
    assert type(ready["1"][1]) is int and type(ready["1"][2]) is bool
    json.dumps(ready, allow_nan=False)

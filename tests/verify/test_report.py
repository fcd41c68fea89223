"""verify's reports say exactly what was shown: proof words, labelled LaTeX columns, no NaN/inf in JSON,
and a verify.tex that compiles and fits a one-column page."""

import json
import math

import pytest

from affdiv import cli, reporting
from affdiv.theory.derivation import Derivation, Proof, ProofKind
from affdiv.verify import report
from affdiv.verify.checks import CheckResult

PROVENANCE = {"version": "0.1.0", "git_commit": "c" * 40, "git_dirty": False, "git_source": "checkout",
              "time_utc": "2026-12-01T00:00:00+00:00", "command": "affdiv verify", "seeds": [0]}


def _derivation(name: str, *steps: Proof) -> Derivation:
    return Derivation(name=name, layer="z = f(x)", statement=r"\Delta z = 0", build=None, predict=None,
                      proofs=lambda: list(steps), sizes=({"batch": 2},))


SYMBOLIC = Proof("general", ProofKind.SYMBOLIC_GENERAL, True, "sympy matrix calculus, residual expands to 0")
EXACT = Proof("at sizes", ProofKind.EXACT_CONCRETE, True, "exact differentiation at B=2, m=2, n=2")
CORROBORATING = Proof("again", ProofKind.EXACT_CONCRETE, True, "exact at B=1", corroborates=True)
NUMERIC = Proof("second order", ProofKind.NUMERIC_ONLY, True, "nested forward-mode AD")
FAILING = Proof("general", ProofKind.SYMBOLIC_GENERAL, False, "residual expands to x")

DERIVATIONS = [
    _derivation("affine", SYMBOLIC, CORROBORATING),
    _derivation("residual_tanh", EXACT),
    _derivation("attention", SYMBOLIC, EXACT, NUMERIC),
    _derivation("broken", FAILING),
    _derivation("residual_affine_like_on_affine_like", EXACT),
]


def _check(derivation: str, check: str, err: float, *, tol: float = 1e-10, passed: bool = True, **errors):
    return CheckResult(name=f"{derivation}/{check}", derivation=derivation, check=check, sizes={"batch": 2},
                       seed=0, lr=0.1, tol=tol, passed=passed, max_rel_err=err, errors=errors or {"linear": err})


CHECKS = [
    _check("affine", "update", 4e-16), _check("affine", "diagonal", 3e-16), _check("affine", "linearity", 2e-16),
    _check("residual_tanh", "update", 3.8e-16),
    _check("residual_tanh", "taylor", 0.029, tol=0.1, slope_first_order=2.029),
    _check("attention", "update", 1.3e-15),
    _check("attention", "taylor", math.inf, tol=0.1, passed=False, points_above_rounding=2.0),
    _check("broken", "update", 0.5, passed=False),
    _check("residual_affine_like_on_affine_like", "update", 6.7e-16),
    _check("residual_affine_like_on_affine_like", "site_diagonal", 1e-16),
    _check("residual_affine_like_on_affine_like", "taylor", 0.016, tol=0.1, slope_first_order=math.nan),
]


@pytest.fixture(scope="module")
def record():
    return report.build_record(DERIVATIONS, CHECKS, PROVENANCE)


def test_proof_status_reserves_proven_for_symbolic_proofs_at_general_size(record):
    status = {d["name"]: (d["proof_status"], d["proven"], d["steps_hold"]) for d in record["derivations"]}
    assert status == {
        "affine": ("proven", True, True),  # a corroborating exact step does not weaken it
        "residual_tanh": ("exact_at_sizes", False, True),
        "attention": ("numerical", False, True),
        "broken": ("failed", False, False),
        "residual_affine_like_on_affine_like": ("exact_at_sizes", False, True),
    }
    tanh = next(d for d in record["derivations"] if d["name"] == "residual_tanh")
    assert tanh["exact_at"] == ["B=2, m=2, n=2"] and tanh["shown"].startswith("exact at sizes B=2, m=2, n=2")
    assert record["summary"]["derivations"] == {"proven": 1, "exact_at_sizes": 2, "numerical": 1, "failed": 1}
    assert report.proof_summary(record) == (
        "1 with a failing proof step, 1 proven, 2 exact at concrete sizes, 1 checked numerically")


def test_markdown_headings_use_the_proof_words(record):
    md = report.to_markdown(record)
    headings = [line for line in md.splitlines() if line.startswith("### ")]
    assert headings == [
        "### `affine` — proven",
        "### `residual_tanh` — exact at concrete sizes",
        "### `attention` — checked numerically",
        "### `broken` — NOT SHOWN: a proof step fails",
        "### `residual_affine_like_on_affine_like` — exact at concrete sizes",
    ]
    assert "Shown: exact at sizes B=2, m=2, n=2 (not a proof at general size)." in md
    assert "| `attention/taylor` |" in md and "points_above_rounding 2" in md
    assert "slope_first_order NaN" in md  # a non-finite value is shown, from the record's null + nonfinite
    assert "## Provenance" in md and "commit " + "c" * 40 in md


def test_json_holds_no_nonfinite_number_and_lists_where_it_was(record, tmp_path):
    text = report.to_json(record)
    assert "Infinity" not in text and "NaN" not in text
    loaded = json.loads(text)
    assert loaded["schema_version"] == 2
    attention = next(c for c in loaded["checks"] if c["name"] == "attention/taylor")
    assert attention["max_rel_err"] is None and attention["nonfinite"] == {"max_rel_err": "inf"}
    nan = next(c for c in loaded["checks"] if c["name"] == "residual_affine_like_on_affine_like/taylor")
    assert nan["errors"]["slope_first_order"] is None and nan["nonfinite"] == {"errors.slope_first_order": "nan"}
    assert "nonfinite" not in loaded["checks"][0]
    path = reporting.write_json(tmp_path / "verify.json", record)
    assert json.loads(path.read_text()) == loaded


def test_to_json_refuses_a_record_built_around_the_cleaning(record):
    broken = {**record, "summary": {**record["summary"], "rate": math.inf}}
    with pytest.raises(ValueError, match=r"verify\.json: non-finite number inf at summary\.rate"):
        report.to_json(broken)


def test_latex_labels_its_columns_and_uses_the_proof_words(record):
    tex = report.to_latex(record)
    assert r"Derivation & Check & Cases & Quantity & Worst & Tol. & Result \\" in tex
    assert "Max." not in tex  # the taylor rows' |slope − 2| is no longer called an error
    taylor = [line for line in tex.splitlines() if "Taylor order" in line]
    assert len(taylor) == 3 and all(r"$|$slope$-$order$|$" in line for line in taylor)
    assert all(r"rel.\ error" in line for line in tex.splitlines() if "& update &" in line)
    assert r"\emph{proven}" in tex and r"\emph{exact at fixed sizes}" in tex and r"\emph{checked numerically}" in tex
    assert r"\emph{PROOF FAILED}" in tex and r"\textbf{FAIL}" in tex and r"$\infty$" in tex
    assert tex.count(r"\emph{proven}") == 1  # "proven" for the symbolic proof only
    assert tex.startswith("% affdiv verification table") and "% affdiv 0.1.0, commit " + "c" * 40 in tex
    assert "−" not in tex and "—" not in tex  # no Unicode that pdflatex cannot set


@pytest.mark.parametrize("font", [r"\small", r"\normalsize"])
def test_verify_tex_compiles_and_fits_a_one_column_page(record, latex_page, tmp_path, font):
    measure = latex_page(report.to_latex(record), tmp_path, font=font)
    assert measure.fits, measure.describe()


def test_verify_tex_of_a_real_run_fits(latex_page, tmp_path):
    tex = tmp_path / "verify.tex"
    assert cli.main(["verify", "--only", "affine", "residual_affine", "--seeds", "1", "--latex", str(tex)]) == 0
    text = tex.read_text()
    assert r"\emph{proven}" in text and "Taylor order" in text
    measure = latex_page(text, tmp_path / "build")
    assert measure.fits, measure.describe()

"""Writing verification results: JSON (the record), Markdown (to read), LaTeX (to \\input in a paper).

JSON schema (``schema_version`` 2):
    provenance   object: affdiv.provenance.provenance() — version, git_commit, git_dirty, git_source,
                 library versions, platform, time, seeds, wall_time_s
    derivations  list of {name, layer, statement (LaTeX), proof_kind, proof_status, shown, exact_at,
                          proven, steps_hold, proofs: [{claim, kind, holds, detail, corroborates}]}
                 proof_status: "proven" (symbolic proof at general size, every step holds),
                 "exact_at_sizes" (exact identities at concrete sizes), "numerical" (the weakest
                 essential step is numerical only) or "failed" (a proof step does not hold);
                 shown: the same in words; exact_at: the concrete sizes of the exact steps;
                 proven: proof_status == "proven"; steps_hold: every proof step holds.
    checks       list of {name, derivation, check, sizes, seed, lr, tol, passed, max_rel_err,
                          errors: {reference: error}, proof, detail, metrics[, nonfinite]}
                 A number that is not finite (a failed fit, an overflow) is written as null and
                 listed in the check's ``nonfinite``: {key path in the check: "inf"|"-inf"|"nan"}
                 (e.g. {"max_rel_err": "inf"}); ``detail`` says why. JSON never holds NaN/inf.
    summary      {total, passed, failed, derivations: {proven, exact_at_sizes, numerical, failed}}

Version 1 differed in ``proven`` (then: every step holds, whatever its kind) and could hold a bare
``Infinity``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from affdiv import reporting
from affdiv.theory.derivation import Derivation, ProofKind
from affdiv.verify import latex
from affdiv.verify.checks import CheckResult

SCHEMA_VERSION = 2

STATUS = {
    ProofKind.SYMBOLIC_GENERAL: "proven",
    ProofKind.EXACT_CONCRETE: "exact_at_sizes",
    ProofKind.NUMERIC_ONLY: "numerical",
}
STATUS_WORDS = {
    "proven": "proven",
    "exact_at_sizes": "exact at concrete sizes",
    "numerical": "checked numerically",
    "failed": "NOT SHOWN: a proof step fails",
}


def exact_sizes(derivation: Derivation) -> list[str]:
    """The concrete sizes of the derivation's exact (non-corroborating) proof steps, read from their
    details ("... at B=2, m=2, n=2"); several phrases of one step are separated by "; "."""
    sizes = []
    for step in derivation.proof_steps():
        if step.kind is ProofKind.EXACT_CONCRETE and not step.corroborates:
            for phrase in step.detail.split("; "):
                match = re.search(r"\bat (.+)$", phrase)
                if match:
                    sizes.append(match.group(1).strip())
    return sizes


def proof_status(derivation: Derivation) -> str:
    """"proven", "exact_at_sizes", "numerical" or "failed" (see the module docstring)."""
    if not all(p.holds for p in derivation.proof_steps()):
        return "failed"
    return STATUS[derivation.proof_kind]


def shown(derivation: Derivation) -> str:
    """What the proof steps establish, in words: "proven (symbolic, general size)", "exact at sizes
    B=2, m=2, n=2 (not a proof at general size)", "checked numerically (...)"."""
    status = proof_status(derivation)
    if status == "proven":
        return "proven (symbolic proof at general size)"
    if status == "exact_at_sizes":
        where = "; ".join(exact_sizes(derivation)) or "the concrete sizes of its proof steps"
        return f"exact at sizes {where} (not a proof at general size)"
    if status == "numerical":
        weakest = [p.claim for p in derivation.proof_steps()
                   if p.kind is ProofKind.NUMERIC_ONLY and not p.corroborates]
        return "checked numerically" + (f" (numerical only: {weakest[0]})" if weakest else "")
    failed = [p.claim for p in derivation.proof_steps() if not p.holds]
    return f"NOT SHOWN: proof step fails: {failed[0]}"


def derivation_record(derivation: Derivation) -> dict:
    status = proof_status(derivation)
    return {
        "name": derivation.name,
        "layer": derivation.layer,
        "statement": derivation.statement,
        "proof_kind": derivation.proof_kind.value,
        "proof_status": status,
        "shown": shown(derivation),
        "exact_at": exact_sizes(derivation) if status == "exact_at_sizes" else [],
        "proven": status == "proven",
        "steps_hold": all(p.holds for p in derivation.proof_steps()),
        "proofs": [
            {
                "claim": p.claim,
                "kind": p.kind.value,
                "holds": p.holds,
                "detail": p.detail,
                "corroborates": p.corroborates,
            }
            for p in derivation.proof_steps()
        ],
    }


def check_record(check: CheckResult) -> dict:
    """``check.to_dict()`` with every non-finite number as null, listed under ``nonfinite``."""
    record, nonfinite = reporting.nonfinite_to_null(check.to_dict())
    if nonfinite:
        record["nonfinite"] = nonfinite
    return record


def build_record(derivations: Iterable[Derivation], checks: Sequence[CheckResult], provenance: dict) -> dict:
    derivations = [derivation_record(d) for d in derivations]
    passed = sum(c.passed for c in checks)
    statuses = Counter(d["proof_status"] for d in derivations)
    return {
        "schema_version": SCHEMA_VERSION,
        "provenance": provenance,
        "derivations": derivations,
        "checks": [check_record(c) for c in checks],
        "summary": {"total": len(checks), "passed": passed, "failed": len(checks) - passed,
                    "derivations": {s: statuses.get(s, 0) for s in STATUS_WORDS}},
    }


def proof_summary(record: Mapping) -> str:
    """One line: "5 proven, 5 exact at concrete sizes, 1 checked numerically" (zero counts left out;
    "all ... " when one kind; a failed proof first)."""
    counts = record["summary"]["derivations"]
    words = {"failed": "with a failing proof step", **{k: v for k, v in STATUS_WORDS.items() if k != "failed"}}
    parts = [f"{counts[s]} {words[s]}" for s in ("failed", "proven", "exact_at_sizes", "numerical") if counts.get(s)]
    return ", ".join(parts) or "no derivations"


def to_json(record: dict) -> str:
    """The record as JSON; a NaN/inf left anywhere is an error naming its key path."""
    return reporting.to_json(record, what="verify.json")


def sizes_label(sizes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def _value(check: Mapping, *parts) -> float | str | None:
    """check[parts...], or its non-finite token ("inf", "nan") when it was written as null."""
    value = check
    for part in parts:
        value = value[part]
    if value is None:
        return check.get("nonfinite", {}).get(reporting.key_path(list(parts)))
    return value


def _fmt(key: str, value) -> str:
    if isinstance(value, str) or value is None:
        return {"inf": "∞", "-inf": "−∞", "nan": "NaN", None: "—"}.get(value, str(value))
    if key.startswith("points"):
        return f"{value:.0f}"
    if key.startswith(("slope", "removed")):
        return f"{value:.3f}"
    return f"{value:.2e}"


def format_row(check: CheckResult) -> str:
    """One fixed-width console line per check."""
    verdict = "PASS" if check.passed else "FAIL"
    errors = " ".join(f"{k}={_fmt(k, v)}" for k, v in check.errors.items())
    sizes = sizes_label(check.sizes)
    return f"{verdict}  {check.name:<28} seed={check.seed:<3} {sizes:<52} {errors}  tol={check.tol:.1e}"


def to_markdown(record: dict) -> str:
    prov = record["provenance"]
    summary = record["summary"]
    lines = [
        "# affdiv verification report",
        "",
        f"{summary['passed']} of {summary['total']} checks passed; derivations: {proof_summary(record)}. "
        f"({reporting.provenance_line(prov)})",
        "",
        "*Proven* means a symbolic proof at general size (sympy matrix calculus with symbolic sizes); *exact "
        "at concrete sizes* means exact identities (rational/algebraic arithmetic) at the sizes named, not a "
        "proof at general size; *checked numerically* means some essential step is established by float64 "
        "numerics only. Every derivation is also checked numerically below, whatever its proof.",
        "",
        "Errors are normwise relative, ‖predicted − measured‖∞ / ‖measured‖∞, in float64. References: "
        "`linear` = jvp after vjp (first order), `finite` = the real SGD step, `ntk` = −η Θ g with the empirical "
        "NTK; `taylor` rows give the fitted log-log slopes of the remainders (pass: |slope − 2| ≤ tol, and "
        "|slope − 3| ≤ tol after the η² term).",
        "",
        "## Derivations",
        "",
    ]
    for d in record["derivations"]:
        heading = STATUS_WORDS.get(d.get("proof_status"), d.get("proof_status"))
        lines += [f"### `{d['name']}` — {heading}", "", f"Shown: {d.get('shown', heading)}.", ""]
        lines += [f"$${d['statement']}$$", ""]
        for p in d["proofs"]:
            lines.append(
                f"- {'✔' if p['holds'] else '✘'} *{p['kind']}*{' (corroboration)' if p['corroborates'] else ''}: "
                f"{p['claim']} — {p['detail']}"
            )
        lines.append("")
    lines += [
        "## Checks",
        "",
        "| check | sizes | seed | values | tol | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in record["checks"]:
        errors = ", ".join(f"{k} {_fmt(k, _value(c, 'errors', k))}" for k in c["errors"])
        lines.append(
            f"| `{c['name']}` | {sizes_label(c['sizes'])} | {c['seed']} | {errors} | {c['tol']:.1e} | "
            f"{'PASS' if c['passed'] else '**FAIL**'} |"
        )
    lines += ["", reporting.provenance_markdown(prov).rstrip("\n"), ""]
    return "\n".join(lines)


def to_latex(record: dict) -> str:
    """verify.tex (:func:`affdiv.verify.latex.table`)."""
    return latex.table(record)


__all__ = ["SCHEMA_VERSION", "build_record", "check_record", "derivation_record", "format_row", "proof_status",
           "proof_summary", "shown", "sizes_label", "to_json", "to_latex", "to_markdown"]

"""Writing verification results: JSON (the record), Markdown (to read), LaTeX (to \\input in a paper).

JSON schema (``schema_version`` 1):
    provenance   object: package version, git commit, library versions, platform, time, seeds
    derivations  list of {name, layer, statement (LaTeX), proof_kind, proven,
                          proofs: [{claim, kind, holds, detail, corroborates}]}
    checks       list of {name, derivation, check, sizes, seed, lr, tol, passed, max_rel_err,
                          errors: {reference: error}, proof, detail, metrics}
    summary      {total, passed, failed}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

from affdiv.theory.derivation import Derivation
from affdiv.verify.checks import CheckResult
from affdiv.verify.latex import escape

SCHEMA_VERSION = 1


def derivation_record(derivation: Derivation) -> dict:
    return {
        "name": derivation.name,
        "layer": derivation.layer,
        "statement": derivation.statement,
        "proof_kind": derivation.proof_kind.value,
        "proven": derivation.proven,
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


def build_record(derivations: Iterable[Derivation], checks: Sequence[CheckResult], provenance: dict) -> dict:
    passed = sum(c.passed for c in checks)
    return {
        "schema_version": SCHEMA_VERSION,
        "provenance": provenance,
        "derivations": [derivation_record(d) for d in derivations],
        "checks": [c.to_dict() for c in checks],
        "summary": {"total": len(checks), "passed": passed, "failed": len(checks) - passed},
    }


def to_json(record: dict) -> str:
    return json.dumps(record, indent=2, sort_keys=False) + "\n"


def sizes_label(sizes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


def format_row(check: CheckResult) -> str:
    """One fixed-width console line per check."""
    verdict = "PASS" if check.passed else "FAIL"
    errors = " ".join(f"{k}={v:.2e}" for k, v in check.errors.items())
    return f"{verdict}  {check.name:<28} seed={check.seed:<3} {sizes_label(check.sizes):<52} {errors}  tol={check.tol:.1e}"


def to_markdown(record: dict) -> str:
    prov = record["provenance"]
    summary = record["summary"]
    lines = [
        "# affdiv verification report",
        "",
        f"{summary['passed']} of {summary['total']} checks passed "
        f"(affdiv {prov.get('version')}, commit {prov.get('git_commit') or 'n/a'}, {prov.get('time_utc')}).",
        "",
        "Errors are normwise relative, ‖predicted − measured‖∞ / ‖measured‖∞, in float64. References: "
        "`linear` = jvp after vjp (first order), `finite` = the real SGD step, `ntk` = −η Θ g with the empirical "
        "NTK; `taylor` rows give the fitted log-log slopes of the remainders (error = |slope − 2|, and |slope − 3| after the η² term).",
        "",
        "## Derivations",
        "",
    ]
    for d in record["derivations"]:
        lines += [f"### `{d['name']}` — {'proven' if d['proven'] else 'NOT PROVEN'} ({d['proof_kind']})", ""]
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
        "| check | sizes | seed | errors | tol | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in record["checks"]:
        errors = ", ".join(f"{k} {v:.2e}" for k, v in c["errors"].items())
        lines.append(
            f"| `{c['name']}` | {sizes_label(c['sizes'])} | {c['seed']} | {errors} | {c['tol']:.1e} | "
            f"{'PASS' if c['passed'] else '**FAIL**'} |"
        )
    lines += ["", "## Provenance", "", "```json", json.dumps(prov, indent=2), "```", ""]
    return "\n".join(lines)


def _sci(value: float) -> str:
    """1.2e-16 as $1.2\\times10^{-16}$."""
    if value == 0:
        return "$0$"
    if not math.isfinite(value):
        return r"$\infty$" if value > 0 else "NaN"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"${mantissa}\\times10^{{{int(exponent)}}}$"


def to_latex(record: dict) -> str:
    """A booktabs table, one row per derivation and check kind: the worst error and the tightest
    tolerance over sizes and seeds (taylor rows: |slope − expected| against the slope tolerance)."""
    worst: dict[tuple[str, str], dict] = {}
    for c in record["checks"]:
        key = (c["derivation"], c["check"])
        row = worst.setdefault(key, {"err": 0.0, "tol": c["tol"], "passed": True, "n": 0})
        row["err"] = max(row["err"], c["max_rel_err"])
        row["tol"] = min(row["tol"], c["tol"])
        row["passed"] &= c["passed"]
        row["n"] += 1
    proof = {d["name"]: d["proof_kind"] for d in record["derivations"]}
    prov = record["provenance"]
    lines = [
        "% affdiv verification table; generated by `affdiv verify --latex`, needs \\usepackage{booktabs}",
        f"% affdiv {prov.get('version')}, commit {prov.get('git_commit') or 'n/a'}, {prov.get('time_utc')}",
        r"\begin{tabular}{lllrrrl}",
        r"\toprule",
        r"Derivation & Proof & Check & Cases & Max.\ error & Min.\ tol. & Result \\",
        r"\midrule",
    ]
    for (name, check), row in worst.items():
        lines.append(
            f"{escape(name)} & {escape(proof.get(name, ''))} & {escape(check)} & {row['n']} & "
            f"{_sci(row['err'])} & {_sci(row['tol'])} & {'pass' if row['passed'] else 'FAIL'} \\\\"
        )
    lines += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(lines)

"""`affdiv verify`: every registered derivation, proven symbolically and checked numerically."""

from __future__ import annotations

import argparse
import sys
import time

from affdiv.atomic import atomic_write
from affdiv.provenance import provenance
from affdiv.theory import registry
from affdiv.verify import report
from affdiv.verify.checks import run_checks


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="prove every derivation and check it against autograd and a real SGD step",
        description=__doc__,
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds per size (default 3)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="check only these derivations")
    parser.add_argument("--list", action="store_true", help="list the registered derivations and exit")
    parser.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write a Markdown report")
    parser.add_argument("--latex", metavar="PATH", help="write a LaTeX table (booktabs)")
    parser.set_defaults(func=run)


def select(names: list[str] | None):
    derivations = registry()
    if not names:
        return list(derivations.values())
    unknown = [n for n in names if n not in derivations]
    if unknown:
        raise ValueError(f"--only: unknown derivation(s) {unknown}; registered: {sorted(derivations)}")
    return [derivations[n] for n in names]


def run(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    derivations = select(args.only)
    if args.list:
        for d in derivations:
            print(f"{d.name:<24} {d.layer}")
        return 0
    start = time.perf_counter()
    print(f"proving {len(derivations)} derivations (sympy) ...", file=sys.stderr, flush=True)
    unproven = []
    for d in derivations:
        for step in d.proof_steps():
            verdict = "PASS" if step.holds else "FAIL"
            print(f"{verdict}  {d.name + '/proof':<28} [{step.kind.value}] {step.claim}")
        if not d.proven:
            unproven.append(d.name)

    def progress(index: int, total: int, check) -> None:
        print(report.format_row(check), flush=True)
        print(f"  [{index}/{total}]", file=sys.stderr, end="\r", flush=True)

    seeds = list(range(args.seed, args.seed + args.seeds))
    checks = run_checks(derivations, seeds, progress)
    record = report.build_record(
        derivations, checks, provenance(seeds=seeds, wall_time_s=round(time.perf_counter() - start, 2))
    )
    for path, render in ((args.json, report.to_json), (args.markdown, report.to_markdown), (args.latex, report.to_latex)):
        if path:
            print(f"wrote {atomic_write(path, render(record))}", file=sys.stderr)
    failed = [c.name for c in checks if not c.passed]
    summary = record["summary"]
    print(
        f"{summary['passed']} passed, {summary['failed']} failed "
        f"({len(derivations) - len(unproven)}/{len(derivations)} derivations proven, "
        f"{record['provenance']['wall_time_s']} s)"
    )
    if unproven:
        print(f"NOT PROVEN: {', '.join(unproven)}", file=sys.stderr)
    return 1 if failed or unproven else 0

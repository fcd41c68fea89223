"""`affdiv verify`: the proof steps of every registered derivation (sympy), and its closed form checked
numerically against autograd, the empirical NTK and a real SGD step."""

from __future__ import annotations

import argparse
import sys
import time

from affdiv.atomic import atomic_write, check_writable_file

# The parser imports nothing heavy (affdiv.cli loads this module without its package): the
# derivations and checks (sympy, torch) are imported when the command runs.


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check every derivation: its proof steps, autograd and a real SGD step",
        description="affdiv verify: runs the proof steps of every registered derivation (sympy) and checks its "
                    "closed form in float64 against autograd, the empirical NTK and a real SGD step. Each "
                    "derivation is reported as proven (symbolic, at general size), exact at concrete sizes, or "
                    "checked numerically. Exit status 1 when a proof step or a check fails.",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=3, metavar="K",
                        help="K seeds from --seed at every size (default 3)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="check only these derivations (default: all; --list names them)")
    parser.add_argument("--list", action="store_true", help="list the registered derivations and exit")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print every proof step and every check (without it: one line per derivation, and "
                        "every proof step or check that fails)")
    parser.add_argument("--json", metavar="PATH", help="write the full record as JSON (default: not written)")
    parser.add_argument("--markdown", metavar="PATH", help="write a Markdown report (default: not written)")
    parser.add_argument("--latex", metavar="PATH",
                        help="write a LaTeX table, booktabs and tabularx (default: not written)")
    parser.set_defaults(func=run)


def select(names: list[str] | None):
    from affdiv.theory import registry

    derivations = registry()
    if not names:
        return list(derivations.values())
    unknown = [n for n in names if n not in derivations]
    if unknown:
        raise ValueError(f"--only: unknown derivation(s) {unknown}; registered: {sorted(derivations)}")
    return [derivations[n] for n in names]


def run(args: argparse.Namespace) -> int:
    from affdiv.provenance import provenance
    from affdiv.verify import checks as checks_module
    from affdiv.verify import report

    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    derivations = select(args.only)
    if args.list:
        w = max(len(d.name) for d in derivations)
        for d in derivations:
            print(f"{d.name:<{w}}  {d.layer}")
        return 0
    # The report paths are checked before the proofs and checks run, so a bad one loses nothing.
    for option, path in (("--json", args.json), ("--markdown", args.markdown), ("--latex", args.latex)):
        if path:
            check_writable_file(path, option)
    start = time.perf_counter()
    print(f"proving {len(derivations)} derivations (sympy) ...", file=sys.stderr, flush=True)
    failing = []  # derivations with a proof step that does not hold
    steps = {}
    for d in derivations:
        steps[d.name] = d.proof_steps()
        for step in steps[d.name]:
            if args.verbose or not step.holds:
                verdict = "PASS" if step.holds else "FAIL"
                print(f"{verdict}  {d.name + '/proof':<28} [{step.kind.value}] {step.claim}")
        if not d.proven:
            failing.append(d.name)

    bar = None
    checked: dict[str, list] = {}  # derivation -> its checks so far (they arrive derivation by derivation)

    def say(line: str) -> None:
        if bar is None:
            print(line, flush=True)
        else:  # the line above the bar (tqdm clears and redraws it)
            bar.write(line, file=sys.stdout)

    def progress(index: int, total: int, check) -> None:
        nonlocal bar
        if bar is None:
            bar = _bar(total)
        if checked and check.derivation not in checked:
            say(derivation_line(*checked.popitem(), steps))
        checked.setdefault(check.derivation, []).append(check)
        if args.verbose or not check.passed:
            say(report.format_row(check))
        if bar is not None:
            bar.update(index - bar.n)

    seeds = list(range(args.seed, args.seed + args.seeds))
    try:
        checks = checks_module.run_checks(derivations, seeds, progress)
        if checked:
            say(derivation_line(*checked.popitem(), steps))
    finally:
        if bar is not None:
            bar.close()
    for d in derivations:  # a derivation without numeric checks: its proof alone
        if not any(c.derivation == d.name for c in checks):
            print(derivation_line(d.name, [], steps))
    record = report.build_record(
        derivations, checks, provenance(seeds=seeds, wall_time_s=round(time.perf_counter() - start, 2))
    )
    outputs = ((args.json, report.to_json), (args.markdown, report.to_markdown), (args.latex, report.to_latex))
    for path, render in outputs:
        if path:
            print(f"wrote {atomic_write(path, render(record))}", file=sys.stderr)
    failed = [c.name for c in checks if not c.passed]
    summary = record["summary"]
    print(
        f"{summary['passed']} passed, {summary['failed']} failed "
        f"(derivations: {report.proof_summary(record)}; {record['provenance']['wall_time_s']} s)"
    )
    if failing:
        print(f"PROOF STEP FAILS: {', '.join(failing)}", file=sys.stderr)
    return 1 if failed or failing else 0


def derivation_line(name: str, checks: list, steps: dict) -> str:
    """One console line for a derivation: how many of its proof steps hold and how many of its
    checks passed (``--verbose`` prints each, with its kind and error)."""
    held = sum(step.holds for step in steps[name])
    passed = sum(c.passed for c in checks)
    verdict = "PASS" if held == len(steps[name]) and passed == len(checks) else "FAIL"
    text = f"{verdict}  {name:<28} proof: {held}/{len(steps[name])} steps hold"
    return text + (f"; checks: {passed}/{len(checks)} passed" if checks else "; no numeric checks")


def _bar(total: int):
    """A tqdm bar on stderr when it is a terminal; None otherwise (a log gets no progress debris)."""
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # an install without the extra: no bar
        return None
    return tqdm(total=total, file=sys.stderr, unit="check", leave=False, dynamic_ncols=True)

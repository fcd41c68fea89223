"""How a steps-to-target study's power depends on its batch sizes and seeds: the report's own
calibration (``calibration.target_calibration``), re-run on the layout a committed report fitted
but with other batch sizes or seed counts.

Each method keeps the fitted S_min, run noise σ (log steps) and seed shift of the report's
``summary.json`` (``calibration.layout``); the baselines' B_crit is the report's reference B_crit
and the corrected layers' is that times the planted ratio (1, 0.5, 0.25). Per layout it prints the
rates of the joint verdicts and of each pair's one-sided test over ``--sims`` simulated studies
(Monte-Carlo s.e. √(r(1 − r)/sims)). The rates hold only as far as the fitted curves and noise
extend to the batch sizes asked for. docs/results/fashion-cnn/README.md shows a use.

    python benchmarks/target_design_power.py docs/results/fashion-cnn/summary.json \\
        --layout 32-512:8 --layout 16-512:8 --layout 8-512:8 [--sims 300] [--json PATH]

The JSON records the summary's path and SHA-256 (a committed summary.json is rewritten by a later run).

A layout ``LOW-HIGH:SEEDS`` is the powers of two from LOW to HIGH with SEEDS seeds. About one
minute per layout at 300 simulated studies per ratio on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
from pathlib import Path

from affdiv.experiments.analysis.calibration import TargetLayout, target_calibration
from affdiv.reporting import write_json

RATIOS = (1.0, 0.5, 0.25)


def layout_argument(text: str) -> tuple[tuple[int, ...], int]:
    """``"8-512:8"`` -> ((8, 16, ..., 512), 8); a one-line error for anything else."""
    try:
        span, seeds = text.split(":")
        low, high = (int(x) for x in span.split("-"))
        seeds = int(seeds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is LOW-HIGH:SEEDS, e.g. 8-512:8, got {text!r}") from None
    if not (0 < low < high and math.log2(low).is_integer() and math.log2(high).is_integer() and seeds >= 3):
        raise argparse.ArgumentTypeError(f"a layout needs powers of two LOW < HIGH and >= 3 seeds, got {text!r}")
    return tuple(2 ** k for k in range(int(math.log2(low)), int(math.log2(high)) + 1)), seeds


def _listed(rates) -> str:
    """Rates at the planted ratios, as '0.01, 0.98, 1.00'."""
    return ", ".join(f"{r:.2f}" for r in rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="a steps-to-target report's summary.json")
    parser.add_argument("--layout", type=layout_argument, action="append", required=True, metavar="LOW-HIGH:SEEDS")
    parser.add_argument("--sims", type=int, default=300, help="simulated studies per planted ratio (default 300)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rates as JSON")
    args = parser.parse_args()
    if args.sims < 1:
        parser.error(f"--sims must be >= 1, got {args.sims}")
    text = args.summary.read_bytes()
    fitted = json.loads(text).get("calibration", {}).get("layout")
    if not fitted or "reference_b_crit" not in fitted:
        parser.error(f"{args.summary} has no steps-to-target calibration layout (calibration.layout)")
    fitted = TargetLayout.from_description(fitted)
    print(f"reference B_crit {fitted.reference_b_crit:.3g}; planted ratios {RATIOS}; {args.sims} studies each")
    rows = []
    for batch_sizes, seeds in args.layout:
        layout = dataclasses.replace(fitted, batch_sizes=batch_sizes, n_seeds=seeds)
        rates = target_calibration(layout, RATIOS, n_sims=args.sims, seed=0)
        rows.append({"batch_sizes": list(batch_sizes), "seeds": seeds, "joint": rates.joint, "pairs": rates.pairs})
        pairs = "; ".join(f"{pair} {_listed(values)}" for pair, values in rates.pairs.items())
        print(f"B {batch_sizes[0]}-{batch_sizes[-1]}, {seeds} seeds: joint supported "
              f"{_listed(rates.joint['supported'])}; contradicted {_listed(rates.joint['contradicted'])}; "
              f"pair tests {pairs}", flush=True)
    if args.json:
        write_json(args.json, {"summary": str(args.summary), "summary_sha256": hashlib.sha256(text).hexdigest(),
                               "ratios": list(RATIOS), "sims": args.sims, "rows": rows})


if __name__ == "__main__":
    main()

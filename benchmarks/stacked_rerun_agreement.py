"""Do stacked (vmapped) runs agree with the committed one-at-a-time runs of the same configs?

    python benchmarks/stacked_rerun_agreement.py COMMITTED.csv RERUN.csv [--metric test_accuracy]
                                                 [--rename l2=norm_l2] [--committed-wall S --rerun-wall S]

Issue 13's check: the 192 configs of the first ``fashion`` study (``docs/results/fashion``,
trained one model at a time) re-run with stacking in float32. Long float32 runs drift apart by
rounding (one ulp in a step changes every later one), so runs are compared statistically, not
bit for bit: runs are paired by (method, batch_size, seed, lr_rule); per method, batch size and
rule, the paired differences d_s = metric_rerun − metric_committed over the seeds give a t
interval (``scipy.stats.ttest_rel``), which should contain 0. With k independent cells about
5% of them exclude 0 by chance (printed as the binomial expectation). Also printed: how many
pairs are bit-identical, how many tuned runs chose the same learning rate, how many configs keep
their committed key (``config_hash``: the same config by the harness's own definition), and the
wall-time ratio when both walls are given.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from scipy import stats

KEY = ["method", "batch_size", "seed", "lr_rule"]


def _read(path: str, rename: dict[str, str]) -> pd.DataFrame:
    frame = pd.read_csv(path)
    frame["method"] = frame["method"].replace(rename)
    if frame.duplicated(KEY).any():
        raise SystemExit(f"{path}: more than one run per {', '.join(KEY)}")
    return frame.set_index(KEY)


def agreement(committed: pd.DataFrame, rerun: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per (method, batch_size, lr_rule): seeds, mean paired difference and its 95% t interval."""
    missing = committed.index.difference(rerun.index)
    if len(missing):
        raise SystemExit(f"{len(missing)} committed runs have no rerun, e.g. {missing[0]}")
    pairs = committed[[metric]].join(rerun[[metric]], rsuffix="_rerun").reset_index()
    pairs["difference"] = pairs[f"{metric}_rerun"] - pairs[metric]
    rows = []
    for (method, batch, rule), cell in pairs.groupby(["method", "batch_size", "lr_rule"]):
        test = stats.ttest_rel(cell[f"{metric}_rerun"], cell[metric])
        if np.all(cell["difference"] == 0):  # a constant difference has no t interval
            low = high = 0.0
        else:
            low, high = test.confidence_interval(0.95)
        rows.append(dict(method=method, batch_size=batch, lr_rule=rule, seeds=len(cell),
                         mean_difference=cell["difference"].mean(), ci_low=low, ci_high=high,
                         contains_zero=low <= 0 <= high))
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("committed")
    parser.add_argument("rerun")
    parser.add_argument("--metric", default="test_accuracy", help="the compared column (default: %(default)s)")
    parser.add_argument("--rename", action="append", default=["l2=norm_l2"],
                        help="OLD=NEW method names of the committed file (default: l2=norm_l2)")
    parser.add_argument("--committed-wall", type=float, help="the committed study's wall time, s (no default)")
    parser.add_argument("--rerun-wall", type=float, help="the rerun's wall time, s (no default)")
    args = parser.parse_args(argv)
    rename = dict(pair.split("=", 1) for pair in args.rename)
    committed, rerun = _read(args.committed, rename), _read(args.rerun, rename)
    table = agreement(committed, rerun, args.metric)
    with pd.option_context("display.width", 160, "display.float_format", "{:+.4f}".format):
        print(table.to_string(index=False))
    cells, outside = len(table), int((~table["contains_zero"]).sum())
    chance = stats.binom(cells, 0.05).ppf(0.975)
    print(f"\n{cells - outside} of {cells} cells' 95% intervals contain 0 (at no difference, "
          f"{chance:.0f} or fewer of {cells} exclude it, 97.5% of the time)")
    joined = committed.join(rerun, rsuffix="_rerun", how="inner")
    print(f"bit-identical {args.metric}: {int((joined[args.metric] == joined[f'{args.metric}_rerun']).sum())} "
          f"of {len(joined)} runs")
    tuned = joined.xs("tuned", level="lr_rule")
    print(f"tuned runs choosing the committed learning rate: {int((tuned['lr'] == tuned['lr_rerun']).sum())} "
          f"of {len(tuned)}")
    print(f"configs keeping their committed key: {int((joined['config_hash'] == joined['config_hash_rerun']).sum())} "
          f"of {len(joined)} (a renamed method changes its key)")
    print(f"mean |difference|: {np.mean(np.abs(joined[f'{args.metric}_rerun'] - joined[args.metric])):.4f}")
    if args.committed_wall and args.rerun_wall:
        print(f"wall time: committed {args.committed_wall:.0f} s, rerun {args.rerun_wall:.0f} s, "
              f"ratio {args.committed_wall / args.rerun_wall:.2f}x")


if __name__ == "__main__":
    main()

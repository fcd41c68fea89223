"""Do stacked (vmapped) runs agree with the committed one-at-a-time runs of the same configs?

    python benchmarks/stacked_rerun_agreement.py COMMITTED RERUN [--metric test_accuracy]
                                                 [--margin 0.01] [--walls COMMITTED_S RERUN_S]

COMMITTED and RERUN are record CSVs or results stores. The committed check: the 192 configs of the
first ``fashion`` study (``docs/results/fashion/records.csv``, trained one model at a time),
re-run with stacking in float32 (``docs/results/fashion-stacked``). Long float32 runs drift apart
by rounding (one ulp in one step changes every later one), so runs are compared statistically,
not bit for bit. Runs are paired by (method, batch_size, seed, lr_rule); d = metric(rerun) −
metric(committed). Printed:

- per (method, batch size, rule) cell: its seeds, mean d and the 95% t interval of the paired
  mean (``scipy.stats.ttest_rel``); a cell whose differences are all 0 has the interval [0, 0];
  fewer than 2 seeds, no interval;
- how many cells with varying d exclude 0, against Binomial(cells, 0.05), with the one-sided
  binomial p of that many or more (``scipy.stats.binomtest``); cells share seeds and the data
  split, so they are not independent and the p is a guide, not a test;
- the overall mean d with a t interval over seeds (each seed's mean d over its pairs: seeds are
  the independent units), and TOST equivalence against ±``margin`` (the 90% interval inside it);
- sd(d) / (√2 · the committed runs' within-cell seed sd): about 1 when a rerun is, in effect,
  another seed (the runs' rounding drift has decorrelated them), near 0 when pairs track;
- tuned runs that chose the committed learning rate, and the mean |d| of those that did and did
  not (a different choice on the grid is a jump, not drift); bit-identical pairs; configs keeping
  their committed key (``config_hash``; a renamed method changes its key);
- with ``--walls``, the committed and the rerun wall times and their ratio.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np
from scipy import stats

from affdiv.experiments.records import is_sqlite, read_csv

KEY = ("method", "batch_size", "seed", "lr_rule")


def read_runs(path: str, metric: str) -> dict[tuple, dict]:
    """Records of a CSV or results store by (method, batch_size, seed, lr_rule); old method names
    read as today's (``records.RENAMED_METHODS``)."""
    if is_sqlite(path):
        from affdiv.experiments.runs.store import ResultStore

        with ResultStore(path, read_only=True) as store:
            records = store.records(metric=metric)
    else:
        records = read_csv(path, metric=metric)
    runs = {}
    for record in records:
        key = tuple(record.get(k, "") for k in KEY)
        if key in runs:
            raise SystemExit(f"{path}: more than one run for {dict(zip(KEY, key))}")
        runs[key] = record
    return runs


def _interval(values: np.ndarray, level: float) -> tuple[float, float] | None:
    """The t interval of the mean of ``values``; [0, 0] when all are 0; None for < 2 values."""
    if len(values) < 2:
        return None
    if np.all(values == values[0]):
        return float(values[0]), float(values[0])
    half = stats.t.ppf(0.5 + level / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return float(values.mean() - half), float(values.mean() + half)


def _mean_abs(d: np.ndarray) -> float:
    return float(np.abs(d).mean()) if len(d) else math.nan


def agreement(committed: dict, rerun: dict, metric: str, margin: float) -> dict:
    """The comparison described in the module docstring, as numbers."""
    missing = sorted(set(committed) - set(rerun), key=str)
    if missing:
        raise SystemExit(f"{len(missing)} committed runs have no rerun, e.g. {dict(zip(KEY, missing[0]))}")
    diff_by_key = {k: float(rerun[k][metric]) - float(committed[k][metric]) for k in committed}

    def differences(keys) -> np.ndarray:
        return np.array([diff_by_key[k] for k in keys])

    cells, by_seed = defaultdict(list), defaultdict(list)
    for key in committed:
        method, batch_size, seed, rule = key
        cells[(method, batch_size, rule)].append(key)
        by_seed[seed].append(key)

    rows = []
    for (method, batch_size, rule), keys in sorted(cells.items(), key=lambda item: item[0]):
        d = differences(keys)
        before = np.array([float(committed[k][metric]) for k in keys])
        rows.append(dict(method=method, batch_size=batch_size, lr_rule=rule, seeds=len(keys), mean=float(d.mean()),
                         interval=_interval(d, 0.95), varies=bool(np.ptp(d) > 0),
                         sd=float(d.std(ddof=1)) if len(d) > 1 else math.nan,
                         committed_sd=float(before.std(ddof=1)) if len(d) > 1 else math.nan))
    judged = [r for r in rows if r["interval"] is not None and r["varies"]]
    outside = sum(not (r["interval"][0] <= 0 <= r["interval"][1]) for r in judged)

    seed_means = np.array([differences(keys).mean() for keys in by_seed.values()])
    tost = _interval(seed_means, 0.90)
    paired = [(r["sd"], r["committed_sd"]) for r in rows if r["committed_sd"] > 0 and math.isfinite(r["sd"])]
    drift_ratio = math.nan
    if paired:  # root mean squares over cells, so that no single cell's sd decides it
        sd_d, sd_seed = (math.sqrt(np.mean(np.square(column))) for column in zip(*paired))
        drift_ratio = sd_d / (math.sqrt(2) * sd_seed)

    tuned = [k for k in committed if k[3] == "tuned" and "lr" in committed[k] and "lr" in rerun[k]]
    same_lr = [k for k in tuned if float(committed[k]["lr"]) == float(rerun[k]["lr"])]
    other_lr = [k for k in tuned if float(committed[k]["lr"]) != float(rerun[k]["lr"])]
    return dict(
        rows=rows, judged=len(judged), outside=outside,
        binomial_p=stats.binomtest(outside, len(judged), 0.05, alternative="greater").pvalue if judged else math.nan,
        seeds=len(seed_means), overall_mean=float(seed_means.mean()), overall=_interval(seed_means, 0.95), tost=tost,
        equivalent=tost is not None and -margin < tost[0] and tost[1] < margin, drift_ratio=drift_ratio,
        tuned=len(tuned), same_lr=len(same_lr),
        mean_abs_same_lr=_mean_abs(differences(same_lr)), mean_abs_other_lr=_mean_abs(differences(other_lr)),
        identical=sum(d == 0 for d in diff_by_key.values()), pairs=len(committed),
        same_key=sum(committed[k].get("config_hash") not in (None, "")
                     and committed[k].get("config_hash") == rerun[k].get("config_hash") for k in committed),
    )


def _walls(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a wall time must be > 0 s, got {text!r}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("committed", help="the committed runs: a record CSV or a results store")
    parser.add_argument("rerun", help="the rerun: a record CSV or a results store")
    parser.add_argument("--metric", default="test_accuracy", help="the compared column (default: %(default)s)")
    parser.add_argument("--margin", type=float, default=0.01, help="equivalence margin of the mean difference "
                        "(default: %(default)s, the studies' contrast margin)")
    parser.add_argument("--walls", nargs=2, type=_walls, metavar=("COMMITTED_S", "RERUN_S"),
                        help="both studies' wall times in seconds (no default: not printed)")
    args = parser.parse_args(argv)
    result = agreement(read_runs(args.committed, args.metric), read_runs(args.rerun, args.metric), args.metric,
                       args.margin)
    print(f"{'method':12} {'B':>5} {'rule':6} {'seeds':>5} {'mean d':>8} {'95% interval':>19} {'sd(d)':>7} "
          f"{'seed sd':>7}")
    for r in result["rows"]:
        interval = "—" if r["interval"] is None else f"[{r['interval'][0]:+.4f}, {r['interval'][1]:+.4f}]"
        print(f"{r['method']:12} {r['batch_size']:5d} {r['lr_rule']:6} {r['seeds']:5d} {r['mean']:+8.4f} "
              f"{interval:>19} {r['sd']:7.4f} {r['committed_sd']:7.4f}")
    print(f"\ncells whose differences vary: {result['judged']}; their 95% intervals exclude 0 in {result['outside']} "
          f"(expected at no difference: {0.05 * result['judged']:.1f}; P(>= {result['outside']}) = "
          f"{result['binomial_p']:.3f}, cells not independent)")
    if result["overall"]:
        low, high = result["overall"]
        print(f"mean difference over {result['seeds']} seeds: {result['overall_mean']:+.4f} [{low:+.4f}, {high:+.4f}]; "
              f"90% interval [{result['tost'][0]:+.4f}, {result['tost'][1]:+.4f}] "
              f"{'inside' if result['equivalent'] else 'not inside'} ±{args.margin}")
    print(f"sd(d) / (√2 · committed seed sd): {result['drift_ratio']:.2f} (1: reruns behave as new seeds)")
    print(f"tuned runs choosing the committed learning rate: {result['same_lr']} of {result['tuned']}; mean |d| "
          f"{result['mean_abs_same_lr']:.4f} for those, {result['mean_abs_other_lr']:.4f} for the others")
    print(f"bit-identical {args.metric}: {result['identical']} of {result['pairs']} pairs; configs keeping their "
          f"committed key: {result['same_key']} of {result['pairs']}")
    if args.walls:
        before, after = args.walls
        print(f"wall time: committed {before:.0f} s, rerun {after:.0f} s, committed / rerun {before / after:.2f}")


if __name__ == "__main__":
    main()

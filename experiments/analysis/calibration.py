"""Calibration of the trend tests on simulated sweeps with a planted slope.

A simulated sweep has the layout of a real one (seeds × batch sizes) and the model

    metric(seed s, batch B) = base + u_s + slope · log2 B + e,   u_s ~ N(0, seed_sd²), e ~ N(0, noise_sd²),

and, for the differential test, a baseline with slope 0 and its own seed effects and noise. For each
planted slope, :func:`calibrate` counts how often each test rejects at level ``alpha`` (unadjusted,
one test at a time — the size of each building block of the decision rule):

* ``falls``        seed-clustered OLS slope, one-sided "performance falls" (the primary test);
* ``differential`` per-seed slope of (method − baseline), one-sided t across seeds;
* ``page``         Page's L, one-sided decreasing trend;
* ``bootstrap``    the one-sided (1 − 2·alpha) cluster-bootstrap percentile bound lies below 0;
* ``flat``         TOST with ``margin`` (its size is read at slope = ±margin, its power at 0);
* ``mixed``        random-intercept REML model, Wald z (slow: ~30 ms a fit; not run by default).

At slope 0 the rejection rate of a one-sided test is its false-positive rate; at a negative slope
it is its power. The rates are binomial proportions over ``n_sims`` datasets: their Monte-Carlo
standard error is sqrt(r (1 − r) / n_sims).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from affdiv.experiments.analysis import stats
from affdiv.experiments.analysis.decision import Analysis, analyse

TESTS = ("falls", "differential", "page", "bootstrap", "flat", "mixed")


@dataclass(frozen=True)
class Layout:
    """The shape and noise of a simulated sweep (defaults: a smoke-sized accuracy sweep)."""

    batch_sizes: tuple[int, ...] = (16, 32, 64, 128, 256)
    n_seeds: int = 5
    seed_sd: float = 0.01
    noise_sd: float = 0.005
    base: float = 0.9

    def __post_init__(self):
        if len(set(self.batch_sizes)) < 3 or min(self.batch_sizes) <= 0:
            raise ValueError(f"need >= 3 distinct positive batch sizes, got {self.batch_sizes}")
        if self.n_seeds < 2:
            raise ValueError(f"need >= 2 seeds, got {self.n_seeds}")


def simulate_table(layout: Layout, slope: float, rng: np.random.Generator) -> np.ndarray:
    """One simulated sweep as a (seeds × batch sizes) table of the metric."""
    x = np.log2(np.asarray(layout.batch_sizes, dtype=np.float64))
    seed_effects = rng.normal(0.0, layout.seed_sd, size=(layout.n_seeds, 1))
    noise = rng.normal(0.0, layout.noise_sd, size=(layout.n_seeds, x.size))
    return layout.base + seed_effects + slope * x + noise


def simulate_records(layout: Layout, slopes: dict[str, float], rng: np.random.Generator,
                     **columns) -> list[dict]:
    """Records {method, batch_size, seed, metric, **columns} of one sweep, one planted slope per method."""
    records = []
    for method, slope in slopes.items():
        table = simulate_table(layout, slope, rng)
        for s in range(layout.n_seeds):
            for b, batch_size in enumerate(layout.batch_sizes):
                records.append({"method": method, "batch_size": batch_size, "seed": s,
                                "metric": float(table[s, b]), **columns})
    return records


def rejections(table: np.ndarray, baseline: np.ndarray, layout: Layout, *, tests: Sequence[str], alpha: float,
               margin: float, rng: np.random.Generator, n_boot: int) -> dict[str, bool]:
    """Which of ``tests`` reject on one simulated (method, baseline) pair of tables."""
    x_row = np.log2(np.asarray(layout.batch_sizes, dtype=np.float64))
    x = np.tile(x_row, layout.n_seeds)
    seeds = np.repeat(np.arange(layout.n_seeds), x_row.size)
    y = table.ravel()
    clustered = stats.clustered_slope(x, y, seeds)
    decide = {
        "falls": lambda: clustered.p_less() < alpha,
        "differential": lambda: stats.mean_estimate(
            list(stats.per_cluster_slopes(x, (table - baseline).ravel(), seeds).values())).p_less() < alpha,
        "page": lambda: stats.page_trend(table).p_decreasing < alpha,
        "bootstrap": lambda: stats.percentile_ci(
            stats.cluster_bootstrap(x, y, seeds, n_boot=n_boot, rng=rng), 1 - 2 * alpha)[1] < 0,
        "flat": lambda: clustered.p_equivalent(margin) < alpha,
        "mixed": lambda: stats.mixed_slope(x, y, seeds).slope.p_less() < alpha,
    }
    return {test: bool(decide[test]()) for test in tests}


@dataclass(frozen=True)
class Calibration:
    """Rejection rates: ``rates[test][i]`` at planted slope ``planted[i]``, over ``n_sims`` datasets."""

    planted: tuple[float, ...]
    rates: dict[str, tuple[float, ...]]
    n_sims: int
    alpha: float
    margin: float
    layout: Layout
    seed: int
    verdicts: dict[str, tuple[float, ...]] | None = None  # verdict_rates at the same slopes, if computed

    def rate(self, test: str, slope: float) -> float:
        """The rejection rate of ``test`` at a planted slope (which must be one of ``planted``)."""
        if slope not in self.planted:
            raise ValueError(f"slope {slope} was not simulated; planted slopes are {self.planted}")
        return self.rates[test][self.planted.index(slope)]

    def mc_se(self, rate: float) -> float:
        """Monte-Carlo standard error of a rejection rate."""
        return float(np.sqrt(rate * (1 - rate) / self.n_sims))

    def to_dict(self) -> dict:
        return {"planted": list(self.planted), "rates": {k: list(v) for k, v in self.rates.items()},
                "n_sims": self.n_sims, "alpha": self.alpha, "margin": self.margin,
                "layout": asdict(self.layout), "seed": self.seed,
                "verdicts": None if self.verdicts is None else {k: list(v) for k, v in self.verdicts.items()}}


def calibrate(planted: Sequence[float], *, layout: Layout = Layout(), n_sims: int = 1000, alpha: float = 0.05,
              margin: float = 0.005, n_boot: int = 1000, seed: int = 0,
              tests: Sequence[str] = ("falls", "differential", "page", "bootstrap", "flat"),
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Rejection rate of every test at every planted slope (metric units per doubling of B).

    ``progress(done, total)`` is called after each planted slope. The data of each slope come from
    a stream seeded by (seed, slope), the bootstrap resamples from another: adding slopes or tests
    does not change the other rates.
    """
    if n_sims < 1:
        raise ValueError(f"n_sims must be >= 1, got {n_sims}")
    unknown = sorted(set(tests) - set(TESTS))
    if unknown:
        raise ValueError(f"unknown test(s) {unknown}; expected some of {TESTS}")
    planted = tuple(float(s) for s in planted)
    counts = {test: [] for test in tests}
    for i, slope in enumerate(planted):
        key = int(np.float64(slope).view(np.uint64))
        data_rng, boot_rng = np.random.default_rng([seed, key, 0]), np.random.default_rng([seed, key, 1])
        hits = dict.fromkeys(tests, 0)
        for _ in range(n_sims):
            table = simulate_table(layout, slope, data_rng)
            baseline = simulate_table(layout, 0.0, data_rng)
            for test, rejected in rejections(table, baseline, layout, tests=tests, alpha=alpha, margin=margin,
                                             rng=boot_rng, n_boot=n_boot).items():
                hits[test] += rejected
        for test in tests:
            counts[test].append(hits[test] / n_sims)
        if progress is not None:
            progress(i + 1, len(planted))
    return Calibration(planted, {k: tuple(v) for k, v in counts.items()}, n_sims, alpha, margin, layout, seed)


def verdict_rates(planted: Sequence[float], *, layout: Layout = Layout(), n_sims: int = 200, alpha: float = 0.05,
                  margin: float = 0.005, groups: Sequence[str] = ("constant", "sqrt"), seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, tuple[float, ...]]:
    """How often the whole decision rule of :func:`analyse` gives each overall verdict.

    Each simulated study has, in every group, ``affine_like`` with the planted slope and the
    baselines ``affine`` and ``batchnorm`` with slope 0 — the full Holm family of a real study.
    Returns {verdict: rate at each planted slope} for ``affine_like``; at slope 0 the rate of
    "supported" is the false-positive rate of the prediction's claim.
    """
    rates: dict[str, list[float]] = {v: [] for v in ("supported", "contradicted", "mixed", "inconclusive")}
    for i, slope in enumerate(float(s) for s in planted):
        rng = np.random.default_rng([seed, int(np.float64(slope).view(np.uint64)), 2])
        counts = dict.fromkeys(rates, 0)
        for _ in range(n_sims):
            records = [r for group in groups for r in simulate_records(
                layout, {"affine_like": slope, "affine": 0.0, "batchnorm": 0.0}, rng, lr_rule=group)]
            result = analyse(records, alpha=alpha, margin=margin, sensitivity=False)
            counts[result.overall["affine_like"]] += 1
        for verdict, count in counts.items():
            rates[verdict].append(count / n_sims)
        if progress is not None:
            progress(i + 1, len(planted))
    return {verdict: tuple(r) for verdict, r in rates.items()}


def layout_of(analysis: Analysis) -> Layout:
    """The layout of a real sweep on the performance scale: its primary group's batch sizes and
    seed count; seed_sd and noise_sd the medians, over the methods with a mixed-model fit, of the
    REML seed and residual standard deviations; base the mean performance."""
    fitted = [r for r in analysis.methods.values() if r["status"] == "ok" and "seed_variance" in r.get("mixed", {})]
    if not fitted:
        raise ValueError("no method of the primary group has a mixed-model fit to take the noise from")
    sign = 1.0 if analysis.settings["higher_is_better"] else -1.0
    return Layout(
        batch_sizes=tuple(sorted({b for r in fitted for b in r["batch_sizes"]})),
        n_seeds=int(min(r["n_seeds"] for r in fitted)),
        seed_sd=float(np.median([np.sqrt(max(r["mixed"]["seed_variance"], 0.0)) for r in fitted])),
        noise_sd=float(np.median([np.sqrt(r["mixed"]["residual_variance"]) for r in fitted])),
        base=sign * float(np.mean([c["mean"] for r in fitted for c in r["cells"]])),
    )


def calibrate_for(analysis: Analysis, *, n_sims: int = 1000, verdict_sims: int = 0, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Calibrate the tests in the layout of a real sweep (:func:`layout_of`) with its alpha and
    margin, at planted performance slopes from -2 to +1 equivalence margins per doubling; with
    ``verdict_sims`` > 0 also the whole decision rule (:func:`verdict_rates`, same number of groups)."""
    margin, alpha = analysis.settings["margin"], analysis.settings["alpha"]
    planted = [k * margin for k in (-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0)]
    layout = layout_of(analysis)
    result = calibrate(planted, layout=layout, n_sims=n_sims, alpha=alpha, margin=margin, seed=seed,
                       progress=progress)
    if verdict_sims > 0:
        verdicts = verdict_rates(planted, layout=layout, n_sims=verdict_sims, alpha=alpha, margin=margin,
                                 groups=tuple(analysis.groups), seed=seed, progress=progress)
        result = replace(result, verdicts=verdicts)
    return result

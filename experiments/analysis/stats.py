"""Statistical tests of a trend of a metric against log2(batch size), with seeds as clusters.

Every estimator takes flat arrays ``x`` (log2 batch size), ``y`` (metric) and ``clusters`` (seed
labels), one entry per run, and returns an :class:`Estimate`: a point estimate, its standard error
and the degrees of freedom of its reference distribution (``inf`` for a normal one), from which the
one-sided, two-sided and equivalence (TOST) p-values and confidence intervals follow.

* :func:`clustered_slope` — OLS of y on [1, x] with the cluster-robust sandwich variance and the CR1
  small-sample factor G/(G-1)·(N-1)/(N-k) (k = 2), t reference with G-1 df (G = clusters):
  statsmodels' ``OLS(...).fit(cov_type="cluster", use_t=True)``.
* :func:`per_cluster_slopes` / :func:`mean_estimate` — the OLS slope within each seed, and the
  one-sample t estimate of their mean (the differential test runs on these); :func:`t_interval` —
  the t interval of a mean (``affdiv probe``'s intervals over seeds).
* :func:`cluster_bootstrap` — percentile CI of the OLS slope from resampling whole seeds;
  :func:`bootstrap_means` — the means of resamples of a sample.
* :func:`page_trend` — Page's L across batch sizes with seeds as blocks.
* :func:`holm` — Holm's step-down adjustment of a family of p-values (statsmodels' ``multipletests``).
* :func:`jackknife_se` — the leave-one-out jackknife standard error from an estimator's replicates.
* :func:`scale_margin` — a default equivalence margin on the metric's own scale.

The TOST on a slope and the cluster bootstrap are written out here (statsmodels has neither).
Arithmetic that leaves the floats (finite metrics like ±1e308 whose sums overflow) raises
:class:`NonFiniteError` rather than returning a NaN slope that a test would read as a verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

from affdiv.checks import NonFiniteError


@dataclass(frozen=True)
class Estimate:
    """A point estimate with standard error ``se`` and a t(df) (normal if df = inf) reference."""

    estimate: float
    se: float
    df: float

    def _cdf(self, t: float) -> float:
        return _st.norm.cdf(t) if math.isinf(self.df) else _st.t.cdf(t, self.df)

    def _sf(self, t: float) -> float:
        return _st.norm.sf(t) if math.isinf(self.df) else _st.t.sf(t, self.df)

    def _t(self, null: float) -> float:
        if math.isnan(self.estimate) or math.isnan(self.se):
            return math.nan  # no estimate: every p-value is NaN, never 0 or 1
        if self.se > 0:
            return (self.estimate - null) / self.se
        # No sampling variability at all (noiseless data): the sign alone decides.
        return math.copysign(math.inf, self.estimate - null) if self.estimate != null else 0.0

    def p_less(self, null: float = 0.0) -> float:
        """p-value of H0: parameter >= null against H1: parameter < null."""
        return float(self._cdf(self._t(null)))

    def p_greater(self, null: float = 0.0) -> float:
        """p-value of H0: parameter <= null against H1: parameter > null."""
        return float(self._sf(self._t(null)))

    def p_two_sided(self, null: float = 0.0) -> float:
        less, greater = self.p_less(null), self.p_greater(null)
        if math.isnan(less) or math.isnan(greater):  # min() would quietly pick a number over NaN
            return math.nan
        return float(min(1.0, 2.0 * min(less, greater)))

    def p_equivalent(self, margin: float) -> float:
        """TOST p-value of H0: |parameter| >= margin against H1: |parameter| < margin."""
        if not margin > 0:
            raise ValueError(f"the equivalence margin must be > 0, got {margin!r}")
        lower, upper = self.p_greater(-margin), self.p_less(margin)
        return math.nan if math.isnan(lower) or math.isnan(upper) else max(lower, upper)

    def ci(self, level: float) -> tuple[float, float]:
        """Two-sided confidence interval of coverage ``level``."""
        q = 0.5 + level / 2.0
        half = (_st.norm.ppf(q) if math.isinf(self.df) else _st.t.ppf(q, self.df)) * self.se
        return (self.estimate - half, self.estimate + half)


def _check_xy(x, y, clusters=None):
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"x and y must be 1-D of equal length, got shapes {x.shape} and {y.shape}")
    if clusters is not None:
        clusters = np.asarray(clusters)
        if clusters.shape != x.shape:
            raise ValueError(f"clusters must have shape {x.shape}, got {clusters.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("x and y must be finite")
    if np.ptp(x) == 0:
        raise ValueError(f"x must take at least two distinct values to fit a slope, got only {x[0]!r}")
    return x, y, clusters


def clustered_slope(x, y, clusters) -> Estimate:
    """OLS slope of y on x with the CR1 cluster-robust standard error and G-1 df (statsmodels).

    V = c (X'X)^-1 [sum_g X_g' u_g u_g' X_g] (X'X)^-1, c = G/(G-1) · (N-1)/(N-2), X = [1, x]:
    ``OLS(y, X).fit(cov_type="cluster", cov_kwds={"groups": g}, use_t=True)``, whose t reference has
    G - 1 degrees of freedom (``df_resid_inference``). x is centred and y shifted by its first value
    first (the slope and its clustered variance do not change), so a constant y gives exactly
    b = 0 and se = 0 (no rounding-level "trend"). Raises :class:`NonFiniteError` if the arithmetic
    leaves the floats.
    """
    from statsmodels.regression.linear_model import OLS  # not statsmodels.api: that imports everything (~2 s)

    x, y, clusters = _check_xy(x, y, clusters)
    _labels, index = _cluster_index(clusters)
    n, n_clusters = x.size, int(index.max()) + 1
    if n_clusters < 2 or n < 3:
        raise ValueError(f"a clustered slope needs >= 2 clusters (seeds) and >= 3 observations (runs; N-2 "
                         f"residual degrees of freedom), got {n_clusters} clusters and {n} observations")
    with np.errstate(all="ignore"):
        # Shifting y by one of its values keeps the slope and its variance, and makes a constant y
        # exactly 0, so that it gives exactly b = 0 and se = 0 (no rounding-level "trend").
        xc, yc = x - x.mean(), y - y[0]
        if not np.all(np.isfinite(yc)):
            raise NonFiniteError(f"non-finite arithmetic in the OLS fit: differences of {n} values of magnitude up "
                                 f"to {np.abs(y).max():.3g} overflow float64")
        fit = OLS(yc, np.column_stack([np.ones_like(xc), xc])).fit(
            cov_type="cluster", cov_kwds={"groups": index}, use_t=True)
    slope, se, df = float(fit.params[1]), float(fit.bse[1]), float(fit.df_resid_inference)
    if not (math.isfinite(slope) and math.isfinite(se)):
        raise NonFiniteError(f"non-finite arithmetic in the clustered OLS fit (slope {slope}, se {se}) from {n} "
                             f"values of magnitude up to {np.abs(y).max():.3g}")
    return Estimate(slope, se, df)


def _cluster_index(clusters) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct labels, index of each entry's label): np.unique, also for Python ints of any size."""
    clusters = np.asarray(clusters)
    if clusters.dtype == object:  # e.g. seeds beyond int64, mixed with negative ones
        labels = sorted(set(clusters.tolist()))
        code = {label: i for i, label in enumerate(labels)}
        return np.array(labels, dtype=object), np.fromiter((code[c] for c in clusters.tolist()), np.intp,
                                                          count=clusters.size)
    return np.unique(clusters, return_inverse=True)


def per_cluster_slopes(x, y, clusters) -> dict:
    """OLS slope of y on x within each cluster that has >= 2 distinct x values: {label: slope}.

    Vectorised over clusters (per-cluster means, then the centred cross-products, by bincount):
    O(N log N) however many clusters there are.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size == 0:
        return {}
    labels, index = _cluster_index(clusters)
    size = labels.size
    counts = np.bincount(index, minlength=size)
    with np.errstate(all="ignore"):
        xc = x - (np.bincount(index, weights=x, minlength=size) / counts)[index]
        yc = y - (np.bincount(index, weights=y, minlength=size) / counts)[index]
        sxx = np.bincount(index, weights=xc * xc, minlength=size)
        sxy = np.bincount(index, weights=xc * yc, minlength=size)
        slopes = sxy / sxx
    order = np.argsort(index, kind="stable")  # every label occurs, so cluster i is the i-th run of equal index
    starts = np.flatnonzero(np.r_[True, np.diff(index[order]) != 0])
    varies = np.maximum.reduceat(x[order], starts) > np.minimum.reduceat(x[order], starts)
    return {(labels[i].item() if hasattr(labels[i], "item") else labels[i]): float(slopes[i])
            for i in np.flatnonzero(varies)}


def mean_estimate(values) -> Estimate:
    """One-sample t estimate of the mean: (mean, sd/sqrt(n), n-1 df)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2:
        raise ValueError(f"a one-sample t test needs >= 2 values, got {values.size}")
    return Estimate(float(values.mean()), float(values.std(ddof=1) / math.sqrt(values.size)), float(values.size - 1))


def t_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided t interval of coverage ``level`` of the mean of ``values``
    (n >= 2, t with n-1 df): mean ± t·sd/√n, with the sums taken left to right and the product in
    that order, as ``affdiv probe`` has always computed it (``mean_estimate(values).ci(level)``
    gives the same interval up to the last bit)."""
    values = [float(v) for v in values]
    n = len(values)
    if n < 2:
        raise ValueError(f"a t interval needs >= 2 values, got {n}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(_st.t.ppf(0.5 + level / 2.0, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def jackknife_se(replicates) -> float:
    """Leave-one-out jackknife standard error of an estimator from its G replicates t_(-s) (the
    estimator with unit s left out): sqrt((G-1)/G * sum_s (t_(-s) - mean_s t_(-s))^2)."""
    replicates = np.asarray(replicates, dtype=np.float64)
    g = replicates.size
    return float(math.sqrt((g - 1) / g * np.sum((replicates - replicates.mean()) ** 2)))


def scale_margin(values, higher_is_better: bool, *, accuracy: float, fraction: float, per: str,
                 name: str, argument: str) -> tuple[float, str]:
    """An equivalence margin on the metric's own scale when none is given, and why.

    A score in [0, 1] (accuracy): ``accuracy``. Anything else (a loss, a percentage): ``fraction``
    times the median |metric|. ``per`` says what the margin is a change over (e.g. "per doubling of
    the batch size"); a median of 0 raises ValueError naming ``name`` and the ``argument`` to pass.
    """
    values = np.asarray(values, dtype=np.float64)
    if higher_is_better and values.min() >= 0 and values.max() <= 1:
        points = 100 * accuracy
        return accuracy, f"{points:g} percentage point{'' if points == 1 else 's'} of accuracy (metric in [0, 1]) {per}"
    scale = float(np.median(np.abs(values)))
    if scale == 0:
        raise ValueError(f"cannot derive {name} from a metric whose median is 0; pass {argument}=")
    return fraction * scale, f"{100 * fraction:g}% of the median |metric| ({scale:.4g}) {per}"


def _cluster_sums(x, y, clusters):
    """Per-cluster sufficient statistics [n, Sx, Sy, Sxx, Sxy] of a simple regression."""
    labels, index = _cluster_index(clusters)
    sums = np.zeros((labels.size, 5))
    np.add.at(sums, index, np.column_stack([np.ones_like(x), x, y, x * x, x * y]))
    return sums


def bootstrap_multiplicities(n_clusters: int, n_boot: int, rng: np.random.Generator, *, chunk: int = 256):
    """Yield (rows, n_clusters) blocks of resample multiplicities, ``n_boot`` rows in all: row r
    counts how often each of the G clusters is among G draws with replacement
    (``rng.integers(0, G, size=(n_boot, G))``, drawn block by block to bound the memory)."""
    for start in range(0, n_boot, chunk):
        rows = min(chunk, n_boot - start)
        draws = rng.integers(0, n_clusters, size=(rows, n_clusters))
        flat = (np.arange(rows)[:, None] * n_clusters + draws).ravel()
        yield np.bincount(flat, minlength=rows * n_clusters).reshape(rows, n_clusters)


def bootstrap_means(values, n_boot: int, rng: np.random.Generator, *, chunk: int = 256) -> np.ndarray:
    """Means of ``n_boot`` resamples of ``values`` drawn with replacement: row r of
    ``values[rng.integers(0, n, size=(n_boot, n))]`` averaged, drawn and averaged block by block (the
    same numbers, without an n_boot x n temporary)."""
    values = np.asarray(values)
    return np.concatenate([values[rng.integers(0, values.size, size=(min(chunk, n_boot - start), values.size))]
                           .mean(axis=1) for start in range(0, n_boot, chunk)])


def cluster_bootstrap(x, y, clusters, *, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """OLS slopes of ``n_boot`` datasets made of seeds drawn with replacement (whole seeds kept).

    A resample is a vector of multiplicities w over the G seeds (:func:`bootstrap_multiplicities`),
    so its slope follows from the weighted per-seed sums S = w @ sums:
    b = (n Sxy - Sx Sy) / (n Sxx - Sx^2). O(n_boot · G), with no per-resample Python work.
    Resamples whose x is constant (possible only when some seeds ran a single batch size) give NaN
    and are dropped.
    """
    x, y, clusters = _check_xy(x, y, clusters)
    with np.errstate(all="ignore"):
        sums = _cluster_sums(x - x.mean(), y - y.mean(), clusters)  # centred: a constant y gives exactly 0
        totals = np.concatenate([weights @ sums for weights in bootstrap_multiplicities(sums.shape[0], n_boot, rng)])
        n, sx, sy, sxx, sxy = totals.T
        denominator = n * sxx - sx * sx
        slopes = (n * sxy - sx * sy) / denominator
        return slopes[denominator > 1e-12 * np.maximum(n * sxx, 1.0)]


def percentile_ci(samples, level: float) -> tuple[float, float]:
    lo, hi = np.quantile(np.asarray(samples), [0.5 - level / 2.0, 0.5 + level / 2.0])
    return float(lo), float(hi)


@dataclass(frozen=True)
class PageResult:
    statistic: float
    p_decreasing: float
    p_increasing: float
    n_blocks: int
    method: str


def page_trend(table) -> PageResult:
    """Page's L on a (seeds × batch sizes, ascending) table: both one-sided trend p-values.

    With ties inside a block the exact null distribution does not apply; the asymptotic one is used.
    """
    table = np.asarray(table, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] < 3:
        raise ValueError(f"Page's L needs >= 2 complete seeds × >= 3 batch sizes, got a {table.shape} table")
    ties = bool(np.any(np.diff(np.sort(table, axis=1), axis=1) == 0))
    method = "asymptotic" if ties else "auto"
    columns = table.shape[1]
    up = _st.page_trend_test(table, predicted_ranks=np.arange(1, columns + 1), method=method)
    down = _st.page_trend_test(table, predicted_ranks=np.arange(columns, 0, -1), method=method)
    return PageResult(float(down.statistic), float(down.pvalue), float(up.pvalue), table.shape[0], down.method)


def holm(p_values) -> np.ndarray:
    """Holm step-down adjusted p-values: p~_(i) = max_{j<=i} min(1, (m-j+1) p_(j)); NaN entries are ignored
    (statsmodels' ``multipletests(method="holm")`` on the others)."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(p_values, dtype=np.float64)
    adjusted = np.full_like(p, np.nan)
    valid = np.flatnonzero(~np.isnan(p))
    if valid.size == 0:
        return adjusted
    if np.any((p[valid] < 0) | (p[valid] > 1)):
        raise ValueError(f"p-values must lie in [0, 1], got {p[valid].min()}..{p[valid].max()}")
    adjusted[valid] = multipletests(p[valid], method="holm")[1]
    return adjusted

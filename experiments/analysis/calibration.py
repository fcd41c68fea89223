"""Calibration of the decision rules on simulated studies with a known truth.

Two levels:

* **Verdict level** (what the report shows): whole simulated studies in the layout of a real one
  — its batch sizes and seed count, and for every method its own noise — run through the same
  functions as the real analysis, counting each verdict.

  - Fixed budget (:func:`fixed_budget_layout`, :func:`verdict_calibration`): every method's
    performance is ``shape(B) + u_s + v_s (x - mean x) + e + eta_B`` with its own run noise s.d.,
    seed-shift s.d. and seed-slope s.d. (:func:`~affdiv.experiments.analysis.contrast.noise_components`,
    moments, curvature excluded), the *shared batch-size shock* eta_B ~ N(0, shock_sd^2) common to
    all seeds of a method at B (what a data split shared by the seeds produces), and the study's
    own curvature: the shape is the mean cell curve of its baselines. The planted effect is an
    extra fall of the corrected layers after the shape's peak, reaching ``effect`` at the largest
    batch size. Effect 0: "supported" is a false positive. Effect >= margin: "supported" is power.
  - Steps to target (:func:`target_layout`, :func:`target_calibration`): every method's steps
    follow the fitted curve S_min (1 + B_crit/B) with its fitted run noise and seed shift, censored
    at the study's max_steps; the baselines share one reference B_crit (the geometric mean of the
    fitted ones) and the corrected layers get ``ratio`` times it. Planted ratios 1, 0.9, 0.81,
    0.707 (about the equivalence margin 2^-1/2) and 0.5, and each pair's measured ratio; at each, the rate of
    every pair outcome class (smaller, smaller within the margin, equivalent, larger, unclear).
    Ratio 1: "supported" is a false positive and the pair test's rejection rate is its size; below
    1: power (at the measured ratio: the power the study had against what it found).

* **Test level** (the slope tests, now descriptive; :func:`calibrate`): rejection rates of the
  slope tests on sweeps with a planted linear slope, as before.

A rate r over n simulated studies has Monte-Carlo standard error sqrt(r (1 - r) / n).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from affdiv.experiments.analysis import contrast, stats
from affdiv.experiments.analysis.design import StudyAnalysis, design_of, joint
from affdiv.vocabulary import FIXED_BUDGET, JOINT_VERDICTS, RATIO_CLASSES, STEPS_TO_TARGET, TARGET_METRIC

TESTS = ("falls", "differential", "page", "bootstrap", "flat")


# ------------------------------------------------------------------------- slope tests (descriptive)
@dataclass(frozen=True)
class Layout:
    """The shape and noise of a simulated sweep with a linear trend (the slope tests' calibration)."""

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
    }
    return {test: bool(decide[test]()) for test in tests}


@dataclass(frozen=True)
class Calibration:
    """Rejection rates of the slope tests: ``rates[test][i]`` at planted slope ``planted[i]``."""

    planted: tuple[float, ...]
    rates: dict[str, tuple[float, ...]]
    n_sims: int
    alpha: float
    margin: float
    layout: Layout
    seed: int

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
                "layout": asdict(self.layout), "seed": self.seed}


@dataclass(frozen=True)
class CalibrationOptions:
    """How :func:`calibrate` simulates and tests: ``n_sims`` sweeps per planted slope, the level
    ``alpha``, the TOST ``margin`` per doubling of B, ``n_boot`` bootstrap draws, the ``seed`` of
    the simulations and the ``tests`` counted (some of :data:`TESTS`)."""

    n_sims: int = 1000
    alpha: float = 0.05
    margin: float = 0.005
    n_boot: int = 1000
    seed: int = 0
    tests: tuple[str, ...] = TESTS

    def __post_init__(self):
        object.__setattr__(self, "tests", tuple(self.tests))
        if self.n_sims < 1:
            raise ValueError(f"n_sims must be >= 1, got {self.n_sims}")
        unknown = sorted(set(self.tests) - set(TESTS))
        if unknown:
            raise ValueError(f"tests: unknown test(s) {unknown}; expected some of {TESTS}")


def calibrate(planted: Sequence[float], options: CalibrationOptions = CalibrationOptions(), *,
              layout: Layout = Layout(), progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Rejection rate of every slope test at every planted slope (metric units per doubling of B),
    simulated in ``layout`` as ``options`` says.

    At slope 0 the rate of 'falls', 'differential', 'page' and 'bootstrap' is a false-positive
    rate; the rate of 'flat' (TOST) there is its power, and its size is read at slope = ±margin.
    """
    n_sims, alpha, margin, n_boot, seed, tests = (options.n_sims, options.alpha, options.margin, options.n_boot,
                                                  options.seed, options.tests)
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


# ----------------------------------------------------------------------------- verdict level
@dataclass(frozen=True)
class MethodModel:
    """One method of a simulated fixed-budget study (performance scale)."""

    role: str
    noise_sd: float
    seed_sd: float = 0.0
    slope_sd: float = 0.0


@dataclass(frozen=True)
class StudyLayout:
    """A fixed-budget study to simulate: the shape is the performance per batch size without effect."""

    batch_sizes: tuple[int, ...]
    n_seeds: int
    shape: tuple[float, ...]
    methods: dict[str, MethodModel]
    margin: float
    test_baselines: bool
    shock_sd: float = 0.0

    def __post_init__(self):
        if len(self.batch_sizes) < 2 or len(self.shape) != len(self.batch_sizes):
            raise ValueError(f"need >= 2 batch sizes and one shape value per batch size, got {self.batch_sizes} "
                             f"and {self.shape}")
        if self.n_seeds < 2:
            raise ValueError(f"need >= 2 seeds, got {self.n_seeds}")
        if not any(m.role == "corrected" for m in self.methods.values()):
            raise ValueError("the layout has no corrected method: there is no verdict to calibrate")

    def effect_profile(self) -> np.ndarray:
        """h(B): 0 up to the shape's peak, then a linear fall in log2 B to -1 at the largest B."""
        x = np.log2(np.asarray(self.batch_sizes, dtype=np.float64))
        peak = int(np.argmax(self.shape))
        if peak == len(x) - 1:
            return -(np.arange(len(x)) == len(x) - 1).astype(np.float64)
        return -np.clip((x - x[peak]) / (x[-1] - x[peak]), 0.0, None)

    def describe(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "n_seeds": self.n_seeds, "shape": list(self.shape),
                "margin": self.margin, "test_baselines": self.test_baselines, "shock_sd": self.shock_sd,
                "methods": {m: asdict(model) for m, model in self.methods.items()}}


def simulate_study(layout: StudyLayout, effect: float, rng: np.random.Generator) -> dict[str, list[dict]]:
    """One simulated study: {method: records {method, batch_size, seed, metric}} (metric = performance)."""
    x = np.log2(np.asarray(layout.batch_sizes, dtype=np.float64))
    xc = x - x.mean()
    shape = np.asarray(layout.shape, dtype=np.float64)
    fall = layout.effect_profile()
    out = {}
    for method, model in layout.methods.items():
        curve = shape + (effect * fall if model.role == "corrected" else 0.0)
        shock = rng.normal(0.0, layout.shock_sd, size=x.size) if layout.shock_sd > 0 else 0.0
        u = rng.normal(0.0, model.seed_sd, size=(layout.n_seeds, 1))
        v = rng.normal(0.0, model.slope_sd, size=(layout.n_seeds, 1))
        e = rng.normal(0.0, model.noise_sd, size=(layout.n_seeds, x.size))
        table = curve + shock + u + v * xc + e
        out[method] = [{"method": method, "batch_size": b, "seed": s, "metric": float(table[s, j])}
                       for s in range(layout.n_seeds) for j, b in enumerate(layout.batch_sizes)]
    return out


def fixed_budget_verdicts(layout: StudyLayout, rows: Mapping[str, Sequence[Mapping]], alpha: float) -> dict:
    """The verdicts the real rule gives on simulated rows (the same functions as ``analyse``)."""
    methods = {m: {"role": model.role, "status": "ok", "n_runs": len(rows[m])} for m, model in layout.methods.items()}
    baselines = [m for m, model in layout.methods.items() if model.role == "baseline"]
    contrast.group_contrasts(methods, rows, metric="metric", sign=1.0, alpha=alpha, margin=layout.margin,
                             baselines=baselines, noise=False)
    joint = contrast.assign_verdicts(methods, alpha=alpha, test_baselines=layout.test_baselines)
    return {"joint": joint["verdict"], "methods": {m: r["verdict"] for m, r in methods.items()},
            "pairs": {f"{m} vs {b}": d.get("p_less", 1.0) < alpha for m, r in methods.items()
                      for b, d in r.get("did", {}).items()}}


@dataclass(frozen=True)
class VerdictCalibration:
    """Verdict rates of a decision rule on simulated studies: ``joint[verdict][i]`` at ``effects[i]``."""

    design: str
    effect_name: str
    effects: tuple[float, ...]
    null_effect: float  # the effect at which 'supported' is a false positive
    joint: dict[str, tuple[float, ...]]
    methods: dict[str, tuple[float, ...]]  # rate of 'supported' per corrected method
    pairs: dict[str, tuple[float, ...]]  # rejection rate of each pair's one-sided test (p < alpha)
    pair_event: str
    n_sims: int
    alpha: float
    seed: int
    layout: dict
    scenarios: dict = field(default_factory=dict)  # {name: VerdictCalibration.to_dict()} (e.g. shared shocks)
    # Steps to target: {pair: {class: rates}}, the rate of each of RATIO_CLASSES at each planted ratio.
    classes: dict = field(default_factory=dict)
    # Steps to target: {pair: {"ratio": the pair's measured ratio, "power": rate of p < alpha there}}.
    measured: dict = field(default_factory=dict)

    def mc_se(self, rate: float) -> float:
        return float(math.sqrt(rate * (1 - rate) / self.n_sims))

    def rate(self, verdict: str, effect: float) -> float:
        if effect not in self.effects:
            raise ValueError(f"effect {effect} was not simulated; the effects are {self.effects}")
        return self.joint[verdict][self.effects.index(effect)]

    def to_dict(self) -> dict:
        return {"design": self.design, "effect_name": self.effect_name, "effects": list(self.effects),
                "null_effect": self.null_effect, "joint": {k: list(v) for k, v in self.joint.items()},
                "methods": {k: list(v) for k, v in self.methods.items()},
                "pairs": {k: list(v) for k, v in self.pairs.items()}, "pair_event": self.pair_event,
                "n_sims": self.n_sims, "alpha": self.alpha, "seed": self.seed, "layout": self.layout,
                "scenarios": self.scenarios, "classes": {p: {k: list(v) for k, v in c.items()}
                                                         for p, c in self.classes.items()},
                "measured": self.measured}


def _rates(counts: list[dict], n: int) -> dict[str, tuple[float, ...]]:
    keys = sorted({k for c in counts for k in c})
    return {k: tuple(c.get(k, 0) / n for c in counts) for k in keys}


def verdict_calibration(layout: StudyLayout, effects: Sequence[float], *, n_sims: int = 200, alpha: float = 0.05,
                        seed: int = 0, progress: Callable[[int, int], None] | None = None) -> VerdictCalibration:
    """Verdict rates of the fixed-budget rule at each planted extra fall (performance units)."""
    if n_sims < 1:
        raise ValueError(f"n_sims must be >= 1, got {n_sims}")
    effects = tuple(float(e) for e in effects)
    joint, methods, pairs = [], [], []
    for i, effect in enumerate(effects):
        rng = np.random.default_rng([seed, int(np.float64(effect).view(np.uint64)), 3])
        j_count, m_count, p_count = dict.fromkeys(JOINT_VERDICTS, 0), {}, {}
        for _ in range(n_sims):
            result = fixed_budget_verdicts(layout, simulate_study(layout, effect, rng), alpha)
            j_count[result["joint"]] += 1
            for m, v in result["methods"].items():
                if layout.methods[m].role == "corrected":
                    m_count[m] = m_count.get(m, 0) + (v == "supported")
            for name, rejected in result["pairs"].items():
                p_count[name] = p_count.get(name, 0) + rejected
        joint.append(j_count)
        methods.append(m_count)
        pairs.append(p_count)
        if progress is not None:
            progress(i + 1, len(effects))
    return VerdictCalibration(FIXED_BUDGET, "planted extra fall of the corrected layers at the largest batch "
                              "size (performance units)", effects, 0.0, _rates(joint, n_sims),
                              _rates(methods, n_sims), _rates(pairs, n_sims),
                              "the one-sided test of DiD < 0 rejects (p < alpha)", n_sims, alpha, seed,
                              layout.describe())


def fixed_budget_layout(analysis: StudyAnalysis, *, shock_sd: float = 0.0) -> StudyLayout:
    """The layout of a real fixed-budget analysis: its primary group's batch sizes, seed count and
    per-method noise (``noise`` of each method, moments), and its baselines' mean curve as the shape."""
    methods = analysis.groups[analysis.primary_group]["methods"]
    fitted = {m: r for m, r in methods.items() if r.get("noise", {}).get("status") == "ok" and r["role"] != "other"}
    if not any(r["role"] == "corrected" for r in fitted.values()):
        raise ValueError("no corrected method of the primary group has a noise estimate (needs >= 3 batch sizes "
                         "and >= 2 complete seeds)")
    shapes = [np.asarray(r["noise"]["cell_means"]) for r in fitted.values() if r["role"] == "baseline"] or \
             [np.asarray(r["noise"]["cell_means"]) for r in fitted.values()]
    batch_sizes = tuple(next(iter(fitted.values()))["noise"]["batch_sizes"])
    if any(tuple(r["noise"]["batch_sizes"]) != batch_sizes for r in fitted.values()):
        raise ValueError("the methods of the primary group ran different batch sizes; no common layout")
    shape = np.mean(shapes, axis=0)
    shape = shape - shape.max()
    if analysis.settings.get("test_baselines", True):
        peak = int(np.argmax(shape))
        shape[peak:] = shape[peak]  # the prediction's world: the baselines do not fall after their peak
    return StudyLayout(batch_sizes, int(min(r["noise"]["n_seeds"] for r in fitted.values())),
                       tuple(float(v) for v in shape),
                       {m: MethodModel(r["role"], r["noise"]["noise_sd"], r["noise"]["seed_sd"], r["noise"]["slope_sd"])
                        for m, r in fitted.items()},
                       analysis.settings["contrast_margin"], bool(analysis.settings.get("test_baselines", True)),
                       shock_sd)


# -------------------------------------------------------------------------- steps to target
@dataclass(frozen=True)
class TargetMethod:
    role: str
    s_min: float
    b_crit: float
    noise_sd: float
    seed_sd: float = 0.0


@dataclass(frozen=True)
class TargetLayout:
    batch_sizes: tuple[int, ...]
    n_seeds: int
    max_steps: int
    methods: dict[str, TargetMethod]
    reference_b_crit: float

    def describe(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "n_seeds": self.n_seeds, "max_steps": self.max_steps,
                "reference_b_crit": self.reference_b_crit,
                "methods": {m: asdict(model) for m, model in self.methods.items()}}

    @classmethod
    def from_description(cls, description: Mapping) -> TargetLayout:
        """The layout :meth:`describe` wrote (a report's ``summary.json`` ``calibration.layout``)."""
        return cls(tuple(description["batch_sizes"]), description["n_seeds"], description["max_steps"],
                   {m: TargetMethod(**model) for m, model in description["methods"].items()},
                   description["reference_b_crit"])


def target_layout(analysis: StudyAnalysis) -> TargetLayout:
    """The layout of a real steps-to-target analysis (primary group): its batch sizes, seeds and
    max_steps, each method's fitted S_min, run noise and seed shift; the reference B_crit is the
    geometric mean of the resolved baselines' fits (of every resolved method if none)."""
    fits = analysis.groups[analysis.primary_group]["critical_batch"]
    fitted = {m: r for m, r in fits.items() if r.get("status") == "ok" and "noise_sd" in r and r["role"] != "other"}
    if not any(r["role"] == "corrected" for r in fitted.values()):
        raise ValueError("no corrected method of the primary group has a fitted curve to simulate")
    references = [r["b_crit"] for r in fitted.values() if r["role"] == "baseline" and r.get("resolved")] or \
                 [r["b_crit"] for r in fitted.values() if r.get("resolved")]
    if not references:
        raise ValueError("no method's B_crit is resolved by the batch sizes: no reference B_crit to simulate")
    reference = float(np.exp(np.mean(np.log(references))))
    batch_sizes = tuple(sorted({b for r in fitted.values() for b in r["batch_sizes"]}))
    n_seeds = int(min(r["n_seeds"] for r in fitted.values()))
    max_steps = int(max(c["max_steps"] for r in fitted.values() for c in r["cells"]))
    return TargetLayout(batch_sizes, n_seeds, max_steps,
                        {m: TargetMethod(r["role"], r["s_min"], reference, r["noise_sd"], r.get("seed_sd", 0.0))
                         for m, r in fitted.items()}, reference)


def _simulate_steps(layout: TargetLayout, ratio: float, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Steps of one simulated study, {method: (seeds, batch sizes) array} (see
    :func:`simulate_target_study`); values above max_steps are censored by the caller."""
    b = np.asarray(layout.batch_sizes, dtype=np.float64)
    out = {}
    for method, model in layout.methods.items():
        b_crit = layout.reference_b_crit * (ratio if model.role == "corrected" else 1.0)
        log_median = math.log(model.s_min) + np.log1p(b_crit / b)
        shift = rng.normal(0.0, model.seed_sd, size=(layout.n_seeds, 1))
        steps = np.ceil(np.exp(log_median + shift + rng.normal(0.0, model.noise_sd, size=(layout.n_seeds, b.size))))
        out[method] = np.maximum(steps, 1.0)
    return out


def simulate_target_study(layout: TargetLayout, ratio: float, rng: np.random.Generator) -> list[dict]:
    """Records of one simulated steps-to-target study: corrected methods at ``ratio`` x the reference
    B_crit, baselines at the reference; log-normal run noise and seed shifts; censored at max_steps.
    The records are typed as :func:`~affdiv.experiments.analysis.critical_batch.check_target_records`
    returns them (``log_steps`` included)."""
    records = []
    for method, steps in _simulate_steps(layout, ratio, rng).items():
        for s in range(layout.n_seeds):
            for j, batch_size in enumerate(layout.batch_sizes):
                value = int(steps[s, j])
                reached = value <= layout.max_steps
                records.append({"method": method, "batch_size": batch_size, "seed": s, "max_steps": layout.max_steps,
                                TARGET_METRIC: float(value) if reached else None, "censored": int(not reached),
                                "log_steps": math.log(value if reached else layout.max_steps)})
    return records


#: Measured ratios outside this range are not planted (a pair that far off needs no calibration there).
MEASURED_RANGE = (0.05, 2.0)
#: The planted ratios of :func:`target_calibration` by default: no effect, then across the decision
#: region (about the equivalence margin 2^-1/2 = 0.7071 among them), to a halving.
TARGET_RATIOS = (1.0, 0.9, 0.81, 0.707, 0.5)


def target_calibration(layout: TargetLayout, ratios: Sequence[float] = TARGET_RATIOS, *, n_sims: int = 200,
                       alpha: float = 0.05, seed: int = 0,
                       progress: Callable[[int, int], None] | None = None) -> VerdictCalibration:
    """Rates of the steps-to-target rule's outcomes at each planted B_crit ratio: the joint verdict,
    each corrected layer's 'supported', each pair's one-sided test (p < alpha) and each pair's
    class (every one of ``RATIO_CLASSES``: ``classes[pair][class][i]`` at ``ratios[i]``).

    The curves of all simulated studies (and their leave-one-seed-out refits) are fitted in one
    vectorised call per method; each study is then decided by the rule's own functions (the
    method's status, the paired jackknife ratio test and its class, the corrected layer's and the
    joint verdict: what :func:`~affdiv.experiments.analysis.critical_batch.analyse_group` decides
    with, less its descriptive summaries; no bootstrap: the rule does not use it). A study at
    ratio r depends only on (seed, r), so the rates at a ratio do not depend on the others run."""
    from affdiv.experiments.analysis.critical_batch import fit_curves

    if n_sims < 1:
        raise ValueError(f"n_sims must be >= 1, got {n_sims}")
    ratios = tuple(float(r) for r in ratios)
    if not ratios or not all(math.isfinite(r) and r > 0 for r in ratios):
        raise ValueError(f"planted ratios must be finite and > 0, got {list(ratios)}")
    corrected = [m for m, t in layout.methods.items() if t.role == "corrected"]
    baselines = [m for m, t in layout.methods.items() if t.role == "baseline"]
    g, n_batch = layout.n_seeds, len(layout.batch_sizes)
    pattern = np.vstack([np.ones((1, g)), 1.0 - np.eye(g)])  # the data, then leave one seed out
    # The runs of a method in the order the analysis sorts them: by batch size, then seed.
    batch = np.repeat(np.asarray(layout.batch_sizes, dtype=np.float64), g)
    seed_index = np.tile(np.arange(g), n_batch)
    weights = np.tile(pattern[:, seed_index], (n_sims, 1))
    joint, methods, pairs = [], [], []
    classes = {f"{c} vs {b}": {k: [] for k in RATIO_CLASSES} for c in corrected for b in baselines}
    for i, ratio in enumerate(ratios):
        rng = np.random.default_rng([seed, int(np.float64(ratio).view(np.uint64)), 4])
        steps = [_simulate_steps(layout, ratio, rng) for _ in range(n_sims)]
        fits, data = {}, {}
        for method in layout.methods:
            values = np.stack([study[method].T.ravel() for study in steps])  # (n_sims, runs)
            censored = values > layout.max_steps
            log_steps = np.log(np.where(censored, layout.max_steps, values))
            data[method] = (log_steps, censored)
            fits[method] = fit_curves(batch, np.repeat(log_steps, g + 1, axis=0),
                                      np.repeat(censored, g + 1, axis=0), weights)
        j_count, m_count, p_count = dict.fromkeys(JOINT_VERDICTS, 0), {}, {}
        c_count = {pair: dict.fromkeys(RATIO_CLASSES, 0) for pair in classes}
        for k in range(n_sims):
            rows = slice(k * (g + 1), (k + 1) * (g + 1))
            result = _decide_study({m: (batch, log_steps[k], censored[k], seed_index)
                                    for m, (log_steps, censored) in data.items()},
                                   {m: _rows(f, rows) for m, f in fits.items()}, corrected, baselines, g, alpha)
            j_count[result["joint"]] += 1
            for m in corrected:
                m_count[m] = m_count.get(m, 0) + (result["methods"][m] == "supported")
            for pair, outcome in result["pairs"].items():
                p_count[pair] = p_count.get(pair, 0) + (outcome.get("p", 1.0) < alpha)
                c_count[pair][outcome["class"]] += 1
        joint.append(j_count)
        methods.append(m_count)
        pairs.append(p_count)
        for pair, counts in c_count.items():
            for kind, count in counts.items():
                classes[pair][kind].append(count / n_sims)
        if progress is not None:
            progress(i + 1, len(ratios))
    return VerdictCalibration(STEPS_TO_TARGET, "planted ratio B_crit(corrected) / B_crit(baseline)", ratios, 1.0,
                              _rates(joint, n_sims), _rates(methods, n_sims), _rates(pairs, n_sims),
                              "the one-sided test of ratio < 1 rejects (p < alpha)", n_sims, alpha, seed,
                              layout.describe(),
                              classes={p: {k: tuple(v) for k, v in c.items()} for p, c in classes.items()})


def _rows(fit, rows: slice):
    """The rows of a :class:`~affdiv.experiments.analysis.critical_batch.CurveFit` of one study."""
    return type(fit)(fit.log_b_crit[rows], fit.log_s_min[rows], fit.sigma[rows], fit.at_edge[rows], fit.valid[rows])


def _decide_study(runs: Mapping[str, tuple], fits: Mapping, corrected: Sequence[str], baselines: Sequence[str],
                  n_seeds: int, alpha: float) -> dict:
    """The verdicts of one simulated study (no flags: simulated runs neither diverge nor sit on an LR
    grid's edge) from its runs {method: (batch, log_steps, censored, seed_index)} and its fits
    (row 0 the data, rows 1..G leave one seed out), by the rule's functions in
    :mod:`~affdiv.experiments.analysis.critical_batch`: {"joint", "methods": {corrected: verdict},
    "pairs": {"c vs b": the ratio test's result}}."""
    from affdiv.experiments.analysis.critical_batch import (
        UNCLEAR,
        MethodData,
        _corrected_verdict,
        _method_status,
        _ratio,
    )

    status, resolved = {}, {}
    for method, (batch, log_steps, censored, seed_index) in runs.items():
        data = MethodData(batch, log_steps, censored, seed_index, tuple(range(n_seeds)))
        status[method] = _method_status(data, n_seeds)
        fit = fits[method]
        # As the analysis: resolved when every leave-one-seed-out refit is valid and no fit sits on the edge.
        resolved[method] = status[method] == "ok" and bool(fit.valid[1:].all()) and not bool(fit.at_edge.any())
    every = set(range(n_seeds))
    statuses = {m: {"status": s} for m, s in status.items()}
    pairs, verdicts = {}, {}
    for c in corrected:
        against = {b: _ratio(fits[c], fits[b], every, every, n_seeds, alpha, 0) if resolved[c] and resolved[b]
                   else {"class": UNCLEAR, "status": "no ratio: a B_crit is unresolved"} for b in baselines}
        verdicts[c] = _corrected_verdict(c, against, statuses, alpha)[0]
        pairs.update({f"{c} vs {b}": outcome for b, outcome in against.items()})
    return {"joint": joint(list(verdicts.values())), "methods": verdicts, "pairs": pairs}


# ------------------------------------------------------------------------------- dispatch
def calibrate_target(analysis: StudyAnalysis, *, n_sims: int = 200, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> VerdictCalibration:
    """Verdict-level calibration in the layout of a steps-to-target analysis: the ratios of
    :data:`TARGET_RATIOS` and, as further planted points, each pair's measured ratio at the primary
    target (where estimated and within [``MEASURED_RANGE``]); ``measured`` gives each pair the
    power of its test at its own ratio."""
    primary = analysis.groups[analysis.primary_group]
    measured = {f"{c} vs {b}": pair["ratio"] for c, against in primary["ratios"].items()
                for b, pair in against.items()
                if pair.get("status") == "ok" and MEASURED_RANGE[0] <= pair["ratio"] <= MEASURED_RANGE[1]}
    ratios = sorted({*TARGET_RATIOS, *measured.values()}, reverse=True)
    result = target_calibration(target_layout(analysis), ratios, n_sims=n_sims, alpha=analysis.settings["alpha"],
                                seed=seed, progress=progress)
    return VerdictCalibration(**{**result.__dict__, "measured": {
        pair: {"ratio": ratio, "power": result.pairs[pair][result.effects.index(ratio)]}
        for pair, ratio in measured.items()}})


def calibrate_fixed_budget(analysis: StudyAnalysis, *, n_sims: int = 200, seed: int = 0,
                           progress: Callable[[int, int], None] | None = None) -> VerdictCalibration:
    """Verdict-level calibration in the layout of a fixed-budget analysis: planted extra falls of
    0, 1, 2 and 3 contrast margins, without shared shocks, and the same with shocks of the median
    run noise (what a data split shared by every seed adds) as a second scenario."""
    layout = fixed_budget_layout(analysis)
    alpha = analysis.settings["alpha"]
    effects = [k * layout.margin for k in (0.0, 1.0, 2.0, 3.0)]
    result = verdict_calibration(layout, effects, n_sims=n_sims, alpha=alpha, seed=seed, progress=progress)
    shock = float(np.median([m.noise_sd for m in layout.methods.values()]))
    shocked = verdict_calibration(StudyLayout(**{**layout.__dict__, "shock_sd": shock}), effects[:2],
                                  n_sims=n_sims, alpha=alpha, seed=seed + 1)
    return VerdictCalibration(**{**result.__dict__, "scenarios": {f"shared batch-size shocks, s.d. {shock:.3g}":
                                                                  shocked.to_dict()}})


def calibrate_for(analysis: StudyAnalysis, *, n_sims: int = 200, seed: int = 0,
                  progress: Callable[[int, int], None] | None = None) -> VerdictCalibration:
    """Verdict-level calibration in the layout of a real analysis, by its design
    (:func:`calibrate_fixed_budget`, :func:`calibrate_target`)."""
    return design_of(analysis.design).calibrate(analysis, n_sims=n_sims, seed=seed, progress=progress)

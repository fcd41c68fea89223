"""The gradient noise scale B_simple on problems whose gradient mean and covariance are known."""

import math

import numpy as np
import pytest
import torch

from affdiv.experiments.runs import noise_scale as ns


def test_estimates_are_exact_on_the_expected_squared_norms():
    # E|G_B|^2 = |G|^2 + tr(Sigma)/B: plugging the expectations in gives the truth back exactly.
    g2, trace = 2.5, 40.0
    for b_small, b_big in ((1, 2), (8, 256), (32, 1024)):
        e = ns.estimate(g2 + trace / b_small, g2 + trace / b_big, b_small, b_big)
        assert e.grad_sq == pytest.approx(g2, rel=1e-12) and e.trace == pytest.approx(trace, rel=1e-12)
        assert e.b_simple == pytest.approx(trace / g2, rel=1e-12)
    assert math.isnan(ns.estimate(10.0, 1.0, 4, 8).b_simple)  # |G|^2 estimate -8 <= 0: no B_simple
    assert math.isnan(ns.estimate(1.0, 1.0 + 1e-9, 4, 8).b_simple)  # tr(Sigma) estimate < 0: none either
    for bad in ((8, 8), (16, 8), (0, 8)):
        with pytest.raises(ValueError, match="batch sizes"):
            ns.estimate(1.0, 0.5, *bad)
    # A diverging model's overflowed gradients: no estimate, not an error (it must not stop a sweep).
    for overflowed in ((math.inf, 1.0), (1.0, math.nan), (math.nan, math.inf)):
        e = ns.estimate(*overflowed, 4, 8)
        assert all(math.isnan(v) for v in (e.b_simple, e.grad_sq, e.trace)), overflowed
    with pytest.raises(ValueError, match="squared norms must be >= 0, got -1.0 and 1.0"):
        ns.estimate(-1.0, 1.0, 4, 8)


class Linear(torch.nn.Module):
    """loss(theta; a) = theta . a: the per-example gradient is a itself, whatever theta is."""

    def __init__(self, dim):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))


def linear_loss(model, x, _y):
    return (x @ model.theta).mean()


def test_unbiased_on_examples_with_a_known_gradient_covariance():
    # N examples a_i ~ N(mu, Sigma) in 10 dimensions, Sigma = diag(1..10) (tr 55), |mu|^2 = 1.
    # Batches are drawn with replacement, so the estimators are unbiased for the examples' own mean
    # and covariance (computed exactly below). Over 400 independent measurements (4 draws each),
    # each mean estimate lies within 4 Monte-Carlo s.e. of its truth; B_simple is within 10%.
    rng = np.random.default_rng(0)
    dim, n = 10, 20000
    mu = np.full(dim, 1 / math.sqrt(dim))
    a = mu + rng.normal(size=(n, dim)) * np.sqrt(np.arange(1, dim + 1))
    x = torch.tensor(a)
    y = torch.zeros(n, dtype=torch.long)
    true_g2 = float(a.mean(0) @ a.mean(0))
    true_trace = float(a.var(0).sum())  # population (1/N) covariance of the examples
    model = Linear(dim)
    generator = torch.Generator().manual_seed(1)
    results = [ns.measure(model, x, y, b_small=4, b_big=64, draws=4, generator=generator, loss_fn=linear_loss)
               for _ in range(400)]
    for name, truth in (("grad_sq", true_g2), ("trace", true_trace)):
        values = np.array([getattr(r, name) for r in results])
        se = values.std(ddof=1) / math.sqrt(values.size)
        print(f"{name}: mean {values.mean():.4f} ± {se:.4f}, truth {truth:.4f}")
        assert abs(values.mean() - truth) < 4 * se, name
    pooled = ns.estimate(np.mean([r.grad_sq + r.trace / 4 for r in results]),
                         np.mean([r.grad_sq + r.trace / 64 for r in results]), 4, 64)
    assert pooled.b_simple == pytest.approx(true_trace / true_g2, rel=0.1)


def test_the_batch_size_factors_matter():
    # A mutant that forgot the factors (|G|^2 ~ mean(|G_small|^2, |G_big|^2)) would be biased by
    # tr(Sigma)(1/b_small + 1/b_big)/2: on the example above that is ~7.3 against a truth of 1.
    e = ns.estimate(1.0 + 55 / 4, 1.0 + 55 / 64, 4, 64)
    assert e.grad_sq == pytest.approx(1.0) and (1.0 + 55 / 4 + 1.0 + 55 / 64) / 2 > 7


def test_record_columns_pick_the_first_and_last_measurement():
    measurements = [{"measurement": "noise_scale", "step": s, "b_simple": b} for s, b in ((500, 30.0), (0, 3.0),
                                                                                         (1000, 80.0))]
    measurements.append({"measurement": "other", "step": 2000, "b_simple": -1.0})
    assert ns.record_columns(measurements) == {"b_simple": 80.0, "b_simple_step": 1000, "b_simple_init": 3.0}
    assert ns.record_columns([]) == {}


def test_measurement_plugs_into_a_training_run():
    from affdiv.experiments.data.dataset import load_dataset
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.training import train_run

    data = load_dataset("digits", seed=0, val_fraction=0.1)
    config = RunConfig(dataset="digits", method="affine", batch_size=32, seed=0, budget="steps", length=4,
                       width=16, base_lr=0.1)
    result = train_run(config, data, measurements=[ns.measurement(every=2, b_small=8, b_big=64, draws=2)])
    steps = [m["step"] for m in result.measurements if m["measurement"] == "noise_scale"]
    assert steps == [0, 2, 4]
    columns = ns.record_columns(result.measurements)
    assert columns["b_simple_step"] == 4 and math.isfinite(columns["b_simple_init"])

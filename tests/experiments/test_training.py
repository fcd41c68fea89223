"""One training run: LR rules, budgets (steps to target included), the optimizers, determinism,
divergence, tuning on val, grid extension, config keys, the measurement hook."""

import dataclasses
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs import training
from affdiv.experiments.runs.config import MLP_METHODS, RunConfig, candidates, config_hash, learning_rates
from affdiv.experiments.runs.models import build_model
from affdiv.experiments.runs.optimizers import make_optimizer
from affdiv.experiments.runs.training import Measurement, metric_names, train_run

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(**changes):
    base = dict(dataset="digits", method="affine", batch_size=64, seed=0, depth=1, width=16, length=2)
    return RunConfig(**{**base, **changes})


def test_learning_rate_rules():
    # Closed forms from the module docstring, at B = 4 * ref: linear x4, sqrt x2.
    assert learning_rates(_config(lr_rule="constant", base_lr=0.1, batch_size=128, ref_batch_size=32)) == (0.1,)
    assert learning_rates(_config(lr_rule="linear", base_lr=0.1, batch_size=128, ref_batch_size=32)) == (0.4,)
    assert learning_rates(_config(lr_rule="sqrt", base_lr=0.1, batch_size=128, ref_batch_size=32)) == (0.2,)
    assert learning_rates(_config(lr_rule="tuned", lr_grid=[0.3, 0.01])) == (0.3, 0.01)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_first_step_of_each_optimizer(optimizer):
    # The first update has a closed form: SGD and momentum SGD (buffer = grad at step 1):
    # w - lr g; Adam: m/(sqrt(v)+eps) with bias correction = g/(|g|+eps), so w - lr sign(g) up to
    # eps/|g| <= 1e-8/0.5 relative (float64; no weight decay in any case).
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    grad = torch.tensor([0.5, -1.5, 2.0], dtype=torch.float64)
    opt = make_optimizer(optimizer, [w], lr=0.1, momentum=0.9)
    w.grad = grad.clone()
    opt.step()
    expected = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64) - 0.1 * (
        grad.sign() if optimizer == "adam" else grad
    )
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-8)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
        ({"batch_size": 2.5}, "batch_size must be an integer >= 1, got 2.5"),
        ({"batch_size": True}, "batch_size must be an integer >= 1, got True"),
        ({"method": "bn"}, "unknown method 'bn'; expected one of: affine"),
        ({"lr_rule": "cosine"}, "unknown lr_rule 'cosine'; expected one of: constant, linear, sqrt, tuned"),
        ({"budget": "minutes"}, "unknown budget 'minutes'"),
        ({"lr_rule": "tuned"}, "needs a non-empty lr_grid"),
        ({"base_lr": -1.0}, "base_lr must be > 0"),
        ({"val_fraction": 1.0}, "val_fraction must be a number in [0, 1), got 1.0"),
        ({"val_fraction": -0.1}, "val_fraction must be a number in [0, 1), got -0.1"),
        ({"lr_rule": "tuned", "lr_grid": (0.1,), "val_fraction": 0},
         "lr_rule 'tuned' selects the lr on the validation split: it needs val_fraction > 0, got 0"),
    ],
)
def test_bad_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(**changes)
    with pytest.raises(ValueError, match="unknown run setting"):
        RunConfig.from_dict({**_config().to_dict(), "weight_decay": 0.1})


def test_same_config_same_numbers_and_the_seed_matters(digits):
    first, second = train_run(_config(), digits), train_run(_config(), digits)
    assert first.metrics == second.metrics and first.curves == second.curves
    other = train_run(_config(seed=1), digits)
    assert other.curves != first.curves


def _keep_models(every: int, kept: dict) -> Measurement:
    """A measurement that keeps the model (a copy) at every ``every``-th step in ``kept``."""
    return Measurement("keep", every, lambda model, step, _data, _config: kept.__setitem__(step, model) or {})


def test_the_training_loop_takes_plain_sgd_steps(digits):
    # Two steps rebuilt by hand from the documented recipe: init under manual_seed(seed), batches
    # from randperm(seed), w <- w - lr * grad of the mean cross-entropy (no decay, no clipping).
    config = _config(method="batchnorm", budget="steps", length=2, base_lr=0.3, seed=5)
    kept = {}
    result = train_run(config, digits, measurements=[_keep_models(2, kept)])
    torch.manual_seed(5)
    reference = build_model("batchnorm", input_shape=digits.input_shape, num_classes=10, depth=1, width=16,
                            activation="tanh")
    order = torch.randperm(len(digits.train.y), generator=torch.Generator().manual_seed(5))
    for step in range(2):
        batch = order[step * 64 : (step + 1) * 64]
        reference.zero_grad()
        F.cross_entropy(reference(digits.train.x[batch]), digits.train.y[batch]).backward()
        with torch.no_grad():
            for param in reference.parameters():
                param -= 0.3 * param.grad
    assert result.metrics["steps"] == 2 and sorted(kept) == [0, 2]
    for got, want in zip(kept[2].state_dict().values(), reference.state_dict().values(), strict=True):
        # Same float32 operations in the same order; 1e-6 relative allows only for a different
        # but equivalent fused update kernel in torch.optim.SGD.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@settings(max_examples=8, deadline=None)
@given(method=st.sampled_from(sorted(MLP_METHODS)), seed=st.integers(0, 2**31 - 1), batch_size=st.integers(1, 300))
def test_any_config_repeats_exactly(digits, method, seed, batch_size):
    config = _config(method=method, seed=seed, batch_size=max(batch_size, 2), budget="steps", length=3)
    first, second = train_run(config, digits), train_run(config, digits)
    assert first.metrics == second.metrics and first.curves == second.curves


@pytest.mark.parametrize("budget, length", [("epochs", 2), ("steps", 7), ("steps", 30)])
def test_budget(digits, budget, length):
    result = train_run(_config(budget=budget, length=length), digits)
    per_epoch = len(digits.train.y) // 64  # the partial last batch is dropped
    steps = length * per_epoch if budget == "epochs" else length
    assert result.metrics["steps"] == steps
    assert [c["step"] for c in result.curves][-1] == steps
    assert len(result.curves) == math.ceil(steps / per_epoch) == result.metrics["epochs"]
    assert [c["epoch"] for c in result.curves] == list(range(1, len(result.curves) + 1))
    assert not {"steps_to_target", "censored", "max_steps", "target"} & set(result.metrics)  # target budget only
    assert result.metrics["diverged"] == 0
    if steps >= 30:  # enough SGD steps to learn something: well above chance (0.1)
        assert result.metrics["test_accuracy"] > 0.3


def test_divergence_is_a_result_not_a_crash(digits):
    result = train_run(_config(activation="identity", depth=2, base_lr=1e6), digits)
    assert result.metrics["diverged"] == 1
    assert result.metrics["test_accuracy"] == pytest.approx(0.1)  # chance: 1 / 10 classes
    assert math.isnan(result.metrics["test_loss"])


def test_without_a_validation_split_runs_train_and_still_detect_divergence():
    data = load_dataset("digits", val_fraction=0)
    assert len(data.val.y) == 0
    result = train_run(_config(val_fraction=0, budget="steps", length=30), data)
    assert all(c["val_loss"] is None and c["val_metric"] is None for c in result.curves)
    assert result.metrics["val_accuracy"] is None and result.metrics["val_loss"] is None
    assert result.metrics["diverged"] == 0 and result.metrics["test_accuracy"] > 0.3  # chance is 0.1
    blown = train_run(_config(val_fraction=0, activation="identity", base_lr=1e6), data)
    assert blown.metrics["diverged"] == 1 and not math.isfinite(blown.curves[-1]["train_loss"])
    with pytest.raises(ValueError, match="at least one sample, got an empty split"):
        training.evaluate(torch.nn.Linear(64, 10), data.val.x.flatten(1), data.val.y)


@pytest.mark.parametrize(
    "rule, unused, used",
    [
        (dict(optimizer="sgd"), dict(momentum=0.5), dict(base_lr=0.07)),
        (dict(optimizer="adam"), dict(momentum=0.5), dict(base_lr=0.07)),
        (dict(lr_rule="constant"), dict(ref_batch_size=8, lr_grid=(0.1,)), dict(base_lr=0.07)),
        (dict(lr_rule="linear"), dict(lr_grid=(0.1,)), dict(ref_batch_size=8)),
        (dict(lr_rule="tuned", lr_grid=(0.05, 0.2)), dict(ref_batch_size=8, base_lr=3.0), dict(lr_grid=(0.05,))),
        (dict(optimizer="momentum"), dict(lr_grid=(0.1,)), dict(momentum=0.5)),
    ],
)
def test_settings_a_run_ignores_do_not_change_its_key(digits, rule, unused, used):
    base, idle, changed = (_config(budget="steps", length=3, **{**rule, **extra}) for extra in ({}, unused, used))
    assert idle != base and idle.to_dict() == base.to_dict()
    assert config_hash(changed.to_dict()) != config_hash(base.to_dict())
    assert RunConfig.from_dict(idle.to_dict()).to_dict() == idle.to_dict()  # a stored dict is a valid config
    # The claim behind the normalisation, checked by training: the ignored settings change no number.
    first, second = train_run(base, digits), train_run(idle, digits)
    assert (first.metrics, first.curves) == (second.metrics, second.curves)


def test_tuned_picks_the_best_validation_lr_and_tests_once(digits, monkeypatch):
    grid = (0.001, 0.3, 1e6)  # too small, reasonable, diverging
    # Reference: each LR trained separately as a constant-rule run (same seed: same init, shuffles).
    separate = {lr: train_run(_config(lr_rule="constant", base_lr=lr), digits) for lr in grid}
    best = max((lr for lr in grid if not separate[lr].metrics["diverged"]),
               key=lambda lr: separate[lr].metrics["val_accuracy"])

    seen_sizes = []
    real_evaluate = training.evaluate
    monkeypatch.setattr(training, "evaluate", lambda m, x, y: seen_sizes.append(len(y)) or real_evaluate(m, x, y))
    tuned = train_run(_config(lr_rule="tuned", lr_grid=grid), digits)

    assert tuned.metrics["lr"] == best == 0.3 and tuned.metrics["lr_at_grid_edge"] == 0
    assert {k: v for k, v in tuned.metrics.items() if k != "lr"} == {
        k: v for k, v in separate[best].metrics.items() if k != "lr"
    }
    assert seen_sizes.count(len(digits.test.y)) == 1  # the test split is evaluated once, at the end
    assert len(digits.test.y) != len(digits.val.y)
    edge = train_run(_config(lr_rule="tuned", lr_grid=(0.001, 0.01)), digits)
    assert edge.metrics["lr"] == 0.01 and edge.metrics["lr_at_grid_edge"] == 1


def test_batch_larger_than_the_training_split_is_refused(digits):
    with pytest.raises(ValueError, match=f"batch_size 5000 exceeds the {len(digits.train.y)} training samples"):
        train_run(_config(batch_size=5000), digits)


# ----------------------------------------------------------------------------- config keys

# Two runs of the committed fashion study (docs/results/fashion/records.csv) with their stored
# keys: the settings added since must leave the key of every earlier config unchanged.
_COMMITTED = [
    ("8c939ea863a93192e17f0690acf7668da0f459bec7e0ac68fbeee4c24de1406c", dict(lr_rule="sqrt", lr_grid=[])),
    ("a9f848266379bb0aec878fc57e2c25d60001f0704133a0041ed3c3fe690991dd",
     dict(lr_rule="tuned", lr_grid=[0.0125, 0.05, 0.2, 0.8, 3.2, 12.8], base_lr=0.05, ref_batch_size=32)),
]


@pytest.mark.parametrize("key, rule", _COMMITTED)
def test_keys_of_earlier_configs_are_unchanged(key, rule):
    stored = {**dict(activation="tanh", base_lr=0.1, batch_size=16, budget="epochs", data_options={}, data_seed=0,
                     dataset="fashion-mnist", depth=3, device="cpu", length=4, method="affine", momentum=0.9,
                     optimizer="sgd", ref_batch_size=64, seed=0, val_fraction=0.1, width=256), **rule}
    assert config_hash(stored) == key
    config = RunConfig.from_dict(stored)
    assert config.to_dict() == stored and config_hash(config.to_dict()) == key
    # The new settings are idle under the old budgets (and at their old values): no new key.
    idle = RunConfig.from_dict({**stored, "target": 0.8, "eval_every": 7, "grid_extensions": 1, "momentum_grid": [0.5]})
    assert config_hash(idle.to_dict()) == key


def test_new_settings_enter_the_key_where_they_act():
    target = _config(budget="target", target=0.8, eval_every=5, length=100)
    assert {"target", "eval_every"} <= set(target.to_dict()) and "grid_extensions" not in target.to_dict()
    tuned = _config(budget="target", target=0.8, lr_rule="tuned", lr_grid=(0.1, 0.2))
    assert tuned.to_dict()["grid_extensions"] == 3
    assert config_hash(tuned.to_dict()) != config_hash(dataclasses.replace(tuned, grid_extensions=1).to_dict())
    grid = _config(optimizer="momentum", lr_rule="tuned", lr_grid=(0.1,), momentum_grid=(0.5, 0.9), momentum=0.1)
    assert grid.to_dict()["momentum_grid"] == [0.5, 0.9] and grid.to_dict()["momentum"] == 0.9  # momentum idle
    assert candidates(grid) == [(0.1, 0.5), (0.1, 0.9)]
    assert _config(dtype="float64").to_dict()["dtype"] == "float64" and "dtype" not in _config().to_dict()
    assert RunConfig.from_dict(target.to_dict()) == target


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"budget": "target"}, "budget 'target' needs a target validation accuracy in (0, 1], got None"),
        ({"budget": "target", "target": 1.5}, "in (0, 1], got 1.5"),
        ({"budget": "target", "target": 0.5, "val_fraction": 0}, "it needs val_fraction > 0, got 0"),
        ({"budget": "target", "target": 0.5, "lr_rule": "tuned", "lr_grid": (0.1, 0.4)},
         "spaced by at most x2; [0.1, 0.4] has a step of x4"),
        ({"eval_every": 0}, "eval_every must be an integer >= 1, got 0"),
        ({"momentum_grid": (0.9, 1.0)}, "every momentum in momentum_grid must be in [0, 1), got (0.9, 1.0)"),
        ({"grid_extensions": -1}, "grid_extensions must be an integer >= 0, got -1"),
        ({"dtype": "float16"}, "unknown dtype 'float16'; expected one of: float32, float64"),
    ],
)
def test_bad_target_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _config(**changes)


# ----------------------------------------------------------------------------- steps to target


def _target(**changes):
    return _config(**{"budget": "target", "target": 0.8, "eval_every": 5, "length": 200, "base_lr": 0.3, **changes})


def test_target_budget_records_steps_to_target(digits):
    result = train_run(_target(), digits)
    m, curves = result.metrics, result.curves
    assert (m["censored"], m["max_steps"], m["target"], m["diverged"]) == (0, 200, 0.8, 0)
    # The first check (every 5 steps) with validation accuracy >= target; training stops there.
    reached = [c["step"] for c in curves if c["val_metric"] >= 0.8]
    assert reached == [curves[-1]["step"]] == [m["steps_to_target"]] == [m["steps"]]
    assert [c["step"] for c in curves] == list(range(5, m["steps"] + 1, 5))
    per_epoch = len(digits.train.y) // 64
    assert [c["epoch"] for c in curves] == [math.ceil(c["step"] / per_epoch) for c in curves]
    assert m["epochs"] == math.ceil(m["steps"] / per_epoch)
    # Out of reach within max_steps: censored at max_steps (which need not be a multiple of eval_every).
    censored = train_run(_target(target=0.999, length=23), digits)
    m = censored.metrics
    assert (m["steps_to_target"], m["censored"], m["steps"]) == (None, 1, 23)
    assert [c["step"] for c in censored.curves] == [5, 10, 15, 20, 23]


def test_tuned_target_stops_every_candidate_at_the_first_success(digits):
    grid = (0.05, 0.1, 0.2, 0.4)
    # Reference: each lr alone, as a constant-rule run with the same seed (same init, shuffles).
    alone = {lr: train_run(_target(base_lr=lr), digits).metrics for lr in grid}
    fastest = min(alone[lr]["steps_to_target"] for lr in grid)
    tied = [lr for lr in grid if alone[lr]["steps_to_target"] == fastest]
    best = max(tied, key=lambda lr: (alone[lr]["val_accuracy"], -alone[lr]["val_loss"], -lr))
    kept = {}
    tuned = train_run(_target(lr_rule="tuned", lr_grid=grid, grid_extensions=0), digits,
                      measurements=[Measurement("steps", 5, lambda _m, step, _d, _c: kept.setdefault(step, 0) or {})])
    assert tuned.metrics["lr"] == best and tuned.metrics["steps_to_target"] == fastest
    assert {k: v for k, v in tuned.metrics.items() if k not in ("lr", "lr_at_grid_edge")} == {
        k: v for k, v in alone[best].items() if k not in ("lr", "lr_at_grid_edge")}
    assert max(kept) == fastest  # no candidate trained past the first check that reached the target


def test_an_edge_lr_extends_the_grid_then_is_flagged(digits):
    # 0.0125 and 0.025 are far too small for 40 steps: every candidate is censored, the best
    # (highest validation accuracy) is the largest lr, so the grid grows by x2 steps upward.
    config = _target(lr_rule="tuned", lr_grid=(0.0125, 0.025), length=40, target=0.99)
    one = train_run(dataclasses.replace(config, grid_extensions=1), digits)
    assert one.metrics["lr"] == 0.05 and one.metrics["lr_at_grid_edge"] == 1 and one.metrics["censored"] == 1
    two = train_run(dataclasses.replace(config, grid_extensions=2), digits)
    assert two.metrics["lr"] == 0.1 and two.metrics["lr_at_grid_edge"] == 1
    # From (0.05, 0.1) upward until the best is inside the lrs tried (here 0.2, 0.4, 0.8 are
    # added; each lr alone says which is fastest): not flagged.
    alone = {lr: train_run(_target(base_lr=lr), digits).metrics for lr in (0.05, 0.1, 0.2, 0.4, 0.8)}
    best = min(alone, key=lambda lr: (alone[lr]["steps_to_target"], -alone[lr]["val_accuracy"], lr))
    inside = train_run(_target(lr_rule="tuned", lr_grid=(0.05, 0.1)), digits)
    assert best not in (0.05, 0.1, 0.8) and inside.metrics["lr"] == best and inside.metrics["lr_at_grid_edge"] == 0
    assert inside.metrics["steps_to_target"] == alone[best]["steps_to_target"]


def test_momentum_grid_candidates(digits):
    config = _target(optimizer="momentum", lr_rule="tuned", lr_grid=(0.05, 0.1), momentum_grid=(0.0, 0.9),
                     grid_extensions=0)
    result = train_run(config, digits)
    alone = {(lr, mu): train_run(_target(optimizer="momentum", base_lr=lr, momentum=mu), digits).metrics
             for lr in (0.05, 0.1) for mu in (0.0, 0.9)}
    fastest = min(m["steps_to_target"] for m in alone.values())
    assert result.metrics["steps_to_target"] == fastest
    assert alone[result.metrics["lr"], result.metrics["tuned_momentum"]]["steps_to_target"] == fastest


# ----------------------------------------------------------------------------- measurements


def test_measurements_are_kept_with_the_run_and_change_nothing(digits):
    def train_mode_forward(model, step, data, config):
        # A forward in train mode moves BatchNorm's running statistics: on a copy, not the run's model.
        logits = model(data.train.x[:32])
        return {"mean_logit": float(logits.detach().mean()), "training": model.training}

    config = _config(method="batchnorm", budget="steps", length=7)
    plain = train_run(config, digits)
    measured = train_run(config, digits, measurements=[Measurement("probe", 3, train_mode_forward)])
    assert (measured.metrics, measured.curves) == (plain.metrics, plain.curves)
    assert [(m["measurement"], m["step"], m["training"]) for m in measured.measurements] == [
        ("probe", 0, True), ("probe", 3, True), ("probe", 6, True)]
    assert plain.measurements == []
    with pytest.raises(ValueError, match="every must be an integer >= 1, got 0"):
        Measurement("probe", 0, train_mode_forward)


@pytest.mark.parametrize("changes", [
    {"budget": "steps", "length": 3},
    {"budget": "target", "target": 0.5, "eval_every": 2, "length": 4},
    {"budget": "steps", "length": 2, "optimizer": "momentum", "lr_rule": "tuned", "lr_grid": (0.1, 0.2),
     "momentum_grid": (0.5, 0.9)},
])
def test_metric_names_are_the_metrics_a_run_records(digits, changes):
    config = _config(**changes)
    assert sorted(train_run(config, digits).metrics) == sorted(metric_names(config))

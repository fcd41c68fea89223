"""One training run: LR rules, budgets, the optimizers, determinism, divergence, tuning on val."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs import training
from affdiv.experiments.runs.config import RunConfig, config_hash, learning_rates
from affdiv.experiments.runs.models import MLP_METHODS, build_model
from affdiv.experiments.runs.training import make_optimizer, train_run


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Runs use one torch thread, as in a sweep's workers (see affdiv.experiments.runs.sweep)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


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
    opt = make_optimizer(_config(optimizer=optimizer), [w], lr=0.1)
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


def test_the_training_loop_takes_plain_sgd_steps(digits):
    # Two steps rebuilt by hand from the documented recipe: init under manual_seed(seed), batches
    # from randperm(seed), w <- w - lr * grad of the mean cross-entropy (no decay, no clipping).
    config = _config(method="batchnorm", budget="steps", length=2, base_lr=0.3, seed=5)
    model, _curves, _diverged, steps = training._fit(
        config, digits, 0.3, (digits.train.x, digits.train.y), (digits.val.x, digits.val.y))
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
    assert steps == 2
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
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

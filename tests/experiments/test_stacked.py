"""Stacked (vmapped) ensembles against one model at a time: the optimisers, every method, divergence,
BatchNorm's statistics, steps to target, independence of the other members, the fallback, the plan."""

import copy
import dataclasses
import logging
import math
import time

import pytest
import torch

from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.runs import training
from affdiv.experiments.runs.batched import BatchedEnsemble, batched_layers
from affdiv.experiments.runs.config import METHODS, RunConfig, architecture, config_hash
from affdiv.experiments.runs.ensembles import ensemble_key, member_bytes, plan_ensembles
from affdiv.experiments.runs.models import build_model
from affdiv.experiments.runs.optimizers import StackedOptimizer, make_optimizer
from affdiv.experiments.runs.options import parse_memory
from affdiv.experiments.runs.stacked import StackedEnsemble, eval_chunk, stack_failure
from affdiv.experiments.runs.training import Measurement, train_group, train_run, train_runs

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- optimisers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_stacked_optimizers_are_torch_optim_bit_for_bit(optimizer, dtype):
    generator = torch.Generator().manual_seed(0)
    lrs, momenta = [0.1, 0.03, 1.7], [0.9, 0.5, 0.0]
    start = {"w": torch.randn(3, 5, 7, generator=generator, dtype=dtype), "b": torch.randn(3, 7, generator=generator,
                                                                                              dtype=dtype)}
    stacked = {name: t.clone() for name, t in start.items()}
    stepper = StackedOptimizer(optimizer, stacked, lrs, momenta)
    alone = [{name: torch.nn.Parameter(t[k].clone()) for name, t in start.items()} for k in range(3)]
    optimizers = [make_optimizer(optimizer, list(alone[k].values()), lrs[k], momenta[k]) for k in range(3)]
    for _ in range(6):
        grads = {name: torch.randn(t.shape, generator=generator, dtype=dtype) for name, t in start.items()}
        stepper.step(stacked, grads)
        for k in range(3):
            for name, param in alone[k].items():
                param.grad = grads[name][k].clone()
            optimizers[k].step()
    for k in range(3):
        for name, param in alone[k].items():
            assert torch.equal(stacked[name][k], param.detach()), (optimizer, k, name)
    # Dropping a model keeps the others' state: the survivors go on as before.
    stepper.keep(torch.tensor([2, 0]))
    stacked = {name: t[[2, 0]] for name, t in stacked.items()}
    grads = {name: torch.randn(t.shape, generator=generator, dtype=dtype) for name, t in stacked.items()}
    stepper.step(stacked, grads)
    for row, k in enumerate([2, 0]):
        for name, param in alone[k].items():
            param.grad = grads[name][row].clone()
        optimizers[k].step()
        for name, param in alone[k].items():
            assert torch.equal(stacked[name][row], param.detach())


# ----------------------------------------------------------------------------- stacked = one at a time

# Tolerance of stacked against one-at-a-time numbers (float64, one thread), an error bound:
# both engines evaluate the same formulas for each model and differ only in the order of the
# sums inside their kernels (a batched GEMM or grouped convolution against a single one, torch
# ops against the layers' fused C passes, chunked loss sums). A sum of n terms computed in two
# orders differs by at most 2·γ_n·Σ|terms| (Higham, Thm 3.1; γ_n = n·u/(1 − n·u), u = 2⁻⁵³),
# with n ≤ 256 here (inputs 64, batch 32, widths ≤ 16, 3×3×4 patches, 180 validation samples):
# 2γ_256 ≤ 5.7e-14. A step chains 4L + 2 = 10 such sums (L = 2 hidden layers: forward, backward
# to the input and to the weights, plus the loss and its gradient), and κ = 10² bounds the
# cancellation Σ|terms|/|Σ terms| in each and the growth of a perturbation through T = 30 SGD
# steps that do not expand distances (η‖H‖ < 2, the stable regime of every lr below but the
# diverging one). Hence per tensor ‖Δθ‖∞ ≤ T·10·2γ_256·κ·‖θ‖∞ ≈ 1.7e-9·‖θ‖∞, the same for the
# losses in the curves and metrics. The ViT chains more sums per step, S ≈ 30 at depth 1
# (forward: the patch embedding; in the block two LayerNorms, q/k/v, the scores, the softmax's
# normaliser, A·V, o and the two MLP layers; the final norm, the token mean, the read-out; as many
# backward, then the weights' and the loss's), and its weights' gradients sum over B·16 token
# rows, so it runs T = 10 steps at batch 16 (n ≤ 256): T·S·2γ_256·κ is the same bound.
# Measured: 1e-16 to 5e-15. (At lrs that are finite but
# chaotic, e.g. BatchNorm at lr 1e4, rounding differences grow ×10 every few steps and no such
# bound exists; a diverging lr of 1e308 instead overflows at once in both engines alike.)
TOL = 30 * 10 * 5.7e-14 * 100
DIVERGING = 1e308


def _state(model, _step, _data, _config):
    return {"state": {name: t.detach().clone() for name, t in model.state_dict().items()}}


FINAL_STATE = Measurement("state", 30, _state)


def _assert_close(eager, stacked):
    """Equal flags, curves and metrics within TOL (non-finite values where the other has them)."""
    def close(a, b, where):
        if isinstance(a, float) and not math.isfinite(a):
            assert isinstance(b, float) and not math.isfinite(b), where
        elif isinstance(a, float):
            assert abs(a - b) <= TOL * max(abs(a), 1e-300), (where, a, b)
        else:
            assert a == b, (where, a, b)

    assert eager.metrics.keys() == stacked.metrics.keys()
    for key in eager.metrics:
        close(eager.metrics[key], stacked.metrics[key], key)
    assert [(c["epoch"], c["step"]) for c in eager.curves] == [(c["epoch"], c["step"]) for c in stacked.curves]
    for point, other in zip(eager.curves, stacked.curves):
        for key in point:
            close(point[key], other[key], key)
    assert [m["step"] for m in eager.measurements] == [m["step"] for m in stacked.measurements]
    for mine, theirs in zip(eager.measurements, stacked.measurements):
        for name, want in mine["state"].items():
            got = theirs["state"][name]
            if not want.is_floating_point():  # BatchNorm's num_batches_tracked
                assert torch.equal(got, want), name
                continue
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(got)), name
            if finite.any():
                scale = want[finite].abs().max()
                assert (got[finite] - want[finite]).abs().max() <= TOL * scale, name


# The sizes (and steps) per architecture at which TOL bounds the two engines' difference.
_SIZES = {"mlp": dict(depth=2, width=16), "cnn": dict(depth=2, width=4),
          "vit": dict(depth=1, width=16, batch_size=16, length=10)}


def _configs(method, lr=0.1, **changes):
    """Two seeds at a good and a diverging lr, and a tuned run whose grid holds both kinds."""
    base = dict(dataset="digits", method=method, batch_size=32, activation="relu", budget="steps", length=30,
                dtype="float64")
    base.update(_SIZES[architecture(method)], **changes)
    runs = [RunConfig(**base, seed=seed, base_lr=rate) for seed in (0, 1) for rate in (lr, DIVERGING)]
    return runs + [RunConfig(**base, seed=2, lr_rule="tuned", lr_grid=(lr / 2, lr * 2, DIVERGING))]


@pytest.fixture(params=["chosen", "vmap"])
def engine(request, monkeypatch):
    """The stacked engine: the one ``stacked_engine`` chooses (batched where it applies), or the
    vmapped ensemble for every model (the fallback)."""
    if request.param == "vmap":
        monkeypatch.setattr(training, "stacked_engine", lambda model, input_shape=None: StackedEnsemble)
    return request.param


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_stacked_as_one_at_a_time(digits, method, engine):
    configs = _configs(method)
    final_state = dataclasses.replace(FINAL_STATE, every=configs[0].length)
    eager = [train_run(c, digits, [final_state]) for c in configs]
    stacked = train_runs(configs, [digits] * len(configs), stacked=True, measurements=[final_state])
    assert eager[0].measurements[-1]["step"] == configs[0].length
    assert [r.metrics["diverged"] for r in eager] == [0, 1, 0, 1, 0]  # diverged members match too
    for one, many in zip(eager, stacked):
        _assert_close(one, many)


@pytest.mark.parametrize("method", ["affine", "batchnorm", "conv+batchnorm"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_momentum_and_adam_train_stacked_as_one_at_a_time(digits, method, optimizer, engine):
    configs = _configs(method, lr=0.01 if optimizer == "adam" else 0.05, optimizer=optimizer)
    eager = [train_run(c, digits, [FINAL_STATE]) for c in configs]
    stacked = train_runs(configs, [digits] * len(configs), stacked=True, measurements=[FINAL_STATE])
    for one, many in zip(eager, stacked):
        _assert_close(one, many)


def test_steps_to_target_stacked_as_one_at_a_time(digits, engine):
    base = dict(dataset="digits", method="batchnorm", batch_size=32, depth=1, width=16, budget="target", target=0.85,
                eval_every=5, length=150, dtype="float64")
    configs = [RunConfig(**base, seed=seed, lr_rule="tuned", lr_grid=(0.025, 0.05)) for seed in (0, 1)]
    configs.append(RunConfig(**base, seed=3, base_lr=0.2))
    eager = [train_run(c, digits) for c in configs]
    stacked = train_runs(configs, [digits] * len(configs), stacked=True)
    assert all(r.metrics["censored"] == 0 for r in eager) and eager[0].metrics["lr"] > 0.05  # grid extended
    for one, many in zip(eager, stacked):
        _assert_close(one, many)


def test_small_mlp_members_do_not_depend_on_their_ensemble(digits):
    # affine_like at width 16: bit for bit, whatever else is stacked with a run. Not a guarantee of the
    # kernels: at width 128 its float32 losses can change in the 7th digit with the ensemble's size
    # (stacked.py), and so can a resumed sweep's.
    configs = _configs("affine_like", dtype="float32")
    together = train_runs(configs, [digits] * len(configs), stacked=True)
    for config, result in zip(configs, together):
        alone = train_runs([config], [digits], stacked=True)[0]
        assert repr(alone.metrics) == repr(result.metrics) and repr(alone.curves) == repr(result.curves)


def test_stacked_training_is_deterministic(digits):
    configs = _configs("conv+batchnorm", dtype="float32", length=12)
    first = train_runs(configs, [digits] * len(configs), stacked=True)
    second = train_runs(configs, [digits] * len(configs), stacked=True)
    assert [repr((r.metrics, r.curves)) for r in first] == [repr((r.metrics, r.curves)) for r in second]


def test_evaluation_chunks_depend_on_the_device_only():
    # fashion-cnn's widest layer output, 8 x 28 x 28 = 6272 elements per sample: cache-sized on a CPU
    assert [eval_chunk([6272, 10], device) for device in ("cpu", torch.device("cpu"), "cuda:0", torch.device("mps"))] \
        == [2**20 // 6272, 2**20 // 6272, 2**22 // 6272, 2**22 // 6272] == [167, 167, 668, 668]
    assert eval_chunk([10], "cpu") == 1024 and eval_chunk([2**23], "cpu") == 1


def test_stacked_ladder_runs_test_the_model_kept_at_their_primary_target(digits, engine):
    # Each run trains on past its primary target (0.6) towards 0.8; its test numbers are those of the
    # model kept at the read that reached 0.6, evaluated stacked with the other run's, as alone
    base = dict(dataset="digits", method="affine", batch_size=32, depth=1, width=16, budget="target", target=0.6,
                targets=(0.8,), read_spacing=0.05, length=400, dtype="float64", lr_rule="tuned",
                lr_grid=(0.05, 0.1), grid_extensions=0)
    configs = [RunConfig(**base, seed=seed) for seed in (0, 1)]
    eager = [train_run(config, digits) for config in configs]
    stacked = train_runs(configs, [digits] * 2, stacked=True)
    # the same runs with the primary target only stop at that read: their model is the one kept there
    primary = [train_run(RunConfig(**{**base, "targets": ()}, seed=seed), digits) for seed in (0, 1)]
    for one, many, alone in zip(eager, stacked, primary):
        _assert_close(one, many)
        assert many.metrics["steps"] < many.curves[-1]["step"] and many.metrics["val_accuracy"] < 0.8
        assert [one.metrics[k] for k in ("lr", "steps", "test_accuracy", "test_loss")] == \
            [alone.metrics[k] for k in ("lr", "steps", "test_accuracy", "test_loss")]


def test_runs_on_different_data_splits_stack(digits, engine):
    other = load_dataset("digits", seed=1)
    base = dict(dataset="digits", method="batchnorm", batch_size=64, depth=1, width=8, budget="steps", length=25,
                dtype="float64")
    configs = [RunConfig(**base, seed=0), RunConfig(**base, seed=1, data_seed=1), RunConfig(**base, seed=2)]
    datasets = [digits, other, digits]
    eager = [train_run(c, d, [FINAL_STATE]) for c, d in zip(configs, datasets)]
    stacked = train_runs(configs, datasets, stacked=True, measurements=[FINAL_STATE])
    for one, many in zip(eager, stacked):
        _assert_close(one, many)
    assert stacked[1].data_fingerprint == str(other.fingerprint) != stacked[0].data_fingerprint


# ----------------------------------------------------------------------------- engines


@pytest.mark.parametrize("method", METHODS)
def test_every_method_takes_the_batched_engine(method):
    model = build_model(method, input_shape=(1, 8, 8), num_classes=10, depth=2, width=4, activation="gelu")
    assert training.stacked_engine(model) is BatchedEnsemble


@pytest.mark.parametrize("model", [
    torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, stride=2), torch.nn.Flatten(), torch.nn.Linear(36, 3)),
    torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4), torch.nn.Sigmoid()),
    torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4), torch.nn.BatchNorm1d(4, momentum=None)),
    torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.LayerNorm([2, 6, 6])),
    torch.nn.Linear(64, 4),
], ids=["strided-conv", "sigmoid", "cumulative-batchnorm", "layernorm-over-images", "not-sequential"])
def test_other_models_fall_back_to_vmap(model):
    assert batched_layers(model) is None and training.stacked_engine(model) is StackedEnsemble
    with pytest.raises(ValueError, match="BatchedEnsemble takes an nn.Sequential of"):
        BatchedEnsemble([model], "sgd", [0.1], [None], [(torch.zeros(1, 64), torch.zeros(1))] * 1,
                        [(torch.zeros(1, 64), torch.zeros(1))])


# ----------------------------------------------------------------------------- fallback


class _NoVmap(torch.autograd.Function):
    """An old-style autograd.Function (forward with ctx): torch.func cannot transform it."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _Doubler(torch.nn.Module):
    def forward(self, x):
        return _NoVmap.apply(x)


def test_stack_failure_names_what_torch_func_cannot_do():
    def build():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3), _Doubler())

    reason = stack_failure(build, "sgd", (torch.randn(2, 4), torch.tensor([0, 2])))
    assert reason is not None and "setup_context" in reason
    assert stack_failure(lambda: torch.nn.Sequential(torch.nn.Linear(4, 3)), "sgd",
                         (torch.randn(2, 4), torch.tensor([0, 2]))) is None


def test_unstackable_runs_train_one_at_a_time_and_say_so(digits, monkeypatch, caplog):
    configs = _configs("norm_l2", length=5)
    monkeypatch.setattr(training, "stack_failure", lambda *args: "RuntimeError: no vmap rule")
    monkeypatch.setattr(training, "_STACKABLE", {})
    with caplog.at_level(logging.WARNING, logger="affdiv.experiments.runs.training"):
        results = train_group(configs, [digits] * len(configs), stack=True)
    assert "training 5 run(s) of method norm_l2 one at a time, not stacked: torch.func cannot stack it " \
           "(RuntimeError: no vmap rule)" in caplog.text
    for config, result in zip(configs, results):
        assert repr(result.metrics) == repr(train_run(config, digits).metrics)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="affdiv.experiments.runs.training"):
        train_group(configs[:1], [digits], stack=True, measurements=[Measurement("m", 5, lambda *a: {})])
        train_group(configs[:1], [digits], stack=False)
    # measurements no longer force one run at a time: only the unstackable model falls back (logged once)
    assert caplog.text.count("one at a time") == 1 and "torch.func cannot stack it" in caplog.text


# ----------------------------------------------------------------------------- plan


def test_ensembles_group_runs_by_all_but_seed_data_and_lr():
    base = dict(dataset="digits", method="affine", batch_size=32)
    same = [RunConfig(**base, seed=1), RunConfig(**base, seed=2, data_seed=2, lr_rule="tuned", lr_grid=(0.1,)),
            RunConfig(**base, seed=0, base_lr=0.3, lr_rule="sqrt")]
    assert len({ensemble_key(c) for c in same}) == 1
    for change in ({"batch_size": 64}, {"method": "batchnorm"}, {"width": 8}, {"optimizer": "adam"}, {"length": 3}):
        assert ensemble_key(RunConfig(**{**base, **change}, seed=1)) != ensemble_key(same[0])
    with pytest.raises(ValueError, match="differ only in seed, data split and learning-rate settings; got 2"):
        train_runs([same[0], RunConfig(**base, seed=0, width=8)], [None, None])


def test_plan_keeps_runs_whole_within_the_memory_budget():
    shape = ((1, 8, 8), 10)
    base = dict(dataset="digits", method="affine", batch_size=32, width=64)
    runs = [RunConfig(**base, seed=s, lr_rule=rule, lr_grid=(0.1, 0.2, 0.4)) for s in range(5) for rule in ("sqrt",
                                                                                                           "tuned")]
    runs.append(RunConfig(**{**base, "method": "batchnorm"}, seed=0))
    per_model = member_bytes(runs[0], *shape)
    assert per_model > 4 * (64 * 64 + 64 * 64 + 64 * 10) * 2  # at least parameters and gradients
    assert member_bytes(RunConfig(**{**base, "batch_size": 1024}, seed=0), *shape) > per_model
    assert member_bytes(RunConfig(**base, seed=0, dtype="float64"), *shape) > per_model
    whole = plan_ensembles(runs, lambda c: shape, budget=10**12)
    assert [len(e) for e in whole] == [10, 1]  # one per kind, ordered by key
    cut = plan_ensembles(runs, lambda c: shape, budget=9 * per_model)
    affine = [e for e in cut if e[0].method == "affine"]
    hashes = [config_hash(c.to_dict()) for e in affine for c in e]
    assert sorted(hashes) == sorted(config_hash(c.to_dict()) for c in runs[:10]) and len(affine) == 3
    for ensemble in affine:
        assert sum(3 if c.lr_rule == "tuned" else 1 for c in ensemble) * per_model <= 9 * per_model
    assert plan_ensembles(list(reversed(runs)), lambda c: shape, budget=9 * per_model) == cut  # order-free
    tiny = plan_ensembles(runs, lambda c: shape, budget=1)
    assert [len(e) for e in tiny] == [1] * 11  # a run larger than the budget alone
    assert [config_hash(c.to_dict()) for c in affine[0]] == [config_hash(c.to_dict()) for c in sorted(
        affine[0], key=lambda c: (c.seed, c.data_seed, config_hash(c.to_dict())))]


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 2**30), ("512MiB", 2**29), ("1.5GB", 1_500_000_000),
                                        ("4096", 4096), (10, 10)])
def test_memory_sizes(text, size):
    assert parse_memory(text) == size


@pytest.mark.parametrize("bad", ["0", "two", "-1GiB", "2GiBs", True])
def test_bad_memory_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="^ensemble_memory must be"):
        parse_memory(bad)


def test_falsify_takes_stack_and_ensemble_memory(tmp_path, capsys):
    from affdiv.cli import main

    status = main(["falsify", "--preset", "smoke", "--out", str(tmp_path / "out"), "--stack", "off",
                   "--ensemble-memory", "lots"])
    assert status == 2 and "--ensemble-memory must be a size such as 2GiB" in capsys.readouterr().err
    assert not (tmp_path / "out" / "results.sqlite").exists()  # refused before any work
    with pytest.raises(SystemExit):
        main(["falsify", "--preset", "smoke", "--out", str(tmp_path / "out"), "--stack", "maybe"])


# ----------------------------------------------------------------------------- checks' time


@pytest.mark.parametrize("stacked", [False, True])
def test_a_run_counts_its_seconds_in_checks(digits, monkeypatch, stacked):
    # Every evaluation of the validation split is made to last 0.05 s more: a check of the ensemble's
    # 3 models (one run, and a tuned run of 2) then takes at least 0.05 s, a third of it each model's.
    waits = []
    for engine_type in (training.OneAtATime, StackedEnsemble):
        def slow(self, evaluate=engine_type.evaluate):
            waits.append(len(self))
            time.sleep(0.5 if len(self) == 2 else 0.05)  # (2 models: the stacked test pass)
            return evaluate(self)
        monkeypatch.setattr(engine_type, "evaluate", slow)
    base = dict(dataset="digits", method="affine", batch_size=32, depth=1, width=8, budget="target", target=0.99,
                eval_every=5, length=20, grid_extensions=0)
    configs = [RunConfig(**base, seed=0), RunConfig(**base, seed=1, lr_rule="tuned", lr_grid=(0.05, 0.1))]
    results = train_runs(configs, [digits] * 2, stacked=stacked)
    # (4 checks of the 3 models; stacked, the 2 runs' test splits are then evaluated in one pass too)
    assert [len(r.curves) for r in results] == [4, 4] and waits == [3] * 4 + ([2] if stacked else [])
    for result, models in zip(results, (1, 2)):
        assert 0.05 * 4 * models / 3 <= result.check_seconds <= result.seconds, (result.check_seconds, result.seconds)
        if stacked:  # the test pass (0.5 s, shared by the 2 runs) is in their seconds, not in their checks'
            assert result.seconds - result.check_seconds >= 0.5 / 2, (result.check_seconds, result.seconds)
    no_val = train_runs([RunConfig(**{**base, "budget": "steps", "val_fraction": 0.0}, seed=0)],
                        [load_dataset("digits", val_fraction=0.0)], stacked=stacked)[0]
    assert no_val.check_seconds < 0.05
    assert waits[-1] == 1 if stacked else len(waits) == 4  # a lone stacked run is tested by the stacked engine too


@pytest.mark.parametrize("activation", ["gelu", "tanh"])
@pytest.mark.parametrize("method", METHODS)
def test_batched_logits_are_each_models_own(method, activation):
    # float64, one forward: the same formulas summed in other orders, 2γ_n·κ with n ≤ 64 and κ ≤ 10²
    # per layer, two hidden layers (blocks) and the read-out: ≤ 3 · 1.5e-14 · 100 ≈ 5e-12 relative.
    torch.manual_seed(0)
    width = 8 if architecture(method) == "vit" else 4  # (the vit's 4 heads of 2)
    models = [build_model(method, input_shape=(1, 8, 8), num_classes=10, depth=2, width=width, activation=activation)
              .double() for _ in range(3)]
    with torch.no_grad():  # off their initial values (norm gains 1, biases 0): each model's own parameters count
        for model in models:
            for parameter in model.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
    x, y = torch.randn(3, 5, 1, 8, 8, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 3, [None] * 3, [(x[0], y)] * 3, [(x[0], y)] * 3)
    for training_mode in (True, False):
        got = ensemble._batched_logits(ensemble.params, {n: t.clone() for n, t in ensemble.buffers.items()}, x,
                                       training_mode)
        for k, model in enumerate(models):
            want = copy.deepcopy(model).train(training_mode)(x[k]).detach()  # (a copy: BatchNorm's statistics)
            assert torch.allclose(got[k], want, rtol=5e-12, atol=5e-12 * float(want.abs().max())), (k, training_mode)
    # The evaluation's form: one chunk of samples for all the models (a shared first layer).
    with torch.no_grad():
        got = ensemble._eval_logits(ensemble.params, ensemble.buffers, x[1], 3)
    for k, model in enumerate(models):
        want = copy.deepcopy(model).eval()(x[1]).detach()
        assert torch.allclose(got[k], want, rtol=5e-12, atol=5e-12 * float(want.abs().max())), k


@pytest.mark.parametrize("method", METHODS)
def test_a_check_on_several_splits_gives_each_model_its_own_logits(method):
    # A check's form: models 0 and 1 on one split, model 2 on another, the first layers on each
    # split's chunk once for its models (a first convolution on three input channels is one dense
    # convolution per split), then one batch. float64, the bound of the test above with n ≤ 192
    # (the MLP's first layer sums 3·8·8 inputs): 3 · 2γ_192 · 100 ≈ 1.3e-11 relative.
    torch.manual_seed(1)
    width = 8 if architecture(method) == "vit" else 4
    models = [build_model(method, input_shape=(3, 8, 8), num_classes=10, depth=2, width=width, activation="tanh")
              .double() for _ in range(3)]
    with torch.no_grad():
        for model in models:
            for parameter in model.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
    xa, xb, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randn(5, 3, 8, 8, dtype=torch.float64), \
        torch.zeros(5, dtype=torch.long)
    splits = [(xa, y), (xa, y), (xb, y)]
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 3, [None] * 3, splits, splits)
    with torch.no_grad():
        got = ensemble._shared_logits(ensemble.params, ensemble.buffers, [(0, 2, xa), (2, 3, xb)])
    assert got.is_contiguous()  # (the checks' argmax is several times slower on a transposed view)
    for k, (model, x) in enumerate(zip(models, (xa, xa, xb))):
        want = copy.deepcopy(model).eval()(x).detach()
        assert torch.allclose(got[k], want, rtol=1.5e-11, atol=1.5e-11 * float(want.abs().max())), k


def test_a_layer_norm_without_its_affine_parameters_is_batched_as_itself():
    # Same bound as the batched-logits test above (float64, one forward, two layers).
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 6),
                                  torch.nn.LayerNorm(6, elementwise_affine=False), torch.nn.Tanh(),
                                  torch.nn.Linear(6, 3)).double() for _ in range(2)]
    assert training.stacked_engine(models[0]) is BatchedEnsemble
    x, y = torch.randn(2, 5, 1, 8, 8, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 2, [None] * 2, [(x[0], y)] * 2, [(x[0], y)] * 2)
    got = ensemble._batched_logits(ensemble.params, ensemble.buffers, x, True)
    for k, model in enumerate(models):
        want = model(x[k]).detach()
        assert torch.allclose(got[k], want, rtol=5e-12, atol=5e-12 * float(want.abs().max())), k


def test_a_grouped_patchnorm_convolution_is_batched_as_itself():
    # Each model's groups are patches of their own (groups·K groups in the stacked convolution).
    # Same bound as the batched-logits test above (float64, one forward and backward, two layers).
    from affdiv.layers import PatchNormConv2d

    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(),
                                  PatchNormConv2d(4, 6, 3, padding=1, groups=2), torch.nn.Flatten(),
                                  torch.nn.Linear(6 * 8 * 8, 3)).double() for _ in range(3)]
    assert training.stacked_engine(models[0]) is BatchedEnsemble
    x, y = torch.randn(3, 5, 1, 8, 8, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 3, [None] * 3, [(x[0], y)] * 3, [(x[0], y)] * 3)
    leaves = {name: p.detach().requires_grad_() for name, p in ensemble.params.items()}
    got = ensemble._batched_logits(leaves, ensemble.buffers, x, True)
    grads = torch.autograd.grad(got.square().sum(), list(leaves.values()))
    for k, model in enumerate(models):
        want = model(x[k])
        assert torch.allclose(got[k], want.detach(), rtol=5e-12, atol=5e-12 * float(want.detach().abs().max())), k
        for name, grad, own in zip(leaves, grads,
                                               torch.autograd.grad(want.square().sum(), list(model.parameters()))):
            assert torch.allclose(grad[k], own, rtol=5e-12, atol=5e-12 * float(own.abs().max())), (k, name)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_stacked_patchnorm_convolution_keeps_or_recomputes_its_output_as_the_module_says(monkeypatch, recompute):
    from affdiv.experiments.runs import batched
    from affdiv.layers import PatchNormConv2d

    real, asked = batched.patchnorm_conv2d, []
    monkeypatch.setattr(batched, "patchnorm_conv2d", lambda *args: asked.append(args[-1]) or real(*args))
    models = [torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(),
                                  PatchNormConv2d(2, 3, 3, padding=1, recompute=recompute), torch.nn.Flatten(),
                                  torch.nn.Linear(3 * 6 * 6, 2)) for _ in range(2)]
    x, y = torch.randn(2, 4, 1, 6, 6), torch.zeros(4, dtype=torch.long)
    ensemble = BatchedEnsemble(models, "sgd", [0.1] * 2, [None] * 2, [(x[0], y)] * 2, [(x[0], y)] * 2)
    ensemble._batched_logits(ensemble.params, ensemble.buffers, x, True)
    assert asked == [recompute]


def test_samples_that_are_neither_vectors_nor_images_train_vmapped_and_agree(digits):
    # A (N, 8, 8) input (no channel axis) is no layout the batched layers know: the vmapped engine
    # trains it, as each model alone would (the float64 bound of this module's equality tests).
    models = [torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 5), torch.nn.Tanh(),
                                  torch.nn.Linear(5, 10)).double() for _ in range(2)]
    assert training.stacked_engine(models[0], (8, 8)) is StackedEnsemble
    assert training.stacked_engine(models[0], (64,)) is training.stacked_engine(models[0], (1, 8, 8)) is BatchedEnsemble
    x = torch.as_tensor(digits.train.x[:64, 0], dtype=torch.float64)
    y = torch.as_tensor(digits.train.y[:64])
    alone = [copy.deepcopy(m) for m in models]
    engine = training._stacked(models, "sgd", [0.1, 0.2], [None, None], [(x, y)] * 2, [(x, y)] * 2)
    assert type(engine) is StackedEnsemble
    batches = torch.stack([torch.arange(0, 16), torch.arange(16, 32)])
    losses = engine.step(batches)
    for k, model in enumerate(alone):  # the losses before the step: each model's own
        loss = torch.nn.functional.cross_entropy(model(x[batches[k]]), y[batches[k]])
        assert torch.allclose(losses[k], loss.detach(), rtol=1e-12)

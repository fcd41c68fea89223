"""Measurements along stacked training (the gradient noise scale, the divergence meter): equal to one
at a time, changing nothing they measure, skipping diverged members; ``affdiv falsify
--noise-scale-every`` and a preset's [measure] table; the committed presets' run keys."""

import hashlib
import json
import logging
import math
import sqlite3
from pathlib import Path

import pytest
import torch

from affdiv.cli import main
from affdiv.experiments.runs import divergence_measurement, noise_scale, training
from affdiv.experiments.runs.config import RunConfig, candidates, config_hash
from affdiv.experiments.runs.ensembles import plan_ensembles
from affdiv.experiments.runs.presets import available_presets, load_preset
from affdiv.experiments.runs.training import Measurement, train_group, train_run, train_runs
from tests.experiments.test_pipeline import refused
from tests.experiments.test_stacked import DIVERGING, TOL, _configs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/experiments/conftest.py, as is ``digits``


def _measurements(every: int = 10) -> list[Measurement]:
    """Both measurements ``affdiv falsify`` takes, small: B_simple from 2 draws of 8 and 64 samples,
    the divergence meter on one batch of the run's own size."""
    return [noise_scale.measurement(every=every, b_small=8, b_big=64, draws=2),
            divergence_measurement.measurement(every=every)]


# ----------------------------------------------------------------------------- stacked = one at a time

# Tolerance of a measured number, stacked against one at a time (float64, one thread). Both engines
# hand the callback a module holding the member's parameters and buffers and the callback draws
# its batches from its own generator, so the two calls run the same code on the same samples and
# differ only by the members' states: within TOL relative (tests/experiments/test_stacked.py, the
# bound for these configs: 30 SGD steps, batch 32, widths <= 16). The callback's gradients at the
# two states then differ by at most κ·TOL relative, κ = 10² bounding the cancellation in them (as
# there), and squared norms by twice that: EPS = 2κ·TOL ≈ 3.4e-7. B_simple's estimates subtract
# the two batch sizes' mean squared norms s_small, s_big and multiply EPS by their condition
# numbers, computed from the one-at-a-time values:
#     |G|²:      c_G = (b_big s_big + b_small s_small) / |b_big s_big − b_small s_small|
#     tr(Σ):     c_T = (s_small + s_big) / |s_small − s_big|
#     B_simple:  c_G + c_T
# The divergence meter's shares, cosines, correlations and coefficient of variation are
# dimensionless ratios of such sums, O(1) whatever the layer (the corrected layers' diagonal-scale
# CV is 0 up to rounding, where a relative bound means nothing): absolute EPS·max(1, |value|); its
# two scales (scale_mean, diagonal_scale_mean): relative EPS. Measured: at most 7e-14.
EPS = 2 * 100 * TOL


def _close(a, b, tol: float, scale: float) -> bool:
    if a is None or b is None or not math.isfinite(a):
        return repr(a) == repr(b)  # None, nan and inf where the other has the same
    return abs(a - b) <= tol * scale


def _assert_measurements_close(eager: list[dict], stacked: list[dict]) -> None:
    assert [(m["measurement"], m["step"]) for m in eager] == [(m["measurement"], m["step"]) for m in stacked]
    for mine, theirs in zip(eager, stacked):
        assert mine.keys() == theirs.keys()
        where = (mine["measurement"], mine["step"])
        if mine["measurement"] == noise_scale.NAME:
            small, big = mine["b_small"], mine["b_big"]
            s_small, s_big = mine["grad_sq"] + mine["trace"] / small, mine["grad_sq"] + mine["trace"] / big
            c_g = (big * s_big + small * s_small) / abs(big * s_big - small * s_small)
            c_t = (s_small + s_big) / abs(s_small - s_big)
            for key, condition in (("grad_sq", c_g), ("trace", c_t), ("b_simple", c_g + c_t)):
                assert _close(mine[key], theirs[key], EPS * condition, abs(mine[key])), (where, key)
            assert [mine[k] for k in ("b_small", "b_big", "n_draws")] == [theirs[k] for k in ("b_small", "b_big",
                                                                                              "n_draws")]
            continue
        for key, value in mine.items():
            if key in ("measurement", "step"):
                continue
            scale = abs(value or 0.0) if key.endswith("scale_mean") else max(1.0, abs(value or 0.0))
            assert _close(value, theirs[key], EPS, scale), (where, key, value, theirs[key])


@pytest.mark.parametrize("method", ["affine", "batchnorm", "affine_like", "conv+batchnorm"])
def test_stacked_measurements_equal_one_at_a_time(digits, method):
    # _configs: two seeds at a good and at a diverging lr, and a tuned run whose grid holds both
    # kinds (7 members); 30 steps, measured at 0, 10, 20, 30.
    configs = _configs(method)
    eager = [train_run(c, digits, _measurements()) for c in configs]
    stacked = train_runs(configs, [digits] * len(configs), stacked=True, measurements=_measurements())
    for config, one, many in zip(configs, eager, stacked):
        steps = sorted({m["step"] for m in one.measurements})
        # A diverging member is measured at initialisation only: by step 10 its parameters are not
        # finite, so it is no longer active (the next test looks at the steps in between).
        assert steps == ([0] if config.base_lr == DIVERGING else [0, 10, 20, 30]), (config.base_lr, steps)
        assert {m["measurement"] for m in one.measurements} == {noise_scale.NAME, divergence_measurement.NAME}
        _assert_measurements_close(one.measurements, many.measurements)


def test_a_member_is_not_measured_once_its_parameters_stop_being_finite(digits):
    # At lr 1e308 the first update leaves the parameters finite (near 1e307) and the outputs not;
    # the second makes the parameters non-finite. Measured every step, that run is measured at
    # steps 0 and 1 (its noise scale at step 1 is nan, not an error) and no more; the other at every
    # step; alike in both engines.
    base = dict(dataset="digits", method="batchnorm", batch_size=32, depth=1, width=8, budget="steps", length=3,
                dtype="float64", seed=0)
    configs = [RunConfig(**base, base_lr=DIVERGING), RunConfig(**base, base_lr=0.1)]
    for stacked in (False, True):
        results = train_runs(configs, [digits] * 2, stacked=stacked, measurements=_measurements(every=1))
        assert [sorted({m["step"] for m in r.measurements}) for r in results] == [[0, 1], [0, 1, 2, 3]], stacked
        noise = [m["b_simple"] for m in results[0].measurements if m["measurement"] == noise_scale.NAME]
        assert math.isfinite(noise[0]) and math.isnan(noise[1])
        assert [r.metrics["diverged"] for r in results] == [1, 0]


# ----------------------------------------------------------------------------- measuring changes nothing


def _meddling(calls: list) -> Measurement:
    """A measurement that does all it may to its model: a train-mode forward (BatchNorm's running
    statistics move) and backward (``.grad`` written), every parameter and buffer changed in place,
    and a draw from the global random generator. Appends each call's step to ``calls``."""
    def meddle(model, step, data, config):
        calls.append(step)
        fresh = all(p.grad is None for p in model.parameters())
        torch.rand(100)
        x = torch.as_tensor(data.train.x[:16], dtype=next(model.parameters()).dtype)
        model(x).square().mean().backward()
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                tensor.add_(1)
        return {"fresh": fresh, "training": model.training}

    return Measurement("meddle", 3, meddle)


def _target() -> list[RunConfig]:
    """BatchNorm MLPs to a target (a check, with its curve point, every step), a tuned grid that
    extends upward (a second lockstep), and a constant-lr run beside it."""
    base = dict(dataset="digits", method="batchnorm", batch_size=32, depth=1, width=16, budget="target", target=0.85,
                eval_every=1, length=150, dtype="float64")
    return [RunConfig(**base, seed=0, lr_rule="tuned", lr_grid=(0.025, 0.05)), RunConfig(**base, seed=1, base_lr=0.1)]


@pytest.mark.parametrize("stacked", [False, True], ids=["one at a time", "stacked"])
def test_a_measurement_changes_nothing_it_measures(digits, stacked):
    configs = _target()
    plain = train_runs(configs, [digits] * 2, stacked=stacked)
    plain_rng = torch.get_rng_state()
    calls = []
    measured = train_runs(configs, [digits] * 2, stacked=stacked, measurements=[_meddling(calls), *_measurements(4)])
    assert torch.equal(torch.get_rng_state(), plain_rng)  # the global generator as training left it
    assert plain[0].metrics["lr"] > 0.05  # the grid was extended: a second lockstep, measured too
    # one call per run at step 0 (its candidates share the init), one per active candidate after
    # (3 in the first lockstep, and the grid extension's)
    assert calls.count(0) == 2 and calls.count(3) > len(candidates(configs[0])) + 1
    for one, other in zip(plain, measured):
        assert repr((one.metrics, one.curves)) == repr((other.metrics, other.curves))  # bit for bit
        meddled = [m for m in other.measurements if m["measurement"] == "meddle"]
        assert [m["step"] for m in meddled] == list(range(0, other.metrics["steps"] + 1, 3))
        assert all(m["fresh"] and m["training"] for m in meddled)  # a new module, no .grad, train mode


def test_measured_runs_train_stacked_and_the_unstackable_fall_back_with_them(digits, monkeypatch, caplog):
    configs = _configs("norm_l2", length=10)
    with caplog.at_level(logging.WARNING, logger="affdiv.experiments.runs.training"):
        grouped = train_group(configs, [digits] * len(configs), stack=True, measurements=_measurements(5))
    assert "one at a time" not in caplog.text  # measurements no longer force one run at a time
    stacked = train_runs(configs, [digits] * len(configs), stacked=True, measurements=_measurements(5))
    assert repr([(r.metrics, r.curves, r.measurements) for r in grouped]) == repr(
        [(r.metrics, r.curves, r.measurements) for r in stacked])
    # A model torch.func cannot stack still trains one at a time, measured the same way, and says so.
    monkeypatch.setattr(training, "stack_failure", lambda *args: "RuntimeError: no vmap rule")
    monkeypatch.setattr(training, "_STACKABLE", {})
    with caplog.at_level(logging.WARNING, logger="affdiv.experiments.runs.training"):
        fallback = train_group(configs[:1], [digits], stack=True, measurements=_measurements(5))
    assert "one at a time, not stacked: torch.func cannot stack it (RuntimeError: no vmap rule)" in caplog.text
    alone = train_run(configs[0], digits, _measurements(5))
    assert repr(fallback[0].measurements) == repr(alone.measurements) and alone.measurements


# ----------------------------------------------------------------------------- presets


def test_committed_presets_keep_their_run_keys():
    # SHA-256 of the sorted config hashes of every run of each packaged preset, as committed before
    # measurements could be switched on: measurement settings never enter a run's key, so a store
    # such as docs/results/fashion-target/ resumes. A change here orphans stored runs. (smoke's runs
    # changed key once, on purpose, when it came to read a target ladder; the ladder presets' keys
    # are those of docs/results/fashion-ladder/ and cnn-ladder's runs; fashion-vit's as first committed.)
    # (fashion-cnn's 40 patchnorm runs changed key once, on purpose, when its [method.patchnorm] grid
    # came in; batch sizes 8 and 16 joined later, and its 120 runs at 32-512 keep their keys: below.)
    expected = {
        "fashion": (192, "c8e05f670232af4b5e999797084ebec836c7767633eb591696e97f5c49118225"),
        "fashion-cnn": (168, "c0138382190e85f0d15db0ea0fdcdec8604aa93f199dee52b5aa2829121b7a8f"),
        "fashion-steps": (192, "fc1c234bc0dac3388f9ca60bb2e80a56d232baa60c6169bfbb0038d6b71f8354"),
        "fashion-target": (336, "acf21496df591638404f8039a94c4d5e5b6cc97e5e4430653945ab09a2890c92"),
        "paper": (2040, "a40e7415a9eb3e1a2255fbbf368315ab897a7240132befd3954d48580971331c"),
        "smoke": (128, "cc421df106e102196af6eed53aedc5af4502ac0458b2ae0996cc6a92475b246a"),
        "fashion-ladder": (336, "aef7dc12eb38f97384bd48f6f63caa8f7675fa6b6bdfdcc3321f8ca56a2fa102"),
        "cnn-ladder": (168, "c5aeeac6c9bf171777092c5ea3855d61ec1da53cd92ce28fd4cfd383c86e43d7"),
        "fashion-vit": (160, "4ded10feaddc37c2887a955bcf42cfa03860aea0a763a8fd7a33e33c5c783819"),
    }
    assert available_presets() == sorted(expected)
    for name, (runs, digest) in expected.items():
        hashes = sorted(config_hash(c.to_dict()) for study in load_preset(name).studies() for c in study.configs)
        assert (len(hashes), hashlib.sha256("".join(hashes).encode()).hexdigest()) == (runs, digest), name
    # fashion-cnn's 120 runs at batch sizes 32-512 (stored in docs/results/fashion-cnn/), the same keys as
    # before batch sizes 8 and 16 joined; of those, the conv and conv+batchnorm runs have the same 80 keys as
    # before patchnorm got its own grid.
    cnn = [c for study in load_preset("fashion-cnn").studies() for c in study.configs if c.batch_size >= 32]
    first = sorted(config_hash(c.to_dict()) for c in cnn)
    assert (len(first), hashlib.sha256("".join(first).encode()).hexdigest()) == \
        (120, "8f7d7ab32794d7cd774acea3dba9fd6f88afc7bd8b3cedcb961f1051bc5b974f")
    conv = sorted(config_hash(c.to_dict()) for c in cnn if c.method != "patchnorm")
    assert hashlib.sha256("".join(conv).encode()).hexdigest() == \
        "a5e1c3b7094e2385121ec39e2fb5e82bbf856ecaff5b8b4fda575ca7826b6db5" and len(conv) == 80


@pytest.mark.parametrize("table, message", [
    ("[measure]\nnoise_scale_every = 0", "preset 'bad' [measure] noise_scale_every must be an integer >= 1, got 0"),
    ("[measure]\nprobe_every = -4", "[measure] probe_every must be an integer >= 1, got -4"),
    ("[measure]\nnoise_scale_every = 2.5", "noise_scale_every must be an integer >= 1, got 2.5"),
    ("[measure]\nnoise_scale_every = true", "noise_scale_every must be an integer >= 1, got True"),
    ("[measure]\nnoise_scale_every = \"10\"", "noise_scale_every must be an integer >= 1, got '10'"),
    ("[measure]\nnoise_every = 10", "[measure] takes only ['noise_scale_every', 'probe_every']"),
    ("measure = 10", "[measure] takes only"),
    ("[sweep]\nensemble_memory = \"lots\"", "preset 'bad' [sweep] ensemble_memory must be a size such as 2GiB"),
    ("[sweep]\nensemble_memory = 0", "[sweep] ensemble_memory must be more than 0 bytes, got 0"),
    ("[sweep]\nworkers = 2", "preset 'bad': [sweep] takes only ['ensemble_memory'], got {'workers': 2}"),
    ("sweep = 1", "[sweep] takes only"),
    ("[method.nosuch]\nlr_grid = [1.0]", "preset 'bad' [method.nosuch]: the preset runs no method 'nosuch'; it runs: "
     "affine"),
    ("[method.batchnorm]\nlr_grid = [1.0]", "[method.batchnorm]: the preset runs no method 'batchnorm'"),
    ("[method.affine]\nseed = 5", "[method.affine]: 'seed' cannot differ by method"),
    ("[method]\naffine = 3", "[method] holds one table of run settings per method ([method.NAME]), got {'affine': 3}"),
    ("[method.affine]\nmethod = \"batchnorm\"", "preset 'bad' [method.affine]: 'method' is a grid axis"),
    ("[method.affine]\ndata_seed = 1", "[method.affine]: 'data_seed' cannot differ by method"),
    ("[method.affine]\nwidht = 3", "[method.affine]: 'widht' is not a run setting"),
    ("method = 3", "preset 'bad': [method] holds one table of run settings per method ([method.NAME]), got 3"),
])
def test_bad_measure_method_and_sweep_tables_are_refused(tmp_path, table, message):
    path = tmp_path / "bad.toml"
    path.write_text(f"{table}\n[grid]\nmethod = [\"affine\"]\n")
    with pytest.raises(ValueError) as error:
        load_preset(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_method_table_sets_the_runs_of_its_method_only(tmp_path):
    text = ("[run]\ndataset = \"digits\"\nlr_rule = \"tuned\"\nlr_grid = [0.1, 0.2]\nbudget = \"target\"\n"
            "target = 0.5\neval_every = 2\nlength = 10\nval_fraction = 0.1\n"
            "[grid]\nmethod = [\"affine\", \"batchnorm\"]\nbatch_size = [16, 32]\nseed = [0, 1]\n")
    (tmp_path / "plain.toml").write_text(text)
    (tmp_path / "by-method.toml").write_text(text + "[method.batchnorm]\nlr_grid = [0.4, 0.8]\ngrid_extensions = 1\n")

    def runs(name, **overrides):
        return {(c.method, c.batch_size, c.seed): c
                for c in load_preset(str(tmp_path / f"{name}.toml")).studies(**overrides)[0].configs}

    plain, by_method = runs("plain"), runs("by-method")
    assert plain.keys() == by_method.keys() and len(plain) == 8
    for key, config in by_method.items():
        before, after = plain[key].to_dict(), config.to_dict()
        if key[0] == "affine":  # untouched, down to its key
            assert config_hash(after) == config_hash(before)
        else:
            assert (after["lr_grid"], after["grid_extensions"]) == ([0.4, 0.8], 1)
            assert before["grid_extensions"] == 3
            assert {k: v for k, v in after.items() if k not in ("lr_grid", "grid_extensions")} == \
                {k: v for k, v in before.items() if k not in ("lr_grid", "grid_extensions")}
    # the command line's --set replaces a method table's setting; the table's others stay
    overridden = runs("by-method", run={"lr_grid": [0.05]})
    assert {c.method: (tuple(c.lr_grid), c.grid_extensions) for c in overridden.values()} == {
        "affine": ((0.05,), 3), "batchnorm": ((0.05,), 1)}


def test_a_method_table_merges_before_its_runs_are_built(tmp_path):
    # [run]'s momentum is idle under sgd; a table that switches batchnorm to momentum makes it count
    # (a run built from [run] and then changed would have lost it), and a [study.run] setting wins
    (tmp_path / "p.toml").write_text(
        "[run]\ndataset = \"digits\"\nmomentum = 0.5\nwidth = 8\nbatch_size = 16\nseed = 0\n"
        "[grid]\nmethod = [\"affine\", \"batchnorm\"]\n"
        "[method.batchnorm]\noptimizer = \"momentum\"\nwidth = 4\n"
        "[[study]]\nname = \"plain\"\n[[study]]\nname = \"wide\"\n[study.run]\nwidth = 32\n")
    plain, wide = load_preset(str(tmp_path / "p.toml")).studies()
    assert [(c.method, c.optimizer, c.width) for c in plain.configs] == [("affine", "sgd", 8),
                                                                          ("batchnorm", "momentum", 4)]
    assert plain.configs[1].momentum == 0.5
    assert [(c.method, c.width) for c in wide.configs] == [("affine", 32), ("batchnorm", 32)]
    (tmp_path / "bad.toml").write_text("[run]\ndataset = \"digits\"\nbatch_size = 16\nseed = 0\n"
                                       "[grid]\nmethod = [\"affine\"]\n"
                                       "[method.affine]\ngrid_extensions = -1\n")
    with pytest.raises(ValueError, match=r"^preset 'bad' \[method.affine\]: grid_extensions must be an integer"):
        load_preset(str(tmp_path / "bad.toml")).studies()


# ----------------------------------------------------------------------------- affdiv falsify

# A steps-to-target grid that trains in seconds (tests/presets/quick-target.toml).
PRESET = (Path(__file__).parents[1] / "presets" / "quick-target.toml").read_text()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    folder = tmp_path_factory.mktemp("preset")
    (folder / "quick.toml").write_text(PRESET)
    (folder / "measured.toml").write_text(PRESET + "[measure]\nnoise_scale_every = 4\n")
    (folder / "one-run-units.toml").write_text(PRESET + "[sweep]\nensemble_memory = \"1\"\n")
    return folder


def _options(quick, preset="quick"):
    return ["--preset", str(quick / f"{preset}.toml"), "--calibration-sims", "0", "--workers", "1"]


def test_a_presets_sweep_table_sets_the_ensemble_budget_and_the_option_overrides_it(tmp_path, quick, monkeypatch):
    from affdiv.experiments.runs import sweep

    plans = []  # (budget, ensemble sizes) of each sweep's plan

    def plan(configs, shape_of, budget):
        ensembles = plan_ensembles(configs, shape_of, budget)
        plans.append((budget, sorted(len(e) for e in ensembles)))
        return ensembles

    monkeypatch.setattr(sweep, "plan_ensembles", plan)
    # 2 seeds x 2 batch sizes: an ensemble per batch size, or (1 byte) a unit per run
    for preset, option, budget, sizes in (("quick", [], 2 * 2**30, [2, 2]), ("one-run-units", [], 1, [1, 1, 1, 1]),
                                          ("one-run-units", ["--ensemble-memory", "2GiB"], 2 * 2**30, [2, 2])):
        out = tmp_path / f"{preset}-{len(option)}"
        assert main(["falsify", *_options(quick, preset), "--out", str(out), *option]) == 0
        assert plans[-1] == (budget, sizes)
        invocation = json.loads((out / "summary.json").read_text())["provenance"]["this_invocation"]
        assert invocation == {"stack": True, "ensemble_memory": budget}
    out = tmp_path / "off"
    assert main(["falsify", *_options(quick, "one-run-units"), "--out", str(out), "--stack", "off"]) == 0
    provenance = json.loads((out / "summary.json").read_text())["provenance"]
    assert provenance["this_invocation"] == {"stack": False, "ensemble_memory": None} and len(plans) == 3


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "ten"])
def test_bad_noise_scale_intervals_are_one_line_errors_before_any_work(tmp_path, capsys, quick, value):
    out = tmp_path / "out"
    shown = value if value.lstrip("-").isdigit() else repr(value)
    refused(capsys, ["falsify", *_options(quick), "--out", str(out), "--noise-scale-every", value],
            f"--noise-scale-every must be an integer >= 1, got {shown}")
    assert not out.exists()


def test_falsify_noise_scale_every_measures_and_refuses_to_mix_intervals(tmp_path, capsys, quick):
    out = tmp_path / "out"
    assert main(["falsify", *_options(quick), "--seeds", "1", "--out", str(out), "--noise-scale-every", "4"]) == 0
    for other, said in ((["--noise-scale-every", "6"], "resuming with --noise-scale-every 6"),
                        ([], "resuming without --noise-scale-every")):
        line = refused(capsys, ["falsify", *_options(quick), "--out", str(out), *other],
                       "holds runs of this sweep measured with --noise-scale-every 4", said)
        assert line.startswith(f"affdiv falsify: error: --db {out / 'results.sqlite'} holds runs")  # named once
    # the preset's [measure] table sets the same interval: it resumes the store; another is refused, naming it
    refused(capsys, ["falsify", *_options(quick, "measured"), "--out", str(out), "--noise-scale-every", "3"],
            "resuming with --noise-scale-every 3 would")
    assert main(["falsify", *_options(quick, "measured"), "--out", str(out)]) == 0
    db = sqlite3.connect(f"file:{out / 'results.sqlite'}?mode=ro", uri=True)
    rows = [json.loads(text) for (text,) in db.execute("SELECT measurements FROM runs")]
    assert len(rows) == 4
    for measured in rows:
        steps = [m["step"] for m in measured]
        assert {m["measurement"] for m in measured} == {noise_scale.NAME} and steps[:2] == [0, 4]
    header = (out / "records.csv").read_text().splitlines()[0].split(",")
    assert {"b_simple_init", "b_simple"} <= set(header)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["noise_scale_every"] == 4 and summary["provenance"]["probe_every"] is None
    assert "B_simple (init)" in (out / "report.md").read_text()
    # with nothing left to train, a store is never refused
    assert main(["falsify", *_options(quick), "--out", str(out)]) == 0
    fresh = tmp_path / "fresh"
    assert main(["falsify", *_options(quick), "--seeds", "1", "--out", str(fresh), "--noise-scale-every", "6"]) == 0
    refused(capsys, ["falsify", *_options(quick, "measured"), "--out", str(fresh)],
            "measured with --noise-scale-every 6; resuming with --noise-scale-every 4 (set by preset 'measured' "
            "[measure]) would mix them; rerun with --noise-scale-every 6 or use another results store")
    refused(capsys, ["falsify", *_options(quick), "--out", str(fresh), "--noise-scale-every", "6", "--probe-every",
                     "5"], "measured without --probe-every; resuming with --probe-every 5")

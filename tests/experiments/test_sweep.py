"""Sweeps: grid expansion, resuming, parallel workers equal to serial, stacked ensembles, presets,
and the worker processes under faults (a parent or a worker killed)."""

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from affdiv.experiments.runs.config import config_hash, expand_grid
from affdiv.experiments.runs.options import SweepOptions
from affdiv.experiments.runs.presets import available_presets, load_preset
from affdiv.experiments.runs.store import ResultStore
from affdiv.experiments.runs.sweep import Progress, run_sweep
from affdiv.experiments.runs.training import Measurement

BASE = dict(dataset="digits", depth=1, width=8, length=1)


def test_grid_is_the_full_product_in_a_fixed_order():
    axes = {"method": ["norm_l2", "affine"], "batch_size": [64, 16, 32], "seed": [1, 0]}
    configs = expand_grid(BASE, axes)
    assert len(configs) == 12
    assert {(c.method, c.batch_size, c.seed) for c in configs} == {
        (m, b, s) for m in ["norm_l2", "affine"] for b in [64, 16, 32] for s in [1, 0]
    }
    order = [(c.method, c.batch_size, c.seed) for c in configs]
    assert order[:3] == [("affine", 16, 0), ("affine", 16, 1), ("affine", 32, 0)]
    assert expand_grid(BASE, dict(reversed(list(axes.items())))) == configs


def test_a_unit_records_the_machine_of_its_runs_device(monkeypatch):
    # each run's code carries provenance.machine_identity of the device it trained on (a GPU run's
    # names the GPU); here a run on the CPU named as "cpu:0", with the identity replaced by one
    # that names its argument
    from affdiv import provenance
    from affdiv.experiments.runs import sweep

    monkeypatch.setattr(provenance, "machine_identity", lambda device: {"device": device})
    [config] = expand_grid({**BASE, "device": "cpu:0"}, {"method": ["affine"], "batch_size": [16], "seed": [0]})
    [(trained, stored)] = sweep._run_unit([config], stack=False, measurements=(), data_dir=None)
    assert trained == config and stored.code["cpu"] == {"device": "cpu:0"}


def test_grid_collapses_duplicates_and_refuses_empty_axes():
    # lr_grid only matters to the tuned rule, so these two grid points are one run.
    assert len(expand_grid({**BASE, "method": "affine", "batch_size": 8, "seed": 0},
                           {"lr_grid": [[0.1], [0.2]]})) == 1
    with pytest.raises(ValueError, match="grid axis 'seed' must be a non-empty list, got \\[\\]"):
        expand_grid(BASE, {"seed": []})


def test_resume_skips_finished_runs_and_parallel_equals_serial(tmp_path):
    configs = expand_grid(BASE, {"method": ["affine", "batchnorm"], "batch_size": [32, 128], "seed": [0]})
    first = configs[:2]
    serial = ResultStore(tmp_path / "serial.sqlite")
    outcome = run_sweep(first, serial, SweepOptions(workers=1, threads=1), progress=None)
    assert (outcome.ran, outcome.skipped) == (2, 0)

    seen = []
    stream = io.StringIO()
    outcome = run_sweep(configs, serial, SweepOptions(workers=1, threads=1), progress=stream, on_result=seen.append)
    assert (outcome.ran, outcome.skipped) == (2, 2)
    assert seen == sorted(configs[2:], key=lambda c: config_hash(c.to_dict()))  # only the unfinished ones ran
    assert "4/4" not in stream.getvalue() and "2/2 runs, 2 already done" in stream.getvalue()
    assert serial.finished() == {config_hash(c.to_dict()) for c in configs} == set(outcome.hashes)

    parallel = ResultStore(tmp_path / "parallel.sqlite")
    outcome = run_sweep(configs, parallel, SweepOptions(workers=2, threads=1), progress=None)
    assert (outcome.workers, outcome.ran) == (2, 4)
    drop = ("config_hash",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in parallel.records()] == [
        {k: v for k, v in r.items() if k not in drop} for r in serial.records()
    ]
    assert parallel.curves() == serial.curves()


def test_progress_reports_count_and_eta_in_a_log_and_draws_a_tqdm_bar_on_a_terminal():
    stream = io.StringIO()
    bar = Progress(total=3, skipped=1, stream=stream)
    bar.advance(), bar.advance(), bar.advance()
    lines = stream.getvalue().splitlines()  # a log: whole lines, the first and the last (10 s apart at most)
    assert "\r" not in stream.getvalue() and len(lines) == 2
    assert "| 0/3 runs, 1 already done, elapsed 00:00, ETA --:--" in lines[0] and lines[0].startswith("  0%|")
    assert lines[-1].startswith("100%|") and lines[-1].endswith("| 3/3 runs, 1 already done, elapsed 00:00, ETA 00:00")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    bar = Progress(total=2, skipped=0, stream=terminal)
    bar.advance(failed=True)
    assert bar.bar is not None and bar.bar.n == 1  # tqdm's bar, redrawn in place
    bar.advance()
    assert bar.bar is None  # closed at the last run
    drawn = terminal.getvalue().split("\r")
    assert any("1/2 runs, 0 already done, 1 failed, elapsed" in d for d in drawn)
    assert "2/2 runs" in drawn[-1] and "ETA 00:00" in drawn[-1]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_eta_is_elapsed_time_per_unit_of_cost_times_the_cost_left():
    from affdiv.experiments.runs.config import RunConfig

    # Costs 1 : 2 : 4 (batch x steps); each run takes 10 s per unit of cost on the fake clock.
    runs = [RunConfig(**{**BASE, "method": "affine", "batch_size": b, "seed": 0, "budget": "steps", "length": 10})
            for b in (8, 16, 32)]
    assert [Progress.cost(c) for c in runs] == [80.0, 160.0, 320.0]
    clock, stream = FakeClock(), io.StringIO()
    bar = Progress(total=3, skipped=0, stream=stream, runs=runs, clock=clock)
    assert bar.eta() != bar.eta()  # NaN: no ETA before a run has finished
    assert stream.getvalue().splitlines()[-1].endswith("ETA --:--")
    clock.now += 10
    bar.advance(config=runs[0])
    assert bar.eta() == pytest.approx(10 * 6)  # cost 6 of 7 left; a count would say 2 x 10 s
    clock.now += 20
    bar.advance(config=runs[1])
    assert bar.eta() == pytest.approx(30 / 3 * 4)
    clock.now += 40
    bar.advance(config=runs[2])
    assert bar.eta() == 0.0
    assert stream.getvalue().splitlines()[-1].endswith("elapsed 01:10, ETA 00:00")


def test_the_cost_of_a_run_follows_its_budget_and_its_learning_rate_candidates():
    from affdiv.experiments.runs.config import RunConfig

    common = {**BASE, "method": "affine", "batch_size": 16, "seed": 0}
    steps = RunConfig(**{**common, "budget": "steps", "length": 50})
    target = RunConfig(**{**common, "budget": "target", "target": 0.5, "length": 50, "eval_every": 10,
                          "lr_rule": "tuned", "lr_grid": (0.1, 0.2, 0.4)})
    epochs = RunConfig(**{**common, "budget": "epochs", "length": 2, "data_seed": 12345})
    assert Progress.cost(steps) == 16 * 50
    assert Progress.cost(target) == 3  # the three candidates; max_steps is a cap, not the work
    assert Progress.cost(RunConfig(**{**target.to_dict(), "batch_size": 1024})) == 3
    assert Progress.cost(epochs) == 2  # every batch size passes over the split `length` times
    assert Progress.cost(RunConfig(**{**common, "budget": "epochs", "length": 2, "batch_size": 256})) == 2


def test_the_eta_of_a_steps_to_target_sweep_holds_from_its_first_runs():
    """A planted sweep shaped like a real one (4 methods x 7 batch sizes x 12 seeds, steps to a
    target, max_steps 12000): a run's time depends on its method (the corrected layers 4-8x
    slower) and only mildly on the batch size. Run one at a time in the sweep's order on a fake
    clock, the ETA after 2, 5, 8, 12, 30 and 100 runs is within a factor 1.5 of the time truly left. (Grid
    order with the old weight batch x max_steps said 95 hours for 4 left in such a sweep.)"""
    from affdiv.experiments.runs.config import RunConfig
    from affdiv.experiments.runs.sweep import _units

    seconds = {"affine": 20.0, "batchnorm": 30.0, "norm_l2": 120.0, "affine_like": 160.0}
    batch_sizes = (16, 32, 64, 128, 256, 512, 1024)
    configs = [RunConfig(**{**BASE, "method": m, "batch_size": b, "seed": s, "budget": "target", "target": 0.84,
                            "length": 12000, "lr_rule": "tuned", "lr_grid": (0.05, 0.1, 0.2, 0.4, 0.8)})
               for m in seconds for b in batch_sizes for s in range(8, 20)]

    def duration(config):  # a mild U in the batch size: slow at the smallest and the largest
        return seconds[config.method] * (1 + 0.3 * abs(batch_sizes.index(config.batch_size) - 3) / 3)

    order = [config for unit in _units(configs, False, 0, None) for config in unit]
    assert sorted(map(config_hash, (c.to_dict() for c in order))) == sorted(config_hash(c.to_dict()) for c in configs)
    clock = FakeClock()
    bar = Progress(total=len(order), skipped=0, stream=None, runs=order, clock=clock)
    left = sum(map(duration, order))
    for k, config in enumerate(order, 1):
        clock.now += duration(config)
        left -= duration(config)
        bar.advance(config=config)
        if k in (12, 30, 100):  # from a dozen finished runs on: a fair sample of a shuffled sweep
            assert 1 / 1.5 < bar.eta() / left < 1.5, (k, bar.eta() / 3600, left / 3600)


def test_packaged_presets_expand():
    assert available_presets() == ["cnn-ladder", "fashion", "fashion-cnn", "fashion-ladder", "fashion-steps",
                                   "fashion-target", "fashion-vit", "paper", "smoke"]
    sizes = {name: [len(s.configs) for s in load_preset(name).studies()] for name in available_presets()}
    assert sizes["smoke"] == [4 * 4 * 8] and sizes["fashion"] == [6 * 4 * 8]
    assert sizes["fashion-target"] == [6 * 7 * 8] and sizes["fashion-steps"] == [6 * 4 * 8]
    assert sizes["fashion-cnn"] == [3 * 7 * 8]
    assert sizes["fashion-ladder"] == [4 * 7 * 12] and sizes["cnn-ladder"] == [3 * 7 * 8]
    assert sizes["fashion-vit"] == [5 * 4 * 8]
    # The ladder studies' seeds are used by no other study (fresh replications).
    earlier = {c.seed for name in ("fashion", "fashion-target", "fashion-steps", "fashion-cnn")
               for s in load_preset(name).studies() for c in s.configs}
    for name in ("fashion-ladder", "cnn-ladder"):
        assert not earlier & {c.seed for s in load_preset(name).studies() for c in s.configs}, name
    for name in available_presets():  # >= 8 seeds, each with its own data split (data_seed = "seed")
        configs = [c for s in load_preset(name).studies() for c in s.configs]
        assert len({c.seed for c in configs}) >= 8 and all(c.data_seed == c.seed for c in configs), name
    assert {c.budget for s in load_preset("smoke").studies() for c in s.configs} == {"target"}
    paper = load_preset("paper").studies()
    assert [s.name for s in paper] == ["mlp-tanh", "mlp-relu", "cnn"]
    assert {c.dataset for s in paper for c in s.configs} == {"cifar10"}
    assert {c.activation for c in paper[0].configs} == {"tanh"}
    assert {c.method for c in paper[2].configs} == {"conv", "conv+batchnorm", "patchnorm"}


def test_preset_overrides():
    (smoke,) = load_preset("smoke").studies(seeds=[7], batch_sizes=[16], methods=["norm_l2"], run={"length": 1})
    assert {(c.method, c.batch_size, c.seed, c.length) for c in smoke.configs} == {("norm_l2", 16, 7, 1)}
    (smoke,) = load_preset("smoke").studies(run={"lr_rule": "sqrt", "seed": 3})
    assert {(c.lr_rule, c.seed, c.data_seed) for c in smoke.configs} == {("sqrt", 3, 3)}
    paper = load_preset("paper").studies(methods=["affine", "patchnorm"])
    assert [{c.method for c in s.configs} for s in paper] == [{"affine"}, {"affine"}, {"patchnorm"}]


def test_method_overrides_keep_each_study_to_its_architecture(tmp_path):
    preset = tmp_path / "arms.toml"
    preset.write_text('[run]\ndataset = "digits"\n'
                      '[[study]]\nname = "mlp"\ngrid = {method = ["affine", "affine_like"]}\n'
                      '[[study]]\nname = "vit"\ngrid = {method = ["vit", "vit-qknorm"]}\n'
                      '[grid]\nbatch_size = [8]\nseed = [0]\n')
    studies = load_preset(str(preset)).studies(methods=["affine_like", "vit-qknorm", "patchnorm"])
    assert {s.name: {c.method for c in s.configs} for s in studies} == {"mlp": {"affine_like"},
                                                                        "vit": {"vit-qknorm"}}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"methods": ["dropout"]}, "unknown method 'dropout'; expected one of: affine, batchnorm"),
        ({"methods": ["patchnorm"]}, "none of the methods \\['patchnorm'\\] is in preset 'smoke'"),
        ({"batch_sizes": [0]}, "batch sizes must be integers >= 1, got 0"),
        ({"run": {"optimiser": "sgd"}}, "unknown run setting\\(s\\) \\['optimiser'\\]"),
    ],
)
def test_bad_overrides_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_preset("smoke").studies(**kwargs)


def test_unknown_preset_lists_the_packaged_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'smok'; expected one of: cnn-ladder, fashion, fashion-cnn, "
                                         "fashion-ladder, fashion-steps, fashion-target, fashion-vit, paper, "
                                         "smoke"):
        load_preset("smok")
    bad = tmp_path / "bad.toml"
    bad.write_text("[runs]\nlength = 1\n")
    with pytest.raises(ValueError, match="unknown table\\(s\\) \\['runs'\\]"):
        load_preset(str(bad))


# A sweep whose runs take hours (10**7 steps each): its workers are busy whenever the parent dies.
_ENDLESS_SWEEP = textwrap.dedent("""
    import sys
    from affdiv.experiments.runs.store import ResultStore
    from affdiv.experiments.runs.config import expand_grid
    from affdiv.experiments.runs.options import SweepOptions
    from affdiv.experiments.runs.sweep import run_sweep
    configs = expand_grid(dict(dataset="digits", method="affine", depth=1, width=8, batch_size=8,
                               budget="steps", length=10**7), {"seed": [0, 1]})
    run_sweep(configs, ResultStore(sys.argv[1]), SweepOptions(workers=2, threads=1, stack=False), progress=None)
""")


def _children(parent: int) -> list[int]:
    """Pool workers of ``parent`` (spawned interpreters running multiprocessing's spawn_main)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_the_parent(tmp_path, signum, sweep_util):
    parent = subprocess.Popen([sys.executable, "-c", _ENDLESS_SWEEP, str(tmp_path / "runs.sqlite")])
    workers: list[int] = []
    try:
        # Both workers up and past their imports (torch mapped): they are (about to be) training.
        def training() -> bool:
            workers = _children(parent.pid)
            return len(workers) == 2 and all(b"libtorch" in Path(f"/proc/{w}/maps").read_bytes() for w in workers)

        assert sweep_util.wait(training, 120), f"the sweep did not start its 2 workers: {_children(parent.pid)}"
        workers = _children(parent.pid)
        os.kill(parent.pid, signum)
        assert parent.wait(30) == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signal.SIGTERM)
        # A surviving worker would train for hours; 30 s covers a worker still finishing its start-up.
        assert sweep_util.exited(workers, 30), [w for w in workers if sweep_util.alive(w)]
    finally:  # a failed check must not leave hours of training behind
        parent.kill()
        parent.wait()
        for worker in filter(sweep_util.alive, workers):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_a_killed_worker_costs_only_a_retry(tmp_path, sweep_util):
    # kill -9 of a worker mid-sweep (what the out-of-memory killer does): the units in flight are
    # trained again in a fresh pool; every run is stored once, with the numbers of an undisturbed sweep.
    configs = expand_grid({**BASE, "budget": "steps", "length": 40},
                          {"method": ["affine", "batchnorm"], "batch_size": [16, 32], "seed": [0, 1]})
    undisturbed = ResultStore(tmp_path / "undisturbed.sqlite")
    run_sweep(configs, undisturbed, SweepOptions(workers=1), progress=None)
    killed: list[int] = []

    def kill_a_worker(_config) -> None:
        if not killed:
            workers = _children(os.getpid())
            assert workers, "no worker process to kill"
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    store = ResultStore(tmp_path / "killed.sqlite")
    outcome = run_sweep(configs, store, SweepOptions(workers=2), progress=None, on_result=kill_a_worker)
    assert killed and outcome.restarts >= 1 and outcome.units == 4
    assert sweep_util.counts(store) == (len(configs), len(configs))
    assert sweep_util.records(store) == sweep_util.records(undisturbed)


def test_a_worker_that_dies_between_units_costs_a_fresh_pool(tmp_path, sweep_util, monkeypatch, caplog):
    # A worker killed while none of its units is in flight: the pool says so only when the next
    # unit is submitted (submit raises); the sweep goes on in a fresh pool, every run stored once,
    # and no unit is charged an attempt (with no retries, a charged attempt would stop the sweep).
    from affdiv.experiments.runs import sweep

    configs = expand_grid({**BASE, "budget": "steps", "length": 20},
                          {"method": ["affine"], "batch_size": [16, 32], "seed": [0, 1]})
    undisturbed = ResultStore(tmp_path / "undisturbed.sqlite")
    run_sweep(configs, undisturbed, SweepOptions(workers=1, stack=False), progress=None)
    pools, killed = [], []
    real_pool = sweep._pool

    @contextlib.contextmanager
    def recorded_pool(workers, initargs):
        with real_pool(workers, initargs) as executor:
            pools.append(executor)
            yield executor

    def kill_the_idle_worker(_config) -> None:  # on a finished unit's commit: nothing is in flight
        if not killed:
            (worker,) = sweep._worker_processes(pools[-1])
            worker.kill()
            worker.join()
            deadline = time.monotonic() + 60
            while not pools[-1]._broken and time.monotonic() < deadline:  # the pool's own thread notices
                time.sleep(0.05)
            killed.append(worker.pid)

    real_run = sweep._run_in_pools  # a pool of one worker: when a unit is committed, none is in flight
    monkeypatch.setattr(sweep, "_pool", recorded_pool)
    monkeypatch.setattr(sweep, "_run_in_pools", lambda units, options, commit, _workers, *rest:
                        real_run(units, options, commit, 1, *rest))
    store = ResultStore(tmp_path / "killed.sqlite")
    outcome = run_sweep(configs, store, SweepOptions(workers=2, stack=False, retries=0), progress=None,
                        on_result=kill_the_idle_worker)
    assert killed and pools[0]._broken and len(pools) == 2 and outcome.restarts == 1
    assert "a worker process died between units (exit codes [-9]" in caplog.text
    assert sweep_util.counts(store) == (len(configs), len(configs))
    assert sweep_util.records(store) == sweep_util.records(undisturbed)


_KILLER = "import os, signal\n\ndef die(model, step, data, config):\n    os.kill(os.getpid(), signal.SIGKILL)\n"


def test_a_unit_that_always_kills_its_worker_stops_the_sweep(tmp_path, monkeypatch):
    (tmp_path / "affdiv_test_killer.py").write_text(_KILLER)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the parent's sys.path
    import affdiv_test_killer

    configs = expand_grid(BASE, {"method": ["affine"], "batch_size": [32], "seed": [0, 1]})

    store = ResultStore(tmp_path / "runs.sqlite")  # (the measurements never arrive: every worker dies first)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a worker process died 2 times while training these runs \(exit codes "
                                           r"\[-9.*affine B=32 seed=0 lr_rule=constant"):
        run_sweep(configs, store, SweepOptions(workers=2, stack=False, retries=1), progress=None,
                  measurements=[Measurement("die", 1, affdiv_test_killer.die)])
    assert store.finished() == set() and time.monotonic() - started < 300  # (4 worker start-ups on a loaded machine)


def test_stacked_sweep_equals_one_at_a_time_and_repeats_exactly(tmp_path, sweep_util):
    configs = expand_grid({**BASE, "budget": "steps", "length": 25, "dtype": "float64", "lr_grid": [0.05, 0.2]},
                          {"method": ["affine", "norm_l2"], "batch_size": [32], "seed": [0, 1],
                           "lr_rule": ["sqrt", "tuned"]})
    stores = {name: ResultStore(tmp_path / f"{name}.sqlite") for name in ("off", "on", "again")}
    assert run_sweep(configs, stores["off"], SweepOptions(workers=1, stack=False), progress=None).units == 8
    assert run_sweep(configs, stores["on"], SweepOptions(workers=1, stack=True), progress=None).units == 2
    run_sweep(configs, stores["again"], SweepOptions(workers=1, stack=True), progress=None)
    assert sweep_util.records(stores["again"]) == sweep_util.records(stores["on"])  # same sweep, same stored numbers
    off, on = stores["off"].records(), stores["on"].records()
    assert [r["config_hash"] for r in off] == [r["config_hash"] for r in on]
    for one, many in zip(off, on):  # float64: within the bound derived in test_stacked.py
        for key, value in one.items():
            if isinstance(value, float):
                assert abs(value - many[key]) <= 1.7e-9 * abs(value), key
            else:
                assert value == many[key], key


def test_a_resumed_stacked_sweep_trains_only_the_missing_runs(tmp_path, sweep_util):
    configs = expand_grid({**BASE, "budget": "steps", "length": 30}, {"method": ["batchnorm"], "batch_size": [32],
                                                                      "seed": [0, 1, 2]})
    whole = ResultStore(tmp_path / "whole.sqlite")
    run_sweep(configs, whole, SweepOptions(workers=1), progress=None)
    resumed = ResultStore(tmp_path / "resumed.sqlite")
    run_sweep(configs[:1], resumed, SweepOptions(workers=1), progress=None)
    seen = []
    outcome = run_sweep(configs, resumed, SweepOptions(workers=1), progress=None, on_result=seen.append)
    assert (outcome.ran, outcome.skipped, outcome.units) == (2, 1, 1) and seen == configs[1:]
    # an MLP member's numbers do not depend on its ensemble: its steps, accuracies and training losses
    # bit for bit; its validation and test losses to float32 rounding (a validation or test pass over
    # 1, 2 or 3 models is one batched matrix product whose blocking, so whose float32 rounding (u = 6e-8
    # per operation), may depend on the number of models: over the width-8 layers, 1e-6 relative bounds it)
    def split(store):
        rows = [dict(r) for r in store.records()]
        losses = [r.pop(key) for r in rows for key in ("val_loss", "test_loss")]
        curves = [dict(point) for point in store.curves()]
        curve_losses = [point.pop("val_loss") for point in curves]
        return rows, curves, losses + curve_losses

    rows, curves, losses = split(resumed)
    assert (rows, curves) == split(whole)[:2]
    assert losses == pytest.approx(split(whole)[2], rel=1e-6, abs=0)

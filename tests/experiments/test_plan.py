"""A study before it trains: the plan (runs, their keys, analysis and metric), the preflight, and the
options a sweep travels with. The run keys of every packaged preset are pinned here: a change that
moves one would orphan the runs of every results store written before it."""

import dataclasses
import hashlib
import sqlite3
from pathlib import Path

import pytest

from affdiv.experiments import pipeline
from affdiv.experiments.plan import (
    Preflight,
    StudyOverrides,
    StudyPlan,
    check_measurement_resume,
    default_metric,
    plan_study,
    preflight,
)
from affdiv.experiments.runs.config import MAX_SEED, RunConfig
from affdiv.experiments.runs.ensembles import plan_ensembles
from affdiv.experiments.runs.options import DEFAULT_ENSEMBLE_MEMORY, DaskOptions, SweepOptions
from affdiv.experiments.runs.presets import available_presets, load_preset
from affdiv.experiments.runs.store import ResultStore, StoredRun

# {preset: (runs, SHA-256 of its sorted run keys, key of its first run, {study: metric})}, computed
# with the code before the plan existed (``Preset.studies`` and ``config_hash``).
KEYS = {
    "cnn-ladder": (168, "c5aeeac6c9bf171777092c5ea3855d61ec1da53cd92ce28fd4cfd383c86e43d7",
                   "5e39707d86abd1a161f6fc3cf87005c1866d4803dc95ed4f6d77e7f340ef197a",
                   {"cnn-ladder": "steps_to_target"}),
    "fashion": (192, "c8e05f670232af4b5e999797084ebec836c7767633eb591696e97f5c49118225",
                "7d0879f154bed038c6f2b42daac41055c22932adb52e501a5869e00d2ef7ddbe", {"fashion": "test_accuracy"}),
    "fashion-cnn": (168, "c0138382190e85f0d15db0ea0fdcdec8604aa93f199dee52b5aa2829121b7a8f",
                    "5adbbcd8440c61f58ef7be75bc60e1ddd39f84c2992ef5a0defaf9871c1ca3cb",
                    {"fashion-cnn": "steps_to_target"}),
    "fashion-ladder": (336, "aef7dc12eb38f97384bd48f6f63caa8f7675fa6b6bdfdcc3321f8ca56a2fa102",
                       "e6676659c743acc78a8b41cd92bdb1430d5c4c1145d17050fcd75f23334211fc",
                       {"fashion-ladder": "steps_to_target"}),
    "fashion-steps": (192, "fc1c234bc0dac3388f9ca60bb2e80a56d232baa60c6169bfbb0038d6b71f8354",
                      "3d9809c6e71af283e997d53f5b7fc02e9e7bed60b8fb6a88fb98d75bcf791868",
                      {"fashion-steps": "test_accuracy"}),
    "fashion-target": (336, "acf21496df591638404f8039a94c4d5e5b6cc97e5e4430653945ab09a2890c92",
                       "734c0de4aefc85e438096af4bb2b32dc528a539c9cde58fa2eaa26c13956d864",
                       {"fashion-target": "steps_to_target"}),
    "fashion-vit": (160, "4ded10feaddc37c2887a955bcf42cfa03860aea0a763a8fd7a33e33c5c783819",
                    "091ccc764f3a5035a1271bd7306891078c09b874d9d875747b3dba1a2dbf6ac2",
                    {"fashion-vit": "steps_to_target"}),
    "paper": (2040, "a40e7415a9eb3e1a2255fbbf368315ab897a7240132befd3954d48580971331c",
              "09c15372510c4f7fad9a07095e3c5c08ae32d4a3e131ebc39fb0d049ba9d8ac0",
              {"mlp-tanh": "test_accuracy", "mlp-relu": "test_accuracy", "cnn": "test_accuracy"}),
    "smoke": (128, "cc421df106e102196af6eed53aedc5af4502ac0458b2ae0996cc6a92475b246a",
              "ddcc1fd7d378a7e8d39687e2c51f9c0eb4417d17e0f70e79a14c62069c4dfe67", {"smoke": "steps_to_target"}),
}

# A grid that trains in a few seconds (tests/presets/quick.toml).
PRESET = (Path(__file__).parents[1] / "presets" / "quick.toml").read_text()


def _digest(keys) -> str:
    return hashlib.sha256("".join(sorted(keys)).encode()).hexdigest()


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_every_packaged_preset_is_pinned():
    assert sorted(KEYS) == available_presets()


@pytest.mark.parametrize("name", sorted(KEYS))
def test_the_run_keys_of_every_packaged_preset_are_unchanged(name):
    runs, digest, first, metrics = KEYS[name]
    plan = plan_study(name)
    assert isinstance(plan, StudyPlan) and len(plan.runs) == runs
    assert _digest(plan.runs) == digest and next(iter(plan.runs)) == first
    assert {study.name: study.metric for study in plan.studies} == metrics
    for study in plan.studies:  # the metric is chosen once and travels with the analysis settings
        assert study.analysis.metric == study.metric
        assert study.digest == hashlib.sha256("".join(study.hashes).encode()).hexdigest()
        assert list(study.hashes) == sorted(study.hashes) and set(study.hashes) <= set(plan.runs)


ONE_RUN_PER_UNIT = [name for name in available_presets() if "one run per unit of work" in load_preset(name).description]


def test_the_presets_that_say_so_train_one_run_per_unit_of_work():
    # Their [sweep] budget is below every run's estimated size, so a stopped sweep loses at most the
    # runs in flight and no run's float32 numbers depend on another's (a change to the memory
    # estimate that lets two runs share an ensemble fails here)
    assert ONE_RUN_PER_UNIT == ["cnn-ladder", "fashion-cnn", "fashion-ladder", "fashion-vit"]
    for name in ONE_RUN_PER_UNIT:
        preset = load_preset(name)
        configs = [config for study in preset.studies() for config in study.configs]
        units = plan_ensembles(configs, lambda _config: ((1, 28, 28), 10), preset.ensemble_memory)
        assert len(units) == len(configs), name


def test_overrides_replace_the_grid_axes_and_settings_with_the_keys_of_before():
    overrides = StudyOverrides(seeds=[3, 4], batch_sizes=[16, 64], methods=["affine", "norm_l2"],
                               settings={"width": 8})
    plan = plan_study("smoke", overrides)
    assert len(plan.runs) == 8 and plan.overrides == overrides
    assert _digest(plan.runs) == "346071d12d7a7e9936880db7a598dc426f882f8f206dbd79ccd452953c0a3b28"
    assert next(iter(plan.runs)) == "4d5f245af9dc9d7892975dd66c2ff885d2fc651b07f8d4f6251086557cfc609a"
    assert {(c.seed, c.batch_size, c.method, c.width) for c in plan.runs.values()} == {
        (s, b, m, 8) for s in (3, 4) for b in (16, 64) for m in ("affine", "norm_l2")}


def test_the_plan_fills_in_the_presets_sweep_and_measure_tables():
    vit = plan_study("fashion-vit")  # [sweep] ensemble_memory = "64MiB", [measure] probe_every = 50
    assert (vit.options.ensemble_memory, vit.options.probe_every, vit.options.noise_scale_every) == (64 * 2**20, 50,
                                                                                                     None)
    assert vit.origin == {"probe_every": "preset 'fashion-vit' [measure]"}
    given = plan_study("fashion-vit", options=SweepOptions(ensemble_memory="1GiB", probe_every=7, workers=3))
    assert (given.options.ensemble_memory, given.options.probe_every, given.options.workers) == (2**30, 7, 3)
    assert given.origin == {}
    assert plan_study("fashion").options.ensemble_memory == DEFAULT_ENSEMBLE_MEMORY


def test_a_plan_of_several_studies_reports_into_a_folder_each(tmp_path):
    paper = plan_study("paper")
    assert paper.out_dirs(tmp_path) == {name: tmp_path / name for name in ("mlp-tanh", "mlp-relu", "cnn")}
    assert plan_study("smoke").out_dirs(tmp_path) == {"smoke": tmp_path}


def test_one_function_chooses_the_metric():
    assert pipeline.default_metric is default_metric and not hasattr(pipeline, "study_metric")
    assert default_metric({"target"}, database=True, where="x") == "steps_to_target"
    assert default_metric({"epochs", "steps"}, database=True, where="x") == "test_accuracy"
    assert default_metric(set(), database=False, where="x") == "metric"
    with pytest.raises(ValueError, match=r"^x: records of budget 'target' mixed with budget\(s\) \['epochs'\]") as err:
        default_metric({"target", "epochs"}, database=True, where="x")
    one_line(err)


@pytest.mark.parametrize("make, message", [
    (lambda: StudyOverrides(settings={"momentum": float("nan")}), "settings momentum: nan is not a finite number"),
    (lambda: StudyOverrides(settings={"data_options": {"noise": [1, float("inf")]}}),
     "settings data_options.noise[1]: inf is not a finite number"),
    (lambda: StudyOverrides(seeds="01"), "seeds must be a list, got '01'"),
    (lambda: StudyOverrides(settings=[("width", 8)]), "settings must be a table of run settings"),
    (lambda: SweepOptions(workers=0), "workers must be an integer >= 1, got 0"),
    (lambda: SweepOptions(threads=1.5), "threads must be an integer >= 1, got 1.5"),
    (lambda: SweepOptions(stack="on"), "stack must be True or False, got 'on'"),
    (lambda: SweepOptions(ensemble_memory="lots"), "ensemble_memory must be a size such as 2GiB"),
    (lambda: SweepOptions(probe_every=0), "probe_every must be an integer >= 1, got 0"),
    (lambda: SweepOptions(noise_scale_every="5"), "noise_scale_every must be an integer >= 1, got '5'"),
    (lambda: SweepOptions(retries=-1), "retries must be an integer >= 0, got -1"),
    (lambda: SweepOptions(dask="tcp://x:1"), "dask must be None or DaskOptions"),
    (lambda: DaskOptions(max_in_flight=0), "max_in_flight must be None or an integer >= 1, got 0"),
    (lambda: DaskOptions(scheduler=""), "scheduler must be None or an address"),
    (lambda: RunConfig("digits", "affine", 32, MAX_SEED + 1).check(),
     f"run setting seed (torch's seed range) must be an integer in [0, {MAX_SEED}], got {MAX_SEED + 1}"),
    (lambda: RunConfig("digits", "affine", 32, 0, base_lr=float("inf")).check(),
     "run setting base_lr: inf is not a finite number"),
    (lambda: RunConfig("digits", "affine", 32, 0, optimizer="momentum", momentum=1.0).check(),
     "momentum must be a number in [0, 1), got 1.0"),
    (lambda: RunConfig("digits", "affine", 32, 0, data_options=5).check(),
     "data_options must be a table of dataset options"),
    (lambda: RunConfig("digits", "affine", 32, 0, device=0).check(), "device must be a string"),
])
def test_bad_input_is_one_line_naming_the_parameter(make, message):
    with pytest.raises(ValueError) as error:
        make()
    assert one_line(error).startswith(message)


def test_options_are_one_value_each():
    options = SweepOptions(workers=2, ensemble_memory="512MiB", dask=DaskOptions(scheduler="tcp://h:8786"))
    assert (options.executor, options.ensemble_memory, SweepOptions().executor) == ("dask", 2**29, "local")
    assert options.intervals == {"noise_scale_every": None, "probe_every": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.workers = 3
    assert StudyOverrides(seeds=[0, 1], methods=[]) == StudyOverrides(seeds=(0, 1))  # an empty list: the preset's
    assert RunConfig("digits", "affine", 32, 0).check() == RunConfig("digits", "affine", 32, 0)


def test_the_plan_refuses_settings_the_runs_cannot_take(tmp_path):
    preset = tmp_path / "quick.toml"
    preset.write_text(PRESET)
    with pytest.raises(ValueError, match="^preset 'quick': a run setting has the wrong type") as error:
        plan_study(str(preset), StudyOverrides(settings={"base_lr": "fast"}))
    one_line(error)
    preset.write_text(PRESET + "group_by = \"nosuch\"\n")  # in its [analysis] table
    with pytest.raises(ValueError, match="^preset 'quick' \\[analysis\\] of study 'quick': group_by 'nosuch' is not"):
        plan_study(str(preset))
    preset.write_text(PRESET.replace("length = 1", "length = inf"))
    with pytest.raises(ValueError, match=r"^preset 'quick' \[run\] length: inf is not a finite number"):
        plan_study(str(preset))
    for text in (PRESET + "n_boot = 0\n", PRESET.replace('metric = "test_accuracy"', "n_boot = 0")):
        preset.write_text(text)  # a fixed budget's intervals need a bootstrap: refused before any run, the metric
        with pytest.raises(ValueError, match=r"^preset 'quick' \[analysis\] of study 'quick': n_boot .* >= 100 for"):
            plan_study(str(preset))  # named or not


def test_preflight_checks_before_anything_is_written(tmp_path):
    preset = tmp_path / "quick.toml"
    preset.write_text(PRESET)
    plan = plan_study(load_preset(str(preset)))
    out = tmp_path / "out"
    checked = preflight(plan, out)
    assert isinstance(checked, Preflight)
    assert (checked.db, checked.resumes, dict(checked.out_dirs)) == (out / "results.sqlite", False, {"quick": out})
    assert list(checked.fingerprints) == ["digits"] and len(checked.fingerprints["digits"]) == 1
    assert not checked.db.exists()  # (the report folder is created, to prove it writable; no store)
    with pytest.raises(ValueError, match=f"^db {out / 'summary.json'} would be overwritten by the report") as error:
        preflight(plan, out, db=out / "summary.json")
    one_line(error)
    foreign = tmp_path / "shop.sqlite"
    connection = sqlite3.connect(foreign)
    connection.execute("CREATE TABLE orders (id INTEGER)")
    connection.commit()
    connection.close()
    with pytest.raises(ValueError, match=f"^db {foreign}: not an affdiv results store"):
        preflight(plan, out, db=foreign)
    bogus = plan_study(load_preset(str(preset)), StudyOverrides(settings={"device": "bogus"}))
    with pytest.raises(ValueError, match="^device 'bogus': not a torch device") as error:
        preflight(bogus, out)
    one_line(error)


def test_preflight_refuses_to_mix_measurement_intervals(tmp_path):
    preset = tmp_path / "quick.toml"
    preset.write_text(PRESET)
    plan = plan_study(str(preset), options=SweepOptions(probe_every=5))
    db = tmp_path / "runs.sqlite"
    first = next(iter(plan.runs.values()))
    checked = preflight(plan, tmp_path / "out", db=db)
    with ResultStore(db) as store:
        store.put(first.to_dict(), StoredRun({"test_accuracy": 0.5}, [], 1.0, checked.fingerprints["digits"][0],
                                             measurements=[{"measurement": "divergence", "step": s} for s in (0, 5)]))
    with ResultStore(db, read_only=True) as store:
        check_measurement_resume(store, list(plan.runs), plan.options.intervals)
        with pytest.raises(ValueError, match=f"^db {db} holds runs of this sweep measured with probe_every 5; resuming "
                                             "with probe_every 7 would mix them"):
            check_measurement_resume(store, list(plan.runs), {**plan.options.intervals, "probe_every": 7})
    assert preflight(plan, tmp_path / "out", db=db).resumes


def test_a_store_takes_one_stored_run_object(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store, pytest.raises(ValueError, match="^run must be a StoredRun"):
        store.put({"method": "affine", "seed": 0}, {"metrics": {}})

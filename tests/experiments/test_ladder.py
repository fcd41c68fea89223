"""The target ladder: geometric reads and interpolated crossings, every candidate's curve kept,
the best learning rate at each target read from one set of runs, per-target records in the
store, and the analysis along the ladder on planted records."""

import dataclasses
import itertools
import math
import sqlite3
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from affdiv.experiments.analysis.critical_batch import (
    RATIO_MARGIN,
    analyse_target,
    simulate_target_records,
)
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.experiments.runs import reads
from affdiv.experiments.runs.config import RunConfig, config_hash
from affdiv.experiments.runs.store import ResultStore, StoredRun
from affdiv.experiments.runs.training import train_run, train_runs
from affdiv.vocabulary import TARGET_METRIC

#: The steps-to-target analysis (its settings otherwise at their defaults).
TARGET = AnalysisSettings(metric=TARGET_METRIC)

pytestmark = pytest.mark.usefixtures("one_thread")

LADDER = (0.8, 0.85, 0.9)


def _ladder(**changes) -> RunConfig:
    base = dict(dataset="digits", method="affine", batch_size=32, seed=0, depth=1, width=16, budget="target",
                target=0.9, targets=(0.8, 0.85), read_spacing=0.05, length=400, lr_rule="tuned",
                lr_grid=(0.05, 0.1, 0.2, 0.4), grid_extensions=0)
    return RunConfig(**{**base, **changes})


# ------------------------------------------------------------------------------------ reads
@settings(max_examples=60, deadline=None)
@given(max_steps=st.integers(1, 20000), spacing=st.floats(0.001, 1.0))
def test_geometric_reads_bracket_every_step_within_the_spacing(max_steps, spacing):
    steps = list(reads.read_steps(max_steps, eval_every=10, read_spacing=spacing))
    assert steps[-1] == max_steps and steps == sorted(set(steps)) and steps[0] == 1
    # Every crossing S in (s_{k-1}, s_k] is within the gap, which is at most spacing * s_{k-1} (or 1 step).
    for before, after in zip(steps, steps[1:]):
        assert after - before <= max(1, spacing * before)
    # About log(max_steps)/log(1 + spacing) reads, plus one per step while spacing * s < 1.
    assert len(steps) <= 1 / spacing + math.log(max_steps) / math.log1p(spacing) + 2


def test_reads_every_eval_every_steps_are_the_old_checks():
    assert list(reads.read_steps(23, eval_every=5, read_spacing=None)) == [5, 10, 15, 20, 23]


@given(a0=st.floats(0.0, 0.89), a1=st.floats(0.9, 1.0), s0=st.integers(1, 1000), gap=st.integers(1, 100))
def test_an_interpolated_crossing_lies_between_its_reads(a0, a1, s0, gap):
    curve = [{"step": s0, "train_loss": 1.0, "val_loss": 1.0, "val_metric": a0},
             {"step": s0 + gap, "train_loss": 1.0, "val_loss": 1.0, "val_metric": a1}]
    steps, read = reads.crossing(curve, 0.9, interpolate=True)
    assert read == s0 + gap and s0 < steps <= s0 + gap
    # Linear in accuracy: the closed form of the module docstring.
    assert steps == pytest.approx(s0 + (0.9 - a0) / (a1 - a0) * gap, rel=1e-12)
    assert reads.crossing(curve, 0.9, interpolate=False) == (s0 + gap, s0 + gap)


def test_a_read_after_divergence_is_never_a_crossing():
    curve = [{"step": 1, "train_loss": 1.0, "val_loss": 1.0, "val_metric": 0.5},
             {"step": 2, "train_loss": None, "val_loss": None, "val_metric": 0.95}]
    assert reads.crossing(curve, 0.9, interpolate=True) is None


# -------------------------------------------------------------------------------- training
def _alone(config: RunConfig, target: float, digits) -> dict:
    """The run retrained with ``target`` as its only target."""
    return train_run(dataclasses.replace(config, target=target, targets=()), digits).metrics


def test_the_stored_candidates_give_each_target_what_retraining_for_it_alone_gives(digits):
    config = _ladder()
    result = train_run(config, digits)
    assert len(result.candidates) == 4 and {c["lr"] for c in result.candidates} == set(config.lr_grid)
    best = reads.best_at_targets(result.candidates, LADDER, max_steps=400, interpolate=True, tuned=True)
    # The run's own metrics are its primary target's.
    assert result.metrics["steps_to_target"] == best[0.9]["steps_to_target"] and result.metrics["lr"] == best[0.9]["lr"]
    for target in LADDER:
        alone = _alone(config, target, digits)
        assert alone["censored"] == 0 == best[target]["censored"]
        assert (best[target]["lr"], best[target]["steps_to_target"]) == (alone["lr"], alone["steps_to_target"])
    # Each candidate stopped at the first read at which, for every target it had not reached,
    # another candidate already had: the highest target's first crossing bounds every curve.
    first = min(reads.crossing(c["curve"], 0.9, interpolate=True)[1] for c in result.candidates
                if reads.crossing(c["curve"], 0.9, interpolate=True))
    assert max(c["curve"][-1]["step"] for c in result.candidates) == first


def test_ties_at_a_target_are_broken_as_a_run_for_that_target_alone_breaks_them(digits):
    # Reads every 100 steps make equal steps common; the tie-break (validation accuracy, then loss)
    # is read at the read that reached the target, not at the candidate's last read (which differs
    # along a ladder, where candidates stop at different reads).
    config = _ladder(seed=3, target=0.95, targets=(0.9, 0.93, 0.96), read_spacing=None, eval_every=100, length=2000,
                     lr_grid=(0.025, 0.05, 0.1, 0.2))
    result = train_run(config, digits)
    best = reads.best_at_targets(result.candidates, config.ladder, max_steps=2000, interpolate=False, tuned=True)
    ties = 0
    for target in config.ladder:
        alone = _alone(config, target, digits)
        assert (best[target]["lr"], best[target]["steps_to_target"]) == (alone["lr"], alone["steps_to_target"])
        steps = [reads.crossing(c["curve"], target, interpolate=False) for c in result.candidates]
        ties += sum(1 for x in steps if x and x[0] == best[target]["steps_to_target"]) > 1
    assert ties  # the case this test is about occurs


BLOWS_UP = """
from torch import nn


class Net(nn.Module):
    def __init__(self, shape, k):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, k))
        self.calls = 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls > 150:  # diverges after 150 training steps, whatever the learning rate
                out = out * float("nan")
        return out


def factory(input_shape, num_classes):
    return Net(input_shape, num_classes)
"""


def test_the_primary_targets_result_is_the_model_that_reached_it(digits, tmp_path, monkeypatch):
    # Above the primary target the run trains on; a candidate that diverges there keeps, at the
    # primary target, the model and numbers it had when it reached it.
    (tmp_path / "blows.py").write_text(BLOWS_UP)
    monkeypatch.chdir(tmp_path)
    config = RunConfig(dataset="digits", method="mine", model="blows.py:factory", batch_size=32, seed=0,
                       budget="target", target=0.8, targets=(0.97,), read_spacing=0.1, length=1500, lr_rule="tuned",
                       lr_grid=(0.1, 0.2), grid_extensions=0)
    result = train_run(config, digits)
    m = result.metrics
    assert all(c["diverged"] for c in result.candidates) and m["diverged"] == 0 and m["censored"] == 0
    reached = reads.crossing(next(c for c in result.candidates if c["lr"] == m["lr"])["curve"], 0.8, interpolate=True)
    assert m["steps_to_target"] == reached[0] and m["steps"] == reached[1] < 150
    assert m["val_accuracy"] >= 0.8 and m["test_accuracy"] > 0.5 and math.isfinite(m["test_loss"])


def test_a_grid_extension_for_one_target_is_seen_at_every_target(digits):
    # A grid too small for every target: the best lr sits on the upper edge, so the grid grows
    # upward; what the extended candidates reach enters every target's choice.
    config = _ladder(lr_grid=(0.0125, 0.025), grid_extensions=2)
    result = train_run(config, digits)
    lrs = sorted({c["lr"] for c in result.candidates})
    assert lrs == [0.0125, 0.025, 0.05, 0.1]
    best = reads.best_at_targets(result.candidates, LADDER, max_steps=400, interpolate=True, tuned=True)
    for target in LADDER:
        alone = _alone(config, target, digits)
        # Never worse than the target alone: its candidates are among the ladder's.
        assert best[target]["steps_to_target"] <= alone["steps_to_target"]


@pytest.mark.parametrize(("reading", "bound"), [({}, 0.02), ({"sparse_spacing": 0.15}, 0.025)],
                         ids=["geometric", "adaptive"])
def test_reads_estimate_steps_to_target_without_bias(reading, bound):
    # Against a read at every step (eval_every = 1, no interpolation: the first step at which the
    # validation accuracy reaches the target), over 3 seeds x 3 batch sizes x 3 targets, in the
    # geometric regime (S = 68-336 steps: reads 3-16 steps apart) on a 431-image validation split;
    # geometric reads at r = 0.05, and adaptive ones at r = 0.05 near a target and 0.15 elsewhere.
    from affdiv.experiments.data.dataset import load_dataset

    errors = []
    for seed in range(3):
        data = load_dataset("digits", seed=seed, val_fraction=0.3)
        for batch_size in (8, 32, 128):
            base = dict(seed=seed, data_seed=seed, val_fraction=0.3, batch_size=batch_size, lr_rule="constant",
                        base_lr=0.03, length=3000)
            read = train_run(_ladder(**base, **reading), data)
            every = train_run(_ladder(**base, read_spacing=None, eval_every=1), data)
            for target in LADDER:
                exact = reads.crossing(every.candidates[0]["curve"], target, interpolate=False)
                estimate = reads.crossing(read.candidates[0]["curve"], target, interpolate=True)
                assert exact and estimate and exact[0] >= 60  # reads there are >= 3 steps apart
                errors.append((estimate[0] - exact[0]) / exact[0])
    # Accuracy is not monotone: sparse reads can miss a brief excursion above the target, so
    # single runs may be read late by more than the spacing; on average the error is small.
    bias = float(np.mean(errors))
    assert abs(bias) < bound, f"bias {bias:.4f} of S; errors {np.round(errors, 3).tolist()}"


@pytest.mark.parametrize("stacked", [False, True], ids=["one-at-a-time", "stacked"])
def test_adaptive_reads_bracket_every_crossing_densely_and_read_less(digits, stacked):
    config = _ladder(length=3000, sparse_spacing=0.5, grid_extensions=1)
    result = train_runs([config], [digits], stacked=stacked)[0]
    geometric = train_runs([dataclasses.replace(config, sparse_spacing=None)], [digits], stacked=stacked)[0]
    dense = config.read_spacing
    curves = [c["curve"] for c in result.candidates]
    sparse_gaps = sum(b - a > max(1, dense * a) for curve in curves
                      for a, b in itertools.pairwise(p["step"] for p in curve))
    for target in LADDER:
        # The first read of the run at which a candidate reached the target (later ones never give
        # the fewest steps): bracketed as under geometric reads, within r of the read before it.
        crossings = [(reads.crossing(curve, target, interpolate=True), curve) for curve in curves]
        first = min(reached[1] for reached, _curve in crossings if reached)
        for reached, curve in crossings:
            steps = [p["step"] for p in curve]
            if reached and reached[1] == first and first != steps[0]:
                before = steps[steps.index(first) - 1]
                assert first - before <= max(1, math.floor(dense * before)), (target, before, reached)
    assert sparse_gaps > 0  # (the sparse spacing was used)
    assert sum(map(len, (c["curve"] for c in result.candidates))) < \
        sum(map(len, (c["curve"] for c in geometric.candidates)))
    # Every target is reached by each; the steps agree to within the dense reads' resolution
    # (up to the excursions the sparse stretches skip, which make the adaptive reads no earlier).
    best = reads.best_at_targets(result.candidates, LADDER, max_steps=3000, interpolate=True, tuned=True)
    best_geometric = reads.best_at_targets(geometric.candidates, LADDER, max_steps=3000, interpolate=True, tuned=True)
    for target in LADDER:
        steps, steps_geometric = best[target]["steps_to_target"], best_geometric[target]["steps_to_target"]
        assert steps is not None and steps >= steps_geometric * (1 - dense)


def test_a_rewound_stretch_is_trained_exactly_as_the_first_time(digits, monkeypatch):
    # Never near a target: every gap is sparse (doubling the steps), so each crossing is found
    # after a sparse gap and its stretch re-trained from the state kept at the read before. The
    # models are those of the same steps on the same batches: at max_steps they are those of
    # geometric reads, to the bit.
    from affdiv.experiments.runs import training

    restored = []
    original = training._AdaptiveReads.restore
    monkeypatch.setattr(training._AdaptiveReads, "restore",
                        lambda self, cands: restored.append(self.last) or original(self, cands))
    monkeypatch.setattr(reads, "near_target", lambda *args: False)
    base = dict(lr_rule="constant", base_lr=0.03, length=300, target=0.99, targets=(0.8, 0.85), read_spacing=0.05)
    adaptive = train_run(_ladder(**base, sparse_spacing=1.0), digits)
    geometric = train_run(_ladder(**base), digits)
    assert restored  # the stretch in which the targets were first reached was re-trained
    last, last_geometric = adaptive.curves[-1], geometric.curves[-1]
    assert last["step"] == last_geometric["step"] == 300
    assert (last["val_metric"], last["val_loss"]) == (last_geometric["val_metric"], last_geometric["val_loss"])
    assert adaptive.metrics["test_loss"] == geometric.metrics["test_loss"]
    for target in (0.8, 0.85):  # each crossing read densely: within r = 0.05 of the read before it
        _steps, read = reads.crossing(adaptive.curves, target, interpolate=True)
        steps = [p["step"] for p in adaptive.curves]
        assert read - steps[steps.index(read) - 1] <= max(1, 0.05 * read)


# ----------------------------------------------------------------------------------- store
def test_a_ladder_run_gives_one_record_per_target(tmp_path, digits):
    config = _ladder()
    result = train_run(config, digits)
    with ResultStore(tmp_path / "r.sqlite") as store:
        store.put(config.to_dict(), StoredRun(metrics=result.metrics, curves=result.curves, seconds=1.0,
                                              data_fingerprint=result.data_fingerprint, candidates=result.candidates))
    with ResultStore(tmp_path / "r.sqlite", read_only=True) as store:
        records = store.records(metric="steps_to_target")
        runs = store.records(metric="test_accuracy")
        assert store.candidates() == {config_hash(config.to_dict()): result.candidates}
    assert [r["target"] for r in records] == list(LADDER) and len(runs) == 1
    best = reads.best_at_targets(result.candidates, LADDER, max_steps=400, interpolate=True, tuned=True)
    for record in records:
        chosen = best[record["target"]]
        assert record["metric"] == record["steps_to_target"] == chosen["steps_to_target"]
        assert (record["lr"], record["primary_target"], record["max_steps"]) == (chosen["lr"], 0.9, 400)
    primary = next(r for r in records if r["target"] == 0.9)
    assert primary["steps_to_target"] == result.metrics["steps_to_target"]


def test_candidates_are_stored_compressed_and_a_plain_json_row_still_reads(tmp_path, digits):
    config = _ladder()
    result = train_run(config, digits)
    key = config_hash(config.to_dict())
    with ResultStore(tmp_path / "r.sqlite") as store:
        store.put(config.to_dict(), StoredRun(metrics=result.metrics, curves=result.curves, seconds=1.0,
                                              data_fingerprint=result.data_fingerprint, candidates=result.candidates))
    db = sqlite3.connect(tmp_path / "r.sqlite")
    (cell,) = db.execute("SELECT candidates FROM runs").fetchone()
    text = zlib.decompress(cell).decode()
    assert len(cell) < len(text) / 3, (len(cell), len(text))
    with db:  # a row as an earlier version wrote it: the same JSON as text
        db.execute("UPDATE runs SET candidates = ?", (text,))
    db.close()
    with ResultStore(tmp_path / "r.sqlite", read_only=True) as store:
        assert store.candidates() == {key: result.candidates}
        assert len(store.records(metric="steps_to_target")) == len(LADDER)
    db = sqlite3.connect(tmp_path / "r.sqlite")
    with db:  # damaged compressed bytes are a damaged store, named
        db.execute("UPDATE runs SET candidates = ?", (cell[:-7],))
    db.close()
    with ResultStore(tmp_path / "r.sqlite", read_only=True) as store, \
            pytest.raises(ValueError, match=f"run {key}: column 'candidates' is not valid JSON"):
        store.candidates()


def test_ladder_settings_are_checked_and_spelled_once():
    assert _ladder(targets=(0.85, 0.8, 0.9)).to_dict() == _ladder().to_dict()
    assert config_hash(_ladder(read_spacing=1).to_dict()) == config_hash(_ladder(read_spacing=1.0).to_dict())
    assert config_hash(_ladder(batch_size=np.int64(32)).to_dict()) == config_hash(_ladder().to_dict())
    assert _ladder().ladder == LADDER
    with pytest.raises(ValueError, match=r"targets must be validation accuracies in \(0, 1\], got \[0.8, 1.2\]"):
        _ladder(targets=(0.8, 1.2))
    with pytest.raises(ValueError, match=r"read_spacing must be None .* got 0"):
        _ladder(read_spacing=0)
    for sparse, spacing in ((0.05, 0.05), (1.5, 0.05), (0.2, None), (True, 0.05)):
        with pytest.raises(ValueError, match=r"sparse_spacing must be None .* with read_spacing set"):
            _ladder(sparse_spacing=sparse, read_spacing=spacing)
    # An opt-in setting: absent from the key where unset, part of it where set.
    assert "sparse_spacing" not in _ladder().to_dict()
    assert config_hash(_ladder(sparse_spacing=0.2).to_dict()) != config_hash(_ladder().to_dict())
    # Idle outside the target budget; eval_every idle when the reads are geometric.
    assert "targets" not in _ladder(budget="epochs", length=2).to_dict()
    assert "eval_every" not in _ladder().to_dict()


# -------------------------------------------------------------------------------- analysis
def _planted(ratios: dict[str, float], seeds: int = 10, sigma: float = 0.04) -> list[dict]:
    """Records along a ladder whose baselines' B_crit grows with the target (x2 from 0.78 to
    0.84), the corrected methods at fixed ratios of it."""
    rng = np.random.default_rng(7)
    records = []
    for i, target in enumerate((0.78, 0.80, 0.82, 0.84)):
        reference = 40.0 * 2 ** (i / 3)
        curves = {"base": (300.0 * (1 + i / 4), reference),
                  **{m: (300.0 * (1 + i / 4), reference * r) for m, r in ratios.items()}}
        for row in simulate_target_records(curves, batch_sizes=[8, 16, 32, 64, 128, 256, 512, 1024],
                                           seeds=range(seeds), sigma=sigma, seed_sd=0.05, rng=rng):
            records.append({**row, "target": target})
    return records


def test_planted_ratios_are_recovered_and_classified_along_the_ladder():
    analysis = analyse_target(_planted({"small": 0.81, "half": 0.5}), TARGET.replace(corrected=["small", "half"],
                              baselines=["base"], n_boot=0))
    summary = analysis.to_dict()
    assert summary["primary_target"] == 0.84 and set(summary["by_target"]) == {"0.78", "0.8", "0.82", "0.84"}
    for key, content in summary["by_target"].items():
        assert content["critical_batch"]["base"]["ci_low"] < 40.0 * 2 ** ((float(key) - 0.78) / 0.06) \
            < content["critical_batch"]["base"]["ci_high"]
        for method, planted, kind in (("small", 0.81, "smaller_within_margin"), ("half", 0.5, "smaller")):
            pair = content["ratios"][method]["base"]
            assert pair["ci_low"] < planted < pair["ci_high"], (key, method, pair)
            assert pair["class"] == kind, (key, method, pair)
    assert summary["ratios"] == summary["by_target"]["0.84"]["ratios"]
    assert summary["prediction"]["verdict"] == "supported"
    # The ratios do not move along the ladder: the trend's interval holds 0 and is narrow.
    for method in ("small", "half"):
        trend = summary["trends"][method]["base"]
        assert trend["status"] == "ok" and trend["ci_low"] < 0 < trend["ci_high"]
    assert "_replicates" not in str(summary)


def test_a_ratio_that_moves_along_the_ladder_has_a_trend():
    rng = np.random.default_rng(3)
    records = []
    for i, target in enumerate((0.78, 0.80, 0.82, 0.84)):
        ratio = 1.0 * 0.8 ** i  # 1 -> 0.51: -log(0.8) per 0.02 of target
        curves = {"base": (300.0, 60.0), "c": (300.0, 60.0 * ratio)}
        records += [{**r, "target": target} for r in simulate_target_records(
            curves, batch_sizes=[8, 16, 32, 64, 128, 256, 512, 1024], seeds=range(8), sigma=0.04, seed_sd=0.0,
            rng=rng)]
    analysis = analyse_target(records, TARGET.replace(corrected=["c"], baselines=["base"], n_boot=0))
    trend = analysis.to_dict()["trends"]["c"]["base"]
    planted = math.log(0.8) / 2  # per 0.01 of target
    assert trend["ci_low"] < planted < trend["ci_high"] and trend["ci_high"] < 0 and trend["p"] < 0.05


def test_equivalence_no_longer_hides_a_real_reduction():
    # A planted 0.81 with tight data: shown below 1 AND inside the band -> "smaller_within_margin",
    # where the equivalence-first rule said "equivalent" (a contradiction).
    analysis = analyse_target(_planted({"small": 0.81}, seeds=16, sigma=0.02), TARGET.replace(corrected=["small"],
                              baselines=["base"], n_boot=0, primary_target=0.8))
    pair = analysis.to_dict()["ratios"]["small"]["base"]
    assert RATIO_MARGIN < pair["ci_low_one_sided"] and pair["ci_high_one_sided"] < 1
    assert pair["class"] == "smaller_within_margin" and analysis.to_dict()["primary_target"] == 0.8


def test_a_primary_target_not_in_the_records_is_refused():
    with pytest.raises(ValueError, match=r"primary_target 0.9 is not among the records' targets"):
        analyse_target(_planted({"c": 0.5}, seeds=4), TARGET.replace(corrected=["c"], baselines=["base"], n_boot=0,
                       primary_target=0.9))


def test_the_trend_pairs_targets_by_seed_not_by_position():
    # Each target's records from other seeds: no seed to leave out at every target, so no trend.
    records = []
    for i, target in enumerate((0.78, 0.80, 0.82)):
        curves = {"base": (300.0, 60.0), "c": (300.0, 30.0)}
        records += [{**r, "target": target} for r in simulate_target_records(
            curves, batch_sizes=[8, 16, 32, 64, 128, 256, 512, 1024], seeds=range(8 * i, 8 * i + 8), sigma=0.04,
            seed_sd=0.05, rng=np.random.default_rng(i))]
    analysis = analyse_target(records, TARGET.replace(corrected=["c"], baselines=["base"], n_boot=0))
    trend = analysis.to_dict()["trends"]["c"]["base"]
    assert trend == {"status": "no trend: 0 seed(s) common to every target, needs >= 3"}


def test_the_near_target_margin_is_the_largest_recent_change_between_reads():
    def curve(accuracies):
        return [{"step": 10 * k, "val_metric": a} for k, a in enumerate(accuracies)]

    flat = [0.5, 0.8, 0.5, 0.5]  # no rise at the end; one jump of 0.3 among the last reads
    assert reads.near_target(curve(flat), (0.85,), {}, horizon=1)  # 0.8 + 2 * 0.3 >= 0.85
    assert not reads.near_target(curve(flat), (1.45,), {}, horizon=1)  # 0.8 + 0.6 < 1.45
    assert not reads.near_target(curve([0.5] * 12), (0.51,), {}, horizon=1)  # no change, no slope
    assert reads.near_target(curve([0.5, 0.6]), (0.9,), {}, horizon=10)  # slope 0.01/step: 0.6 + 0.2 + 0.2
    assert not reads.near_target(curve(flat), (0.85,), {0.85: 3}, horizon=1)  # every target reached
    assert not reads.near_target(curve([0.5, 0.8, math.nan]), (0.85,), {}, horizon=1)  # diverged
    old = [0.5, 0.9] + [0.5] * 9  # the jump is older than the last eight changes
    assert not reads.near_target(curve(old), (0.95,), {}, horizon=1)

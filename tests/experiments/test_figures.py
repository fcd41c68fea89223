"""Every figure of a small report (both designs) and of `affdiv probe`, read from its matplotlib
objects as the report saves it: size (and the saved PNG's), words on the axes, a title, series told
apart by marker or line style (not colour alone), the shared y range, the LR rule in words, the
calibration legend and the deciding tests of the forest. The checker itself is shown to fail on a
broken figure."""

import re
from pathlib import Path

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from affdiv.experiments import probe
from affdiv.experiments.analysis.calibration import calibrate_for
from affdiv.experiments.analysis.critical_batch import RATIO_MARGIN, analyse_target, simulate_target_records
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.experiments.data.dataset import load_dataset
from affdiv.experiments.report import figures
from affdiv.experiments.report.writer import write_report
from affdiv.vocabulary import TARGET_METRIC
from tests.experiments.test_report import PROVENANCE, ladder, study  # noqa: F401  (the small reports' fixtures)

#: The steps-to-target analysis (its settings otherwise at their defaults).
TARGET = AnalysisSettings(metric=TARGET_METRIC)

# column and key names that must never stand on an axis in place of words
RAW_NAMES = ("test_accuracy", "batch_size", "val_metric", "train_loss", "lr_rule", "steps_to_target",
             "median_steps", "off_diagonal_share", "cosine_mean", "diagonal_scale", "input_norm")
MIN_FONT_PT = 7
MAX_HEIGHT_PX = 2400
TUNED = "learning rate tuned per method and batch size"


def _png_size(path: Path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _title(figure: Figure) -> str:
    suptitle = figure._suptitle.get_text() if figure._suptitle else ""
    return " ".join([suptitle] + [ax.get_title() for ax in figure.axes]).strip()


def _check_readable(figure: Figure, name: str) -> None:
    width, height = figure.get_size_inches() * figures._DPI
    assert width <= figures.MAX_WIDTH_PX and height <= MAX_HEIGHT_PX, (name, width, height)
    assert figure.axes, name
    assert _title(figure), f"{name}: no title"
    for ax in figure.axes:
        assert ax.get_title() or figure._suptitle, f"{name}: a panel without a title"
        for label in (ax.xaxis.label, ax.yaxis.label):
            text = label.get_text()
            assert len(re.findall(r"[A-Za-z]{3,}", text)) >= 2, (name, f"not words: {text!r}")
            assert not re.search(r"[A-Za-z]{2,}_[A-Za-z]{2,}", text), (name, f"a raw name: {text!r}")
            assert not any(raw in text for raw in RAW_NAMES), (name, text)
            assert label.get_fontsize() >= MIN_FONT_PT, (name, text, label.get_fontsize())
        legend = ax.get_legend()
        if legend is not None:
            assert all(t.get_fontsize() >= MIN_FONT_PT for t in legend.get_texts()), name
        # Series of different labels differ in marker or line style, not colour alone: both the
        # labelled lines and the legend's own handles (which a figure may draw apart from its lines).
        for handles in (ax.get_legend_handles_labels()[0], [] if legend is None else legend.legend_handles):
            keys = []
            for handle in handles:
                line = handle[0] if isinstance(handle, ErrorbarContainer) else handle
                if isinstance(line, Line2D):
                    keys.append((line.get_marker(), str(line.get_linestyle())))
            assert len(keys) == len(set(keys)), (name, f"series told apart by colour alone: {keys}")


@pytest.fixture
def captured(monkeypatch):
    """{file name: Figure} of every figure saved through the report's figure module (the probe's
    figures save through it too), and each file saved."""
    seen = {}
    save = figures._save

    def capture(figure, path):
        seen[Path(path).name] = figure
        return save(figure, path)

    monkeypatch.setattr(figures, "_save", capture)
    return seen


def _texts(figure: Figure) -> list:
    """Every text artist the figure draws, as (what, Text): titles, axis labels, the tick labels
    drawn (those in the view), other texts, legend texts and titles."""
    out = [("suptitle", figure._suptitle)] if figure._suptitle else []
    out += [("figure text", t) for t in figure.texts]
    out += [("figure legend", t) for legend in figure.legends for t in [*legend.get_texts(), legend.get_title()]]
    for n, ax in enumerate(figure.axes):
        out += [(f"axes {n} title", t) for t in (ax.title, ax._left_title, ax._right_title)]
        out += [(f"axes {n} x label", ax.xaxis.label), (f"axes {n} y label", ax.yaxis.label)]
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            for tick in axis._update_ticks():  # the ticks drawn: those within the view
                out += [(f"axes {n} {name} tick", label) for label in (tick.label1, tick.label2)]
            out.append((f"axes {n} {name} offset", axis.offsetText))
        out += [(f"axes {n} text", t) for t in ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            out += [(f"axes {n} legend", t) for t in [*legend.get_texts(), legend.get_title()]]
    seen: set = set()  # the suptitle is among the figure's texts too
    return [(what, t) for what, t in out if t.get_visible() and t.get_text().strip()
            and not (id(t) in seen or seen.add(id(t)))]


def _check_layout(figure: Figure, name: str) -> None:
    """No two texts overlap (bounding boxes from matplotlib's renderer, more than 1 px each way), no
    text reaches outside the figure (its size as laid out: ``bbox_inches="tight"`` would save such
    a text, but only by growing the figure past the size it was laid out for), and no two lines of
    one axes look alike but for their colour (same marker, line style and fill)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()
    for _ in range(2):  # constrained layout settles over two draws, as savefig(bbox_inches="tight") draws
        figure.draw(renderer)
    boxes = [(what, t.get_text(), t.get_window_extent(renderer)) for what, t in _texts(figure)]
    edge = figure.bbox
    for what, text, box in boxes:
        assert box.x0 >= edge.x0 - 1 and box.y0 >= edge.y0 - 1 and box.x1 <= edge.x1 + 1 and \
            box.y1 <= edge.y1 + 1, f"{name}: {what} {text!r} clipped: {box.bounds} outside {edge.bounds}"
    for i, (what_a, text_a, a) in enumerate(boxes):
        for what_b, text_b, b in boxes[i + 1:]:
            overlap = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
            assert not (overlap[0] > 1 and overlap[1] > 1), \
                f"{name}: {what_a} {text_a!r} overlaps {what_b} {text_b!r} by {overlap[0]:.0f}x{overlap[1]:.0f} px"
    for n, ax in enumerate(figure.axes):
        caps = {id(line) for c in ax.containers if isinstance(c, ErrorbarContainer) for line in c[1]}
        looks: dict = {}
        for line in ax.get_lines():
            if id(line) in caps or not line.get_visible():
                continue
            marker, style = str(line.get_marker()), str(line.get_linestyle())
            if marker in ("None", "", " ") and style in ("None", "", " "):
                continue
            open_face = str(line.get_markerfacecolor()) in ("none", "white", "w") or line.get_fillstyle() == "none"
            looks.setdefault((marker, style, open_face), set()).add(str(line.get_color()))
        alike = {key: colours for key, colours in looks.items() if len(colours) > 1}
        assert not alike, f"{name}, axes {n}: lines told apart by colour alone: {alike}"


def _check_every_saved_figure(captured, paths):
    pngs = {Path(p).name: Path(p) for p in paths if str(p).endswith(".png")}
    assert set(pngs) == set(captured), "a figure was written without figures._save"
    for name, figure in captured.items():
        _check_readable(figure, name)
        _check_layout(figure, name)
        width, height = _png_size(pngs[name])
        assert width <= figures.MAX_WIDTH_PX and height <= MAX_HEIGHT_PX, (name, width, height)


def test_every_figure_of_a_small_fixed_budget_report(study, captured, tmp_path):  # noqa: F811
    records, curves, analysis, calibration = study
    paths = write_report(tmp_path, analysis, records=records, curves=curves, provenance=PROVENANCE,
                         calibration=calibration)
    assert set(captured) == {"metric_vs_batch.png", "contrast_forest.png", "slope_forest.png",
                             "training_curves.png", "calibration.png"}
    _check_every_saved_figure(captured, paths.values())

    panels = captured["metric_vs_batch.png"].axes
    assert len(panels) == 2 and len({ax.get_ylim() for ax in panels}) == 1  # shared y range
    assert {ax.get_title() for ax in panels} == {"learning rate ∝ √B", TUNED}  # the LR rule in words
    assert TUNED in _title(captured["training_curves.png"])

    labels = [t.get_text() for t in captured["calibration.png"].axes[0].get_legend().get_texts()]
    assert any("joint verdict 'supported'" in t for t in labels) and any("affine_like" in t for t in labels)
    assert any("α" in t for t in labels) and "Monte-Carlo" in _title(captured["calibration.png"])
    # Points at the simulated effects only, each with its error bar; no line joins them.
    ax = captured["calibration.png"].axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 + len(calibration.methods)  # joint supported and contradicted, each corrected layer
    gap = min(np.diff(sorted(calibration.effects)))
    for bar in bars:
        points = bar[0]
        assert str(points.get_linestyle()) == "None" and points.get_marker() not in ("None", "")
        assert np.allclose(sorted(points.get_xdata()), sorted(calibration.effects), atol=0.2 * gap)
    assert any("± equivalence margin" in t for t in labels)


def test_every_figure_of_a_small_steps_to_target_report(captured, tmp_path):
    rng = np.random.default_rng(2)
    records = simulate_target_records({"affine_like": (300, 100), "affine": (200, 400), "batchnorm": (150, 400)},
                                      batch_sizes=(16, 64, 256, 1024), seeds=range(5), sigma=0.1, max_steps=5000,
                                      rng=rng)
    records = [{**r, "lr_rule": "tuned"} for r in records]
    analysis = analyse_target(records, TARGET.replace(n_boot=0, group_by="lr_rule"))
    curves = [{"method": r["method"], "batch_size": r["batch_size"], "seed": r["seed"], "lr_rule": "tuned",
               "epoch": 1 + step // 100, "step": step, "train_loss": 2.0 / (1 + step / r["batch_size"]),
               "val_metric": 0.1 + 0.8 * step / 400} for r in records for step in (0, 100, 200, 300, 400)]
    calibration = calibrate_for(analysis, n_sims=3)
    paths = write_report(tmp_path, analysis, records=records, curves=curves, provenance=PROVENANCE,
                         calibration=calibration)
    assert set(captured) == {"steps_vs_batch.png", "examples_vs_steps.png", "bcrit_forest.png", "ratio_forest.png",
                             "training_curves.png", "calibration.png"}
    _check_every_saved_figure(captured, paths.values())
    for name in ("steps_vs_batch.png", "examples_vs_steps.png", "training_curves.png"):
        assert TUNED in _title(captured[name]), name
    for name in ("steps_vs_batch.png", "examples_vs_steps.png"):
        # Each method's legend entry shows its points' marker and its fit's line style.
        handles = captured[name].axes[0].get_legend().legend_handles
        assert len(handles) == 3, name
        assert len({h.get_marker() for h in handles}) == len({h.get_linestyle() for h in handles}) == 3, name
        fits = {(line.get_linestyle(), line.get_color()) for line in captured[name].axes[0].get_lines()
                if line.get_linestyle() != "None"}
        assert {(h.get_linestyle(), h.get_color()) for h in handles} <= fits, name
    curve_axes = captured["training_curves.png"].axes
    assert curve_axes[0].get_xlabel() == "optimizer step" and curve_axes[0].xaxis.get_major_locator()._integer


def test_the_figures_along_a_target_ladder(ladder, captured, tmp_path):  # noqa: F811
    records, analysis, calibration = ladder
    paths = write_report(tmp_path, analysis, records=records, provenance=PROVENANCE, calibration=calibration)
    assert {"bcrit_vs_target.png", "ratio_vs_target.png"} <= set(captured)
    _check_every_saved_figure(captured, paths.values())
    targets = analysis.settings["targets"]
    for name, expected in (("bcrit_vs_target.png", 3), ("ratio_vs_target.png", 2)):  # methods; pairs
        ax = captured[name].axes[0]
        assert ax.get_yscale() == "log" and TUNED in ax.get_title()
        assert [float(t.get_text()) for t in ax.get_xticklabels()] == targets
        series = [line for line in ax.get_lines() if len(line.get_xdata()) == len(targets)]
        assert len(series) == expected, name
        # Told apart by marker and by line style, not only by colour.
        assert len({line.get_marker() for line in series}) == len({line.get_linestyle() for line in series}) == \
            expected, name
        for line in series:  # near their targets (dodged apart by less than a fifth of the gap)
            assert np.allclose(line.get_xdata(), targets, atol=0.2 * 0.05), name
        # Each point with its interval: one error bar per target and series.
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == expected * len(targets), name
        primary = [line for line in ax.get_lines() if list(line.get_xdata()) == [0.9, 0.9]]
        assert primary and "primary target 0.9" in primary[0].get_label(), name
    ax = captured["ratio_vs_target.png"].axes[0]
    (band,) = [p for p in ax.patches if p.get_label().startswith("equivalence band")]
    low, high = band.get_path().transformed(band.get_patch_transform()).get_extents().intervaly
    assert (low, high) == pytest.approx((RATIO_MARGIN, 1 / RATIO_MARGIN), rel=1e-12)
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    by_pair = {line.get_label(): line for line in ax.get_lines() if len(line.get_xdata()) == len(targets)}
    for c, b in (("affine_like", "affine"), ("affine_like", "batchnorm")):  # each ratio at its target
        expected = [analysis.by_target[repr(t)]["tuned"]["ratios"][c][b]["ratio"] for t in targets]
        np.testing.assert_allclose(by_pair[f"{c} / {b}"].get_ydata(), expected, rtol=1e-12)


@pytest.fixture(scope="module")
def probe_measured():
    """A small probe of every scatter pair (four panels) on correlated synthetic data."""
    data = load_dataset("synthetic", seed=0, n_train=300, n_test=50, features=12, classes=3, correlation=0.8)
    models = sorted({m for a, b, _, _ in probe.SCATTER_PAIRS for m in (a, b)})
    options = probe.ProbeOptions(batch_sizes=(4, 16), seeds=2, batches=1)
    rows, samples = probe.measure(data, models, options)
    return probe.Summary.of(rows, samples), options


def test_the_probe_figures(probe_measured, captured, tmp_path):
    summary, options = probe_measured
    by_kind = summary.by_kind
    paths = [probe.figure_share_vs_batch(by_kind, tmp_path / "share_vs_batch.png", data="synthetic", options=options),
             probe.figure_diagonal_vs_norm(summary.samples, tmp_path / "diagonal_vs_norm.png", data="synthetic",
                                           options=options)]
    _check_every_saved_figure(captured, paths)

    share = captured["share_vs_batch.png"]
    kinds = sorted({g.kind for g in by_kind})
    for ax in share.axes:
        assert "batch size" in ax.get_xlabel() and "samples per step" in ax.get_xlabel()  # the unit
        assert sorted(ax.get_legend_handles_labels()[1]) == kinds  # one line per layer kind
    assert [ax.get_yscale() for ax in share.axes] == ["log", "linear"]
    assert "ratio" in share.axes[0].get_ylabel() and "−1 to 1" in share.axes[1].get_ylabel()
    assert "synthetic, layer scope" in _title(share) and "2 seeds" in _title(share)

    scatter = captured["diagonal_vs_norm.png"]
    assert len(scatter.axes) == 4  # the four pairs, two a row
    assert len({round(ax.get_position().x0, 3) for ax in scatter.axes}) == 2
    for ax, (a, b, _, what) in zip(scatter.axes, probe.SCATTER_PAIRS):
        assert ax.get_title() == f"{what}, B = 16"
        assert [t.split(":")[0] for t in ax.get_legend_handles_labels()[1]] == [a, b]
        assert "‖x_i‖" in ax.get_xlabel() and "factor" in ax.get_ylabel()
        plain, corrected = ax.get_lines()
        assert plain.get_markerfacecolor() == "none" and corrected.get_markerfacecolor() != "none"


def test_the_checker_fails_a_broken_figure(study):  # noqa: F811
    analysis = study[2]
    good = figures._build_metric_vs_batch(analysis)
    _check_readable(good, "metric_vs_batch")

    def broken(change):
        figure = figures._build_metric_vs_batch(analysis)
        change(figure)
        with pytest.raises(AssertionError):
            _check_readable(figure, "broken")

    broken(lambda f: f.axes[0].set_xlabel("batch_size"))  # a column name, not words
    broken(lambda f: f.axes[1].set_ylabel(""))  # no label
    broken(lambda f: f.axes[0].xaxis.label.set_fontsize(5))  # too small to read
    broken(lambda f: [ax.set_title("") for ax in f.axes])  # no title anywhere
    broken(lambda f: f.set_size_inches(20, 4))  # wider than the cap

    def colour_only(figure):
        for line in figure.axes[0].get_lines():
            line.set_marker("o")
            line.set_linestyle("-")

    broken(colour_only)


def test_training_curves_wrap_and_use_steps_when_the_curves_carry_them():
    methods = [f"m{i}" for i in range(7)]
    curves = [{"method": m, "batch_size": b, "seed": s, "epoch": 1 + step // 100, "step": step,
               "train_loss": 1.0 / (1 + step), "val_metric": 0.5}
              for m in methods for b in (16, 64) for s in (0, 1) for step in (50, 100, 150, 200)]
    figure = figures._build_training_curves(curves, group_by=None)
    _check_readable(figure, "training_curves")
    assert len(figure.axes) == 14
    ax = figure.axes[0]
    assert ax.get_xlabel() == "optimizer step"
    assert list(ax.get_lines()[0].get_xdata()) == [50, 100, 150, 200]  # not collapsed onto the epochs
    assert ax.xaxis.get_major_locator()._integer


def test_the_contrast_forest_puts_each_verdict_on_the_test_that_decided_it(study):  # noqa: F811
    analysis = study[2]
    rows = figures._contrast_rows(analysis)
    for group, content in analysis.groups.items():
        for method, r in content["methods"].items():
            mine = [label for label, _, _ in rows if label.startswith((f"Δ {method} [{group}]", f"DiD {method} −"))
                    and f"[{group}]" in label]
            with_verdict = [label for label in mine if "⇒" in label]
            if r["role"] == "corrected":
                assert all(label.startswith("DiD") for label in with_verdict) and with_verdict
                assert all(label.endswith(f"⇒ {method} {r['verdict']}") for label in with_verdict)
            elif r["role"] == "baseline":
                assert with_verdict == [f"Δ {method} [{group}] ⇒ {r['verdict']}"]


def test_the_layout_checker_fails_overlapping_clipped_and_colour_only(study):  # noqa: F811
    analysis = study[2]
    _check_layout(figures._build_contrast_forest(analysis), "contrast_forest")

    def broken(change, match):
        figure = figures._build_contrast_forest(analysis)
        change(figure)
        with pytest.raises(AssertionError, match=match):
            _check_layout(figure, "broken")

    def overlapping(figure):  # a second text where the x label stands
        ax = figure.axes[0]
        ax.annotate("a note on the axis", xy=(0.5, 0), xycoords=ax.xaxis.label, ha="center", va="bottom")

    broken(overlapping, "overlaps")
    broken(lambda f: f._suptitle.set_x(0.9), "clipped")  # the title moved to reach past the right edge

    def colour_only(figure):
        ax = figure.axes[0]
        ax.plot([0, 0.01], [1, 2], marker="s", ls="--", color="C1")
        ax.plot([0, 0.01], [2, 3], marker="s", ls="--", color="C2")

    broken(colour_only, "colour alone")


def test_training_curves_over_thousands_of_steps_keep_their_tick_labels_apart():
    curves = [{"method": m, "batch_size": b, "seed": s, "epoch": 1 + step // 1000, "step": step,
               "train_loss": 1.0 / (1 + step), "val_metric": 0.5 + step / 30000}
              for m in ("affine", "affine_like", "batchnorm", "norm_l2") for b in (16, 1024) for s in (0, 1)
              for step in range(0, 12001, 600)]
    figure = figures._build_training_curves(curves)
    _check_layout(figure, "training_curves")  # 1500 and 3000 collided in a 3.4-inch panel
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert "10k" in labels or "12k" in labels, labels

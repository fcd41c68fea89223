"""Every figure of a small report, read from its matplotlib objects: size, words on the axes, titles,
distinguishable series, shared y range, the calibration legend and the deciding tests of the forest."""

import re

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.lines import Line2D

from affdiv.experiments.analysis.critical_batch import analyse_target, simulate_target_records
from affdiv.experiments.report import figures
from tests.experiments.test_report import study  # noqa: F401  (the small report's fixture)

RAW_COLUMNS = ("test_accuracy", "batch_size", "val_metric", "train_loss", "lr_rule")


def _check_readable(figure, name):
    width, height = figure.get_size_inches() * figures._DPI
    assert width <= figures.MAX_WIDTH_PX, (name, width)
    assert figure.axes, name
    for ax in figure.axes:
        for label in (ax.get_xlabel(), ax.get_ylabel()):
            assert len(re.findall(r"[A-Za-z]{3,}", label)) >= 1, (name, label)  # words
            assert not any(col in label for col in RAW_COLUMNS), (name, label)
        legend = ax.get_legend()
        if legend is not None:
            assert all(t.get_fontsize() >= 7 for t in legend.get_texts()), name
        # Series of different labels differ in marker or line style, not colour alone.
        keys = []
        for handle in ax.get_legend_handles_labels()[0]:
            line = handle[0] if isinstance(handle, ErrorbarContainer) else handle
            if isinstance(line, Line2D):
                keys.append((line.get_marker(), str(line.get_linestyle())))
        assert len(keys) == len(set(keys)), (name, keys)


def _title(figure):
    return " ".join([figure._suptitle.get_text() if figure._suptitle else ""] + [ax.get_title() for ax in figure.axes])


def test_every_fixed_budget_figure_is_readable(study):  # noqa: F811
    _records, curves, analysis, calibration = study
    built = {"metric_vs_batch": figures._build_metric_vs_batch(analysis),
             "contrast_forest": figures._build_contrast_forest(analysis),
             "slope_forest": figures._build_slope_forest(analysis),
             "training_curves": figures._build_training_curves(curves, group_by="lr_rule", group="tuned"),
             "calibration": figures._build_calibration_curves(calibration)}
    for name, figure in built.items():
        _check_readable(figure, name)

    panels = built["metric_vs_batch"].axes
    assert len(panels) == 2 and len({ax.get_ylim() for ax in panels}) == 1  # shared y range
    assert {ax.get_title() for ax in panels} == {"learning rate ∝ √B", "learning rate tuned per method and batch size"}
    assert "learning rate tuned per method and batch size" in _title(built["training_curves"])

    labels = [t.get_text() for t in built["calibration"].axes[0].get_legend().get_texts()]
    assert any("joint verdict 'supported'" in t for t in labels) and any("affine_like" in t for t in labels)
    assert any("α" in t for t in labels) and any("Monte-Carlo" in t for t in labels)
    assert any("± equivalence margin" in t for t in labels)


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


def test_steps_to_target_figures_are_readable():
    rng = np.random.default_rng(2)
    records = simulate_target_records({"affine_like": (300, 100), "affine": (200, 400), "batchnorm": (150, 400)},
                                      batch_sizes=(16, 64, 256, 1024), seeds=range(5), sigma=0.1, max_steps=5000,
                                      rng=rng)
    analysis = analyse_target(records, n_boot=0)
    for name in ("steps_vs_batch", "examples_vs_steps"):
        _check_readable(getattr(figures, f"_build_{name}")(analysis), name)


@pytest.mark.parametrize("name", ["metric_vs_batch", "slope_forest", "contrast_forest"])
def test_saved_png_is_at_most_the_cap(study, tmp_path, name):  # noqa: F811
    data = getattr(figures, name)(study[2], tmp_path / f"{name}.png").read_bytes()
    assert int.from_bytes(data[16:20], "big") <= figures.MAX_WIDTH_PX

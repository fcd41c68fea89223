"""The falsification harness: does performance fall with batch size for the corrected layers?

Sub-packages by pipeline stage; an import only ever points down this list:

    checks      the one-line checks of a setting's value (torch-free, used by every stage)
    data/       datasets (digits, fashion-mnist, cifar10, synthetic): one module per source, and
                the API that splits, standardises and fingerprints them (load_dataset)
    records     the one place that reads and writes record CSVs (and tells one from a results store)
    runs/       one run and many: config (RunConfig, its hash, grids), models, training, the
                SQLite store, the parallel sweep, presets and their TOML files
    analysis/   trend statistics, the decision rule, the groups analysed together, calibration
    report/     the written report (Markdown, HTML, JSON, LaTeX) and its figures
    probe       the update alignment behind the prediction, measured on real data
    pipeline    the whole study: sweep, analysis, calibration, report (what the CLI calls)
    cli         ``affdiv falsify``, ``affdiv analyse``, ``affdiv probe``

The public API below is imported on first use, so that importing the package costs nothing.
"""

from __future__ import annotations

import importlib

from affdiv._extras import require

# The harness's libraries come with the experiments extra; checked here (without importing them)
# so that a missing one is named with the extra, whichever submodule needs it first.
require("scipy", "matplotlib", "sklearn", "statsmodels", "sympy", "tqdm", extra="experiments",
        feature="affdiv.experiments")

_PUBLIC = {
    "load_dataset": "affdiv.experiments.data",
    "RunConfig": "affdiv.experiments.runs.config",
    "run_sweep": "affdiv.experiments.runs.sweep",
    "analyse": "affdiv.experiments.analysis.decision",
    "analyse_target": "affdiv.experiments.analysis.critical_batch",
    "analyse_study": "affdiv.experiments.analysis.design",
    "AnalysisSettings": "affdiv.experiments.analysis.settings",
    "write_report": "affdiv.experiments.report.writer",
    "falsify": "affdiv.experiments.pipeline",
    "analyse_file": "affdiv.experiments.pipeline",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Compiling a generated LaTeX table with pdflatex and measuring it against the page.

Used by the tests of every LaTeX writer (verify.tex, summary.tex) through the ``latex_page``
fixture of ``tests/conftest.py`` (which skips the test when pdflatex is not installed)::

    def test_summary_tex_fits(latex_page, tmp_path):
        measure = latex_page(tex_text, tmp_path)
        assert measure.fits, measure.describe()

The table is set in a plain ``article`` (one column, 10 pt, default margins: a 345 pt text
width) under ``\\small``, as a paper would ``\\input`` it. Its natural width is measured by
boxing it (``\\setbox0=\\hbox{...}``, ``\\wd0`` written to the log), and the same table is then
typeset on the page, so that the log's Overfull/Underfull reports and every LaTeX error count too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PDFLATEX = shutil.which("pdflatex")

PREAMBLE = r"""\documentclass{article}
\usepackage{booktabs}
\usepackage{tabularx}
"""

_DOCUMENT = PREAMBLE + r"""\begin{document}
%(font)s
\setbox0=\hbox{\input{%(name)s}}
\typeout{AFFDIV-TABLE-WIDTH=\the\wd0}
\typeout{AFFDIV-LINEWIDTH=\the\linewidth}
\noindent\input{%(name)s}
\end{document}
"""


@dataclass
class TableMeasure:
    """What pdflatex said about one table."""

    width_pt: float  # the table's natural width
    linewidth_pt: float  # the page's text width in the test document
    overfull: list[str]  # the log's "Overfull \hbox" lines
    log: str

    @property
    def excess_pt(self) -> float:
        return self.width_pt - self.linewidth_pt

    @property
    def fits(self) -> bool:
        return self.excess_pt <= 0.01 and not self.overfull

    def describe(self) -> str:
        return (f"table {self.width_pt:.1f} pt against a {self.linewidth_pt:.1f} pt line "
                f"({self.excess_pt:+.1f} pt); overfull boxes: {self.overfull or 'none'}")


def measure_table(tex: str, workdir: Path, *, font: str = r"\small", name: str = "table.tex") -> TableMeasure:
    """Compile ``tex`` (a tabular/tabularx, as written to disk) in a one-column article under
    ``font`` and measure it. Raises AssertionError with the end of the log if pdflatex fails."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / name).write_text(tex, encoding="utf-8")
    (workdir / "doc.tex").write_text(_DOCUMENT % {"font": font, "name": name}, encoding="utf-8")
    done = subprocess.run(
        [PDFLATEX or "pdflatex", "-interaction=nonstopmode", "-halt-on-error", "doc.tex"],
        cwd=workdir, capture_output=True, text=True, timeout=120,
    )
    log_path = workdir / "doc.log"
    log = log_path.read_text(encoding="latin-1") if log_path.exists() else done.stdout
    if done.returncode != 0:
        raise AssertionError(f"pdflatex failed ({done.returncode}):\n{log[-3000:]}")
    width = re.search(r"AFFDIV-TABLE-WIDTH=([\d.]+)pt", log)
    line = re.search(r"AFFDIV-LINEWIDTH=([\d.]+)pt", log)
    assert width and line, f"no width in the log:\n{log[-3000:]}"
    overfull = [m for m in log.splitlines() if m.startswith("Overfull \\hbox")]
    return TableMeasure(float(width.group(1)), float(line.group(1)), overfull, log)

"""report.html as a browser lays it out: headless Chromium renders a real report at 800 and 1280 px
and a script in the page finds every token (a run of non-space characters) of a table cell that
the layout split over two lines ("1.63" / "e+04", "contradict" / "ed"). Skips, saying why, when no
Chromium is installed (Debian: ``apt-get install chromium``)."""

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from affdiv.experiments.analysis.critical_batch import analyse_target, simulate_target_records
from affdiv.experiments.analysis.settings import AnalysisSettings
from affdiv.experiments.report.writer import write_report
from affdiv.vocabulary import TARGET_METRIC
from tests.experiments.test_report import PROVENANCE

#: The steps-to-target analysis (its settings otherwise at their defaults).
TARGET = AnalysisSettings(metric=TARGET_METRIC)

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTHS = (800, 1280)

# Run on load: for each text node in a table cell, a Range per token; a token whose client rects
# lie on more than one line (distinct tops) was broken inside. The result goes into the DOM, which
# --dump-dom prints. A planted cell (narrow, allowed to break anywhere) must be found broken: the
# probe is shown to see a break where there is one.
PROBE = """
<table id="planted"><tr><td style="width:3em;max-width:3em;overflow-wrap:anywhere">contradicted</td></tr></table>
<script>
(function () {
  function broken(cell) {
    var out = [], walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT), node;
    while ((node = walker.nextNode())) {
      var re = /\\S+/g, m;
      while ((m = re.exec(node.data))) {
        var range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        var tops = new Set();
        for (var r of range.getClientRects()) { if (r.width > 0) tops.add(Math.round(r.top)); }
        if (tops.size > 1) out.push(m[0]);
      }
    }
    return out;
  }
  var report = [], planted = broken(document.querySelector("#planted td"));
  document.getElementById("planted").remove();
  document.querySelectorAll("td, th").forEach(function (cell) {
    broken(cell).forEach(function (token) { report.push(token); });
  });
  var cells = document.querySelectorAll("td").length;
  var pre = document.createElement("pre");
  pre.id = "wrap-result";
  pre.textContent = JSON.stringify({planted: planted, broken: report, cells: cells,
                                    width: document.documentElement.clientWidth});
  document.body.appendChild(pre);
})();
</script>
"""


def _browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip(f"no Chromium binary on PATH (looked for {', '.join(BROWSERS)}); "
                "install one (Debian: apt-get install chromium) to lay report.html out in a browser")


@pytest.fixture(scope="module")
def report_html(tmp_path_factory):
    """A steps-to-target report with the numbers that used to break: B_crit and S_min in the
    thousands (1.63e+04 style), a contradicted corrected layer."""
    rng = np.random.default_rng(5)
    records = simulate_target_records({"affine_like": (3000, 16000), "norm_l2": (2000, 100),
                                       "affine": (2000, 16000), "batchnorm": (1500, 14000)},
                                      batch_sizes=(16, 64, 256, 1024, 4096), seeds=range(4), sigma=0.1,
                                      max_steps=200000, rng=rng)
    out = tmp_path_factory.mktemp("browser")
    analysis = analyse_target(records, TARGET.replace(n_boot=0, corrected=("affine_like", "norm_l2")))
    return write_report(out, analysis, records=records, provenance=PROVENANCE)["report_html"]


def _laid_out(browser: str, page, width: int) -> dict:
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={width},1000", "--dump-dom", page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="wrap-result">(.*?)</pre>', done.stdout, re.S)
    assert found, f"no result from the page (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


@pytest.mark.parametrize("width", WIDTHS)
def test_no_table_cell_breaks_inside_a_number_or_a_word(report_html, width, tmp_path):
    browser = _browser()
    text = report_html.read_text()
    assert "e+04" in text and "contradicted" in text  # the tokens that used to break are there
    page = tmp_path / "report.html"
    page.write_text(text.replace("</body>", PROBE + "</body>"))
    result = _laid_out(browser, page, width)
    assert result["planted"] == ["contradicted"], result  # the probe sees a break where there is one
    assert result["width"] <= width and result["cells"] > 100
    assert result["broken"] == [], f"tokens broken inside at {width} px: {sorted(set(result['broken']))}"

"""What every written report does, in one place: JSON without NaN/inf, the provenance block, LaTeX
escaping and tables that fit the page, HTML tables that stay readable on a narrow screen.

Used by ``affdiv verify`` (verify.json/md/tex), the falsification report (summary.json/tex,
report.md/html), ``affdiv probe`` and ``affdiv bench layers --json``.

JSON
    :func:`write_json` refuses a NaN or ±inf anywhere in the object, naming its key path
    (``checks[3].errors.ntk``), and writes atomically (:func:`affdiv.atomic.atomic_write`). A writer
    that can meet a non-finite number decides what it means and says so: :func:`nonfinite_to_null`
    replaces each by ``null`` and returns ``{key path: "inf" | "-inf" | "nan"}`` to store beside it.

Provenance
    :func:`provenance_line` (one line: version, commit, dirty flag, time) and its renderings:
    :func:`provenance_markdown`, :func:`provenance_html` (a collapsed ``<details>``) and
    :func:`provenance_latex` (``%`` comment lines heading a ``.tex`` file).

LaTeX
    :func:`latex_escape` (special characters, Unicode that pdflatex does not know, a leading
    ``-`` of a number as a real minus sign ``$-$``), :func:`latex_number` and :func:`latex_sci`
    (numbers in math mode), :func:`latex_identifier` (names that may break after ``_``), and
    :func:`latex_table`: a booktabs ``tabularx`` as wide as the line, whose ``X`` columns wrap,
    so that it fits a one-column article page. Cells are escaped unless given as :class:`Latex`.

HTML
    :data:`HTML_STYLE` and :func:`html_table`: the table scrolls inside its own box, numbers and
    words never break inside a cell (only prose cells wrap, at spaces), so a page stays readable
    at 800 px; ``first=`` puts the named columns (verdicts) first.
"""

from __future__ import annotations

import html as _html
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from affdiv.atomic import atomic_write
from affdiv.checks import NonFiniteError

# ------------------------------------------------------------------------------------------ JSON


def key_path(parts: Sequence[str | int]) -> str:
    """``["checks", 3, "errors", "ntk"]`` as ``checks[3].errors.ntk`` (``$`` for the root)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part, ensure_ascii=False)}]"
    return out or "$"


def _walk(obj, parts: list) -> Iterable[tuple[list, float]]:
    if isinstance(obj, float):
        if not math.isfinite(obj):
            yield list(parts), obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _walk(value, [*parts, str(key)])
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _walk(value, [*parts, index])


def nonfinite_paths(obj) -> list[tuple[str, float]]:
    """Every non-finite float in ``obj`` (nested dicts, lists, tuples) as (key path, value)."""
    return [(key_path(parts), value) for parts, value in _walk(obj, [])]


def _token(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def nonfinite_to_null(obj):
    """(a copy of ``obj`` with each non-finite float replaced by None, {key path: "inf"|"-inf"|"nan"})."""
    found: dict[str, str] = {}

    def clean(value, parts):
        if isinstance(value, float) and not math.isfinite(value):
            found[key_path(parts)] = _token(value)
            return None
        if isinstance(value, Mapping):
            return {k: clean(v, [*parts, str(k)]) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, [*parts, i]) for i, v in enumerate(value)]
        return value

    return clean(obj, []), found


def to_json(obj, *, indent: int | None = 2, default: Callable | None = None, what: str = "JSON") -> str:
    """``json.dumps(obj, allow_nan=False)`` plus a newline; a NaN/inf raises :class:`NonFiniteError`
    naming the first offending key path (``what`` names the file in the message)."""
    bad = nonfinite_paths(obj)
    if bad:
        path, value = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise NonFiniteError(
            f"{what}: non-finite number {_token(value)} at {path}{more}; JSON has no NaN/inf: "
            "write null and say why"
        )
    try:
        return json.dumps(obj, indent=indent, allow_nan=False, default=default, ensure_ascii=False) + "\n"
    except ValueError as error:  # a non-finite value produced by ``default``
        raise NonFiniteError(f"{what}: {error}") from None


def write_json(path: str | Path, obj, *, indent: int | None = 2, default: Callable | None = None) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically; NaN/inf anywhere raises :class:`NonFiniteError`
    (a ``ValueError``) naming the key path, and nothing is written."""
    return atomic_write(path, to_json(obj, indent=indent, default=default, what=str(path)))


# ------------------------------------------------------------------------------------ provenance


def provenance_line(provenance: Mapping) -> str:
    """``affdiv 0.1.0, commit 2fe6550… (uncommitted changes), 2026-12-01T15:37:02+00:00``."""
    parts = [f"affdiv {provenance.get('version', '?')}"]
    commit = provenance.get("git_commit")
    if commit:
        dirty = provenance.get("git_dirty")
        source = " (build)" if provenance.get("git_source") == "build" else ""
        parts.append(f"commit {commit}{source}" + (" with uncommitted changes" if dirty else ""))
    else:
        parts.append("no git commit (not run from a git checkout)")
    if provenance.get("time_utc"):
        parts.append(str(provenance["time_utc"]))
    return ", ".join(parts)


def _provenance_json(provenance: Mapping) -> str:
    return json.dumps(dict(provenance), indent=2, sort_keys=True, default=str, ensure_ascii=False)


def provenance_markdown(provenance: Mapping, *, heading: str = "Provenance", level: int = 2) -> str:
    """A Markdown section: heading, the one-line summary, then the full record as a JSON block."""
    return (f"{'#' * level} {heading}\n\n{provenance_line(provenance)}\n\n"
            f"```json\n{_provenance_json(provenance)}\n```\n")


def provenance_html(provenance: Mapping, *, heading: str = "Provenance") -> str:
    """A collapsed ``<details>`` whose summary is the one-line provenance, the record inside."""
    return (f'<details class="provenance"><summary>{_html.escape(heading)}: '
            f"{_html.escape(provenance_line(provenance))}</summary>"
            f"<pre>{_html.escape(_provenance_json(provenance))}</pre></details>")


def _comment(text: str) -> str:
    return "% " + " ".join(str(text).split())  # one line, whatever the text held


def provenance_latex(provenance: Mapping, *, what: str, needs: str = r"\usepackage{booktabs,tabularx}") -> str:
    """The ``%`` comment lines that head a generated ``.tex`` file: what it is, what it needs,
    the one-line provenance and the command that wrote it."""
    lines = [_comment(what), _comment(f"needs {needs}"), _comment(provenance_line(provenance))]
    if provenance.get("command"):
        lines.append(_comment(f"command: {provenance['command']}"))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- LaTeX


class Latex(str):
    """A string that is already LaTeX: table cells and headers of this type are not escaped."""


_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}",
    # Unicode pdflatex's default input encoding does not set up
    "−": "$-$", "—": "---", "–": "--", "±": r"$\pm$", "×": r"$\times$", "·": r"$\cdot$",
    "≤": r"$\le$", "≥": r"$\ge$", "≠": r"$\ne$", "≈": r"$\approx$", "∞": r"$\infty$",
    "η": r"$\eta$", "θ": r"$\theta$", "Θ": r"$\Theta$", "σ": r"$\sigma$", "α": r"$\alpha$",
    "‖": r"$\|$", "²": r"$^2$", "³": r"$^3$", "√": r"$\surd$", "∈": r"$\in$", "→": r"$\to$",
}
# A hyphen that is a number's sign: at the start, or after a space or opening bracket, before a digit.
_SIGN = re.compile(r"(?:^|(?<=[\s(\[{=,/;:]))-(?=\.?\d)")


def latex_escape(text: object) -> str:
    """``str(text)`` to print verbatim in LaTeX text: special characters escaped, Unicode that
    pdflatex lacks mapped to LaTeX, and a number's leading ``-`` set as a real minus sign ``$-$``."""
    text = _SIGN.sub("\u2212", str(text))
    return "".join(_SPECIAL.get(c, c) for c in text)


def latex_identifier(name: object) -> str:
    """An identifier (``residual_affine_like_on_affine_like``) escaped, with a line break allowed
    after each underscore, so that a wrapping column can set it."""
    return latex_escape(name).replace(r"\_", r"\_\allowbreak{}")


def _mantissa_exponent(text: str) -> str:
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    exponent = str(int(exponent))
    return rf"10^{{{exponent}}}" if mantissa in ("1", "1.0") else rf"{mantissa}\times10^{{{exponent}}}"


def latex_number(value, fmt: str = ".3g", *, missing: str = "---") -> str:
    """A number in math mode with a real minus sign and ×10^k for exponents: ``$-1.2\\times10^{-5}$``;
    None gives ``missing``, ±inf ``$\\infty$``/``$-\\infty$``, NaN ``NaN``."""
    if value is None:
        return missing
    if isinstance(value, bool):
        return str(value).lower()
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return r"$\infty$" if value > 0 else r"$-\infty$"
    text = format(value, fmt)
    sign = "-" if text.startswith("-") else ""
    return f"${sign}{_mantissa_exponent(text.lstrip('-'))}$"


def latex_sci(value, digits: int = 1, *, missing: str = "---") -> str:
    """Scientific notation in math mode: 1.23e-16 as ``$1.2\\times10^{-16}$``, 0 as ``$0$``."""
    if value is not None and not isinstance(value, bool) and float(value) == 0:
        return "$0$"
    return latex_number(value, f".{digits}e", missing=missing)


@dataclass(frozen=True)
class Column:
    """One column of :func:`latex_table`.

    header: the heading (escaped unless :class:`Latex`; ``\\n`` stacks it on lines).
    align:  ``l``, ``r`` or ``c`` (as wide as its widest cell), or ``X`` (wraps, ragged right; all
            ``X`` columns share the width the others leave).
    """

    header: str
    align: str = "l"

    def spec(self) -> str:
        if self.align == "X":
            return r">{\raggedright\arraybackslash}X"
        if self.align in ("l", "r", "c"):
            return self.align
        raise ValueError(f"Column.align must be one of l, r, c, X, got {self.align!r}")


MIDRULE = object()  # a row of latex_table that is a \midrule between groups of rows


@dataclass(frozen=True)
class Subheading:
    """A row of :func:`latex_table` across every column: the title of the rows below it (a group),
    set in italics; escaped unless :class:`Latex`."""

    text: str


def latex_cell(value) -> str:
    """A table cell: :class:`Latex` as is, numbers through :func:`latex_number`, None as ``---``,
    anything else escaped."""
    if isinstance(value, Latex):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"${value}$" if value < 0 else str(value)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return latex_number(value)
    return latex_escape(value)


def _header(column: Column) -> str:
    text = column.header if isinstance(column.header, Latex) else latex_escape(column.header)
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    where = "l" if column.align == "X" else column.align
    stacked = r" \\ ".join(lines)
    return rf"\begin{{tabular}}[b]{{@{{}}{where}@{{}}}}{stacked}\end{{tabular}}"


def latex_table(columns: Sequence[Column], rows: Iterable, *, notes: str | Latex | None = None,
                head: str = "", tabcolsep: str = "4pt") -> str:
    """A booktabs table that fits the line: ``tabularx`` of width ``\\linewidth`` when a column is
    ``X`` (plain ``tabular`` otherwise), no padding outside the first and last column, ``tabcolsep``
    between columns. ``rows``: sequences of cells (see :func:`latex_cell`), :data:`MIDRULE` or a
:class:`Subheading`.
    ``notes`` (escaped unless :class:`Latex`) is set under the table across its full width, in
    ``\\footnotesize``. ``head`` (e.g. :func:`provenance_latex`) goes first. Needs
    ``\\usepackage{booktabs,tabularx}``; set the surrounding font (``\\small``) in the document."""
    columns = list(columns)
    wide = any(c.align == "X" for c in columns)
    spec = "@{}" + "".join(c.spec() for c in columns) + "@{}"
    begin = rf"\begin{{tabularx}}{{\linewidth}}{{{spec}}}" if wide else rf"\begin{{tabular}}{{{spec}}}"
    lines = [head.rstrip("\n")] if head else []
    lines += [rf"{{\setlength{{\tabcolsep}}{{{tabcolsep}}}%", begin, r"\toprule",
              " & ".join(_header(c) for c in columns) + r" \\", r"\midrule"]
    for row in rows:
        if row is MIDRULE:
            lines.append(r"\midrule")
            continue
        if isinstance(row, Subheading):
            text = row.text if isinstance(row.text, Latex) else latex_escape(row.text)
            lines.append(rf"\multicolumn{{{len(columns)}}}{{@{{}}l@{{}}}}{{\emph{{{text}}}}} \\")
            continue
        cells = list(row)
        if len(cells) != len(columns):
            raise ValueError(f"latex_table: a row has {len(cells)} cells, expected {len(columns)}: {cells!r}")
        lines.append(" & ".join(latex_cell(c) for c in cells) + r" \\")
    lines.append(r"\bottomrule")
    if notes:
        text = notes if isinstance(notes, Latex) else latex_escape(notes)
        lines.append(rf"\multicolumn{{{len(columns)}}}{{@{{}}p{{\linewidth}}@{{}}}}"
                     rf"{{\footnotesize\raggedright {text}}} \\")
    lines += [(r"\end{tabularx}" if wide else r"\end{tabular}") + "}%"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ HTML

HTML_STYLE = (
    ".table-scroll{overflow-x:auto;max-width:100%;margin:1em 0}"
    ".table-scroll table{border-collapse:collapse;font-size:0.85em}"
    ".table-scroll th,.table-scroll td{border:1px solid #bbb;padding:2px 6px;text-align:left;"
    "vertical-align:top;white-space:nowrap}"
    ".table-scroll td.prose{white-space:normal;min-width:16em;max-width:28em}"
    ".table-scroll th{background:#eee;position:sticky;top:0}"
    "details.provenance{margin:1em 0}details.provenance pre{background:#f5f5f5;padding:1em;"
    "overflow-x:auto;font-size:0.8em;white-space:pre-wrap;overflow-wrap:anywhere}"
)
#: A cell longer than this (in characters) with a space in it is prose: it wraps, at spaces only.
PROSE_CHARS = 40


class Markup(str):
    """A string that is already HTML: :func:`html_table` cells of this type are not escaped."""


def reorder(header: Sequence[str], rows: Iterable[Sequence], first: Sequence[str] = ()) -> tuple[list, list]:
    """``header`` and ``rows`` with the columns named in ``first`` moved to the front, in that order
    (names not in ``header`` are an error)."""
    header = list(header)
    missing = [name for name in first if name not in header]
    if missing:
        raise ValueError(f"reorder: no column(s) {missing} in {header}")
    order = [header.index(name) for name in first] + [i for i, h in enumerate(header) if h not in first]
    return [header[i] for i in order], [[row[i] for i in order] for row in rows]


def html_table(header: Sequence[str], rows: Iterable[Sequence], *, first: Sequence[str] = (),
               cell: Callable[[object], str] | None = None) -> str:
    """A ``<table>`` inside ``<div class="table-scroll">`` (style: :data:`HTML_STYLE`): it scrolls
    sideways within its box, so the page reads at 800 px. No cell breaks inside a word or a number
    (``1.63e+04``, ``contradicted``): a cell of prose (over :data:`PROSE_CHARS` characters, with
    spaces; class ``prose``) wraps at its spaces, every other cell stays on one line. ``first``
    moves the named columns to the front; ``cell`` renders a cell (default: escaped text,
    :class:`Markup` as is)."""
    header, rows = reorder(header, rows, first)

    def render(value) -> str:
        if isinstance(value, Markup):
            return str(value)
        if cell is not None:
            return cell(value)
        return _html.escape("—" if value is None else str(value))

    head = "".join(f'<th scope="col">{render(h)}</th>' for h in header)
    def td(value) -> str:
        text = "" if value is None else str(value)
        prose = len(text) > PROSE_CHARS and " " in text.strip()
        return f'<td class="prose">{render(value)}</td>' if prose else f"<td>{render(value)}</td>"

    body = "".join("<tr>" + "".join(td(c) for c in row) + "</tr>" for row in rows)
    return f'<div class="table-scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def json_ready(value):
    """A copy of ``value`` that ``json`` writes as is: mappings with ``str`` keys, tuples as lists,
    numpy/torch scalars as Python numbers, and non-finite floats as ``None``."""
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a numpy or torch scalar
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value

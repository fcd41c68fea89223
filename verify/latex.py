"""Escaping text for LaTeX: the one escaper of every LaTeX table the package writes."""

from __future__ import annotations

_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "—": "--", "−": "-",  # em dash and minus sign: not in pdflatex's default input encoding
}


def escape(text: object) -> str:
    """``str(text)`` with LaTeX's special characters escaped, to print verbatim in a table cell."""
    return "".join(_SPECIAL.get(c, c) for c in str(text))

"""The written report (writer: Markdown, HTML, summary.json, LaTeX) and its figures."""

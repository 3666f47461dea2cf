"""Sections later stages add to the validation report (e.g. the drafter's acceptance from `evaluate`).

A section is stored as `reports/sections/<name>.md` (markdown) and `<name>.html` (an HTML fragment) and is
spliced into `report.md` / `report.html` between `<!-- section:<name> -->` markers, replacing an earlier version
of itself; `write_validation_report` re-applies all stored sections, so re-validating never drops them.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from tasks.common.schemas import REPORTS_DIR
from tasks.common.shards import atomic_write_text

SECTIONS_DIR = "sections"


def _splice(text: str, name: str, body: str, closing: str) -> str:
    start, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text)
    if closing and closing in text:
        return text.replace(closing, block + closing, 1)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def reapply_sections(run_dir: Path) -> None:
    out = Path(run_dir) / REPORTS_DIR
    folder = out / SECTIONS_DIR
    if not folder.is_dir():
        return
    for md in sorted(folder.glob("*.md")):
        name = md.stem
        fragment = md.with_suffix(".html")
        report_md = out / "report.md"
        if report_md.is_file():
            atomic_write_text(report_md, _splice(report_md.read_text(), name, md.read_text(), ""))
        report_html = out / "report.html"
        if report_html.is_file() and fragment.is_file():
            atomic_write_text(report_html, _splice(report_html.read_text(), name, fragment.read_text(), "</body>"))


def add_report_section(run_dir: Path, name: str, markdown: str, html_fragment: str | None = None) -> Path:
    """Store a section and splice it into the existing report; returns the markdown report's path."""
    if not re.fullmatch(r"[a-z0-9_-]+", name):
        raise ValueError(f"report section name {name!r} must be lowercase letters, digits, '-' or '_'")
    folder = Path(run_dir) / REPORTS_DIR / SECTIONS_DIR
    atomic_write_text(folder / f"{name}.md", markdown)
    fragment = html_fragment if html_fragment is not None else f"<pre>{html.escape(markdown)}</pre>"
    atomic_write_text(folder / f"{name}.html", fragment)
    reapply_sections(run_dir)
    return Path(run_dir) / REPORTS_DIR / "report.md"

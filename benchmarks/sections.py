"""BENCHMARKS.md is assembled from sections that benchmark scripts own, each between an
HTML-comment begin/end marker pair; a script rewrites only its own section."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def write_section(begin: str, end: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text from `begin` to `end` (markers included) with begin + body + end,
    or append that section when the markers are absent. Other sections are kept."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    section = f"{begin}\n{body.strip(chr(10))}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)

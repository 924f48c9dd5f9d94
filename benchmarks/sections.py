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


def cpu_kind() -> tuple[str, str]:
    """(tag, title suffix) naming the kind of CPU this machine's kernels were built for, so each kind
    keeps its own results JSON and BENCHMARKS.md section: a run on one kind never overwrites another's.
    AVX-512 with BF16 (the first machine) is untagged; the others: '-amx', '-avx512' (AVX-512 without
    BF16: fp32 kernels only), '-avx2', and '-nokernels' where the kernels did not build."""
    from draftsmith.kernels.build import cpu_kernels

    isa = cpu_kernels().isa
    if not isa:
        return "-nokernels", ", CPU without Draftsmith's kernels"
    if isa.endswith("+amx"):
        return "-amx", ", AVX-512 + AMX CPU"
    if isa == "avx512-bf16":
        return "", ""
    if isa == "avx512":
        return "-avx512", ", AVX-512 CPU without BF16"
    return f"-{isa}", f", {isa.upper()} CPU"

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
    zen = amd_zen()
    # '-avx2' tagged every AVX2 run until 2026-12-06, from a Zen 3 and then a Zen 1 machine (each section's
    # text names its machine: runtime-avx2 is a Zen 3's, bench_builtin-avx2 a Zen 1's, so '-avx2' stays
    # mixed): from then a Zen 2-5 gets a tag of its own and only a Zen 1 (or another vendor) writes '-avx2'.
    if isa == "avx2" and zen not in ("", "Zen 1"):
        return f"-avx2-{zen.replace(' ', '').lower()}", f", AVX2 CPU ({zen})"
    return f"-{isa}", f", {isa.upper()} CPU"


def amd_zen(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """'Zen 1' .. 'Zen 5' for an AMD CPU, from /proc/cpuinfo's family and model (family 0x17: Zen 1 below
    model 0x30, Zen 2 from it; 0x19: Zen 3 below model 0x10 and in 0x20-0x5f, Zen 4 otherwise; 0x1a: Zen 5);
    '' elsewhere. Two AVX2 machines of different generations keep their own results and sections."""
    try:
        lines = [line.split(":", 1) for line in cpuinfo.read_text().splitlines()[:30] if ":" in line]
        fields = {key.strip(): value for key, value in lines}
        vendor, family = fields["vendor_id"].strip(), int(fields["cpu family"])
        model = int(fields["model"])
    except (OSError, KeyError, ValueError):
        return ""
    if vendor != "AuthenticAMD":
        return ""
    if family == 0x17:
        return "Zen 1" if model < 0x30 else "Zen 2"
    if family == 0x19:
        return "Zen 3" if model < 0x10 or 0x20 <= model < 0x60 else "Zen 4"
    return "Zen 5" if family == 0x1A else ""

"""The run directory's raw files: setup.json (written whole, atomically) and results.jsonl (one
JSON line per finished (tier, configuration), appended and fsynced when its tier ends).

A --resume keeps the tiers whose every configuration has a line and drops the rest (a tier
cut short is measured again as a whole: its configurations are only comparable measured together).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT_VERSION = 1
RESULTS = "results.jsonl"
SETUP = "setup.json"


def read_results(path: Path) -> tuple[list[dict], int]:
    """Complete lines of results.jsonl and the byte length they span (a torn last line is not)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    lines, good = [], 0
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            break
        good += len(raw)
    return lines, good


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonl(lines: list[dict]) -> str:
    return "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines)


def append_lines(path: Path, lines: list[dict]) -> None:
    blob = _jsonl(lines)
    with open(path, "a") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def fingerprint_sha(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def keep_finished(path: Path, expected: dict[str, set[str]]) -> set[str]:
    """Rewrite results.jsonl without torn lines and unfinished phases; return the finished phase keys.

    expected: phase key -> the labels a finished phase has lines for. Lines of phases not in
    `expected` (tiers this invocation does not plan) are kept as they are.
    """
    lines, good = read_results(path)
    by_phase: dict[str, dict[str, dict]] = {}
    for ln in lines:
        by_phase.setdefault(ln["phase"], {})[ln["label"]] = ln
    done = {k for k, v in by_phase.items() if k in expected and set(v) >= expected[k]}
    keep = [ln for ln in lines if ln["phase"] in done or ln["phase"] not in expected]
    if len(keep) != len(lines) or (path.exists() and good != path.stat().st_size):
        atomic_write(path, _jsonl(keep))
    return done

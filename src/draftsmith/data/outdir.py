"""Checks of a job's --out path, made before the job loads anything: the right kind (a
directory for cache / eval / bench / export / import, a file for regen), and, for the jobs
that write a model directory (export, import), no silent replacement of what is there.

(These belong beside fileio.py; they live here because every job that writes an --out
reaches draftsmith.data without importing torch.)"""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.errors import DraftsmithError


def _blocking_ancestor(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (mkdir / open would fail)."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_out_dir(out: str | Path, flag: str = "--out") -> Path:
    """`out` names a directory this job writes: refuse a file there (or above it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"{flag} {out} is a file, but this job writes a directory there; give a directory "
                              "path (a new one is created)")
    blocker = _blocking_ancestor(out)
    if blocker is not None:
        raise DraftsmithError(f"{flag} {out}: {blocker} is a file, not a directory; give a path inside a directory")
    return out


def check_out_file(out: str | Path, flag: str = "--out", example: str = "out.jsonl") -> Path:
    """`out` names a file this job writes: refuse a directory there (or a file above it)."""
    out = Path(out)
    if out.is_dir():
        raise DraftsmithError(f"{flag} {out} is a directory, but this job writes a file there; give a file path, "
                              f"e.g. {out / example}")
    blocker = _blocking_ancestor(out)
    if blocker is not None:
        raise DraftsmithError(f"{flag} {out}: {blocker} is a file, not a directory; give a path inside a directory")
    return out


def _same_path(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_replace(out: str | Path, overwrite: bool, source: str | Path | None = None,
                  source_what: str = "source") -> Path:
    """export / import: --out must be a new or empty directory, and not the directory being read,
    unless `overwrite` (--overwrite)."""
    out = check_out_dir(out)
    if overwrite or not out.exists():
        return out
    if source is not None and Path(source).exists() and _same_path(out, Path(source)):
        raise DraftsmithError(f"--out {out} is the {source_what} being read; writing there would replace it. Give "
                              "another --out, or pass --overwrite to replace it")
    if any(out.iterdir()):
        raise DraftsmithError(f"{out} is not empty; give a new --out, or pass --overwrite to replace the drafter "
                              "files in it (config.json, model.safetensors)")
    return out

"""Checks of a job's --out path, made before the job loads anything: the right kind (a
directory for cache / eval / bench / export / import, a file for regen), no other job's
output there (bench and train write their files beside what a directory holds), and, for
the jobs that write a model directory (export, import), no silent replacement of what is there.

(These belong beside fileio.py; they live here because every job that writes an --out
reaches draftsmith.data without importing torch.)"""

from __future__ import annotations

import os
from collections.abc import Sequence
from fnmatch import fnmatch
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


# What each job leaves in its directory, the first match naming it: bench or train writing among
# these would mix two jobs' files (and --overwrite would delete the other's report.json).
JOB_FILES = (
    ("manifest.json", "a feature cache"), ("shard-*.safetensors", "a feature cache"),
    ("checkpoint-*", "a training run"), ("train_info.json", "a training run"),
    ("*.safetensors", "model or drafter weights"),
    ("rounds-*.jsonl", "an eval report"),
    ("setup.json", "a bench report"), ("results.jsonl", "a bench report"),
    ("*.jsonl", "a data file (a regen output or prompts)"),
)


def check_no_other_job(out: str | Path, job: str, own: Sequence[str], where: str | None = None) -> None:
    """Refuse a directory `out` that holds another job's output (JOB_FILES); names matching a
    pattern in `own` are this job's own files. `where` names it in the error (default --out OUT)."""
    out = Path(out)
    if not out.is_dir():
        return
    for pattern, what in JOB_FILES:
        for p in sorted(out.glob(pattern)):
            if not any(fnmatch(p.name, o) for o in own):
                raise DraftsmithError(f"{where or f'--out {out}'} holds {what} ({p.name}), another job's output; "
                                      f"{job} would write its files among it. Give a new or empty directory")


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

"""File helpers shared by the feature cache, checkpoints, reports and runs: atomic writes and
JSON reads with errors that name the file."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after a rename) so the new name survives a crash; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` through `write(tmp)` on a temporary file in the same directory, fsync
    it, then rename it over `path`: a crash leaves the old file or the new one, never half."""
    path = Path(path)
    # a fresh name created with the process umask (mkstemp's files are 0600)
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"))
    open(tmp, "x").close()
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as indented JSON (one trailing newline), written atomically."""
    atomic_write(Path(path), lambda p: p.write_text(json.dumps(data, indent=1) + "\n"))


def read_json(path: Path, what: str = "file") -> Any:
    """Parsed JSON, or a DraftsmithError that names the file and what is wrong with it."""
    path = Path(path)
    if path.is_dir():
        raise DraftsmithError(f"{what} {path} is a directory; give the JSON file")
    if not path.is_file():
        raise DraftsmithError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno}, "
                              f"column {e.colno})") from None
    except UnicodeDecodeError:
        raise DraftsmithError(f"{what} {path} is not UTF-8 text") from None
    except RecursionError:
        raise DraftsmithError(f"{what} {path} is JSON nested too deeply to read") from None

"""Drafters that ship inside the package, trained by Draftsmith's own recipe.

`--drafter KIND:NAME` (CLI) and `LLM(..., drafter="KIND:NAME")` load the built-in drafter
`draftsmith/builtin/KIND/NAME/` when NAME is not an existing path (a local directory of that
name wins, as with HF model ids). A built-in directory is an ordinary checkpoint
(drafters/checkpoint.py) plus what made it:

    config.json          kind, target id and weights hash, the kind's config
    model.safetensors    16-bit weights with their content hash (tensorfile.py; at most 20 MB)
    calibration.json     optional STS temperatures, for the rows of the regime they were fitted in
    recipe.yaml          the recipe that trained it
    data_manifest.json   the regenerated data it saw (counts, sizes, checksums)
    TRAINING.md          how long it trained and what it measured

A built-in's weights file must carry its content hash (every load checks it), and the target's
weights hash is checked like any checkpoint's, so a built-in never loads onto another model.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.tensorfile import HASH_KEY

BUILTIN_ROOT = Path(__file__).resolve().parents[1] / "builtin"


def builtin_dir(kind: str, name: str) -> Path | None:
    """The package directory of built-in drafter `KIND:NAME`, or None."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    d = BUILTIN_ROOT / kind / name
    return d if (d / "config.json").is_file() else None


def builtin_specs(kind: str | None = None) -> list[str]:
    """Every built-in drafter as a spec `KIND:NAME` (only `kind`'s when given), sorted."""
    if not BUILTIN_ROOT.is_dir():
        return []
    return sorted(f"{d.parent.name}:{d.name}" for d in BUILTIN_ROOT.glob("*/*")
                  if (d / "config.json").is_file() and (kind is None or d.parent.name == kind))


def is_builtin(path: str | Path) -> bool:
    """Whether a checkpoint directory is a built-in drafter's (package data: never written to)."""
    try:
        return Path(path).resolve().is_relative_to(BUILTIN_ROOT.resolve())
    except OSError:
        return False


def resolve(kind: str, arg: str) -> str:
    """A trainable kind's spec argument -> a checkpoint path: an existing path as given, else a
    built-in name's package directory (whose weights must carry their content hash)."""
    if not arg or Path(arg).exists():
        return arg
    d = builtin_dir(kind, arg)
    if d is None:
        return arg
    f = d / "model.safetensors"
    try:
        with safe_open(str(f), framework="pt") as fh:
            hashed = HASH_KEY in (fh.metadata() or {})
    except Exception:  # a missing or unreadable file: the same advice either way
        hashed = False
    if not hashed:
        raise DraftsmithError(f"built-in drafter {kind}:{arg} is damaged ({f} is missing or carries no content "
                              "hash); reinstall draftsmith")
    return str(d)

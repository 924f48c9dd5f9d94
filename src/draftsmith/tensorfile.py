"""Tensor files (safetensors) that carry a hash of their own contents.

`save_tensors` writes the sha256 of every tensor's name, dtype, shape and bytes into the
file's metadata (`draftsmith_sha256`); `load_tensors` recomputes it and refuses a file whose
contents changed after it was written (a flipped byte, a truncated copy that still parses).
Files written without the field (older checkpoints, other tools) load unchecked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError

HASH_KEY = "draftsmith_sha256"


def content_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(state, str(path), metadata={**(metadata or {}), HASH_KEY: content_hash(state)})


def load_tensors(path: str | Path, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Tensors of a file, checked against its stored content hash when it has one."""
    f = Path(path)
    if not f.is_file():
        raise DraftsmithError(f"{f} does not exist; the {what} is incomplete")
    try:
        with safe_open(str(f), framework="pt") as fh:
            stored = (fh.metadata() or {}).get(HASH_KEY)
        state = load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise DraftsmithError(f"cannot read {f} ({' '.join(str(e).split())}); the {what} is damaged") from None
    if stored is not None and content_hash(state) != stored:
        raise DraftsmithError(
            f"{f} does not match the content hash written with it; the {what} is damaged (copy it again or retrain)"
        )
    return state

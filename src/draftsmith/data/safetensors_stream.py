"""A streaming safetensors encoder: tensors are written chunk by chunk (no concatenated copy
of a shard in memory) and checksummed while written. Used by the feature-cache writer and,
with placeholder data, by its size estimate (`safetensors_size`)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftsmith.fileio import file_sha256  # noqa: F401  (re-exported: the cache modules import it from here)
from typing import Any

import torch

_ST_DTYPE = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
             torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


@dataclass
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[torch.Tensor]  # concatenated along dim 0 in the file

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": _ST_DTYPE[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned


def _order(specs: list[TensorSpec]) -> list[TensorSpec]:
    # Larger element sizes first: every tensor then starts aligned to its element size.
    return sorted(specs, key=lambda s: (-torch.empty((), dtype=s.dtype).element_size(), s.name))


def safetensors_size(specs: Sequence[TensorSpec], metadata: Mapping[str, str]) -> int:
    specs = _order(list(specs))
    return 8 + len(_header_bytes(specs, metadata)) + sum(s.nbytes for s in specs)


def write_safetensors_stream(path: Path, specs: list[TensorSpec], metadata: Mapping[str, str]) -> tuple[str, int]:
    """Write a safetensors file chunk by chunk (no concatenated copy); returns (sha256, bytes)."""
    specs = _order(specs)
    header = _header_bytes(specs, metadata)
    h = hashlib.sha256()
    total = 0
    with open(path, "wb") as f:
        for part in (struct.pack("<Q", len(header)), header):
            f.write(part)
            h.update(part)
            total += len(part)
        for s in specs:
            written = 0
            for c in s.chunks:
                if c.dtype != s.dtype:
                    raise ValueError(f"{s.name}: chunk dtype {c.dtype} != {s.dtype}")
                buf = c.contiguous().view(torch.uint8).numpy()
                f.write(buf)
                h.update(buf)
                written += buf.nbytes
            if written != s.nbytes:
                raise ValueError(f"{s.name}: wrote {written} bytes, header says {s.nbytes}")
            total += written
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest(), total



"""The feature-cache writer: streaming, one shard of samples in memory at a time.

A shard is written under a temporary name, fsynced and renamed, and only then listed in the
manifest (itself replaced atomically). A shard is therefore visible only once complete, and
`--resume` continues after the last listed shard (removing a killed run's ".shard-…" strays).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from draftsmith.data.cache_format import (
    DEFAULT_SHARD_TOKENS,
    MANIFEST,
    shard_metadata,
    shard_name,
    shard_specs,
    split_label,
    write_json_atomic,
)
from draftsmith.data.features import store_dtype
from draftsmith.data.safetensors_stream import write_safetensors_stream
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import fsync_dir


class CacheWriter:
    """Buffers samples up to `shard_tokens` tokens, then writes one shard atomically.

    A shard holds whole samples: a sample longer than `shard_tokens` gets a shard of its own.
    `peak_buffered_tokens` records the most tokens ever held (tests check it stays within one
    shard).
    """

    def __init__(self, out_dir: Path, manifest: dict, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        self.out = Path(out_dir)
        self.manifest = manifest
        self.shard_tokens = int(shard_tokens)
        if self.shard_tokens <= 0:
            raise DraftsmithError(f"--shard-tokens must be positive, got {shard_tokens}")
        self.layer_ids = tuple(manifest["layer_ids"])
        self.hidden_size = int(manifest["hidden_size"])
        self.dtype = store_dtype(manifest["dtype"])
        self.buffer: list[dict] = []
        self.buffered_tokens = 0
        self.peak_buffered_tokens = 0
        self.bytes_written = 0

    def add(self, sample_id: str, split: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            hidden: Mapping[int, torch.Tensor], final_hidden: torch.Tensor) -> None:
        T = int(input_ids.shape[0])
        if self.buffer and self.buffered_tokens + T > self.shard_tokens:
            self.flush()
        for name, t in [("final_hidden", final_hidden), *((f"hidden.{i}", hidden[i]) for i in self.layer_ids)]:
            if tuple(t.shape) != (T, self.hidden_size):
                raise ValueError(f"{sample_id}: {name} has shape {tuple(t.shape)}, expected {(T, self.hidden_size)}")
        self.buffer.append({
            "id": sample_id, "split": split, "num_tokens": T,
            "input_ids": input_ids.to(torch.int32).contiguous(),
            "loss_mask": loss_mask.to(torch.uint8).contiguous(),
            "hidden": {i: hidden[i].to("cpu", self.dtype).contiguous() for i in self.layer_ids},
            "final_hidden": final_hidden.to("cpu", self.dtype).contiguous(),
        })
        self.buffered_tokens += T
        self.peak_buffered_tokens = max(self.peak_buffered_tokens, self.buffered_tokens)

    def flush(self) -> None:
        if not self.buffer:
            return
        m = self.manifest
        index = len(m["shards"])
        listed = {s["file"] for s in m["shards"]}
        while shard_name(index) in listed:  # a resume that dropped a damaged shard leaves a gap
            index += 1
        name = shard_name(index)
        # Not fileio.atomic_write: its mkstemp temporary would leave shards mode 0600 instead
        # of the umask default. Same steps: write + fsync (write_safetensors_stream), rename,
        # fsync the directory.
        tmp = self.out / f".{name}.tmp"
        buffer, tokens = self.buffer, self.buffered_tokens
        specs = shard_specs(self.layer_ids, self.hidden_size, self.dtype, buffer)
        sha, nbytes = write_safetensors_stream(tmp, specs, shard_metadata(buffer))
        os.replace(tmp, self.out / name)
        fsync_dir(self.out)
        # From here the samples are in a shard file: an interrupt (Ctrl-C, SIGTERM) must not have
        # close() flush them again into a second shard. So the buffer goes first and the manifest
        # changes in one step after its write; an interrupt in between leaves the shard unlisted
        # (its samples are redone by --resume, which reuses the name), never listed twice.
        self.buffer, self.buffered_tokens = [], 0
        entry = {
            "file": name, "sha256": sha, "bytes": nbytes, "num_samples": len(buffer),
            "num_tokens": tokens, "sample_ids": [s["id"] for s in buffer],
            "token_counts": [s["num_tokens"] for s in buffer],
            "splits": [s["split"] for s in buffer],
        }
        splits = dict(m["splits"])
        for s in buffer:
            splits[s["split"]] = splits.get(s["split"], 0) + 1
        new = {**m, "shards": [*m["shards"], entry], "num_samples": m["num_samples"] + len(buffer),
               "num_tokens": m["num_tokens"] + tokens,
               "num_loss_tokens": m["num_loss_tokens"] + int(sum(int(s["loss_mask"].sum()) for s in buffer)),
               "splits": splits, "split": split_label(splits)}
        write_json_atomic(self.out / MANIFEST, new)
        m.update(new)  # (in place: the caller holds this dict)
        self.bytes_written += nbytes

    def close(self, complete: bool = True) -> None:
        self.flush()
        self.manifest["complete"] = complete
        write_json_atomic(self.out / MANIFEST, self.manifest)

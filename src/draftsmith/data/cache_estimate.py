"""Sizes of a feature cache: what a cache will take before it is built (`draftsmith cache
--estimate`, same shard rule and header encoder as the writer) and what it takes on disk."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.cache_format import dump_manifest, shard_metadata, shard_name, shard_specs
from draftsmith.data.features import store_dtype
from draftsmith.data.safetensors_stream import safetensors_size


def plan_shards(token_counts: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Which samples go in which shard (the writer's rule, for estimates)."""
    shards: list[list[int]] = []
    cur: list[int] = []
    cur_t = 0
    for k, t in enumerate(token_counts):
        if cur and cur_t + t > shard_tokens:
            shards.append(cur)
            cur, cur_t = [], 0
        cur.append(k)
        cur_t += t
    if cur:
        shards.append(cur)
    return shards


def estimate_bytes(samples: Sequence[tuple[str, int]], layer_ids: Sequence[int], hidden_size: int,
                   dtype: str, shard_tokens: int, manifest: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Bytes the cache will take: tokens x (layers + 1) x H x dtype bytes + ids/mask + headers.

    `samples` are (id, tokens). Shard headers are computed exactly (same layout rule and
    header encoder as the writer); the manifest is rendered with placeholder checksums.
    """
    dt = store_dtype(dtype)
    elt = torch.empty((), dtype=dt).element_size()
    tokens = sum(t for _, t in samples)
    features = tokens * (len(layer_ids) + 1) * hidden_size * elt
    ids_mask = tokens * (4 + 1)
    shard_bytes = 0
    entries = []
    for idx in plan_shards([t for _, t in samples], shard_tokens):
        part = [{"id": samples[k][0], "num_tokens": samples[k][1]} for k in idx]
        nbytes = safetensors_size(shard_specs(layer_ids, hidden_size, dt, part), shard_metadata(part))
        shard_bytes += nbytes
        entries.append({"file": shard_name(len(entries)), "sha256": "0" * 64, "bytes": nbytes,
                        "num_samples": len(part), "num_tokens": sum(p["num_tokens"] for p in part),
                        "sample_ids": [p["id"] for p in part], "token_counts": [p["num_tokens"] for p in part],
                        "splits": ["train"] * len(part)})
    m = dict(manifest or {})
    m["shards"] = entries
    manifest_bytes = len(dump_manifest(m).encode())
    total = shard_bytes + manifest_bytes
    return {"tokens": tokens, "samples": len(samples), "shards": len(entries), "feature_bytes": features,
            "ids_mask_bytes": ids_mask, "overhead_bytes": total - features - ids_mask, "total_bytes": total}


def directory_bytes(path: Path) -> int:
    """Bytes of the files in a cache directory (temporary ".…" files left out)."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file() and not f.name.startswith("."))

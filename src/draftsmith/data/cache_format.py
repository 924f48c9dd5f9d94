"""The target feature cache format: sharded safetensors + manifest.json.

Layout of a cache directory:

    manifest.json              what the cache holds (see `Manifest fields` below)
    shard-00000.safetensors    a few samples concatenated along tokens
    shard-00001.safetensors    ...

Tensors in a shard (T = tokens in the shard, n = samples, H = hidden size):

    offsets        int64 [n + 1]  sample k is tokens offsets[k] : offsets[k+1]
    input_ids      int32 [T]
    loss_mask      uint8 [T]      1 on target-generated (assistant) tokens
    hidden.<i>     dtype [T, H]   output of decoder layer i (0-based; HF hidden_states[i+1])
    final_hidden   dtype [T, H]   normed last hidden state (lm_head input)

Manifest fields: format_version, kind, target {id, weights_hash}, layer_ids, hidden_size,
num_layers, dtype, shard_tokens, num_samples, num_tokens, num_loss_tokens, split, splits
{split: n}, complete, data {path}, options {split, model_dtype, allow_target_mismatch, target},
skipped [{id, reason}], shards [{file, sha256, bytes, num_samples, num_tokens, sample_ids,
token_counts, splits}]. `options` holds the rest of what the `draftsmith cache` command that
built it was given (--split: the one it cached, None = all; the dtype the target computed in;
--target as a path or alias), so that `rebuild_command` repeats that command (absent in caches
written before it was recorded).

This module holds what writer, reader and estimate share: the constants, shard names and
tensor layout, and the manifest (new / dump / write / read).
"""

from __future__ import annotations

import json
import shlex
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith import fileio
from draftsmith.data.features import DTYPE_NAMES, store_dtype
from draftsmith.data.safetensors_stream import TensorSpec
from draftsmith.errors import DraftsmithError

CACHE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KIND = "draftsmith-target-cache"
DEFAULT_SHARD_TOKENS = 8192


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


# ---- shard layout ---------------------------------------------------------------------


def shard_specs(layer_ids: Sequence[int], hidden_size: int, dtype: torch.dtype,
                samples: Sequence[dict]) -> list[TensorSpec]:
    """The tensors of a shard holding `samples` (dicts with id, num_tokens and, to write, the
    tensors; the estimate passes only id and num_tokens)."""
    T = sum(s["num_tokens"] for s in samples)
    offs = [0]
    for s in samples:
        offs.append(offs[-1] + s["num_tokens"])
    specs = [
        TensorSpec("offsets", torch.int64, (len(samples) + 1,), [torch.tensor(offs, dtype=torch.int64)]),
        TensorSpec("input_ids", torch.int32, (T,), [s.get("input_ids") for s in samples]),
        TensorSpec("loss_mask", torch.uint8, (T,), [s.get("loss_mask") for s in samples]),
        TensorSpec("final_hidden", dtype, (T, hidden_size), [s.get("final_hidden") for s in samples]),
    ]
    for i in layer_ids:
        specs.append(TensorSpec(f"hidden.{i}", dtype, (T, hidden_size), [s.get("hidden", {}).get(i) for s in samples]))
    return specs


def shard_metadata(samples: Sequence[dict]) -> dict[str, str]:
    return {"format": KIND, "format_version": str(CACHE_FORMAT_VERSION),
            "sample_ids": json.dumps([s["id"] for s in samples], ensure_ascii=False)}


def shard_problem(cache_dir: Path, entry: Mapping[str, Any]) -> str | None:
    """What is wrong with the shard a manifest entry lists, or None: it must exist, have the
    manifest's size, a readable safetensors header and exactly the bytes that header describes
    (a truncated or half-copied shard fails one of these). Reads the header only, not the data
    (the sha256 is checked by the reader when it loads the shard)."""
    f = Path(cache_dir) / entry["file"]
    if not f.is_file():
        return "is missing"
    size = f.stat().st_size
    want = entry.get("bytes")
    if isinstance(want, int) and size != want:
        return f"has {size} bytes, the manifest says {want} (truncated?)"
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= size - 8:
                return "has no readable safetensors header"
            header = json.loads(fh.read(n).decode("utf-8"))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, RecursionError, AttributeError, KeyError, IndexError, TypeError):
        return "has no readable safetensors header"
    if 8 + n + end != size:
        return f"has {size} bytes, its header describes {8 + n + end} (truncated?)"
    return None


def rebuild_command(cache_dir: Path, m: Mapping[str, Any], target: str | None = None) -> str:
    """The `draftsmith cache --resume` command that completes the cache `cache_dir` (manifest `m`)
    and re-makes its damaged shards: every option that decides what the cache holds, from the
    manifest; `target`: how to name the target (default: the one the manifest records)."""
    opts = m.get("options") or {}
    args = ["--target", target or opts.get("target") or (m.get("target") or {}).get("id"),
            "--data", (m.get("data") or {}).get("path") or "DATA",
            "--layers", ",".join(str(i) for i in m.get("layer_ids") or ())]
    if m.get("dtype") not in (None, "fp16"):
        args += ["--dtype", m["dtype"]]
    if opts.get("model_dtype"):
        args += ["--model-dtype", opts["model_dtype"]]
    if opts.get("split"):
        args += ["--split", opts["split"]]
    if m.get("shard_tokens") not in (None, DEFAULT_SHARD_TOKENS):
        args += ["--shard-tokens", str(m["shard_tokens"])]
    if opts.get("allow_target_mismatch"):
        args.append("--allow-target-mismatch")
    args += ["--out", str(cache_dir), "--resume"]
    return "draftsmith cache " + " ".join(shlex.quote(str(a)) for a in args)


# ---- manifest -------------------------------------------------------------------------


def new_manifest(target_id: str, weights_hash: str, layer_ids: Sequence[int], hidden_size: int,
                 num_layers: int, dtype: str, shard_tokens: int, data_path: str | None,
                 split: str | None = None, allow_target_mismatch: bool = False) -> dict:
    return {
        "format_version": CACHE_FORMAT_VERSION, "kind": KIND,
        "target": {"id": target_id, "weights_hash": weights_hash},
        "layer_ids": [int(i) for i in layer_ids], "hidden_size": int(hidden_size),
        "num_layers": int(num_layers), "dtype": DTYPE_NAMES[store_dtype(dtype)],
        "shard_tokens": int(shard_tokens),
        "features": [f"hidden.{i}" for i in layer_ids] + ["final_hidden"],
        "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "split": None, "splits": {},
        "complete": False, "data": {"path": data_path},
        "options": {"split": split, "model_dtype": None, "allow_target_mismatch": bool(allow_target_mismatch)},
        "skipped": [], "shards": [],
    }


def split_label(splits: Mapping[str, int]) -> str | None:
    """The manifest's `split`: the one split present, "mixed", or None when empty."""
    names = [k for k, v in splits.items() if v]
    return names[0] if len(names) == 1 else ("mixed" if names else None)


def dump_manifest(m: Mapping[str, Any]) -> str:
    """Readable manifest JSON with one line per shard (it is rewritten after every shard)."""
    head = json.dumps({k: v for k, v in m.items() if k != "shards"}, indent=1, ensure_ascii=False)
    shards = ",\n".join("  " + json.dumps(s, separators=(",", ":"), ensure_ascii=False) for s in m.get("shards", ()))
    return head[:-2] + ',\n "shards": [\n' + shards + "\n ]\n}\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """A manifest (one shard per line) or other JSON (as `fileio.write_json_atomic`), written atomically."""
    if not (isinstance(data, dict) and "shards" in data):
        fileio.write_json_atomic(path, data)
        return
    text = dump_manifest(data)
    fileio.atomic_write(path, lambda p: p.write_text(text))


def read_manifest(path: Path) -> dict:
    """The manifest of the cache directory `path`, checked to be a cache of this format version."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise DraftsmithError(f"{path} is not a feature cache: {MANIFEST} is missing (run `draftsmith cache`)")
    try:
        m = fileio.read_json(mpath, "feature-cache manifest")
    except DraftsmithError as e:
        raise DraftsmithError(f"{e}; the cache is damaged, rebuild it") from None
    if not isinstance(m, dict) or m.get("kind") != KIND:
        raise DraftsmithError(f"{mpath} is not a Draftsmith feature-cache manifest")
    if m.get("format_version") != CACHE_FORMAT_VERSION:
        raise DraftsmithError(f"{mpath} has cache format version {m.get('format_version')}; this Draftsmith "
                              f"reads version {CACHE_FORMAT_VERSION}. Rebuild the cache")
    return m


def manifest_view(m: Mapping[str, Any]) -> dict:
    """What `features.check_compatible` compares, taken from a manifest."""
    return {"target_id": m["target"]["id"], "weights_hash": m["target"]["weights_hash"],
            "layer_ids": tuple(m["layer_ids"]), "hidden_size": m["hidden_size"]}

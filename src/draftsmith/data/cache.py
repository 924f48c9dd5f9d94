"""The target feature cache: sharded safetensors + manifest.json.

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
{split: n}, complete, data {path}, skipped [{id, reason}], shards [{file, sha256, bytes,
num_samples, num_tokens, sample_ids, token_counts, splits}].

Writing is streaming: the writer holds at most one shard of samples; a shard is written
under a temporary name, fsynced and renamed, and only then listed in the manifest (itself
replaced atomically). A shard is therefore visible only once complete, and `--resume`
continues after the last listed shard. Shards are written by a small streaming safetensors
encoder (no concatenated copy of the shard in memory) and checksummed while written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import struct
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.data.features import (
    DTYPE_NAMES,
    FeatureExtractor,
    FeatureSample,
    check_compatible,
    parse_layer_ids,
    record_tensors,
    store_dtype,
)
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write
from draftsmith.fileio import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KIND = "draftsmith-target-cache"
DEFAULT_SHARD_TOKENS = 8192

_ST_DTYPE = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
             torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def dump_manifest(m: Mapping[str, Any]) -> str:
    """Readable manifest JSON with one line per shard (it is rewritten after every shard)."""
    head = json.dumps({k: v for k, v in m.items() if k != "shards"}, indent=1, ensure_ascii=False)
    shards = ",\n".join("  " + json.dumps(s, separators=(",", ":"), ensure_ascii=False) for s in m.get("shards", ()))
    return head[:-2] + ',\n "shards": [\n' + shards + "\n ]\n}\n"


def write_json_atomic(path: Path, data: Any) -> None:
    """A manifest (one shard per line) or other JSON, written atomically."""
    text = dump_manifest(data) if isinstance(data, dict) and "shards" in data else json.dumps(data, indent=1) + "\n"
    atomic_write(path, lambda p: p.write_text(text))


# ---- streaming safetensors ------------------------------------------------------------


@dataclass
class _TensorSpec:
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


def _header_bytes(specs: Sequence[_TensorSpec], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": _ST_DTYPE[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # data starts 8-byte aligned


def _order(specs: list[_TensorSpec]) -> list[_TensorSpec]:
    # Larger element sizes first: every tensor then starts aligned to its element size.
    return sorted(specs, key=lambda s: (-torch.empty((), dtype=s.dtype).element_size(), s.name))


def safetensors_size(specs: Sequence[_TensorSpec], metadata: Mapping[str, str]) -> int:
    specs = _order(list(specs))
    return 8 + len(_header_bytes(specs, metadata)) + sum(s.nbytes for s in specs)


def write_safetensors_stream(path: Path, specs: list[_TensorSpec], metadata: Mapping[str, str]) -> tuple[str, int]:
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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


# ---- writer ---------------------------------------------------------------------------


def _shard_specs(layer_ids: Sequence[int], hidden_size: int, dtype: torch.dtype,
                 samples: Sequence[dict]) -> list[_TensorSpec]:
    T = sum(s["num_tokens"] for s in samples)
    offs = [0]
    for s in samples:
        offs.append(offs[-1] + s["num_tokens"])
    specs = [
        _TensorSpec("offsets", torch.int64, (len(samples) + 1,), [torch.tensor(offs, dtype=torch.int64)]),
        _TensorSpec("input_ids", torch.int32, (T,), [s.get("input_ids") for s in samples]),
        _TensorSpec("loss_mask", torch.uint8, (T,), [s.get("loss_mask") for s in samples]),
        _TensorSpec("final_hidden", dtype, (T, hidden_size), [s.get("final_hidden") for s in samples]),
    ]
    for i in layer_ids:
        specs.append(_TensorSpec(f"hidden.{i}", dtype, (T, hidden_size), [s.get("hidden", {}).get(i) for s in samples]))
    return specs


def _shard_metadata(samples: Sequence[dict]) -> dict[str, str]:
    return {"format": KIND, "format_version": str(CACHE_FORMAT_VERSION),
            "sample_ids": json.dumps([s["id"] for s in samples], ensure_ascii=False)}


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
        name = shard_name(index)
        tmp = self.out / f".{name}.tmp"
        specs = _shard_specs(self.layer_ids, self.hidden_size, self.dtype, self.buffer)
        sha, nbytes = write_safetensors_stream(tmp, specs, _shard_metadata(self.buffer))
        os.replace(tmp, self.out / name)
        _fsync_dir(self.out)
        entry = {
            "file": name, "sha256": sha, "bytes": nbytes, "num_samples": len(self.buffer),
            "num_tokens": self.buffered_tokens, "sample_ids": [s["id"] for s in self.buffer],
            "token_counts": [s["num_tokens"] for s in self.buffer],
            "splits": [s["split"] for s in self.buffer],
        }
        m["shards"].append(entry)
        m["num_samples"] += entry["num_samples"]
        m["num_tokens"] += entry["num_tokens"]
        m["num_loss_tokens"] += int(sum(int(s["loss_mask"].sum()) for s in self.buffer))
        for s in self.buffer:
            m["splits"][s["split"]] = m["splits"].get(s["split"], 0) + 1
        m["split"] = _split_label(m["splits"])
        write_json_atomic(self.out / MANIFEST, m)
        self.bytes_written += nbytes
        self.buffer = []
        self.buffered_tokens = 0

    def close(self, complete: bool = True) -> None:
        self.flush()
        self.manifest["complete"] = complete
        write_json_atomic(self.out / MANIFEST, self.manifest)


def _split_label(splits: Mapping[str, int]) -> str | None:
    names = [k for k, v in splits.items() if v]
    return names[0] if len(names) == 1 else ("mixed" if names else None)


def new_manifest(target_id: str, weights_hash: str, layer_ids: Sequence[int], hidden_size: int,
                 num_layers: int, dtype: str, shard_tokens: int, data_path: str | None) -> dict:
    return {
        "format_version": CACHE_FORMAT_VERSION, "kind": KIND,
        "target": {"id": target_id, "weights_hash": weights_hash},
        "layer_ids": [int(i) for i in layer_ids], "hidden_size": int(hidden_size),
        "num_layers": int(num_layers), "dtype": DTYPE_NAMES[store_dtype(dtype)],
        "shard_tokens": int(shard_tokens),
        "features": [f"hidden.{i}" for i in layer_ids] + ["final_hidden"],
        "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "split": None, "splits": {},
        "complete": False, "data": {"path": data_path}, "skipped": [], "shards": [],
    }


# ---- reading regen data ---------------------------------------------------------------


def iter_records(path: Path) -> Iterator[dict]:
    """Stream regen records; a truncated last line (a killed regen) is skipped with a warning."""
    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"regen data {path} does not exist; run `draftsmith regen` first")
    with open(path, "rb") as f:
        prev: tuple[int, bytes] | None = None
        for n, line in enumerate(f, 1):
            if prev is not None:
                yield _parse_record(path, *prev)
            prev = (n, line)
        if prev is not None:
            n, line = prev
            if not line.endswith(b"\n"):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    print(f"[draftsmith] warning: {path}:{n} is an incomplete last line (a killed run?); "
                          "skipped", file=sys.stderr)
                    return
                yield rec
            elif line.strip():
                yield _parse_record(path, n, line)


def _parse_record(path: Path, n: int, line: bytes) -> dict:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}:{n}: not valid JSON ({e.msg}); the regen file is damaged") from None
    if not isinstance(rec, dict) or "id" not in rec:
        raise DraftsmithError(f"{path}:{n}: expected a regen record object with an 'id'")
    return rec


def _record_split(rec: Mapping[str, Any]) -> str:
    return str(rec.get("split") or "train")


# ---- estimate -------------------------------------------------------------------------


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
        nbytes = safetensors_size(_shard_specs(layer_ids, hidden_size, dt, part), _shard_metadata(part))
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
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file() and not f.name.startswith("."))


# ---- build (the `draftsmith cache` job) -----------------------------------------------


@dataclass
class CacheConfig:
    target: str
    data: Path
    out: Path
    layers: str | Sequence[int] | None = None
    dtype: str = "fp16"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    estimate: bool = False
    resume: bool = False
    overwrite: bool = False
    split: str | None = None  # cache only records of this split (None = all)
    device: str | None = None
    model_dtype: str | None = None
    chunk_tokens: int = 1024
    allow_target_mismatch: bool = False
    progress: bool | None = None  # None = only on a terminal


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


def run_cache(cfg: CacheConfig) -> dict:
    """Build (or estimate) a feature cache. Returns a summary dict."""
    from draftsmith.models.loading import read_config, weights_fingerprint
    from draftsmith.models.registry import resolve_target

    target_id, path = resolve_target(cfg.target)
    mcfg = read_config(path)
    layer_ids = parse_layer_ids(cfg.layers, mcfg.num_layers)
    dtype_name = DTYPE_NAMES[store_dtype(cfg.dtype)]
    out = Path(cfg.out)

    if cfg.estimate:
        samples = [(str(r["id"]), len(r.get("input_ids") or ())) for r in iter_records(cfg.data)
                   if cfg.split is None or _record_split(r) == cfg.split]
        proto = new_manifest(target_id, weights_fingerprint(path), layer_ids, mcfg.hidden_size, mcfg.num_layers,
                             dtype_name, cfg.shard_tokens, str(cfg.data))
        proto.update(num_samples=len(samples), num_tokens=sum(t for _, t in samples), num_loss_tokens=10 ** 6,
                     split="train", splits={"train": len(samples)}, complete=True)
        est = estimate_bytes(samples, layer_ids, mcfg.hidden_size, dtype_name, cfg.shard_tokens, proto)
        per_tok = est["total_bytes"] / est["tokens"] if est["tokens"] else 0.0
        print(f"estimate: {est['samples']} samples, {est['tokens']} tokens, {est['shards']} shards, "
              f"layers {list(layer_ids)} + final, H={mcfg.hidden_size}, {dtype_name}: "
              f"{est['total_bytes']} bytes ({_fmt_bytes(est['total_bytes'])}, {per_tok:.0f} B/token)")
        return {"estimate": est, "layer_ids": list(layer_ids)}

    from draftsmith.models.target import load_target

    weights_hash = weights_fingerprint(path)
    manifest = _prepare_out(out, cfg, target_id, weights_hash, layer_ids, mcfg, dtype_name)
    done = {sid for sh in manifest["shards"] for sid in sh["sample_ids"]}
    done |= {s["id"] for s in manifest["skipped"]}
    target = load_target(cfg.target, device=cfg.device, dtype=cfg.model_dtype)
    extractor = FeatureExtractor(target.model, layer_ids, cfg.chunk_tokens)
    writer = CacheWriter(out, manifest, cfg.shard_tokens)
    from tqdm import tqdm

    bar = tqdm(unit="tok", unit_scale=True, desc="cache", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    t0 = time.perf_counter()
    new_tokens = 0
    seen: set[str] = set()
    try:
        for rec in iter_records(cfg.data):
            sid = str(rec["id"])
            if sid in seen:
                raise DraftsmithError(f"{cfg.data}: id {sid!r} appears twice; the regen file is damaged")
            seen.add(sid)
            if sid in done or (cfg.split is not None and _record_split(rec) != cfg.split):
                continue
            _check_record_target(rec, target_id, weights_hash, cfg)
            ids, mask = record_tensors(rec)
            if ids.shape[0] > extractor.max_len:
                manifest["skipped"].append({"id": sid, "reason": f"{ids.shape[0]} tokens exceed the "
                                            f"target context of {extractor.max_len}"})
                continue
            (hidden, final), = extractor([ids.tolist()])
            writer.add(sid, _record_split(rec), ids, mask, hidden, final)
            new_tokens += int(ids.shape[0])
            bar.update(int(ids.shape[0]))
        writer.close(complete=True)
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    size = directory_bytes(out)
    summary = {
        "out": str(out), "num_samples": manifest["num_samples"], "num_tokens": manifest["num_tokens"],
        "shards": len(manifest["shards"]), "bytes": size, "new_tokens": new_tokens,
        "new_bytes": writer.bytes_written, "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall else 0.0,
        "peak_buffered_tokens": writer.peak_buffered_tokens, "skipped": len(manifest["skipped"]),
    }
    print(f"cache: {summary['num_samples']} samples, {summary['num_tokens']} tokens in {summary['shards']} "
          f"shards, {_fmt_bytes(size)} at {out} ({new_tokens} new tokens, "
          f"{summary['tokens_per_s']:.0f} tok/s, {summary['skipped']} skipped)", file=sys.stderr)
    return summary


def _check_record_target(rec: Mapping[str, Any], target_id: str, weights_hash: str, cfg: CacheConfig) -> None:
    t = rec.get("target") or {}
    h = t.get("weights_hash")
    if h and h != weights_hash and not cfg.allow_target_mismatch:
        raise DraftsmithError(
            f"record {rec.get('id')!r} was regenerated by target {t.get('id')!r} (weights {h}), but the "
            f"cache target is {target_id!r} (weights {weights_hash}); use the same target, or pass "
            "--allow-target-mismatch if that is intended")


def _prepare_out(out: Path, cfg: CacheConfig, target_id: str, weights_hash: str, layer_ids: tuple[int, ...],
                 mcfg, dtype_name: str) -> dict:
    mpath = out / MANIFEST
    if out.exists() and any(out.iterdir()):
        if cfg.resume and mpath.is_file():
            m = read_manifest(out)
            want = {"target_id": target_id, "weights_hash": weights_hash, "layer_ids": None,
                    "hidden_size": mcfg.hidden_size}
            check_compatible(f"the cache being resumed at {out}", _manifest_view(m), **want)
            if tuple(m["layer_ids"]) != layer_ids or m["dtype"] != dtype_name:
                raise DraftsmithError(
                    f"cannot resume {out}: it holds layers {m['layer_ids']} in {m['dtype']}, this run asks for "
                    f"{list(layer_ids)} in {dtype_name}; use the same flags or a new --out")
            _clean_strays(out, m)
            m["complete"] = False
            return m
        if not cfg.overwrite:
            raise DraftsmithError(f"{out} is not empty; pass --resume to continue it or --overwrite to replace it")
        for f in out.iterdir():
            if f.is_file() and (f.name == MANIFEST or f.name.startswith(("shard-", ".shard-", f".{MANIFEST}"))):
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    m = new_manifest(target_id, weights_hash, layer_ids, mcfg.hidden_size, mcfg.num_layers, dtype_name,
                     cfg.shard_tokens, str(cfg.data))
    write_json_atomic(mpath, m)
    return m


def _clean_strays(out: Path, m: dict) -> None:
    """Remove temp files and shards a killed run renamed but never listed in the manifest."""
    listed = {s["file"] for s in m["shards"]}
    for f in out.iterdir():
        if f.name.startswith(".shard-") or (f.name.startswith("shard-") and f.name not in listed):
            f.unlink()


# ---- reader ---------------------------------------------------------------------------


def read_manifest(path: Path) -> dict:
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise DraftsmithError(f"{path} is not a feature cache: {MANIFEST} is missing (run `draftsmith cache`)")
    try:
        m = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{mpath} is not valid JSON ({e.msg}); the cache is damaged, rebuild it") from None
    if not isinstance(m, dict) or m.get("kind") != KIND:
        raise DraftsmithError(f"{mpath} is not a Draftsmith feature-cache manifest")
    if m.get("format_version") != CACHE_FORMAT_VERSION:
        raise DraftsmithError(f"{mpath} has cache format version {m.get('format_version')}; this Draftsmith "
                              f"reads version {CACHE_FORMAT_VERSION}. Rebuild the cache")
    return m


def _manifest_view(m: Mapping[str, Any]) -> dict:
    return {"target_id": m["target"]["id"], "weights_hash": m["target"]["weights_hash"],
            "layer_ids": tuple(m["layer_ids"]), "hidden_size": m["hidden_size"]}


class FeatureCache:
    """Reads a feature cache one shard at a time (memory: one shard).

        cache = FeatureCache("cache/").validate(target_id, weights_hash, layer_ids, hidden_size)
        for s in cache: s.id, s.input_ids, s.loss_mask, s.hidden[layer], s.final_hidden

    Every shard's sha256 is checked against the manifest the first time it is opened; a
    mismatch (or a missing file) raises a DraftsmithError naming the shard.
    """

    def __init__(self, path: str | Path, verify: bool = True, layer_ids: Sequence[int] | None = None) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        m = self.manifest
        self.target_id: str = m["target"]["id"]
        self.weights_hash: str = m["target"]["weights_hash"]
        self.hidden_size: int = int(m["hidden_size"])
        self.stored_layer_ids: tuple[int, ...] = tuple(m["layer_ids"])
        self.layer_ids: tuple[int, ...] = self.stored_layer_ids
        self.dtype: torch.dtype = store_dtype(m["dtype"])
        self.verify = verify
        self._verified: set[str] = set()
        self._index: dict[str, tuple[int, int]] | None = None
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None
        if layer_ids is not None:
            self.validate(layer_ids=layer_ids)
        if not m.get("complete", False):
            log.warning("feature cache %s is incomplete (a run was interrupted); resume it to add the rest", path)

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def sample_ids(self) -> list[str]:
        return [sid for sh in self.manifest["shards"] for sid in sh["sample_ids"]]

    def validate(self, target_id: str | None = None, weights_hash: str | None = None,
                 layer_ids: Sequence[int] | None = None, hidden_size: int | None = None) -> "FeatureCache":
        """Check the cache against what the consumer needs; keeps only the requested layers."""
        check_compatible(f"feature cache {self.path}", _manifest_view(self.manifest), target_id,
                         weights_hash, layer_ids, hidden_size)
        if layer_ids is not None:
            self.layer_ids = tuple(int(i) for i in layer_ids)
        return self

    def load_shard(self, index: int) -> dict[str, torch.Tensor]:
        if self._loaded is not None and self._loaded[0] == index:
            return self._loaded[1]
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        entry = self.manifest["shards"][index]
        f = self.path / entry["file"]
        if not f.is_file():
            raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} is missing; "
                                  "rebuild the cache")
        if self.verify and entry["file"] not in self._verified:
            got = file_sha256(f)
            if got != entry["sha256"]:
                raise DraftsmithError(
                    f"feature cache {self.path}: shard {entry['file']} is corrupt (sha256 {got[:16]}… "
                    f"!= manifest {entry['sha256'][:16]}…); delete the cache and rebuild it")
            self._verified.add(entry["file"])
        self._loaded = None  # drop the previous shard before loading the next
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} is unreadable "
                                  f"({' '.join(str(e).split())}); rebuild the cache") from None
        T = int(entry["num_tokens"])
        names = ["offsets", "input_ids", "loss_mask", "final_hidden"] + [f"hidden.{i}" for i in self.stored_layer_ids]
        for n in names:
            if n not in tensors:
                raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} lacks tensor {n!r}")
        if int(tensors["offsets"][-1]) != T or tensors["final_hidden"].shape != (T, self.hidden_size):
            raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} shapes disagree with the manifest")
        self._loaded = (index, tensors)
        return tensors

    def _sample(self, index: int, k: int, tensors: dict[str, torch.Tensor]) -> FeatureSample:
        entry = self.manifest["shards"][index]
        a, b = int(tensors["offsets"][k]), int(tensors["offsets"][k + 1])
        return FeatureSample(
            id=entry["sample_ids"][k], split=entry["splits"][k],
            input_ids=tensors["input_ids"][a:b].long(), loss_mask=tensors["loss_mask"][a:b].bool(),
            hidden={i: tensors[f"hidden.{i}"][a:b] for i in self.layer_ids},
            final_hidden=tensors["final_hidden"][a:b],
        )

    def iter_samples(self, shuffle: bool = False, seed: int = 0) -> Iterator[FeatureSample]:
        """All samples, shard by shard; `shuffle` permutes shards and samples within a shard."""
        rng = random.Random(seed)
        order = list(range(len(self.manifest["shards"])))
        if shuffle:
            rng.shuffle(order)
        for si in order:
            tensors = self.load_shard(si)
            ks = list(range(int(self.manifest["shards"][si]["num_samples"])))
            if shuffle:
                rng.shuffle(ks)
            for k in ks:
                yield self._sample(si, k, tensors)

    __iter__ = iter_samples

    def features(self, sample: Mapping[str, Any] | str) -> FeatureSample:
        """Features of one sample, by regen record or id (loads its shard)."""
        sid = sample if isinstance(sample, str) else str(sample["id"])
        if self._index is None:
            self._index = {sid_: (si, k) for si, sh in enumerate(self.manifest["shards"])
                           for k, sid_ in enumerate(sh["sample_ids"])}
        if sid not in self._index:
            raise DraftsmithError(f"sample {sid!r} is not in the feature cache {self.path}")
        si, k = self._index[sid]
        return self._sample(si, k, self.load_shard(si))

    __call__ = features

    def verify_all(self) -> None:
        for i in range(len(self.manifest["shards"])):
            self.load_shard(i)

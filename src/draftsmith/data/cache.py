"""`draftsmith cache`: run the target over regen records and store its features in a cache.

The cache is split by role (this module keeps the job and re-exports the public names):

    cache_format.py        directory layout, shard tensors, manifest (new / dump / write / read)
    safetensors_stream.py  the streaming, checksummed safetensors encoder
    cache_writer.py        CacheWriter: streaming, one shard in memory, atomic shards + manifest
    cache_reader.py        FeatureCache: one shard in memory, sha256-checked
    cache_estimate.py      plan_shards / estimate_bytes (--estimate), directory_bytes
    regen_records.py       iter_records: the regen JSONL this job reads

Writing is streaming: the writer holds at most one shard of samples; a shard is written
under a temporary name, fsynced and renamed, and only then listed in the manifest (itself
replaced atomically). A shard is therefore visible only once complete, and `--resume`
continues after the last listed shard.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from draftsmith.data.cache_estimate import directory_bytes, estimate_bytes, plan_shards
from draftsmith.data.cache_format import (
    CACHE_FORMAT_VERSION,
    DEFAULT_SHARD_TOKENS,
    KIND,
    MANIFEST,
    dump_manifest,
    manifest_view,
    new_manifest,
    read_manifest,
    rebuild_command,
    shard_name,
    shard_problem,
    split_label,
    write_json_atomic,
)
from draftsmith.data.cache_reader import FeatureCache
from draftsmith.data.cache_writer import CacheWriter
from draftsmith.data.features import (
    DTYPE_NAMES,
    FeatureExtractor,
    check_compatible,
    parse_layer_ids,
    record_tensors,
    store_dtype,
)
from draftsmith.data.outdir import check_out_dir
from draftsmith.data.regen_records import iter_records, record_split
from draftsmith.data.safetensors_stream import file_sha256, safetensors_size, write_safetensors_stream
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import legacy_weights_fingerprint, read_config, same_weights, weights_fingerprint
from draftsmith.models.registry import BUILTIN_TARGETS, resolve_target
from draftsmith.models.target import load_target
from draftsmith.models.threads import ThreadGovernor

__all__ = [
    "CACHE_FORMAT_VERSION", "DEFAULT_SHARD_TOKENS", "KIND", "MANIFEST",
    "CacheConfig", "CacheWriter", "FeatureCache",
    "directory_bytes", "dump_manifest", "estimate_bytes", "file_sha256", "iter_records", "new_manifest",
    "open_writer", "plan_shards", "read_manifest", "rebuild_command", "run_cache", "safetensors_size", "shard_name",
    "shard_problem", "write_json_atomic",
    "write_safetensors_stream",
]


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
    adaptive_threads: bool = False  # CPU: fewer threads while other processes keep cores busy (models/threads.py)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n}"


def open_writer(cfg: CacheConfig, target) -> tuple[CacheWriter, set[str]]:
    """A writer adding samples to the cache cfg.out for `target` (a LoadedTarget): a new cache,
    or the one there resumed (cfg.resume) or replaced (cfg.overwrite), checked as `run_cache`
    checks it; and the ids of the samples it already holds (or skipped)."""
    mcfg = read_config(target.path)
    layer_ids = parse_layer_ids(cfg.layers, mcfg.num_layers)
    manifest = _prepare_out(Path(cfg.out), cfg, target.target_id, target.weights_hash, layer_ids, mcfg,
                            DTYPE_NAMES[store_dtype(cfg.dtype)], target.legacy_weights_hash)
    _record_target(manifest, Path(cfg.out), cfg, target)
    done = {sid for sh in manifest["shards"] for sid in sh["sample_ids"]} | {s["id"] for s in manifest["skipped"]}
    return CacheWriter(Path(cfg.out), manifest, cfg.shard_tokens), done


def run_cache(cfg: CacheConfig, target=None) -> dict:
    """Build (or estimate) a feature cache. Returns a summary dict. `target`: the LoadedTarget
    of cfg.target when the caller has it loaded already (regen's catch-up pass)."""
    if not cfg.estimate:
        check_out_dir(cfg.out)  # before the target is resolved (a built-in one may be converted first)
    target_id, path = resolve_target(cfg.target)
    mcfg = read_config(path)
    layer_ids = parse_layer_ids(cfg.layers, mcfg.num_layers)
    dtype_name = DTYPE_NAMES[store_dtype(cfg.dtype)]
    out = Path(cfg.out)

    if cfg.estimate:
        samples = [(str(r["id"]), len(r.get("input_ids") or ())) for r in iter_records(cfg.data)
                   if cfg.split is None or record_split(r) == cfg.split]
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

    weights_hash = weights_fingerprint(path)
    legacy = legacy_weights_fingerprint(path)
    resumed = _resumed_manifest(out) if cfg.resume else None  # read once: for the option here, then by _prepare_out
    if resumed is not None and not cfg.allow_target_mismatch and _saved_allow_mismatch(resumed):
        cfg = replace(cfg, allow_target_mismatch=True)  # a resume keeps the option the cache was built with
    _check_data(cfg, target_id, weights_hash, legacy, need_records=target is None)  # before --out changes
    out_existed = out.exists()
    prepare = lambda: _prepare_out(out, cfg, target_id, weights_hash, layer_ids, mcfg, dtype_name, legacy,  # noqa: E731
                                   resumed)
    manifest = None if cfg.overwrite else prepare()  # --overwrite deletes the old cache once the target has loaded
    try:
        if target is None:
            target = load_target(cfg.target, device=cfg.device, dtype=cfg.model_dtype)
    except BaseException:
        if manifest is not None and not manifest["shards"] and not manifest["skipped"]:
            _remove_cache_files(out, remove_dir=not out_existed)  # (as below: nothing a later run could resume)
        raise
    manifest = manifest or prepare()
    fresh = not manifest["shards"] and not manifest["skipped"]
    done = {sid for sh in manifest["shards"] for sid in sh["sample_ids"]}
    done |= {s["id"] for s in manifest["skipped"]}
    _record_target(manifest, out, cfg, target)
    extractor = FeatureExtractor(target.model, layer_ids, cfg.chunk_tokens)
    governor = (ThreadGovernor(torch.get_num_threads())
                if cfg.adaptive_threads and target.model.device.type == "cpu" else None)
    writer = CacheWriter(out, manifest, cfg.shard_tokens)
    bar = tqdm(unit="tok", unit_scale=True, desc="cache", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    t0 = time.perf_counter()
    new_tokens = 0
    try:
        for rec in iter_records(cfg.data):  # (checked by _check_data)
            sid = str(rec["id"])
            if sid in done or (cfg.split is not None and record_split(rec) != cfg.split):
                continue
            ids, mask = record_tensors(rec)
            if ids.shape[0] > extractor.max_len:
                manifest["skipped"].append({"id": sid, "reason": f"{ids.shape[0]} tokens exceed the "
                                            f"target context of {extractor.max_len}"})
                continue
            if governor is not None:
                governor.step()
            (hidden, final), = extractor([ids.tolist()])
            writer.add(sid, record_split(rec), ids, mask, hidden, final)
            new_tokens += int(ids.shape[0])
            bar.update(int(ids.shape[0]))
        writer.close(complete=True)
    except BaseException as e:
        if fresh and not manifest["shards"]:  # nothing was cached: leave nothing a later run could
            _remove_cache_files(out, remove_dir=not out_existed)  # take for an interrupted cache
        elif isinstance(e, KeyboardInterrupt):
            print(f"[draftsmith] cache: {manifest['num_samples']} samples are kept in {out}; continue with "
                  f"`{rebuild_command(out, manifest, cfg.target)}`", file=sys.stderr)
        raise
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


def _check_data(cfg: CacheConfig, target_id: str, weights_hash: str, legacy: str | None, need_records: bool) -> None:
    """Read every record of cfg.data once before the target loads and --out changes: a missing or
    damaged file, a repeated id, a record of another target or without tokens is an error while
    --overwrite has deleted nothing yet; so is a file with no record to cache, when `need_records`
    (the cache job: regen's catch-up pass caches whatever its run wrote, nothing included)."""
    seen: set[str] = set()
    wanted = 0
    for rec in iter_records(cfg.data):
        sid = str(rec["id"])
        if sid in seen:
            raise DraftsmithError(f"{cfg.data}: id {sid!r} appears twice; the regen file is damaged")
        seen.add(sid)
        if cfg.split is None or record_split(rec) == cfg.split:
            _check_record_target(rec, target_id, weights_hash, cfg, legacy)
            record_tensors(rec)
            wanted += 1
    if need_records and not wanted:
        which = f"no {cfg.split}-split records ({len(seen)} of other splits)" if seen else "no records"
        raise DraftsmithError(f"{cfg.data} has {which}: nothing to cache; give the JSONL file `draftsmith regen` "
                              "wrote" + (", or another --split" if seen else ""))


def _resumed_manifest(out: Path) -> dict | None:
    """The manifest of the cache --resume continues at `out`; None where it has none or an unreadable
    one (_prepare_out then reads it itself and says what is wrong, after the data check)."""
    try:
        return read_manifest(out) if (out / MANIFEST).is_file() else None
    except DraftsmithError:
        return None


def _saved_allow_mismatch(m: Mapping[str, Any]) -> bool:
    """Whether the cache of manifest `m` was built with --allow-target-mismatch."""
    opts = m.get("options")
    return bool(isinstance(opts, dict) and opts.get("allow_target_mismatch"))


def _check_record_target(rec: Mapping[str, Any], target_id: str, weights_hash: str, cfg: CacheConfig,
                         legacy: str | None = None) -> None:
    t = rec.get("target") or {}
    h = t.get("weights_hash")
    if same_weights(h, weights_hash, legacy) is False and not cfg.allow_target_mismatch:
        raise DraftsmithError(
            f"record {rec.get('id')!r} was regenerated by target {t.get('id')!r} (weights {h}), but the "
            f"cache target is {target_id!r} (weights {weights_hash}); use the same target, or pass "
            "--allow-target-mismatch if that is intended")


def _prepare_out(out: Path, cfg: CacheConfig, target_id: str, weights_hash: str, layer_ids: tuple[int, ...],
                 mcfg, dtype_name: str, legacy: str | None = None, resumed: dict | None = None) -> dict:
    """The manifest the job writes to: the cache at `out` resumed (`resumed`: its manifest, when the
    caller has read it already), else a new one (an old one deleted with --overwrite)."""
    check_out_dir(out)
    mpath = out / MANIFEST
    if out.exists() and any(out.iterdir()):
        if cfg.resume and mpath.is_file():
            m = resumed if resumed is not None else read_manifest(out)
            want = {"target_id": target_id, "weights_hash": weights_hash, "layer_ids": None,
                    "hidden_size": mcfg.hidden_size, "legacy_hash": legacy}
            check_compatible(f"the cache being resumed at {out}", manifest_view(m), **want)
            _check_resume_options(out, m, cfg, layer_ids, dtype_name)
            _drop_damaged_shards(out, m)
            _clean_strays(out, m)
            m["complete"] = False
            return m
        if cfg.resume:  # (not "pass --resume": it was passed)
            raise DraftsmithError(f"cannot resume {out}: it holds no feature cache ({MANIFEST} is missing) but other "
                                  "files; give the cache's directory, or a new --out")
        if not cfg.overwrite:
            raise DraftsmithError(f"{out} is not empty; pass --resume to continue it or --overwrite to replace it")
        for f in out.iterdir():
            if f.is_file() and (f.name == MANIFEST or f.name.startswith(("shard-", ".shard-", f".{MANIFEST}"))):
                f.unlink()
    out.mkdir(parents=True, exist_ok=True)
    m = new_manifest(target_id, weights_hash, layer_ids, mcfg.hidden_size, mcfg.num_layers, dtype_name,
                     cfg.shard_tokens, str(cfg.data), cfg.split, cfg.allow_target_mismatch)
    write_json_atomic(mpath, m)
    return m


def _check_resume_options(out: Path, m: dict, cfg: CacheConfig, layer_ids: tuple[int, ...], dtype_name: str) -> None:
    """--resume: the options that decide what the cache holds must be the ones it was built with
    (a cache of mixed layers, splits or shard sizes is not one any single command builds).
    --allow-target-mismatch may be added (a resume that stopped at such a record)."""
    opts = m.get("options")
    have = {"--layers": ",".join(map(str, m["layer_ids"])), "--dtype": m["dtype"],
            "--shard-tokens": m.get("shard_tokens")}
    want = {"--layers": ",".join(map(str, layer_ids)), "--dtype": dtype_name, "--shard-tokens": cfg.shard_tokens}
    if opts is not None:  # caches written before options were recorded: not known
        have["--split"], want["--split"] = opts.get("split") or "all", cfg.split or "all"
        opts["allow_target_mismatch"] = bool(opts.get("allow_target_mismatch")) or cfg.allow_target_mismatch
    diff = [f"{k} {have[k]} (this run: {want[k]})" for k in have if have[k] is not None and have[k] != want[k]]
    if diff:
        raise DraftsmithError(f"cannot resume {out}: it was built with {', '.join(diff)}; resume it with "
                              f"`{rebuild_command(out, m, cfg.target)}`, or give a new --out")


def _record_target(m: dict, out: Path, cfg: CacheConfig, target) -> None:
    """Record how the target was named and the dtype it computes the features in; a resume that
    loads it in another dtype is refused (its features would differ from the cached ones)."""
    opts = m.get("options")
    if opts is None:  # a cache written before options were recorded: what built it is not known
        return
    name = str(target.model.dtype).removeprefix("torch.")
    if opts.get("model_dtype") not in (None, name):
        raise DraftsmithError(f"cannot resume {out}: its features were computed with the target in "
                              f"{opts['model_dtype']}, this run loads it in {name}; resume it with "
                              f"`{rebuild_command(out, m, cfg.target)}`, or give a new --out")
    opts["model_dtype"] = name
    opts["target"] = target.target_id if cfg.target in BUILTIN_TARGETS else str(target.path)


def _remove_cache_files(out: Path, remove_dir: bool) -> None:
    """Delete what this job writes (manifest, shards, temporaries); the directory too when this
    run created it and nothing else is in it."""
    for f in out.iterdir():
        if f.is_file() and (f.name == MANIFEST or f.name.startswith(("shard-", ".shard-", f".{MANIFEST}"))):
            f.unlink()
    if remove_dir and not any(out.iterdir()):
        out.rmdir()


def _drop_damaged_shards(out: Path, m: dict) -> None:
    """--resume: take every listed shard that is missing, truncated or has an unreadable header
    out of the manifest (and delete it), so that its samples are cached again by this run."""
    damaged = [(e, why) for e in m["shards"] if (why := shard_problem(out, e)) is not None]
    if not damaged:
        return
    for e, why in damaged:
        n = e["num_samples"]
        print(f"[draftsmith] cache: {out / e['file']} {why}; its {n} sample{'s' if n != 1 else ''} will be cached "
              "again", file=sys.stderr)
        (out / e["file"]).unlink(missing_ok=True)
    bad = {id(e) for e, _ in damaged}
    m["shards"] = [e for e in m["shards"] if id(e) not in bad]
    m["num_samples"] = sum(e["num_samples"] for e in m["shards"])
    m["num_tokens"] = sum(e["num_tokens"] for e in m["shards"])
    m["num_loss_tokens"] = 0
    for e in m["shards"]:  # the loss tokens per shard are not in the manifest: count the kept ones' masks
        with safe_open(str(out / e["file"]), "pt") as f:
            m["num_loss_tokens"] += int(f.get_tensor("loss_mask").sum())
    m["splits"] = {}
    for e in m["shards"]:
        for s in e["splits"]:
            m["splits"][s] = m["splits"].get(s, 0) + 1
    m["split"] = split_label(m["splits"])
    write_json_atomic(out / MANIFEST, m)


def _clean_strays(out: Path, m: dict) -> None:
    """Remove temp files and shards a killed run renamed but never listed in the manifest."""
    listed = {s["file"] for s in m["shards"]}
    for f in out.iterdir():
        if f.name.startswith(".shard-") or (f.name.startswith("shard-") and f.name not in listed):
            f.unlink()

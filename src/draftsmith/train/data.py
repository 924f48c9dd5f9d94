"""Training batches from the target feature cache (offline) or the target itself (online).

Items are windows of at most `data.max_len` tokens cut from training conversations (the
features were computed over the whole conversation, so a window loses nothing of the
target's context); windows without any loss token are dropped. Held-out conversations are
never used: a sample is skipped when its stored split is not "train" or when its id hashes
to the held-out split (data/sources `split_of`), whichever says so.

Order: epoch e is a permutation seeded by (seed, e) - of shards, then of windows within a
shard (offline: one shard in memory at a time), or of all windows (online). Step s reads
global batch s mod steps_per_epoch of epoch s div steps_per_epoch, so the data position is
a function of the step and resuming at step s replays exactly what an unbroken run reads.
Each global batch of `batch_size` windows is split into equal contiguous parts, one per
rank (the distributed sampler); the last incomplete batch of an epoch is dropped so every
rank takes the same number of steps.

A model may provide `target_stats` (drafters/protocol.py): per-position statistics of the frozen
target that its loss would otherwise recompute at every step. The trainer hands it to TrainData,
which computes them once per window, keeps them (12 bytes a token) and adds them to its batches.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.data.cache import FeatureCache, iter_records, rebuild_command, shard_problem
from draftsmith.data.features import FeatureSample, OnlineFeatures, record_tensors
from draftsmith.data.sources.conversation import split_of
from draftsmith.drafters.protocol import TrainBatch
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write
from draftsmith.models.registry import BUILTIN_TARGETS
from draftsmith.tensorfile import load_tensors, save_tensors
from draftsmith.train.config import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Window:
    """Tokens [start, end) of sample `sample` (offline: of shard `shard`)."""

    sample: int  # index in the source's sample list
    shard: int  # offline: shard index; online: 0
    start: int
    end: int


def windows_of(loss_mask: torch.Tensor, max_len: int) -> list[tuple[int, int]]:
    """Cut [0, T) into windows of max_len (the last one shifted back to be full); keep those with loss tokens."""
    T = int(loss_mask.shape[0])
    if T <= max_len:
        spans = [(0, T)]
    else:
        spans = [(s, s + max_len) for s in range(0, T - max_len + 1, max_len)]
        if spans[-1][1] < T:
            spans.append((T - max_len, T))
    return [(a, b) for a, b in spans if bool(loss_mask[a:b].any())]


def is_training_sample(sample_id: str, stored_split: str | None) -> bool:
    return (stored_split or "train") == "train" and split_of(sample_id) == "train"


def sample_split(sample_id: str, stored_split: str | None) -> str:
    """"train" only when both the stored split and the id's hash say so, else "heldout"."""
    return "train" if is_training_sample(sample_id, stored_split) else "heldout"


TargetStats = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor] | None"]


def collate(parts: Sequence[tuple[FeatureSample, int, int]], layer_ids: Sequence[int],
            device: torch.device | str = "cpu",
            stats: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> TrainBatch:
    """Right-pad windows into a TrainBatch (fresh float32 tensors: safe for autograd); `stats`:
    each window's target statistics (rest log-sum-exp [n], argmax [n]), if the model has them."""
    B = len(parts)
    T = max(b - a for _, a, b in parts)
    H = int(parts[0][0].final_hidden.shape[-1])
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    hidden = {i: torch.zeros(B, T, H, dtype=torch.float32) for i in layer_ids}
    final = torch.zeros(B, T, H, dtype=torch.float32)
    for r, (s, a, b) in enumerate(parts):
        n = b - a
        ids[r, :n] = s.input_ids[a:b]
        mask[r, :n] = s.loss_mask[a:b]
        lengths[r] = n
        for i in layer_ids:
            hidden[i][r, :n] = s.hidden[i][a:b]
        final[r, :n] = s.final_hidden[a:b]
    dev = torch.device(device)
    rest = top1 = None
    if stats is not None:
        rest = torch.zeros(B, T, dtype=torch.float32)
        top1 = torch.zeros(B, T, dtype=torch.long)
        for r, (lse, top) in enumerate(stats):
            rest[r, :lse.shape[0]] = lse
            top1[r, :top.shape[0]] = top
        rest, top1 = rest.to(dev), top1.to(dev)
    return TrainBatch(input_ids=ids.to(dev), loss_mask=mask.to(dev), lengths=lengths.to(dev),
                      hidden={i: h.to(dev) for i, h in hidden.items()}, final_hidden=final.to(dev),
                      target_rest_lse=rest, target_top1=top1)


class TrainData:
    """The training windows of a run and the deterministic, rank-split batch order."""

    def __init__(self, cfg: DataConfig, target, layer_ids: Sequence[int], seed: int, batch_size: int,
                 rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu",
                 split: str = "train") -> None:
        """`split="heldout"` reads the other side instead (held-out evaluation, train/evaluate.py)."""
        if batch_size % world_size:
            raise DraftsmithError(f"train.batch_size={batch_size} must be a multiple of the number of "
                                  f"processes ({world_size}); it is the global batch, split evenly")
        self.cfg = cfg
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.per_rank = self.batch_size // self.world_size
        self.device = torch.device(device)
        self.split = split
        self.excluded_heldout = 0  # samples of the other split skipped
        self._epoch_cache: tuple[int, list[Window]] | None = None
        # the model's per-position target statistics (set by the trainer), kept per window
        self.target_stats: TargetStats | None = None
        self._stats: dict[Window, tuple[torch.Tensor, torch.Tensor] | None] = {}
        if cfg.online:
            self._init_online(target)
        else:
            self._init_offline(target)
        if not self.windows:
            raise DraftsmithError(f"no {'training' if split == 'train' else 'held-out'} data: {self.source} has no "
                                  f"{split}-split samples with loss tokens ({self.excluded_heldout} of the other "
                                  "split excluded)")
        self.steps_per_epoch = len(self.windows) // self.batch_size
        if self.steps_per_epoch == 0:
            raise DraftsmithError(f"{self.source} gives {len(self.windows)} training windows, fewer than one "
                                  f"batch of train.batch_size={self.batch_size}; lower the batch size or add data")

    # ---- sources ------------------------------------------------------------------------

    def _init_offline(self, target) -> None:
        path = Path(self.cfg.cache)
        self.source = f"feature cache {path}"
        cache = FeatureCache(path)
        cache.validate(target_id=target.target_id, weights_hash=target.weights_hash,
                       legacy_hash=getattr(target, "legacy_weights_hash", None), layer_ids=self.layer_ids,
                       hidden_size=target.model.config.hidden_size)
        # how the rebuild command names the target: its alias, else its directory
        self._target_arg = (target.target_id if target.target_id in BUILTIN_TARGETS
                            else str(getattr(target, "path", target.target_id)))
        if not cache.manifest.get("complete", False):
            raise DraftsmithError(
                f"feature cache {path} is incomplete ({len(cache)} samples written before its `draftsmith cache` run "
                f"stopped); finish it with `{rebuild_command(path, cache.manifest, self._target_arg)}` before training"
            )
        if len(cache) == 0:
            raise DraftsmithError(f"feature cache {path} holds no samples; regenerate data and cache it again")
        self.cache = cache
        for entry in cache.manifest["shards"]:  # every shard's header and size, before any work
            why = shard_problem(path, entry)
            if why is not None:
                self._damaged(entry, why)
        self.samples: list[str] = []  # sample ids
        self.windows: list[Window] = []
        for si, entry in enumerate(cache.manifest["shards"]):
            with self._open_shard(entry) as f:  # only ids/masks: cheap
                offsets = f.get_tensor("offsets")
                loss_mask = f.get_tensor("loss_mask").bool()
            for k, sid in enumerate(entry["sample_ids"]):
                if self.cfg.max_samples is not None and len(self.samples) >= self.cfg.max_samples:
                    break
                if sample_split(sid, entry["splits"][k]) != self.split:
                    self.excluded_heldout += 1
                    continue
                a, b = int(offsets[k]), int(offsets[k + 1])
                self.samples.append(sid)
                for s, e in windows_of(loss_mask[a:b], self.cfg.max_len):
                    self.windows.append(Window(len(self.samples) - 1, si, s, e))
        self.shard_count = len(cache.manifest["shards"])

    def _damaged(self, entry: Mapping[str, Any], why: str) -> NoReturn:
        path = Path(self.cfg.cache)
        raise DraftsmithError(f"feature cache {path}: shard {entry['file']} {why}; re-make it with `"
                              f"{rebuild_command(path, self.cache.manifest, self._target_arg)}` (it caches the "
                              "samples of damaged shards again)")

    def _open_shard(self, entry: Mapping[str, Any]):
        """safe_open of a cache shard; a damaged one is a DraftsmithError that says how to re-make it."""
        try:
            return safe_open(str(Path(self.cfg.cache) / entry["file"]), "pt")
        except (SafetensorError, OSError) as e:
            self._damaged(entry, f"is unreadable ({' '.join(str(e).split())})")

    def _init_online(self, target) -> None:
        path = Path(self.cfg.regen)
        self.source = f"regen data {path}"
        self.records: list[Mapping[str, Any]] = []
        self.windows = []
        for rec in iter_records(path):
            if self.cfg.max_samples is not None and len(self.records) >= self.cfg.max_samples:
                break
            if sample_split(str(rec["id"]), rec.get("split")) != self.split:
                self.excluded_heldout += 1
                continue
            _, mask = record_tensors(rec)
            if mask.shape[0] > target.model.config.max_position_embeddings:
                log.warning("skipping %s: %d tokens exceed the target context", rec["id"], mask.shape[0])
                continue
            self.records.append(rec)
            for s, e in windows_of(mask, self.cfg.max_len):
                self.windows.append(Window(len(self.records) - 1, 0, s, e))
        self.online = OnlineFeatures(target, layer_ids=self.layer_ids)
        self.shard_count = 1

    # ---- order --------------------------------------------------------------------------

    def epoch_order(self, epoch: int) -> list[Window]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        rng = random.Random(self.seed * 1_000_003 + epoch)
        by_shard: dict[int, list[Window]] = {}
        for w in self.windows:
            by_shard.setdefault(w.shard, []).append(w)
        shards = sorted(by_shard)
        rng.shuffle(shards)
        order: list[Window] = []
        for s in shards:
            ws = list(by_shard[s])
            rng.shuffle(ws)
            order.extend(ws)
        self._epoch_cache = (epoch, order)
        return order

    def position(self, step: int) -> dict[str, int]:
        """Where global step `step` reads: epoch, batch within the epoch, windows consumed before it."""
        return {"epoch": step // self.steps_per_epoch, "batch": step % self.steps_per_epoch,
                "windows_seen": step * self.batch_size}

    def rank_windows(self, step: int) -> list[Window]:
        pos = self.position(step)
        order = self.epoch_order(pos["epoch"])
        g = order[pos["batch"] * self.batch_size: (pos["batch"] + 1) * self.batch_size]
        return g[self.rank * self.per_rank: (self.rank + 1) * self.per_rank]

    # ---- batches ------------------------------------------------------------------------

    def batch(self, step: int) -> TrainBatch:
        """This rank's part of global batch `step`."""
        return self.collate_windows(self.rank_windows(step))

    def collate_windows(self, ws: Sequence[Window]) -> TrainBatch:
        """A TrainBatch of the given windows (features from the cache, or the target online)."""
        if self.cfg.online:
            need = sorted({w.sample for w in ws})
            feats: dict[int, FeatureSample] = {}
            for i in range(0, len(need), self.cfg.online_batch):
                chunk = need[i: i + self.cfg.online_batch]
                for idx, fs in zip(chunk, self.online.batch([self.records[j] for j in chunk])):
                    feats[idx] = fs
            parts = [(feats[w.sample], w.start, w.end) for w in ws]
        else:
            parts = [(self.cache.features(self.samples[w.sample]), w.start, w.end) for w in ws]
        stats = None
        if self.target_stats is not None:
            stats = [self._window_stats(w, fs) for w, (fs, _, _) in zip(ws, parts)]
            stats = None if any(x is None for x in stats) else stats
        return collate(parts, self.layer_ids, self.device, stats)

    def prepare_stats(self, fn: TargetStats, windows: Sequence[Window] | None = None, every: int = 0,
                      log_fn: Callable[[str], None] | None = None, store: Path | None = None,
                      key: str = "", save: bool = True) -> int:
        """Use `fn` as the model's target statistics and compute them now for `windows` (default:
        all; a step then costs the same from the first one, so the trainer's budget probe times
        steady steps; online, each window's come with its features, on first use). Returns the
        windows computed; `log_fn` hears every `every` windows.

        `store`: a file that keeps them for a resumed run (the full-vocabulary lm_head over every
        window again cost each resume of a 1,000-window DSpark run ~4 CPU minutes). It is used
        when it was written for the same `key` (what `fn` depends on: the caller's) and the same
        windows, and when its first and last windows equal a fresh computation bit for bit;
        otherwise everything is computed again and (`save`) the file rewritten."""
        self.target_stats = fn
        self._stats.clear()  # a new function (a restored draft vocabulary): nothing kept holds
        if self.cfg.online:  # features come from a target forward per batch: computed with them, on first use
            return 0
        todo = list(self.windows if windows is None else windows)
        digest = None if store is None else self._windows_digest(todo, key)
        if digest is not None and self._load_stats(store, todo, digest, log_fn):
            return 0
        # one buffer for all windows: thousands of small survivors allocated between each window's
        # short-lived logits pinned glibc's heap (a DSpark run on an 8.3 GB cache grew to 12 GB RSS)
        n = sum(w.end - w.start for w in todo)
        lse_all, top_all = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.long)
        off = 0
        complete = True
        for done, w in enumerate(todo, 1):  # shard by shard, as they were listed
            got = self._compute_stats(w, self.cache.features(self.samples[w.sample]))
            if got is None:
                self._stats[w] = None
                complete = False
            else:
                k = w.end - w.start
                lse, top = lse_all[off:off + k], top_all[off:off + k]
                lse.copy_(got[0])
                top.copy_(got[1])
                self._stats[w] = (lse, top)
                off += k
            if log_fn is not None and every and done % every == 0:
                log_fn(f"target statistics: {done}/{len(todo)} windows")
        if digest is not None and save and complete and todo:
            atomic_write(Path(store), lambda p: save_tensors(p, {"rest_lse": lse_all, "top1": top_all},
                                                             {"windows": digest, "count": str(len(todo))}))
        return len(todo)

    def _windows_digest(self, todo: Sequence[Window], key: str) -> str:
        h = hashlib.sha256(key.encode())
        for w in todo:
            h.update(f"|{self.samples[w.sample]}:{w.start}:{w.end}".encode())
        return h.hexdigest()

    def _load_stats(self, store: Path, todo: Sequence[Window], digest: str,
                    log_fn: Callable[[str], None] | None) -> bool:
        """Fill the statistics of `todo` from `store` (prepare_stats); False when it does not hold them."""
        store = Path(store)
        if not store.is_file() or not todo:
            return False

        def no(why: str) -> bool:
            if log_fn is not None:
                log_fn(f"target statistics in {store.name} not used ({why}); computing them again")
            return False

        try:
            with safe_open(str(store), "pt") as f:
                if (f.metadata() or {}).get("windows") != digest:
                    return no("written for other windows, another target or another draft vocabulary")
            t = load_tensors(store, "target statistics file")
            lse_all, top_all = t["rest_lse"], t["top1"]
        except (DraftsmithError, SafetensorError, KeyError, OSError) as e:
            return no(" ".join(str(e).split()))
        spans, off = [], 0
        for w in todo:
            spans.append((off, off + w.end - w.start))
            off = spans[-1][1]
        if off != lse_all.shape[0] or off != top_all.shape[0]:
            return no("sizes differ")
        for i in sorted({0, len(todo) - 1}):  # the function still gives what the file holds
            w, (a, b) = todo[i], spans[i]
            got = self._compute_stats(w, self.cache.features(self.samples[w.sample]))
            if got is None or not (torch.equal(got[0].float().cpu(), lse_all[a:b])
                                   and torch.equal(got[1].long().cpu(), top_all[a:b])):
                return no("they differ from a fresh computation")
        for w, (a, b) in zip(todo, spans):
            self._stats[w] = (lse_all[a:b], top_all[a:b])
        if log_fn is not None:
            log_fn(f"target statistics of {len(todo)} windows read from {store.name} (checked against a fresh "
                   "computation of two)")
        return True

    def _compute_stats(self, w: Window, fs: FeatureSample) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.target_stats(fs.final_hidden[w.start:w.end].to(self.device, torch.float32))

    def _window_stats(self, w: Window, fs: FeatureSample) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The model's target statistics of window `w`, computed on its first use."""
        if w not in self._stats:
            got = self._compute_stats(w, fs)
            self._stats[w] = None if got is None else (got[0].float().cpu(), got[1].long().cpu())
        return self._stats[w]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] int64 counts of the tokens the drafter learns to predict (loss-masked positions)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        if self.cfg.online:
            for rec in self.records:
                ids, mask = record_tensors(rec)
                counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
            return counts

        wanted = set(self.samples)
        for entry in self.cache.manifest["shards"]:
            with self._open_shard(entry) as f:
                offsets, ids, mask = f.get_tensor("offsets"), f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            for k, sid in enumerate(entry["sample_ids"]):
                if sid in wanted:
                    a, b = int(offsets[k]), int(offsets[k + 1])
                    counts += torch.bincount(ids[a:b][mask[a:b]], minlength=vocab_size)[:vocab_size]
        return counts

    def describe(self) -> dict[str, Any]:
        n_tok = sum(w.end - w.start for w in self.windows)
        return {"source": self.source, "samples": len(self.samples if not self.cfg.online else self.records),
                "windows": len(self.windows), "window_tokens": n_tok, "excluded_heldout": self.excluded_heldout,
                "steps_per_epoch": self.steps_per_epoch, "batch_size": self.batch_size, "world_size": self.world_size}

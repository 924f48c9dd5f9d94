"""The feature-cache reader: `FeatureCache`, one shard in memory at a time, checksummed."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.data.cache_format import manifest_view, read_manifest, rebuild_command
from draftsmith.data.features import FeatureSample, check_compatible, store_dtype
from draftsmith.data.safetensors_stream import file_sha256
from draftsmith.errors import DraftsmithError

log = logging.getLogger("draftsmith.data.cache")  # the name it had before the split from cache.py


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
                 layer_ids: Sequence[int] | None = None, hidden_size: int | None = None,
                 legacy_hash: str | None = None) -> "FeatureCache":
        """Check the cache against what the consumer needs; keeps only the requested layers."""
        check_compatible(f"feature cache {self.path}", manifest_view(self.manifest), target_id,
                         weights_hash, layer_ids, hidden_size, legacy_hash)
        if layer_ids is not None:
            self.layer_ids = tuple(int(i) for i in layer_ids)
        return self

    def load_shard(self, index: int) -> dict[str, torch.Tensor]:
        if self._loaded is not None and self._loaded[0] == index:
            return self._loaded[1]
        entry = self.manifest["shards"][index]
        f = self.path / entry["file"]
        remake = f"re-make it with `{rebuild_command(self.path, self.manifest)}`"
        if not f.is_file():
            raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} is missing; {remake}")
        if self.verify and entry["file"] not in self._verified:
            got = file_sha256(f)
            if got != entry["sha256"]:
                raise DraftsmithError(
                    f"feature cache {self.path}: shard {entry['file']} is corrupt (sha256 {got[:16]}… "
                    f"!= manifest {entry['sha256'][:16]}…); delete that file and {remake}")
            self._verified.add(entry["file"])
        self._loaded = None  # drop the previous shard before loading the next
        try:
            tensors = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftsmithError(f"feature cache {self.path}: shard {entry['file']} is unreadable "
                                  f"({' '.join(str(e).split())}); delete that file and {remake}") from None
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

"""Target features for drafter training: one interface, offline (disk cache) or online.

A drafter learns from the target's own hidden states at every token of a regenerated
conversation. Two providers give the same `FeatureSample` for a regenerated record:

    FeatureCache(dir)              reads `draftsmith cache` shards (see data/cache.py)
    OnlineFeatures(target, layers) runs the target on the fly, for when the cache would be
                                   too big for the disk

Both are validated the same way against what the consumer needs (target id + weights hash,
layer ids, hidden size) and both compute features with `FeatureExtractor`, so the numbers
agree up to the storage dtype.

Layer ids are 0-based decoder-layer indices: layer i's output is HF's `hidden_states[i + 1]`.
`final_hidden` is the state after the final norm (the lm_head input).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import same_weights
from draftsmith.models.target import load_target

STORE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def store_dtype(name: str) -> torch.dtype:
    if name not in STORE_DTYPES:
        raise DraftsmithError(f"unknown feature dtype {name!r}; choose fp16, bf16 or fp32")
    return STORE_DTYPES[name]


def default_layer_ids(num_layers: int, n: int = 3) -> tuple[int, ...]:
    """EAGLE-3 / DFlash / DSpark-style spread of `n` feature layers (low, ..., high).

    Layers are spread evenly over [1, L-3] (DFlash's default range; for n = 3 this is
    EAGLE-3's low / middle / high choice, e.g. 1, 14, 27 for a 30-layer target). Very
    shallow models (L <= 3) use [0, L-1]. Duplicates are removed, so tiny models may get
    fewer than n layers.
    """
    if num_layers <= 0:
        raise DraftsmithError(f"a target needs at least one layer, got {num_layers}")
    if n <= 0:
        raise DraftsmithError(f"need at least one feature layer, got n={n}")
    lo, hi = (1, num_layers - 3) if num_layers > 4 else (0, num_layers - 1)
    if n == 1:
        return ((lo + hi) // 2,)
    return tuple(sorted({int(lo + k * (hi - lo) / (n - 1) + 0.5) for k in range(n)}))


def spelled_layer_ids(spec: str | Sequence[int] | None, flag: str = "--layers") -> list[int] | None:
    """The ids '1,15,27' (or a sequence) spells, in its order; None for None / '' / 'default'
    (`default_layer_ids`). The spelling only, so a job can refuse a bad `flag` value before the
    target loads; `parse_layer_ids` checks the ids against the target's depth."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "default")):
        return None
    if not isinstance(spec, str):
        ids = [int(x) for x in spec]
        if not ids:
            raise DraftsmithError("no feature layers given")
        return ids
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise DraftsmithError(f"{flag} expects comma-separated 0-based layer ids, e.g. 1,14,27 (or default), "
                              f"got {spec!r}")
    return ids


def parse_layer_ids(spec: str | Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """'1,15,27' (or a sequence, or None / 'default' for `default_layer_ids`) -> sorted ids."""
    ids = spelled_layer_ids(spec)
    if ids is None:
        return default_layer_ids(num_layers)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise DraftsmithError(
            f"layer ids {bad} are out of range: the target has {num_layers} layers (ids 0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids):
        raise DraftsmithError(f"layer ids repeat: {ids}")
    return tuple(sorted(ids))


@dataclass
class FeatureSample:
    """Target features of one regenerated conversation.

    input_ids:    [T] int64, the templated token ids (as in the regen record)
    loss_mask:    [T] bool, True on tokens the target generated (assistant turns)
    hidden:       layer id -> [T, H] decoder-layer outputs
    final_hidden: [T, H] normed last hidden state (lm_head input)
    """

    id: str
    split: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "split": self.split, "input_ids": self.input_ids,
                "loss_mask": self.loss_mask, "hidden": self.hidden, "final_hidden": self.final_hidden}


@runtime_checkable
class FeatureProvider(Protocol):
    """What a trainer needs from a feature source, offline or online."""

    target_id: str
    weights_hash: str
    layer_ids: tuple[int, ...]
    hidden_size: int

    def validate(self, target_id: str | None = None, weights_hash: str | None = None,
                 layer_ids: Sequence[int] | None = None, hidden_size: int | None = None) -> Any: ...

    def features(self, sample: Mapping[str, Any] | str) -> FeatureSample: ...


def check_compatible(what: str, have: Mapping[str, Any], target_id: str | None, weights_hash: str | None,
                     layer_ids: Sequence[int] | None, hidden_size: int | None, legacy_hash: str | None = None) -> None:
    """Raise a DraftsmithError naming every mismatch between `have` and what is asked for."""
    problems = []
    if target_id is not None and target_id != have["target_id"]:
        problems.append(f"target is {have['target_id']!r}, expected {target_id!r}")
    if weights_hash is not None and same_weights(have["weights_hash"], weights_hash, legacy_hash) is False:
        problems.append(f"target weights hash is {have['weights_hash']}, expected {weights_hash} "
                        "(the checkpoint changed since the features were made)")
    if hidden_size is not None and int(hidden_size) != int(have["hidden_size"]):
        problems.append(f"hidden size is {have['hidden_size']}, expected {hidden_size}")
    if layer_ids is not None:
        missing = sorted(set(int(i) for i in layer_ids) - set(have["layer_ids"]))
        if missing:
            problems.append(f"layers {list(have['layer_ids'])} lack the requested {missing}")
    if problems:
        raise DraftsmithError(f"{what} does not match: " + "; ".join(problems)
                              + ". Rebuild it for this target / layer set (draftsmith cache ...)")


class FeatureExtractor:
    """Runs the target over whole conversations and returns per-token features.

    Long sequences are processed in chunks of `chunk_tokens` through a KV cache (a chunked
    prefill), so activation memory is bounded by the chunk, not the sequence. The KV cache
    is reused between calls and only grows to the longest batch seen.
    """

    def __init__(self, model, layer_ids: Sequence[int], chunk_tokens: int = 1024) -> None:
        self.model = model
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.chunk_tokens = int(chunk_tokens)
        self.max_len = int(model.config.max_position_embeddings)
        self._cache = None
        L = model.config.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i < L]
        if bad:
            raise DraftsmithError(f"layer ids {bad} out of range for a {L}-layer target")

    def _kv(self, rows: int, length: int):
        c = self._cache
        if c is None or c.max_rows < rows or c.max_len < length:
            self._cache = None  # free the old one before allocating the new one
            c = self._cache = self.model.new_cache(max(rows, c.max_rows if c else 0),
                                                   max(length, c.max_len if c else 0))
        c.lengths.zero_()
        return c

    @torch.inference_mode()
    def __call__(self, batch: Sequence[Sequence[int]], out_dtype: torch.dtype | None = None,
                 out_device: torch.device | str | None = "cpu") -> list[tuple[dict[int, torch.Tensor], torch.Tensor]]:
        """Per sequence: ({layer id: [T, H]}, final [T, H]) in `out_dtype` (default: the model's) on
        `out_device` (None: the model's device)."""
        if not batch:
            return []
        lens = [len(x) for x in batch]
        if min(lens) == 0:
            raise DraftsmithError("cannot compute features of an empty sequence")
        S = max(lens)
        if S > self.max_len:
            raise DraftsmithError(f"sequence of {S} tokens exceeds the target's context of {self.max_len}")
        B = len(batch)
        ids = torch.zeros(B, S, dtype=torch.long)
        for b, x in enumerate(batch):  # right padding: causal attention keeps real tokens exact
            ids[b, : lens[b]] = torch.as_tensor(list(x), dtype=torch.long)
        cache = self._kv(B, S)
        rows = torch.arange(B)
        hid: dict[int, list[torch.Tensor]] = {i: [] for i in self.layer_ids}
        fin: list[torch.Tensor] = []
        dt = out_dtype or self.model.dtype
        dev = self.model.device if out_device is None else out_device
        for s0 in range(0, S, self.chunk_tokens):
            chunk = ids[:, s0 : s0 + self.chunk_tokens]
            out = self.model(chunk, cache, rows=rows, layer_ids=self.layer_ids, compute_logits=False)
            cache.lengths[:B] += chunk.shape[1]
            for i in self.layer_ids:
                hid[i].append(out.hidden[i].to(dev, dt))
            fin.append(out.final_hidden.to(dev, dt))
        hidden = {i: torch.cat(v, dim=1) if len(v) > 1 else v[0] for i, v in hid.items()}
        final = torch.cat(fin, dim=1) if len(fin) > 1 else fin[0]
        return [({i: h[b, : lens[b]] for i, h in hidden.items()}, final[b, : lens[b]]) for b in range(B)]


def record_tensors(record: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [T] int64, loss_mask [T] bool) of a regen record, checked."""
    try:
        ids, mask = record["input_ids"], record["loss_mask"]
    except KeyError as e:
        raise DraftsmithError(f"record {record.get('id', '?')!r} lacks {e.args[0]!r}; "
                              "expected a `draftsmith regen` record") from None
    if len(ids) != len(mask) or not ids:
        raise DraftsmithError(f"record {record.get('id', '?')!r}: input_ids ({len(ids)}) and "
                              f"loss_mask ({len(mask)}) must be non-empty and equally long")
    return torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask, dtype=torch.bool)


class OnlineFeatures:
    """The feature interface computed on the fly from the target (no disk cache).

    `target` is a LoadedTarget or a target name/path. `dtype` ("fp16" / "bf16" / "fp32")
    casts features like the cache would store them; None keeps the model's dtype. Features
    stay on the target's device (a GPU trainer gets GPU tensors); `out_device="cpu"` moves them.
    """

    def __init__(self, target, layer_ids: Sequence[int] | str | None = None, dtype: str | None = None,
                 device: str | None = None, chunk_tokens: int = 1024,
                 out_device: torch.device | str | None = None) -> None:
        if isinstance(target, str):
            target = load_target(target, device=device)
        self.target = target
        cfg = target.model.config
        self.target_id = target.target_id
        self.weights_hash = target.weights_hash
        self.hidden_size = cfg.hidden_size
        self.layer_ids = parse_layer_ids(layer_ids, cfg.num_layers)
        self.out_dtype = store_dtype(dtype) if dtype else None
        self.extractor = FeatureExtractor(target.model, self.layer_ids, chunk_tokens)
        self.out_device = out_device

    def validate(self, target_id: str | None = None, weights_hash: str | None = None,
                 layer_ids: Sequence[int] | None = None, hidden_size: int | None = None) -> "OnlineFeatures":
        have = {"target_id": self.target_id, "weights_hash": self.weights_hash,
                "layer_ids": self.layer_ids, "hidden_size": self.hidden_size}
        check_compatible(f"online target features ({self.target_id})", have, target_id, weights_hash,
                         layer_ids, hidden_size)
        return self

    def features(self, sample: Mapping[str, Any] | str) -> FeatureSample:
        if isinstance(sample, str):
            raise DraftsmithError("online features need the regenerated record (with input_ids), not an id")
        return self.batch([sample])[0]

    __call__ = features

    def batch(self, records: Sequence[Mapping[str, Any]]) -> list[FeatureSample]:
        """Features of several records in one (right-padded) target forward."""
        tensors = [record_tensors(r) for r in records]
        outs = self.extractor([ids.tolist() for ids, _ in tensors], self.out_dtype, self.out_device)
        dev = outs[0][1].device if outs else None
        tensors = [(ids.to(dev), mask.to(dev)) for ids, mask in tensors]
        return [
            FeatureSample(id=str(r.get("id", "")), split=str(r.get("split", "")), input_ids=ids,
                          loss_mask=mask, hidden=h, final_hidden=f)
            for r, (ids, mask), (h, f) in zip(records, tensors, outs)
        ]

    def iter_samples(self, records: Iterable[Mapping[str, Any]], batch_size: int = 1) -> Iterator[FeatureSample]:
        buf: list[Mapping[str, Any]] = []
        for r in records:
            buf.append(r)
            if len(buf) >= batch_size:
                yield from self.batch(buf)
                buf = []
        if buf:
            yield from self.batch(buf)

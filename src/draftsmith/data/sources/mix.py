"""Named mixes of sources: "code:0.4,chat:0.6" -> a deterministic list of conversations.

How samples are drawn, and why:
- Within a source, conversations are ranked by sha256(seed, id): a seeded shuffle that needs
  no RNG state and does not depend on file order or on which other sources are in the mix.
  Only the best `max_samples` per source are kept while streaming (a bounded heap).
- An alias's members are interleaved round-robin, so a small member (HumanEval inside
  `code`) is used in full before a large one (stdlib) takes over.
- Quotas are proportional to the weights (largest remainder, so they sum exactly to
  `max_samples`). When a source has fewer samples than its quota, the shortfall is shared
  by the others in proportion to their weights ("water-filling"); with `max_samples=None`
  every source contributes everything it has and weights only matter for the ordering.
- The output interleaves sources so that any prefix is in proportion too. No sample is
  drawn twice: no replacement, and a source may appear only once per mix.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import zip_longest

from draftsmith.data.sources.base import Source
from draftsmith.data.sources.conversation import SPLITS, Conversation, Split
from draftsmith.data.sources.files import OnError
from draftsmith.data.sources.registry import resolve_source, source_key
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixEntry:
    """One `name:weight` term of a mix; name is a source, alias or prompt-file path."""

    name: str
    weight: float


def parse_mix(spec: str) -> tuple[MixEntry, ...]:
    """Parse "name:weight,name:weight"; a bare name has weight 1. Paths may not contain ','."""
    entries: list[MixEntry] = []
    for term in spec.split(","):
        term = term.strip()
        if not term:
            raise DraftsmithError(f"empty term in mix {spec!r}; expected 'name:weight,...'")
        name, sep, raw_weight = term.rpartition(":")
        if not sep:
            name, raw_weight = term, "1"
        try:
            weight = float(raw_weight)
        except ValueError:
            raise DraftsmithError(f"bad weight {raw_weight!r} for {name.strip()!r} in mix "
                                  f"{spec!r}; weights are non-negative numbers") from None
        entries.append(MixEntry(name.strip(), weight))
    return validate_mix(entries)


def validate_mix(entries: Iterable[MixEntry]) -> tuple[MixEntry, ...]:
    """Check names and weights: finite, non-negative, each name once, positive total."""
    entries = tuple(entries)
    for index, entry in enumerate(entries):
        if not entry.name:
            raise DraftsmithError(f"mix term {index + 1} has no source name")
        if not math.isfinite(entry.weight) or entry.weight < 0:
            raise DraftsmithError(f"bad weight {entry.weight!r} for {entry.name!r}; weights are "
                                  "finite and non-negative")
        if any(e.name == entry.name for e in entries[:index]):
            raise DraftsmithError(f"{entry.name!r} appears twice in the mix")
    if sum(e.weight for e in entries) <= 0:
        raise DraftsmithError(f"mix {_describe(entries) or '(empty)'} has no positive weight; "
                              "give at least one source a weight > 0")
    return entries


def _rank(seed: int, conversation_id: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{conversation_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def _first_ranked(conversations: Iterable[Conversation], seed: int,
                  limit: int | None) -> list[Conversation]:
    """The `limit` lowest-ranked conversations in rank order, holding at most `limit`."""
    if limit is None:
        return sorted(conversations, key=lambda c: (_rank(seed, c.id), c.id))
    heap: list[tuple[int, str, Conversation]] = []  # max-heap on rank via negation
    for conversation in conversations:
        item = (-_rank(seed, conversation.id), conversation.id, conversation)
        if len(heap) < limit:
            heapq.heappush(heap, item)
        elif item[:2] > heap[0][:2]:
            heapq.heapreplace(heap, item)
    return [c for _, _, c in sorted(heap, key=lambda t: (-t[0], t[1]))]


def _round_robin(lists: Sequence[list[Conversation]]) -> list[Conversation]:
    return [c for group in zip_longest(*lists) for c in group if c is not None]


def _quotas(weights: Sequence[float], available: Sequence[int], total: int | None) -> list[int]:
    """Integer quotas ∝ weights, capped by availability, summing to min(total, Σ available)."""
    if total is None:
        return [a if w > 0 else 0 for w, a in zip(weights, available)]
    quotas = [0] * len(weights)
    open_ = [i for i, w in enumerate(weights) if w > 0]
    remaining = total
    while open_:  # water-filling: fix sources that cannot meet their share, re-share the rest
        weight_sum = sum(weights[i] for i in open_)
        short = [i for i in open_ if available[i] <= remaining * weights[i] / weight_sum]
        if not short:
            break
        for i in short:
            quotas[i] = available[i]
            remaining -= available[i]
        open_ = [i for i in open_ if i not in short]
    if open_:
        weight_sum = sum(weights[i] for i in open_)
        exact = {i: remaining * weights[i] / weight_sum for i in open_}
        for i in open_:
            quotas[i] = math.floor(exact[i])
        leftover = remaining - sum(quotas[i] for i in open_)
        by_remainder = sorted(open_, key=lambda i: (-(exact[i] - quotas[i]), i))
        for i in by_remainder[:leftover]:
            quotas[i] += 1
    return quotas


def _interleave(picked: Sequence[list[Conversation]]) -> list[Conversation]:
    """Merge so that every prefix holds each source in proportion to its quota."""
    keyed = [((j + 0.5) / len(items), i, j, c)
             for i, items in enumerate(picked) for j, c in enumerate(items)]
    return [c for *_, c in sorted(keyed, key=lambda t: t[:3])]


def _resolve_entries(entries: Sequence[MixEntry], on_error: OnError) -> list[tuple[Source, ...]]:
    owner: dict[str, str] = {}
    resolved = []
    for entry in entries:
        sources = resolve_source(entry.name, on_error=on_error)
        for source in sources:
            key = source_key(source)
            if key in owner:
                raise DraftsmithError(f"source {source.name!r} is in both {owner[key]!r} and "
                                      f"{entry.name!r}; a mix may use each source once")
            owner[key] = entry.name
        resolved.append(sources)
    return resolved


def load_mix(spec: str | Sequence[MixEntry], split: Split = "train",
             max_samples: int | None = None, seed: int = 0, *,
             on_error: OnError = "raise") -> list[Conversation]:
    """Draw a deterministic, duplicate-free list of conversations from a weighted mix.

    Same spec, split, max_samples and seed give the same list on any machine (for the same
    Python version, which decides the stdlib-code set).
    """
    entries = parse_mix(spec) if isinstance(spec, str) else validate_mix(spec)
    if split not in SPLITS:
        raise DraftsmithError(f"split must be one of {SPLITS}, got {split!r}")
    if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                    or max_samples < 0):
        raise DraftsmithError(f"max_samples must be a non-negative integer or None, got {max_samples!r}")
    resolved = _resolve_entries(entries, on_error)
    candidates: list[list[Conversation]] = []
    for entry, sources in zip(entries, resolved):
        if entry.weight == 0 or max_samples == 0:
            candidates.append([])
            continue
        members = [_first_ranked(s.conversations(split), seed, max_samples) for s in sources]
        candidates.append(_round_robin(members))
    quotas = _quotas([e.weight for e in entries], [len(c) for c in candidates], max_samples)
    result = _interleave([c[:q] for c, q in zip(candidates, quotas)])
    if not result and max_samples != 0:
        raise DraftsmithError(
            f"mix {_describe(entries)} has no {split} conversations: check the file or source names "
            "(a JSONL line needs 'prompt' or 'messages'), or use --split"
        )
    if max_samples is not None and len(result) < max_samples:
        log.warning("mix %s (%s) has only %d conversations, fewer than max_samples=%d",
                    _describe(entries), split, len(result), max_samples)
    _check_unique(result)
    return result


def _describe(entries: Iterable[MixEntry]) -> str:
    return ",".join(f"{e.name}:{e.weight:g}" for e in entries)


def _check_unique(conversations: Iterable[Conversation]) -> None:
    seen: set[str] = set()
    for conversation in conversations:
        if conversation.id in seen:
            raise DraftsmithError(f"two sources in the mix produce the id {conversation.id!r}; "
                                  "rename one of the prompt files")
        seen.add(conversation.id)

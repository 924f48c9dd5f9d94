"""The per-request queue of target features a context-cache drafter has not consumed yet,
and the request lifecycle built on it (DFlash / DSpark: block_drafter.py; EAGLE-3: eagle3.py).

Such a drafter keeps, per engine row, a cache computed from the target features of the
committed tokens; once the row drafts it covers num_tokens − 1 positions (the engine's
invariant: the last token is pending and has no features yet). Features arrive at prefill
(`start`: the prompt's) and after every round (`on_verified`: the committed positions only —
rejected drafts never enter, so there is nothing to roll back). They wait in the request's
`QueuedFeatures` and are consumed lazily, when the row next drafts or when the queues outgrow
their bounds (`flush_tokens` positions in a row, `queue_bytes` in all): the rows admitted in one
engine step go through the drafter in one batch, and rounds a load-aware policy does not draft
pay no drafter upkeep.

Automatic prefix caching (engine/prefix_cache.py). A drafter whose context positions depend on
the row's tokens and features up to a fixed distance sets `follows_prefix_cache`: a leaving
request's row keeps its context and its still-queued features (`_Kept`, with the token ids they
belong to), and a request the engine places in that row with a reused prefix of n tokens starts
from the first n of them. DFlash / DSpark: a context position is that position's features
projected (the draft layers' keys / values there). EAGLE-3: context position j pairs the features
of j with token j + 1, so the engine stops a reuse one position short of the matched prefix
(`FeatureSpec.reuse_margin`): every reused position's next token is then shared, the target
recomputes the position after them, and the first new position's features set the drafter's last
hidden state. The engine matches a new prompt against what both hold (`held_ids`), so a row whose
kept queue was dropped to bound memory, or whose target KV another engine rewrote, is reused only
as far as the drafter can follow. Keeping costs no compute: the queued features of a row that
never drafted stay queued, as they did while it ran.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from draftsmith.core.request import Request
from draftsmith.drafters.base import DrafterRequestState, RequestStates, TargetFeatures, drafter_generator
from draftsmith.errors import DraftsmithError
from draftsmith.models.kv_cache import KVCache

# Queued positions are consumed when their row next drafts. Until then a row that does not
# draft costs its drafter nothing: at high concurrency the scheduler keeps drafting off, and
# consuming each new request's prompt anyway cost a batch-32 server ~3-4% of its decode rate
# (measured at 64 tokens per request, HumanEval prompts of 100-280 tokens). Deferring never adds
# work (a row that drafts later consumes the same positions then; one that finishes first never
# does), it only holds memory (~7 KB per position for three 576-wide float32 layers), so the
# queues are bounded twice: all rows together by QUEUE_BYTES (past it, the longest queues are
# consumed until the rows hold half of it) and one row by FLUSH_TOKENS positions. Consuming is a
# per-token cost, not a per-round one: `consumed_s` lets the engine keep a backlog (a prompt, the
# positions of rounds that did not draft) out of the drafting time the prefix scheduler's cost
# model learns (a prompt's worth of context inside one round's draft time made drafting look dear
# and switched it off at batch 1). A flush whose rows hold at most STEADY_TOKENS positions each (the
# last round's commits of a row that drafts every round, or a few rounds that did not draft) is a
# cost of drafting this round, not counted in `consumed_s` (at 4 rows on a 2-core Zen 3, ~1.5 ms of
# a ~50 ms drafting round, which the cost model did not see before; BENCHMARKS.md, stop 60).
FLUSH_TOKENS = 2048
QUEUE_BYTES = 128 << 20
STEADY_TOKENS = 16


def backlog(counts: Sequence[int]) -> int:
    """Of the queued positions of the rows one flush consumes (`counts`), those that are a backlog:
    all of them when a row holds more than STEADY_TOKENS, else none (a drafting row's upkeep)."""
    return sum(counts) if any(c > STEADY_TOKENS for c in counts) else 0


@contextmanager
def consuming(drafter, positions: int, device: torch.device) -> Iterator[None]:
    """Time the block as the consumption of a backlog of `positions` (from `backlog`): its wall time
    and count go to the drafter's `consumed_s` / `consumed_positions` when positions > 0 (on CUDA
    synchronised around it: a backlog's kernels, not their launch)."""
    timed = positions and device.type == "cuda"
    if timed:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if positions:
            if timed:
                torch.cuda.synchronize(device)
            drafter.consumed_s += time.perf_counter() - t0
            drafter.consumed_positions += positions


def owned(h: torch.Tensor) -> torch.Tensor:
    """h itself when it is the whole of its storage, else a copy. A queued slice of a round's
    features ([B, S, H], or a batched prefill's padded rows) would keep the whole tensor alive
    until its row consumes it: a row that lives for many rounds beside short ones would then hold
    up to B times the bytes its queue counts, and the bounds above would not bound memory."""
    if h.untyped_storage().nbytes() == h.numel() * h.element_size():
        return h
    return h.clone()


@dataclass
class QueuedFeatures:
    """One request's target features not yet in its drafter's cache, oldest first."""

    # a reused prefix's positions the request before had queued (prefix caching): layer id → [n, H]
    reused: dict[int, torch.Tensor] | None = None
    prefill: dict[int, torch.Tensor] | None = None  # the prompt's: layer id → [1, S, H]
    rounds: list[dict[int, torch.Tensor]] = field(default_factory=list)  # committed: {layer id: [n, H]} per round
    n: int = 0  # positions queued (reused + prompt + rounds), kept as they come: count() is asked every round
    bytes: int = 0  # what they hold, kept the same way

    @staticmethod
    def of_prompt(features: TargetFeatures | None) -> "QueuedFeatures":
        """The queue of a new request: its prompt features (none for a one-token prompt)."""
        q = QueuedFeatures()
        if features is not None and features.hidden:
            n = int(next(iter(features.hidden.values())).shape[1])
            if n:
                q.prefill, q.n = {i: owned(h) for i, h in features.hidden.items()}, n
                q.bytes = sum(h[0].numel() * h.element_size() for h in features.hidden.values())
        return q

    def count(self) -> int:
        """Context positions queued."""
        return self.n

    def head(self, n: int) -> dict[int, torch.Tensor]:
        """Empty the queue; its first n <= count() positions (layer id → [n, H])."""
        if not 0 < n <= self.n:
            raise ValueError(f"the queue holds {self.n} positions, not {n}")
        return {i: owned(h[:n]) for i, h in self.take().items()}

    def put_reused(self, hidden: dict[int, torch.Tensor]) -> None:
        """Queue a reused prefix's positions ({layer id: [n, H]}) ahead of everything else."""
        if self.reused is not None:
            raise ValueError("the queue already holds a reused prefix")
        self.reused = hidden
        self.n += int(next(iter(hidden.values())).shape[0])
        self.bytes += sum(h.numel() * h.element_size() for h in hidden.values())

    def push(self, hidden: dict[int, torch.Tensor]) -> None:
        """Queue one round's committed positions ({layer id: [n, H]}; slices of a larger tensor
        are copied, so that what the queue counts is what it holds)."""
        hidden = {i: owned(h) for i, h in hidden.items()}
        self.rounds.append(hidden)
        self.n += int(next(iter(hidden.values())).shape[0])
        self.bytes += sum(h.numel() * h.element_size() for h in hidden.values())

    def take(self) -> dict[int, torch.Tensor] | None:
        """Empty the queue: layer id → [n, H], a reused prefix's, the prompt's, then the rounds' in
        order (the layers every part has), or None when nothing was queued."""
        parts = []
        if self.reused is not None:
            parts.append(self.reused)
        if self.prefill is not None:
            parts.append({i: h[0] for i, h in self.prefill.items()})
        parts += self.rounds
        self.reused, self.prefill, self.rounds, self.n, self.bytes = None, None, [], 0, 0
        if not parts:
            return None
        keys = set(parts[0]).intersection(*parts[1:])
        return {i: torch.cat([p[i] for p in parts], 0) for i in sorted(keys)}


@dataclass
class _Kept:
    """What a free row still holds for prefix caching: the ids of the positions in its context
    cache and then in `queue` (features not consumed when its request left)."""

    ids: torch.Tensor  # int32 [cached + queued]
    queue: QueuedFeatures


@dataclass
class FeatureRequestState(DrafterRequestState):
    """Per-request state of a queue-fed drafter: its generator (`drafter_gen`) and the
    features waiting for its cache."""

    queue: QueuedFeatures = field(default_factory=QueuedFeatures)


def committed_feature_counts(seqs: Sequence[Request], num_accepted: torch.Tensor, ctx_len: Sequence[int]) -> list[int]:
    """How many of a round's feature positions [pending, d1..] each row commits: 1 + accepted,
    less where a stop rule cut the committed tokens short (the row is finishing)."""
    out = []
    for s, m, c in zip(seqs, num_accepted.tolist(), ctx_len):
        out.append(max(0, min(1 + int(m), s.num_tokens - 1 - int(c))))
    return out


def pad_rows(chunks: Sequence[dict[int, torch.Tensor]]) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Per row, layer id → [n_b, H] → (layer id → right-padded [B, max n, H], [n_b])."""
    counts = [int(next(iter(c.values())).shape[0]) for c in chunks]
    hidden = {}
    for i, ref in chunks[0].items():
        out = ref.new_zeros(len(chunks), max(counts), ref.shape[-1])
        for b, c in enumerate(chunks):
            out[b, : counts[b]] = c[i]
        hidden[i] = out
    return hidden, counts


class FeatureQueueDrafter:
    """start / release / on_verified of a drafter fed through `QueuedFeatures`.

    A subclass sets `name`, `device`, `cache` (its per-row context cache: `lengths`, `reset`),
    `feature_layers` (the target layers it reads), `flush_tokens` (`queue_bytes` may stay the default), `states` (a
    `RequestStates[FeatureRequestState]`), and implements `_consume`. One whose context position
    depends on that position's features alone sets `follows_prefix_cache` (and says so in its
    `needs`): its rows then follow the engine's prefix cache (the module docstring).
    """

    name: str
    device: torch.device
    cache: KVCache
    feature_layers: tuple[int, ...]
    flush_tokens: int
    queue_bytes: int = QUEUE_BYTES
    states: RequestStates[FeatureRequestState]
    # wall seconds spent consuming backlogs (a flush with a row past STEADY_TOKENS), cumulative (the engine reads it)
    consumed_s: float = 0.0
    consumed_positions: int = 0  # the positions those flushes consumed, cumulative (the cost model's rate)
    follows_prefix_cache: bool = False
    _kept: dict[int, _Kept]  # free row → what it holds (follows_prefix_cache; made on first use)

    def _consume(self, rows: list[Request], hidden: dict[int, torch.Tensor], counts: list[int]) -> None:
        """Append the first counts[b] positions of hidden (layer id → [B, S, H]) to row b's context."""
        raise NotImplementedError

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        """A request got its row; `features` are its prompt's past the prefix the row reuses
        (`seq.stats.cached_tokens`, 0 without prefix caching)."""
        queue = QueuedFeatures.of_prompt(features)
        kept = self._kept_rows().pop(seq.row, None)
        reused = int(seq.stats.cached_tokens)
        if reused:
            held = 0 if kept is None else kept.ids.numel()
            if not self.follows_prefix_cache or reused > held:
                raise RuntimeError(f"drafter {self.name}: row {seq.row} reuses {reused} positions, but the drafter "
                                   f"holds {held} (the engine must match prompts against held_ids)")
            in_cache = min(reused, int(self.cache.lengths[seq.row]))
            self.cache.truncate(seq.row, in_cache)
            if reused > in_cache:
                queue.put_reused(kept.queue.head(reused - in_cache))
        else:
            self.cache.reset(seq.row)
        self.states.start(seq, FeatureRequestState(drafter_gen=drafter_generator(seq, self.device), queue=queue))

    def release(self, seq: Request) -> None:
        state = self.states.release(seq)
        if seq.row < 0:
            return
        if not self.follows_prefix_cache or state is None:
            self.cache.reset(seq.row)
            return
        # The row keeps its context and queue: a later request may reuse its prefix (start()).
        n = int(self.cache.lengths[seq.row]) + state.queue.count()
        self._kept_rows()[seq.row] = _Kept(torch.tensor(seq.all_ids[:n], dtype=torch.int32), state.queue)

    def held_ids(self, row: int) -> torch.Tensor | None:
        """The ids of the positions a free row holds (int32), or None: how far a request placed
        there can reuse a prefix (the engine's prefix cache asks, with follows_prefix_cache)."""
        kept = self._kept_rows().get(row)
        return None if kept is None else kept.ids

    def _kept_rows(self) -> dict[int, _Kept]:
        if not hasattr(self, "_kept"):
            self._kept = {}
        return self._kept

    def pending_count(self, seq: Request) -> int:
        """Context positions whose target features are queued but not yet in the cache."""
        return self.states[seq].queue.count()

    def backlog_positions(self, seqs: Sequence[Request]) -> int:
        """The backlog a round that drafts all these rows consumes first (positions counted in
        `consumed_positions` then): what the prefix scheduler prices a probe with."""
        return backlog([self.pending_count(s) for s in seqs])

    def on_verified(self, seqs, proposal, result, features) -> None:
        """Queue the committed positions' features; they are consumed when the row next drafts
        (or when the queues outgrow their bounds), so rounds a policy does not draft cost nothing."""
        if features is None or not features.hidden:
            raise DraftsmithError(f"drafter {self.name!r} needs target features after every round")
        ctx = [int(self.cache.lengths[s.row]) + self.pending_count(s) for s in seqs]
        for b, (s, n) in enumerate(zip(seqs, committed_feature_counts(seqs, result.num_accepted, ctx))):
            if n > 0:
                self.states[s].queue.push({i: features.hidden[i][b, :n] for i in self.feature_layers})
        self._flush(self._over_budget(seqs))

    def _over_budget(self, seqs: Sequence[Request]) -> list[Request]:
        """The rows to consume now: each one past `flush_tokens`, then, while all rows' queues
        hold more than `queue_bytes`, the longest ones until they hold at most half of it."""
        out = [s for s in seqs if self.pending_count(s) >= self.flush_tokens]
        rest = [s for s in seqs if self.pending_count(s) < self.flush_tokens]
        left = sum(self.states[s].queue.bytes for s in rest)
        left = self._drop_kept(left)
        if left > self.queue_bytes:  # sorted only then: most rounds stay under the bound
            for s in sorted(rest, key=lambda s: -self.states[s].queue.bytes):
                if left <= self.queue_bytes // 2:
                    break
                out.append(s)
                left -= self.states[s].queue.bytes
        return out

    def _drop_kept(self, running: int) -> int:
        """Free rows' kept queues count against `queue_bytes` too, and go first (dropping one
        costs no compute: its row then holds only its context cache, and a prompt reuses only
        that much of it); → what the queues hold after."""
        kept = self._kept_rows()
        total = running + sum(k.queue.bytes for k in kept.values())
        for row, k in list(kept.items()):  # least recently released first
            if total <= self.queue_bytes:
                break
            if k.queue.bytes:
                total -= k.queue.bytes
                n = int(self.cache.lengths[row])
                kept[row] = _Kept(k.ids[:n], QueuedFeatures())
        return total

    def _flush(self, seqs: Sequence[Request]) -> None:
        """Consume every given row's queued positions (prompt, then committed rounds), in one batch;
        its time (and their count) goes to `consumed_s` (`consumed_positions`) when a row held more
        than STEADY_TOKENS of them."""
        with consuming(self, self.backlog_positions(seqs), self.device):
            self._flush_rows(seqs)

    def _flush_rows(self, seqs: Sequence[Request]) -> None:
        rows, chunks = [], []
        for s in seqs:
            c = self.states[s].queue.take()
            if c is not None:
                rows.append(s)
                chunks.append(c)
        if rows:
            hidden, counts = pad_rows(chunks)
            self._consume(rows, hidden, counts)

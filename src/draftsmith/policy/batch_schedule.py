"""Batch size -> K schedule (vLLM's "disable speculation above a batch size", generalised).

A table of (max batch, K) rows sorted by max batch: a round with n running requests drafts
the K of the first row with n <= max batch; above the last row speculation is off (K = 0).
The batch size is known before drafting, so this is non-anticipating and lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.types import Proposal
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.policy.base import keep_all


def default_schedule(k: int) -> tuple[tuple[int, int], ...]:
    """Full K for 1-2 requests, about half up to 4, off above: the small models on a CPU
    stop gaining from wider forwards early (docs/ARCHITECTURE.md, machine facts)."""
    return ((2, k), (4, max(1, (k + 1) // 2))) if k > 0 else ((1, 0),)


@dataclass(frozen=True)
class BatchSizeSchedule:
    schedule: tuple[tuple[int, int], ...] = default_schedule(5)  # ((max batch, K), ...)
    name: str = "batch-schedule"

    def __post_init__(self) -> None:
        sched = tuple((int(b), int(k)) for b, k in self.schedule)
        if not sched:
            raise DraftsmithError("batch schedule needs at least one (max batch, K) row")
        bs = [b for b, _ in sched]
        if bs[0] < 1 or any(a >= b for a, b in zip(bs, bs[1:])):
            raise DraftsmithError(f"batch schedule max batches must be >= 1 and strictly increasing, got {bs}")
        if any(k < 0 for _, k in sched):
            raise DraftsmithError(f"batch schedule K values must be >= 0, got {[k for _, k in sched]}")
        object.__setattr__(self, "schedule", sched)

    def k_for(self, batch_size: int) -> int:
        for max_batch, k in self.schedule:
            if batch_size <= max_batch:
                return k
        return 0

    def choose(self, seqs: list[Request]) -> list[int]:
        return [self.k_for(len(seqs))] * len(seqs)

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        return keep_all(proposal)

    def update(self, seqs, proposal, result) -> None:
        pass

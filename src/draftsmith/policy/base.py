"""Draft-length policies: how many draft tokens each row may propose this round.

A policy only sees information from before the round it decides (non-anticipating), which
is what keeps any choice of length lossless. The engine caps the choice further by the
request's remaining max_tokens and the context limit.
"""

from __future__ import annotations

from typing import Protocol

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.request import Request


def keep_all(proposal: Proposal) -> list[int]:
    return proposal.lengths.tolist() if proposal.max_len else [0] * proposal.batch_size


class DraftLengthPolicy(Protocol):
    name: str

    def choose(self, seqs: list[Request]) -> list[int]:
        """Draft length per row for this round (>= 0)."""
        ...

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        """After drafting: how many of each row's drafts to verify (<= proposal.lengths).

        Confidence-driven schedulers (static threshold, DSpark's prefix scheduler) decide
        here, from the drafter's per-position confidences. Must stay non-anticipating:
        whether draft k is kept may not depend on draft k itself except through
        confidences the algorithm is proven safe with (see policy/prefix_scheduler.py).
        """
        ...

    def update(self, seqs: list[Request], proposal: Proposal, result: VerifyResult) -> None:
        """Learn from the round that just finished."""
        ...

    # Optional: `draft_gate(seqs, caps) -> gate | None`, called before drafting: an object whose
    # open_next(column confidences) tells a gated drafter whether that column will be verified
    # (the prefix scheduler's column search; the drafter may stop at the first False).
    # Optional: `queued(positions: int) -> None`, called before choose() where the drafter keeps a
    # queue of context features (drafter.backlog_positions): the backlog its next drafting round
    # consumes first (the prefix scheduler prices a probe with it).
    # Optional: `observe(info: engine.StepInfo) -> None`, called after update() with the
    # round's forward shape and timings (the prefix scheduler's online cost model uses it).
    # Optional: `forced_lengths(seqs, kept, forced) -> list[int]`, called after trim() where rows'
    # grammars force tokens (core/grammar_drafts.py): how many of each row's forced drafts to
    # verify beside the kept drafts (the prefix scheduler weighs the wider forward; without the
    # hook, core/grammar_drafts.fit_forced: as if a forward cost time in proportion to its tokens).

"""Draft-length policies: how many draft tokens each row may propose this round.

A policy only sees information from before the round it decides (non-anticipating), which
is what keeps any choice of length lossless. The engine caps the choice further by the
request's remaining max_tokens and the context limit.
"""

from __future__ import annotations

from typing import Protocol

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.engine.sequence import Sequence


class DraftLengthPolicy(Protocol):
    name: str

    def choose(self, seqs: list[Sequence]) -> list[int]:
        """Draft length per row for this round (>= 0)."""
        ...

    def update(self, seqs: list[Sequence], proposal: Proposal, result: VerifyResult) -> None:
        """Learn from the round that just finished."""
        ...

"""Fixed K: every row proposes K draft tokens every round."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.types import Proposal
from draftsmith.core.request import Request
from draftsmith.policy.base import keep_all
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class FixedK:
    k: int = 5
    name: str = "fixed"

    def __post_init__(self) -> None:
        if self.k < 0:
            raise DraftsmithError(f"draft length K must be >= 0, got {self.k}")

    def choose(self, seqs: list[Request]) -> list[int]:
        return [self.k] * len(seqs)

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        return keep_all(proposal)

    def update(self, seqs, proposal, result) -> None:
        pass

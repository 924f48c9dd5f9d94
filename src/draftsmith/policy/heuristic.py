"""The +2 / −1 heuristic (HF transformers' `num_assistant_tokens_schedule="heuristic"`).

Per request: if every draft of the last round was accepted, propose 2 more next time;
otherwise propose 1 fewer. Bounded to [min_k, max_k].
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.types import Proposal
from draftsmith.core.request import Request
from draftsmith.policy.base import keep_all
from draftsmith.errors import DraftsmithError

_KEY = "heuristic_k"


@dataclass(frozen=True)
class HeuristicK:
    initial: int = 5
    min_k: int = 1
    max_k: int = 16
    name: str = "heuristic"

    def __post_init__(self) -> None:
        if not 0 <= self.min_k <= self.initial <= self.max_k:
            raise DraftsmithError(
                f"heuristic policy needs 0 <= min_k <= initial <= max_k, got "
                f"{self.min_k}, {self.initial}, {self.max_k}"
            )

    def choose(self, seqs: list[Request]) -> list[int]:
        return [s.drafter_state.get(_KEY, self.initial) for s in seqs]

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        return keep_all(proposal)

    def update(self, seqs, proposal, result) -> None:
        for b, s in enumerate(seqs):
            proposed = int(proposal.lengths[b]) if proposal.max_len else 0
            if proposed == 0:
                continue  # nothing proposed (no match, or capped): no evidence either way
            k = s.drafter_state.get(_KEY, self.initial)
            k = k + 2 if int(result.num_accepted[b]) == proposed else k - 1
            s.drafter_state[_KEY] = max(self.min_k, min(self.max_k, k))

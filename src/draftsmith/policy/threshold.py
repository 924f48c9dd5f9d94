"""Static confidence threshold: verify draft k while a_k = prod_{i<=k} c_i >= threshold.

a_k is the estimated probability that drafts 1..k all survive. Every row drafts up to max_k
tokens; after drafting, row b keeps the longest prefix whose a_k clears the threshold. The
c_k come from the drafter (Proposal.confidences, DSpark's confidence head) or, for drafters
without them, from the request's running acceptance (policy/acceptance.py).

Lossless: c_k depends on drafts before k only (the head reads x_{k-1}), so whether draft k
is verified never depends on draft k itself; a_k is non-increasing, so "keep while" is a
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.core.types import Proposal
from draftsmith.engine.sequence import Sequence
from draftsmith.errors import DraftsmithError
from draftsmith.policy.acceptance import AcceptancePrior, cumulative, record_round, running_confidences


def row_confidences(seqs: list[Sequence], proposal: Proposal, prior: AcceptancePrior) -> list[list[float]]:
    """Per row, c_1..c_{lengths[b]}: the drafter's when it gives them, else running acceptance."""
    lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
    if proposal.confidences is not None and proposal.max_len:
        conf = proposal.confidences.detach().float().cpu().tolist()
        return [conf[b][:n] for b, n in enumerate(lengths)]
    return [running_confidences(s, n, prior) for s, n in zip(seqs, lengths)]


@dataclass(frozen=True)
class ConfidenceThreshold:
    threshold: float = 0.4  # keep draft k while the survival estimate a_k >= this
    max_k: int = 5  # drafts requested per row per round
    prior: AcceptancePrior = field(default_factory=AcceptancePrior)  # drafters without confidences
    name: str = "threshold"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise DraftsmithError(f"confidence threshold must be in [0, 1], got {self.threshold}")
        if self.max_k < 0:
            raise DraftsmithError(f"max_k must be >= 0, got {self.max_k}")

    def choose(self, seqs: list[Sequence]) -> list[int]:
        return [self.max_k] * len(seqs)

    def trim(self, seqs: list[Sequence], proposal: Proposal) -> list[int]:
        keep = []
        for conf in row_confidences(seqs, proposal, self.prior):
            n = 0
            for a in cumulative(conf):
                if a < self.threshold:
                    break
                n += 1
            keep.append(n)
        return keep

    def update(self, seqs, proposal, result) -> None:
        record_round(seqs, proposal, result)

"""Static confidence threshold: verify draft k while a_k = prod_{i<=k} c_i >= threshold.

a_k is the estimated probability that drafts 1..k all survive. With a drafter that gives
confidences (Proposal.confidences, DSpark's head), every row drafts max_k tokens and keeps the
longest prefix whose a_k clears the threshold. Without them, c_k is the request's running
acceptance (policy/acceptance.py), known before drafting, so the cap is set in choose().

Lossless: c_k depends on drafts before k only (the head reads x_{k-1}), so whether draft k
is verified never depends on draft k itself; a_k is non-increasing, so "keep while" is a
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.core.types import Proposal
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.policy.acceptance import (
    AcceptancePrior, cumulative, drafter_has_confidences, record_round, remember_drafts,
    running_confidences,
)
from draftsmith.policy.base import keep_all


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

    def choose(self, seqs: list[Request]) -> list[int]:
        # Without drafter confidences the running ones are known now: draft only what passes.
        return [self.max_k if drafter_has_confidences(s) else self._keep(running_confidences(s, self.max_k, self.prior))
                for s in seqs]

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        remember_drafts(seqs, proposal)
        if proposal.confidences is None or not proposal.max_len:
            return keep_all(proposal)  # capped in choose()
        lengths = proposal.lengths.tolist()
        conf = proposal.confidences.detach().float().cpu().tolist()
        return [self._keep(c[:n]) for c, n in zip(conf, lengths)]

    def _keep(self, conf: list[float]) -> int:
        n = 0
        for a in cumulative(conf):
            if a < self.threshold:
                break
            n += 1
        return n

    def update(self, seqs, proposal, result) -> None:
        record_round(seqs, proposal, result, self.prior)

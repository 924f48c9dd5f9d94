"""Per-position confidences for drafters that have none, from a request's past rounds.

A drafter without a confidence head (n-gram, a plain draft model) still has a track
record: at position k, among this request's rounds that verified a draft k after accepting
drafts 1..k-1, the fraction that accepted draft k. That is the conditional acceptance the
DSpark confidence head predicts (c_k = P(draft k survives | 1..k-1 survived)), estimated
with a Beta prior so a fresh request starts at `prior.mean`.

seq.stats only keeps prefix survival (accepted >= k / proposed >= k), which mixes in rounds
that stopped proposing before k; the conditional counts are kept here instead, in
seq.drafter_state under one key. They use finished rounds only, so confidences derived from
them are non-anticipating: any verify-length rule built on them is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.engine.sequence import Sequence
from draftsmith.errors import DraftsmithError

_KEY = "policy.running_acceptance"  # -> ([reached_k], [accepted_k]) per position k = 1..


@dataclass(frozen=True)
class AcceptancePrior:
    mean: float = 0.6  # prior conditional acceptance at every position
    strength: float = 2.0  # pseudo-rounds behind the prior

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0 or self.strength <= 0:
            raise DraftsmithError(f"acceptance prior needs 0 < mean < 1 and strength > 0, got {self}")


def record_round(seqs: list[Sequence], proposal: Proposal, result: VerifyResult) -> None:
    """Count, per position, rounds that reached a verified draft there and accepted it."""
    if not proposal.max_len:
        return
    lengths = proposal.lengths.tolist()
    accepted = result.num_accepted.tolist()
    for s, n, m in zip(seqs, lengths, accepted):
        if n == 0:
            continue
        reached, acc = s.drafter_state.setdefault(_KEY, ([], []))
        # Draft k (1-based) was reached iff drafts 1..k-1 were accepted: k <= m + 1.
        top = min(n, m + 1)
        if len(reached) < top:
            grow = top - len(reached)
            reached.extend([0] * grow)
            acc.extend([0] * grow)
        for k in range(top):
            reached[k] += 1
            if k < m:
                acc[k] += 1


def running_confidences(seq: Sequence, k: int, prior: AcceptancePrior) -> list[float]:
    """c_1..c_k for this request: posterior-mean conditional acceptance per position."""
    reached, acc = seq.drafter_state.get(_KEY, ([], []))
    a0, n0 = prior.mean * prior.strength, prior.strength
    out = []
    for j in range(k):
        r = reached[j] if j < len(reached) else 0
        a = acc[j] if j < len(acc) else 0
        out.append((a + a0) / (r + n0))
    return out


def cumulative(conf: list[float]) -> list[float]:
    """a_j = prod_{i <= j} c_i (survival estimate of the first j drafts)."""
    out, a = [], 1.0
    for c in conf:
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out

"""Per-position confidences for drafters that have none, from a request's past rounds.

A drafter without a confidence head (n-gram, a plain draft model) still has a track record:
the conditional acceptance at position k, P(draft k accepted | drafts 1..k-1 accepted), which
is what DSpark's confidence head predicts. It is estimated per request, recency-weighted
(evidence fades by `decay` per round: n-gram acceptance changes within a request, high while
the model copies its prompt and low after), with a Beta prior so a fresh request starts at
`mean`. Fading also means a request that stopped drafting drifts back to the prior and
probes again (rarely: a few rounds in a hundred at the default decay).

Evidence, kept in seq.drafter_state under one key:
- Deterministic drafts (Proposal.q is None: n-gram, greedy draft models): every drafted chain
  is remembered in trim() and scored once the request's own output has resolved it: draft k
  "survives" if drafts 1..k all equal the committed tokens. With a one-hot q this has exactly
  the law of the verifier's accept events (the committed token after a matching prefix is
  distributed as p, and a one-hot draft is accepted with probability p(x)). So drafts the
  scheduler chose NOT to verify still count, and a request whose estimate fell does not stay
  shut off for lack of evidence.
- Sampled drafts (q given): only verified rounds count (acceptance min(1, p/q) is not a match
  probability).

A fresh request starts from the prior. With an `AcceptancePool` the prior mean at position k
is the server's own recent conditional acceptance at k, pooled over all requests (what this
drafter achieves on this traffic), instead of the fixed `AcceptancePrior.mean` guess.

Everything is scored from committed output of finished rounds, so confidences derived from
it are non-anticipating: any verify-length rule built on them is lossless. (seq.stats keeps
prefix survival only, which mixes in rounds that proposed fewer drafts, hence these counts.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError

_KEY = "policy.running_acceptance"
_HAS_CONF = "policy.drafter_confidences"  # did this request's last proposal carry confidences?
_MAX_PENDING = 16  # unresolved chains kept per request (each resolves within K rounds)


@dataclass(frozen=True)
class AcceptancePrior:
    mean: float = 0.5  # prior conditional acceptance at every position
    strength: float = 2.0  # pseudo-chains behind the prior
    decay: float = 0.9  # weight of older evidence per round (1 = plain average)

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0 or self.strength <= 0 or not 0.0 < self.decay <= 1.0:
            raise DraftsmithError(
                f"acceptance prior needs 0 < mean < 1, strength > 0 and 0 < decay <= 1, got {self}"
            )


@dataclass
class _Counts:
    reached: list[float]  # [k] weighted chains that reached draft k+1 (drafts 1..k accepted)
    accepted: list[float]  # [k] ... and accepted it
    pending: list[tuple[int, list[int]]]  # (output index of draft 1, drafts) not yet resolved

    def fade(self, decay: float) -> None:
        self.reached = [x * decay for x in self.reached]
        self.accepted = [x * decay for x in self.accepted]

    def add(self, reached: int, accepted: int) -> None:
        """One scored chain: drafts 1..reached were reached, 1..accepted accepted."""
        if len(self.reached) < reached:
            self.reached += [0.0] * (reached - len(self.reached))
            self.accepted += [0.0] * (reached - len(self.accepted))
        for k in range(reached):
            self.reached[k] += 1.0
            if k < accepted:
                self.accepted[k] += 1.0


@dataclass
class AcceptancePool:
    """Conditional acceptance per position pooled over every request's scored chains,
    recency-weighted (older chains fade by `decay` per new chain)."""

    decay: float = 0.995
    min_weight: float = 8.0  # chains reaching position k before the pooled mean replaces the prior
    counts: "_Counts" = field(default_factory=lambda: _Counts([], [], []))

    @property
    def reached(self) -> list[float]:
        return self.counts.reached

    @property
    def accepted(self) -> list[float]:
        return self.counts.accepted

    def add(self, reached: int, accepted: int) -> None:
        self.counts.fade(self.decay)
        self.counts.add(reached, accepted)

    def mean(self, k: int, fallback: float) -> float:
        """Pooled conditional acceptance at 0-based position k (fallback until enough chains),
        kept inside (0.01, 0.99) so that it stays a usable prior mean."""
        if k >= len(self.reached) or self.reached[k] < self.min_weight:
            return fallback
        return min(max(self.accepted[k] / self.reached[k], 0.01), 0.99)


def _counts(seq: Request) -> _Counts:
    c = seq.drafter_state.get(_KEY)
    if c is None:
        c = seq.drafter_state[_KEY] = _Counts([], [], [])
    return c


def drafter_has_confidences(seq: Request) -> bool:
    """True once this request's drafter has proposed with confidences (False: not yet/never)."""
    return bool(seq.drafter_state.get(_HAS_CONF, False))


def remember_drafts(seqs: list[Request], proposal: Proposal) -> None:
    """Call in trim(), before any draft is dropped: keep deterministic chains for scoring,
    and note whether the drafter gives confidences."""
    if not proposal.max_len:
        return
    for s in seqs:
        s.drafter_state[_HAS_CONF] = proposal.confidences is not None
    if proposal.q is not None:
        return
    tokens = proposal.tokens.tolist()
    for s, row, n in zip(seqs, tokens, proposal.lengths.tolist()):
        if n:
            c = _counts(s)
            c.pending = (c.pending + [(len(s.output_ids), row[:n])])[-_MAX_PENDING:]


def record_round(seqs: list[Request], proposal: Proposal, result: VerifyResult,
                 prior: AcceptancePrior = AcceptancePrior(), pool: AcceptancePool | None = None) -> None:
    """Call in update(): fade older evidence one round, then score what this round resolved
    (into each request's counts and, when given, the pool)."""
    for s in seqs:
        c = s.drafter_state.get(_KEY)
        if c is not None:
            c.fade(prior.decay)
    if proposal.q is None:
        for s in seqs:
            c = s.drafter_state.get(_KEY)
            if c is None or not c.pending:
                continue
            out, keep = s.output_ids, []
            for start, drafts in c.pending:
                m = 0
                while m < len(drafts) and start + m < len(out) and out[start + m] == drafts[m]:
                    m += 1
                if m == len(drafts) or start + m < len(out):  # all matched, or a mismatch seen
                    c.add(reached=min(m + 1, len(drafts)), accepted=m)
                    if pool is not None:
                        pool.add(reached=min(m + 1, len(drafts)), accepted=m)
                else:
                    keep.append((start, drafts))  # the output has not got that far yet
            c.pending = keep
        return
    if not proposal.max_len:
        return
    for s, n, m in zip(seqs, proposal.lengths.tolist(), result.num_accepted.tolist()):
        if n:  # draft k (1-based) was reached iff drafts 1..k-1 were accepted
            _counts(s).add(reached=min(n, m + 1), accepted=m)
            if pool is not None:
                pool.add(reached=min(n, m + 1), accepted=m)


def running_confidences(seq: Request, k: int, prior: AcceptancePrior,
                        pool: AcceptancePool | None = None) -> list[float]:
    """c_1..c_k for this request: posterior-mean conditional acceptance per position (prior
    mean from the pool where it has enough chains, else prior.mean)."""
    c = seq.drafter_state.get(_KEY)
    reached, acc = (c.reached, c.accepted) if c is not None else ([], [])
    n0 = prior.strength
    out = []
    for j in range(k):
        a0 = (pool.mean(j, prior.mean) if pool is not None else prior.mean) * n0
        out.append(((acc[j] if j < len(acc) else 0.0) + a0) / ((reached[j] if j < len(reached) else 0.0) + n0))
    return out


def cumulative(conf: list[float]) -> list[float]:
    """a_j = prod_{i <= j} c_i (survival estimate of the first j drafts)."""
    out, a = [], 1.0
    for c in conf:
        a *= min(max(float(c), 0.0), 1.0)
        out.append(a)
    return out

"""A request's recent drafter confidences, kept to predict what the column search will open.

choose() decides whether to draft before this round's confidences exist; trim()'s column search
(prefix_scheduler.py) then opens the columns that this round's confidences pay for. Planned on
one running estimate per position, choose() predicted two columns where the search opened the
second in about half the rounds (4 rows on a 2-core Zen 3: planned 3.6 accepted drafts per round,
realized 1.95 in rounds of one column and 3.4 in rounds of two; BENCHMARKS.md, stop 60): a plan
on the mean is not the mean of the plans. Replaying each request's last RECENT confidence vectors
through the same search gives the mixture of widths trim() actually runs.

A vector is what the drafter said in one round, c_{r,1..n}: every column the column search was
asked about (draft_gate's search sees the column that did not open too; a round whose first
column did not open still leaves its vector), else the proposal's. Kept in seq.drafter_state under
one key, most recent first. Past rounds only: lossless whatever choose() makes of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.core.request import Request

_KEY = "policy.recent_confidences"
RECENT = 8  # vectors kept per request (the replays choose() runs per round, at most)


def remember_confidences(seqs: Sequence[Request], vectors: Sequence[Sequence[float]]) -> None:
    """Keep this round's confidence vector of each row (an empty one, a row the drafter did not
    draft for, adds nothing)."""
    for s, v in zip(seqs, vectors):
        if len(v):
            kept = s.drafter_state.setdefault(_KEY, [])
            kept.insert(0, list(v))
            del kept[RECENT:]


def recent_confidences(seq: Request) -> list[list[float]]:
    """This request's last confidence vectors, most recent first ([] before its first draft)."""
    return seq.drafter_state.get(_KEY, [])

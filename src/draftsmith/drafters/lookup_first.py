"""Prompt lookup first, a model drafter where the lookup finds no match (spec `lookup:SPEC`,
e.g. `lookup:dspark:smollm2-135m`).

Per row and round: when the sequence's trailing n-gram (n from `max_match` down to
`min_match`) occurred earlier in prompt + output, the row proposes what followed it, as the
`ngram` drafter does; otherwise the wrapped drafter proposes for it. A lookup draft costs no
forward, and where text repeats its context (code that reuses its identifiers, answers that
quote the question) it is often long and right; the trained drafter covers the rest. The
wrapped drafter still sees every round's target features (start / on_verified are passed
through), so its context stays complete for the rounds it drafts.

Proposal of a mixed batch: lookup rows are deterministic, so where the wrapped drafter
sampled (q given) their q is one-hot at the draft, which is exactly the law they were drawn
from. Where it gives confidences (DSpark), lookup rows get this drafter's running
conditional acceptance of its own lookup drafts per position (recency-weighted, pooled over
requests, from finished rounds only: non-anticipating, so any verify-length rule built on it
stays lossless), with prior `prior_mean`.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.request import Request
from draftsmith.core.types import Proposal
from draftsmith.drafters.base import Drafter
from draftsmith.drafters.ngram import lookup
from draftsmith.errors import DraftsmithError
from draftsmith.policy.acceptance import AcceptancePool


@dataclass(frozen=True)
class LookupFirstConfig:
    min_match: int = 2  # shortest trailing n-gram whose earlier occurrence makes a lookup draft
    max_match: int = 3  # longest tried first (the most specific context)
    prior_mean: float = 0.5  # conditional acceptance assumed for lookup drafts before evidence
    prior_strength: float = 4.0  # pseudo-drafts behind the prior
    decay: float = 0.995  # weight of older evidence per scored lookup draft chain

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_match:
            raise DraftsmithError(f"lookup needs 1 <= min_match <= max_match, got {self.min_match}, {self.max_match}")
        if not 0.0 < self.prior_mean < 1.0 or self.prior_strength <= 0 or not 0.0 < self.decay <= 1.0:
            raise DraftsmithError(f"lookup prior needs 0 < mean < 1, strength > 0, 0 < decay <= 1, got {self}")


class LookupFirstDrafter:
    def __init__(self, model: Drafter, config: LookupFirstConfig | None = None) -> None:
        self.model = model
        self.config = config or LookupFirstConfig()
        self.name = f"lookup+{model.name}"
        self.needs = model.needs
        self._pool = AcceptancePool(decay=self.config.decay)  # lookup chains: reached / accepted per position
        self._rows: list[int] = []  # this round: drafts proposed by lookup per row (0 = the model's row)
        self.lookup_rounds = 0  # row-rounds drafted by lookup / by the model (reported by bench / eval)
        self.model_rounds = 0

    @property
    def temperatures(self):
        """The wrapped drafter's STS temperatures (None without)."""
        return getattr(self.model, "temperatures", None)

    @property
    def sts(self):
        """The wrapped drafter's STS fit, with the regime it applies to (None without)."""
        return getattr(self.model, "sts", None)

    @property
    def consumed_s(self) -> float:
        """The wrapped drafter's context-upkeep seconds (the engine keeps them out of drafting time)."""
        return getattr(self.model, "consumed_s", 0.0)

    @property
    def consumed_positions(self) -> int:
        """The positions of that upkeep (the cost model's rate per position)."""
        return getattr(self.model, "consumed_positions", 0)

    def backlog_positions(self, seqs) -> int:
        """The wrapped drafter's backlog for these rows (0 for one without a feature queue)."""
        of = getattr(self.model, "backlog_positions", None)
        return 0 if of is None else of(seqs)

    # -- request lifecycle: the wrapped drafter's

    def start(self, seq: Request, features) -> None:
        self.model.start(seq, features)

    def release(self, seq: Request) -> None:
        self.model.release(seq)

    def held_ids(self, row: int):
        """What the wrapped drafter holds in a free row (asked only when it follows the prefix cache)."""
        return self.model.held_ids(row)

    def on_verified(self, seqs, proposal, result, features) -> None:
        for n, m in zip(self._rows, result.num_accepted.tolist()):
            if n:  # a lookup row: draft k was reached iff drafts 1..k-1 were accepted
                self._pool.add(reached=min(n, int(m) + 1), accepted=int(m))
        self._rows = []
        self.model.on_verified(seqs, proposal, result, features)

    # -- one round

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        c = self.config
        found = [lookup(s.all_ids, k, c.max_match, c.min_match) if k > 0 else [] for s, k in zip(seqs, max_lengths)]
        rest = [0 if d else k for d, k in zip(found, max_lengths)]
        mp = self.model.propose(seqs, rest) if any(rest) else Proposal.empty(len(seqs))
        self._rows = [len(d) for d in found]
        self.lookup_rounds += sum(1 for d in found if d)
        self.model_rounds += sum(1 for k in rest if k)
        # lookup rows: their drafts, a one-hot q, the running acceptance (where the model gives
        # confidences)
        running = self.running_acceptance(max(len(d) for d in found)) if any(found) else []
        return mp.with_rows(found, [running[: len(d)] for d in found])

    # -- the lookup drafts' track record

    def running_acceptance(self, k: int) -> list[float]:
        """Posterior-mean conditional acceptance of lookup drafts at positions 1..k."""
        c = self.config
        reached, accepted = self._pool.reached, self._pool.accepted
        out = []
        for j in range(k):
            n = reached[j] if j < len(reached) else 0.0
            a = accepted[j] if j < len(accepted) else 0.0
            out.append((a + c.prior_mean * c.prior_strength) / (n + c.prior_strength))
        return out

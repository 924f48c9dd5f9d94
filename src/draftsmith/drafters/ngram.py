"""N-gram prompt lookup drafter (Saxena 2023; HF `prompt_lookup_num_tokens`).

Find the most recent earlier occurrence of the sequence's trailing n-gram (longest n
first) in prompt + output, and propose the tokens that followed it. No model, no training.
Drafts are deterministic, so q is one-hot (Proposal.q = None) and acceptance is p(x).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.types import Proposal
from draftsmith.drafters.base import FeatureSpec, TargetFeatures, pad_proposal
from draftsmith.core.request import Request


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3  # longest trailing n-gram to match
    min_ngram: int = 1  # shortest
    max_draft: int = 10  # cap on proposal length whatever the policy asks


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Tokens that followed the latest earlier match of tokens' trailing n-gram."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = tokens[L - n :]
        # Scan backwards: the most recent match predicts best (repetition is local).
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter:
    name = "ngram"
    needs = FeatureSpec()

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        pass

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        c = self.config
        drafts = [
            lookup(s.all_ids, min(k, c.max_draft), c.max_ngram, c.min_ngram)
            for s, k in zip(seqs, max_lengths)
        ]
        return pad_proposal(drafts)

    def on_verified(self, seqs, proposal, result, features) -> None:
        pass

    def release(self, seq: Request) -> None:
        pass

"""The drafter interface: propose, then learn from the verification result.

The engine calls every drafter the same way and never branches on its kind:

    needs            which target features the drafter reads (layer ids, final hidden)
    start(seq)       a request got a cache row (prefill done): set up per-request state
    propose(seqs, max_lengths) -> Proposal
                     at most max_lengths[b] draft tokens for row b (0 allowed), with q when
                     the drafts were sampled (None = deterministic one-hot drafts)
    on_verified(seqs, proposal, result, features)
                     the committed tokens are in seq.output_ids already; features hold the
                     requested target features for this round's input positions
    release(seq)     the request left: free its state
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.request import Request


@dataclass(frozen=True)
class FeatureSpec:
    """Target features a drafter needs from each target forward."""

    layer_ids: tuple[int, ...] = ()
    final_hidden: bool = False


@dataclass
class TargetFeatures:
    """Features of one target forward, for the rows that took part.

    hidden:       layer id -> [B, S, H] decoder-layer outputs at the forward's input positions
    final_hidden: [B, S, H] normed last hidden state, or None when not requested
    """

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    name: str
    needs: FeatureSpec

    def start(self, seq: Request, features: TargetFeatures | None) -> None: ...

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal: ...

    def on_verified(
        self,
        seqs: list[Request],
        proposal: Proposal,
        result: VerifyResult,
        features: TargetFeatures | None,
    ) -> None: ...

    def release(self, seq: Request) -> None: ...


class NoDrafter:
    """Plain decoding through the same path: every round proposes nothing."""

    name = "none"
    needs = FeatureSpec()

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        pass

    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        return Proposal.empty(len(seqs))

    def on_verified(self, seqs, proposal, result, features) -> None:
        pass

    def release(self, seq: Request) -> None:
        pass


def pad_proposal(drafts: list[list[int]], q: list[torch.Tensor] | None = None) -> Proposal:
    """Right-pad per-row draft lists into a Proposal (q rows are [len_b, V] each)."""
    B = len(drafts)
    K = max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(B, K, dtype=torch.long)
    for b, d in enumerate(drafts):
        if d:
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    q_full = None
    if q is not None and K > 0:
        V = next(x.shape[-1] for x in q if x is not None and x.numel())
        q_full = torch.zeros(B, K, V, dtype=torch.float32)
        for b, qb in enumerate(q):
            if qb is not None and qb.numel():
                q_full[b, : qb.shape[0]] = qb
        # Rows without sampled drafts never read q past their length.
    return Proposal(tokens=tokens, lengths=lengths, q=q_full)

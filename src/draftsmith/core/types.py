"""Data passed between drafters, the verifier and the engine.

Notation (Leviathan et al. 2023): **p is the target distribution, q is the draft's**.
γ (gamma) is the number of draft tokens proposed for a row in one round. τ (tau) is the
number of tokens committed per verification round, the bonus / correction token included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass
class Proposal:
    """Draft tokens for a batch of rows; rows may propose different lengths (0 included).

    tokens:      [B, K] int64 draft ids, right-padded (padding value is ignored).
    lengths:     [B]    int64 number of valid draft tokens per row, 0 <= lengths <= K.
    q:           [B, K, V] float draft distributions the tokens were sampled from, or None
                 when every row that drafted this round drew deterministically (n-gram, or
                 greedy rows of a trained drafter — also when the sampled rows of the batch
                 proposed 0 tokens): then q is one-hot at `tokens` and the verifier never
                 materialises it.
    confidences: [B, K] float, per-position survival confidences c_k (DSpark), or None.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    q: torch.Tensor | None = None
    confidences: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.tokens.shape[1])

    def truncated(self, lengths: Sequence[int]) -> "Proposal":
        """This proposal with row b's drafts cut to lengths[b] (<= its own) and the block to the
        longest kept (itself where nothing is cut)."""
        lengths = list(lengths)
        if not self.max_len or lengths == self.lengths.tolist():
            return self
        width = max(lengths, default=0)
        return replace(
            self,
            tokens=self.tokens[:, :width],
            lengths=torch.tensor(lengths, dtype=torch.long),
            q=None if self.q is None else self.q[:, :width],
            confidences=None if self.confidences is None else self.confidences[:, :width],
        )

    def with_rows(self, rows: Sequence[Sequence[int]], confidences: Sequence[Sequence[float]]) -> "Proposal":
        """This proposal with row b's drafts set to rows[b] wherever that is non-empty (deterministic
        drafts of another source, e.g. a lookup or the grammar's forced tokens, for a row this
        proposal left empty): q one-hot at them where the proposal has q, confidences[b] (one per
        draft) where it has confidences. Itself where every row is empty."""
        if not any(rows):
            return self
        B, K0 = len(rows), self.max_len
        K = max([len(r) for r in rows] + [K0])
        tokens = torch.zeros(B, K, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        tokens[:, :K0] = self.tokens.cpu()
        lengths[:] = self.lengths.cpu() if K0 else 0
        q = conf = None
        if self.q is not None:
            q = torch.zeros(B, K, self.q.shape[-1], dtype=self.q.dtype, device=self.q.device)
            q[:, :K0] = self.q
        if self.confidences is not None:
            conf = torch.zeros(B, K, dtype=torch.float32)
            conf[:, :K0] = self.confidences.float().cpu()
        for b, row in enumerate(rows):
            if not row:
                continue
            if lengths[b]:
                raise RuntimeError(f"row {b} has {int(lengths[b])} drafts of its own and {len(row)} of another source")
            n = len(row)
            tokens[b, :n] = torch.tensor(list(row), dtype=torch.long)
            lengths[b] = n
            if q is not None:  # the row's q padding need not be zero: one-hot rows only
                q[b] = 0
                q[b, torch.arange(n), torch.tensor(list(row))] = 1
            if conf is not None:
                conf[b] = 0
                conf[b, :n] = torch.tensor(list(confidences[b])[:n], dtype=torch.float32)
        return Proposal(tokens=tokens, lengths=lengths, q=q, confidences=conf)

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> "Proposal":
        return Proposal(
            tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
        )


@dataclass
class VerifyResult:
    """Outcome of one verification round.

    tokens:       [B, K+1] int64; row b commits tokens[b, :num_accepted[b] + 1]: the accepted
                  drafts followed by one token sampled from the target (the residual sample at
                  the first rejection, or the bonus token when every draft was accepted).
                  Entries past that are padding (-1).
    num_accepted: [B] int64 accepted draft tokens per row (0..lengths[b]).
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def num_committed(self) -> torch.Tensor:
        """[B] tokens committed per row this round (τ for that row): accepted + 1."""
        return self.num_accepted + 1

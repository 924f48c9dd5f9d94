"""A reduced draft vocabulary: the drafter scores only the most frequent target tokens.

The lm_head over a 49k–150k vocabulary is most of a small drafter's cost (on a CPU, ~80% of
a block drafter's training step); restricting the drafted tokens to the `size` most
frequent tokens of the training data costs a few points of acceptance where the target's
token falls outside, and buys that much cheaper training and drafting.

Conventions (EAGLE-3's, which vLLM / SGLang read): draft id i is target id i + d2t[i];
draft ids follow ascending target id; t2d [V] bool marks the target ids with a draft id.
A proposal's q is scattered back into the target vocabulary (zero outside), so the
verifier sees the distribution the token was actually drawn from and stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from draftsmith.errors import DraftsmithError


def build_vocab_map(token_counts: torch.Tensor | Sequence[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent target tokens (ties → lower id) as a draft vocabulary.

    Returns (d2t [size] int64, t2d [V] bool): draft id i is target id i + d2t[i]; draft ids
    follow ascending target id; t2d marks the target ids that have a draft id.
    """
    counts = torch.as_tensor(token_counts, dtype=torch.float64).flatten()
    V = counts.numel()
    if not 1 <= size <= V:
        raise DraftsmithError(f"draft vocabulary size {size} must be in [1, {V}] (the target vocabulary)")
    order = torch.sort(-counts, stable=True).indices[:size]
    ids = order.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


class DraftVocab(nn.Module):
    """d2t / t2d (saved with the weights) and the derived maps block drafters use:
    `ids` [Vd] target id per draft id, `index` [V] draft id per target id (Vd = outside)."""

    def __init__(self, vocab_size: int, size: int) -> None:
        super().__init__()
        if not 1 <= size <= vocab_size:
            raise DraftsmithError(f"draft_vocab_size {size} must be in [1, {vocab_size}] (the target vocabulary)")
        self.vocab_size, self.size = int(vocab_size), int(size)
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab_size) < size)
        self.register_buffer("ids", torch.arange(size), persistent=False)
        self.register_buffer("index", torch.zeros(vocab_size, dtype=torch.long), persistent=False)
        self._derive()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._derive())

    def _derive(self) -> None:
        with torch.no_grad():
            self.ids.copy_(torch.arange(self.size, device=self.d2t.device) + self.d2t)
            self.index.fill_(self.size)
            self.index[self.ids] = torch.arange(self.size, device=self.d2t.device)

    def set_counts(self, token_counts: torch.Tensor | Sequence[int]) -> None:
        """Choose the vocabulary from training-data token counts [V]."""
        d2t, t2d = build_vocab_map(token_counts, self.size)
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
        self._derive()

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids → draft ids (Vd for a token outside the draft vocabulary)."""
        return self.index[target_ids.to(self.index.device)]

    def scatter(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] draft-vocabulary probabilities → [..., V], zero outside."""
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        return out.index_copy_(-1, self.ids.to(q.device), q)

"""Anchor sampling and block packing for block drafters (DFlash, DSpark).

A training block reproduces one inference round. The anchor at sequence index a is the
"last committed" token: its own target features do not exist yet at inference (it is the
engine's pending token), so the block sees the target context at indices < a only, and it
drafts the tokens at a+1 .. a+γ.

Eligible anchors: a + 1 < length and loss_mask[a + 1] — the first token the block drafts is
one the drafter should learn (an assistant token). Later positions a+k are scored only where
a+k < length and loss_mask[a+k] (`BlockPack.target_mask`).

Packing: all blocks of a batch row share that row's context keys and go through one forward.
Block j of row b sees context key t iff t < anchors[b, j] (`context_mask`), and its own
positions bidirectionally; the block axis is kept separate ([B, A, n, ...]) so a block has no
keys of another block at all — blocks never see each other by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BlockPack:
    """Sampled anchors of a padded batch and everything derived from them.

    anchors:      [B, A] int64 sequence index of each block's anchor (0 where not valid)
    valid:        [B, A] bool, False on padding blocks (rows with fewer eligible anchors)
    context_mask: [B, A, T] bool, True where block (b, j) may attend context key t (t < anchor)
    target_index: [B, A, γ] int64 sequence index a+k of the token drafted at position k
                  (clamped into [0, T−1]; read `target_mask` before using it)
    target_mask:  [B, A, γ] bool, valid block & a+k < length & loss_mask[a+k]
    """

    anchors: torch.Tensor
    valid: torch.Tensor
    context_mask: torch.Tensor
    target_index: torch.Tensor
    target_mask: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.valid.sum())


def eligible_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: index a may anchor a block (a + 1 < length and loss_mask[a + 1])."""
    B, T = loss_mask.shape
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    idx = torch.arange(T, device=loss_mask.device)[None, :]
    return nxt & (idx + 1 < lengths.to(loss_mask.device)[:, None])


def sample_anchors(
    loss_mask: torch.Tensor,  # [B, T] bool
    lengths: torch.Tensor,  # [B] int64
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` distinct eligible anchors per row, uniformly without replacement,
    sorted ascending. Returns (anchors [B, A], valid [B, A]) with A = the most any row got
    (at least 1, so shapes stay non-empty). Uses only `generator` (on the CPU)."""
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    ok = eligible_anchors(loss_mask.cpu(), lengths.cpu())  # [B, T]
    picks: list[torch.Tensor] = []
    for row in ok:
        cand = row.nonzero().squeeze(-1)  # [n]
        if cand.numel() > max_anchors:
            perm = torch.randperm(cand.numel(), generator=generator)[:max_anchors]
            cand = cand[perm].sort().values
        picks.append(cand)
    A = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(len(picks), A, dtype=torch.long)
    valid = torch.zeros(len(picks), A, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, : p.numel()] = p
        valid[b, : p.numel()] = True
    dev = loss_mask.device
    return anchors.to(dev), valid.to(dev)


def pack_blocks(
    loss_mask: torch.Tensor,  # [B, T] bool
    lengths: torch.Tensor,  # [B]
    anchors: torch.Tensor,  # [B, A]
    valid: torch.Tensor,  # [B, A]
    gamma: int,
) -> BlockPack:
    """Context visibility and drafted-token bookkeeping for the given anchors."""
    B, T = loss_mask.shape
    dev = loss_mask.device
    t = torch.arange(T, device=dev)
    context_mask = (t[None, None, :] < anchors[:, :, None]) & valid[:, :, None]  # [B, A, T]
    k = torch.arange(1, gamma + 1, device=dev)
    idx = anchors[:, :, None] + k[None, None, :]  # [B, A, γ]
    inside = idx < lengths.to(dev)[:, None, None]
    idx_c = idx.clamp(max=T - 1)
    lm = loss_mask.bool().gather(1, idx_c.view(B, -1)).view_as(idx)
    return BlockPack(
        anchors=anchors,
        valid=valid,
        context_mask=context_mask,
        target_index=idx_c,
        target_mask=valid[:, :, None] & inside & lm,
    )


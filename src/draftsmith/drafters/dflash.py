"""DFlash: a block-parallel drafter (block diffusion style), one forward per block.

Two layouts of the block (`layout`), both drafting the tokens at a+1 .. a+γ after the
anchor a (the last committed token):

- "anchor-first" (the default; DeepSpec's DFlash baseline, our DSpark backbone, vLLM's
  sample_from_anchor=true): inputs = the anchor + γ−1 masks at positions a .. a+γ−1, and
  block position k−1 predicts a+k — the first draft comes from the anchor's own slot, as a
  plain language model's next token does.
- "mask-first" (z-lab's released DFlash models, sample_from_anchor=false): inputs = the
  anchor + γ masks at a .. a+γ, and the mask at a+k predicts a+k, so the first draft must
  fetch the anchor through attention (first-position acceptance 0.05-0.07 in issue 4's
  runs). Checkpoints written before `layout` existed are mask-first
  (drafters/checkpoint.py).

The hidden states at the drafted slots give the γ draft logits through the target's frozen
lm_head, and every position is sampled independently (q_k = the request's warp of those
logits). Backbone and context injection: drafters/block.py; inference
state: drafters/block_drafter.py. Loss: position-weighted CE (optionally + TV),
drafters/losses.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.warp import inverse_cdf, target_probs
from draftsmith.drafters.block import BlockBackbone, BlockConfig, BlockModel, resolve_block_config, target_logits_at
from draftsmith.drafters.block_drafter import BlockDrafter
from draftsmith.drafters.losses import BlockLossWeights, block_loss
from draftsmith.drafters.protocol import LossOutput, TrainBatch
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder

LAYOUTS = ("anchor-first", "mask-first")


@dataclass(frozen=True)
class DFlashConfig(BlockConfig):
    """DFlash drafter (defaults: docs/ALGORITHMS.md / the DFlash paper). γ = block_size drafts
    per block; `layout` as the module docstring. DFlash trains with CE only (ce_weight 1,
    tv_weight 0); an L1/TV term is available for ablations."""

    kind: Literal["dflash"] = "dflash"
    layout: Literal["anchor-first", "mask-first"] = "anchor-first"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout not in LAYOUTS:
            raise DraftsmithError(f"dflash config: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def anchor_first(self) -> bool:
        return self.layout == "anchor-first"


class DFlashModel(BlockModel):
    def __init__(self, target: Decoder, config: DFlashConfig) -> None:
        super().__init__()
        self.config = resolve_block_config(config, target)
        c = self.config
        self.backbone = BlockBackbone(target, c.layer_ids, c.num_layers, c.mask_token_id, c.intermediate_size,
                                      c.draft_vocab_size, c.init_from_target, c.qk_norm)

    def training_loss(self, batch: TrainBatch, generator: torch.Generator | None = None) -> LossOutput:
        c = self.config
        pf, sel = self.packed_training_forward(batch, generator, c.anchor_first)  # sel [B, A, γ]
        logits = self.backbone.draft_logits(pf.hidden[sel])  # [N, Vd]
        targets = self.backbone.to_draft(pf.targets[sel])
        position = torch.arange(c.block_size, device=sel.device).expand_as(sel)[sel]
        need_pt = c.tv_weight or c.kl_weight
        tl, rest, top1 = target_logits_at(self.backbone, batch, pf.pack) if need_pt else (None, None, None)
        terms = block_loss(
            logits, targets, position, c.block_size,
            BlockLossWeights(ce=c.ce_weight, tv=c.tv_weight, conf=0.0, kl=c.kl_weight), tl, None, c.position_decay,
            self.backbone.draft_ids, rest, top1,
        )
        parts = dict(terms.parts)
        parts.update(accuracy_parts(logits.detach(), targets, position))
        parts["blocks"] = float(pf.pack.num_blocks)
        return LossOutput(total=terms.total, parts=parts)

    def draft(self, hidden, anchors, params: Sequence[SamplingParams], uniforms, stop=None, masks=None):
        """Independent positions: q_k = warp(lm_head(h_k)); x_k by inverse CDF (argmax when greedy).
        With a reduced vocabulary q is scattered back into target ids (zero outside). No
        confidences, so `stop` is never asked. `masks` (core/draft_masks.py): position by
        position, each row's logits masked by its grammar after the drafts before it."""
        bb = self.backbone
        logits = bb.draft_logits(hidden)  # [B, n, Vd]
        if masks is not None:
            return self._draft_masked(logits, params, uniforms, masks)
        if all(p.greedy for p in params):  # the argmax is what inverse_cdf draws from the one-hot q
            return bb.to_target(logits.argmax(-1)), None, None
        q = target_probs(logits, list(params))  # [B, n, Vd]; one-hot rows for greedy requests
        B, n, Vd = q.shape
        tokens = inverse_cdf(q.reshape(B * n, Vd), uniforms.reshape(-1)).view(B, n)
        return bb.to_target(tokens), bb.to_target_q(q), None

    def _draft_masked(self, logits, params, uniforms, masks):
        bb = self.backbone
        greedy = all(p.greedy for p in params)
        toks, qs = [], []
        for k in range(logits.shape[1]):
            if masks.all_ended():
                break
            lk = masks.restrict(logits[:, k])
            if greedy:
                t = lk.argmax(-1)
            else:
                q = target_probs(lk[:, None], list(params))[:, 0]
                t = inverse_cdf(q, uniforms[:, k])
                qs.append(q)
            masks.consume(bb.to_target(t).tolist())
            toks.append(t)
        B = logits.shape[0]
        if not toks:
            return logits.new_zeros(B, 0, dtype=torch.long), None if greedy else logits.new_zeros(B, 0, 1), None
        tokens = bb.to_target(torch.stack(toks, 1))
        return tokens, None if greedy else bb.to_target_q(torch.stack(qs, 1)), None

    def make_drafter(self, target: Decoder, max_rows: int, max_len: int, temperatures=None) -> BlockDrafter:
        return BlockDrafter("dflash", self.backbone, self, self.config.block_size, self.config.anchor_first,
                            max_rows, max_len)


def build(target: Decoder, config: DFlashConfig) -> DFlashModel:
    return DFlashModel(target, config).to(target.device)


def accuracy_parts(logits: torch.Tensor, targets: torch.Tensor, position: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement with the data token, at block position 1 and over all positions."""
    if targets.numel() == 0:
        return {}
    hit = (logits.argmax(-1) == targets).float()
    first = position == 0
    out = {"acc": float(hit.mean())}
    if bool(first.any()):
        out["acc@1"] = float(hit[first].mean())
    return out

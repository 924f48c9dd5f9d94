"""DSpark: the DFlash backbone, a sequential stage, and a confidence head (DSpark paper).

Backbone change: the anchor itself is the first prediction position, so γ inputs (anchor +
γ−1 masks) give draft logits U_1..U_γ and hidden states h_1..h_γ in one forward.

Sequential stage, sampled left to right (x_0 = the anchor):

    p_k(v | x_0, x_<k) ∝ exp(U_k(v) + B_k(x_0, x_<k, v)),   e_{k−1} = W1[x_{k−1}] ∈ R^r

    markov (default): B_k = e_{k−1} W2                       W1 ∈ R^{V×r}, W2 ∈ R^{r×V}
    gated:            B_k = (σ(W_g [h_k ; e_{k−1}]) ⊙ e_{k−1}) W2
                      (our reading of the paper's "gated Markov" variant: the backbone's
                      state decides, per rank component, how much of the Markov bias applies)
    rnn:              z_k = [s_{k−1} ; e_{k−1} ; h_k],  (g, c, o) = split3(W z_k),
                      s_k = σ(g) ⊙ s_{k−1} + (1 − σ(g)) ⊙ tanh(c),  B_k = tanh(o) W2,  s_0 = 0

Confidence: c_k = σ(wᵀ [h_k ; e_{k−1}] + b), trained against c*_k = 1 − ½‖p_d,k − p_t,k‖₁.

W2 starts at zero, so an untrained DSpark drafts exactly like its backbone. In training the
stage is teacher-forced on the data tokens; at inference x_{k−1} is the token just sampled,
and the proposal's q_k is the request's warp of U_k + B_k — the distribution x_k was
actually drawn from, conditioned on the drafted prefix — so verification stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.warp import argmax_rows, inverse_cdf, target_probs
from draftsmith.drafters.block import BlockBackbone, BlockConfig, BlockModel, resolve_block_config, target_logits_at
from draftsmith.drafters.block_drafter import BlockDrafter
from draftsmith.drafters.dflash import accuracy_parts
from draftsmith.drafters.losses import BlockLossWeights, block_loss
from draftsmith.drafters.protocol import LossOutput, TrainBatch
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder

HEADS = ("markov", "gated", "rnn")


@dataclass(frozen=True)
class DSparkConfig(BlockConfig):
    """DSpark drafter (defaults: docs/ALGORITHMS.md / the DSpark paper). γ = block_size: block
    inputs = drafts (the anchor predicts the first draft)."""

    kind: Literal["dspark"] = "dspark"
    head: Literal["markov", "gated", "rnn"] = "markov"  # sequential stage
    rank: int = 256  # r of W1 ∈ R^{V×r}, W2 ∈ R^{r×V} (and the RNN state width)
    ce_weight: float = 0.1  # L = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    anchor_first = True  # the only DSpark layout (a class constant, not a field)

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.head not in HEADS:
            problems.append(f"head must be one of {', '.join(HEADS)}, got {self.head!r}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            problems.append(f"rank must be an integer >= 1, got {self.rank!r}")
        if problems:
            raise DraftsmithError("dspark config: " + "; ".join(problems))


class SequentialHead(nn.Module):
    """B_k and the confidence logit from (h_k, x_{k−1}[, s_{k−1}])."""

    def __init__(self, kind: str, vocab_size: int, hidden_size: int, rank: int, extra_rows: int = 0) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        # W1 [Vd (+1: the row of every token outside a reduced vocabulary), r]
        self.w1 = nn.Embedding(vocab_size + extra_rows, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)  # W2 (stored as [Vd, r])
        if kind == "gated":
            self.gate = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.cell = nn.Linear(2 * rank + hidden_size, 3 * rank)  # W_g, W_c, W_o in one
        self.conf = nn.Linear(hidden_size + rank, 1)  # w, b
        nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(rank))
        nn.init.zeros_(self.w2.weight)
        for m in (getattr(self, "gate", None), getattr(self, "cell", None)):
            if m is not None:
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.zeros_(self.conf.weight)
        nn.init.zeros_(self.conf.bias)

    def init_state(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(*shape, self.rank) if self.kind == "rnn" else None

    def step(
        self, h: torch.Tensor, e: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [..., H], e = W1[x_{k−1}] [..., r], s_{k−1} → (rank vector o_k [..., r], s_k);
        B_k = W2(o_k)."""
        if self.kind == "markov":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate(torch.cat([h, e], -1))) * e, None
        g, c, o = self.cell(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        return torch.tanh(o), gate * state + (1 - gate) * torch.tanh(c)

    def confidence_logit(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """wᵀ[h_k ; e_{k−1}] + b: [..., H], [..., r] → [...]."""
        return self.conf(torch.cat([h, e], -1)).squeeze(-1)

    def confidence_parts(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The confidence logit split as (w_hᵀ h_k + b) + w_eᵀ e_{k−1}, for inference, where h is
        known for every position before e is: (w_hᵀ h + b [...] float32, w_e [r] in W1's dtype)."""
        H = h.shape[-1]
        w = self.conf.weight[0]
        z_h = (h @ w[:H].to(h.dtype)).float() + self.conf.bias.float()
        return z_h, w[H:].to(self.w1.weight.dtype)

    def teacher_forced(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All block positions at once from the data prefix: h [B, A, γ, H], prev [B, A, γ]
        → (rank vectors o [B, A, γ, r], confidence logits [B, A, γ])."""
        e = self.w1(prev)  # [B, A, γ, r]
        if self.kind != "rnn":
            o, _ = self.step(h, e, None)
        else:
            state = self.init_state(h.shape[:2], h)
            outs = []
            for k in range(h.shape[2]):
                ok, state = self.step(h[:, :, k], e[:, :, k], state)
                outs.append(ok)
            o = torch.stack(outs, dim=2)
        return o, self.confidence_logit(h, e)


class DSparkModel(BlockModel):
    def __init__(self, target: Decoder, config: DSparkConfig) -> None:
        super().__init__()
        self.config = resolve_block_config(config, target)
        c = self.config
        self.backbone = BlockBackbone(target, c.layer_ids, c.num_layers, c.mask_token_id, c.intermediate_size,
                                      c.draft_vocab_size, c.init_from_target, c.qk_norm)
        self.seq_head = SequentialHead(c.head, self.backbone.draft_size, target.config.hidden_size, c.rank,
                                       extra_rows=int(self.backbone.vocab is not None))

    def training_loss(self, batch: TrainBatch, generator: torch.Generator | None = None) -> LossOutput:
        c = self.config
        pf, sel = self.packed_training_forward(batch, generator, c.anchor_first)  # sel [B, A, γ]
        bb = self.backbone
        o, conf = self.seq_head.teacher_forced(pf.hidden, bb.to_draft(pf.prev))
        logits = bb.draft_logits(pf.hidden[sel]) + self.seq_head.w2(o[sel]).float()  # [N, Vd]
        targets = bb.to_draft(pf.targets[sel])
        position = torch.arange(c.block_size, device=sel.device).expand_as(sel)[sel]
        need_pt = c.tv_weight > 0 or c.kl_weight > 0 or c.conf_weight > 0
        tl, rest, top1 = target_logits_at(bb, batch, pf.pack) if need_pt else (None, None, None)
        terms = block_loss(
            logits, targets, position, c.block_size,
            BlockLossWeights(ce=c.ce_weight, tv=c.tv_weight, conf=c.conf_weight, kl=c.kl_weight), tl, conf[sel],
            c.position_decay, bb.draft_ids, rest, top1,
        )
        parts = dict(terms.parts)
        parts.update(accuracy_parts(logits.detach(), targets, position))
        parts["blocks"] = float(pf.pack.num_blocks)
        return LossOutput(total=terms.total, parts=parts)

    def draft(self, hidden, anchors, params: Sequence[SamplingParams], uniforms, stop=None, masks=None):
        """Left to right: q_k = warp(U_k + B_k(x_0, x_<k)), x_k ~ q_k (argmax when greedy), in
        draft ids; tokens and q go back to target ids (q zero outside a reduced vocabulary).
        `masks` (core/draft_masks.py): U_k + B_k masked by each row's grammar after x_<k; the
        loop ends once every row has ended under its grammar.

        The confidence's h part of every position is one product before the loop
        (`SequentialHead.confidence_parts`), so a step is the W1 row, the confidence's r-wide
        dot, the W2 product and the sample (the same values up to summation order). At batch 1
        on a CPU a step's time is mostly W2 read back from memory.

        c_k reads x_{k-1}, so it is known before x_k is drafted: `stop(k, z_k)` (BlockSampler)
        is asked right then, and on True the loop ends without the W2 product and the sample."""
        bb, sh = self.backbone, self.seq_head
        U = bb.draft_logits(hidden)  # [B, n, Vd]
        B, n, Vd = U.shape
        plist = list(params)
        prev = bb.to_draft(anchors)
        state = sh.init_state((B,), hidden)
        z_h, w_e = sh.confidence_parts(hidden)  # [B, n], [r]
        toks, qs, confs = [], [], []
        greedy = all(p.greedy for p in plist)  # argmax = what inverse_cdf draws from the one-hot q; no q needed
        for k in range(n):
            if masks is not None and masks.all_ended():
                break
            e = F.embedding(prev, sh.w1.weight)  # [B, r]
            z = z_h[:, k] + (e @ w_e).float()
            if stop is not None and stop(k, z):
                break
            o, state = sh.step(hidden[:, k], e, state)
            logits = U[:, k] + sh.w2(o).float()
            if masks is not None:
                logits = masks.restrict(logits)
            if greedy:
                prev = argmax_rows(logits)  # through the CPU kernel where built (torch: ~40 us a row)
            else:
                q = target_probs(logits[:, None], plist)[:, 0]  # [B, V]; one-hot on greedy rows
                prev = inverse_cdf(q, uniforms[:, k])
                qs.append(q)
            if masks is not None:
                masks.consume(bb.to_target(prev).tolist())
            toks.append(prev)
            confs.append(z)
        if not toks:  # stopped before the first draft
            empty = anchors.new_zeros(B, 0)
            return empty, None if greedy else hidden.new_zeros(B, 0, 1), hidden.new_zeros(B, 0)
        if greedy:
            return bb.to_target(torch.stack(toks, 1)), None, torch.stack(confs, 1)
        return bb.to_target(torch.stack(toks, 1)), bb.to_target_q(torch.stack(qs, 1)), torch.stack(confs, 1)

    def make_drafter(self, target: Decoder, max_rows: int, max_len: int, temperatures=None) -> BlockDrafter:
        return BlockDrafter("dspark", self.backbone, self, self.config.block_size, self.config.anchor_first, max_rows, max_len,
                            temperatures=temperatures)


def build(target: Decoder, config: DSparkConfig) -> DSparkModel:
    return DSparkModel(target, config).to(target.device)

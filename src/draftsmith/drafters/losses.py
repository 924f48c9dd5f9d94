"""Drafter training losses (docs/ALGORITHMS.md: DSpark, DFlash, EAGLE-3).

Notation: p_t is the target's distribution (softmax of lm_head(final_hidden) at T = 1),
p_d the drafter's; k = 1..γ is a position inside a draft block.

Block drafters (DFlash, DSpark), each term position-weighted by w_k = exp(−(k−1)/γ):

    L_ce   = −Σ w_k log p_d,k(x*_k)
    L_tv   =  Σ w_k ‖p_d,k − p_t,k‖₁                    (the L1 norm, i.e. 2 × TV, as written)
    L_conf = −Σ w_k [c*_k log c_k + (1 − c*_k) log(1 − c_k)],  c*_k = 1 − ½‖p_d,k − p_t,k‖₁
    L      = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf             (DSpark; DFlash: L_ce only)
    L_kl   =  Σ w_k KL(p_t,k ‖ p_d,k)                      (optional, `kl` weight; 0 in the papers)

L_kl is an addition for short budgets: while acceptance is near zero the TV gradient is tiny
(|∂‖p_d − p_t‖₁| scales with the overlap) and L_ce sees one sampled token per position, while
the KL term gives every position the target's whole distribution (as EAGLE-3's loss does).
With a reduced vocabulary it runs over D (p_t's mass outside D is a constant).

The soft label c*_k is the probability that draft k is accepted when drafted from p_d,k
(1 − TV); it is a label, so no gradient flows into it. With a reduced draft vocabulary D,
p_d lives on D: ‖p_d − p_t‖₁ = Σ_D |p_d − p_t| + p_t(V∖D) (the target mass no draft can
reach), and L_ce skips items whose x*_k is outside D. Every sum is normalised as a
weighted mean, Σ_i w_{k_i} ℓ_i / Σ_i w_{k_i} over the valid (block, position) pairs, so the
scale does not depend on how many blocks or masked positions a batch has.

EAGLE-3: forward KL(p_t ‖ p_d) at every training-time-test step i = 0..S−1 (the gradient of
the soft cross-entropy −Σ p_t log p_d, minus the constant target entropy so 0 is the
optimum), a plain mean over the step's valid positions, summed with weights 0.8^i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def position_weights(gamma: int, decay: float | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """w_k = exp(−(k−1)/decay) for k = 1..γ → [γ] float32; decay defaults to γ."""
    d = float(gamma if decay is None else decay)
    return torch.exp(-torch.arange(gamma, dtype=torch.float32, device=device) / d)


def ttt_step_weights(steps: int, decay: float = 0.8, device: torch.device | str | None = None) -> torch.Tensor:
    """EAGLE-3 training-time-test step weights decay^i for i = 0..steps−1 → [steps]."""
    return decay ** torch.arange(steps, dtype=torch.float32, device=device)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w v / Σ w over matching shapes; 0 (keeping the graph) when there is nothing to average."""
    total = weights.sum()
    if float(total) <= 0:
        return (values * 0).sum()
    return (values * weights).sum() / total


# ---------------------------------------------------------------------------- per-item terms


def token_cross_entropy(draft_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """−log p_d(x*): draft_logits [N, V], targets [N] → [N]."""
    return F.cross_entropy(draft_logits.float(), targets, reduction="none")


def l1_distance(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """‖p_d − p_t‖₁ over the last dim: [N, V], [N, V] → [N] (in [0, 2])."""
    return (p_draft.float() - p_target.float()).abs().sum(-1)


def forward_kl(draft_logits: torch.Tensor, target_probs: torch.Tensor,
               target_neg_entropy: torch.Tensor | None = None) -> torch.Tensor:
    """KL(p_t ‖ p_d) = Σ p_t log p_t − Σ p_t log p_d: [N, V] logits, [N, V] probs → [N].
    `target_neg_entropy` [N] = Σ p_t log p_t when the caller has it (a constant of the target:
    EAGLE-3 computes it once per batch, not at each of its 7 steps over [N, V])."""
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    pt = target_probs.float()
    if target_neg_entropy is None:
        return (torch.xlogy(pt, pt) - pt * log_pd).sum(-1)
    return target_neg_entropy.float() - (pt * log_pd).sum(-1)


def confidence_bce(conf_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """−[c* log σ(z) + (1 − c*) log(1 − σ(z))] with soft labels c* ∈ [0, 1]: [N], [N] → [N]."""
    return F.binary_cross_entropy_with_logits(conf_logits.float(), labels.float(), reduction="none")


# ---------------------------------------------------------------------------- combined losses


@dataclass(frozen=True)
class BlockLossWeights:
    """Coefficients of L = ce·L_ce + tv·L_tv + conf·L_conf (DSpark paper: 0.1 / 0.9 / 1.0)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    kl: float = 0.0


@dataclass
class LossTerms:
    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)


def block_loss(
    draft_logits: torch.Tensor,  # [N, Vd] sequential draft logits (U_k + B_k) at valid positions
    targets: torch.Tensor,  # [N] x*_k as a draft id (Vd = outside a reduced draft vocabulary)
    position: torch.Tensor,  # [N] 0-based k − 1 of each item inside its block
    gamma: int,
    coef: BlockLossWeights,
    target_logits: torch.Tensor | None = None,  # [N, V] lm_head(final_hidden) of the target
    conf_logits: torch.Tensor | None = None,  # [N] confidence-head logits
    decay: float | None = None,
    draft_ids: torch.Tensor | None = None,  # [Vd] target id per draft id; None: Vd = V
    target_rest_lse: torch.Tensor | None = None,  # [N]: target_logits are over the draft vocabulary only,
    target_top1: torch.Tensor | None = None,  # [N]    this the log-sum-exp of the rest; the target's argmax
) -> LossTerms:
    """The DFlash / DSpark objective over N valid (block, position) items. The target's
    distribution comes as its full logits [N, V], or (with a reduced draft vocabulary) as its
    logits over the draft vocabulary [N, Vd] with the log-sum-exp of the other logits and its
    argmax token: the same numbers (BlockBackbone.target_stats)."""
    w = position_weights(gamma, decay, draft_logits.device)[position]  # [N]
    parts: dict[str, float] = {}
    total = draft_logits.new_zeros(())
    if coef.ce:
        Vd = draft_logits.shape[-1]
        inside = (targets < Vd).float()
        ce = weighted_mean(token_cross_entropy(draft_logits, targets.clamp(max=Vd - 1)), w * inside)
        total = total + coef.ce * ce
        parts["ce"] = float(ce.detach())
    need_pt = coef.tv or coef.kl or (coef.conf and conf_logits is not None)
    if need_pt:
        if target_logits is None:
            raise ValueError("the TV and confidence terms need the target's logits")
        pd = torch.softmax(draft_logits.float(), -1)
        log_pt = None
        if target_rest_lse is not None:  # logits over the draft vocabulary + the rest's log-sum-exp
            if draft_ids is None or target_top1 is None:
                raise ValueError("target_rest_lse needs draft_ids and target_top1")
            tl = target_logits.float()
            lse = torch.logaddexp(torch.logsumexp(tl, -1), target_rest_lse.float())  # [N]
            log_pt = tl - lse[:, None]
            pt = torch.exp(log_pt)
            l1 = l1_distance(pd, pt) + torch.exp(target_rest_lse.float() - lse)  # + the mass outside
        else:
            pt = torch.softmax(target_logits.float(), -1)
            if draft_ids is None:
                l1 = l1_distance(pd, pt)  # [N]
            else:
                pt = pt[:, draft_ids]
                l1 = l1_distance(pd, pt) + (1.0 - pt.sum(-1)).clamp(min=0.0)
        if coef.kl:
            log_pd = torch.log_softmax(draft_logits.float(), -1)
            neg_entropy = torch.xlogy(pt, pt) if log_pt is None else pt * log_pt  # (log_pt: no log pass)
            kl = weighted_mean((neg_entropy - pt * log_pd).sum(-1), w)
            total = total + coef.kl * kl
            parts["kl"] = float(kl.detach())
        if coef.tv:
            tv = weighted_mean(l1, w)
            total = total + coef.tv * tv
            parts["tv"] = float(tv.detach())
        if coef.conf and conf_logits is not None:
            label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)  # c*_k: acceptance prob of draft k
            conf = weighted_mean(confidence_bce(conf_logits, label), w)
            total = total + coef.conf * conf
            parts["conf"] = float(conf.detach())
        parts["accept"] = float(weighted_mean(1.0 - 0.5 * l1.detach(), torch.ones_like(w)))
        # T = 0 agreement: the draft's argmax is the target's (teacher-forced greedy acceptance)
        d_arg = draft_logits.detach().argmax(-1)
        t_arg = target_logits.argmax(-1) if target_top1 is None else target_top1
        same = ((d_arg if draft_ids is None else draft_ids[d_arg]) == t_arg).float()
        parts["greedy"] = float(same.mean())
        if bool((position == 0).any()):
            parts["greedy@1"] = float(same[position == 0].mean())
    return LossTerms(total=total, parts=parts)


def ttt_loss(
    step_draft_logits: Sequence[torch.Tensor],  # per step i: [N_i, V'] draft logits
    step_target_probs: Sequence[torch.Tensor],  # per step i: [N_i, V'] target probs (same vocab)
    decay: float = 0.8,
    step_target_neg_entropy: Sequence[torch.Tensor] | None = None,  # per step i: [N_i] Σ p_t log p_t
) -> LossTerms:
    """EAGLE-3: Σ_i decay^i · mean_n KL(p_t ‖ p_d) over each step's valid positions."""
    total: torch.Tensor | None = None
    parts: dict[str, float] = {}
    for i, (dl, tp) in enumerate(zip(step_draft_logits, step_target_probs)):
        kl = forward_kl(dl, tp, None if step_target_neg_entropy is None else step_target_neg_entropy[i])
        step = kl.mean() if kl.numel() else dl.sum() * 0
        term = (decay**i) * step
        total = term if total is None else total + term
        parts[f"kl@{i}"] = float(step.detach())
    if total is None:
        raise ValueError("ttt_loss needs at least one step")
    return LossTerms(total=total, parts=parts)


def logit(p: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """log(p / (1 − p)) with p clamped into (eps, 1 − eps)."""
    p = p.clamp(eps, 1 - eps)
    return torch.log(p) - torch.log1p(-p)


def temperature_scale(conf: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """STS at inference: c'_k = σ(logit(c_k) / T_k) over the last dim (positions beyond the
    temperatures given keep T = 1). conf [..., K] → [..., K]."""
    K = conf.shape[-1]
    t = [float(x) for x in temperatures[:K]] + [1.0] * max(0, K - len(temperatures))
    if any(not (x > 0 and math.isfinite(x)) for x in t):
        raise ValueError(f"STS temperatures must be positive and finite, got {list(temperatures)}")
    T = torch.tensor(t, dtype=torch.float32, device=conf.device)
    return torch.sigmoid(logit(conf.float()) / T)

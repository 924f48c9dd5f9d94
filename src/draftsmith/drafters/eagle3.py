"""EAGLE-3: an autoregressive one-layer drafter over fused low / mid / high target features.

Model (EAGLE-3 paper; docs/ALGORITHMS.md):
- g_t = fc([f_low ; f_mid ; f_high]_t)  (3H → H), the fused target feature at position t;
- one decoder layer whose attention input is [RMSNorm(embed(x_{t+1})) ; RMSNorm(g_t)] (2H
  wide), with g_t as the residual stream; its output h_t (before the final norm) predicts
  x_{t+2} through the drafter's own lm_head;
- optional reduced draft vocabulary: the lm_head scores only the `draft_vocab_size` most
  frequent target tokens (d2t: draft id i ↦ target id i + d2t[i]; t2d: bool mask over the
  target vocabulary); `build_vocab_map` makes the maps from token counts.

Training-time test (TTT, `ttt_steps`, default 7): step 0 runs on target features; at step
i > 0 the feature slot of every position holds the drafter's own step-(i−1) output, and
the token slot the next data token, so position t at step i plays draft i+1 of a round
whose context ends at t. Its query (RoPE position t+i) sees the step-0 keys at ≤ t and its
own column's keys of steps 1..i (positions t+1..t+i) — exactly the keys it sees at
inference. Step i's forward KL against the target is weighted 0.8^i.

Inference: per engine row, a one-layer KVCache of step-0 keys/values at context positions
0..num_tokens−2 (position j pairs the feature of token j with token j+1), plus the layer
output at the last context position, which proposes the first draft. Draft steps write
temporary keys past the context length; `on_verified` recomputes the committed positions
from target features, overwriting them (rollback = the length never moved).
With a reduced vocabulary, q over the target vocabulary is the draft distribution
scattered into the target ids (zero elsewhere), so verification stays exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.draft_masks import DraftMasks, MaskPool
from draftsmith.core.types import Proposal
from draftsmith.core.warp import inverse_cdf, target_probs
from draftsmith.drafters.base import FeatureSpec, RequestStates, row_uniforms
from draftsmith.drafters.block import resolve_feature_layers
from draftsmith.drafters.block_attention import InjectedAttention, head_rope, merge_heads
from draftsmith.drafters.feature_queue import FLUSH_TOKENS, FeatureQueueDrafter, FeatureRequestState
from draftsmith.drafters.target_head import TargetHead, concat_features, init_linear_
from draftsmith.drafters.vocab import build_vocab_map
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import MLP, Decoder, RMSNorm
from draftsmith.models.rope import rope_inv_freq
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import pack_linears_for_inference_
from draftsmith.drafters.losses import ttt_loss
from draftsmith.drafters.protocol import LossOutput, TrainBatch


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3 drafter (defaults: docs/ALGORITHMS.md / the EAGLE-3 paper)."""

    kind: Literal["eagle3"] = "eagle3"
    layer_ids: tuple[int, ...] = ()  # target feature layers; () = low / mid / high over [1, L−3]
    ttt_steps: int = 7  # training-time-test unroll
    ttt_decay: float = 0.8  # step i loss weight decay^i
    draft_vocab_size: int | None = None  # reduced draft vocabulary; None = the full target vocab
    intermediate_size: int | None = None  # draft MLP width; None = the target's
    freeze_lm_head: bool = False  # keep the target's lm_head rows (as DeepSpec does against DSpark, whose
    # block drafters score with the target's frozen lm_head): the like-for-like comparison

    def __post_init__(self) -> None:
        if isinstance(self.layer_ids, list):
            object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        problems = []
        if not isinstance(self.ttt_steps, int) or isinstance(self.ttt_steps, bool) or self.ttt_steps < 1:
            problems.append(f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}")
        if not isinstance(self.ttt_decay, (int, float)) or not 0 < self.ttt_decay <= 1:
            problems.append(f"ttt_decay must be in (0, 1], got {self.ttt_decay!r}")
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 1):
            problems.append(f"draft_vocab_size must be a positive integer or null, got {self.draft_vocab_size!r}")
        if self.intermediate_size is not None and (not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            problems.append(f"intermediate_size must be a positive integer or null, got {self.intermediate_size!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.layer_ids):
            problems.append(f"layer_ids must be integers, got {self.layer_ids!r}")
        elif len(set(self.layer_ids)) != len(self.layer_ids):
            problems.append(f"layer_ids repeat: {list(self.layer_ids)}")
        if problems:
            raise DraftsmithError("eagle3 config: " + "; ".join(problems))


class EagleLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)  # on the feature slot
        self.self_attn = InjectedAttention(cfg, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def project(self, emb: torch.Tensor, feat: torch.Tensor, cos, sin):
        """emb, feat [B, S, H] → q [B, Hq, S, D], k, v [B, Hkv, S, D] (cos/sin [B|1, 1, S, D])."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)  # [B, S, 2H]
        q = self.self_attn.query(x, cos, sin)
        k, v = self.self_attn.key_value(x, cos, sin)
        return q, k, v

    def finish(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual on the feature slot, then the MLP: attn [B, Hq, S, D] → h [B, S, H]."""
        h = feat + self.self_attn.o_proj(merge_heads(attn))
        return h + self.mlp(self.post_attention_layernorm(h))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask0: torch.Tensor) -> torch.Tensor:
    """TTT step i attention. q [B, Hq, T, D]; keys/values: steps 0..i, each [B, Hkv, T, D];
    mask0 [B, T, T] (causal & valid) for the step-0 keys; the keys of steps 1..i are seen
    only by their own column. → [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    Hkv = keys[0].shape[1]
    g = Hq // Hkv
    qg = q.reshape(B, Hkv, g, T, D) * D**-0.5
    s0 = torch.einsum("bkgtd,bksd->bkgts", qg, keys[0]).float()  # [B, Hkv, g, T, T]
    s0 = s0.masked_fill(~mask0[:, None, None], float("-inf"))
    diag = [torch.einsum("bkgtd,bktd->bkgt", qg, k).float()[..., None] for k in keys[1:]]
    p = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1).to(q.dtype)
    out = torch.einsum("bkgts,bksd->bkgtd", p[..., :T], values[0])
    for j, v in enumerate(values[1:]):
        out = out + p[..., T + j, None] * v[:, :, None]
    return out.reshape(B, Hq, T, D)


class Eagle3Model(nn.Module):
    def __init__(self, target: Decoder, config: Eagle3Config) -> None:
        super().__init__()
        tc = target.config
        ids = resolve_feature_layers(config.layer_ids, 3, tc.num_layers, "eagle3")
        vd = config.draft_vocab_size or tc.vocab_size
        if vd > tc.vocab_size:
            raise DraftsmithError(f"eagle3 config: draft_vocab_size {vd} exceeds the target vocabulary {tc.vocab_size}")
        self.config = dataclasses.replace(config, layer_ids=ids, draft_vocab_size=config.draft_vocab_size)
        self.cfg = dataclasses.replace(tc, num_layers=1, intermediate_size=config.intermediate_size or tc.intermediate_size)
        H = tc.hidden_size
        self.layer_ids = ids
        self.fc = nn.Linear(len(ids) * H, H, bias=False)
        self.layer = EagleLayer(self.cfg)
        self.norm = RMSNorm(H, tc.rms_norm_eps)
        self.lm_head = nn.Linear(H, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))  # saved with the weights
        self.register_buffer("t2d", torch.arange(tc.vocab_size) < vd)
        inv, scale = rope_inv_freq(tc.rope, tc.head_dim, tc.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.head = TargetHead.of(target)
        init_linear_(self)
        self._init_lm_head()
        self.lm_head.weight.requires_grad_(not config.freeze_lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(layer_ids=self.layer_ids)

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @property
    def reduced_vocab(self) -> bool:
        return self.d2t.numel() < self.head.vocab_size

    def _init_lm_head(self) -> None:
        with torch.no_grad():
            self.lm_head.weight.copy_(self.head.lm_head[self.draft_ids.to(self.head.lm_head.device)].to(self.lm_head.weight))

    def init_draft_vocab(self, token_counts: torch.Tensor | Sequence[int]) -> None:
        """Choose the reduced vocabulary from training-data token counts [V] (call before
        training when draft_vocab_size is set); re-initialises the lm_head from the target's."""
        d2t, t2d = build_vocab_map(token_counts, self.d2t.numel())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._init_lm_head()

    # -- pieces shared by training and inference

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.fc(concat_features(hidden, self.layer_ids, self.dtype))  # g [B, T, H]

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return head_rope(self.inv_freq, positions, self.rope_scale, dtype)  # [B, 1, S, D]

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] → draft-vocabulary logits [..., Vd] (float32)."""
        return self.lm_head(self.norm(h)).float()

    # -- training

    def ttt_forward(self, batch: TrainBatch, steps: int | None = None) -> list[torch.Tensor]:
        """Unrolled training-time test: per step i, the layer output h_i [B, T, H] at every
        column t (h_i[:, t] plays draft i+1 of a round whose context ends at t, fed the data
        tokens x_{t+1..t+1+i}; its logits predict x_{t+2+i})."""
        ids, lengths = batch.input_ids, batch.lengths.to(batch.input_ids.device)
        B, T = ids.shape
        t = torch.arange(T, device=ids.device)
        valid_key = t[None, :] < lengths[:, None]  # [B, T]
        mask0 = (t[None, :, None] >= t[None, None, :]) & valid_key[:, None, :]  # [B, query, key]
        feat = self.features(batch.hidden)  # g [B, T, H]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        for i in range(steps or self.config.ttt_steps):
            tok_idx = t + 1 + i  # token slot: x_{t+1+i}
            tok = ids.gather(1, tok_idx.clamp(max=T - 1).expand(B, T)).masked_fill(tok_idx[None] >= T, 0)
            cos, sin = self.rope((t + i)[None], feat.dtype)
            q, k, v = self.layer.project(self.head.embed_ids(tok, self.dtype), feat, cos, sin)
            keys.append(k)
            values.append(v)
            feat = self.layer.finish(feat, ttt_attention(q, keys, values, mask0))  # next feature slot
            out.append(feat)
        return out

    def training_loss(self, batch: TrainBatch, generator: torch.Generator | None = None) -> LossOutput:
        """Σ_i 0.8^i KL(p_t ‖ p_d) at the loss-masked positions of every TTT step (the
        generator is unused: every position trains, no anchors are sampled)."""
        ids, lengths = batch.input_ids, batch.lengths.to(batch.input_ids.device)
        B, T = ids.shape
        t = torch.arange(T, device=ids.device)
        draft_ids = self.draft_ids
        with torch.no_grad():
            # p_t over the draft vocabulary at every column, once: step i reads column t+1+i.
            # Only the draft rows of the lm_head are computed (the softmax over them equals
            # the renormalised restriction of the full softmax).
            lm = self.head.lm_head[draft_ids.to(self.head.lm_head.device)] if self.reduced_vocab else self.head.lm_head
            log_p_t = F.log_softmax(F.linear(batch.final_hidden.to(lm.dtype), lm).float(), dim=-1)  # [B, T, Vd]
            p_t = log_p_t.exp()
            neg_entropy = (p_t * log_p_t).sum(-1)  # [B, T] Σ p_t log p_t: the KL's constant, once for all steps
            del log_p_t
        step_logits, step_targets, step_neg_entropy = [], [], []
        parts: dict[str, float] = {}
        for i, h in enumerate(self.ttt_forward(batch)):
            tgt = t + 2 + i  # predicts x_{t+2+i}; the target's p from final_hidden[t+1+i]
            sel = (tgt[None] < lengths[:, None]) & batch.loss_mask.bool().gather(1, tgt.clamp(max=T - 1).expand(B, T))
            rows, cols = sel.nonzero(as_tuple=True)
            dl = self.draft_logits(h[rows, cols])  # [N, Vd]
            step_logits.append(dl)
            step_targets.append(p_t[rows, cols + 1 + i])
            step_neg_entropy.append(neg_entropy[rows, cols + 1 + i])
            if i == 0 and rows.numel():
                x_star = ids[rows, cols + 2]
                parts["acc@1"] = float((draft_ids[dl.detach().argmax(-1)] == x_star).float().mean())
        terms = ttt_loss(step_logits, step_targets, self.config.ttt_decay, step_neg_entropy)
        parts.update(terms.parts)
        return LossOutput(total=terms.total, parts=parts)

    def make_drafter(self, target: Decoder, max_rows: int, max_len: int, temperatures=None) -> "EagleDrafter":
        return EagleDrafter(self, max_rows, max_len)


def build(target: Decoder, config: Eagle3Config) -> Eagle3Model:
    return Eagle3Model(target, config).to(target.device)


class EagleDrafter(FeatureQueueDrafter):
    """Inference for Eagle3Model. State per engine row: `cache` (step-0 K/V at context
    positions 0..num_tokens−2) and `last_hidden[row]` (layer output at the last context
    position); per request, `states` keeps a `FeatureRequestState` (the request's
    `drafter_gen` and its queued target features, drafters/feature_queue.py)."""

    name = "eagle3"
    follows_prefix_cache = True
    grammar_masks = True  # rows with a grammar draft under it (core/draft_masks.py)

    def __init__(self, model: Eagle3Model, max_rows: int, max_len: int) -> None:
        self.model = pack_linears_for_inference_(model)  # prepacked at inference; trains as before
        # Context position j pairs the features of j with token j + 1: a row's context follows
        # the prefix cache one position short of the matched prefix (feature_queue.py)
        self.needs = FeatureSpec(layer_ids=model.layer_ids, follows_prefix_cache=self.follows_prefix_cache,
                                 reuse_margin=1)
        self.feature_layers = model.layer_ids
        self.states: RequestStates[FeatureRequestState] = RequestStates(self.name)
        self.mask_pool = MaskPool()
        c = model.cfg
        self.device = model.fc.weight.device
        self.cache = KVCache(1, max_rows, c.num_kv_heads, max_len, c.head_dim, dtype=model.dtype, device=self.device)
        self.last_hidden = torch.zeros(max_rows, c.hidden_size, dtype=model.dtype, device=self.device)
        self.flush_tokens = FLUSH_TOKENS

    def _attend(self, rows: torch.Tensor, q: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, S, D] at positions qpos [B, S]: causal attention over the cached keys."""
        kv_len = int(qpos.max()) + 1
        keys = self.cache.k[0][rows, :, :kv_len]
        values = self.cache.v[0][rows, :, :kv_len]
        mask = (torch.arange(kv_len, device=self.device)[None, None, :] <= qpos[:, :, None])[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1])

    def _write(self, rows: list[int], starts: list[int], counts: list[int], k, v) -> None:
        kc, vc = self.cache.k[0], self.cache.v[0]
        for b, (r, s0, n) in enumerate(zip(rows, starts, counts)):
            if s0 + n > self.cache.max_len:
                raise DraftsmithError(f"eagle3 drafter context for row {r} would exceed {self.cache.max_len} tokens")
            kc[r, :, s0 : s0 + n] = k[b, :, :n]
            vc[r, :, s0 : s0 + n] = v[b, :, :n]

    @torch.inference_mode()
    def _extend(self, rows: list[int], feats: dict[int, torch.Tensor], tokens: list[list[int]]) -> None:
        """Add context positions for rows: feats [B, S, ·] per layer, tokens[b] = the next
        token of each new position (len = the count to keep)."""
        m = self.model
        counts = [len(x) for x in tokens]
        S = max(counts)
        g = m.features({i: f[:, :S].to(self.device) for i, f in feats.items()})  # [B, S, H]
        nxt = torch.zeros(len(rows), S, dtype=torch.long, device=self.device)
        for b, x in enumerate(tokens):
            nxt[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        starts = self.cache.lengths[rows].tolist()
        qpos = torch.tensor(starts, device=self.device)[:, None] + torch.arange(S, device=self.device)  # [B, S]
        cos, sin = m.rope(qpos, g.dtype)
        q, k, v = m.layer.project(m.head.embed_ids(nxt, m.dtype), g, cos, sin)
        self._write(rows, starts, counts, k, v)
        r = torch.tensor(rows)
        h = m.layer.finish(g, self._attend(r, q, qpos))  # [B, S, H]
        for b, (row, n) in enumerate(zip(rows, counts)):
            self.last_hidden[row] = h[b, n - 1]
            self.cache.lengths[row] += n

    def _consume(self, rows: list[Request], hidden: dict[int, torch.Tensor], counts: list[int]) -> None:
        """Run queued context positions through the draft layer, all rows in one batch;
        position j pairs feature j with token j+1."""
        ctx = [int(self.cache.lengths[s.row]) for s in rows]
        self._extend([s.row for s in rows], hidden,
                     [s.all_ids[c + 1 : c + 1 + n] for s, c, n in zip(rows, ctx, counts)])

    @torch.inference_mode()
    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        m = self.model
        self._flush([s for s, k in zip(seqs, max_lengths) if k > 0])
        rows_all = [s.row for s in seqs]
        ctx = self.cache.lengths[rows_all].tolist()
        # A row without context (a one-token prompt, first round) has nothing to draft from.
        active = [i for i, k in enumerate(max_lengths) if k > 0 and ctx[i] > 0]
        if not active:
            return Proposal.empty(len(seqs))
        for i in active:
            if ctx[i] != seqs[i].num_tokens - 1:
                raise RuntimeError(
                    f"eagle3 drafter: row {seqs[i].row} has context for {ctx[i]} tokens, expected "
                    f"{seqs[i].num_tokens - 1} (the engine's feature invariant is broken)"
                )
        caps = {i: max_lengths[i] for i in active}
        K = max(caps.values())
        gens = [self.states[seqs[i]].drafter_gen for i in active]
        u = row_uniforms([seqs[i] for i in active], gens, [caps[i] for i in active], K, self.device)
        col = {i: j for j, i in enumerate(active)}
        draft_ids = m.draft_ids
        V = m.head.vocab_size
        drafts: dict[int, list[int]] = {i: [] for i in active}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        idx = list(active)
        h = self.last_hidden[[seqs[i].row for i in idx]]  # [B', H]
        masks = DraftMasks.of([seqs[i] for i in active], V, draft_ids if m.reduced_vocab else None, self.mask_pool,
                              [caps[i] for i in active]) if self.grammar_masks else None
        try:
            self._draft(seqs, idx, h, ctx, caps, u, col, drafts, qs, masks)
        finally:
            if masks is not None:
                masks.release()
        if masks is not None:  # a row ended under its grammar keeps only its drafts before that
            for i in active:
                n = masks.limit(col[i], len(drafts[i]))
                drafts[i], qs[i] = drafts[i][:n], qs[i][:n]
            if not any(drafts.values()):
                return Proposal.empty(len(seqs))
        return _proposal(len(seqs), drafts, qs, all(seqs[i].params.greedy for i in active))

    def _draft(self, seqs, idx, h, ctx, caps, u, col, drafts, qs, masks: DraftMasks | None) -> None:
        """The drafting loop of `propose`: appends to drafts[i] / qs[i] for every row i in idx."""
        m = self.model
        draft_ids = m.draft_ids
        V = m.head.vocab_size
        k = 0
        while True:
            logits = m.draft_logits(h)  # [B', Vd]
            if masks is not None:
                logits = masks.restrict(logits, [col[i] for i in idx])
            qd = target_probs(logits[:, None], [seqs[i].params for i in idx])[:, 0]  # [B', Vd]
            pick = inverse_cdf(qd, u[[col[i] for i in idx], k])  # draft ids [B']
            tok = draft_ids[pick]
            q = qd if not m.reduced_vocab else qd.new_zeros(len(idx), V).index_copy_(1, draft_ids, qd)
            if masks is not None:
                masks.consume(tok.tolist(), [col[i] for i in idx])
            for j, i in enumerate(idx):
                drafts[i].append(int(tok[j]))
                qs[i].append(q[j])
            k += 1
            keep = [j for j, i in enumerate(idx) if caps[i] > k and not (masks is not None and masks.ended[col[i]])]
            if not keep:
                break
            idx = [idx[j] for j in keep]
            h, tok = h[keep], tok[keep]
            rows = [seqs[i].row for i in idx]
            pos = torch.tensor([ctx[i] + k - 1 for i in idx], device=self.device)[:, None]  # draft k's position
            cos, sin = m.rope(pos, h.dtype)
            q_, k_, v_ = m.layer.project(m.head.embed_ids(tok[:, None], m.dtype), h[:, None], cos, sin)
            self._write(rows, pos[:, 0].tolist(), [1] * len(rows), k_, v_)  # temporary: past the context
            h = m.layer.finish(h[:, None], self._attend(torch.tensor(rows), q_, pos))[:, 0]


def _proposal(B: int, drafts: dict[int, list[int]], qs: dict[int, list[torch.Tensor]], greedy: bool) -> Proposal:
    K = max(len(d) for d in drafts.values())
    tokens = torch.zeros(B, K, dtype=torch.long)
    lengths = torch.zeros(B, dtype=torch.long)
    q_full = None
    if not greedy:
        first = next(q[0] for q in qs.values() if q)
        q_full = torch.zeros(B, K, first.shape[-1], dtype=torch.float32, device=first.device)
    for i, d in drafts.items():
        if not d:  # a row that kept none (its grammar allowed nothing of the draft vocabulary)
            continue
        tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        lengths[i] = len(d)
        if q_full is not None:
            q_full[i, : len(d)] = torch.stack(qs[i]).float()
    return Proposal(tokens=tokens, lengths=lengths, q=q_full)

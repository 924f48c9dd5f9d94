"""The block-parallel backbone shared by DFlash and DSpark, and their inference drafter.

Backbone (DFlash paper; docs/ALGORITHMS.md):
- context: target features of m layers, concatenated → W_c (mH→H) → RMSNorm = H_ctx;
- KV injection: every draft layer attends over keys [W_K H_ctx ; W_K H_d] and values
  [W_V H_ctx ; W_V H_d]; queries come from the block H_d only;
- the block: the anchor (last committed token) followed by mask tokens, bidirectional
  inside the block; the block sees the context strictly before the anchor (the anchor is
  the engine's pending token and has no target features yet);
- embedding and lm_head are the target's, frozen, never saved (`TargetHead`); with a
  reduced draft vocabulary (drafters/vocab.py) the drafter scores only those lm_head rows.

Attention is computed in two parts — the context keys shared by all blocks of a row, and
each block's own keys — joined in one softmax. Blocks are a separate tensor axis, so in
training many blocks of one conversation share a forward without ever seeing each other.

Inference (`BlockDrafter`): per engine row, a KVCache of the projected context keys/values
of every draft layer; once a row drafts, its length is the number of committed tokens with
target features (= num_tokens − 1, the engine's invariant). `on_verified` keeps the features
of the committed tokens only (rejected drafts never enter the cache, so there is nothing to
roll back) and projects them lazily: when the row next drafts, or once FLUSH_TOKENS have
gathered — rounds a load-aware policy does not draft pay no drafter upkeep. Each drafting
round is one backbone forward per row batch plus the kind's sampling stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal
from draftsmith.core.warp import draw_uniforms
from draftsmith.drafters.base import FeatureSpec, TargetFeatures
from draftsmith.drafters.vocab import DraftVocab
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import MLP, Decoder, DecoderConfig, RMSNorm
from draftsmith.models.rope import apply_rope, rope_inv_freq
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import PackedWeight, pack_linears_for_inference_
from draftsmith.drafters.anchors import BlockPack, pack_blocks
from draftsmith.drafters.protocol import TrainBatch

DRAFT_SEED_SALT = 0x5EED  # drafter generators derive from, and never share, the request's


# ---------------------------------------------------------------------------- shared pieces


@dataclass(frozen=True)
class TargetHead:
    """The target's frozen token embedding and lm_head, shared by reference (detached:
    no gradient ever reaches them, and they are not module parameters, so never saved)."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]

    @staticmethod
    def of(target: Decoder) -> "TargetHead":
        return TargetHead(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def embed_ids(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids.to(self.embed.device), self.embed).to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] → float32 target-vocabulary logits [..., V]."""
        return F.linear(h.to(self.lm_head.dtype), self.lm_head).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float, dtype: torch.dtype):
    """positions [...] → cos, sin [..., D] (HF rotate-half layout, as in models/decoder.py)."""
    freqs = positions[..., None].float() * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def split_heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[B, *S, n·D] → [B, n, *S, D]."""
    return x.view(*x.shape[:-1], n_heads, head_dim).movedim(-2, 1)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, n, *S, D] → [B, *S, n·D]."""
    x = x.movedim(1, -2)
    return x.reshape(*x.shape[:-2], -1)


def init_linear_(module: nn.Module, std: float = 0.02) -> None:
    """HF-style init for a fresh drafter: N(0, std) weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def two_part_attention(
    q: torch.Tensor,  # [B, Hq, A, n, D] queries of A blocks of n positions
    k_ctx: torch.Tensor,  # [B, Hkv, T, D] context keys (shared by the row's blocks)
    v_ctx: torch.Tensor,  # [B, Hkv, T, D]
    ctx_mask: torch.Tensor,  # [B, A, T] bool, True = block may attend this context key
    k_blk: torch.Tensor,  # [B, Hkv, A, n, D] each block's own keys (bidirectional)
    v_blk: torch.Tensor,  # [B, Hkv, A, n, D]
) -> torch.Tensor:
    """softmax over [context keys ; own block keys] → [B, Hq, A, n, D] (GQA by grouping)."""
    B, Hq, A, n, D = q.shape
    Hkv = k_ctx.shape[1]
    g = Hq // Hkv
    qg = q.reshape(B, Hkv, g, A, n, D) * D**-0.5
    s_ctx = torch.einsum("bkgand,bktd->bkgant", qg, k_ctx).float()  # [B, Hkv, g, A, n, T]
    s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None, :, None, :], float("-inf"))
    s_blk = torch.einsum("bkgand,bkamd->bkganm", qg, k_blk).float()  # [B, Hkv, g, A, n, n]
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1).to(q.dtype)
    T = k_ctx.shape[2]
    out = torch.einsum("bkgant,bktd->bkgand", p[..., :T], v_ctx)
    out = out + torch.einsum("bkganm,bkamd->bkgand", p[..., T:], v_blk)
    return out.reshape(B, Hq, A, n, D)


class InjectedAttention(nn.Module):
    """Projections named like the target's (q_proj, k_proj, v_proj, o_proj [, q/k norm])."""

    def __init__(self, cfg: DecoderConfig, in_dim: int | None = None) -> None:
        super().__init__()
        d_in = in_dim or cfg.hidden_size
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d_in, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, *S, d_in], cos/sin [B, 1, *S, D] → rotated queries [B, Hq, *S, D]."""
        q = split_heads(self.q_proj(x), self.n_heads, self.hd)
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, *S, d_in] → rotated keys and values [B, Hkv, *S, D]."""
        k = split_heads(self.k_proj(x), self.n_kv, self.hd)
        if self.qk_norm:
            k = self.k_norm(k)
        v = split_heads(self.v_proj(x), self.n_kv, self.hd)
        return apply_rope(k, cos, sin), v


class InjectedLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the injected context K/V."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = InjectedAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [B, A, n, H]
        ctx_kv: tuple[torch.Tensor, torch.Tensor],  # [B, Hkv, T, D] each
        ctx_mask: torch.Tensor,  # [B, A, T]
        cos: torch.Tensor,  # [B, 1, A, n, D]
        sin: torch.Tensor,
    ) -> torch.Tensor:
        hn = self.input_layernorm(x)
        q = self.self_attn.query(hn, cos, sin)
        kb, vb = self.self_attn.key_value(hn, cos, sin)
        o = two_part_attention(q, ctx_kv[0], ctx_kv[1], ctx_mask, kb, vb)
        x = x + self.self_attn.o_proj(merge_heads(o))
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockBackbone(nn.Module):
    """W_c + RMSNorm context projection, `num_layers` KV-injected layers, final norm, and
    the draft vocabulary (all target tokens, or the `draft_vocab_size` most frequent)."""

    def __init__(
        self,
        target: Decoder,
        layer_ids: Sequence[int],
        num_layers: int,
        mask_token_id: int,
        intermediate_size: int | None = None,
        draft_vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        tc = target.config
        self.cfg = dataclasses.replace(
            tc, num_layers=num_layers, intermediate_size=intermediate_size or tc.intermediate_size
        )
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.mask_token_id = int(mask_token_id)
        H = tc.hidden_size
        self.fc = nn.Linear(len(self.layer_ids) * H, H, bias=False)  # W_c
        self.ctx_norm = RMSNorm(H, tc.rms_norm_eps)
        self.layers = nn.ModuleList(InjectedLayer(self.cfg) for _ in range(num_layers))
        self.norm = RMSNorm(H, tc.rms_norm_eps)
        inv, scale = rope_inv_freq(tc.rope, tc.head_dim, tc.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.head = TargetHead.of(target)
        V = tc.vocab_size
        self.vocab = DraftVocab(V, draft_vocab_size) if draft_vocab_size and draft_vocab_size < V else None
        self.lm_rows: torch.Tensor | None = None  # the target's lm_head rows of the draft ids (derived)
        self._lm_pack = PackedWeight()  # lm_rows laid out for the CPU kernel at inference (models/linear.py)
        init_linear_(self)
        self._take_lm_rows()
        self.register_load_state_dict_post_hook(lambda module, _keys: module._take_lm_rows())

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # -- the draft vocabulary (identity maps when it is the target's)

    @property
    def draft_size(self) -> int:
        return self.vocab.size if self.vocab is not None else self.head.vocab_size

    def _take_lm_rows(self) -> None:
        if self.vocab is not None:
            self.lm_rows = self.head.lm_head[self.vocab.ids.to(self.head.lm_head.device)]

    def set_draft_vocab(self, token_counts: torch.Tensor | Sequence[int]) -> None:
        """Choose the reduced vocabulary from training-data token counts [V] (no-op without one)."""
        if self.vocab is not None:
            self.vocab.set_counts(token_counts)
            self._take_lm_rows()

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] → float32 logits over the draft vocabulary [..., Vd] (frozen target rows)."""
        if self.vocab is None:
            return self.head.logits(h)
        return self._lm_pack(h.to(self.lm_rows.dtype), self.lm_rows).float()

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """[Vd] target id of each draft id; None when the draft vocabulary is the target's."""
        return self.vocab.ids if self.vocab is not None else None

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids → draft ids (Vd for a token outside a reduced vocabulary)."""
        return target_ids if self.vocab is None else self.vocab.to_draft(target_ids)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.vocab is None else self.vocab.ids[draft_ids]

    def to_target_q(self, q: torch.Tensor) -> torch.Tensor:
        """[..., Vd] → [..., V] (zero outside the draft vocabulary)."""
        return q if self.vocab is None else self.vocab.scatter(q)

    def features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """layer id → [B, T, H] → concatenated [B, T, mH] in `layer_ids` order."""
        missing = [i for i in self.layer_ids if i not in hidden]
        if missing:
            raise DraftsmithError(f"target features lack layers {missing}; the drafter reads {list(self.layer_ids)}")
        xs = [hidden[i] for i in self.layer_ids]
        # Features made under torch.inference_mode cannot be saved for backward: copy them.
        xs = [x.clone() if x.is_inference() and torch.is_grad_enabled() else x for x in xs]
        return torch.cat(xs, dim=-1).to(self.dtype)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """H_ctx = RMSNorm(W_c feats): [B, T, mH] → [B, T, H]."""
        return self.ctx_norm(self.fc(feats))

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, rotated keys and values [B, Hkv, T, D] of H_ctx at positions [B, T]."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.rope_scale, h_ctx.dtype)
        cos, sin = cos[:, None], sin[:, None]
        return [layer.self_attn.key_value(h_ctx, cos, sin) for layer in self.layers]

    def block_inputs(self, anchors: torch.Tensor, n_in: int) -> torch.Tensor:
        """anchor ids [...] → block ids [..., n_in]: the anchor, then n_in − 1 mask tokens."""
        ids = torch.full((*anchors.shape, n_in), self.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    def blocks(
        self,
        ids: torch.Tensor,  # [B, A, n] block token ids
        positions: torch.Tensor,  # [B, A, n] absolute positions (anchor index + 0..n−1)
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,  # [B, A, T]
    ) -> torch.Tensor:
        """→ final-normed block hidden states [B, A, n, H] (the lm_head input)."""
        x = self.head.embed_ids(ids, self.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.rope_scale, x.dtype)
        cos, sin = cos[:, None], sin[:, None]
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, kv, ctx_mask, cos, sin)
        return self.norm(x)


# ---------------------------------------------------------------------------- training forward


@dataclass
class PackedForward:
    """One packed training forward: the sampled blocks and their drafted positions.

    pack:    anchors, masks and drafted-token indices (drafters/anchors.py)
    hidden:  [B, A, γ, H] final-normed hidden at the γ drafted positions of every block
    targets: [B, A, γ] x*_k (the token at a+k);  prev: [B, A, γ] x_{k−1} (anchor at k = 1)
    """

    pack: BlockPack
    hidden: torch.Tensor
    targets: torch.Tensor
    prev: torch.Tensor


def packed_forward(
    backbone: BlockBackbone,
    batch: TrainBatch,
    gamma: int,
    anchor_is_first_prediction: bool,
    anchors: torch.Tensor,  # [B, A] (train/anchors.sample_anchors)
    valid: torch.Tensor,  # [B, A]
) -> PackedForward:
    """Run every block of the batch through the backbone at once.

    DFlash (anchor_is_first_prediction=False): block = anchor + γ masks, drafts at block
    positions 1..γ. DSpark (True): block = anchor + γ−1 masks, drafts at positions 0..γ−1.
    Either way the drafted tokens are those at a+1 .. a+γ.
    """
    ids, lengths = batch.input_ids, batch.lengths
    B, T = ids.shape
    pack = pack_blocks(batch.loss_mask, lengths, anchors, valid, gamma)
    h_ctx = backbone.context(backbone.features(batch.hidden))  # [B, T, H]
    pos = torch.arange(T, device=ids.device).expand(B, T)
    ctx_kv = backbone.context_kv(h_ctx, pos)
    n_in = gamma if anchor_is_first_prediction else gamma + 1
    off = 0 if anchor_is_first_prediction else 1
    block_ids = backbone.block_inputs(ids.gather(1, anchors), n_in)  # [B, A, n_in]
    block_pos = anchors[:, :, None] + torch.arange(n_in, device=ids.device)
    h = backbone.blocks(block_ids, block_pos, ctx_kv, pack.context_mask)  # [B, A, n_in, H]
    prev_index = (anchors[:, :, None] + torch.arange(gamma, device=ids.device)).clamp(max=T - 1)
    return PackedForward(
        pack=pack,
        hidden=h[:, :, off : off + gamma],
        targets=ids.gather(1, pack.target_index.reshape(B, -1)).view_as(pack.target_index),
        prev=ids.gather(1, prev_index.reshape(B, -1)).view_as(prev_index),
    )


def target_logits_at(backbone: BlockBackbone, batch: TrainBatch, pack: BlockPack) -> torch.Tensor:
    """Target logits for the valid drafted positions, [N, V]: the token at a+k is predicted
    by lm_head(final_hidden[a+k−1]) (computed here; no logits cache)."""
    B, T, H = batch.final_hidden.shape
    idx = (pack.target_index - 1).clamp(min=0)[pack.target_mask]  # [N]
    rows = torch.arange(B, device=idx.device)[:, None, None].expand_as(pack.target_index)[pack.target_mask]
    with torch.no_grad():
        return backbone.head.logits(batch.final_hidden[rows, idx])


# ---------------------------------------------------------------------------- inference


class BlockSampler(Protocol):
    """The kind-specific part of a block drafter's round (DFlash: independent positions;
    DSpark: the sequential stage and confidences)."""

    def draft(
        self,
        hidden: torch.Tensor,  # [B, n, H] final-normed hidden at the first n drafted positions
        anchors: torch.Tensor,  # [B] anchor ids (x_0)
        params: Sequence[SamplingParams],
        uniforms: torch.Tensor,  # [B, n] one uniform per drafted position
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """→ tokens [B, n], q [B, n, V] (the warped distributions sampled from; one-hot on
        greedy rows), confidence logits [B, n] or None."""
        ...


def request_generator(seq: Request, device: torch.device) -> torch.Generator | None:
    """The drafter's own per-request generator (None when the request has no seed)."""
    if seq.params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seq.params.seed ^ DRAFT_SEED_SALT)
    return g


def row_uniforms(seqs: Sequence[Request], counts: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] uniforms: row b draws exactly counts[b] from its own generator (the rest
    are 0.5 padding), so a seeded row's drafts do not depend on the rest of the batch."""
    u = torch.full((len(seqs), width), 0.5, device=device)
    for b, (s, n) in enumerate(zip(seqs, counts)):
        if n:
            u[b, :n] = draw_uniforms(n, s.drafter_state.get("drafter_gen"), device)
    return u


def committed_feature_counts(seqs: Sequence[Request], num_accepted: torch.Tensor, ctx_len: Sequence[int]) -> list[int]:
    """How many of a round's feature positions [pending, d1..] each row commits: 1 + accepted,
    less where a stop rule cut the committed tokens short (the row is finishing)."""
    out = []
    for s, m, c in zip(seqs, num_accepted.tolist(), ctx_len):
        out.append(max(0, min(1 + int(m), s.num_tokens - 1 - int(c))))
    return out


PREFILL_KEY = "drafter_prefill"
PENDING_KEY = "drafter_pending"  # committed positions' features, one {layer id: [n, H]} per round
FLUSH_TOKENS = 64  # run a row's pending positions once this many have gathered (bounds memory)


def stash_prefill(seq: Request, features: TargetFeatures | None) -> None:
    """Keep a new request's prompt features until the row next drafts, so the rows admitted
    in one engine step are projected in one batch (the engine starts them one by one)."""
    seq.drafter_state.pop(PREFILL_KEY, None)
    seq.drafter_state.pop(PENDING_KEY, None)
    if features is not None and features.hidden:
        n = int(next(iter(features.hidden.values())).shape[1])
        if n:
            seq.drafter_state[PREFILL_KEY] = features.hidden


def pending_count(seq: Request) -> int:
    """Context positions whose target features are stashed but not yet in the drafter's cache."""
    pre = seq.drafter_state.get(PREFILL_KEY)
    n = int(next(iter(pre.values())).shape[1]) if pre is not None else 0
    return n + sum(int(next(iter(x.values())).shape[0]) for x in seq.drafter_state.get(PENDING_KEY, ()))


def queue_committed(seqs: Sequence[Request], counts: Sequence[int], hidden: dict[int, torch.Tensor],
                    layer_ids: Sequence[int]) -> None:
    """Stash the first counts[b] positions of a round's features [B, 1+K, H] for row b."""
    for b, n in enumerate(counts):
        if n > 0:
            seqs[b].drafter_state.setdefault(PENDING_KEY, []).append({i: hidden[i][b, :n] for i in layer_ids})


def take_pending(seqs: Sequence[Request]) -> tuple[list[Request], dict[int, torch.Tensor], list[int]] | None:
    """Pop every row's stashed positions (prompt, then rounds, in order): (the rows that had
    some, layer id → right-padded [B, S, H], counts), or None when no row has any."""
    rows, chunks = [], []
    for s in seqs:
        parts = []
        pre = s.drafter_state.pop(PREFILL_KEY, None)
        if pre is not None:
            parts.append({i: h[0] for i, h in pre.items()})
        parts += s.drafter_state.pop(PENDING_KEY, [])
        if parts:
            rows.append(s)
            keys = set(parts[0]).intersection(*parts[1:])  # the layers every part has
            chunks.append({i: torch.cat([p[i] for p in parts], 0) for i in sorted(keys)})
    if not rows:
        return None
    counts = [int(next(iter(c.values())).shape[0]) for c in chunks]
    hidden = {}
    for i, ref in chunks[0].items():
        out = ref.new_zeros(len(chunks), max(counts), ref.shape[-1])
        for b, c in enumerate(chunks):
            out[b, : counts[b]] = c[i]
        hidden[i] = out
    return rows, hidden, counts


class BlockDrafter:
    """Inference drafter for a block model (DFlash / DSpark): one backbone forward per round.

    State per engine row: `cache` holds projected context K/V of every draft layer at
    positions 0 .. num_tokens − 2; seq.drafter_state["drafter_gen"] is the request's drafter
    generator. `temperatures` (STS, from calibration.json) rescale confidence logits.
    """

    def __init__(
        self,
        name: str,
        backbone: BlockBackbone,
        sampler: BlockSampler,
        gamma: int,
        anchor_is_first_prediction: bool,
        max_rows: int,
        max_len: int,
        temperatures: Sequence[float] | None = None,
    ) -> None:
        self.name = name
        self.backbone = backbone
        self.sampler = sampler
        self.gamma = int(gamma)
        self.n_in = self.gamma if anchor_is_first_prediction else self.gamma + 1
        self.offset = 0 if anchor_is_first_prediction else 1
        self.needs = FeatureSpec(layer_ids=backbone.layer_ids)
        # inference through prepacked weights; the modules still train as before (models/linear.py)
        pack_linears_for_inference_(backbone)
        if isinstance(sampler, torch.nn.Module):
            pack_linears_for_inference_(sampler)
        self.temperatures = tuple(float(t) for t in temperatures) if temperatures else None
        self.flush_tokens = FLUSH_TOKENS
        c = backbone.cfg
        self.device = backbone.fc.weight.device
        self.cache = KVCache(c.num_layers, max_rows, c.num_kv_heads, max_len, c.head_dim,
                             dtype=backbone.dtype, device=self.device)

    # -- context cache

    @torch.inference_mode()
    def _append(self, rows: list[int], feats: torch.Tensor, counts: list[int]) -> None:
        """Project features [B, S, mH] and store the first counts[b] positions of row b."""
        if not rows or max(counts) == 0:
            return
        S = max(counts)
        feats = feats[:, :S]
        starts = self.cache.lengths[rows]  # [B]
        for r, n in zip(rows, counts):
            if int(self.cache.lengths[r]) + n > self.cache.max_len:
                raise DraftsmithError(f"drafter context for row {r} would exceed {self.cache.max_len} tokens")
        pos = (starts[:, None] + torch.arange(S)[None, :]).to(self.device)
        kvs = self.backbone.context_kv(self.backbone.context(feats.to(self.device, self.backbone.dtype)), pos)
        for layer, (k, v) in enumerate(kvs):
            kc, vc = self.cache.k[layer], self.cache.v[layer]
            for b, (r, n) in enumerate(zip(rows, counts)):
                s0 = int(starts[b])
                kc[r, :, s0 : s0 + n] = k[b, :, :n]
                vc[r, :, s0 : s0 + n] = v[b, :, :n]
        for r, n in zip(rows, counts):
            self.cache.lengths[r] += n

    def start(self, seq: Request, features: TargetFeatures | None) -> None:
        self.cache.reset(seq.row)
        seq.drafter_state["drafter_gen"] = request_generator(seq, self.device)
        stash_prefill(seq, features)

    def _flush(self, seqs: Sequence[Request]) -> None:
        """Project every row's pending positions (prompt, then committed rounds), in one batch."""
        pend = take_pending(seqs)
        if pend:
            rows, hidden, counts = pend
            self._append([s.row for s in rows], self.backbone.features(hidden), counts)

    def release(self, seq: Request) -> None:
        seq.drafter_state.pop(PREFILL_KEY, None)
        seq.drafter_state.pop(PENDING_KEY, None)
        if seq.row >= 0:
            self.cache.reset(seq.row)

    def on_verified(self, seqs, proposal, result, features) -> None:
        """Keep the committed tokens' features; they are projected when the row next drafts
        (or once `flush_tokens` have gathered), so rounds a policy does not draft cost nothing."""
        if features is None or not features.hidden:
            raise DraftsmithError(f"drafter {self.name!r} needs target features after every round")
        ctx = [int(self.cache.lengths[s.row]) + pending_count(s) for s in seqs]
        queue_committed(seqs, committed_feature_counts(seqs, result.num_accepted, ctx), features.hidden,
                        self.backbone.layer_ids)
        self._flush([s for s in seqs if pending_count(s) >= self.flush_tokens])

    # -- one round

    @torch.inference_mode()
    def propose(self, seqs: list[Request], max_lengths: list[int]) -> Proposal:
        active = [i for i, k in enumerate(max_lengths) if k > 0]
        if not active:
            return Proposal.empty(len(seqs))
        act = [seqs[i] for i in active]
        self._flush(act)
        caps = [min(max_lengths[i], self.gamma) for i in active]
        n = max(caps)
        rows = torch.tensor([s.row for s in act])
        ctx_len = self.cache.lengths[rows]  # [B']
        for s, c in zip(act, ctx_len.tolist()):
            if c != s.num_tokens - 1:
                raise RuntimeError(
                    f"drafter {self.name}: row {s.row} has context for {c} tokens, expected "
                    f"{s.num_tokens - 1} (the engine's feature invariant is broken)"
                )
        dev = self.device
        L = int(ctx_len.max())
        ctx_kv = [(self.cache.k[i][rows, :, :L], self.cache.v[i][rows, :, :L]) for i in range(len(self.cache.k))]
        ctx_len_d = ctx_len.to(dev)
        ctx_mask = (torch.arange(L, device=dev)[None, :] < ctx_len_d[:, None])[:, None, :]  # [B', 1, L]
        anchors = torch.tensor([s.all_ids[-1] for s in act], dtype=torch.long, device=dev)  # [B']
        ids = self.backbone.block_inputs(anchors[:, None], self.n_in)  # [B', 1, n_in]
        pos = ctx_len_d[:, None, None] + torch.arange(self.n_in, device=dev)  # anchor at index ctx_len
        h = self.backbone.blocks(ids, pos, ctx_kv, ctx_mask)[:, 0]  # [B', n_in, H]
        h = h[:, self.offset : self.offset + n]  # [B', n, H]
        u = row_uniforms(act, caps, n, dev)
        params = [s.params for s in act]
        tokens, q, conf_logits = self.sampler.draft(h, anchors, params, u)
        return self._assemble(len(seqs), active, caps, tokens, q, conf_logits, params)

    def _assemble(self, B, active, caps, tokens, q, conf_logits, params) -> Proposal:
        K = max(caps)
        out_tokens = torch.zeros(B, K, dtype=torch.long)
        lengths = torch.zeros(B, dtype=torch.long)
        idx = torch.tensor(active)
        out_tokens[idx] = tokens.cpu()
        lengths[idx] = torch.tensor(caps)
        keep = torch.arange(K)[None, :] < lengths[:, None]
        out_tokens = out_tokens.masked_fill(~keep, 0)
        q_full = None
        if not all(p.greedy for p in params):
            q_full = torch.zeros(B, K, q.shape[-1], dtype=torch.float32, device=q.device)
            q_full[idx.to(q.device)] = q.float()
        conf = None
        if conf_logits is not None:
            z = conf_logits.float()
            if self.temperatures:
                t = list(self.temperatures[:K]) + [1.0] * max(0, K - len(self.temperatures))
                z = z / torch.tensor(t, dtype=z.dtype, device=z.device)
            conf = torch.zeros(B, K, dtype=torch.float32)
            conf[idx] = torch.sigmoid(z).cpu()
            conf = conf.masked_fill(~keep, 0.0)
        return Proposal(tokens=out_tokens, lengths=lengths, q=q_full, confidences=conf)


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BlockConfig:
    """The fields DFlash and DSpark share: the backbone and its training. Each kind's config
    subclasses this and sets its kind, loss weights and extras."""

    kind: str = "block"
    block_size: int = 7  # γ: drafts per forward
    num_layers: int = 5  # draft layers, each with the context K/V injected
    layer_ids: tuple[int, ...] = ()  # target feature layers; () = num_layers spread over [1, L−3]
    mask_token_id: int | None = None  # None = resolved at build (choose_mask_token_id)
    intermediate_size: int | None = None  # draft MLP width; None = the target's
    max_anchors: int = 512  # training blocks sampled per sequence
    draft_vocab_size: int | None = None  # reduced draft vocabulary (drafters/vocab.py); None = the target's
    ce_weight: float = 1.0
    tv_weight: float = 0.0
    position_decay: float | None = None  # w_k = exp(−(k−1)/d); None = block_size

    def __post_init__(self) -> None:
        validate_block_config(self)


# ---------------------------------------------------------------------------- config helpers


def choose_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """The embedding row block drafters use as their mask token (never trained: the target's
    embedding is frozen; the drafter learns what that input means). Deterministic:

    1. the first row no tokenizer entry maps to, when the embedding is padded past the
       tokenizer (Qwen3: 151669, the row DFlash uses);
    2. otherwise the highest-id added token that is not a special token the model uses
       (bos / eos / pad / unk / chat markers) — SmolLM2: 16 `<empty_output>`, a code-corpus
       marker chat never produces;
    3. otherwise (no tokenizer at hand) the last row, vocab_size − 1.
    """
    if tokenizer is not None:
        n = len(tokenizer)
        if n < vocab_size:
            return n
        used = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        spare = sorted(int(i) for i in added if int(i) not in used and int(i) < vocab_size)
        if spare:
            return spare[-1]
    return vocab_size - 1


def validate_block_config(cfg) -> None:
    """Checks shared by DFlashConfig and DSparkConfig (called from __post_init__)."""
    if isinstance(cfg.layer_ids, list):
        object.__setattr__(cfg, "layer_ids", tuple(cfg.layer_ids))
    problems = []
    for name in ("block_size", "num_layers", "max_anchors"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            problems.append(f"{name} must be an integer >= 1, got {v!r}")
    if cfg.intermediate_size is not None and (not isinstance(cfg.intermediate_size, int) or cfg.intermediate_size < 1):
        problems.append(f"intermediate_size must be a positive integer or null, got {cfg.intermediate_size!r}")
    dv = cfg.draft_vocab_size
    if dv is not None and (not isinstance(dv, int) or isinstance(dv, bool) or dv < 1):
        problems.append(f"draft_vocab_size must be a positive integer or null, got {dv!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in cfg.layer_ids):
        problems.append(f"layer_ids must be integers, got {cfg.layer_ids!r}")
    elif len(set(cfg.layer_ids)) != len(cfg.layer_ids):
        problems.append(f"layer_ids repeat: {list(cfg.layer_ids)}")
    for name in ("ce_weight", "tv_weight", "conf_weight"):
        v = getattr(cfg, name, 0.0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            problems.append(f"{name} must be a number >= 0, got {v!r}")
    if cfg.position_decay is not None and not (isinstance(cfg.position_decay, (int, float)) and cfg.position_decay > 0):
        problems.append(f"position_decay must be > 0 or null, got {cfg.position_decay!r}")
    if problems:
        raise DraftsmithError(f"{cfg.kind} config: " + "; ".join(problems))


def resolve_feature_layers(layer_ids: Sequence[int], n_default: int, num_layers: int, kind: str) -> tuple[int, ...]:
    """Explicit ids are range-checked; () means `n_default` ids spread over [1, L−3]."""
    from draftsmith.data.features import default_layer_ids

    if not layer_ids:
        return default_layer_ids(num_layers, n_default)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise DraftsmithError(
            f"{kind} config: layer ids {bad} are out of range; the target has {num_layers} layers "
            f"(ids 0..{num_layers - 1})"
        )
    return tuple(sorted(int(i) for i in layer_ids))


def resolve_block_config(cfg, target: Decoder):
    """Fill the target-dependent defaults (feature layers, mask token) and check ranges."""
    tc = target.config
    ids = resolve_feature_layers(cfg.layer_ids, cfg.num_layers, tc.num_layers, cfg.kind)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else choose_mask_token_id(tc.vocab_size)
    if not 0 <= mask < tc.vocab_size:
        raise DraftsmithError(
            f"{cfg.kind} config: mask_token_id {mask} is outside the target vocabulary [0, {tc.vocab_size})"
        )
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > tc.vocab_size:
        raise DraftsmithError(
            f"{cfg.kind} config: draft_vocab_size {cfg.draft_vocab_size} exceeds the target vocabulary "
            f"{tc.vocab_size}; use at most {tc.vocab_size} (or null for the whole vocabulary)"
        )
    return dataclasses.replace(cfg, layer_ids=ids, mask_token_id=int(mask))

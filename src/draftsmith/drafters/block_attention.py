"""Attention pieces of the trained drafters: RoPE, head layout, the target-named projections
(`InjectedAttention`, also EAGLE-3's), and the KV-injected layer of the block backbone.

KV injection (DFlash paper; docs/ALGORITHMS.md): every draft layer of a block drafter
attends over keys [W_K H_ctx ; W_K H_d] and values [W_V H_ctx ; W_V H_d], queries coming
from the block H_d only. Attention is computed in two parts — the context keys shared by
all blocks of a row, and each block's own keys (bidirectional) — joined in one softmax.
Blocks are a separate tensor axis, so in training many blocks of one conversation share a
forward without ever seeing each other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from draftsmith.models.decoder import MLP, DecoderConfig, RMSNorm

NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) → RMSNorm(x)
from draftsmith.models.rope import apply_rope


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float, dtype: torch.dtype):
    """positions [...] → cos, sin [..., D] (HF rotate-half layout, as in models/decoder.py)."""
    freqs = positions[..., None].float() * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def head_rope(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float, dtype: torch.dtype):
    """positions [B, *S] → cos, sin [B, 1, *S, D]: broadcast over the head axis."""
    cos, sin = rope_cos_sin(inv_freq, positions, scale, dtype)
    return cos[:, None], sin[:, None]


def split_heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """[B, *S, n·D] → [B, n, *S, D]."""
    return x.view(*x.shape[:-1], n_heads, head_dim).movedim(-2, 1)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, n, *S, D] → [B, *S, n·D]."""
    x = x.movedim(1, -2)
    return x.reshape(*x.shape[:-2], -1)


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

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  norm: NormFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, *S, d_in] → rotated keys and values [B, Hkv, *S, D]; `norm(x, weight, eps)`
        replaces the k norm's module call (inference: the one-pass CPU kernel)."""
        k = split_heads(self.k_proj(x), self.n_kv, self.hd)
        if self.qk_norm:
            k = self.k_norm(k) if norm is None else norm(k, self.k_norm.weight, self.k_norm.eps)
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

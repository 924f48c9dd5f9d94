"""One compact decoder for the Llama / Qwen2 / Qwen3 family.

Family differences are flags, not copies: qkv bias (Qwen2), q/k RMSNorm (Qwen3), tied
embeddings (SmolLM2, small Qwen), RoPE scaling variants. Parameter names mirror the HF
checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...) so safetensors load strictly.

The forward pass works on a batch of KV-cache rows with independent lengths: row b's new
tokens go to positions lengths[b] .. lengths[b] + S - 1. The caller commits how many of
them to keep by setting the row length afterwards (speculative verification keeps only the
accepted prefix). Layer features for drafters: `layer_ids` index decoder-layer outputs
(0-based; layer i's output is HF's `hidden_states[i + 1]`), `final_hidden` is the normed
state that feeds the lm_head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3 / yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn (DeepSeek-style attention factor)
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dims


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2: always)
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "DecoderConfig":
        """Build from a HF `config.json` dict (transformers 4.x and 5.x spellings)."""
        mt = cfg.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise DraftsmithError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return DecoderConfig(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(cfg),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=(mt == "qwen2") or bool(cfg.get("attention_bias", False)),
                qk_norm=(mt == "qwen3"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise DraftsmithError(f"config.json is missing required field {e.args[0]!r}") from None


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds theta and scaling into `rope_parameters`; 4.x used
    # `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rtype = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise DraftsmithError(
            f"rope type {rtype!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=theta,
        type=rtype,
        factor=float(merged.get("factor", 1.0) or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=merged.get("attention_factor"),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        truncate=bool(merged.get("truncate", True)),
    )


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling for a RoPE variant.

    Computed in float32 with the same operations as HF transformers: a float64 table differs
    in the last bit of some frequencies, which moves a 30-layer model's logits by ~1e-4.
    """
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scale = 1.0
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "dynamic":
        # Dynamic NTK only changes theta past the original context; within it, it is default.
        pass
    elif rope.type == "llama3":
        old_ctx = rope.original_max_position_embeddings or max_pos
        low_wl = old_ctx / rope.low_freq_factor
        high_wl = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        mid = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(mid, smoothed, scaled)
    elif rope.type == "yarn":
        old_ctx = rope.original_max_position_embeddings or max_pos
        factor = rope.factor

        def dim_for(rot: float) -> float:
            return (head_dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(rope.theta))

        low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = rope.theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        extrapolation = 1 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        if rope.attention_factor is not None:
            scale = float(rope.attention_factor)
        elif rope.mscale and rope.mscale_all_dim:
            scale = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            scale = _yarn_mscale(factor)
    return inv.float(), float(scale)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]; cos/sin [B, 1, S, D] (HF 'rotate_half' convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, ctx: "_StepContext", cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.hd)
        k = self.k_proj(x).view(B, S, self.n_kv, self.hd)
        v = self.v_proj(x).view(B, S, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]
        if ctx.row_slice is not None:
            # Fast path (e.g. batch 1 or compact slots): plain slicing, no gather copies.
            r0 = ctx.row_slice.start
            for b in range(B):
                s0 = ctx.starts_list[b]
                kc[r0 + b, :, s0 : s0 + S] = k[b]
                vc[r0 + b, :, s0 : s0 + S] = v[b]
            keys = kc[ctx.row_slice, :, : ctx.kv_len]
            values = vc[ctx.row_slice, :, : ctx.kv_len]
        else:
            kc[ctx.rows[:, None], :, ctx.positions] = k.transpose(1, 2)
            vc[ctx.rows[:, None], :, ctx.positions] = v.transpose(1, 2)
            keys = kc[ctx.rows, :, : ctx.kv_len]
            values = vc[ctx.rows, :, : ctx.kv_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ctx.mask, enable_gqa=self.n_heads != self.n_kv
        )  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: "_StepContext", cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _StepContext:
    rows: torch.Tensor  # [B] cache rows
    row_slice: slice | None  # rows as a contiguous slice when they are one
    starts_list: list[int]  # per-row start positions
    positions: torch.Tensor  # [B, S]
    kv_len: int  # keys visible this step: max(start) + S
    mask: torch.Tensor  # [B, 1, S, kv_len] bool, True = attend
    cos: torch.Tensor  # [B, 1, S, D]
    sin: torch.Tensor


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None  # [B, S or M, V] (float32)
    hidden: dict[int, torch.Tensor]  # layer id -> [B, S, H], decoder-layer outputs
    final_hidden: torch.Tensor  # [B, S, H] after the final norm (lm_head input)


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 decoder with a row-batched, preallocated KV cache."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv, scale = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_rows: int, max_len: int | None = None) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers, max_rows, c.num_kv_heads, max_len or c.max_position_embeddings,
            c.head_dim, dtype=self.dtype, device=self.device,
        )

    def _context(self, rows: torch.Tensor, S: int, cache: KVCache) -> _StepContext:
        starts = cache.lengths[rows]  # [B] on CPU
        cache.check_room(rows, S)
        starts_list = starts.tolist()
        rows_list = rows.tolist()
        contiguous = all(r == rows_list[0] + i for i, r in enumerate(rows_list))
        kv_len = max(starts_list) + S
        dev = self.device
        positions = (starts[:, None] + torch.arange(S)[None, :]).to(dev)  # [B, S]
        key_pos = torch.arange(kv_len, device=dev)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, kv_len]
        freqs = positions[..., None].float() * self.inv_freq[None, None, :]  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, S, D]
        cos = (emb.cos() * self.rope_scale).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        return _StepContext(
            rows=rows.to(dev),
            row_slice=slice(rows_list[0], rows_list[0] + len(rows_list)) if contiguous else None,
            starts_list=starts_list,
            positions=positions,
            kv_len=kv_len,
            mask=mask,
            cos=cos,
            sin=sin,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        cache: KVCache,
        rows: torch.Tensor | None = None,  # [B] cache rows (default 0..B-1)
        layer_ids: tuple[int, ...] = (),
        logit_index: torch.Tensor | None = None,  # [B, M] positions in S to score; None = all
        compute_logits: bool = True,
    ) -> DecoderOutput:
        """Run S new tokens per row; does NOT advance cache lengths (the caller commits)."""
        B, S = input_ids.shape
        if rows is None:
            rows = torch.arange(B)
        rows = rows.cpu()
        vmax = int(input_ids.max()) if input_ids.numel() else 0
        if vmax >= self.config.vocab_size or (input_ids.numel() and int(input_ids.min()) < 0):
            raise DraftsmithError(
                f"token id outside the model vocabulary [0, {self.config.vocab_size})"
            )
        ctx = self._context(rows, S, cache)
        x = self.model.embed_tokens(input_ids.to(self.device))
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(layer_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, cache)
            if i in wanted:
                hidden[i] = x
        final = self.model.norm(x)
        logits = None
        if compute_logits:
            h = final
            if logit_index is not None:
                idx = logit_index.to(self.device)
                h = torch.gather(final, 1, idx[..., None].expand(-1, -1, final.shape[-1]))
            logits = self.lm_head(h).float()
        return DecoderOutput(logits=logits, hidden=hidden, final_hidden=final)

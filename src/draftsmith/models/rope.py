"""Rotary position embeddings: the variants HF transformers implements for Llama / Qwen
(default, linear, dynamic, llama3, yarn), read from either spelling of config.json, and
applied in HF's rotate-half convention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from draftsmith.errors import DraftsmithError

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, S, D]; cos/sin [B, 1, S, D] (HF 'rotate_half' convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in fewer ops, bit-identical: rotate_half(x) * sin == roll(x) * [-sin1, sin2]
    (a sign flip is exact). x [..., D]; cos / sin_signed broadcast to it."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

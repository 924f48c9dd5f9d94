"""Attention over the KV cache: torch's SDPA, or grouped matmuls where SDPA is slow.

PyTorch's CPU `scaled_dot_product_attention` has no fast kernel for 16-bit queries of a
few tokens against a long cache: in bfloat16 a batch-1 decode step took 0.25 ms per layer
(0.07 with the matmuls below) and a batch-32 step with a padding mask 7.5 ms (0.5). In
float32 SDPA is as fast as the alternative, so float32 keeps it (its numerics are what the
HF-parity tests pin).

The grouped form never copies K/V per query head (GQA): the G = heads / kv_heads query
heads that share one kv head are stacked along the query axis, so one matmul per kv head
scores all of them. Scores are softmaxed in float32, as SDPA does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MAX_QUERY = 64  # decode and verify steps; prefill of longer chunks goes to SDPA


def use_grouped(q: torch.Tensor) -> bool:
    """q [B, H, S, D]: 16-bit, on CPU, a decode/verify-sized step."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] <= GROUPED_MAX_QUERY


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool) -> torch.Tensor:
    """q [B, H, S, D], k / v [B, KV, T, D], mask [B or 1, 1, S, T] bool (True = attend) or None;
    causal: the S queries are the last S positions of T with a lower-triangular mask.
    Returns [B, H, S, D] like SDPA (HF's head h reads kv head h // G)."""
    B, H, S, D = q.shape
    KV, T = k.shape[1], k.shape[2]
    G = H // KV
    scores = torch.matmul((q * D ** -0.5).reshape(B, KV, G * S, D), k.transpose(-1, -2)).float()
    if causal and mask is None:
        q_pos = torch.arange(T - S, T, device=q.device)
        mask = (torch.arange(T, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    if mask is not None:
        scores = scores.view(B, KV, G, S, T).masked_fill(~mask[:, :, None], float("-inf")).view(B, KV, G * S, T)
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(B, H, S, D)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool) -> torch.Tensor:
    """Softmax attention of q [B, H, S, D] over k / v [B, KV, T, D] (GQA when KV < H)."""
    if use_grouped(q):
        return grouped_attention(q, k, v, mask, causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])

"""The grouped-matmul attention (16-bit CPU decode / verify) equals SDPA's semantics."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.models.attention import attend, grouped_attention, use_grouped


def _case(B, H, KV, S, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, L, 16, generator=g) for n, L in ((H, S), (KV, T), (KV, T)))
    return q, k, v


@pytest.mark.parametrize("H,KV", [(4, 4), (6, 2), (9, 3)])
def test_grouped_matches_sdpa_under_every_mask_kind(H, KV):
    B, S, T = 3, 5, 12
    q, k, v = _case(B, H, KV, S, T)
    pos = torch.tensor([[7], [2], [11 - S + 1]]) + torch.arange(S)[None]  # ragged rows
    row_mask = (torch.arange(T)[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, S, T]
    shared = (torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None])[None, None]  # [1, 1, S, T]
    for mask in (row_mask, shared, None):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != KV)
        assert torch.allclose(grouped_attention(q, k, v, mask, False), want, atol=1e-5)
    qc, kc, vc = _case(B, H, KV, T, T, seed=1)  # causal: queries are all T positions
    want = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=H != KV)
    assert torch.allclose(grouped_attention(qc, kc, vc, None, True), want, atol=1e-5)


def test_dispatch_keeps_sdpa_for_float32_and_long_prefill():
    q, k, v = _case(2, 6, 2, 4, 9)
    assert not use_grouped(q)
    assert use_grouped(q.bfloat16())
    assert not use_grouped(torch.zeros(1, 6, 65, 16, dtype=torch.bfloat16))
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    got = attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, False).float()
    assert (got - want).abs().max() < 0.05  # bf16 rounding only
    # and a wrong grouping (kv head h % KV instead of h // G) is caught at this tolerance
    wrong = F.scaled_dot_product_attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1))
    assert (got - wrong).abs().max() > 0.05

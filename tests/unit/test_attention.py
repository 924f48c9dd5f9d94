"""The grouped-matmul attention (16-bit CPU decode / verify) equals SDPA's semantics."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.kernels.build import cpu_kernels
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


def _step_kernel_or_skip():
    from draftsmith.kernels.build import cpu_kernels

    if not cpu_kernels().ok:
        pytest.skip(f"Draftsmith's CPU kernels do not run here: {cpu_kernels().reason}")


# head_dim / 16 odd and even (the bfloat16 pair paths take even ones), one spilling its sums (192)
@pytest.mark.parametrize("H,KV,D", [(4, 4, 16), (4, 2, 48), (9, 3, 64), (6, 2, 128), (2, 1, 192)])
def test_step_kernel_matches_sdpa_under_every_mask_kind(H, KV, D):
    """torch.ops.draftsmith.attention (kernels/gemv.cpp) against SDPA: ragged per-row masks, a
    shared mask, none, causal, GQA, k / v as strided views of a larger cache, bfloat16."""
    _step_kernel_or_skip()
    B, S, T = 3, 5, 40
    g = torch.Generator().manual_seed(D)
    q = torch.randn(B, H, S, D, generator=g)
    cache_k, cache_v = (torch.randn(B + 1, KV, T + 9, D, generator=g) for _ in range(2))
    k, v = cache_k[1:, :, 2 : T + 2], cache_v[1:, :, 2 : T + 2]  # views, as the decoder passes them
    pos = torch.tensor([[27], [2], [T - S]]) + torch.arange(S)[None]
    row_mask = (torch.arange(T)[None, None, :] <= pos[:, :, None])[:, None]
    shared = (torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None])[None, None]
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 3e-2)):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        # causal = the S queries are the last S positions (the decoder's meaning; SDPA's is_causal
        # aligns top-left, the same only when S == T): compared with the equivalent shared mask
        for mask, causal in ((row_mask, False), (shared, False), (None, False), (None, True)):
            want = F.scaled_dot_product_attention(qd.float(), kd.float(), vd.float(),
                                                  attn_mask=shared if causal else mask, enable_gqa=H != KV)
            got = attend(qd, kd, vd, mask, causal, kernel="step")
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
        assert attend(qd, kd, vd, None, False, kernel="auto").equal(attend(qd, kd, vd, None, False, kernel="step"))


@pytest.mark.parametrize("D", [16, 32, 48, 64, 96, 128])  # rows per value pass and the pair paths differ by D
def test_step_kernel_is_query_count_invariant(D):
    """A verify block's attention equals that of its queries one at a time, bit for bit (what lets
    a bfloat16 target's greedy speculative output equal its plain decoding), and a query that
    sees no key gets zeros, not NaN."""
    _step_kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    T, S, H, KV = 57, 8, 9, 3
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, H, S, D, generator=g).to(dtype)
        k, v = (torch.randn(1, KV, T, D, generator=g).to(dtype) for _ in range(2))
        block = attend(q, k, v, None, True, kernel="step")
        for i in range(S):
            one = attend(q[:, :, i : i + 1], k[:, :, : T - S + i + 1], v[:, :, : T - S + i + 1], None, False, kernel="step")
            assert torch.equal(one, block[:, :, i : i + 1]), (dtype, i)
        none = torch.zeros(1, 1, S, T, dtype=torch.bool)
        assert torch.equal(attend(q, k, v, none, False, kernel="step"), torch.zeros_like(q))
        # a batch of rows (attended with the other rows of their kv head, tasks split by thread
        # count) equals each row alone
        qb = torch.randn(6, H, 2, D, generator=g).to(dtype)
        kb, vb = (torch.randn(6, KV, T, D, generator=g).to(dtype) for _ in range(2))
        batch = attend(qb, kb, vb, None, True, kernel="step")
        for b in range(6):
            for i in range(2):
                one = attend(qb[b : b + 1, :, i : i + 1], kb[b : b + 1, :, : T - 1 + i], vb[b : b + 1, :, : T - 1 + i],
                             None, False, kernel="step")
                assert torch.equal(one, batch[b : b + 1, :, i : i + 1]), (dtype, b, i)


@pytest.mark.parametrize("D,H", [(48, 6), (64, 6), (128, 6), (128, 4)])  # H / 2 query heads a kv head
def test_step_kernel_ignores_what_masked_cache_slots_hold(D, H):
    """Keys a query does not see may be unwritten or stale cache slots: NaN there (keys and values,
    past a row's length and under a mask) changes no bit of the output."""
    _step_kernel_or_skip()
    g = torch.Generator().manual_seed(11)
    B, KV, S, T = 2, 2, 4, 40
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(B, H, S, D, generator=g).to(dtype)
        k, v = (torch.randn(B, KV, T, D, generator=g).to(dtype) for _ in range(2))
        keep = torch.rand(B, 1, S, T, generator=g) < 0.7
        keep[..., 0] = True
        keep[1, :, :, 25:] = False  # row 1 holds 25 positions; the rest is whatever the cache has
        keep[1, :, 2] = False  # and a query of it sees nothing (padding): zeros, beside queries that see keys
        kn, vn = k.clone(), v.clone()
        hidden = ~keep.any(dim=2)  # [B, 1, T]: slots no query of the row sees
        kn.masked_fill_(hidden[:, :, :, None].expand(B, KV, T, D), float("nan"))
        vn.masked_fill_(hidden[:, :, :, None].expand(B, KV, T, D), float("nan"))
        want = attend(q, k, v, keep, False, kernel="step")
        assert bool(hidden.any()) and not want.isnan().any() and not want[1, :, 2].any()
        # and right: SDPA in float32 under the same mask (its keys with holes: rows that weight one key
        # of a pair only), the query that sees nothing left out (SDPA gives NaN there)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, enable_gqa=True)
        seen = keep.any(-1).expand(B, H, S)
        tol = 2e-6 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(want.float()[seen], ref[seen], atol=tol, rtol=tol)
        assert torch.equal(attend(q, kn, vn, keep, False, kernel="step"), want), dtype


@pytest.mark.parametrize("D", [64, 128])
def test_step_kernel_rows_ignore_nonfinite_values_only_later_rows_see(D):
    """An infinite value in the newest cache slot (one only the block's last query sees, next to a key
    T - 2 that only the query before it also sees) leaves every other query of the block finite and
    equal to that query alone; and an infinite value under one query's mask, next to a key that query
    sees, leaves it finite and equal to SDPA's (the other key of a pair read alone)."""
    _step_kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    T, S, H, KV = 58, 8, 9, 3  # T even: keys T - 2 and T - 1 form a pair
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, H, S, D, generator=g).to(dtype)
        k, v = (torch.randn(1, KV, T, D, generator=g).to(dtype) for _ in range(2))
        v[:, :, T - 1] = float("inf")
        block = attend(q, k, v, None, True, kernel="step")
        assert block[:, :, : S - 1].isfinite().all() and not block[:, :, S - 1].isfinite().all()
        for i in range(S - 1):
            one = attend(q[:, :, i : i + 1], k[:, :, : T - S + i + 1], v[:, :, : T - S + i + 1], None, False, kernel="step")
            assert torch.equal(one, block[:, :, i : i + 1]), (dtype, i)
        # query 0 sees keys 0..9 but 8, query 1 all ten; key 8's values are infinite
        q2 = torch.randn(1, H, 2, D, generator=g).to(dtype)
        k2, v2 = (torch.randn(1, KV, 10, D, generator=g).to(dtype) for _ in range(2))
        v2[:, :, 8] = float("inf")
        sees = torch.ones(1, 1, 2, 10, dtype=torch.bool)
        sees[0, 0, 0, 8] = False
        got = attend(q2, k2, v2, sees, False, kernel="step")
        assert not got[:, :, 1].isfinite().all()
        finite = v2.float().nan_to_num(posinf=0.0)  # SDPA's masked weights multiply the values too: 0 x inf
        want = F.scaled_dot_product_attention(q2[:, :, :1].float(), k2.float(), finite, attn_mask=sees[:, :, :1],
                                              enable_gqa=True)
        tol = 2e-6 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[:, :, :1].float(), want, atol=tol, rtol=tol)


def test_step_kernel_suffix_causal_equals_its_mask_and_any_thread_count():
    """Same-start verify rows pass `suffix_causal` (the kernel's bottom-right causal instead of
    reading the mask): bit-identical to the explicit mask; and the split of a kv head's query rows
    into tasks (by thread count) does not change a bit."""
    _step_kernel_or_skip()
    g = torch.Generator().manual_seed(5)
    H, KV, D = 9, 3, 64
    threads = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for S, T in ((16, 216), (8, 37), (3, 16)):
                q = torch.randn(2, H, S, D, generator=g).to(dtype)
                k, v = (torch.randn(2, KV, T, D, generator=g).to(dtype) for _ in range(2))
                mask = (torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None])[None, None]
                want = attend(q, k, v, mask, False, kernel="step")
                assert torch.equal(attend(q, k, v, mask, False, kernel="step", suffix_causal=True), want)
                assert torch.equal(attend(q, k, v, None, True, kernel="step"), want)
                torch.set_num_threads(1)
                assert torch.equal(attend(q, k, v, mask, False, kernel="step"), want)
                torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_rows_equals_masked_attention_over_gathered_rows(dtype):
    """attend_rows: query (b, s) over cache row rows[b]'s keys 0 .. positions[b, s], in one call:
    the same bits as the masked kernel over the gathered rows, close to SDPA; rows or positions
    outside the cache are refused with a clear error."""
    from draftsmith.models.attention import attend_rows

    g = torch.Generator().manual_seed(2)
    R, KV, H, D, T = 7, 2, 6, 64, 200
    kc, vc = (torch.randn(R, KV, T, D, generator=g).to(dtype) for _ in range(2))
    rows = torch.tensor([6, 0, 3, 2])
    for S in (1, 5):
        pos = torch.tensor([[120], [0], [199 - S + 1], [33]]) + torch.arange(S)
        q = torch.randn(4, H, S, D, generator=g).to(dtype)
        got = attend_rows(q, kc, vc, rows, pos)
        n = int(pos.max()) + 1
        mask = (torch.arange(n)[None, None, :] <= pos[:, :, None])[:, None]
        ref = torch.ops.draftsmith.attention(q, kc[rows, :, :n], vc[rows, :, :n], mask, False, D ** -0.5)
        assert torch.equal(got, ref)
        sdpa = F.scaled_dot_product_attention(q.float(), kc[rows, :, :n].float(), vc[rows, :, :n].float(),
                                              attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got.float(), sdpa, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    q1 = torch.randn(1, H, 1, D).to(dtype)
    with pytest.raises(RuntimeError, match="a row outside the cache"):
        attend_rows(q1, kc, vc, torch.tensor([R]), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="a position outside the cache"):
        attend_rows(q1, kc, vc, torch.tensor([0]), torch.tensor([[T]]))


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kernels_read_a_strided_query_as_its_contiguous_copy(dtype):
    """The step kernels read q through its strides (a layer's q is a view of the fused q/k/v output,
    [B, S, heads, D] transposed): the same bits as a contiguous copy, for attention and attention_rows;
    a q without unit stride in D is copied first."""
    g = torch.Generator().manual_seed(3)
    B, H, KV, S, D, T = 2, 6, 2, 5, 64, 40
    fused = torch.randn(B, S, H + 2 * KV, D, generator=g).to(dtype)
    q = fused.narrow(2, 0, H).transpose(1, 2)  # [B, H, S, D], not contiguous
    assert not q.is_contiguous()
    k, v = (torch.randn(B, KV, T, D, generator=g).to(dtype) for _ in range(2))
    ops = torch.ops.draftsmith
    assert torch.equal(ops.attention(q, k, v, None, True, D ** -0.5), ops.attention(q.contiguous(), k, v, None, True, D ** -0.5))
    rows, pos = torch.tensor([1, 0]), torch.tensor([[30], [7]]) + torch.arange(S)
    assert torch.equal(ops.attention_rows(q, k, v, rows, pos, D ** -0.5),
                       ops.attention_rows(q.contiguous(), k, v, rows, pos, D ** -0.5))
    odd = torch.randn(B, H, D, S, generator=g).to(dtype).transpose(2, 3)  # stride 1 not in D
    assert torch.equal(ops.attention(odd, k, v, None, True, D ** -0.5), ops.attention(odd.contiguous(), k, v, None, True, D ** -0.5))

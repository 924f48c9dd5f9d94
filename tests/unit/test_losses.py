"""Drafter losses and anchor sampling against straightforward loop-based references."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.drafters.anchors import eligible_anchors, pack_blocks, sample_anchors
from draftsmith.drafters.losses import (
    BlockLossWeights, block_loss, confidence_bce, forward_kl, l1_distance, position_weights, temperature_scale,
    ttt_loss, ttt_step_weights,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def test_weights_follow_the_paper():
    w = position_weights(7)
    assert w.tolist() == pytest.approx([math.exp(-(k - 1) / 7) for k in range(1, 8)])
    assert position_weights(4, decay=2.0).tolist() == pytest.approx([math.exp(-k / 2) for k in range(4)])
    assert ttt_step_weights(7).tolist() == pytest.approx([0.8**i for i in range(7)])


def test_per_item_terms_match_definitions():
    g = torch.Generator().manual_seed(0)
    dl, tl = torch.randn(5, 9, generator=g) * 2, torch.randn(5, 9, generator=g) * 2
    tp = torch.softmax(tl, -1)
    tp[0] = 0.0
    tp[0, 3] = 1.0  # a one-hot target: KL must handle p_t = 0 entries
    for n in range(5):
        pd = _softmax(dl[n].tolist())
        pt = tp[n].tolist()
        kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(pt, pd) if a > 0)
        assert float(forward_kl(dl, tp)[n]) == pytest.approx(kl, rel=1e-4, abs=1e-5)
        l1 = sum(abs(a - b) for a, b in zip(pd, pt))
        assert float(l1_distance(torch.softmax(dl, -1), tp)[n]) == pytest.approx(l1, rel=1e-5)
    z, c = torch.randn(6, generator=g), torch.rand(6, generator=g)
    ref = [-(ci * math.log(1 / (1 + math.exp(-zi))) + (1 - ci) * math.log(1 - 1 / (1 + math.exp(-zi))))
           for zi, ci in zip(z.tolist(), c.tolist())]
    assert confidence_bce(z, c).tolist() == pytest.approx(ref, rel=1e-5)
    assert forward_kl(tl, torch.softmax(tl, -1)).abs().max() < 1e-5  # zero at the optimum
    # the target's Σ p log p given by the caller (EAGLE-3: once per batch) gives the same KL
    torch.testing.assert_close(forward_kl(dl, tp, torch.xlogy(tp, tp).sum(-1)), forward_kl(dl, tp), atol=1e-6, rtol=1e-6)


def _block_loss_reference(dl, tl, x, mask, z, gamma, coef):
    """Loop over (block, position): weighted means with w_k = exp(-(k-1)/γ)."""
    num = {"ce": 0.0, "tv": 0.0, "conf": 0.0}
    den = 0.0
    B, A, K, _ = dl.shape
    for b in range(B):
        for a in range(A):
            for k in range(K):
                if not mask[b, a, k]:
                    continue
                w = math.exp(-k / gamma)
                pd = _softmax(dl[b, a, k].tolist())
                pt = _softmax(tl[b, a, k].tolist())
                l1 = sum(abs(p - q) for p, q in zip(pd, pt))
                c_star = 1 - 0.5 * l1
                c = 1 / (1 + math.exp(-float(z[b, a, k])))
                num["ce"] += w * -math.log(pd[int(x[b, a, k])])
                num["tv"] += w * l1
                num["conf"] += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
                den += w
    parts = {k: v / den for k, v in num.items()}
    total = coef.ce * parts["ce"] + coef.tv * parts["tv"] + coef.conf * parts["conf"]
    return total, parts


@pytest.mark.parametrize("coef", [BlockLossWeights(), BlockLossWeights(ce=1.0, tv=0.0, conf=0.0)])
def test_block_loss_equals_loop_reference(coef):
    g = torch.Generator().manual_seed(1)
    B, A, K, V = 2, 3, 4, 11
    dl = torch.randn(B, A, K, V, generator=g) * 2
    tl = torch.randn(B, A, K, V, generator=g) * 2
    x = torch.randint(0, V, (B, A, K), generator=g)
    z = torch.randn(B, A, K, generator=g)
    mask = torch.rand(B, A, K, generator=g) < 0.7
    mask[0, 0, 0] = True
    position = torch.arange(K).expand(B, A, K)[mask]
    out = block_loss(dl[mask], x[mask], position, K, coef, tl[mask], z[mask])
    ref_total, ref_parts = _block_loss_reference(dl, tl, x, mask, z, K, coef)
    assert float(out.total) == pytest.approx(ref_total, rel=1e-5)
    for name, value in out.parts.items():
        if name in ref_parts:
            assert value == pytest.approx(ref_parts[name], rel=1e-5), name
    if coef.tv == 0:
        assert set(out.parts) == {"ce"}  # DFlash: CE only, no target logits needed


def test_block_loss_with_a_reduced_draft_vocabulary():
    """p_d on D ⊂ V: TV counts the target mass outside D (the drafter can never draft it);
    CE skips data tokens outside D. Reference: the full-vocabulary formulas with p_d = 0
    outside D, written as loops."""
    g = torch.Generator().manual_seed(4)
    N, V, K = 9, 12, 3
    draft_ids = torch.tensor([0, 2, 3, 7, 8, 11])
    index = torch.full((V,), len(draft_ids))
    index[draft_ids] = torch.arange(len(draft_ids))
    dl = torch.randn(N, len(draft_ids), generator=g) * 2
    tl = torch.randn(N, V, generator=g) * 2
    x = torch.randint(0, V, (N,), generator=g)
    x[0], x[1] = 2, 5  # one token inside D, one outside
    z = torch.randn(N, generator=g)
    position = torch.arange(N) % K
    coef = BlockLossWeights(ce=0.1, tv=0.9, conf=1.0)
    out = block_loss(dl, index[x], position, K, coef, tl, z, None, draft_ids)
    w = position_weights(K).tolist()
    ce_num = ce_den = tv_num = conf_num = den = 0.0
    for n in range(N):
        pd = [0.0] * V
        for j, p in zip(draft_ids.tolist(), _softmax(dl[n].tolist())):
            pd[j] = p
        pt = _softmax(tl[n].tolist())
        l1 = sum(abs(a - b) for a, b in zip(pd, pt))
        wk = w[int(position[n])]
        if int(x[n]) in draft_ids.tolist():
            ce_num += wk * -math.log(pd[int(x[n])])
            ce_den += wk
        c, label = 1 / (1 + math.exp(-float(z[n]))), 1 - 0.5 * l1
        tv_num += wk * l1
        conf_num += wk * -(label * math.log(c) + (1 - label) * math.log(1 - c))
        den += wk
    ref = 0.1 * ce_num / ce_den + 0.9 * tv_num / den + conf_num / den
    assert float(out.total) == pytest.approx(ref, rel=1e-5)
    assert out.parts["ce"] == pytest.approx(ce_num / ce_den, rel=1e-5)


def test_block_loss_from_draft_vocabulary_logits_and_the_rest_equals_the_full_vocabulary():
    """The target's distribution as its logits over the draft vocabulary + the log-sum-exp of the
    other logits + its argmax (BlockBackbone.target_stats) gives the loss of the full logits, every
    term and metric; a wrong rest log-sum-exp (the mass outside the draft vocabulary) changes it."""
    g = torch.Generator().manual_seed(5)
    N, V, K = 11, 12, 3
    draft_ids = torch.tensor([0, 2, 3, 7, 8, 11])
    outside = torch.ones(V, dtype=torch.bool)
    outside[draft_ids] = False
    index = torch.full((V,), len(draft_ids))
    index[draft_ids] = torch.arange(len(draft_ids))
    dl = torch.randn(N, len(draft_ids), generator=g) * 2
    tl = torch.randn(N, V, generator=g) * 2
    tl[1, 5] = 9.0  # the target's argmax outside the draft vocabulary
    x = torch.randint(0, V, (N,), generator=g)
    z = torch.randn(N, generator=g)
    position = torch.arange(N) % K
    coef = BlockLossWeights(ce=0.1, tv=0.9, conf=1.0, kl=0.5)
    full = block_loss(dl, index[x], position, K, coef, tl, z, None, draft_ids)
    rest = torch.logsumexp(tl[:, outside], -1)
    split = block_loss(dl, index[x], position, K, coef, tl[:, draft_ids], z, None, draft_ids, rest, tl.argmax(-1))
    assert float(split.total) == pytest.approx(float(full.total), rel=1e-6)
    assert split.parts == pytest.approx(full.parts, rel=1e-6)
    wrong = block_loss(dl, index[x], position, K, coef, tl[:, draft_ids], z, None, draft_ids, rest + 1.0,
                       tl.argmax(-1))
    assert abs(float(wrong.total) - float(full.total)) > 1e-3


def test_confidence_label_carries_no_gradient():
    g = torch.Generator().manual_seed(2)
    dl = torch.randn(6, 8, generator=g, requires_grad=True)
    z = torch.randn(6, generator=g, requires_grad=True)
    out = block_loss(dl, torch.zeros(6, dtype=torch.long), torch.arange(6) % 3, 3,
                     BlockLossWeights(ce=0.0, tv=0.0, conf=1.0), torch.randn(6, 8, generator=g), z)
    out.total.backward()
    assert dl.grad is None or float(dl.grad.abs().max()) == 0.0  # c* is a label
    assert float(z.grad.abs().max()) > 0


def test_ttt_loss_equals_loop_reference():
    g = torch.Generator().manual_seed(3)
    steps = [(torch.randn(n, 7, generator=g), torch.softmax(torch.randn(n, 7, generator=g), -1)) for n in (5, 4, 2)]
    ref = 0.0
    for i, (dl, tp) in enumerate(steps):
        kl = 0.0
        for row_l, row_p in zip(dl.tolist(), tp.tolist()):
            pd = _softmax(row_l)
            kl += sum(a * (math.log(a) - math.log(b)) for a, b in zip(row_p, pd))
        ref += 0.8**i * kl / dl.shape[0]
    out = ttt_loss([s[0] for s in steps], [s[1] for s in steps])
    assert float(out.total) == pytest.approx(ref, rel=1e-5)
    assert set(out.parts) == {"kl@0", "kl@1", "kl@2"}


def test_sts_temperature_scaling():
    c = torch.tensor([[0.9, 0.6, 0.3]])
    out = temperature_scale(c, [2.0, 0.5])  # the third position keeps T = 1
    ref = [1 / (1 + math.exp(-math.log(p / (1 - p)) / t)) for p, t in zip([0.9, 0.6, 0.3], [2.0, 0.5, 1.0])]
    assert out[0].tolist() == pytest.approx(ref, rel=1e-5)


# ---------------------------------------------------------------------------- anchors


def _batch_masks(seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 30
    lengths = torch.tensor([30, 21, 9])
    loss_mask = torch.rand(B, T, generator=g) < 0.6
    loss_mask[:, :5] = False  # a prompt
    for b in range(B):
        loss_mask[b, int(lengths[b]):] = False
    return loss_mask, lengths


def test_anchors_only_where_the_first_draft_is_loss_masked():
    loss_mask, lengths = _batch_masks()
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors=4, generator=torch.Generator().manual_seed(0))
    ok = eligible_anchors(loss_mask, lengths)
    for b in range(3):
        mine = anchors[b][valid[b]].tolist()
        want = [a for a in range(30) if a + 1 < int(lengths[b]) and bool(loss_mask[b, a + 1])]
        assert len(mine) == min(4, len(want))
        assert mine == sorted(set(mine))  # distinct, sorted
        assert set(mine) <= set(want)
        assert ok[b].nonzero().squeeze(-1).tolist() == want
    # Fewer eligible anchors than the cap: every one of them is used.
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors=100)
    for b in range(3):
        assert anchors[b][valid[b]].tolist() == ok[b].nonzero().squeeze(-1).tolist()


def test_anchor_sampling_is_reproducible_and_uniform_enough():
    loss_mask, lengths = _batch_masks()
    a1, _ = sample_anchors(loss_mask, lengths, 3, torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(loss_mask, lengths, 3, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)
    g = torch.Generator().manual_seed(8)
    seen = torch.zeros(30)
    for _ in range(300):
        a, v = sample_anchors(loss_mask[:1], lengths[:1], 3, g)
        seen[a[0][v[0]]] += 1
    eligible = eligible_anchors(loss_mask[:1], lengths[:1])[0]
    assert bool((seen[eligible] > 0).all()) and float(seen[~eligible].sum()) == 0
    # uniform over the eligible positions: chi-square against the uniform law, and the same test
    # rejects a sampler biased towards early anchors (negative control; issue 16: "uniform
    # enough" passed a heavily biased sampler)
    from chi_square import chi2_pvalue

    uniform = eligible.double() / eligible.sum()
    assert chi2_pvalue(seen, uniform) > 1e-4
    biased = torch.zeros(30)
    idx = eligible.nonzero().squeeze(-1)
    w = torch.linspace(2.0, 1.0, idx.numel())
    for _ in range(300):
        biased[idx[torch.multinomial(w, 3, generator=g)]] += 1
    assert chi2_pvalue(biased, uniform) < 1e-4


def test_pack_blocks_masks_match_a_loop():
    loss_mask, lengths = _batch_masks()
    anchors, valid = sample_anchors(loss_mask, lengths, 5, torch.Generator().manual_seed(0))
    gamma = 4
    pack = pack_blocks(loss_mask, lengths, anchors, valid, gamma)
    B, A = anchors.shape
    for b in range(B):
        for j in range(A):
            a = int(anchors[b, j])
            for t in range(30):
                assert bool(pack.context_mask[b, j, t]) == (bool(valid[b, j]) and t < a)
            for k in range(1, gamma + 1):
                want = bool(valid[b, j]) and a + k < int(lengths[b]) and bool(loss_mask[b, min(a + k, 29)])
                assert bool(pack.target_mask[b, j, k - 1]) == want
                if want:
                    assert int(pack.target_index[b, j, k - 1]) == a + k


def test_optional_kl_term_is_the_weighted_forward_kl():
    """kl weight > 0 adds Σ w_k KL(p_t ‖ p_d) / Σ w_k (loop reference), zero where p_d = p_t;
    with a reduced vocabulary it runs over D with p_t restricted to D (unnormalised)."""
    g = torch.Generator().manual_seed(7)
    N, V, K = 8, 10, 4
    dl, tl = torch.randn(N, V, generator=g) * 2, torch.randn(N, V, generator=g) * 2
    x, position = torch.randint(0, V, (N,), generator=g), torch.arange(N) % K
    coef = BlockLossWeights(ce=0.0, tv=0.0, conf=0.0, kl=0.5)
    out = block_loss(dl, x, position, K, coef, tl)
    w = position_weights(K).tolist()
    num = den = 0.0
    for n in range(N):
        pd, pt = _softmax(dl[n].tolist()), _softmax(tl[n].tolist())
        kl = sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, pd))
        num += w[int(position[n])] * kl
        den += w[int(position[n])]
    assert out.parts["kl"] == pytest.approx(num / den, rel=1e-5)
    assert float(out.total) == pytest.approx(0.5 * num / den, rel=1e-5)
    assert block_loss(tl, x, position, K, coef, tl).parts["kl"] == pytest.approx(0.0, abs=1e-6)
    draft_ids = torch.tensor([1, 4, 5, 9])
    red = block_loss(dl[:, draft_ids], x.clamp(max=3), position, K, coef, tl, None, None, draft_ids)
    num = 0.0
    for n in range(N):
        pd = _softmax(dl[n, draft_ids].tolist())
        pt = [_softmax(tl[n].tolist())[j] for j in draft_ids.tolist()]
        num += w[int(position[n])] * sum(p * (math.log(p) - math.log(q)) for p, q in zip(pt, pd))
    assert red.parts["kl"] == pytest.approx(num / den, rel=1e-5)
    assert "kl" not in block_loss(dl, x, position, K, BlockLossWeights(), tl, torch.zeros(N)).parts

"""target_probs / sample_from against plain per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.warp import argmax_rows, inverse_cdf, sample_from, target_probs
from draftsmith.kernels.build import cpu_kernels
from draftsmith.errors import DraftsmithError


def _reference_row(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """One position, written the slow obvious way in float64: logits [V] -> probs [V]."""
    z = logits.double().clone()
    V = z.numel()
    if sp.temperature == 0:
        out = torch.zeros(V, dtype=torch.float64)
        out[int(torch.argmax(z))] = 1.0
        return out
    z = z / sp.temperature
    if 0 < sp.top_k < V:
        kth = sorted(z.tolist(), reverse=True)[sp.top_k - 1]
        z[z < kth] = -math.inf
    if sp.top_p < 1.0:
        probs = torch.softmax(z, dim=0)
        mass, cutoff = 0.0, None
        for value in sorted(probs.tolist(), reverse=True):
            mass += value
            cutoff = value
            if mass >= sp.top_p:
                break
        z[probs < cutoff] = -math.inf
    probs = torch.softmax(z, dim=0)
    if sp.min_p > 0:
        probs[probs < sp.min_p * probs.max()] = 0.0
        probs = probs / probs.sum()
    return probs


def _reference(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    B, S, _ = logits.shape
    rows = [[_reference_row(logits[b, s], params[b]) for s in range(S)] for b in range(B)]
    return torch.stack([torch.stack(r) for r in rows])


PARAM_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.8),
    SamplingParams(top_k=1),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=0.6),
    SamplingParams(min_p=0.1),
    SamplingParams(min_p=0.3, temperature=1.5),
    SamplingParams(temperature=0.8, top_k=8, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5),  # greedy ignores warps
]


@pytest.mark.parametrize("sp", PARAM_CASES, ids=repr)
def test_uniform_batch_matches_reference(sp: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 32, generator=g) * 3  # [B, S, V]
    probs = target_probs(logits, [sp] * 3)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    torch.testing.assert_close(probs.double(), _reference(logits, [sp] * 3), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))


def test_mixed_batch_equals_per_row_calls() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAM_CASES), 3, 40, generator=g) * 2  # [B, S, V]
    mixed = target_probs(logits, PARAM_CASES)
    for b, sp in enumerate(PARAM_CASES):
        alone = target_probs(logits[b : b + 1], [sp])
        torch.testing.assert_close(mixed[b : b + 1], alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed.double(), _reference(logits, PARAM_CASES), atol=1e-5, rtol=1e-4)


def test_greedy_is_one_hot_lowest_index_on_ties() -> None:
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0]]])  # [1, 2, 4]
    probs = target_probs(logits, [SamplingParams(temperature=0.0)])
    assert probs.tolist() == [[[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]]


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
def test_argmax_kernel_gives_torch_argmax() -> None:
    """The greedy argmax kernel (kernels/gemv.cpp) against torch.argmax: widths with and without
    whole 16-lane chunks, the vocabulary's width, ties (first index), NaN (counts as the largest),
    infinities, a row of -inf; and the greedy warp goes through it."""
    g = torch.Generator().manual_seed(3)
    for V in (1, 7, 16, 17, 100, 49152):
        for N in (1, 3, 16):
            x = torch.randn(N, V, generator=g)
            assert torch.equal(argmax_rows(x), x.argmax(-1)), (N, V)
            ties = torch.randint(0, 3, (N, V), generator=g).float()
            assert torch.equal(argmax_rows(ties), ties.argmax(-1)), (N, V)
    x = torch.randn(5, 1000, generator=g)
    x[0, 5] = x[0, 7] = float("nan")
    x[1, 3] = float("inf")
    x[2, 9] = -float("inf")
    x[3] = -float("inf")
    x[3, 500] = float("nan")
    x[4] = -float("inf")
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(-1)) and got.tolist() == [5, 3, int(x[2].argmax()), 500, 0]
    calls = []
    real = torch.ops.draftsmith.argmax
    try:
        torch.ops.draftsmith.argmax = lambda t: calls.append(t.shape) or real(t)
        p = target_probs(x[1:3, None], [SamplingParams(temperature=0.0)] * 2)
    finally:
        torch.ops.draftsmith.argmax = real
    assert calls and torch.equal(p[:, 0].argmax(-1), x[1:3].argmax(-1))


def test_top_k_keeps_ties_at_the_boundary() -> None:
    logits = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.0]]])
    probs = target_probs(logits, [SamplingParams(top_k=2)])
    assert (probs[0, 0] > 0).tolist() == [True, False, True, True, False]


def test_top_p_keeps_smallest_set_reaching_the_mass_and_always_the_top_token() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log().view(1, 1, 4)
    kept = lambda top_p: (target_probs(logits, [SamplingParams(top_p=top_p)])[0, 0] > 0).tolist()  # noqa: E731
    assert kept(0.01) == [True, False, False, False]
    assert kept(0.5) == [True, False, False, False]  # 0.5 already reaches 0.5
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.96) == [True, True, True, True]


def test_min_p_drops_relative_to_the_top_token() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log().view(1, 1, 4)
    probs = target_probs(logits, [SamplingParams(min_p=0.31)])[0, 0]  # threshold 0.155
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_top_p_one_keeps_the_tail_in_a_mixed_batch() -> None:
    # A long flat tail: cumsum rounding reaches 1.0 early; top_p == 1 must still keep it.
    logits = torch.cat([torch.tensor([20.0]), torch.zeros(50_000)]).view(1, 1, -1).repeat(2, 1, 1)
    probs = target_probs(logits, [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)])
    assert bool((probs[0, 0] > 0).all())
    assert int((probs[1, 0] > 0).sum()) == 1


def test_matches_hf_transformers_warpers() -> None:
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 100, generator=g) * 2  # [rows, V]
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.85, min_p=0.05)
    scores = logits.clone()
    for warper in (
        lp.TemperatureLogitsWarper(sp.temperature),
        lp.TopKLogitsWarper(sp.top_k),
        lp.TopPLogitsWarper(sp.top_p),
        lp.MinPLogitsWarper(sp.min_p),
    ):
        scores = warper(None, scores)
    expected = torch.softmax(scores, dim=-1)
    got = target_probs(logits.unsqueeze(1), [sp] * 6).squeeze(1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_no_sort_without_top_p_and_no_topk_without_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("expensive op used on the fast path")

    logits = torch.randn(4, 3, 64)
    monkeypatch.setattr(torch, "sort", boom)
    monkeypatch.setattr(torch, "topk", boom)
    probs = target_probs(logits, [SamplingParams(temperature=0.9, min_p=0.1)] * 4)
    assert probs.shape == (4, 3, 64)
    probs = target_probs(logits, [SamplingParams(temperature=0.0)] * 4)
    assert probs.shape == (4, 3, 64)


def test_bad_inputs_raise_draftsmith_error() -> None:
    with pytest.raises(DraftsmithError, match="2 SamplingParams for a batch of 3"):
        target_probs(torch.zeros(3, 1, 5), [SamplingParams()] * 2)
    with pytest.raises(DraftsmithError, match=r"\[B, S, V\]"):
        target_probs(torch.zeros(3, 5), [SamplingParams()] * 3)


def test_sample_from_is_seeded_inverse_cdf() -> None:
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    for seed in range(20):
        u = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
        expected = next(i for i, c in enumerate(probs.cumsum(0).tolist()) if c > u)
        assert sample_from(probs, torch.Generator().manual_seed(seed)) == expected


def test_sample_from_consumes_exactly_one_uniform() -> None:
    g, ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sample_from(torch.ones(7), g)
    torch.rand(1, generator=ref)
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))


def test_sample_from_matches_distribution_and_never_picks_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(6)
    n = 4000
    for _ in range(n):
        counts[sample_from(probs, g)] += 1
    assert counts[[0, 2, 5]].sum() == 0
    chi2 = float((((counts - n * probs) ** 2)[[1, 3, 4]] / (n * probs[[1, 3, 4]])).sum())
    assert chi2 < 18.4  # chi-square, 2 dof, p = 1e-4


def test_inverse_cdf_edge_u_and_unnormalised_rows() -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0], [1.0, 1.0, 0.0]])  # totals 2 and 2, last token empty
    u = torch.tensor([1.0 - 2**-24, 1.0 - 2**-24])
    assert inverse_cdf(probs, u).tolist() == [1, 1]
    assert inverse_cdf(probs, torch.zeros(2)).tolist() == [1, 0]
    with pytest.raises(ValueError):
        inverse_cdf(torch.zeros(1, 3), torch.zeros(1))


@pytest.mark.parametrize("scale", [0.01, 0.3, 1.0, 10.0])  # nuclei from a few tokens to most of V
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_from_leading_tokens_equals_a_full_sort(scale, top_p) -> None:
    V = 5000
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(7)) * scale
    got = target_probs(logits.view(6, 1, V), [SamplingParams(top_p=top_p)] * 6)[:, 0] > 0
    srt = torch.sort(logits, dim=-1, descending=True).values
    p = torch.softmax(srt, dim=-1)
    n_keep = ((p.cumsum(-1) - p) < top_p).sum(-1, keepdim=True)
    want = logits >= srt.gather(-1, n_keep - 1)
    assert torch.equal(got, want)
    assert int(n_keep.max()) > 256 or scale > 0.5  # the flat cases do need the escalation


def test_position_uniforms_are_splitmix64_of_seed_and_position():
    """core/warp.py's vectorised uniforms equal SplitMix64 written out on Python ints (the
    definition seeded requests' reproducibility rests on), for any seed (negative, past 2^63),
    any start and many rows at once."""
    import random

    from draftsmith.core.warp import position_uniforms, position_uniforms_rows

    M = (1 << 64) - 1

    def mix(x: int) -> int:
        x = (x + 0x9E3779B97F4A7C15) & M
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
        return x ^ (x >> 31)

    def reference(seed: int, start: int, n: int) -> list[float]:
        s = mix(seed & M)
        return [(mix(s ^ mix(t)) >> 11) * 2.0 ** -53 for t in range(start, start + n)]

    rng = random.Random(0)
    keys = [(rng.choice([0, -5, 2**63 - 1, 2**64 - 1, rng.getrandbits(64)]), rng.randrange(10**6)) for _ in range(200)]
    rows = position_uniforms_rows(keys, 9)
    assert rows.dtype == torch.float64 and rows.shape == (200, 9)
    assert rows.tolist() == [reference(s, t, 9) for s, t in keys]
    assert position_uniforms(*keys[0], 9).tolist() == reference(*keys[0], 9)
    assert 0.0 <= float(rows.min()) and float(rows.max()) < 1.0

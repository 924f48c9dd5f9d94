"""verify(): greedy exactness, ragged rows, bad input, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal
from draftsmith.core.verify import verify, verify_greedy
from draftsmith.core.warp import sample_from, target_probs
from draftsmith.errors import DraftsmithError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_case(B: int, K: int, V: int, seed: int) -> tuple[Proposal, torch.Tensor]:
    """Drafts sampled from random q, random p, ragged lengths."""
    g = _gen(seed)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=-1)  # [B, K, V]
    tokens = torch.multinomial(q.view(B * K, V), 1, generator=g).view(B, K)  # [B, K]
    lengths = torch.randint(0, K + 1, (B,), generator=g)  # [B]
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, dim=-1)  # [B, K+1, V]
    return Proposal(tokens=tokens, lengths=lengths, q=q), p


def _check_layout(res, lengths: torch.Tensor, V: int) -> None:
    """Committed prefix is in-vocab, then -1 padding; num_accepted within [0, lengths]."""
    B, K1 = res.tokens.shape
    assert res.tokens.dtype == torch.long and res.num_accepted.dtype == torch.long
    assert bool((res.num_accepted >= 0).all()) and bool((res.num_accepted <= lengths).all())
    for b in range(B):
        n = int(res.num_committed[b])
        assert all(0 <= t < V for t in res.tokens[b, :n].tolist())
        assert res.tokens[b, n:].tolist() == [-1] * (K1 - n)


def test_greedy_accepts_argmax_prefix_and_replaces_first_mismatch() -> None:
    B, K, V = 6, 5, 11
    logits = torch.randn(B, K + 1, V, generator=_gen(0))
    p = target_probs(logits, [SamplingParams(temperature=0.0)] * B)  # one-hot [B, K+1, V]
    argmax = logits.argmax(-1)  # [B, K+1]
    tokens = argmax[:, :K].clone()
    tokens[1, 0] = (argmax[1, 0] + 1) % V  # mismatch at 0
    tokens[2, 3] = (argmax[2, 3] + 2) % V  # mismatch at 3
    lengths = torch.tensor([5, 5, 5, 2, 0, 4])
    q_soft = torch.softmax(torch.randn(B, K, V, generator=_gen(1)), dim=-1)
    for q in (None, q_soft):  # deterministic drafter, or sampled from some q
        for seed in range(5):
            res = verify(Proposal(tokens, lengths, q), p, [_gen(seed + b) for b in range(B)])
            assert res.num_accepted.tolist() == [5, 0, 3, 2, 0, 4]
            for b in range(B):
                n = int(res.num_accepted[b])
                # Every committed token is the target's argmax at its position.
                assert res.tokens[b, : n + 1].tolist() == argmax[b, : n + 1].tolist()


def test_ragged_lengths_including_zero() -> None:
    prop, p = _random_case(B=16, K=6, V=9, seed=3)
    prop.lengths = torch.tensor([0, 1, 6, 3] * 4)
    res = verify(prop, p, [None] * 16)
    assert res.tokens.shape == (16, 7)
    _check_layout(res, prop.lengths, 9)
    zero_rows = prop.lengths == 0
    assert bool((res.num_accepted[zero_rows] == 0).all())
    # Accepted drafts are copied verbatim.
    for b in range(16):
        n = int(res.num_accepted[b])
        assert res.tokens[b, :n].tolist() == prop.tokens[b, :n].tolist()


def test_empty_draft_dimension_k0() -> None:
    p = torch.softmax(torch.randn(3, 1, 5), dim=-1)
    res = verify(Proposal.empty(3), p, [_gen(0), None, _gen(1)])
    assert res.tokens.shape == (3, 1) and res.num_accepted.tolist() == [0, 0, 0]
    assert res.tokens[0, 0] == sample_from(p[0, 0], _gen(0))


def test_length_zero_row_matches_sample_from() -> None:
    """A row with no drafts is plain sampling: same token as the non-speculative path."""
    prop, p = _random_case(B=4, K=3, V=50, seed=4)
    prop.lengths = torch.tensor([0, 0, 2, 0])
    for seed in range(10):
        res = verify(prop, p, [_gen(seed), _gen(seed + 100), _gen(7), _gen(seed + 200)])
        for b, s in ((0, seed), (1, seed + 100), (3, seed + 200)):
            assert int(res.tokens[b, 0]) == sample_from(p[b, 0], _gen(s))


def test_always_accepts_when_p_dominates_q_at_the_draft() -> None:
    V = 4
    q = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]])  # [1, 2, V]
    p = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.0, 0.0, 0.0, 1.0]]])
    prop = Proposal(tokens=torch.tensor([[0, 1]]), lengths=torch.tensor([2]), q=q)
    for seed in range(20):
        res = verify(prop, p, [_gen(seed)])
        assert res.tokens.tolist() == [[0, 1, 3]]  # both accepted, bonus from p[:, 2]


def test_never_accepts_a_token_with_zero_target_mass() -> None:
    q = torch.full((1, 1, 3), 1 / 3)
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    prop = Proposal(tokens=torch.tensor([[0]]), lengths=torch.tensor([1]), q=q)
    for seed in range(20):
        res = verify(prop, p, [_gen(seed)])
        assert res.num_accepted.item() == 0 and res.tokens[0, 0].item() in (1, 2)


def test_one_hot_q_none_equals_explicit_one_hot() -> None:
    prop, p = _random_case(B=8, K=4, V=12, seed=5)
    one_hot = torch.nn.functional.one_hot(prop.tokens, 12).float()  # [B, K, V]
    for seed in range(5):
        a = verify(Proposal(prop.tokens, prop.lengths, None), p, [_gen(seed + b) for b in range(8)])
        b = verify(Proposal(prop.tokens, prop.lengths, one_hot), p, [_gen(seed + b) for b in range(8)])
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_q_none_residual_excludes_the_rejected_token() -> None:
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])  # [1, 2, 3]
    prop = Proposal(tokens=torch.tensor([[0]]), lengths=torch.tensor([1]))
    seen = set()
    for seed in range(40):
        res = verify(prop, p, [_gen(seed)])
        seen.add(tuple(res.tokens[0].tolist()))
    assert seen == {(0, 2), (1, -1)}  # accepted 0 + bonus 2, or rejected and replaced by 1


def test_zero_mass_residual_falls_back_to_p() -> None:
    # p(x) < q(x) at the draft but p <= q everywhere: the residual is empty, so a rejection
    # (which float error or an unnormalised q can cause) must still commit a token from p.
    p = torch.tensor([[[0.3, 0.7, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.6, 0.8, 0.0]]])
    prop = Proposal(tokens=torch.tensor([[0]]), lengths=torch.tensor([1]), q=q)
    outcomes = {tuple(verify(prop, p, [_gen(s)]).tokens[0].tolist()) for s in range(40)}
    assert (0, 0) in outcomes  # accepted, bonus
    assert outcomes <= {(0, 0), (0, -1), (1, -1)}
    assert len(outcomes) > 1
    # Near-equal p and q from float noise: no NaN, valid tokens.
    logits = torch.randn(32, 3, 20, generator=_gen(9))
    p = torch.softmax(logits, dim=-1)
    q = torch.softmax(logits[:, :2] + 1e-6 * torch.randn(32, 2, 20, generator=_gen(10)), dim=-1)
    tokens = torch.multinomial(q.view(-1, 20), 1, generator=_gen(11)).view(32, 2)
    res = verify(Proposal(tokens, torch.full((32,), 2), q), p, [None] * 32)
    _check_layout(res, torch.full((32,), 2), 20)


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    prop, p = _random_case(B=10, K=7, V=30, seed=6)
    seeds = list(range(100, 110))
    full = verify(prop, p, [_gen(s) for s in seeds])
    again = verify(prop, p, [_gen(s) for s in seeds])
    assert torch.equal(full.tokens, again.tokens)
    for b in (0, 3, 9):
        alone = verify(
            Proposal(prop.tokens[b : b + 1], prop.lengths[b : b + 1], prop.q[b : b + 1]),
            p[b : b + 1],
            [_gen(seeds[b])],
        )
        assert torch.equal(alone.tokens[0], full.tokens[b])
        # Other rows unseeded (global RNG) and in a different order: row b unchanged.
        order = [b] + [i for i in range(10) if i != b]
        gens = [_gen(seeds[b])] + [None] * 9
        mixed = verify(Proposal(prop.tokens[order], prop.lengths[order], prop.q[order]), p[order], gens)
        assert torch.equal(mixed.tokens[0], full.tokens[b])


def test_generator_consumption_is_lengths_plus_one() -> None:
    """The row's generator advances the same amount whatever the outcome."""
    prop, p = _random_case(B=1, K=5, V=10, seed=8)
    prop.lengths = torch.tensor([3])
    g, ref = _gen(42), _gen(42)
    verify(prop, p, [g])
    torch.rand(4, generator=ref)
    assert torch.equal(torch.rand(2, generator=g), torch.rand(2, generator=ref))


def test_bad_draft_id_names_id_and_vocab() -> None:
    prop, p = _random_case(B=3, K=4, V=10, seed=9)
    prop.lengths = torch.tensor([4, 2, 4])
    prop.tokens[1, 3] = 99  # padding: ignored
    prop.tokens[1, 1] = 10  # real draft: out of range
    with pytest.raises(DraftsmithError, match=r"id 10 .*V=10"):
        verify(prop, p, [None] * 3)
    prop.tokens[1, 1] = -3
    with pytest.raises(DraftsmithError, match=r"id -3 .*V=10"):
        verify(prop, p, [None] * 3)
    prop.tokens[1, 1] = 2
    verify(prop, p, [None] * 3)  # padding value 99 is fine


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda prop, p: (prop, p[:, :-1]), "draft tokens have shape"),
        (lambda prop, p: (prop, p[:2]), "draft tokens have shape"),
        (lambda prop, p: (prop, p[0]), r"\[B, K\+1, V\]"),
        (lambda prop, p: (Proposal(prop.tokens, prop.lengths[:2], prop.q), p), "lengths have shape"),
        (lambda prop, p: (Proposal(prop.tokens, prop.lengths, prop.q[..., :5]), p), "q has shape"),
        (lambda prop, p: (Proposal(prop.tokens, torch.tensor([1, 5, 2]), prop.q), p), "lengths must be in"),
        (lambda prop, p: (Proposal(prop.tokens, torch.tensor([1, -1, 2]), prop.q), p), "lengths must be in"),
    ],
)
def test_bad_shapes_and_lengths_raise(mutate, message: str) -> None:
    prop, p = _random_case(B=3, K=4, V=10, seed=10)
    prop, p = mutate(prop, p)
    with pytest.raises(DraftsmithError, match=message):
        verify(prop, p, [None] * 3)


def test_wrong_number_of_generators_raises() -> None:
    prop, p = _random_case(B=3, K=4, V=10, seed=11)
    with pytest.raises(DraftsmithError, match="2 generators for a batch of 3"):
        verify(prop, p, [None, None])


def test_drafted_token_with_zero_q_is_a_bug() -> None:
    prop, p = _random_case(B=2, K=3, V=6, seed=12)
    prop.lengths = torch.tensor([3, 3])
    prop.q[1, 2, prop.tokens[1, 2]] = 0.0
    with pytest.raises(ValueError, match="q = 0"):
        verify(prop, p, [None, None])


def _reference_verify_row(tokens, length, q, p, g) -> list[int]:
    """The paper's loop for one row, written plainly; same uniform layout as verify()."""
    u = torch.rand(length + 1, generator=g)
    committed = []
    for k in range(length):
        x = int(tokens[k])
        qx = 1.0 if q is None else float(q[k, x])
        if float(u[k]) < float(p[k, x]) / qx:
            committed.append(x)
            continue
        residual = p[k].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (p[k] - q[k]).clamp_min(0.0)
        dist = residual if float(residual.sum()) > 1e-6 * float(p[k].sum()) else p[k]
        break
    else:
        dist = p[length]
    cdf = dist.cumsum(0)
    target = float(u[length]) * float(cdf[-1])
    committed.append(next(i for i, c in enumerate(cdf.tolist()) if c > target))
    return committed


@pytest.mark.parametrize("with_q", [True, False])
def test_matches_a_plain_per_row_loop(with_q: bool) -> None:
    B, K, V = 24, 6, 7
    prop, p = _random_case(B, K, V, seed=13)
    q = prop.q if with_q else None
    for seed in range(10):
        res = verify(Proposal(prop.tokens, prop.lengths, q), p, [_gen(seed * B + b) for b in range(B)])
        for b in range(B):
            expected = _reference_verify_row(
                prop.tokens[b], int(prop.lengths[b]), None if q is None else q[b], p[b], _gen(seed * B + b)
            )
            n = len(expected)
            assert res.tokens[b, :n].tolist() == expected
            assert int(res.num_accepted[b]) == n - 1


def test_half_precision_inputs_are_upcast() -> None:
    prop, p = _random_case(B=4, K=3, V=16, seed=14)
    half = verify(Proposal(prop.tokens, prop.lengths, prop.q.half()), p.bfloat16(), [_gen(b) for b in range(4)])
    _check_layout(half, prop.lengths, 16)


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("K", [0, 1, 5])
def test_verify_greedy_commits_what_verify_commits_on_one_hot_p(with_q: bool, K: int) -> None:
    """The all-greedy shortcut (the engine's path when every row is greedy) against `verify`
    on the one-hot p that target_probs builds: same tokens, same accepted counts, over drafts
    that agree with the argmax for a random prefix (ties included), with and without q."""
    B, V = 7, 12
    greedy = [SamplingParams(temperature=0.0)] * B
    for seed in range(40):
        g = _gen(seed)
        logits = torch.randint(0, 4, (B, K + 1, V), generator=g).float()  # small ints: ties are common
        am = logits.argmax(-1)  # first maximum, as target_probs' one-hot
        agree = torch.randint(0, K + 1, (B,), generator=g)
        noise = torch.randint(0, V, (B, K), generator=g)
        tokens = torch.where(torch.arange(K)[None] < agree[:, None], am[:, :K], noise)
        lengths = torch.randint(0, K + 1, (B,), generator=g)
        q = None
        if with_q:
            q = torch.softmax(torch.randn(B, K, V, generator=g), dim=-1)  # positive at every draft
        prop = Proposal(tokens=tokens, lengths=lengths, q=q)
        want = verify(prop, target_probs(logits, greedy), [_gen(seed)] * B)
        got = verify_greedy(prop, am, V)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
        # negative control: an argmax off by one somewhere the drafts reach gives other tokens
        wrong = am.clone()
        wrong[:, 0] = (wrong[:, 0] + 1) % V
        assert not torch.equal(verify_greedy(prop, wrong, V).tokens, want.tokens)


def test_verify_greedy_checks_like_verify() -> None:
    prop = Proposal(tokens=torch.tensor([[3, 99]]), lengths=torch.tensor([2]))
    with pytest.raises(DraftsmithError, match="outside the vocabulary"):
        verify_greedy(prop, torch.zeros(1, 3, dtype=torch.long), 10)
    q = torch.full((1, 2, 10), 0.1)
    q[0, 1, 4] = 0.0
    with pytest.raises(ValueError, match="q = 0"):
        verify_greedy(Proposal(tokens=torch.tensor([[3, 4]]), lengths=torch.tensor([2]), q=q),
                      torch.tensor([[3, 4, 5]]), 10)
    with pytest.raises(DraftsmithError, match="draft tokens have shape"):
        verify_greedy(prop, torch.zeros(1, 2, dtype=torch.long), 10)

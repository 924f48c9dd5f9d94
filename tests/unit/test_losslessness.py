"""Statistical losslessness of verify(): committed tokens are distributed exactly as p.

Set-up: a small vocabulary and position-indexed first-order Markov models, M[t, prev] =
distribution of the token at position t given the previous token (prev = BOS at t = 0).
The target is P, the drafter Q. N independent rows (one batch; global RNG under a fixed
seed, so every test is deterministic) generate L = γ + 2 tokens by repeated rounds: draft
γ tokens autoregressively from Q after the last committed token, as a real drafter would,
then let verify() commit some. With L = γ + 2 the observed window always includes a round
boundary and, when a first round accepts everything, its bonus token.

Check: Pearson chi-square against the exact target law, computed by propagating the chain
(m_0 = P[0, BOS], m_t = m_{t-1} P[t]): the first token, the first two tokens jointly, and
the last two of the L tokens jointly. Cells with expected count < 5 are pooled; a token seen
where the target has zero mass fails outright. A check fails when its p-value is below
ALPHA = 1e-4, the false-failure rate per check if the seeds were changed (~100 checks here:
~1% for the file). A negative control runs two deliberately biased verifiers through the
same check and asserts that it catches them. The first-draft acceptance rate is also checked
against 1 - TV(p, q): a verifier that rejected too often could still be lossless, but would
waste the drafter.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.verify import verify
from draftsmith.core.warp import target_probs
from chi_square import chi2_pvalue  # noqa: E402  (tests/unit helper)

ALPHA = 1e-4
N_ROWS = 100_000
V = 12
BOS = 0


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- models


def _models(kind: str, markov: bool, gamma: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q), each [T, V, V] with T = L + γ positions: P[t, prev] is the target at position t.

    markov=False: position- and prefix-independent distributions (one vector, tiled).
    For the one_hot kinds Q is what the drafts come from; verify() is told q = None.
    """
    g = torch.Generator().manual_seed(seed)
    T = 2 * gamma + 2
    shape = (T, V, V) if markov else (1, 1, V)

    def rand_logits(scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).expand(T, V, V).contiguous()

    def warped(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        return target_probs(logits.view(T * V, 1, V), [sp] * (T * V)).view(T, V, V)

    p_logits = rand_logits(1.5)
    P = torch.softmax(p_logits, dim=-1)
    if kind == "disjoint":
        P = torch.softmax(p_logits.index_fill(-1, torch.arange(V // 2, V), -float("inf")), -1)
        Q = torch.softmax(rand_logits(1.0).index_fill(-1, torch.arange(0, V // 2), -float("inf")), -1)
    elif kind == "equal":
        Q = P.clone()
    elif kind == "near_uniform":
        Q = torch.softmax(rand_logits(0.1), dim=-1)
    elif kind == "peaked":
        Q = torch.softmax(rand_logits(4.0), dim=-1)
    elif kind == "close":  # a good drafter: the target's logits plus noise
        Q = torch.softmax(p_logits + rand_logits(0.5), dim=-1)
    elif kind in ("one_hot_argmax", "one_hot_sampled"):
        Q = torch.softmax(p_logits + rand_logits(1.0), dim=-1)
    elif kind == "warped":  # p: temperature + top-k + top-p + min-p; q: top-k only
        P = warped(p_logits, SamplingParams(temperature=0.7, top_k=8, top_p=0.8, min_p=0.05))
        Q = warped(p_logits + rand_logits(1.0), SamplingParams(top_k=4))
    elif kind == "greedy_target":
        P = warped(p_logits, SamplingParams(temperature=0.0))
        Q = torch.softmax(rand_logits(1.0), dim=-1)
    else:
        raise ValueError(kind)
    return P, Q


def _marginals(P: torch.Tensor, L: int) -> list[torch.Tensor]:
    """Exact target marginals m_t [V] of positions t = 0..L-1 (float64)."""
    m = [P[0, BOS].double()]
    for t in range(1, L):
        m.append(m[-1] @ P[t].double())
    return m


# ----------------------------------------------------------------------------- simulation


def _draw(probs: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [N, V] (torch.multinomial is ~10x slower here).

    u is shrunk by 1e-6 so rounding can never step past the last token with mass.
    """
    cdf = probs.cumsum(-1)  # [N, V]
    u = torch.rand(probs.shape[0], 1, generator=g) * cdf[:, -1:] * (1 - 1e-6)  # [N, 1]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def _round(P, Q, kind, prev, start, lengths, verifier, g, keys=None) -> VerifyResult:
    """One round for n rows: draft γ tokens after prev [n] from positions start [n] on."""
    n, gamma = prev.numel(), int(lengths.max()) if lengths.numel() else 0
    gamma = max(gamma, 1)
    chain = torch.empty(n, gamma + 1, dtype=torch.long)  # [n, γ+1]: prev, x_1..x_γ
    chain[:, 0] = prev
    for k in range(gamma):
        q_k = Q[start + k, chain[:, k]]  # [n, V]
        chain[:, k + 1] = q_k.argmax(-1) if kind == "one_hot_argmax" else _draw(q_k, g)
    pos = start.unsqueeze(1) + torch.arange(gamma + 1)  # [n, γ+1]
    p = P[pos, chain]  # [n, γ+1, V]: p[:, k] = target at draft k's position given its prefix
    q = None if kind.startswith("one_hot") else Q[pos[:, :-1], chain[:, :-1]]  # [n, γ, V]
    if keys is not None:
        return verifier(Proposal(chain[:, 1:], lengths, q), p, [None] * n, keys)
    return verifier(Proposal(chain[:, 1:], lengths, q), p, [None] * n)


def _generate(P, Q, kind, gamma, verifier, seed, ragged=False, keyed=None):
    """Generate L = γ + 2 tokens per row by repeated rounds.

    Returns (sequences [N, L], first-round first-draft accepted [N] bool). ragged: each round
    verifies a length drawn uniformly from 0..γ before drafting (non-anticipating).
    keyed(rows, start) -> per-row (seed, position) keys: position-keyed verification.
    """
    L = gamma + 2
    g = torch.Generator().manual_seed(seed)
    seq = torch.full((N_ROWS, L + gamma + 1), -1, dtype=torch.long)  # room for a full round
    filled = torch.zeros(N_ROWS, dtype=torch.long)  # [N] tokens committed so far
    first_accepted = None
    with torch.random.fork_rng(devices=[]):
        # Not `seed`: the global RNG and g would then replay one stream, and a drafter's
        # uniform could equal a verifier's (we saw that bias the negative control).
        torch.manual_seed(seed + 7_919)
        while bool((filled < L).any()):
            rows = (filled < L).nonzero().squeeze(-1)  # [n]
            start = filled[rows]  # [n]
            prev = torch.where(start > 0, seq[rows, (start - 1).clamp_min(0)], BOS)
            if ragged:
                lengths = torch.randint(0, gamma + 1, (rows.numel(),), generator=g)
            else:
                lengths = torch.full((rows.numel(),), gamma)
            keys = None if keyed is None else keyed(rows.tolist(), start.tolist())
            res = _round(P, Q, kind, prev, start, lengths, verifier, g, keys)
            if first_accepted is None:
                first_accepted = (res.num_accepted >= 1) & (lengths >= 1)
            cols = start.unsqueeze(1) + torch.arange(res.tokens.shape[1])  # [n, γ+1]
            mask = res.tokens >= 0  # committed entries
            seq[rows.unsqueeze(1).expand_as(cols)[mask], cols[mask]] = res.tokens[mask]
            filled[rows] += res.num_committed
    return seq[:, :L], first_accepted


# ----------------------------------------------------------------------------- statistics


def _pvalues(P: torch.Tensor, seq: torch.Tensor) -> dict[str, float]:
    """p-values of the first token, the first pair and the last pair of seq [N, L]."""
    L = seq.shape[1]
    m = _marginals(P, L)

    def pair(t: int) -> float:  # positions (t-1, t)
        law = m[t - 1].unsqueeze(1) * P[t].double()  # [V, V]
        return chi2_pvalue(torch.bincount(seq[:, t - 1] * V + seq[:, t], minlength=V * V), law)

    return {
        "first": chi2_pvalue(torch.bincount(seq[:, 0], minlength=V), m[0]),
        "first_pair": pair(1),
        "last_pair": pair(L - 1),
    }


def _expected_first_acceptance(P, Q, kind) -> float:
    p, q = P[0, BOS].double(), Q[0, BOS].double()
    if kind == "one_hot_argmax":
        alpha = float(p[q.argmax()])
    elif kind == "one_hot_sampled":
        alpha = float((p * q).sum())
    else:
        alpha = float(torch.minimum(p, q).sum())  # 1 - TV(p, q)
    return min(max(alpha, 0.0), 1.0)


# ----------------------------------------------------------------------------- tests

KINDS = ["disjoint", "equal", "near_uniform", "peaked", "close", "one_hot_argmax",
         "one_hot_sampled", "warped", "greedy_target"]


@pytest.mark.parametrize("gamma", [1, 3, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_committed_tokens_follow_the_target(kind: str, gamma: int) -> None:
    markov = gamma != 3  # γ = 3: position/prefix-independent q and p; γ = 1, 7: Markov
    seed = 1000 * gamma + KINDS.index(kind)
    P, Q = _models(kind, markov, gamma, seed)
    seq, accepted = _generate(P, Q, kind, gamma, verify, seed)
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"

    alpha = _expected_first_acceptance(P, Q, kind)
    rate = accepted.double().mean().item()
    sd = (alpha * (1 - alpha) / N_ROWS) ** 0.5
    if sd < 1e-9:  # acceptance certain or impossible: must be exact
        assert rate == pytest.approx(alpha, abs=1e-9)
    else:
        assert abs(rate - alpha) < 3.9 * sd, f"acceptance {rate:.4f} vs 1-TV {alpha:.4f}"


@pytest.mark.parametrize("kind", ["close", "one_hot_sampled", "warped"])
def test_ragged_lengths_stay_lossless(kind: str) -> None:
    P, Q = _models(kind, True, 5, seed=77)
    seq, _ = _generate(P, Q, kind, 5, verify, seed=78, ragged=True)
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"


# ----------------------------------------------------------------------------- negative control


def _biased_verify(proposal: Proposal, p: torch.Tensor, mode: str) -> VerifyResult:
    """Deliberately wrong verifiers (test-only). Global RNG; q must be given.

    always_accept:   commit every draft, then a bonus token from p.
    resample_from_p: the right acceptance test, but replace a rejection with a sample from p
                     instead of the residual norm(max(p - q, 0)).
    stale_bonus:     the real verifier, but the bonus token is drawn from the last draft's
                     position (p[len-1]) instead of the bonus position (p[len]): invisible
                     in the first token, visible only where a bonus token is observed.
    """
    tokens, lengths, q = proposal.tokens, proposal.lengths, proposal.q
    if mode == "stale_bonus":
        rows = (lengths > 0).nonzero().squeeze(-1)
        p = p.clone()
        p[rows, lengths[rows]] = p[rows, lengths[rows] - 1]
        return verify(proposal, p, [None] * proposal.batch_size)
    B, K = tokens.shape
    rows = torch.arange(B)
    if mode == "always_accept":
        n = lengths.clone()
    else:
        pick = tokens.unsqueeze(-1)
        ratio = p[:, :K].gather(-1, pick).squeeze(-1) / q.gather(-1, pick).squeeze(-1)  # [B, K]
        valid = torch.arange(K).unsqueeze(0) < lengths.unsqueeze(1)
        accept = (torch.rand(B, K) < ratio) & valid
        n = accept.long().cumprod(-1).sum(-1)
    out = torch.full((B, K + 1), -1, dtype=torch.long)
    out[:, :K] = torch.where(torch.arange(K).unsqueeze(0) < n.unsqueeze(1), tokens, out[:, :K])
    out[rows, n] = _draw(p[rows, n], None)
    return VerifyResult(tokens=out, num_accepted=n)


@pytest.mark.parametrize(
    "kind, gamma, modes",
    [
        ("peaked", 3, ("always_accept", "resample_from_p")),
        ("near_uniform", 7, ("always_accept", "resample_from_p")),
        ("close", 1, ("always_accept", "resample_from_p", "stale_bonus")),
        ("equal", 7, ("stale_bonus",)),  # first tokens exact; only the last pair shows it
    ],
)
def test_negative_control_biased_verifiers_fail_the_check(kind: str, gamma: int, modes) -> None:
    seed = 5000 + 10 * gamma + KINDS.index(kind)
    P, Q = _models(kind, True, gamma, seed)
    # The same seed and model with the real verifier passes: the check, not luck, decides.
    seq, _ = _generate(P, Q, kind, gamma, verify, seed)
    assert min(_pvalues(P, seq).values()) >= ALPHA
    for mode in modes:

        def biased(proposal, p, generators):
            return _biased_verify(proposal, p, mode)

        seq, _ = _generate(P, Q, kind, gamma, biased, seed)
        pvalues = _pvalues(P, seq)
        assert min(pvalues.values()) < ALPHA, f"biased verifier {mode} passed: {pvalues}"


# ----------------------------------------------------------------------------- seeded rows (keys)


@pytest.mark.parametrize("kind, gamma", [("close", 3), ("near_uniform", 7), ("one_hot_sampled", 5), ("peaked", 1)])
def test_position_keyed_rows_follow_the_target_and_equal_plain_seeded_decoding(kind: str, gamma: int) -> None:
    """Issue 15 item 3: a seeded row verifies by position-keyed coupling. Over many seeds the
    output is distributed as p, and each seed's output equals plain decoding with that seed
    (no drafts) token for token, whatever the drafts and the (ragged) lengths were."""
    seed = 9000 + 10 * gamma + KINDS.index(kind)
    P, Q = _models(kind, True, gamma, seed)

    def keyed(rows, start):
        return [(seed * 1_000_003 + r, t) for r, t in zip(rows, start)]

    seq, _ = _generate(P, Q, kind, gamma, verify, seed, ragged=True, keyed=keyed)
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"
    plain, _ = _generate(P, Q, kind, 0, verify, seed + 1, keyed=keyed)  # one token per round
    L = min(seq.shape[1], plain.shape[1])
    assert torch.equal(seq[:, :L], plain[:, :L])


def test_negative_control_keys_that_ignore_the_position_fail_the_check() -> None:
    """The same rule with a key that does not advance with the position (every round reuses
    position 0's uniform) correlates consecutive tokens: the chi-square check must see it."""
    kind, gamma = "near_uniform", 1
    seed = 9500
    P, Q = _models(kind, True, gamma, seed)
    seq, _ = _generate(P, Q, kind, gamma, verify, seed, keyed=lambda rows, start: [(seed + r, 0) for r in rows])
    assert min(_pvalues(P, seq).values()) < ALPHA


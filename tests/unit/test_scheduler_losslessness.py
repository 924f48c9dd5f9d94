"""Losslessness of confidence-driven verify lengths (DSpark Algorithm 1 and its early stop).

Set-up (as in test_losslessness.py): a small vocabulary, position-indexed first-order Markov
models P[t, prev] (target) and Q[t, prev] (drafter). N independent rows, one batch, fixed
seeds, each generating L = K + 2 tokens by rounds: draft K tokens from Q after the last
committed token, with confidences like DSpark's head, c_k = C[class(x_{k-1})] (x_0 = the last
committed token), so c_{k+1} depends on the sampled draft x_k. The policy under test turns
the confidences into verify lengths (its real trim()); `draftsmith.core.verify.verify`
commits tokens.

Rows are served in groups of R requests (one engine step each): trim() sees a group's R rows
at once. Its decision depends only on the group's confidence pattern, so it is computed once
per distinct pattern (exact, and fast).

Padded cases run Algorithm 1 candidate by candidate and the default padded search, column by
column (`admit_columns`).

Check: Pearson chi-square of the first token, the first pair and the last pair against the
exact target law; a check fails below ALPHA = 1e-4 (~20 checks: ~0.2% false failures for the
file if the seeds were changed). Negative controls: the same pipeline with a scheduler
WITHOUT the early stop (a global search for the best prefix of the same sorted order: the
test-only `_global_search_without_early_stop` below) fails, with a p-value of ~0 on DSpark
appendix A's example (a_1 = 0.8, SPS = 1.0, 0.5, 0.45) and below ALPHA on a one-row CPU-like
cost curve where both variants verify varied lengths.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal
from draftsmith.core.verify import verify
from draftsmith.core.request import Request
from draftsmith.policy.acceptance import cumulative
from draftsmith.policy.prefix_scheduler import PrefixScheduler
from draftsmith.policy.profile import SPSTable
from draftsmith.policy.threshold import ConfidenceThreshold
from chi_square import chi2_pvalue  # noqa: E402  (tests/unit helper)

ALPHA = 1e-4
N_ROWS = 60_000
V = 8
BOS = 0
# The confidence head reads the previous token through its class (3 classes keep the number
# of distinct confidence patterns per group small, so the scheduler runs once per pattern).
CLASS_OF = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
HEAD_C = torch.tensor([0.95, 0.7, 0.35])  # c of the next draft, by class of the previous token


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------- models


def _models(K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, Q) [T, V, V]; Q is a decent drafter (the target's logits plus noise)."""
    g = torch.Generator().manual_seed(seed)
    T = 2 * K + 3
    logits = torch.randn(T, V, V, generator=g) * 1.5
    P = torch.softmax(logits, -1)
    Q = torch.softmax(logits + torch.randn(T, V, V, generator=g) * 0.7, -1)
    return P, Q


def _draw(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    cdf = probs.cumsum(-1)  # [n, V]
    u = torch.rand(probs.shape[0], 1, generator=g) * cdf[:, -1:] * (1 - 1e-6)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


# ----------------------------------------------------------------------------- schedulers


def _global_search_without_early_stop(conf: list[list[float]], sps) -> list[int]:
    """THE BROKEN VARIANT (test-only): Algorithm 1's order, but keep scanning past a
    candidate that does not improve Theta and return the best prefix found. Then c_{r,j+1}
    (a function of draft j) decides whether draft j is verified. Packed token count."""
    R = len(conf)
    cands = sorted(((a, j, r) for r, c in enumerate(conf) for j, a in enumerate(cumulative(c), 1)),
                   key=lambda t: (-t[0], t[1], t[2]))
    tau, best, best_n = float(R), R * sps(R), 0
    for n, (a, _, _) in enumerate(cands, 1):
        tau += a
        if tau * sps(R + n) > best:
            best, best_n = tau * sps(R + n), n
    ell = [0] * R
    for _, j, r in cands[:best_n]:
        ell[r] = j
    return ell


def _policy_lengths(policy):
    """Verify lengths from the real policy's trim() for one group's confidences."""
    seqs_cache: dict[int, list[Request]] = {}

    def lengths(conf: list[list[float]]) -> list[int]:
        R, K = len(conf), len(conf[0])
        seqs = seqs_cache.setdefault(R, [Request(f"r{i}", [0], SamplingParams(), None) for i in range(R)])
        proposal = Proposal(tokens=torch.zeros(R, K, dtype=torch.long), lengths=torch.full((R,), K),
                            confidences=torch.tensor(conf))
        return policy.trim(seqs, proposal)

    return lengths


def _broken(sps):
    return lambda conf: _global_search_without_early_stop(conf, sps)


# ----------------------------------------------------------------------------- simulation


def _generate(P, Q, C, K, R, schedule, seed):
    """Generate L = K + 2 tokens per row. C: [M] confidence of the next draft per class of
    the previous token (CLASS_OF). schedule(conf [R][K]) -> verify lengths.
    Returns (seq [N, L], histogram of verify lengths)."""
    L = K + 2
    g = torch.Generator().manual_seed(seed)
    seq = torch.full((N_ROWS, L + K + 1), -1, dtype=torch.long)
    filled = torch.zeros(N_ROWS, dtype=torch.long)
    seen = torch.zeros(K + 1, dtype=torch.long)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7_919)  # verify() draws from the global RNG
        while bool((filled < L).any()):
            rows = (filled < L).nonzero().squeeze(-1)  # [n]
            n = rows.numel()
            start = filled[rows]
            prev = torch.where(start > 0, seq[rows, (start - 1).clamp_min(0)], BOS)
            chain = torch.empty(n, K + 1, dtype=torch.long)  # prev, x_1..x_K
            chain[:, 0] = prev
            for k in range(K):
                chain[:, k + 1] = _draw(Q[start + k, chain[:, k]], g)
            pos = start.unsqueeze(1) + torch.arange(K + 1)  # [n, K+1]
            p = P[pos, chain]  # [n, K+1, V]
            q = Q[pos[:, :-1], chain[:, :-1]]  # [n, K, V]
            # DSpark-style confidence: c_k reads the token before draft k, so a row's
            # confidences are fixed by chain[:, :K]; a group's by its rows' patterns.
            cls = CLASS_OF[chain[:, :-1]]  # [n, K] confidence class of each draft's prefix
            M = len(C)
            pattern = (cls * M ** torch.arange(K)).sum(-1)  # [n] pattern id
            G = -(-n // R)
            groups = torch.full((G * R,), -1, dtype=torch.long)  # -1: no row (last group)
            groups[:n] = pattern
            uniq, inverse = torch.unique(groups.view(G, R), dim=0, return_inverse=True)
            lengths = torch.zeros(uniq.shape[0], R, dtype=torch.long)
            for u, key in enumerate(uniq.tolist()):
                rows_conf = [[float(C[(c // M**k) % M]) for k in range(K)] for c in key if c >= 0]
                lengths[u, : len(rows_conf)] = torch.tensor(schedule(rows_conf))
            ell = lengths[inverse].view(-1)[:n]  # [n]
            seen += torch.bincount(ell, minlength=K + 1)
            res = verify(Proposal(chain[:, 1:], ell, q), p, [None] * n)
            cols = start.unsqueeze(1) + torch.arange(K + 1)
            mask = res.tokens >= 0
            seq[rows.unsqueeze(1).expand_as(cols)[mask], cols[mask]] = res.tokens[mask]
            filled[rows] += res.num_committed
    return seq[:, :L], seen


# ----------------------------------------------------------------------------- statistics


def _pvalues(P: torch.Tensor, seq: torch.Tensor) -> dict[str, float]:
    L = seq.shape[1]
    m = [P[0, BOS].double()]
    for t in range(1, L):
        m.append(m[-1] @ P[t].double())

    def pair(t: int) -> float:
        law = m[t - 1].unsqueeze(1) * P[t].double()
        return chi2_pvalue(torch.bincount(seq[:, t - 1] * V + seq[:, t], minlength=V * V), law)

    return {"first": chi2_pvalue(torch.bincount(seq[:, 0], minlength=V), m[0]),
            "first_pair": pair(1), "last_pair": pair(L - 1)}


# ----------------------------------------------------------------------------- tests

# DSpark appendix A: one request, a_1 = 0.8, SPS(1..3) = 1.0, 0.5, 0.45. With the early stop,
# admitting draft 1 gives 1.8 * 0.5 = 0.9 < 1.0: stop, verify nothing. Without it, draft 2
# gives (1.8 + 0.8 c_2) * 0.45 > 1.0 iff c_2 > 0.528, so draft 1 is verified exactly when
# it is a token after which the head is confident (c_2 = C[x_1] high).
APPENDIX_SPS = SPSTable((1, 2, 3), (1.0, 0.5, 0.45))


# c_2 = C[class of x_1]: 0.95 after tokens of class 0, 0.05 after class 1 or 2 (c_1 is
# pinned to 0.8 by _appendix_schedule).
APPENDIX_C = torch.tensor([0.95, 0.05, 0.05])


def _appendix_schedule(inner):
    """Appendix A pins a_1 = 0.8: replace c_1 (whatever the committed token) by 0.8."""
    return lambda conf: inner([[0.8] + c[1:] for c in conf])


def test_appendix_a_with_early_stop_is_lossless() -> None:
    P, Q = _models(2, seed=11)
    policy = PrefixScheduler(APPENDIX_SPS, max_k=2, batch_tokens="packed", adapt=False)
    seq, seen = _generate(P, Q, APPENDIX_C, 2, 1, _appendix_schedule(_policy_lengths(policy)), seed=12)
    assert seen[1:].sum() == 0  # Theta drops at the first candidate: nothing is verified
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"


def test_appendix_a_without_early_stop_is_biased() -> None:
    P, Q = _models(2, seed=11)
    seq, seen = _generate(P, Q, APPENDIX_C, 2, 1, _appendix_schedule(_broken(APPENDIX_SPS)), seed=12)
    assert seen[2] > 0 and seen[0] > 0 and seen[1] == 0  # l = 2 exactly when c_2 = C[x_1] is high
    pv = _pvalues(P, seq)
    assert pv["first"] < 1e-12, pv  # not a borderline miss: the first token is far off


def _sps(tokens: tuple[int, ...], step_times: tuple[float, ...]) -> SPSTable:
    return SPSTable.from_step_times(tokens, step_times)


# CPU-like cost curves (docs/ARCHITECTURE.md): the first extra verify token is expensive, later ones
# nearly free. So Theta first dips, then rises: exactly where the early stop and a global
# search disagree, and where the verify length depends on the drafts through c_k.
CASES = {
    "one-row": (1, 4, "packed", _sps((1, 2, 3, 4, 5), (1.0, 1.6, 1.65, 1.7, 1.75)), "early-stop"),
    "two-rows": (2, 3, "packed", _sps((1, 2, 3, 4, 5, 6, 7, 8), (0.8, 1.0, 1.3, 1.33, 1.36, 1.39, 1.42, 1.45)),
                 "early-stop"),
    "two-rows-padded": (2, 3, "padded", _sps((2, 4, 6, 8), (1.0, 1.3, 1.36, 1.42)), "early-stop"),
    # the default padded search, column by column (admit_columns): a column opens on the drafts
    # of all rows together, each row's length still fixed by its own earlier drafts
    "two-rows-padded-columns": (2, 3, "padded", _sps((2, 4, 6, 8), (1.0, 1.5, 1.6, 1.7)), "columns"),
    "four-rows-padded-columns": (4, 3, "padded", _sps((4, 8, 12, 16), (1.0, 1.4, 1.5, 1.6)), "columns"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_scheduler_with_early_stop_is_lossless(case: str) -> None:
    """Varied lengths that depend on the drafts through c_k: still the target law."""
    R, K, batch_tokens, sps, search = CASES[case]
    P, Q = _models(K, seed=20 + R)
    policy = PrefixScheduler(sps, max_k=K, batch_tokens=batch_tokens, adapt=False, padded_search=search)
    seq, seen = _generate(P, Q, HEAD_C, K, R, _policy_lengths(policy), seed=30 + R)
    assert seen[0] > 0 and seen[1:].sum() > 0 and (seen > 0).sum() >= 3, seen.tolist()
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"


def test_one_row_case_without_early_stop_is_biased() -> None:
    """Negative control for the case above (the bias shows where a bonus/next round is seen)."""
    R, K, _, sps, _ = CASES["one-row"]
    P, Q = _models(K, seed=20 + R)
    seq, _ = _generate(P, Q, HEAD_C, K, R, _broken(sps), seed=30 + R)
    assert min(_pvalues(P, seq).values()) < ALPHA


def test_threshold_policy_is_lossless() -> None:
    K = 4
    P, Q = _models(K, seed=41)
    policy = ConfidenceThreshold(threshold=0.6, max_k=K)
    seq, seen = _generate(P, Q, HEAD_C, K, 1, _policy_lengths(policy), seed=42)
    assert (seen > 0).sum() >= 3, seen.tolist()
    for name, pv in _pvalues(P, seq).items():
        assert pv >= ALPHA, f"{name}: p-value {pv:.2e}"

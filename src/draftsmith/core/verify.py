"""Chain verification: the only place draft tokens are accepted.

Notation (Leviathan et al. 2023; Chen et al. 2023): **p is the target distribution, q is the
draft distribution** the draft tokens were sampled from. For one row with drafts x_1..x_γ:

- left to right, accept x_k with probability min(1, p_k(x_k) / q_k(x_k));
- at the first rejection, sample a replacement from norm(max(p_k - q_k, 0)) and stop;
- if all γ are accepted, sample a bonus token from p_{γ+1}.

The committed tokens are then distributed exactly as if sampled from p one at a time.

Special cases that are the same code, not branches:
- greedy: p is one-hot (temperature 0), so the ratio is exactly 1 (accept) or 0 (reject)
  and the residual is the one-hot itself — the argmax replaces the first mismatch (a batch
  of greedy rows only can skip p altogether: `verify_greedy`, the same tokens from the argmax);
- deterministic drafters (n-gram, argmax drafts) pass q = None, meaning one-hot at the
  drafted tokens: the acceptance probability is p_k(x_k) and the residual is p_k with x_k
  zeroed. The one-hot is never materialised.

Randomness: row b draws only from generators[b] (None = the global RNG), and always the same
number of uniforms, lengths[b] + 1, in one call: uniform k decides draft k, the last one
samples the final token (by inverse CDF, exactly like `sample_from`). The draw count does
not depend on the outcome, so the whole round is vectorised over the batch, and a seeded
row gives the same result whatever else is in the batch. A row with no drafts draws one
uniform and matches `sample_from(p[b, 0], generators[b])`.

Seeded requests (keys[b] = (seed, t0), t0 = the output position of this round's first
token): position-keyed coupling instead. Position t has its own uniform u_t, a pure function
of (seed, t) (`warp.position_uniforms`); the target's token there is y_t = inverse_cdf(p_t, u_t),
exactly what plain decoding with that seed samples. Draft k is accepted iff it equals y_{t0+k}
(and all before it were accepted); the round commits the accepted drafts and then y at the
first mismatch (or the bonus position). Every committed token is y_t, so the output is the
plain seeded output token for token — whatever the drafter, K, policy, batch or load — and
hence exactly distributed as p. q plays no part; acceptance is P(x = y), which reaches the
rejection rule's sum_v min(p, q) when the drafter samples by inverse CDF from the same u_t.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.warp import draw_uniforms, inverse_cdf, position_uniforms_rows
from draftsmith.errors import DraftsmithError

# Residual mass below this is float noise from p ≈ q (a rejection there has probability of
# the same order); sampling from p instead changes the output by at most that much.
_RESIDUAL_EPS = 1e-6


def verify(
    proposal: Proposal, p: torch.Tensor, generators: Sequence[torch.Generator | None],
    keys: Sequence[tuple[int, int] | None] | None = None,
) -> VerifyResult:
    """Accept or reject a batch of draft chains against the target distributions.

    proposal:   tokens [B, K], lengths [B], q [B, K, V] or None (one-hot at tokens).
    p:          [B, K+1, V] target probabilities; p[b, k] is the distribution at the
                position of draft k (k < lengths[b]), p[b, lengths[b]] the bonus position.
                Rows need not be exactly normalised (inverse CDF scales by the total).
    generators: one per row; None = global RNG.
    keys:       optional, one per row: (seed, first output position) for position-keyed
                coupling (see the module docstring), None for the rejection rule.
    Returns VerifyResult with tokens [B, K+1] padded by -1.

    Raises DraftsmithError for bad shapes, lengths outside [0, K] or draft ids outside
    [0, V) (what a mismatched drafter/target pair produces), and ValueError when a drafted
    token has q = 0 — the drafter did not pass the distribution it sampled from (a bug).
    """
    if p.dim() != 3 or not p.is_floating_point():
        raise DraftsmithError(f"verify: p must be a float tensor [B, K+1, V], got {tuple(p.shape)} {p.dtype}")
    tokens, lengths, q = _validated(proposal, tuple(p.shape), p.device, len(generators))
    if p.dtype in (torch.float16, torch.bfloat16):  # cumulative sums need more precision
        p = p.float()
    B, K1, V = p.shape
    K = K1 - 1
    dev = p.device
    rows = torch.arange(B, device=dev)  # [B]
    positions = torch.arange(K, device=dev)  # [K]

    valid = positions.unsqueeze(0) < lengths.unsqueeze(1)  # [B, K] real drafts, not padding
    if keys is not None and all(k is not None for k in keys):  # every row keyed (e.g. seeded regen)
        zeros = torch.zeros(B, dtype=torch.long, device=dev)
        num_accepted, final_token = _coupled(tokens, lengths, valid, p, keys, zeros, zeros)
        return _result(tokens, num_accepted, final_token)
    safe_tokens = tokens.masked_fill(~valid, 0)  # [B, K] padding -> any in-range id
    p_draft = p[:, :K].gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K] p_k(x_k)
    if q is None:
        ratio = p_draft  # q_k(x_k) = 1
    else:
        q_draft = q.gather(-1, safe_tokens.unsqueeze(-1)).squeeze(-1).to(p.dtype)  # [B, K]
        _refuse_zero_q(q_draft, valid, tokens)
        ratio = p_draft / q_draft.masked_fill(~valid, 1.0)

    u = _uniforms(lengths, generators, K, dev)  # [B, K+1]
    accept = (u[:, :K] < ratio) & valid  # [B, K]; u < 1 so ratio >= 1 always accepts
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B] length of accepted prefix
    rejected = num_accepted < lengths  # [B]

    # The final token comes from p at position num_accepted: the bonus position when all
    # drafts were accepted, else the rejected draft's position, minus q there (residual).
    final = p[rows, num_accepted]  # [B, V] (advanced indexing copies)
    if bool(rejected.any()):
        final = _residual(final, q, tokens, num_accepted, rejected)
    u_final = u[rows, lengths]  # [B]
    final_token = inverse_cdf(final, u_final)  # [B]

    if keys is not None and any(k is not None for k in keys):
        num_accepted, final_token = _coupled(tokens, lengths, valid, p, keys, num_accepted, final_token)

    return _result(tokens, num_accepted, final_token)


def verify_greedy(proposal: Proposal, target_argmax: torch.Tensor, vocab_size: int) -> VerifyResult:
    """`verify` for a batch whose rows are all greedy, from the target's argmax [B, K+1] alone.

    With p one-hot at the argmax a_k the rule above accepts draft k iff x_k == a_k (ratio 1
    or 0, whatever q is, since q_k(x_k) <= 1), and the final token is a at the first mismatch
    (the residual of a one-hot p is itself: q_k(a_k) < 1 when x_k != a_k was drawn from q_k)
    or at the bonus position; keyed rows give the same (inverse CDF of a one-hot is its
    argmax). So the committed tokens are those of `verify(proposal, one_hot(a), ...)`, without
    building [B, K+1, V] one-hot tensors or summing them (0.2 ms a decode step, 0.5 ms an
    8-token verify on one CPU core). No uniforms are drawn: a greedy row's outcome never
    depends on them. The same checks as `verify`; a drafted token with q = 0 is still refused."""
    if target_argmax.dim() != 2:
        raise DraftsmithError(f"verify_greedy: target_argmax must be [B, K+1], got {tuple(target_argmax.shape)}")
    B, K1 = target_argmax.shape
    tokens, lengths, q = _validated(proposal, (B, K1, int(vocab_size)), target_argmax.device, B)
    K = K1 - 1
    am = target_argmax.to(torch.long)
    valid = torch.arange(K, device=am.device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    if q is not None and K:
        q_draft = q.gather(-1, tokens.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)  # [B, K]
        _refuse_zero_q(q_draft, valid, tokens)
    num_accepted = ((tokens == am[:, :K]) & valid).long().cumprod(dim=-1).sum(dim=-1)  # [B]
    final_token = am[torch.arange(B, device=am.device), num_accepted]
    return _result(tokens, num_accepted, final_token)


def _refuse_zero_q(q_draft: torch.Tensor, valid: torch.Tensor, tokens: torch.Tensor) -> None:
    if bool(((q_draft <= 0) & valid).any()):
        b, k = ((q_draft <= 0) & valid).nonzero()[0].tolist()
        raise ValueError(
            f"verify: draft token {int(tokens[b, k])} at row {b}, position {k} has q = 0; "
            "the drafter must pass the distribution it sampled from"
        )


def _result(tokens: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> VerifyResult:
    """Accepted drafts, then the final token, padded by -1: [B, K+1]."""
    B, K = tokens.shape
    out = torch.full((B, K + 1), -1, dtype=torch.long, device=tokens.device)  # [B, K+1]
    keep = torch.arange(K, device=tokens.device).unsqueeze(0) < num_accepted.unsqueeze(1)  # [B, K]
    out[:, :K] = torch.where(keep, tokens, out[:, :K])
    out[torch.arange(B, device=tokens.device), num_accepted] = final_token
    return VerifyResult(tokens=out, num_accepted=num_accepted)


def _coupled(tokens, lengths, valid, p, keys, num_accepted, final_token):
    """Position-keyed rows: accept draft k iff it equals y_k = inverse_cdf(p_k, u_{t0+k});
    the final token is y at the first mismatch. Returns (num_accepted, final_token) with the
    keyed rows replaced."""
    B, K1, V = p.shape
    idx = [b for b, k in enumerate(keys) if k is not None]
    u = position_uniforms_rows([keys[b] for b in idx], K1, p.device)  # [n, K+1]
    y = inverse_cdf(p[idx].reshape(-1, V), u.reshape(-1)).view(len(idx), K1)  # [n, K+1]
    match = (tokens[idx] == y[:, : K1 - 1]) & valid[idx]  # [n, K]
    m = match.long().cumprod(dim=-1).sum(dim=-1)  # [n]
    rows = torch.tensor(idx, device=p.device)
    num_accepted = num_accepted.clone()
    final_token = final_token.clone()
    num_accepted[rows] = m
    final_token[rows] = y[torch.arange(len(idx), device=p.device), m]
    return num_accepted, final_token


def _residual(
    final: torch.Tensor,
    q: torch.Tensor | None,
    tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    rejected: torch.Tensor,
) -> torch.Tensor:
    """norm(max(p - q, 0)) for rejected rows of final [B, V] (normalisation is left to the
    sampler); rows whose residual has no mass (p == q up to float error) keep p."""
    B, K = tokens.shape
    rows = torch.arange(B, device=final.device)
    at = num_accepted.clamp(max=max(K - 1, 0))  # [B] rejected position (clamp: unused rows)
    if q is None:
        residual = final.clone()
        residual[rows, tokens[rows, at].clamp(0, final.shape[-1] - 1)] = 0.0
    else:
        residual = (final - q[rows, at].to(final.dtype)).clamp_min(0.0)  # [B, V]
    has_mass = residual.sum(dim=-1) > _RESIDUAL_EPS * final.sum(dim=-1)  # [B]
    use = (rejected & has_mass).unsqueeze(-1)  # [B, 1]
    return torch.where(use, residual, final)


def _uniforms(
    lengths: torch.Tensor, generators: Sequence[torch.Generator | None], K: int, dev: torch.device
) -> torch.Tensor:
    """[B, K+1] uniforms; row b's first lengths[b] + 1 entries come from generators[b].

    Rows without a generator share one draw from the global RNG (fast for large batches);
    their unused entries are simply ignored.
    """
    B = len(generators)
    u = torch.empty(B, K + 1, device=dev)
    seeded = [b for b, g in enumerate(generators) if g is not None]
    if len(seeded) < B:
        u[:] = torch.rand(B, K + 1, device=dev)
    if seeded:
        lens = lengths.tolist()
        for b in seeded:
            u[b, : lens[b] + 1] = draw_uniforms(lens[b] + 1, generators[b], dev)
    return u


def _validated(
    proposal: Proposal, shape: tuple[int, int, int], device: torch.device, n_generators: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check shapes, lengths and draft ids against p's shape [B, K+1, V]; return (tokens,
    lengths, q) on `device`."""
    tokens, lengths, q = proposal.tokens, proposal.lengths, proposal.q
    B, K1, V = shape
    if tokens.dim() != 2 or tuple(tokens.shape) != (B, K1 - 1):
        raise DraftsmithError(
            f"verify: draft tokens have shape {tuple(tokens.shape)}, expected [B, K] = {(B, K1 - 1)} "
            f"to match p of shape {tuple(shape)} = [B, K+1, V]"
        )
    if tuple(lengths.shape) != (B,):
        raise DraftsmithError(f"verify: lengths have shape {tuple(lengths.shape)}, expected ({B},)")
    if q is not None and tuple(q.shape) != (B, K1 - 1, V):
        raise DraftsmithError(f"verify: q has shape {tuple(q.shape)}, expected {(B, K1 - 1, V)}")
    if n_generators != B:
        raise DraftsmithError(f"verify: got {n_generators} generators for a batch of {B} rows")
    tokens = tokens.to(device, torch.long)
    lengths = lengths.to(device, torch.long)
    if B and (bool((lengths < 0).any()) or bool((lengths > K1 - 1).any())):
        raise DraftsmithError(
            f"verify: lengths must be in [0, K={K1 - 1}], got {lengths.tolist()}"
        )
    valid = torch.arange(K1 - 1, device=device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    bad = valid & ((tokens < 0) | (tokens >= V))  # [B, K]
    if bool(bad.any()):
        b, k = bad.nonzero()[0].tolist()
        raise DraftsmithError(
            f"verify: draft token id {int(tokens[b, k])} (row {b}, position {k}) is outside "
            f"the vocabulary [0, V={V}); the drafter and target vocabularies disagree"
        )
    if q is not None:
        q = q.to(device)
    return tokens, lengths, q

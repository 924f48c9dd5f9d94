"""Target logits -> target distribution p, and inverse-CDF sampling from it.

The warps, applied in this order (the order of HF transformers' logits warpers):

1. temperature: logits / T. T = 0 is greedy: p is one-hot at the argmax (ties -> lowest
   index, like `torch.argmax`), so the verifier needs no greedy branch.
2. top-k: keep tokens whose logit is >= the k-th largest logit (ties at the boundary are
   all kept, as in HF and vLLM). k = 0 disables.
3. top-p (nucleus): keep the smallest set of most-likely tokens whose mass (after top-k,
   renormalised) is >= top_p; the top token is always kept. Tokens tied with the last kept
   token are kept too, so the result never depends on how a sort orders ties. 1 disables.
4. min-p: drop tokens whose probability is < min_p * (max probability), then renormalise.
   The ratio prob / max prob does not change under renormalisation, so this is the same
   set whether it is measured before or after top-k / top-p. 0 disables.

vLLM v1 applies min-p before top-k / top-p. The two orders give the same p except when
top_p < 1 and min_p > 0 are combined: measured after min-p, the nucleus is taken from a
renormalised (larger) mass and can keep fewer tokens. We follow HF's order.

Everything is batched: per-row parameters become [N, 1] tensors, so one pass serves a batch
of mixed settings as well as a uniform one, and the sort (the only expensive step) runs only
when some row uses top-p (top-k alone needs just `torch.topk`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_kernels


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Warp target logits [B, S, V] into float32 probabilities [B, S, V].

    Row b uses params[b] at all of its S positions (a row is one request; S covers the
    draft positions plus the bonus position of one verification round).
    """
    if logits.dim() != 3:
        raise DraftsmithError(f"target_probs expects logits of shape [B, S, V], got {tuple(logits.shape)}")
    B, S, V = logits.shape
    if len(params) != B:
        raise DraftsmithError(f"target_probs got {len(params)} SamplingParams for a batch of {B} rows")
    x = logits.reshape(B * S, V).float()  # [N, V], N = B * S
    if B * S == 0 or V == 0:
        return x.reshape(B, S, V).clone()

    greedy = [sp.greedy for sp in params]
    if all(greedy):
        return _one_hot_argmax(x).reshape(B, S, V)

    probs = _warp_sampled(x, params, S)  # [N, V]
    if any(greedy):
        greedy_rows = _per_row(greedy, S, x.device, torch.bool)  # [N, 1]
        probs = torch.where(greedy_rows, _one_hot_argmax(x), probs)
    return probs.reshape(B, S, V)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from probs [V] (need not be normalised) by inverse CDF.

    Consumes exactly one uniform from `generator` (None = the global RNG of probs' device),
    so the draw depends only on this generator's state: the same seed gives the same token
    whatever else runs. `verify` samples its final token in the same way, so a row that
    proposes no drafts gets the same token as calling this on its p.
    """
    if probs.dim() != 1:
        raise ValueError(f"sample_from expects probs of shape [V], got {tuple(probs.shape)}")
    u = draw_uniforms(1, generator, probs.device)  # [1]
    return int(inverse_cdf(probs.unsqueeze(0), u)[0])


def draw_uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """n uniforms in [0, 1) from `generator` (None = global RNG of `device`), on `device`.

    Drawn on the generator's own device so a CPU generator also works for CUDA tensors.
    """
    if generator is None:
        return torch.rand(n, device=device)
    return torch.rand(n, generator=generator, device=generator.device).to(device)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixing function (SplitMix64's finaliser), elementwise on uint64 arrays (their
    arithmetic wraps mod 2**64): consecutive inputs give statistically independent outputs."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def position_uniforms_rows(keys: Sequence[tuple[int, int]], n: int,
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniforms in [0, 1) for output positions start .. start+n-1 of requests seeded `seed`,
    one row per (seed, start) of `keys`, float64 [rows, n]: a pure function of (seed, position),
    never of how many were drawn before (u = top 53 bits of splitmix(splitmix(seed) ^
    splitmix(t)), scaled by 2^-53: exact in float64).

    This is what makes a seeded request reproducible whatever the policy, batch and load:
    position t's token is always inverse_cdf(p_t, u_t), however many drafts were verified in
    the round that reached t (core/verify.py, "keys")."""
    seeds = np.array([int(s) & _MASK64 for s, _ in keys], dtype=np.uint64)
    starts = np.array([int(t) for _, t in keys], dtype=np.uint64)
    t = starts[:, None] + np.arange(n, dtype=np.uint64)[None, :]
    bits = _splitmix64(_splitmix64(seeds)[:, None] ^ _splitmix64(t)) >> np.uint64(11)
    return torch.from_numpy(bits.astype(np.float64) * 2.0 ** -53).to(device)


def position_uniforms(seed: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """position_uniforms_rows of one request: float64 [n]."""
    return position_uniforms_rows([(seed, start)], n, device)[0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Batched inverse-CDF sampling: probs [N, V] (non-negative, any positive total), u [N]
    in [0, 1) -> token ids [N] (int64).

    Picks the first index whose cumulative mass exceeds u * total. A zero-probability token
    can never be picked: its cumulative mass equals its predecessor's, so it is never the
    first to exceed anything. If rounding pushes u * total up to the total, the last token
    with positive mass is returned.
    """
    cdf = probs.cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()  # [N, 1]
    if not bool(torch.all(total > 0)) or not bool(torch.all(torch.isfinite(total))):
        raise ValueError("inverse_cdf: every row needs a finite, positive probability mass")
    target = u.to(cdf.dtype).unsqueeze(-1) * total  # [N, 1]
    idx = torch.searchsorted(cdf, target, right=True)  # [N, 1]
    last_positive = torch.searchsorted(cdf, total, right=False)  # [N, 1]
    return torch.minimum(idx, last_positive).squeeze(-1)


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> float32 one-hot at the argmax of each row (lowest index on ties)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    return out.scatter_(-1, argmax_rows(x)[:, None], 1.0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [N, V] float32 logits: on a CPU through Draftsmith's kernel where it is
    built (torch's generic reduction took ~57 us a 49k-vocabulary row, ~1 ms of a 16-token
    verify step), the same indices (first maximum; NaN counts as the largest)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 and cpu_kernels().ok:
        return torch.ops.draftsmith.argmax(x)
    return x.argmax(dim=-1)


def _per_row(values: list, S: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One value per request -> [B * S, 1], each repeated over the request's S positions."""
    t = torch.tensor(values, dtype=dtype, device=device)  # [B]
    return t.repeat_interleave(S).unsqueeze(-1)


def _leading_logits(x: torch.Tensor, m: torch.Tensor, z: torch.Tensor, top_p: torch.Tensor,
                    k: int = 256) -> torch.Tensor:
    """The k largest logits of each row, descending, for the smallest k in 256, 2048, 16384, V
    whose tokens hold at least top_p of every row's mass (rows with top_p = 1 need all V).

    A top-p nucleus is a prefix of the sorted row, so once the leading k tokens reach top_p
    the cut lies inside them and sorting the rest cannot change it: exact, and a top-256 is
    ~20x cheaper than sorting 49k logits (a quarter of a batched sampling step was the sort)."""
    V = x.shape[-1]
    while k < V:
        lead = torch.topk(x, k, dim=-1).values  # [N, k], descending
        if bool(torch.all(((torch.exp(lead - m) / z).sum(dim=-1, keepdim=True) >= top_p) & (top_p < 1.0))):
            return lead
        k *= 8
    return torch.sort(x, dim=-1, descending=True).values


def _warp_sampled(x: torch.Tensor, params: Sequence[SamplingParams], S: int) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on logits x [N, V] -> probabilities [N, V].

    Greedy rows are computed at temperature 1 here (their result is replaced by a one-hot).
    """
    N, V = x.shape
    dev = x.device
    temps = [sp.temperature if not sp.greedy else 1.0 for sp in params]
    if any(t != 1.0 for t in temps):
        x = x / _per_row(temps, S, dev, torch.float32)  # [N, V]

    use_top_k = any(0 < sp.top_k < V for sp in params)
    use_top_p = any(sp.top_p < 1.0 for sp in params)
    use_min_p = any(sp.min_p > 0.0 for sp in params)

    if use_top_k:
        k = _per_row([sp.top_k if 0 < sp.top_k < V else V for sp in params], S, dev, torch.long)
        kth = torch.topk(x, int(k.max()), dim=-1).values.gather(-1, k - 1)  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if use_top_p:
        top_p = _per_row([sp.top_p for sp in params], S, dev, torch.float32)  # [N, 1]
        m = x.amax(dim=-1, keepdim=True)  # [N, 1]; normalised over the whole vocabulary, as softmax
        z = torch.exp(x - m).sum(dim=-1, keepdim=True)  # [N, 1]
        sorted_x = _leading_logits(x, m, z, top_p)  # [N, k], descending
        sorted_p = torch.exp(sorted_x - m) / z  # [N, k]
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # [N, k] mass of strictly better tokens
        # top_p == 1 rows keep everything: cumsum rounding can reach 1 before the tail ends.
        keep = (mass_before < top_p) | (top_p >= 1.0)  # [N, k], a prefix, never empty
        n_keep = keep.sum(dim=-1, keepdim=True)  # [N, 1]
        cutoff = sorted_x.gather(-1, n_keep - 1)  # [N, 1] logit of the last kept token
        x = x.masked_fill(x < cutoff, float("-inf"))

    probs = torch.softmax(x, dim=-1)  # [N, V]
    if use_min_p:
        min_p = _per_row([sp.min_p for sp in params], S, dev, torch.float32)  # [N, 1]
        threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [N, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs

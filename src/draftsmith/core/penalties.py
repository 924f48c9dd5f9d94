"""What a request does to the target's raw logits before the warps, over a verify block:
repetition, presence and frequency penalties, logit_bias, min_tokens, allowed_token_ids and
bad_words (vLLM's / the OpenAI API's).

A penalty makes the target distribution at a position depend on the tokens before it, so in
a verify block position j must be penalised as if drafts 0..j-1 were already part of the
output (they are, whenever position j's token is used: verification only reaches position j
after accepting every draft before it). Rejection sampling against these per-position p then
stays exact, and a greedy request's tokens are the penalised argmax plain decoding picks.

Applied to the raw logits in this order (the three penalties in vLLM's), before temperature and
the other warps (core/warp.py):

- repetition_penalty r (HF transformers / vLLM; 1 = off): a token that occurs in the prompt or
  the output so far has its logit divided by r where positive, multiplied by r where not;
- frequency_penalty f (OpenAI; 0 = off): logit - f x (times the token occurs in the output);
- presence_penalty a (OpenAI; 0 = off): logit - a if the token occurs in the output at all;
- logit_bias {token: b} (OpenAI): logit + b at every position;
- min_tokens m (vLLM): end-of-sequence and stop_token_ids masked (-inf) at the positions whose
  token would be output token 0..m-1 (position j of a block is output token len(output) + j);
- allowed_token_ids (vLLM): every other token masked at every position;
- bad_words (vLLM): a word's last token masked where the output (and drafts 0..j-1) end with
  its other tokens; a one-token word everywhere; not at a position where the bans would leave
  no token (with allowed_token_ids / min_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.core.request import Request


def has_penalties(params) -> bool:
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def adjusts(s: Request) -> bool:
    """Whether the request changes the raw logits of its next block (see the module docstring)."""
    p = s.params
    return (has_penalties(p) or bool(p.logit_bias) or len(s.output_ids) < p.min_tokens
            or p.allowed_token_ids is not None or bool(s.bad_words_ids))


def penalize(logits: torch.Tensor, seqs: Sequence[Request], drafts: torch.Tensor | None,
             eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """logits [B, S, V] of a verify block (row b: seqs[b]; position j follows drafts[b, :j]);
    drafts [B, >= S - 1] or None when S == 1; eos_token_ids: what min_tokens holds back (with
    each request's stop_token_ids). Returns float32 logits with every row's adjustments applied
    (a new tensor where any row has one; `logits` itself otherwise)."""
    rows = [b for b, s in enumerate(seqs) if adjusts(s)]
    if not rows:
        return logits
    B, S, V = logits.shape
    out = logits.float().clone()
    dev = out.device
    for b in rows:
        p = seqs[b].params
        x = out[b]  # [S, V], a view: updated in place
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
            x[:, ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=dev)
        early = p.min_tokens - len(seqs[b].output_ids)  # positions 0..early-1 may not end the output
        if early > 0:
            ends = sorted({t for t in (*(() if p.ignore_eos else eos_token_ids), *p.stop_token_ids) if 0 <= t < V})
            if ends:
                x[:early, torch.tensor(ends, dtype=torch.long, device=dev)] = float("-inf")
        if p.allowed_token_ids is not None:
            banned = torch.ones(V, dtype=torch.bool, device=dev)
            banned[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=dev)] = False
            x[:, banned] = float("-inf")
        if seqs[b].bad_words_ids:
            before = x.clone()
            _ban_bad_words(x, seqs[b], drafts[b, : S - 1].tolist() if S > 1 else [])
            # where the bans would leave nothing (with allowed_token_ids / min_tokens), they give way
            # at that position: a rule of the context alone, so p there is still well defined
            dead = torch.isneginf(x).all(-1)
            if dead.any():
                x[dead] = before[dead]
        if not has_penalties(p):
            continue
        out_ids = torch.tensor(seqs[b].output_ids, dtype=torch.long, device=dev)
        counts = torch.bincount(out_ids, minlength=V).float()[None].repeat(S, 1)  # [S, V]
        if S > 1:  # position j also counts drafts 0..j-1
            d = drafts[b, : S - 1].to(dev).clamp(0, V - 1)  # past the row's own drafts: padding, never used
            after = torch.zeros(S, V, device=dev)
            after[torch.arange(1, S, device=dev), d] = 1.0
            counts += after.cumsum(0)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, torch.tensor(seqs[b].prompt_ids, dtype=torch.long, device=dev)] = True
            r = p.repetition_penalty
            x.copy_(torch.where(seen, torch.where(x > 0, x / r, x * r), x))
        if p.frequency_penalty != 0.0:
            x.sub_(p.frequency_penalty * counts)
        if p.presence_penalty != 0.0:
            x.sub_(p.presence_penalty * (counts > 0).float())
    return out


def _ban_bad_words(x: torch.Tensor, s: Request, drafts: list[int]) -> None:
    """-inf at position j for the last token of every bad word whose other tokens end the output
    followed by drafts 0..j-1 (x [S, V], in place)."""
    history = list(s.output_ids) + drafts  # position j's context ends at len(output) + j
    n = len(s.output_ids)
    for word in s.bad_words_ids:
        *head, last = word
        if not head:
            x[:, last] = float("-inf")
            continue
        for j in range(x.shape[0]):
            end = n + j
            if end >= len(head) and history[end - len(head): end] == head:
                x[j, last] = float("-inf")

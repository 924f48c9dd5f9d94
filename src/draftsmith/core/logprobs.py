"""Log probabilities of generated tokens (vLLM's `SamplingParams(logprobs=k)`, OpenAI's `logprobs`).

A request that asks for them gets, for every token it generates, a dict {token id: Logprob}:
the generated token first, then the k most likely tokens (one entry if the generated token is
among them). The numbers are the target's raw distribution, log_softmax of its logits before
temperature, top-k / top-p / min-p (vLLM's default `raw_logprobs`): what the model thinks of
the token, whatever sampling picked it. With speculative decoding they come from the verify
forward's row of each committed token, which is the same distribution plain decoding computes
for it: speculation changes neither the tokens' distribution nor their log probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit, vLLM's max_logprobs default)


@dataclass(frozen=True)
class Logprob:
    """One token's log probability under the target, its rank among all tokens (1 = the most
    likely; tied tokens share a rank) and its text (filled by `LLM.generate` and the server)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]  # one generated position: the generated token first, then the top k


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """logits [n, V] (row i: the target's logits for the i-th token of `tokens`), tokens: the n
    generated ids, k: how many top tokens besides the generated one. → one dict per token."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])
    ranks = (lp > chosen).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], ids[:, None][:, :0])
    out: list[TokenLogprobs] = []
    for t, c, r, tv, ti in zip(tokens, chosen[:, 0].tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()):
        d = {t: Logprob(c, r)}
        for v, i in zip(tv, ti):
            if i not in d:  # every token above v is among the top k (sorted): count them
                d[i] = Logprob(v, 1 + sum(u > v for u in tv))
        out.append(d)
    return out


def with_text(entries: list[TokenLogprobs], decode_one) -> list[TokenLogprobs]:
    """The same dicts with every token's text (`decode_one(id) -> str`)."""
    return [{t: Logprob(lp.logprob, lp.rank, decode_one(t)) for t, lp in d.items()} for d in entries]

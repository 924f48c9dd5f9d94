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
    """One token's log probability under the target, its rank (vLLM's: the generated token's is
    the number of tokens at least as likely, itself included; the top k are 1..k in order) and
    its text (filled by `LLM.generate`: models/token_text.py)."""

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
    ranks = (lp >= chosen).sum(-1, keepdim=True)
    top_v, top_i = lp.topk(k, dim=-1)
    # one transfer: [chosen, rank, top values, top ids] per row (ids < 2**24 are exact in float32)
    rows = torch.cat([chosen, ranks.float(), top_v, top_i.float()], dim=-1).tolist()
    out: list[TokenLogprobs] = []
    for t, r in zip(tokens, rows):
        d = {t: Logprob(r[0], int(r[1]))}
        for j in range(k):
            i = int(r[2 + k + j])
            if i not in d:
                d[i] = Logprob(r[2 + j], j + 1)
        out.append(d)
    return out


def with_text(entries: list[TokenLogprobs], token_text) -> list[TokenLogprobs]:
    """The same dicts with every token's text (`token_text(id) -> str`)."""
    return [{t: Logprob(lp.logprob, lp.rank, token_text(t)) for t, lp in d.items()} for d in entries]

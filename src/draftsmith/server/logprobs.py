"""The `logprobs` objects of the two APIs, built from the engine's per-token dicts
(core/logprobs.py: the generated token first, then the k most likely).

- chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [the k most likely, most likely first]}], "refusal": null}
- completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}
  of the generated token and the k most likely], "text_offset": [where each token starts in
  the choice's text]}; with `echo: true` the prompt's tokens come first, the first of them
  with null (nothing predicts it).

One entry per generated token, as `usage.completion_tokens` counts them (an end-of-sequence
token, `<|im_end|>`, and tokens a stop string cut from the text included), after the echoed
prompt's. A token's `token` / `bytes` are its own bytes (models/token_text.py): a character
split over two tokens reads as U+FFFD in each `token`, its bytes are exact. `text_offset`
counts from the start of the choice's text (vLLM's; with `echo` that is the prompt's start).

vLLM's `return_tokens_as_token_ids: true` names every token `token_id:N` (its own and the top
ones', completions' top_logprobs keys too), so tokens that read the same stay apart; `bytes` and
`text_offset` keep the token's real bytes and text (vLLM's are those of the `token_id:N` string).
"""

from __future__ import annotations

from draftsmith.core.logprobs import TokenLogprobs
from draftsmith.models.token_text import TokenText

_FLOOR = -9999.0  # JSON has no -inf (nor NaN): the number OpenAI-compatible servers send instead


def _num(x: float) -> float:
    x = float(x)
    return _FLOOR if x != x else max(x, _FLOOR)


class LogprobsFormat:
    """One request's logprobs objects; `k` = how many top tokens it asked for; token texts and
    bytes from `token_text` (models/token_text.py). Completions' text_offset runs per choice."""

    def __init__(self, chat: bool, k: int, token_text: TokenText, as_ids: bool = False) -> None:
        self.chat, self.k = chat, k
        self._tt = token_text
        self._as_ids = as_ids  # return_tokens_as_token_ids
        self._offset: dict[int, int] = {}

    def _top(self, d: TokenLogprobs) -> list[tuple[int, float]]:
        return sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda x: -x[1])[: self.k]

    def _name(self, token_id: int) -> str:
        """A token as the response names it: its text, or vLLM's `token_id:N`."""
        return f"token_id:{token_id}" if self._as_ids else self._tt.text(token_id)

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self._name(token_id), "logprob": _num(logprob), "bytes": list(self._tt.bytes(token_id))}

    def build(self, index: int, token_ids: list[int], entries: list[TokenLogprobs | None]) -> dict:
        """The logprobs object of choice `index`'s next tokens (a chunk's, or all of them) and their
        entries (None: a token nothing predicts, the first of an echoed prompt)."""
        if self.chat:
            content = [{**self._entry(tok, d[tok].logprob), "top_logprobs": [self._entry(t, v) for t, v in self._top(d)]}
                       for tok, d in zip(token_ids, entries)]
            return {"content": content, "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        at = self._offset.get(index, 0)
        for tok, d in zip(token_ids, entries):
            out["tokens"].append(self._name(tok))
            out["text_offset"].append(at)
            at += len(self._tt.text(tok))
            if d is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_num(d[tok].logprob))
            # keyed by text: where two tokens read the same, the generated token's number stands
            # (the k most likely: an echoed prompt's entries may list more, for prompt_logprobs)
            top = {self._name(t): _num(v.logprob) for t, v in d.items() if t != tok and v.rank <= self.k}
            top[self._name(tok)] = _num(d[tok].logprob)
            out["top_logprobs"].append(top)
        self._offset[index] = at
        return out


def prompt_logprobs_object(prompt_ids: list[int], entries: list[TokenLogprobs | None], k: int,
                           token_text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (its request field): per prompt token, None for the first
    (nothing predicts it), else {token id: {"logprob", "rank", "decoded_token"}} of the prompt's
    token and the k most likely there."""
    return [None if d is None else
            {str(t): {"logprob": _num(lp.logprob), "rank": lp.rank, "decoded_token": token_text.text(t)}
             for t, lp in d.items() if t == tok or lp.rank <= k}
            for tok, d in zip(prompt_ids, entries)]

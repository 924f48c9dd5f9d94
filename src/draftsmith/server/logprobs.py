"""The `logprobs` objects of the two APIs, built from the engine's per-token dicts
(core/logprobs.py: the generated token first, then the k most likely).

- chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [the k most likely, most likely first]}], "refusal": null}
- completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}
  of the generated token and the k most likely], "text_offset": [where each token starts in
  the completion's text]}

One entry per generated token (as `usage.completion_tokens` counts them). A token's text is
its own decoding with special tokens kept (`<|im_end|>`), so a byte that completes a
character only with the next token reads as U+FFFD there; `bytes` are that text's UTF-8.
"""

from __future__ import annotations

from typing import Callable

from draftsmith.core.logprobs import TokenLogprobs

_FLOOR = -9999.0  # JSON has no -inf: the number OpenAI-compatible servers send instead


def _num(x: float) -> float:
    return max(float(x), _FLOOR)


class LogprobsFormat:
    """One request's logprobs objects; `k` = how many top tokens it asked for; decoded token
    texts are cached for the request. `offset`: completions' running text_offset per choice."""

    def __init__(self, chat: bool, k: int, decode_one: Callable[[int], str]) -> None:
        self.chat, self.k = chat, k
        self._decode_one = decode_one
        self._texts: dict[int, str] = {}
        self._offset: dict[int, int] = {}

    def _text(self, token_id: int) -> str:
        s = self._texts.get(token_id)
        if s is None:
            s = self._texts[token_id] = self._decode_one(token_id)
        return s

    def _top(self, d: TokenLogprobs) -> list[tuple[int, float]]:
        return sorted(((t, lp.logprob) for t, lp in d.items()), key=lambda x: -x[1])[: self.k]

    def build(self, index: int, entries: list[TokenLogprobs]) -> dict:
        """The logprobs object of choice `index`'s next `entries` (a chunk's, or all of them)."""
        if self.chat:
            content = []
            for d in entries:
                tok, lp = next(iter(d.items()))
                s = self._text(tok)
                content.append({"token": s, "logprob": _num(lp.logprob), "bytes": list(s.encode("utf-8")),
                                "top_logprobs": [{"token": self._text(t), "logprob": _num(v),
                                                  "bytes": list(self._text(t).encode("utf-8"))}
                                                 for t, v in self._top(d)]})
            return {"content": content, "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        at = self._offset.get(index, 0)
        for d in entries:
            tok, lp = next(iter(d.items()))
            s = self._text(tok)
            out["tokens"].append(s)
            out["token_logprobs"].append(_num(lp.logprob))
            out["top_logprobs"].append({self._text(t): _num(v.logprob) for t, v in d.items()})
            out["text_offset"].append(at)
            at += len(s)
        self._offset[index] = at
        return out

"""Streaming text: emit only what can no longer change.

A streamed delta is final once sent, so two kinds of tail are held back until resolved:

- a tail that could be the start of a stop string (``"Hel"`` while stop is ``"Hello"``):
  if the stop completes, the engine cuts the output there and nothing of it may have
  leaked; if it does not, the tail is released with the next delta or at the end;
- trailing U+FFFD: a multi-byte character whose remaining bytes are in later tokens.

The final text of a finished request comes from the engine (stop string removed unless kept), and the
stream ends with whatever of it was not sent yet, so the concatenated deltas always equal
the non-streaming text.
"""

from __future__ import annotations

from typing import Callable, Sequence

from draftsmith.core.stops import stop_cut

REPLACEMENT_CHAR = "\ufffd"


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def safe_prefix(text: str, stops: Sequence[str], include: bool = False, after: int = 0) -> str:
    """The part of an unfinished output's text that may be emitted now (`include`: the stop
    string is part of the output, so a tail that may start one need not wait; `after`: a stop
    string counts only where it ends past this many characters, core/stops.py)."""
    cut = stop_cut(text, stops, include, after)
    if cut is not None:  # the engine finishes on a stop; be safe anyway
        return text[:cut]
    if stops and not include:
        text = text[: len(text) - stop_holdback(text, stops)]
    return text.rstrip(REPLACEMENT_CHAR)


class StreamText:
    """Per-choice incremental text: push committed token ids, get the delta to send."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str], include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self._decode = decode
        self._stops = tuple(stops)
        self._include = include_stop
        self._min_tokens = min_tokens
        self._after: int | None = None if stops and min_tokens > 1 else 0
        self.ids: list[int] = []
        self.sent = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        after = self._after
        if after is None:  # stop strings count past the text of the tokens before min_tokens (as the engine's)
            if len(self.ids) < self._min_tokens - 1:
                after = len(text)  # none counts yet
            else:
                after = self._after = len(self._decode(self.ids[: self._min_tokens - 1]))
        return self._advance(safe_prefix(text, self._stops, self._include, after))

    def finish(self, final_text: str) -> str:
        return self._advance(final_text)

    def _advance(self, text: str) -> str:
        # Decoding a longer id list normally extends the shorter one's text; if a tokenizer
        # ever rewrites earlier text, nothing is sent until the texts agree again.
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta = text[len(self.sent) :]
            self.sent = text
            return delta
        return ""

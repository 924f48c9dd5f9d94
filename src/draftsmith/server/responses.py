"""The response objects of the completions and chat APIs: whole responses, streamed chunks,
usage; `ResponseFormat` holds what differs between the two APIs."""

from __future__ import annotations

import time

from typing import Callable

from draftsmith.server.engine_loop import Event
from draftsmith.server.logprobs import LogprobsFormat


class ResponseFormat:
    """What differs between the completions and chat APIs: the shape of the objects."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat, self.rid, self.model = chat, rid, model
        self.created = int(time.time())
        self.logprobs: LogprobsFormat | None = None

    def with_logprobs(self, k: int | None, decode_one: Callable[[int], str]) -> None:
        """The request asked for logprobs with k top tokens (None: it did not)."""
        self.logprobs = None if k is None else LogprobsFormat(self.chat, k, decode_one)

    def _logprobs(self, index: int, entries: list | None) -> dict | None:
        return None if self.logprobs is None or entries is None else self.logprobs.build(index, entries)

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        return {**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: list | None = None) -> dict:
        """A streamed chunk; `logprobs`: the entries of the tokens since the previous chunk."""
        lp = self._logprobs(index, logprobs)
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def response(self, finals: list[Event], usage: dict) -> dict:
        if self.chat:
            choices = [{"index": e.index, "message": {"role": "assistant", "content": e.text},
                        "logprobs": self._logprobs(e.index, e.logprobs), "finish_reason": e.finish_reason}
                       for e in finals]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        choices = [{"index": e.index, "text": e.text, "logprobs": self._logprobs(e.index, e.logprobs),
                    "finish_reason": e.finish_reason} for e in finals]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}


def usage(prompt_tokens: int, finals: list[Event], n: int = 1) -> dict:
    """OpenAI's usage object. Each prompt counts once (its n choices share it); so do its cached
    tokens (`prompt_tokens_details.cached_tokens`: reused by prefix caching), taken from its first choice."""
    completion = sum(len(e.token_ids) for e in finals)
    cached = sum(e.cached_tokens for e in finals if e.index % n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

"""The response objects of the completions and chat APIs: whole responses, streamed chunks,
usage; `ResponseFormat` holds what differs between the two APIs."""

from __future__ import annotations

import time

from draftsmith.server.engine_loop import Event


class ResponseFormat:
    """What differs between the completions and chat APIs: the shape of the objects."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat, self.rid, self.model = chat, rid, model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        return {**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def response(self, finals: list[Event], usage: dict) -> dict:
        if self.chat:
            choices = [{"index": e.index, "message": {"role": "assistant", "content": e.text},
                        "logprobs": None, "finish_reason": e.finish_reason} for e in finals]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        choices = [{"index": e.index, "text": e.text, "logprobs": None, "finish_reason": e.finish_reason}
                   for e in finals]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}


def usage(prompt_tokens: int, finals: list[Event], n: int = 1) -> dict:
    """OpenAI's usage object. Each prompt counts once (its n choices share it); so do its cached
    tokens (`prompt_tokens_details.cached_tokens`: reused by prefix caching), taken from its first choice."""
    completion = sum(len(e.token_ids) for e in finals)
    cached = sum(e.cached_tokens for e in finals if e.index % n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

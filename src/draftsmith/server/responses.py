"""The response objects of the completions and chat APIs: whole responses, streamed chunks
(written as server-sent events), usage; `ResponseFormat` holds what differs between the two
APIs and what one request asked for beyond text (logprobs, completions' `echo`)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import AsyncIterator, Callable

from draftsmith.models.token_text import TokenText
from draftsmith.server.engine_loop import Event
from draftsmith.server.logprobs import LogprobsFormat, prompt_logprobs_object
from draftsmith.server.answer import AnswerFormat, AnswerReader
from draftsmith.server.request_metrics import without_tokens


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(obj: dict) -> str:
    """A named server-sent event, `event: TYPE` + its data (`obj`, whose type is TYPE): the
    Responses and Messages APIs' form."""
    return f"event: {obj['type']}\n" + sse(obj)


class ResponseFormat:
    """What differs between the completions and chat APIs: the shape of the objects."""

    def __init__(self, chat: bool, rid: str, model: str, key: str | None = None) -> None:
        """`rid`: the response's id; `key`: the engine's ids start with it (`rid` where none is
        given: a client's id in `rid` must not meet another request's in the engine)."""
        self.chat, self.rid, self.model = chat, rid, model
        self.key = key or rid
        self.created = int(time.time())
        self.logprobs: LogprobsFormat | None = None
        self.echo: list[tuple[str, list[int]]] | None = None  # per prompt: its text and ids
        self.n = 1
        self.echo_only = False
        self.answer = AnswerFormat()
        self.prompts: list[list[int]] = []  # each prompt's ids as the engine got them (with_prompts)
        self.prompt_lp: tuple | None = None  # prompt_logprobs: (k, token text)
        self.token_ids = False  # return_token_ids
        self.chat_echo = ""  # chat's echo: the continued assistant message's text, first in the content
        self.decode: Callable[[list[int]], str] | None = None  # the choices' text from their ids (with_decode)
        self.request_metrics = False  # a `metrics` object in the response (with_request_metrics)

    def with_chat_echo(self, text: str) -> None:
        """vLLM's chat `echo` (with a last assistant message, e.g. continue_final_message): the
        content starts with that message's text (streamed: a chunk of its own after the role's)."""
        self.chat_echo = text

    def with_decode(self, decode: Callable[[list[int]], str]) -> None:
        """How a choice's text is decoded from its ids (the engine's and the stream's decoding,
        special tokens skipped or kept as the request asked): a Response reads from it which
        token wrote which character."""
        self.decode = decode

    def with_request_metrics(self) -> None:
        """vLLM's per-request metrics (serve --enable-per-request-metrics,
        --per-request-spec-decode-metrics): the response (a stream: its usage chunk) carries
        `metrics`, the one choice's (server/request_metrics.py), null for several choices."""
        self.request_metrics = True

    def metrics_of(self, finals: list[Event]) -> dict | None:
        return finals[0].metrics if len(finals) == 1 else None

    def _with_metrics(self, body: dict, finals: list[Event]) -> dict:
        if self.request_metrics:
            body["metrics"] = self.metrics_of(finals)
        return body

    def with_prompts(self, prompts: list[list[int]], n: int) -> None:
        """The request's prompts as the engine got them, n choices each (choice i: prompt i // n)."""
        self.prompts, self.n = prompts, n

    def with_token_ids(self) -> None:
        """vLLM's `return_token_ids`: the prompt's ids (chat: at the top of the response or of its
        first chunk; completions: in each choice, or each choice's first chunk) and each choice's
        generated ids (whole, or those of each chunk), as the model saw and wrote them."""
        self.token_ids = True

    def prompt_ids(self, index: int) -> list[int]:
        return list(self.prompts[index // self.n])

    def with_answer(self, answer: AnswerFormat) -> None:
        """A chat request whose answers are read for reasoning or tool calls (server/answer.py)."""
        self.answer = answer

    def answer_reader(self) -> AnswerReader | None:
        """A fresh reader of one choice's text (None: the text is all content)."""
        return self.answer.reader()

    def with_logprobs(self, k: int | None, token_text: TokenText, as_ids: bool = False) -> None:
        """The request asked for logprobs with k top tokens (None: it did not); `as_ids`: vLLM's
        return_tokens_as_token_ids (tokens named `token_id:N`)."""
        self.logprobs = None if k is None else LogprobsFormat(self.chat, k, token_text, as_ids)

    def with_prompt_logprobs(self, k: int, token_text: TokenText) -> None:
        """vLLM's `prompt_logprobs: k`: each prompt's tokens scored, in the whole response (chat:
        at its top; completions: in each choice, as vLLM's)."""
        self.prompt_lp = (k, token_text)

    def prompt_logprobs_of(self, e: Event) -> list | None:
        if self.prompt_lp is None or e.prompt_logprobs is None:
            return None
        k, tt = self.prompt_lp
        return prompt_logprobs_object(self.prompt_ids(e.index), e.prompt_logprobs, k, tt)

    def with_echo(self, prompts: list[tuple[str, list[int]]], echo_only: bool) -> None:
        """Completions' `echo: true`: every choice's text (and logprobs) starts with its prompt's;
        `echo_only` (max_tokens 0): nothing else (the engine's one token is dropped)."""
        self.echo, self.echo_only = prompts, echo_only

    def echoed(self, index: int) -> tuple[str, list[int]] | None:
        return None if self.echo is None else self.echo[index // self.n]

    def cached(self, index: int, tokens: int) -> None:
        """A stream's choice `index` read `tokens` of its prompt from the prefix cache (told with its
        first tokens and when it finishes; a stream's usage chunk has them too)."""

    def visible(self, ev: Event) -> Event:
        """A finished choice as the client sees it: without the generated token of an echo-only request."""
        if not self.echo_only:
            return ev
        return replace(ev, token_ids=[], text="", logprobs=None if ev.logprobs is None else [], stop_reason=None,
                       metrics=without_tokens(ev.metrics))

    def logprobs_of(self, index: int, token_ids: list[int], entries: list | None,
                    prompt_entries: list | None = None) -> dict | None:
        """The logprobs object of `token_ids` (their `entries`), after the echoed prompt's when
        `prompt_entries` are given; None when the request asked for none."""
        if self.logprobs is None or entries is None:
            return None
        if prompt_entries is not None:
            token_ids, entries = self.echoed(index)[1] + list(token_ids), list(prompt_entries) + list(entries)
        return self.logprobs.build(index, list(token_ids), list(entries))

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        head = self._head("chat.completion.chunk")
        if self.token_ids:
            head["prompt_token_ids"] = self.prompt_ids(index)
        return {**head, "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
              stop_reason: int | str | None = None, delta: dict | None = None, token_ids: list[int] | None = None,
              first: bool = False) -> dict:
        """A streamed chunk; `logprobs`: the object of the tokens since the previous chunk;
        `stop_reason`: vLLM's (the stop token id or string that ended the choice: its last chunk);
        `delta`: a chat chunk's delta in place of `text` (content and tool calls); `token_ids`: the
        tokens since the previous chunk; `first`: the choice's first chunk."""
        if self.chat:
            if delta is None:
                delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                      "stop_reason": stop_reason}
            if first and self.token_ids:
                choice["prompt_token_ids"] = self.prompt_ids(index)
        if self.token_ids:
            choice["token_ids"] = list(token_ids or [])
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The stream's server-sent events: each chunk a `data:` line, then `data: [DONE]` (not
        after an error body `{"error": ...}`, which ends the stream)."""
        async for chunk in chunks:
            yield sse(chunk)
            if "error" in chunk:
                return
        yield "data: [DONE]\n\n"

    def usage_chunk(self, usage: dict, finals: list[Event]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._with_metrics({**self._head(obj), "choices": [], "usage": usage}, finals)

    def response(self, finals: list[Event], usage: dict) -> dict:
        """The whole response of `finals` (visible events, in choice order)."""
        if self.chat:
            choices = []
            for e in finals:
                message, finish, r = {"role": "assistant", "content": e.text}, e.finish_reason, self.answer_reader()
                if r is not None:
                    message, finish = r.message(e.text), r.finish_reason(e.finish_reason)
                if self.chat_echo:
                    message["content"] = self.chat_echo + (message["content"] or "")
                choices.append({"index": e.index, "message": message,
                                "logprobs": self.logprobs_of(e.index, e.token_ids, e.logprobs),
                                "finish_reason": finish, "stop_reason": e.stop_reason})
                if self.token_ids:
                    choices[-1]["token_ids"] = list(e.token_ids)
            head = self._head("chat.completion")
            if self.prompt_lp is not None and finals:  # one prompt: its scores once, at the top
                head["prompt_logprobs"] = self.prompt_logprobs_of(finals[0])
            if self.token_ids:
                head["prompt_token_ids"] = self.prompt_ids(0)
            return self._with_metrics({**head, "choices": choices, "usage": usage}, finals)
        choices = []
        for e in finals:
            echo = self.echoed(e.index)
            lp = self.logprobs_of(e.index, e.token_ids, e.logprobs, None if echo is None else e.prompt_logprobs)
            choices.append({"index": e.index, "text": ("" if echo is None else echo[0]) + e.text, "logprobs": lp,
                            "finish_reason": e.finish_reason, "stop_reason": e.stop_reason})
            if self.prompt_lp is not None:
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs_of(e)
            if self.token_ids:
                choices[-1].update(prompt_token_ids=self.prompt_ids(e.index), token_ids=list(e.token_ids))
        return self._with_metrics({**self._head("text_completion"), "choices": choices, "usage": usage}, finals)


def usage(prompt_tokens: int, finals: list[Event], n: int = 1) -> dict:
    """OpenAI's usage object. Each prompt counts once (its n choices share it); so do its cached
    tokens (`prompt_tokens_details.cached_tokens`: reused by prefix caching), taken from its first choice."""
    completion = sum(len(e.token_ids) for e in finals)
    cached = sum(e.cached_tokens for e in finals if e.index % n == 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

"""Server-sent events for `"stream": true`: the chunks of every choice as its tokens arrive
(text held back while it might still become a stop string; server/text.py), the usage chunk
when asked for, as dicts the request's ResponseFormat writes as events
(`ResponseFormat.events`); a response that cleans up however the stream ends."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from draftsmith.server.engine_loop import Event, SubRequest
from draftsmith.server.protocol import APIError
from draftsmith.server.responses import ResponseFormat, usage
from draftsmith.server.state import ServerState
from draftsmith.server.text import StreamText
from draftsmith.server.answer import AnswerReader


class AbortingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Choice:
    """One choice's stream: its text (held back where it may still change), the tokens and
    logprobs entries received since its last chunk, and an echoed prompt until its first chunk."""

    def __init__(self, decode: Callable[[list[int]], str], params, echo: tuple[str, list[int]] | None,
                 answer: AnswerReader | None = None) -> None:
        self.text = StreamText(decode, params.stop, params.include_stop_str_in_output, params.min_tokens)
        self.echo = echo
        self.answer = answer  # a chat answer read for reasoning or tool calls
        self.prompt_entries: list | None = None
        self.ids: list[int] = []
        self.entries: list = []
        self.sent = 0  # tokens already in a chunk
        self.first = True  # no chunk sent yet

    def receive(self, ev: Event) -> str:
        """A `tokens` event; → the text that may be sent now."""
        self.ids += ev.token_ids
        self.entries += ev.logprobs or []
        self.prompt_entries = ev.prompt_logprobs if ev.prompt_logprobs is not None else self.prompt_entries
        return self.text.push(ev.token_ids)

    def finish(self, ev: Event) -> str:
        """The `finished` event (visible): every token not sent yet; → the rest of the text."""
        self.ids, self.entries = list(ev.token_ids[self.sent:]), list((ev.logprobs or [])[self.sent:])
        self.prompt_entries = ev.prompt_logprobs if ev.prompt_logprobs is not None else self.prompt_entries
        return self.text.finish(ev.text)

    def chunk(self, fmt: ResponseFormat, index: int, text: str, finish_reason: str | None,
              stop_reason: int | str | None = None) -> dict | None:
        """The next chunk (None: the answer's reader holds all of `text` back for now)."""
        delta = None
        if self.answer is not None:
            delta = self.answer.push(text) if finish_reason is None else self.answer.finish(text)
            if not delta and finish_reason is None:
                return None  # the tokens' logprobs go with the next chunk
            finish_reason = self.answer.finish_reason(finish_reason)
        prompt = None
        if self.echo is not None:  # the first chunk carries the prompt
            text, prompt, self.echo = self.echo[0] + text, self.prompt_entries, None
        lp = fmt.logprobs_of(index, self.ids, self.entries, prompt)
        ids, first = self.ids, self.first
        self.sent += len(ids)
        self.ids, self.entries, self.first = [], [], False
        return fmt.chunk(index, text, finish_reason, lp, stop_reason, delta, token_ids=ids, first=first)


async def stream_events(st: ServerState, subs: list[SubRequest], q: asyncio.Queue[Event], fmt: ResponseFormat,
                        prompt_tokens: int, n: int, include_usage: bool, done: set[int],
                        close: Callable[[], None], continuous_usage: bool = False) -> AsyncIterator[dict]:
    """The chunks of one request's choices (an error body `{"error": ...}` ends them), read from
    its event queue `q`; marks finished choices in `done` and calls `close` at the end, however
    the stream ends. `n`: choices per prompt;
    `continuous_usage` (vLLM's stream_options.continuous_usage_stats, with include_usage): every
    chunk carries its choice's usage so far (its prompt's tokens, the tokens sent in its chunks)."""
    choices = {s.index: _Choice(partial(st.front.decode, skip_special_tokens=s.params.skip_special_tokens),
                                s.params, fmt.echoed(s.index), fmt.answer_reader()) for s in subs}
    prompt_len = {s.index: len(s.prompt_ids) for s in subs}
    finals: list[Event] = []

    def out(index: int, chunk: dict) -> dict:
        if continuous_usage:
            p, k = prompt_len[index], choices[index].sent
            chunk["usage"] = {"prompt_tokens": p, "completion_tokens": k, "total_tokens": p + k}
        return chunk

    try:
        for s in subs:
            opening = fmt.opening(s.index)
            if opening:
                yield out(s.index, opening)
            if fmt.chat_echo:
                yield out(s.index, fmt.chunk(s.index, fmt.chat_echo, None))
        while len(finals) < len(subs):
            ev = await q.get()
            if ev.kind in ("tokens", "finished") and ev.cached_tokens:
                fmt.cached(ev.index, ev.cached_tokens)
            if ev.kind == "tokens":
                if fmt.echo_only:  # the engine's one token is not the client's
                    continue
                delta = choices[ev.index].receive(ev)
                chunk = choices[ev.index].chunk(fmt, ev.index, delta, None) if delta else None
                if chunk is not None:
                    yield out(ev.index, chunk)
            elif ev.kind == "finished":
                ev = fmt.visible(ev)
                done.add(ev.index)
                finals.append(ev)
                c = choices[ev.index]
                yield out(ev.index, c.chunk(fmt, ev.index, c.finish(ev), ev.finish_reason, ev.stop_reason))
            elif ev.kind == "error":
                st.metrics.record_error(ev.status)
                yield (APIError(400, ev.message) if ev.status == 400
                       else APIError(500, ev.message, type="internal_error")).body()
                return
        if include_usage:
            yield fmt.usage_chunk(usage(prompt_tokens, finals, n), sorted(finals, key=lambda e: e.index))
    finally:
        close()

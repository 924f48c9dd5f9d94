"""Server-sent events for `"stream": true`: the chunks of every choice as its tokens arrive
(text held back while it might still become a stop string; server/text.py), the usage chunk
when asked for, `[DONE]`; a response that cleans up however the stream ends."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from draftsmith.server.engine_loop import Event, SubRequest
from draftsmith.server.protocol import APIError
from draftsmith.server.responses import ResponseFormat, usage
from draftsmith.server.state import ServerState
from draftsmith.server.text import StreamText


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


async def stream_events(st: ServerState, subs: list[SubRequest], q: asyncio.Queue[Event], fmt: ResponseFormat,
                        prompt_tokens: int, n: int, include_usage: bool, done: set[int],
                        close: Callable[[], None]) -> AsyncIterator[str]:
    """The SSE lines of one request's choices, read from its event queue `q`; marks finished
    choices in `done` and calls `close` at the end, however the stream ends. `n`: choices per prompt."""
    stops = {s.index: s.params.stop for s in subs}
    texts = {s.index: StreamText(st.front.decode, stops[s.index]) for s in subs}
    # logprobs entries received and not yet sent (text held back sends them with a later chunk)
    pending: dict[int, list] = {s.index: [] for s in subs}
    sent_lp: dict[int, int] = {s.index: 0 for s in subs}

    def take(index: int, final: list | None = None) -> list | None:
        if fmt.logprobs is None:
            return None
        out = final[sent_lp[index]:] if final is not None else pending[index]
        sent_lp[index] += len(out)
        pending[index] = []
        return out

    finals: list[Event] = []
    try:
        for s in subs:
            opening = fmt.opening(s.index)
            if opening:
                yield sse(opening)
        while len(finals) < len(subs):
            ev = await q.get()
            if ev.kind == "tokens":
                delta = texts[ev.index].push(ev.token_ids)
                pending[ev.index] += ev.logprobs or []
                if delta:
                    yield sse(fmt.chunk(ev.index, delta, None, take(ev.index)))
            elif ev.kind == "finished":
                done.add(ev.index)
                finals.append(ev)
                yield sse(fmt.chunk(ev.index, texts[ev.index].finish(ev.text), ev.finish_reason,
                                    take(ev.index, ev.logprobs or [])))
            elif ev.kind == "error":
                st.metrics.record_error(500)
                yield sse(APIError(500, ev.message, type="internal_error").body())
                return
        if include_usage:
            yield sse(fmt.usage_chunk(usage(prompt_tokens, finals, n)))
        yield "data: [DONE]\n\n"
    finally:
        close()

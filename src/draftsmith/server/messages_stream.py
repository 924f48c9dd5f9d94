"""A streamed Message (POST /v1/messages with `stream: true`): the chat stream's chunks
(server/streaming.py: the answer's parts in order (server/answer.py's PartsReader), its
finish_reason and stop string, then the usage chunk) as Anthropic's server-sent events, each
`event: TYPE` + `data: {"type": TYPE, ...}`:

message_start (the Message, empty: no content, stop_reason null, usage: the prompt as
input_tokens + cache_read_input_tokens, output_tokens 0), sent with the answer's first content
(the engine matches the prompt against the prefix cache when it admits the request, and tells
the count with the first tokens); per content block, in the order the answer writes them
(server/messages_content.py), each stopped before the next starts: content_block_start,
content_block_delta ... (text_delta, thinking_delta, input_json_delta), content_block_stop;
message_delta (stop_reason, stop_sequence; usage: the same input_tokens and
cache_read_input_tokens, output_tokens); message_stop. No ping events are sent. A whole
Message's usage is the same.

An engine error midway is `event: error` with Anthropic's error body (type api_error); the
stream ends there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from draftsmith.server.messages_content import MessageContent
from draftsmith.server.messages_error import stream_error
from draftsmith.server.responses import sse_event

if TYPE_CHECKING:
    from draftsmith.server.messages_api import MessagesFormat


class MessagesStream:
    """One request's events; `events(chunks)` writes them."""

    def __init__(self, fmt: MessagesFormat) -> None:
        self.fmt = fmt
        self.content = MessageContent()
        self.finish: str | None = None
        self.stop: int | str | None = None  # the engine's stop reason (a stop string, a token id)
        self.usage: dict | None = None

    def _usage(self, output_tokens: int) -> dict:
        cached = self.fmt.cache_read
        return {"input_tokens": self.fmt.prompt_tokens() - cached, "cache_read_input_tokens": cached,
                "output_tokens": output_tokens}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        started = False

        def start() -> str:
            nonlocal started
            started = True
            return sse_event({"type": "message_start", "message": self.fmt.message([], (None, None), self._usage(0))})

        async for chunk in chunks:
            if "error" in chunk:
                if not started:
                    yield start()
                yield sse_event(stream_error(chunk["error"]))
                return
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk["choices"]:
                self.finish = choice["finish_reason"] or self.finish
                if choice.get("stop_reason") is not None:
                    self.stop = choice["stop_reason"]
                for fields in self.content.read(choice["delta"].get("parts", [])):
                    if not started:
                        yield start()
                    yield sse_event(fields)
        if not started:
            yield start()
        for fields in self.content.end():
            yield sse_event(fields)
        reason, sequence = self.content.stop_reason(self.finish, self.stop)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": self._usage(self.usage["completion_tokens"])})
        yield sse_event({"type": "message_stop"})

"""A streamed Message (POST /v1/messages with `stream: true`): the chat stream's chunks
(server/streaming.py: the answer's parts in order (server/answer.py's PartsReader), its
finish_reason and stop string, then the usage chunk) as Anthropic's server-sent events, each
`event: TYPE` + `data: {"type": TYPE, ...}`:

message_start (the Message, empty: no content, stop_reason null, usage: the prompt's
input_tokens, output_tokens 0); per content block, in the order the answer writes them
(server/messages_content.py), each stopped before the next starts: content_block_start,
content_block_delta ... (text_delta, thinking_delta, input_json_delta), content_block_stop;
message_delta (stop_reason, stop_sequence; usage: the same input_tokens, output_tokens);
message_stop. No ping events are sent.

A stream's usage does not split off the prefix cache's tokens (no cache_read_input_tokens):
message_start goes out before the engine admits the request and matches its prompt against the
cache, and the engine tells that count only with the finished answer; rather than message_delta
contradicting message_start's input_tokens, both give the whole prompt. A whole Message (and the
chat route's usage) has the split.

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

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        prompt = self.fmt.prompt_tokens()
        start = {"input_tokens": prompt, "output_tokens": 0}
        yield sse_event({"type": "message_start", "message": self.fmt.message([], (None, None), start)})
        async for chunk in chunks:
            if "error" in chunk:
                yield sse_event(stream_error(chunk["error"]))
                return
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk["choices"]:
                self.finish = choice["finish_reason"] or self.finish
                if choice.get("stop_reason") is not None:
                    self.stop = choice["stop_reason"]
                for fields in self.content.read(choice["delta"].get("parts", [])):
                    yield sse_event(fields)
        for fields in self.content.end():
            yield sse_event(fields)
        reason, sequence = self.content.stop_reason(self.finish, self.stop)
        yield sse_event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"input_tokens": prompt, "output_tokens": self.usage["completion_tokens"]}})
        yield sse_event({"type": "message_stop"})

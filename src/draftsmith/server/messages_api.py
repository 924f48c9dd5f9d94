"""Anthropic's Messages API objects (POST /v1/messages): a chat answer (read in order by
server/answer.py's reader, with its finish_reason, stop string and usage) as a Message.

`content` holds the answer's blocks in the order it wrote them (server/messages_content.py):
`thinking` (the server's --reasoning-parser), `text`, `tool_use`; `stop_reason` end_turn,
max_tokens, stop_sequence (with `stop_sequence`) or tool_use. `usage`: `input_tokens` the
prompt's tokens that were not read from the prefix cache, `cache_read_input_tokens` those that
were (Anthropic's meaning: the prompt is their sum, what count_tokens returns; the chat route's
prompt_tokens_details.cached_tokens), `output_tokens`.

A whole Message and a streamed one (server/messages_stream.py) are built by the same reader and
content builder, so the `anthropic` package's accumulator adds the stream up to the whole
Message's content, stop_reason and output_tokens, but for ids; a tool_use block's input too,
unless the model's arguments are not JSON (messages_content.py). A stream's usage does not split
the prompt (see messages_stream.py). Ids: "msg_<hex>"; a tool_use block's "toolu_<hex>".
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from draftsmith.server.answer import PartsReader
from draftsmith.server.engine_loop import Event
from draftsmith.server.messages_content import MessageContent
from draftsmith.server.messages_stream import MessagesStream
from draftsmith.server.responses import ResponseFormat


class MessagesFormat(ResponseFormat):
    """A chat request answered as an Anthropic Message."""

    def __init__(self, model: str) -> None:
        super().__init__(chat=True, rid=f"msg_{uuid.uuid4().hex}", model=model)
        self.cache_read = 0  # a stream's prompt tokens read from the prefix cache (told with its first tokens)

    def cached(self, index: int, tokens: int) -> None:
        self.cache_read = tokens

    def answer_reader(self) -> PartsReader:  # type: ignore[override]
        return self.answer.parts_reader()

    def message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
        """The Message object around `content`; `stop`: its stop_reason and stop_sequence."""
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def prompt_tokens(self) -> int:
        return len(self.prompts[0])

    @staticmethod
    def usage(chat_usage: dict) -> dict:
        """Anthropic's usage of a chat answer's (the prompt = input_tokens + cache_read_input_tokens)."""
        cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": chat_usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "output_tokens": chat_usage["completion_tokens"]}

    def response(self, finals: list[Event], usage: dict) -> dict:
        """The whole Message of the request's one answer."""
        (e,) = finals
        reader, content = self.answer_reader(), MessageContent()
        content.read(reader.finish(e.text)["parts"])
        content.end()
        stop = content.stop_reason(reader.finish_reason(e.finish_reason), e.stop_reason)
        return self.message(content.blocks, stop, self.usage(usage))

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Anthropic's server-sent events (server/messages_stream.py)."""
        async for line in MessagesStream(self).events(chunks):
            yield line

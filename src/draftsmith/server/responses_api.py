"""The Responses API's objects (POST /v1/responses): a chat answer (server/answer.py's message,
finish_reason, logprobs, usage) as a Response.

`output` holds, in this order: a `reasoning` item where the answer had reasoning (the server's
--reasoning-parser), a `message` item with one `output_text` part where it had content (or had
neither content, calls nor reasoning: an empty text), a `function_call` item per tool call. The
response is "incomplete" (incomplete_details.reason "max_output_tokens") where the answer ran out
of tokens (finish_reason "length"), its last item too; else "completed". With `include:
["message.output_text.logprobs"]`, the output_text's `logprobs` are those of every generated token
(chat's: reasoning and calls included). `usage.output_tokens_details.reasoning_tokens` counts the
tokens up to the one that ends the reasoning (`</think>`; all of them where it never ends).

Ids: "resp_<hex>"; the items' are derived from it ("rs_<hex>", "msg_<hex>") and from each call's
("fc_<hex>", call_id "call_<hex>"), so a stream (server/responses_stream.py) names its items as
the final Response does.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from draftsmith.models.token_text import TokenText
from draftsmith.server.engine_loop import Event
from draftsmith.server.responses import ResponseFormat
from draftsmith.server.responses_stream import ResponsesStream

_END_THINK = b"</think>"


class ResponsesFormat(ResponseFormat):
    """A chat request answered as a Response; `echo`: what the Response repeats of its request
    (ResponsesRequest.echo); `logprobs`: the request asked for them (include)."""

    def __init__(self, model: str, echo: dict, token_text: TokenText, logprobs: bool) -> None:
        super().__init__(chat=True, rid=f"resp_{uuid.uuid4().hex}", model=model)
        self.hex = self.rid.removeprefix("resp_")
        self.request_echo, self.token_text, self.want_logprobs = echo, token_text, logprobs
        self.token_ids = True  # (the chat objects carry the generated ids: reasoning_tokens reads them)

    # ---- items ----

    def reasoning_item(self, text: str) -> dict:
        return {"id": f"rs_{self.hex}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def message_item(self, text: str, logprobs: list, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {"id": f"msg_{self.hex}", "type": "message", "role": "assistant", "status": status, "content": [part]}

    @staticmethod
    def call_item(chat_call: dict, arguments: str, status: str) -> dict:
        """A chat tool call (its first delta, or the whole message's call) as a function_call item."""
        h = chat_call["id"].rsplit("-", 1)[-1]  # (chatcmpl-tool-<hex>)
        return {"id": f"fc_{h}", "type": "function_call", "call_id": f"call_{h}", "name": chat_call["function"]["name"],
                "arguments": arguments, "status": status}

    # ---- the response ----

    def envelope(self, status: str, output: list[dict], usage: dict | None, finish_reason: str | None = None) -> dict:
        """The Response object around `output`."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                **self.request_echo, "usage": usage}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def usage_object(self, chat_usage: dict, token_ids: list[int], reasoned: bool) -> dict:
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(token_ids) if reasoned else 0},
                "total_tokens": chat_usage["total_tokens"]}

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """The tokens of an answer's reasoning: up to the one that completes `</think>` (all, where none does)."""
        tail = b""
        for i, t in enumerate(token_ids):
            tail = (tail + self.token_text.bytes(t))[-(len(_END_THINK) + 64):]
            if _END_THINK in tail:
                return i + 1
        return len(token_ids)

    def response(self, finals: list[Event], usage: dict) -> dict:
        """The whole Response of the request's one answer."""
        (choice,) = super().response(finals, usage)["choices"]
        msg, status = choice["message"], self.status(choice["finish_reason"])
        output: list[dict] = []
        if msg.get("reasoning"):
            output.append(self.reasoning_item(msg["reasoning"]))
        if msg["content"] is not None:
            lp = (choice["logprobs"] or {}).get("content") or []
            output.append(self.message_item(msg["content"], lp, "completed"))
        for c in msg.get("tool_calls") or []:
            output.append(self.call_item(c, c["function"]["arguments"], "completed"))
        if status == "incomplete" and output[-1].get("status"):
            output[-1]["status"] = "incomplete"
        return self.envelope(status, output, self.usage_object(usage, choice["token_ids"], bool(msg.get("reasoning"))))

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The Responses API's server-sent events (server/responses_stream.py)."""
        async for line in ResponsesStream(self).events(chunks):
            yield line

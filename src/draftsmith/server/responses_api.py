"""The Responses API's objects (POST /v1/responses): a chat answer (read in order by
server/answer.py's reader, with its finish_reason, logprobs and usage) as a Response.

`output` holds the answer's items in the order it wrote them (server/responses_output.py): a
`reasoning` item (the server's --reasoning-parser), a `message` with one `output_text` per run of
text (before, between and after calls), a `function_call` per tool call; an empty text where the
answer had nothing. The response is "incomplete" (incomplete_details.reason "max_output_tokens")
where the answer ran out of tokens (finish_reason "length"), and so is every item the cut left
unfinished (responses_output.py: the one the last character went to, unless that character
closed it); else "completed". `usage.output_tokens_details.reasoning_tokens` counts the tokens
up to the one that ends the reasoning (`</think>`, where the reader found it in the text; all of
them where it never ends) where the answer had a think block, empty or not.

A whole Response and a streamed one (server/responses_stream.py) are built by the same reader,
output builder and `final`, so the stream's last Response equals the whole one but for ids and
created_at. Ids: "resp_<hex>"; its items' are derived from it and from each call's.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from draftsmith.server.answer import PartsReader
from draftsmith.server.engine_loop import Event
from draftsmith.server.responses import ResponseFormat
from draftsmith.server.responses_output import ResponseOutput
from draftsmith.server.responses_stream import ResponsesStream


class ResponsesFormat(ResponseFormat):
    """A chat request answered as a Response; `echo`: what the Response repeats of its request
    (server/responses_request.py's `echo`)."""

    def __init__(self, model: str, echo: dict) -> None:
        super().__init__(chat=True, rid=f"resp_{uuid.uuid4().hex}", model=model)
        self.hex = self.rid.removeprefix("resp_")
        self.request_echo = echo
        self.token_ids = True  # (the chat objects carry the generated ids: logprobs and reasoning_tokens read them)

    def answer_reader(self) -> PartsReader:  # type: ignore[override]
        return self.answer.parts_reader()

    def output(self) -> ResponseOutput:
        """A fresh builder of one answer's items (`decode`: the request's, server/generate.py)."""
        return ResponseOutput(self.hex, self.decode, logprobs=self.logprobs is not None)

    def envelope(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None,
                 metrics: dict | None = None) -> dict:
        """The Response object around `output` (`metrics`: vLLM's per-request metrics, where the
        server reports them: with_request_metrics)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                **self.request_echo, "usage": usage}
        if self.request_metrics and usage is not None:
            body["metrics"] = metrics
        return body

    def final(self, out: ResponseOutput, finish_reason: str | None, chat_usage: dict,
              thinks: bool, metrics: dict | None = None) -> tuple[list[tuple[str, dict]], dict]:
        """The events that close an answer's items and its whole Response (whole and streamed
        alike): "incomplete", with the items the cut left unfinished, where the answer ran out of
        tokens."""
        cut = finish_reason == "length"
        events = out.end(cut)
        reasoning = out.reasoning_tokens(thinks, chat_usage["completion_tokens"])
        usage = {"input_tokens": chat_usage["prompt_tokens"],
                 "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                 "output_tokens": chat_usage["completion_tokens"],
                 "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": chat_usage["total_tokens"]}
        return events, self.envelope("incomplete" if cut else "completed", out.items, usage, metrics=metrics)

    def response(self, finals: list[Event], usage: dict) -> dict:
        """The whole Response of the request's one answer."""
        (e,) = finals
        reader, out = self.answer_reader(), self.output()
        lp = self.logprobs_of(e.index, e.token_ids, e.logprobs)
        out.read(reader.finish(e.text)["parts"], list(e.token_ids), (lp or {}).get("content") or [],
                 cut=e.finish_reason == "length")
        return self.final(out, e.finish_reason, usage, reader.reader.thinks, self.metrics_of(finals))[1]

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The Responses API's server-sent events (server/responses_stream.py)."""
        async for line in ResponsesStream(self).events(chunks):
            yield line

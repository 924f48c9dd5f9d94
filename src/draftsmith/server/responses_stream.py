"""A streamed Response (POST /v1/responses with `stream: true`): the chat stream's chunks
(server/streaming.py: one choice's deltas, here its answer's parts in order (server/answer.py's
PartsReader), with its logprobs and token ids, then the usage chunk) as the Responses API's
server-sent events, each `event: TYPE` + `data: {"type": TYPE, "sequence_number": n, ...}`
(OpenAI's and vLLM's form):

response.created, response.in_progress; per item, in the order the answer writes them
(server/responses_output.py), each closed before the next is added:
- reasoning: response.output_item.added, response.content_part.added (reasoning_text),
  response.reasoning_text.delta ..., response.reasoning_text.done, response.content_part.done;
- message: response.output_item.added, response.content_part.added (output_text),
  response.output_text.delta ... (with the logprobs of its piece), response.output_text.done,
  response.content_part.done;
- function_call: response.output_item.added, response.function_call_arguments.delta ...,
  response.function_call_arguments.done;
each then response.output_item.done; at the end response.completed with the whole Response
(status "completed" or "incomplete", as vLLM sends it; OpenAI names the last event
response.incomplete there), built by the same `final` as a whole Response.

An engine error midway is an `error` event (its code, message and param, and the chat route's
error object under `error`, which the openai package raises as an APIError), then
response.failed: the Response with status "failed", `error` {"code": "server_error", "message"}
and the output so far; the stream ends there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from draftsmith.server.responses import sse_event

if TYPE_CHECKING:
    from draftsmith.server.responses_api import ResponsesFormat


class ResponsesStream:
    """One request's events; `events(chunks)` writes them."""

    def __init__(self, fmt: ResponsesFormat) -> None:
        self.fmt = fmt
        self.seq = 0
        self.out = fmt.output()
        self.finish: str | None = None
        self.thinks = False  # the answer had a think block (its last delta says)
        self.usage: dict | None = None
        self.metrics: dict | None = None  # the usage chunk's, where the server reports per-request metrics

    def _event(self, kind: str, fields: dict) -> str:
        line = sse_event({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return line

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        start = self.fmt.envelope("in_progress", [], None)
        yield self._event("response.created", {"response": start})
        yield self._event("response.in_progress", {"response": start})
        async for chunk in chunks:
            if "error" in chunk:
                for line in self._failed(chunk["error"]):
                    yield line
                return
            self.usage = chunk.get("usage") or self.usage
            self.metrics = chunk.get("metrics", self.metrics)
            for choice in chunk["choices"]:
                for kind, fields in self._choice(choice):
                    yield self._event(kind, fields)
        events, response = self.fmt.final(self.out, self.finish, self.usage, self.thinks, self.metrics)
        for kind, fields in events:
            yield self._event(kind, fields)
        yield self._event("response.completed", {"response": response})

    def _choice(self, choice: dict) -> list[tuple[str, dict]]:
        delta = choice["delta"]
        ids = choice.get("token_ids") or []
        self.finish = choice["finish_reason"] or self.finish
        self.thinks = delta.get("thinks", self.thinks)
        entries = (choice["logprobs"] or {}).get("content") or []
        return self.out.read(delta.get("parts", []), ids, entries, cut=choice["finish_reason"] == "length")

    def _failed(self, err: dict) -> list[str]:
        code = "invalid_prompt" if err.get("type") == "invalid_request_error" else "server_error"  # (OpenAI's codes)
        error = {"code": code, "message": err["message"]}
        failed = self.fmt.envelope("failed", self.out.failed(), None, error)
        return [self._event("error", {"code": err.get("code") or err.get("type"), "message": err["message"],
                                      "param": err.get("param"), "error": err}),
                self._event("response.failed", {"response": failed})]

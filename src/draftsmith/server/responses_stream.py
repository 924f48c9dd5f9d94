"""A streamed Response (POST /v1/responses with `stream: true`): the chat stream's chunks
(server/streaming.py: one choice's deltas of reasoning, content and tool calls, its logprobs and
token ids, then the usage chunk) as the Responses API's server-sent events, each
`event: TYPE` + `data: {"type": TYPE, "sequence_number": n, ...}` (OpenAI's and vLLM's form):

response.created, response.in_progress; per item, in the order the answer writes them:
- reasoning: response.output_item.added, response.content_part.added (reasoning_text),
  response.reasoning_text.delta ..., then (when content or a call begins, or at the end)
  response.reasoning_text.done, response.content_part.done, response.output_item.done;
- message: response.output_item.added, response.content_part.added (output_text),
  response.output_text.delta ... (with the logprobs entries received since the last delta);
- function_call: response.output_item.added, response.function_call_arguments.delta ...;
at the end the message's response.output_text.done, response.content_part.done and each open
item's response.output_item.done, in output order; then response.completed with the whole
Response (status "completed" or "incomplete", as vLLM sends it; OpenAI names the last event
response.incomplete there). An engine error is an `error` event, and the stream ends.

The final Response is built by the same item and envelope functions as a whole one
(server/responses_api.py) from the same answer, so it equals the whole response but for ids and
created_at. (One order differs: where an answer's only text comes after its calls, the stream
adds the message after them; a whole response puts it first.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

from draftsmith.server.responses import sse

if TYPE_CHECKING:
    from draftsmith.server.responses_api import ResponsesFormat


class ResponsesStream:
    """One request's events; `events(chunks)` writes them."""

    def __init__(self, fmt: ResponsesFormat) -> None:
        self.fmt = fmt
        self.seq = 0
        self.items: list[dict] = []  # output items in output order (each in its final form once done)
        self.reasoning: int | None = None  # the open reasoning item's index
        self.reasoned = False  # the answer had reasoning
        self.thought = ""  # the open reasoning item's text
        self.message: int | None = None
        self.text = ""
        self.calls: dict[int, int] = {}  # chat call index -> output index
        self.arguments: dict[int, str] = {}  # output index -> a call's arguments so far
        self.entries: list[dict] = []  # every logprobs entry
        self.pending: list[dict] = []  # entries not sent with a text delta yet
        self.token_ids: list[int] = []
        self.finish: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        line = f"event: {kind}\n" + sse({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return line

    def _at(self, index: int) -> dict:
        return {"item_id": self.items[index]["id"], "output_index": index}

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        start = self.fmt.envelope("in_progress", [], None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for chunk in chunks:
            if "error" in chunk:
                err = chunk["error"]
                yield self._event("error", code=err.get("code") or err.get("type"), message=err["message"],
                                  param=err.get("param"))
                return
            self.usage = chunk.get("usage") or self.usage
            for choice in chunk["choices"]:
                for line in self._choice(choice):
                    yield line
        for line in self._end():
            yield line

    def _choice(self, choice: dict) -> list[str]:
        out: list[str] = []
        delta = choice["delta"]
        self.finish = choice["finish_reason"] or self.finish
        self.token_ids += choice.get("token_ids") or []
        entries = (choice["logprobs"] or {}).get("content") or []
        self.entries += entries
        self.pending += entries
        if delta.get("reasoning"):
            out += self._reasoning(delta["reasoning"])
        if delta.get("content"):
            out += self._close_reasoning() + self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._close_reasoning() + self._call(call)
        return out

    def _add(self, item: dict) -> tuple[int, str]:
        self.items.append(item)
        return len(self.items) - 1, self._event("response.output_item.added", output_index=len(self.items) - 1,
                                                item=item)

    def _reasoning(self, text: str) -> list[str]:
        out = []
        if self.reasoning is None:
            self.reasoned = True
            self.reasoning, added = self._add({**self.fmt.reasoning_item(""), "content": []})
            out += [added, self._event("response.content_part.added", **self._at(self.reasoning), content_index=0,
                                       part={"type": "reasoning_text", "text": ""})]
        self.thought += text
        return out + [self._event("response.reasoning_text.delta", **self._at(self.reasoning), content_index=0,
                                  delta=text)]

    def _close_reasoning(self) -> list[str]:
        if self.reasoning is None:
            return []
        i, self.reasoning, text = self.reasoning, None, self.thought
        self.items[i] = self.fmt.reasoning_item(text)
        return [self._event("response.reasoning_text.done", **self._at(i), content_index=0, text=text),
                self._event("response.content_part.done", **self._at(i), content_index=0,
                            part={"type": "reasoning_text", "text": text}),
                self._event("response.output_item.done", output_index=i, item=self.items[i])]

    def _open_message(self) -> list[str]:
        item = self.fmt.message_item("", [], "in_progress")
        self.message, added = self._add({**item, "content": []})
        return [added, self._event("response.content_part.added", **self._at(self.message), content_index=0,
                                   part=item["content"][0])]

    def _text(self, text: str) -> list[str]:
        out = self._open_message() if self.message is None else []
        self.text += text
        lp, self.pending = self.pending, []
        return out + [self._event("response.output_text.delta", **self._at(self.message), content_index=0,
                                  delta=text, logprobs=lp)]

    def _call(self, call: dict) -> list[str]:
        arguments = call["function"].get("arguments") or ""
        if "id" in call:  # a call begins
            i, added = self._add(self.fmt.call_item(call, "", "in_progress"))
            self.calls[call["index"]], self.arguments[i] = i, ""
            out = [added]
        else:
            i, out = self.calls[call["index"]], []
        self.arguments[i] += arguments
        if arguments:
            out.append(self._event("response.function_call_arguments.delta", **self._at(i), delta=arguments))
        return out

    def _end(self) -> list[str]:
        out = self._close_reasoning()
        if self.message is None and not self.calls and not self.reasoned:  # an empty answer: an empty text
            out += self._open_message()
        status = self.fmt.status(self.finish)
        last = len(self.items) - 1
        for i in sorted(([self.message] if self.message is not None else []) + list(self.calls.values())):
            done = "incomplete" if status == "incomplete" and i == last else "completed"
            if i == self.message:
                part = self.fmt.message_item(self.text, self.entries, done)["content"][0]
                out += [self._event("response.output_text.done", **self._at(i), content_index=0, text=self.text,
                                    logprobs=self.entries),
                        self._event("response.content_part.done", **self._at(i), content_index=0, part=part)]
                self.items[i] = self.fmt.message_item(self.text, self.entries, done)
            else:
                out.append(self._event("response.function_call_arguments.done", **self._at(i),
                                       arguments=self.arguments[i]))
                self.items[i] = {**self.items[i], "arguments": self.arguments[i], "status": done}
            out.append(self._event("response.output_item.done", output_index=i, item=self.items[i]))
        usage = self.fmt.usage_object(self.usage, self.token_ids, self.reasoned)
        return out + [self._event("response.completed", response=self.fmt.envelope(status, self.items, usage))]

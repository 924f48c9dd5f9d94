"""A Response's `output` items, built from an answer's parts (server/answer_parts.py) in the
order the answer writes them, with the stream events that build them. A whole Response is the
same builder given every part at once, so a stream's final Response has the same items, in the
same order, as a whole one (ids and created_at aside).

- A `reasoning` item per run of reasoning, a `message` (one `output_text`) per run of text, a
  `function_call` per call: text before, between and after calls are messages of their own.
- Each item is closed (its `*.done` events, then `response.output_item.done`) before the next one
  is added, as OpenAI's stream does.
- `end`: the last item, the one the answer's last token went to, is closed "incomplete" where
  the answer was cut by max_output_tokens, "completed" otherwise (every earlier item is
  "completed"); an answer with no item at all is one empty message.
- Logprobs (include `message.output_text.logprobs`): an output_text's are those of the tokens that
  wrote it: from the end of what the answer wrote before it (a `Part`'s `end`: a reasoning's
  through `</think>`, a call's through `</tool_call>`) through the end of its own text, the token
  that completes a character read from the tokens' bytes (TokenText). So a reasoning's or a
  call's tokens are on no output_text, nor is a token after the last text (an end-of-text token);
  the split depends on the text alone, not on how it was streamed. Each `output_text.delta`
  carries those of its piece: a message's deltas add up to its `output_text.done`.

Ids: a reasoning item's "rs_<hex>_<output index>", a message's "msg_<hex>_<output index>"
(<hex>: the response's), a call's "fc_<hex>" with call_id "call_<hex>" (<hex>: the chat call id's).
"""

from __future__ import annotations

import codecs
import copy

from draftsmith.models.token_text import TokenText
from draftsmith.server.answer_parts import Part

Event = tuple[str, dict]  # a stream event's type and fields (server/responses_stream.py numbers and writes it)


class _TextTokens:
    """How many of the answer's tokens it takes to write the first characters of its text: the
    tokens' bytes decoded in turn, as the text was decoded from them."""

    def __init__(self, token_text: TokenText) -> None:
        self.token_text = token_text
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.owner: list[int] = []  # per character: the token that completed it
        self.count = 0

    def add(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.owner.extend([self.count] * len(self.decoder.decode(self.token_text.bytes(t))))
            self.count += 1

    def through(self, end: int) -> int:
        """The tokens that write the text's first `end` characters (all read, past the text's end)."""
        if end <= 0:
            return 0
        return self.owner[end - 1] + 1 if end <= len(self.owner) else self.count


class ResponseOutput:
    """One answer's output items (`items`, in output order): `read` gives each piece of the answer
    as it comes (its parts, with the tokens and logprobs entries that came with them) and returns
    the events that build the items; `end` closes the answer."""

    def __init__(self, response_hex: str, token_text: TokenText | None, logprobs: bool) -> None:
        self.hex = response_hex
        self.items: list[dict] = []
        self.open: int | None = None  # the open item (always the last one, until `end`)
        self.calls: dict[int, int] = {}  # a chat call's index -> its item's
        self.text_end = 0  # where the last part read ends in the answer's text
        self.tokens = _TextTokens(token_text) if logprobs else None
        self.entries: list[dict] = []  # every token's logprobs entry (with logprobs)
        self.sent = 0  # the open message's tokens through its last piece

    def read(self, parts: list[Part], token_ids: list[int], entries: list[dict]) -> list[Event]:
        """`parts` of the answer, read from the text of `token_ids` (with their logprobs
        `entries`) and of the tokens read before them."""
        if self.tokens is not None:
            self.tokens.add(token_ids)
            self.entries += entries
        out: list[Event] = []
        for p in parts:
            if p.kind == "call":
                out += self._call(p)
            elif p.value:  # (an empty part only says where its text ends)
                out += self._text(p)
            self.text_end = p.end
        return out

    def end(self, cut: bool) -> list[Event]:
        """The events that close the answer; `cut`: it ran out of tokens (max_output_tokens)."""
        out = [] if self.items else self._add("message")
        return out + self._close("incomplete" if cut else "completed")

    def failed(self) -> list[dict]:
        """The output of an answer that failed midway (its open item "incomplete")."""
        items = copy.deepcopy(self.items)
        if self.open is not None:
            items[self.open]["status"] = "incomplete"
        return items

    def _at(self, i: int) -> dict:
        return {"item_id": self.items[i]["id"], "output_index": i}

    def _add(self, kind: str) -> list[Event]:
        """A reasoning item or a message, open and empty."""
        i = len(self.items)
        if kind == "reasoning":
            item = {"id": f"rs_{self.hex}_{i}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"id": f"msg_{self.hex}_{i}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.sent = 0 if self.tokens is None else self.tokens.through(self.text_end)  # (its tokens start here)
        self.items.append(item)
        self.open = i
        return [("response.output_item.added", {"output_index": i, "item": {**item, "content": []}}),
                ("response.content_part.added", {**self._at(i), "content_index": 0,
                                                 "part": copy.deepcopy(item["content"][0])})]

    def _text(self, p: Part) -> list[Event]:
        kind = "reasoning" if p.kind == "reasoning" else "message"
        out: list[Event] = []
        if self.open is None or self.items[self.open]["type"] != kind:
            out += self._close("completed") + self._add(kind)
        i = self.open
        part = self.items[i]["content"][0]
        part["text"] += p.value
        if kind == "reasoning":
            return out + [("response.reasoning_text.delta", {**self._at(i), "content_index": 0, "delta": p.value})]
        lp = self._entries(p.end)
        part["logprobs"] += lp
        return out + [("response.output_text.delta", {**self._at(i), "content_index": 0, "delta": p.value,
                                                       "logprobs": lp})]

    def _entries(self, end: int) -> list[dict]:
        """The open message's logprobs entries through the text's first `end` characters, not given out yet."""
        if self.tokens is None:
            return []
        upto = max(self.sent, self.tokens.through(end))
        lp, self.sent = self.entries[self.sent:upto], upto
        return lp

    def _call(self, p: Part) -> list[Event]:
        call = p.value
        out: list[Event] = []
        if "id" in call:  # a call begins
            out += self._close("completed")
            i = len(self.items)
            h = call["id"].rsplit("-", 1)[-1]  # (chatcmpl-tool-<hex>)
            self.items.append({"id": f"fc_{h}", "type": "function_call", "call_id": f"call_{h}",
                               "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
            self.open, self.calls[call["index"]] = i, i
            out.append(("response.output_item.added", {"output_index": i, "item": dict(self.items[i])}))
        else:  # more of its arguments
            i = self.calls[call["index"]]
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self.items[i]["arguments"] += arguments
            out.append(("response.function_call_arguments.delta", {**self._at(i), "delta": arguments}))
        return out

    def _close(self, status: str) -> list[Event]:
        """The open item's done events ("completed" or "incomplete")."""
        if self.open is None:
            return []
        i, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = status
        at = self._at(i)
        if item["type"] == "function_call":
            out = [("response.function_call_arguments.done", {**at, "arguments": item["arguments"]})]
        else:
            part = item["content"][0]
            fields = {**at, "content_index": 0, "text": part["text"]}
            out = [("response.reasoning_text.done", fields) if item["type"] == "reasoning"
                   else ("response.output_text.done", {**fields, "logprobs": list(part["logprobs"])}),
                   ("response.content_part.done", {**at, "content_index": 0, "part": copy.deepcopy(part)})]
        return out + [("response.output_item.done", {"output_index": i, "item": copy.deepcopy(item)})]

"""A Response's `output` items, built from an answer's parts (server/answer_parts.py) in the
order the answer writes them, with the stream events that build them. A whole Response is the
same builder given every part at once, so a stream's final Response has the same items, in the
same order, as a whole one (ids and created_at aside).

- A `reasoning` item per run of reasoning, a `message` (one `output_text`) per run of text, a
  `function_call` per call: text before, between and after calls are messages of their own.
- Each item is closed (its `*.done` events, then `response.output_item.done`) before the next one
  is added, as OpenAI's stream does.
- `end`: where the answer was cut by max_output_tokens, every item the cut left unfinished is
  closed "incomplete", every other one "completed" (all of them where it was not cut). Unfinished:
  a message that no other item follows (text has no closing mark), a reasoning whose `</think>`
  never came, a call whose text did not close it (a hermes block without `</tool_call>`, a named
  call's arguments). So the item the answer's last character went to is "incomplete" unless that
  character closed it: an answer cut right after `</think>` or `</tool_call>` has every item
  "completed" (whitespace a reader drops after a call goes to no item), and a reasoning cut
  before a named call's empty arguments is "incomplete" with that call. An answer with no item
  at all is one empty message ("incomplete" where cut).
- Logprobs (include `message.output_text.logprobs`): an output_text's are those of the tokens that
  wrote it: from the end of what the answer wrote before it (a `Part`'s `end`: a reasoning's
  through `</think>`, a call's through `</tool_call>`) through the end of its own text. Which
  token wrote which character comes from the decoding that wrote the text (`_TextTokens`), so a
  SentencePiece decoder's dropped first space or a skipped special token moves nothing. A
  reasoning's or a call's tokens are on no output_text, nor is a token after the last text (an
  end-of-text token); the split depends on the text alone, not on how it was streamed. Each
  `output_text.delta` carries those of its piece: a message's deltas add up to its
  `output_text.done`.

Ids: a reasoning item's "rs_<hex>_<output index>", a message's "msg_<hex>_<output index>"
(<hex>: the response's), a call's "fc_<hex>" with call_id "call_<hex>" (<hex>: the chat call id's).
"""

from __future__ import annotations

import copy
from typing import Callable

from draftsmith.server.answer_parts import Part, call_hex

Event = tuple[str, dict]  # a stream event's type and fields (server/responses_stream.py numbers and writes it)
_PARTIAL = "\ufffd"  # what a decoding ends in where a character continues in a later token


class _TextTokens:
    """Which of the answer's tokens write its text's first characters, read from the decoding that
    wrote the text (the engine's and the stream's `decode` of the token ids: special tokens
    skipped or kept as the request asked), a token at a time, as vLLM's incremental detokenizer
    does: a token's characters are what decoding a short window of tokens ending with it adds to
    decoding the window without it. The window starts at tokens that were read already, so a
    decoder that treats the first token of a decoding apart (SentencePiece's Metaspace and Strip
    drop its leading space) does so on both sides; a skipped special token adds nothing; a
    character goes to the token that completes it (a decoding that ends in U+FFFD waits for the
    next token). Decoded lazily, only as far as `through` asks."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.owner: list[int] = []  # per character of the text: the token that wrote it
        self.read = 0  # tokens decoded
        self.start = self.mark = 0  # the window: ids[start:] (ids[start:mark] its tokens already read)
        self.base = 0  # characters of decode(ids[start:mark])

    def add(self, token_ids: list[int]) -> None:
        self.ids += token_ids

    def _step(self) -> None:
        k = self.read
        text = self.decode(self.ids[self.start:k + 1])
        if len(text) > self.base and not text.endswith(_PARTIAL):
            self.owner += [k] * (len(text) - self.base)
            self.start, self.mark = self.mark, k + 1
            self.base = len(self.decode(self.ids[self.start:self.mark]))
        self.read = k + 1

    def through(self, end: int) -> int:
        """The tokens that write the text's first `end` characters (all read, past what they wrote)."""
        if end <= 0:
            return 0
        while len(self.owner) < end and self.read < len(self.ids):
            self._step()
        return self.owner[end - 1] + 1 if end <= len(self.owner) else len(self.ids)


class ResponseOutput:
    """One answer's output items (`items`, in output order): `read` gives each piece of the answer
    as it comes (its parts, with the tokens and logprobs entries that came with them) and returns
    the events that build the items; `end` closes the answer. `decode`: the token ids' decoding
    that wrote the answer's text (logprobs and reasoning_tokens read from it which token wrote
    what; None: neither is asked for)."""

    def __init__(self, response_hex: str, decode: Callable[[list[int]], str] | None, logprobs: bool) -> None:
        self.hex = response_hex
        self.items: list[dict] = []
        self.finished: list[bool] = []  # per item: its text closed it (`end`)
        self.open: int | None = None  # the open item (always the last one, until `end`)
        self.calls: dict[int, int] = {}  # a chat call's index -> its item's
        self.text_end = 0  # where the last part read ends in the answer's text
        self.reasoning_end: int | None = None  # where the reasoning closed: just past its `</think>`
        self.cut = False  # the answer ran out of tokens
        self.tokens = None if decode is None else _TextTokens(decode)
        self.logprobs = logprobs and decode is not None
        self.entries: list[dict] = []  # every token's logprobs entry (with logprobs)
        self.sent = 0  # the open message's tokens through its last piece

    def read(self, parts: list[Part], token_ids: list[int], entries: list[dict], cut: bool = False) -> list[Event]:
        """`parts` of the answer, read from the text of `token_ids` (with their logprobs
        `entries`) and of the tokens read before them; `cut`: these are the answer's last parts
        and it ran out of tokens (max_output_tokens): an unfinished item closed by a later one in
        them (a reasoning before a named call) is "incomplete" too."""
        self.cut = self.cut or cut
        if self.tokens is not None:
            self.tokens.add(token_ids)
        if self.logprobs:
            self.entries += entries
        out: list[Event] = []
        for p in parts:
            if p.kind == "call":
                out += self._call(p)
            elif p.value:  # (an empty part only says where its text ends)
                out += self._text(p)
            if p.done:
                if p.kind == "reasoning":
                    self.reasoning_end = p.end
                if self.open is not None and self.items[self.open]["type"] == (
                        "reasoning" if p.kind == "reasoning" else "function_call"):
                    self.finished[self.open] = True
            self.text_end = p.end
        return out

    def end(self, cut: bool = False) -> list[Event]:
        """The events that close the answer; `cut`: it ran out of tokens (max_output_tokens)."""
        self.cut = self.cut or cut
        out = [] if self.items else self._add("message")
        return out + self._close()

    def reasoning_tokens(self, thinks: bool, n_tokens: int) -> int:
        """The tokens of the answer's reasoning (`thinks`: it had a think block, empty or not):
        through the one that completes its `</think>`; all `n_tokens` where it never closed."""
        if not thinks:
            return 0
        if self.reasoning_end is None or self.tokens is None:
            return n_tokens
        return min(self.tokens.through(self.reasoning_end), n_tokens)

    def failed(self) -> list[dict]:
        """The output of an answer that failed midway (its open item "incomplete")."""
        items = copy.deepcopy(self.items)
        if self.open is not None:
            items[self.open]["status"] = "incomplete"
        return items

    def _at(self, i: int) -> dict:
        return {"item_id": self.items[i]["id"], "output_index": i}

    def _new(self, item: dict) -> int:
        """`item` added, open (the open one closed first: it is followed, so a message's text has ended)."""
        i = len(self.items)
        self.items.append(item)
        self.finished.append(False)
        self.open = i
        return i

    def _add(self, kind: str) -> list[Event]:
        """A reasoning item or a message, open and empty."""
        out = self._next()
        i = len(self.items)
        if kind == "reasoning":
            item = {"id": f"rs_{self.hex}_{i}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        else:
            item = {"id": f"msg_{self.hex}_{i}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
            self.sent = self.tokens.through(self.text_end) if self.logprobs else 0  # (its tokens start here)
        self._new(item)
        return out + [("response.output_item.added", {"output_index": i, "item": {**item, "content": []}}),
                      ("response.content_part.added", {**self._at(i), "content_index": 0,
                                                       "part": copy.deepcopy(item["content"][0])})]

    def _text(self, p: Part) -> list[Event]:
        kind = "reasoning" if p.kind == "reasoning" else "message"
        out: list[Event] = []
        if self.open is None or self.items[self.open]["type"] != kind:
            out += self._add(kind)
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
        if not self.logprobs:
            return []
        upto = max(self.sent, self.tokens.through(end))
        lp, self.sent = self.entries[self.sent:upto], upto
        return lp

    def _call(self, p: Part) -> list[Event]:
        call = p.value
        out: list[Event] = []
        if "id" in call:  # a call begins
            out += self._next()
            h = call_hex(call)
            i = self._new({"id": f"fc_{h}", "type": "function_call", "call_id": f"call_{h}",
                           "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
            self.calls[call["index"]] = i
            out.append(("response.output_item.added", {"output_index": i, "item": dict(self.items[i])}))
        else:  # more of its arguments
            i = self.calls[call["index"]]
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self.items[i]["arguments"] += arguments
            out.append(("response.function_call_arguments.delta", {**self._at(i), "delta": arguments}))
        return out

    def _next(self) -> list[Event]:
        """The open item's done events, where another item follows it (a message ends there)."""
        if self.open is not None and self.items[self.open]["type"] == "message":
            self.finished[self.open] = True
        return self._close()

    def _close(self) -> list[Event]:
        """The open item's done events: "incomplete" where the answer was cut and left it unfinished."""
        if self.open is None:
            return []
        i, item = self.open, self.items[self.open]
        self.open = None
        item["status"] = "incomplete" if self.cut and not self.finished[i] else "completed"
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

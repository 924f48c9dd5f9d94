"""A chat answer's content -> the assistant message's `content` and `tool_calls`, streamed.

Each tool plan (server/tools.py) reads the text as it arrives and gives its parts in the
answer's order (server/answer_parts.py: content text and `tool_calls` entries, `{"index", "id",
"type", "function": {"name", "arguments"}}` when a call starts, then `{"index", "function":
{"arguments"}}` for more of its arguments), which a chat delta merges. A whole response is the
same reader fed the whole text at once (server/answer.py), so a streamed answer and a whole one
always agree (tests/unit/test_tool_calls.py checks every split of the text).

- named: every token is the named function's arguments (content stays empty);
- required: a JSON array of `{"name", "parameters"}` objects; each call is sent when its object
  is complete. The answer is never content: its text is the grammar's JSON, so an answer cut by
  max_tokens (or ended by a grammar error) before an object closed gives the calls it completed
  and no more (none at all: no tool_calls and content "", as vLLM's whole answer, whose
  validation of the unfinished array fails), streamed or whole alike. (vLLM's stream, unlike its
  whole answer, sends the unfinished call with its arguments cut short; here a call is sent only
  when its object is whole, so a stream always adds up to the whole answer.)
- auto, hermes: content until `<tool_call>`; each `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` block is a call (a block without an end tag at the end of the answer, too); a
  block that is not such JSON stays in the content, as written; after the first call, whitespace
  before another call or at the end is dropped; with `parallel_tool_calls: false`, blocks after
  the first call stay text.

finish_reason is "tool_calls" where a required or auto answer made calls and ended cleanly
(`tool_calls_finish`), as OpenAI's; a named call keeps "stop", as OpenAI's and vLLM's.
"""

from __future__ import annotations

import json
import uuid

from draftsmith.server.answer_parts import Part, delta
from draftsmith.server.text import stop_holdback

_START, _END = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallReader:
    """Base: `read(text, last)` -> the parts (content, calls) that can be said now, in the
    answer's order, each with its end in the text read; `push(text)` / `finish(text)` -> a chat
    delta ({} when nothing can be said yet)."""

    finishes_with_calls = True  # finish_reason "tool_calls" where the answer made calls

    def __init__(self) -> None:
        self.calls = 0

    def tool_calls_finish(self, finish_reason: str | None) -> str | None:
        """The choice's finish_reason, "tool_calls" where calls ended the answer cleanly."""
        return "tool_calls" if self.finishes_with_calls and self.calls and finish_reason == "stop" else finish_reason

    def read(self, text: str, last: bool = False) -> list[Part]:
        raise NotImplementedError

    def push(self, text: str) -> dict:
        return delta(self.read(text))

    def finish(self, text: str) -> dict:
        return delta(self.read(text, last=True))

    def _call(self, name: str, arguments: str) -> dict:
        self.calls += 1
        return {"index": self.calls - 1, "id": _call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}


class NamedReader(ToolCallReader):
    """tool_choice names a function: the whole answer is its arguments."""

    finishes_with_calls = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.pos = 0  # text read

    def read(self, text: str, last: bool = False) -> list[Part]:
        self.pos += len(text)
        if self.calls == 0:
            text = text.lstrip()  # (whitespace a grammar lets before the JSON, e.g. after a model's reasoning)
            # (an empty answer is still the one call, with no arguments written)
            return [Part("call", self._call(self.name, text), self.pos)] if text or last else []
        return [Part("call", {"index": 0, "function": {"arguments": text}}, self.pos)] if text else []


class RequiredReader(ToolCallReader):
    """tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`, a call per object;
    no content (what the array does not complete is dropped: JSON the grammar wrote, not text)."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""  # all the text read
        self.pos = -1  # where the next element starts (-1: the array has not opened)
        self.closed = False
        self._decoder = json.JSONDecoder()

    def _calls(self) -> list[Part]:
        out: list[Part] = []
        if self.pos < 0:
            head = self.buf.lstrip()
            if not head.startswith("["):
                return out
            self.pos = len(self.buf) - len(head) + 1
        while not self.closed:
            i = self.pos
            while i < len(self.buf) and (self.buf[i].isspace() or self.buf[i] == ","):
                i += 1
            if i < len(self.buf) and self.buf[i] == "]":
                self.closed, self.pos = True, i + 1
                break
            try:
                obj, end = self._decoder.raw_decode(self.buf, i)
            except (ValueError, RecursionError):  # not complete yet (or not JSON: never a call)
                break
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                break
            out.append(Part("call", self._call(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False)),
                            end, done=True))
            self.pos = end
        return out

    def read(self, text: str, last: bool = False) -> list[Part]:
        self.buf += text
        return self._calls()


class HermesReader(ToolCallReader):
    """tool_choice "auto" with the hermes parser: `<tool_call>` blocks in free text."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self.max_calls = max_calls  # parallel_tool_calls: false -> 1 (later blocks stay text)
        self.buf = ""  # text not given out yet
        self.pos = 0  # where buf starts in the text read
        self.in_call = False
        self.ws = ""  # after a call: whitespace held until text follows it

    def _content(self, text: str) -> str:
        if not self.calls:
            return text
        self.ws += text
        body = self.ws.rstrip()
        self.ws = self.ws[len(body):]
        return body

    def _take(self, used: int) -> None:
        self.pos += used
        self.buf = self.buf[used:]

    def _text(self, out: list[Part], n: int) -> None:
        """buf[:n] as content (after any held whitespace; trailing whitespace after a call held:
        the part ends before it, where it ends however the text is split)."""
        content = self._content(self.buf[:n])
        self._take(n)
        if content:
            out.append(Part("content", content, self.pos - len(self.ws)))

    def _block(self, out: list[Part], body: str, used: int, closed: bool) -> None:
        """A `<tool_call>` block's body (its start tag already read), read from buf[:used]."""
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
        full = self.max_calls is not None and self.calls >= self.max_calls
        self._take(used)
        if full or not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            content = self._content(_START + body + (_END if closed else ""))  # (after any held whitespace)
            if content:
                out.append(Part("content", content, self.pos - len(self.ws)))
            return
        self.ws = ""  # whitespace between calls
        args = obj.get("arguments")
        args = args if isinstance(args, str) else json.dumps({} if args is None else args, ensure_ascii=False)
        out.append(Part("call", self._call(obj["name"], args), self.pos, done=closed))

    def read(self, text: str, last: bool = False) -> list[Part]:
        self.buf += text
        out: list[Part] = []
        while True:
            if self.in_call:
                j = self.buf.find(_END)
                if j < 0:
                    break
                self.in_call = False
                self._block(out, self.buf[:j], j + len(_END), closed=True)
                continue
            i = self.buf.find(_START)
            if i >= 0:
                self._text(out, i)
                self._take(len(_START))
                self.in_call = True
                continue
            keep = 0 if last else stop_holdback(self.buf, [_START])  # may still become <tool_call>
            self._text(out, len(self.buf) - keep)
            break
        if last:
            if self.in_call:  # a block the answer did not close
                self.in_call = False
                self._block(out, self.buf, len(self.buf), closed=False)
            self.buf, self.ws = "", ""
        return out


def reader(plan) -> ToolCallReader | None:
    """The reader of a ToolPlan's answers (None: the text is all content)."""
    if plan is None or plan.mode == "none":
        return None
    if plan.mode == "named":
        return NamedReader(plan.name)
    if plan.mode == "required":
        return RequiredReader()
    parsers = {"hermes": HermesReader}  # (TOOL_CALL_PARSERS)
    return parsers[plan.parser](None if plan.parallel else 1)

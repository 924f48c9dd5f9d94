"""A chat answer's content -> the assistant message's `content` and `tool_calls`, streamed.

Each tool plan (server/tools.py) reads the text as it arrives and gives OpenAI deltas: `content`
text and `tool_calls` entries (`{"index", "id", "type", "function": {"name", "arguments"}}`
when a call starts, then `{"index", "function": {"arguments"}}` for more of its arguments). A
whole response is the same reader fed the whole text at once (server/answer.py), so a streamed
answer and a whole one always agree (tests/unit/test_tool_calls.py checks every split of the text).

- named: every token is the named function's arguments (content stays empty);
- required: a JSON array of `{"name", "parameters"}` objects; each call is sent when its object
  is complete; text the array does not hold (an answer cut by max_tokens) is content (all of it,
  when no call completed);
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
from typing import Any

from draftsmith.server.text import stop_holdback

_START, _END = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallReader:
    """Base: `push(text)` and `finish(text)` -> a delta ({} when nothing can be said yet)."""

    finishes_with_calls = True  # finish_reason "tool_calls" where the answer made calls

    def __init__(self) -> None:
        self.calls = 0

    def tool_calls_finish(self, finish_reason: str | None) -> str | None:
        """The choice's finish_reason, "tool_calls" where calls ended the answer cleanly."""
        return "tool_calls" if self.finishes_with_calls and self.calls and finish_reason == "stop" else finish_reason

    def push(self, text: str) -> dict:
        raise NotImplementedError

    def finish(self, text: str) -> dict:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> dict:
        self.calls += 1
        return {"index": self.calls - 1, "id": _call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}


def _delta(content: str = "", calls: list[dict] | None = None) -> dict:
    d: dict[str, Any] = {}
    if content:
        d["content"] = content
    if calls:
        d["tool_calls"] = calls
    return d


class NamedReader(ToolCallReader):
    """tool_choice names a function: the whole answer is its arguments."""

    finishes_with_calls = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def push(self, text: str) -> dict:
        if self.calls == 0:
            text = text.lstrip()  # (whitespace a grammar lets before the JSON, e.g. after a model's reasoning)
            return _delta(calls=[self._call(self.name, text)]) if text else {}
        return _delta(calls=[{"index": 0, "function": {"arguments": text}}]) if text else {}

    def finish(self, text: str) -> dict:
        if self.calls == 0:  # an empty answer is still the one call, with no arguments written
            return _delta(calls=[self._call(self.name, text.lstrip())])
        return self.push(text)


class RequiredReader(ToolCallReader):
    """tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`, a call per object."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = ""
        self.pos = -1  # where the next element starts (-1: the array has not opened)
        self.closed = False
        self._decoder = json.JSONDecoder()

    def _calls(self) -> list[dict]:
        out = []
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
            except (ValueError, RecursionError):  # not complete yet (or not JSON: finish() keeps it as content)
                break
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
                break
            out.append(self._call(obj["name"], json.dumps(obj.get("parameters", {}), ensure_ascii=False)))
            self.pos = end
        return out

    def push(self, text: str) -> dict:
        self.buf += text
        return _delta(calls=self._calls())

    def finish(self, text: str) -> dict:
        self.buf += text
        calls = self._calls()
        rest = self.buf if self.calls == 0 else self.buf[self.pos:]
        return _delta(rest if rest.strip(" \t\n\r,]") else "", calls)


class HermesReader(ToolCallReader):
    """tool_choice "auto" with the hermes parser: `<tool_call>` blocks in free text."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__()
        self.max_calls = max_calls  # parallel_tool_calls: false -> 1 (later blocks stay text)
        self.buf = ""  # text not given out yet
        self.in_call = False
        self.ws = ""  # after a call: whitespace held until text follows it

    def _content(self, text: str) -> str:
        if not self.calls:
            return text
        self.ws += text
        body = self.ws.rstrip()
        self.ws = self.ws[len(body):]
        return body

    def _block(self, body: str, closed: bool) -> tuple[str, dict | None]:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            obj = None
        full = self.max_calls is not None and self.calls >= self.max_calls
        if full or not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return self._content(_START + body + (_END if closed else "")), None  # (after any held whitespace)
        self.ws = ""  # whitespace between calls
        args = obj.get("arguments")
        args = args if isinstance(args, str) else json.dumps({} if args is None else args, ensure_ascii=False)
        return "", self._call(obj["name"], args)

    def push(self, text: str) -> dict:
        self.buf += text
        content, calls = "", []
        while True:
            if self.in_call:
                j = self.buf.find(_END)
                if j < 0:
                    break
                body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(_END):], False
                more, call = self._block(body, True)
                content += more
                calls += [call] if call else []
                continue
            i = self.buf.find(_START)
            if i >= 0:
                content += self._content(self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(_START):], True
                continue
            keep = stop_holdback(self.buf, [_START])  # may still become <tool_call>
            content += self._content(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return _delta(content, calls)

    def finish(self, text: str) -> dict:
        d = self.push(text)
        content, calls = d.get("content", ""), list(d.get("tool_calls", []))
        if self.in_call:  # a block the answer did not close
            more, call = self._block(self.buf, False)
            content += more
            calls += [call] if call else []
        else:
            content += self._content(self.buf)
        self.buf, self.ws = "", ""
        return _delta(content, calls)


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

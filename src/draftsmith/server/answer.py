"""A chat answer's text -> the assistant message: `reasoning` (where the server has a reasoning
parser: server/reasoning.py), `content` and `tool_calls` (where the request has tools:
server/tool_calls.py). One reader gives the streamed deltas and, fed the whole text at once,
the whole message, so the two always agree; its parts in the answer's order (`read`,
server/answer_parts.py) are what a Response's items are built from. Reasoning goes out as `reasoning` and, for clients
of the older name, `reasoning_content` (vLLM's fields); calls are read from the content only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.server.answer_parts import Part, delta, moved, text_of
from draftsmith.server.reasoning import ReasoningReader
from draftsmith.server.tool_calls import ToolCallReader, reader
from draftsmith.server.tools import ToolPlan


@dataclass(frozen=True)
class AnswerFormat:
    """What one chat request's answers are read for. `reasoning`: the server reads reasoning;
    `thinking`: the prompt left a <think> block open; `include_reasoning`: vLLM's request field;
    `grammar_in_reasoning`: a grammar constrains the reasoning too (vLLM's enable_in_reasoning)."""

    tools: ToolPlan | None = None
    reasoning: bool = False
    thinking: bool = False
    include_reasoning: bool = True
    grammar_in_reasoning: bool = False  # serve --structured-outputs-in-reasoning

    def grammar_reasoning(self) -> str | None:
        """Where a grammar starts (StructuredOutputsParams.reasoning): after a <think> block the
        prompt opened ("open") or the answer may open ("optional"), as vLLM applies structured
        outputs after the reasoning; None: from the first token."""
        if not self.reasoning or self.grammar_in_reasoning:
            return None
        return "open" if self.thinking else "optional"

    def reader(self, always: bool = False) -> AnswerReader | None:
        """A fresh reader of one choice's text (None: the text is all content, unless `always`)."""
        tools = reader(self.tools)
        if tools is None and not self.reasoning and not always:
            return None
        return AnswerReader(ReasoningReader(self.thinking) if self.reasoning else None, tools, self.include_reasoning)

    def parts_reader(self) -> PartsReader:
        """A fresh reader of one choice's text whose deltas are its parts in order (PartsReader)."""
        return PartsReader(self.reader(always=True))


class AnswerReader:
    """`read(text, last)` -> the answer's parts in order (server/answer_parts.py), each with its
    end in the whole answer's text; `push(text)` / `finish(text)` -> an OpenAI delta ({} when
    nothing can be said yet)."""

    def __init__(self, reasoning: ReasoningReader | None, tools: ToolCallReader | None,
                 include_reasoning: bool = True) -> None:
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning
        self.thought = False  # the answer had reasoning (shown or not)
        self.pos = 0  # text read (where there is no reasoning reader)

    @property
    def thinks(self) -> bool:
        """The answer had a <think> block (opened by the prompt or by the answer), empty or not."""
        return self.reasoning is not None and self.reasoning.opened

    def read(self, text: str, last: bool = False) -> list[Part]:
        """The parts `text` completes (`last`: the answer ends with it); reasoning first (it
        opens the answer), then the content's, with the calls a tool reader finds in it."""
        if self.reasoning is not None:
            parts = self.reasoning.read(text, last)
            start = self.reasoning.content_start
            start = self.reasoning.pos if start is None else start
        else:
            self.pos += len(text)
            parts, start = [Part("content", text, self.pos)] if text else [], 0
        self.thought = self.thought or any(p.kind == "reasoning" and p.value for p in parts)
        if self.tools is None:
            return parts
        content = self.tools.read(text_of(parts, "content"), last)  # (offsets in the content's text)
        return [p for p in parts if p.kind == "reasoning"] + moved(content, start)

    def _delta(self, text: str, last: bool) -> dict:
        parts = self.read(text, last)
        out: dict[str, Any] = {}
        thought = text_of(parts, "reasoning")
        if thought and self.include_reasoning:
            out["reasoning"] = out["reasoning_content"] = thought
        out.update(delta(parts))
        return out

    def push(self, text: str) -> dict:
        return self._delta(text, last=False)

    def finish(self, text: str) -> dict:
        return self._delta(text, last=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" where calls ended the answer cleanly."""
        return engine_reason if self.tools is None else self.tools.tool_calls_finish(engine_reason)

    def message(self, text: str) -> dict:
        """The whole answer's message (`content` None where there are calls or reasoning and no text)."""
        d = self.finish(text)
        calls = [{k: v for k, v in c.items() if k != "index"} for c in d.get("tool_calls", [])]  # (a delta's)
        msg: dict[str, Any] = {"role": "assistant",
                               "content": d.get("content") or (None if calls or self.thought else "")}
        if self.reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = d.get("reasoning")
        if calls:
            msg["tool_calls"] = calls
        return msg


class PartsReader:
    """A chat answer's reader whose deltas are its parts in order, `{"parts": [...]}` (the last
    one with `thinks`: the answer had a think block): what a Response's items and a Message's
    content blocks are built from, streamed (server/streaming.py's chunks carry these deltas) or whole."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reader = reader

    def push(self, text: str) -> dict:
        parts = self.reader.read(text)
        return {"parts": parts} if parts else {}

    def finish(self, text: str) -> dict:
        return {"parts": self.reader.read(text, last=True), "thinks": self.reader.thinks}

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.reader.finish_reason(engine_reason)

"""A chat answer's text -> the assistant message: `reasoning` (where the server has a reasoning
parser: server/reasoning.py), `content` and `tool_calls` (where the request has tools:
server/tool_calls.py). One reader gives the streamed deltas and, fed the whole text at once,
the whole message, so the two always agree. Reasoning goes out as `reasoning` and, for clients
of the older name, `reasoning_content` (vLLM's fields); calls are read from the content only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

    def reader(self) -> AnswerReader | None:
        """A fresh reader of one choice's text (None: the text is all content)."""
        tools = reader(self.tools)
        if tools is None and not self.reasoning:
            return None
        return AnswerReader(ReasoningReader(self.thinking) if self.reasoning else None, tools, self.include_reasoning)


class AnswerReader:
    """`push(text)` / `finish(text)` -> an OpenAI delta ({} when nothing can be said yet)."""

    def __init__(self, reasoning: ReasoningReader | None, tools: ToolCallReader | None,
                 include_reasoning: bool = True) -> None:
        self.reasoning, self.tools, self.include_reasoning = reasoning, tools, include_reasoning
        self.thought = False  # the answer had reasoning (shown or not)

    def _delta(self, text: str, last: bool) -> dict:
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            thought, content = self.reasoning.finish(text) if last else self.reasoning.push(text)
            self.thought = self.thought or bool(thought)
            if thought and self.include_reasoning:
                delta["reasoning"] = delta["reasoning_content"] = thought
        if self.tools is not None:
            delta.update(self.tools.finish(content) if last else self.tools.push(content))
        elif content:
            delta["content"] = content
        return delta

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

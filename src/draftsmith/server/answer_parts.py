"""An answer read in order: its reasoning, content and tool calls as `Part`s, in the order the
answer writes them, each with where it ends in the text that was read. A chat delta merges a
read's parts (`delta`: all of its content in one string, its calls in one list); a Response keeps
their order (server/responses_output.py: text before, between and after calls are items of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal


@dataclass(frozen=True)
class Part:
    """`kind`: reasoning, content or call; `value`: the text, or a call's entry of a chat delta's
    `tool_calls` (`{"index", "id", "type", "function": {"name", "arguments"}}` where it begins,
    `{"index", "function": {"arguments"}}` for more of its arguments); `end`: the offset, in the
    text the reader was given, just past the text this part was read from (a reasoning's closing
    `</think>` and a call's tags included; whitespace a reader drops after a call not), the same
    however the text was split into pieces. A reasoning part may be empty: it only says where the
    reasoning ends (at `</think>`). `done`: the part's text closes what it belongs to (a reasoning's
    through `</think>`, a hermes call's through `</tool_call>`, a "required" call's object), so an
    answer cut right after it did not cut that item (content has no closing mark: never done)."""

    kind: Literal["reasoning", "content", "call"]
    value: Any
    end: int
    done: bool = False


def call_hex(call: dict) -> str:
    """The hex of a call's chat id (`chatcmpl-tool-<hex>`), which its ids in a Response
    (fc_<hex>, call_<hex>) and a Message (toolu_<hex>) are made of."""
    return call["id"].rsplit("-", 1)[-1]


def moved(parts: list[Part], by: int) -> list[Part]:
    """`parts` read from a text that starts `by` characters into the answer's."""
    return [replace(p, end=p.end + by) for p in parts] if by else parts


def text_of(parts: list[Part], kind: str) -> str:
    return "".join(p.value for p in parts if p.kind == kind)


def delta(parts: list[Part]) -> dict:
    """The content and calls of `parts` as a chat delta ({} for none)."""
    d: dict[str, Any] = {}
    content = text_of(parts, "content")
    if content:
        d["content"] = content
    calls = [p.value for p in parts if p.kind == "call"]
    if calls:
        d["tool_calls"] = calls
    return d

"""A Message's `content` blocks, built from an answer's parts (server/answer_parts.py) in the order
the answer writes them, with the stream events that build them; and its stop_reason. A whole
Message is the same builder given every part at once, so a stream adds up to the whole Message
as the `anthropic` package's accumulator adds it up.

- A `thinking` block per run of reasoning (the server's --reasoning-parser; `signature` ""), a
  `text` block per run of text (text before, between and after calls are blocks of their own), a
  `tool_use` block per call: id "toolu_<hex>" (<hex>: the chat call id's), its name, its `input`:
  the arguments' JSON object, read as the accumulator reads the streamed input_json_delta
  pieces (server/partial_json.py), so a call cut by max_tokens keeps what its arguments
  completed (`{"unit": "f", "da` -> {"unit": "f"}), whole or streamed alike. Arguments that are
  not the start of a JSON object (a model's malformed call) are input {} in the whole Message,
  where the accumulator raises (the stream's input_json_delta pieces are the model's text as is).
- Events, each block's in turn: content_block_start (the block, empty: "" text, input {}),
  content_block_delta (text_delta, thinking_delta, input_json_delta with the arguments' text as
  the model wrote it), content_block_stop, before the next block starts. An answer with no text,
  reasoning or call has no block (content []).
- stop_reason: "max_tokens" where the answer ran out of tokens; "stop_sequence" (with
  stop_sequence) where a stop string ended it; "tool_use" where it made calls; else "end_turn".
"""

from __future__ import annotations

from draftsmith.server.answer_parts import Part, call_hex
from draftsmith.server.partial_json import loads_partial

_DELTA = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessageContent:
    """One answer's content blocks (`blocks`, in order): `read` gives each piece of the answer as
    it comes (its parts) and returns the events that build the blocks; `end` closes the answer."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.open: int | None = None  # the open block (always the last one, until `end`)
        self.calls: dict[int, int] = {}  # a chat call's index -> its block's
        self.arguments: dict[int, str] = {}  # a tool_use block's arguments text so far

    def read(self, parts: list[Part]) -> list[dict]:
        out: list[dict] = []
        for p in parts:
            if p.kind == "call":
                out += self._call(p.value)
            elif p.value:  # (an empty part only says where its text ends)
                out += self._text("thinking" if p.kind == "reasoning" else "text", p.value)
        return out

    def end(self) -> list[dict]:
        """The last block's stop; every tool_use block's input read from its arguments."""
        for i, text in self.arguments.items():
            self.blocks[i]["input"] = _input(text)
        return self._close()

    def stop_reason(self, finish_reason: str | None, stop: int | str | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of an answer that ended with the chat `finish_reason` and
        the engine's stop reason `stop` (the stop string or token id that ended it)."""
        if finish_reason == "length":
            return "max_tokens", None
        if isinstance(stop, str):
            return "stop_sequence", stop
        if self.calls:
            return "tool_use", None
        return "end_turn", None

    def _start(self, block: dict) -> list[dict]:
        out = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return out + [{"type": "content_block_start", "index": self.open, "content_block": dict(block)}]

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if self.open is None or self.blocks[self.open]["type"] != kind:
            out += self._start({"type": "text", "text": ""} if kind == "text"
                               else {"type": "thinking", "thinking": "", "signature": ""})
        delta, field = _DELTA[kind]
        self.blocks[self.open][field] += text
        return out + [{"type": "content_block_delta", "index": self.open, "delta": {"type": delta, field: text}}]

    def _call(self, call: dict) -> list[dict]:
        out: list[dict] = []
        if "id" in call:  # a call begins
            out += self._start({"type": "tool_use", "id": f"toolu_{call_hex(call)}", "name": call["function"]["name"],
                                "input": {}})
            self.calls[call["index"]] = self.open
            self.arguments[self.open] = ""
        i = self.calls[call["index"]]
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self.arguments[i] += arguments
            out.append({"type": "content_block_delta", "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        return [{"type": "content_block_stop", "index": i}]


def _input(arguments: str) -> dict:
    """A tool_use block's input from its arguments' text, whole or cut ({} for no object)."""
    try:
        value = loads_partial(arguments)
    except (ValueError, RecursionError):  # (nesting deeper than the reader follows: no object either)
        return {}
    return value if isinstance(value, dict) else {}

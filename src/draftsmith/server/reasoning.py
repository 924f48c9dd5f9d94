"""A thinking model's answer split into `reasoning` and `content`, like vLLM's `--reasoning-parser`
for Qwen3 and DeepSeek-R1 (`<think> ... </think>` before the answer).

Where the reasoning starts is read from the prompt, so a streamed answer and a whole one always
agree: a prompt that ends in `<think>` (a template that starts the model's thinking, as
DeepSeek-R1's and Qwen3's thinking models' do; or a continued assistant message with an open
block) makes the answer reasoning from its first token until `</think>`; otherwise the answer is
reasoning only if it opens with `<think>` itself, else all content. A `<think>` that opens the
answer (after whitespace) is dropped either way. Text after `</think>` is content, as the model
wrote it. An answer that never closes its reasoning (cut by max_tokens) is all reasoning, with
both parsers (vLLM's qwen3 parser returns it as content).
"""

from __future__ import annotations

from draftsmith.server.answer_parts import Part, text_of
from draftsmith.server.text import stop_holdback

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # both write <think> ... </think>
_OPEN, _CLOSE = "<think>", "</think>"


def opens_thinking(prompt_tail: str) -> bool:
    """Whether the template's generation prompt opened a `<think>` block: the rendered prompt
    ends in one (a `<think>` a user wrote earlier in the prompt does not count)."""
    return prompt_tail.rstrip().endswith(_OPEN)


def leaves_open(message_text: str) -> bool:
    """Whether a message (an assistant's, continued with continue_final_message) leaves its last
    `<think>` block open."""
    i = message_text.rfind(_OPEN)
    return i >= 0 and message_text.find(_CLOSE, i) < 0


class ReasoningReader:
    """`read(text, last)` -> the parts (reasoning, content) that can be said now, each with its
    end in the answer's text; `push(text)` / `finish(text)` -> (reasoning, content) joined."""

    def __init__(self, thinking: bool) -> None:
        # start: whether the answer opens with <think> is not known yet (after it: reasoning, or
        # content where the prompt did not open the block)
        self.after_start = "reasoning" if thinking else "content"
        self.state = "start"
        self.buf = ""
        self.pos = 0  # where buf starts in the answer's text
        self.opened = False  # a <think> block was opened (by the prompt or the answer), empty or not
        self.content_start: int | None = None  # where the content starts in the answer's text

    def read(self, text: str, last: bool = False) -> list[Part]:
        """The parts `text` completes (`last`: the answer ends with it)."""
        self.buf += text
        out: list[Part] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(_OPEN):
                    self._take(out, "reasoning", 0, len(self.buf) - len(head) + len(_OPEN))
                    self.state = "reasoning"
                elif _OPEN.startswith(head) and not last:  # nothing yet, or the tag's start
                    break
                else:
                    self.state = self.after_start
            elif self.state == "reasoning":
                self.opened = True
                j = self.buf.find(_CLOSE)
                if j >= 0:  # (a part even where empty: the reasoning's text ends past </think>)
                    self._take(out, "reasoning", j, j + len(_CLOSE), closes=True)
                    self.state = "content"
                    continue
                keep = 0 if last else stop_holdback(self.buf, [_CLOSE])  # may still become </think>
                self._take(out, "reasoning", len(self.buf) - keep)
                break
            else:
                if self.content_start is None:
                    self.content_start = self.pos
                self._take(out, "content", len(self.buf))
                break
        return out

    def _take(self, out: list[Part], kind: str, n: int, used: int | None = None, closes: bool = False) -> None:
        """buf[:n] as a `kind` part (none where empty, unless it `closes` the reasoning: a part
        that says where it ends), read from buf[:used] (default: n)."""
        used = n if used is None else used
        self.pos += used
        if n or closes:
            out.append(Part(kind, self.buf[:n], self.pos, done=closes))
        self.buf = self.buf[used:]

    def push(self, text: str) -> tuple[str, str]:
        parts = self.read(text)
        return text_of(parts, "reasoning"), text_of(parts, "content")

    def finish(self, text: str) -> tuple[str, str]:
        parts = self.read(text, last=True)
        return text_of(parts, "reasoning"), text_of(parts, "content")

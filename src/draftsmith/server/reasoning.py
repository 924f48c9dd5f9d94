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
    """`push(text)` / `finish(text)` -> (reasoning, content) that can be said now."""

    def __init__(self, thinking: bool) -> None:
        # start: whether the answer opens with <think> is not known yet (after it: reasoning, or
        # content where the prompt did not open the block)
        self.after_start = "reasoning" if thinking else "content"
        self.state = "start"
        self.buf = ""

    def push(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(_OPEN):
                    self.buf, self.state = head[len(_OPEN):], "reasoning"
                elif _OPEN.startswith(head):  # nothing yet, or the tag's start
                    break
                else:
                    self.state = self.after_start
            elif self.state == "reasoning":
                j = self.buf.find(_CLOSE)
                if j >= 0:
                    reasoning += self.buf[:j]
                    self.buf, self.state = self.buf[j + len(_CLOSE):], "content"
                    continue
                keep = stop_holdback(self.buf, [_CLOSE])  # may still become </think>
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                content += self.buf
                self.buf = ""
                break
        return reasoning, content

    def finish(self, text: str) -> tuple[str, str]:
        reasoning, content = self.push(text)
        if self.state == "reasoning" or (self.state == "start" and self.after_start == "reasoning"):
            reasoning += self.buf
        else:
            content += self.buf
        self.buf = ""
        return reasoning, content

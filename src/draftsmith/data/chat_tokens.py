"""Templated token ids for regeneration: which turns get answered (`answer_slots`) and the
conversation's ids + loss mask built turn by turn exactly as the target saw them (`ChatTokens`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from draftsmith.errors import DraftsmithError

_SENTINEL = "\x1fDRAFTSMITH-ANSWER\x1f"


def answer_slots(messages: Sequence[Mapping[str, str]]) -> list[list[dict[str, str]]]:
    """Split a conversation into the blocks that each regenerated answer follows.

    Every user turn is answered (in order, after the previously regenerated answers);
    original assistant turns are dropped. A system message is kept in place: it joins the
    block of the next user turn (trailing system messages with no user turn after them are
    dropped).
    """
    blocks: list[list[dict[str, str]]] = []
    cur: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        cur.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            blocks.append(cur)
            cur = []
    return blocks


class ChatTokens:
    """A conversation's templated token ids and loss mask, built turn by turn.

        ct = ChatTokens(tokenizer)
        prompt = ct.open_turn(block)          # ids the target must continue
        ct.close_turn(generated_ids, stopped) # its answer, verbatim, mask 1

    Template text between answers is tokenized piecewise (text deltas between successive
    renderings), the generated ids are appended untouched, and the template's end-of-turn
    marker (e.g. "<|im_end|>\\n") follows: its first token is the generated stop token when
    the answer stopped (mask 1: the target produced it), else all of it is added with mask 0.
    """

    def __init__(self, tokenizer, eos_token_ids: Iterable[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError("the target's tokenizer has no chat template; regen needs one")
        self.tok = tokenizer
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.messages: list[dict[str, str]] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.turns: list[dict[str, Any]] = []
        self._text = ""  # rendering of self.messages that self.ids encode
        self._open: tuple[str, list[dict[str, str]]] | None = None

    def _render(self, messages: list[dict[str, str]], gen_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def open_turn(self, block: Sequence[Mapping[str, str]]) -> list[int]:
        """Append `block` (system/user messages) + the generation prompt; return the prompt ids."""
        block = [dict(m) for m in block]
        text_b = self._render(self.messages + block, gen_prompt=True)
        prev = self._text
        if not text_b.startswith(prev):
            prev = self._render(self.messages, gen_prompt=False)  # templates that trim content
            if not text_b.startswith(prev):
                raise DraftsmithError(
                    "the chat template renders earlier turns differently once a new turn is added, "
                    "so turn-by-turn token ids cannot be kept consistent for this conversation")
        delta = self._encode(text_b[len(prev):])
        self._before = (len(self.ids), self._text)
        self.ids += delta
        self.mask += [0] * len(delta)
        self._text = text_b
        self._open = (text_b, block)
        return list(self.ids)

    def cancel_turn(self) -> None:
        """Undo the last open_turn() (e.g. its prompt does not fit the context)."""
        if self._open is None:
            return
        n, text = self._before
        del self.ids[n:], self.mask[n:]
        self._text = text
        self._open = None

    def answer_text(self, generated: Sequence[int], stopped: bool) -> str:
        body = list(generated[:-1]) if stopped and generated and int(generated[-1]) in self.eos else list(generated)
        return self.tok.decode(body, skip_special_tokens=False)

    def close_turn(self, generated: Sequence[int], finish_reason: str, content: str | None = None) -> str:
        """Append the answer's ids (mask 1) and the end-of-turn marker; returns the answer text."""
        if self._open is None:
            raise RuntimeError("close_turn() without open_turn()")
        text_b, block = self._open
        prompt_tokens = len(self.ids)
        generated = [int(t) for t in generated]
        stopped = finish_reason == "stop"
        own_stop = stopped and bool(generated) and generated[-1] in self.eos
        if content is None:
            content = self.answer_text(generated, own_stop)
        # The end-of-turn marker, found by rendering a sentinel answer in this position.
        text_s = self._render(self.messages + block + [{"role": "assistant", "content": _SENTINEL}], False)
        at = text_s.find(_SENTINEL, len(text_b))
        if not text_s.startswith(text_b) or at != len(text_b):
            raise DraftsmithError("the chat template inserts text between the generation prompt and the "
                                  "answer; turn-by-turn token ids cannot be kept consistent")
        closing = self._encode(text_s[at + len(_SENTINEL):])
        if own_stop and closing and closing[0] == generated[-1]:
            closing = closing[1:]  # the target's own stop token is the template's end-of-turn token
        elif stopped and not own_stop and closing and closing[0] in self.eos:
            generated = generated + closing[:1]  # text-only backend: the server's target emitted it
            closing = closing[1:]
        self.ids += generated
        self.mask += [1] * len(generated)
        self.ids += closing
        self.mask += [0] * len(closing)
        self.messages += block + [{"role": "assistant", "content": content}]
        self._text = text_s.replace(_SENTINEL, content, 1)
        self.turns.append({"prompt_tokens": prompt_tokens, "generated_tokens": len(generated),
                           "finish_reason": finish_reason})
        self._open = None
        return content

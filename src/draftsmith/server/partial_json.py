"""JSON that may be cut short (a tool call's arguments cut by max_tokens), read the way the
`anthropic` package's stream accumulator reads a tool_use block's input_json_delta pieces (jiter's
partial mode): every value the text completes, with the objects and arrays it opened closed where
it ends; a string, number or literal that the cut leaves unfinished is dropped, with its key. A
number the text ends right after is kept (`{"a": 12` -> {"a": 12}: it may have gone on as 123).

`loads_partial(text)` raises ValueError where the text is not the start of a JSON value.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_LITERALS = (("true", True), ("false", False), ("null", None))
_CUT = object()  # a value the text ends inside of: dropped


def loads_partial(text: str) -> Any:
    """The JSON value `text` holds, or as much of it as `text` completes (see the module docstring)."""
    value, i, done = _value(text, _skip(text, 0))
    if value is _CUT:
        raise ValueError("the text ends before its first value is complete")
    if done and _skip(text, i) != len(text):
        raise ValueError(f"extra characters after the value at {i}")
    return value


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value(s: str, i: int) -> tuple[Any, int, bool]:
    """The value starting at `i`: (the value or _CUT, where it ends, the text completed it)."""
    if i >= len(s):
        return _CUT, i, False
    c = s[i]
    if c == "{":
        return _container(s, i, {})
    if c == "[":
        return _container(s, i, [])
    if c == '"':
        return _string(s, i)
    if c == "-" or c.isdigit():
        j = _NUMBER_CHARS.match(s, i).end()
        token = s[i:j]
        if _NUMBER.fullmatch(token):
            return json.loads(token), j, j < len(s)
        if j == len(s):  # ("1.", "-", "1e": unfinished)
            return _CUT, j, False
        raise ValueError(f"not a number at {i}: {token!r}")
    for word, value in _LITERALS:
        if s.startswith(word, i):
            return value, i + len(word), True
        if word.startswith(s[i:]):  # (the text ends inside it)
            return _CUT, len(s), False
    raise ValueError(f"unexpected {c!r} at {i}")


def _string(s: str, i: int) -> tuple[Any, int, bool]:
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return json.loads(s[i:j + 1]), j + 1, True
        else:
            j += 1
    return _CUT, len(s), False


def _container(s: str, i: int, out: dict | list) -> tuple[Any, int, bool]:
    """An object or array from its opening bracket at `i`, filled into `out`."""
    close = "}" if isinstance(out, dict) else "]"
    i = _skip(s, i + 1)
    if i < len(s) and s[i] == close:
        return out, i + 1, True
    while True:
        if i >= len(s):
            return out, i, False
        if isinstance(out, dict):
            if s[i] != '"':
                raise ValueError(f"expected a key at {i}")
            key, i, done = _string(s, i)
            if not done:
                return out, i, False
            i = _skip(s, i)
            if i >= len(s):
                return out, i, False
            if s[i] != ":":
                raise ValueError(f"expected ':' at {i}")
            value, i, done = _value(s, _skip(s, i + 1))
            if value is not _CUT:
                out[key] = value
        else:
            value, i, done = _value(s, i)
            if value is not _CUT:
                out.append(value)
        if not done:
            return out, i, False
        i = _skip(s, i)
        if i >= len(s):
            return out, i, False
        if s[i] == close:
            return out, i + 1, True
        if s[i] != ",":
            raise ValueError(f"expected ',' or {close!r} at {i}")
        i = _skip(s, i + 1)

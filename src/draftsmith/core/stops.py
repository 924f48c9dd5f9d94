"""Stop strings: where in a decoded text an output ends."""

from __future__ import annotations

from typing import Sequence


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> tuple[int, int] | None:
    """(start, end) of the earliest occurrence of any stop string in `text` that ends past
    character `after` (the text of the tokens before min_tokens; 0: anywhere), the first listed
    where several start at one place; None if there is none."""
    best = None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


def stop_cut(text: str, stops: Sequence[str], include: bool = False, after: int = 0) -> int | None:
    """Where the visible text ends: before the first stop string (see find_stop), or after it
    with `include` (vLLM's include_stop_str_in_output); None when no stop string counts."""
    hit = find_stop(text, stops, after) if stops else None
    return None if hit is None else hit[1 if include else 0]

"""Stop strings: where in a decoded text an output ends."""

from __future__ import annotations

from typing import Sequence


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, end) of the earliest occurrence of any stop string in `text` (the first listed
    where several start at one place), or None."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


def stop_cut(text: str, stops: Sequence[str], include: bool = False) -> int | None:
    """Where the visible text ends: before the first stop string, or after it with `include`
    (vLLM's include_stop_str_in_output); None when no stop string occurs."""
    hit = find_stop(text, stops) if stops else None
    return None if hit is None else hit[1 if include else 0]

"""The fixed catalogue of source names, aliases, and prompt-file paths.

An explicit, immutable table (no import-time discovery): adding a source is one line here.
An alias names several sources that are read together; the split filter applies to each
member, so `code` with split="train" is HumanEval's train part plus stdlib-code's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from types import MappingProxyType
from typing import Final

from draftsmith.data.sources.base import Source
from draftsmith.data.sources.conversation import Conversation, Split
from draftsmith.data.sources.files import FILE_SUFFIXES, JsonlSource, OnError, ParquetSource, check_prompt_file
from draftsmith.data.sources.packaged import HumanEvalSource, MTBenchSource, ShareGPTSource
from draftsmith.data.sources.stdlib_code import StdlibCodeSource
from draftsmith.errors import DraftsmithError

BUILTIN_SOURCES: Final[Mapping[str, Callable[[], Source]]] = MappingProxyType({
    "humaneval": HumanEvalSource,
    "mtbench": MTBenchSource,
    "sharegpt": ShareGPTSource,
    "stdlib-code": StdlibCodeSource,
})
ALIASES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({
    "code": ("humaneval", "stdlib-code"),
    "chat": ("mtbench", "sharegpt"),
})


def source_names() -> tuple[str, ...]:
    """Every name `resolve_source` accepts besides file paths, sources first."""
    return (*BUILTIN_SOURCES, *ALIASES)


def is_prompt_file(name: str) -> bool:
    return name.lower().endswith(FILE_SUFFIXES)


def resolve_source(name: str, *, on_error: OnError = "raise") -> tuple[Source, ...]:
    """The source(s) a name stands for: one built-in, an alias's members, or a prompt file.

    `on_error` applies to prompt files only (built-in data is trusted and never skipped).
    """
    name = name.strip()
    if name in BUILTIN_SOURCES:
        return (BUILTIN_SOURCES[name](),)
    if name in ALIASES:
        return tuple(BUILTIN_SOURCES[member]() for member in ALIASES[name])
    if is_prompt_file(name):
        path = Path(name).expanduser()
        check_prompt_file(path, name)
        kind = JsonlSource if name.lower().endswith(".jsonl") else ParquetSource
        return (kind(path, on_error=on_error),)
    raise DraftsmithError(f"unknown prompt source {name!r}; use one of "
                          f"{', '.join(source_names())} or a path ending in "
                          f"{' or '.join(FILE_SUFFIXES)}")


def source_key(source: Source) -> str:
    """What makes two resolved sources the same data (to refuse mixing a source twice)."""
    path = getattr(source, "path", None)
    return f"file:{Path(path).resolve()}" if path is not None else source.name


def iter_conversations(name: str, split: Split | None = None, *,
                       on_error: OnError = "raise") -> Iterator[Conversation]:
    """All conversations of a name in order (an alias yields its members one after another)."""
    return chain.from_iterable(s.conversations(split) for s in resolve_source(name, on_error=on_error))

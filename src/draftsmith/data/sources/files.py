"""User prompt files: JSONL (one object per line) and Parquet (one row per prompt).

Each record has either `messages` (OpenAI chat: [{"role", "content"}, ...]) or `prompt` (a
string, becoming one user turn), and optionally `id`. Without an id, the id is a hash of the
messages, so it survives reordering and editing other lines. Ids become
"file:<file name>/<id>"; the split uses the fallback held-out fraction unless told otherwise.

A bad record raises `DraftsmithError` naming file and line (row, for Parquet). With
`on_error="skip"` it is logged, appended to the caller's `skipped` list if one is given, and
counted in one warning at the end of the pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from draftsmith.data.sources.conversation import (
    FALLBACK_HELDOUT_FRACTION,
    Conversation,
    Split,
    in_split,
    make_conversation,
    normalize_messages,
)
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
FILE_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class BadRecord:
    """One rejected record: where it was and why."""

    path: str
    line: int  # 1-based line (JSONL) or row (Parquet)
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def record_messages(record: Any) -> tuple[str | None, tuple[dict[str, str], ...]]:
    """(explicit id or None, messages) for one record; ValueError says what is wrong."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    messages, prompt = record.get("messages"), record.get("prompt")
    if (messages is None) == (prompt is None):
        raise ValueError("needs exactly one of 'messages' (chat list) or 'prompt' (string)")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("'prompt' must be a non-empty string")
        messages = ({"role": "user", "content": prompt},)
    raw_id = record.get("id")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))
                               or str(raw_id) == ""):
        raise ValueError(f"'id' must be a non-empty string or integer, got {raw_id!r}")
    return (None if raw_id is None else str(raw_id)), normalize_messages(messages)


def content_id(messages: tuple[dict[str, str], ...]) -> str:
    """A stable id for records without one: 16 hex digits of sha256 over the messages."""
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def check_prompt_file(path: Path, name: str | Path | None = None) -> None:
    """A prompt file that is not there, or a directory named like one, said as what it is."""
    name = path if name is None else name
    if path.is_dir():
        raise DraftsmithError(f"prompt file {name} is a directory; give a .jsonl or .parquet file")
    if not path.is_file():
        raise DraftsmithError(f"prompt file not found: {name}")


@dataclass(frozen=True)
class _FileSource:
    """Shared reading logic; subclasses only say how to get (line number, record) pairs."""

    path: Path
    on_error: OnError = "raise"
    heldout_fraction: float = FALLBACK_HELDOUT_FRACTION
    skipped: list[BadRecord] | None = field(default=None, compare=False, repr=False)

    unit = "line"  # what a record is in the file, for errors

    @property
    def name(self) -> str:
        return f"file:{Path(self.path).name}"

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        if self.on_error not in ("raise", "skip"):
            raise DraftsmithError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        check_prompt_file(Path(self.path))
        return in_split(self._all(), split)

    def _records(self) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def _all(self) -> Iterator[Conversation]:
        first_line: dict[str, int] = {}
        bad = 0
        for line, record in self._records():
            try:
                if isinstance(record, BadRecord):
                    raise ValueError(record.reason)
                explicit_id, messages = record_messages(record)
                local_id = explicit_id or content_id(messages)
                if local_id in first_line:
                    raise ValueError(f"duplicate id {local_id!r} (first on line "
                                     f"{first_line[local_id]})")
                first_line[local_id] = line
                conversation = make_conversation(self.name, local_id, self.name, messages,
                                                 self.heldout_fraction)
            except (ValueError, DraftsmithError) as err:
                problem = BadRecord(str(self.path), line, str(err))
                if self.on_error == "raise":  # (the Python API's on_error="skip" drops bad records)
                    raise DraftsmithError(f"{problem}; fix or remove that {self.unit} and run "
                                          "again") from err
                bad += 1
                log.debug("skipping %s", problem)
                if self.skipped is not None:
                    self.skipped.append(problem)
                continue
            yield conversation
        if bad:
            log.warning("%s: skipped %d bad record(s)", self.path, bad)


@dataclass(frozen=True)
class JsonlSource(_FileSource):
    """A `.jsonl` prompt file; blank lines are ignored."""

    def _records(self) -> Iterator[tuple[int, Any]]:
        with open(self.path, "rb") as lines:
            for number, raw in enumerate(lines, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield number, BadRecord(str(self.path), number, f"not UTF-8 ({err.reason})")
                    continue
                if not text.strip():
                    continue
                try:
                    yield number, json.loads(text)
                except json.JSONDecodeError as err:
                    yield number, BadRecord(str(self.path), number,
                                            f"invalid JSON: {err.msg} at column {err.colno}")
                except RecursionError:
                    yield number, BadRecord(str(self.path), number, "JSON nested too deeply to read "
                                            "(a prompt record is an object of messages)")


@dataclass(frozen=True)
class ParquetSource(_FileSource):
    """A `.parquet` prompt file with a `messages` (list<struct<role, content>>) or `prompt`
    (string) column and an optional `id` column; read in batches, never all at once."""

    batch_rows: int = 1024
    unit = "row"

    def _records(self) -> Iterator[tuple[int, Any]]:
        import pyarrow as pa  # imported here: only Parquet users pay for it
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(self.path)
        except (pa.ArrowException, OSError) as err:
            raise DraftsmithError(f"{self.path}: not a readable Parquet file ({err})") from err
        present = set(parquet.schema_arrow.names)
        if not present & {"messages", "prompt"}:
            raise DraftsmithError(f"{self.path}: needs a 'messages' or 'prompt' column; found "
                                  f"{sorted(present)}")
        columns = [c for c in ("id", "messages", "prompt") if c in present]
        row = 0
        for batch in parquet.iter_batches(batch_size=self.batch_rows, columns=columns):
            for record in batch.to_pylist():
                row += 1
                yield row, record

"""Regen records on disk (JSONL, one conversation per line; fields in `draftsmith.data.regen`):
building a record (`make_record`), appending it durably (`JsonlAppender`), reading the output
back (`scan_output` / `load_records` for resume, `iter_records` streamed for cache and training,
`read_ids` for --exclude) and the errors file beside it (`errors_path`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from draftsmith.data.chat_tokens import ChatTokens
from draftsmith.data.regen_config import RegenSampling
from draftsmith.errors import DraftsmithError

REGEN_FORMAT_VERSION = 1


def make_record(conv, ct: ChatTokens, target_info: Mapping[str, Any], sampling: RegenSampling,
                dropped_user_turns: int = 0) -> dict:
    return {
        "id": conv.id, "source": conv.source, "split": conv.split,
        "messages": ct.messages, "input_ids": ct.ids, "loss_mask": ct.mask, "turns": ct.turns,
        "dropped_user_turns": dropped_user_turns, "num_tokens": len(ct.ids),
        "target": dict(target_info), "sampling": sampling.to_dict(),
        "format_version": REGEN_FORMAT_VERSION,
    }


# ---- writing --------------------------------------------------------------------------


def errors_path(out: Path) -> Path:
    return out.with_name(out.name + ".errors.jsonl")


class JsonlAppender:
    """Append-only JSONL: one write per record, then flush + fsync (a kill loses nothing written)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        self._f.write(line)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


# ---- reading --------------------------------------------------------------------------


def scan_output(path: Path, repair: bool = True) -> tuple[dict[str, dict], int]:
    """Read a regen output for --resume: {id: record}, and bytes of a dropped partial last line.

    Only the last line may be incomplete (append + fsync per record); it is cut off (the file
    is truncated to the last complete record) so the sample is regenerated. A damaged line
    elsewhere means the file was edited or is not a regen output: a clear error.
    """
    done: dict[str, dict] = {}
    path = Path(path)
    if not path.is_file():
        return done, 0
    data = path.read_bytes()
    good_end = 0
    pos = 0
    n = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        n += 1
        line = data[pos:] if nl < 0 else data[pos:nl]
        end = len(data) if nl < 0 else nl + 1
        rec = None
        if line.strip():
            try:
                rec = _loads(line)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
                rec = None
            last = data[end:].strip() == b""
            if rec is None or nl < 0 or not isinstance(rec, dict) or "id" not in rec:
                # A killed run's last write is cut before its newline (a record is one write that
                # ends in it): only such a line is dropped. A whole line that is no record (a
                # prompt file given as --out) is someone's data, never cut away.
                if last and nl < 0 and (rec is None or (isinstance(rec, dict) and "id" in rec)):
                    break  # a truncated final record: drop it
                if last:
                    raise DraftsmithError(f"{path}:{n} is not a regen record (a JSON object with an 'id'); is "
                                          "--out a file `draftsmith regen` wrote? Give a new --out, or fix or "
                                          "remove that line, then --resume")
                raise DraftsmithError(f"{path}:{n} is not a complete regen record and is not the last line; "
                                      "the file is damaged (fix or remove that line, then --resume)")
            done[str(rec["id"])] = rec
        good_end = end
        pos = end
    dropped = len(data) - good_end
    if dropped and repair:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done, dropped


def load_records(path: Path) -> list[dict]:
    """All complete records of a regen output (a truncated last line is ignored)."""
    done, _ = scan_output(path, repair=False)
    return list(done.values())


def iter_records(path: Path) -> Iterator[dict]:
    """Stream regen records; a truncated last line (a killed regen) is skipped with a warning."""
    path = Path(path)
    if path.is_dir():
        raise DraftsmithError(f"regen data {path} is a directory; give the JSONL file `draftsmith regen` wrote")
    if not path.is_file():
        raise DraftsmithError(f"regen data {path} does not exist; run `draftsmith regen` first")
    with open(path, "rb") as f:
        prev: tuple[int, bytes] | None = None
        for n, line in enumerate(f, 1):
            if prev is not None:
                yield _parse_record(path, *prev)
            prev = (n, line)
        if prev is not None:
            n, line = prev
            if not line.endswith(b"\n"):
                try:
                    rec = _loads(line)
                except (ValueError, RecursionError):  # not JSON, or cut inside a UTF-8 character
                    print(f"[draftsmith] warning: {path}:{n} is an incomplete last line (a killed run?); "
                          "skipped", file=sys.stderr)
                    return
                yield rec
            elif line.strip():
                yield _parse_record(path, n, line)


def _loads(line: bytes) -> Any:
    """One JSON line read as UTF-8 (json.loads of bytes guesses UTF-16 / UTF-32 from the first
    bytes, and its UnicodeDecodeError is no JSONDecodeError); ValueError when it is neither."""
    return json.loads(line.decode("utf-8-sig"))


def _parse_record(path: Path, n: int, line: bytes) -> dict:
    try:
        rec = _loads(line)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{path}:{n}: not valid JSON ({e.msg}); the regen file is damaged") from None
    except UnicodeDecodeError:
        raise DraftsmithError(f"{path}:{n}: not UTF-8 text; give the JSONL file `draftsmith regen` wrote") from None
    except RecursionError:
        raise DraftsmithError(f"{path}:{n}: JSON nested too deeply to read; a regen record is a flat object "
                              "(give the JSONL file `draftsmith regen` wrote)") from None
    if not isinstance(rec, dict) or "id" not in rec:
        raise DraftsmithError(f"{path}:{n}: expected a regen record object with an 'id'")
    return rec


def missing_exclude(path: Path) -> DraftsmithError:
    return DraftsmithError(f"--exclude {path}: no such file; give a regen JSONL or a text file with one "
                           "conversation id a line")


def read_ids(path: Path) -> set[str]:
    """Conversation ids to leave out of a run (`regen --exclude`), streamed: a regen JSONL's record
    ids, its last line read as --resume reads it (without its newline it is redone, so not an id
    here), or a text file with one id a line (blank lines skipped). A file whose first non-blank
    bytes are '{' is a JSONL."""
    path = Path(path)
    if not path.is_file():
        raise missing_exclude(path)
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    ids: set[str] = set()
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if head.startswith(b"{"):
                if not line.endswith(b"\n"):  # the last line: a killed run's, or one --resume redoes
                    break
                try:
                    ids.add(str(_parse_record(path, n, line)["id"]))
                except DraftsmithError as e:
                    raise DraftsmithError(f"--exclude {path} is not a readable regen JSONL ({e}); give the JSONL "
                                          "`draftsmith regen` wrote or a text file with one id a line") from None
                continue
            try:
                ids.add(line.decode("utf-8-sig" if n == 1 else "utf-8").strip())
            except UnicodeDecodeError:
                raise DraftsmithError(f"--exclude {path}:{n}: not UTF-8 text; give a regen JSONL or a text file "
                                      "with one conversation id a line") from None
    return ids


def record_split(rec: Mapping[str, Any]) -> str:
    """A record's split ("train" when it has none)."""
    return str(rec.get("split") or "train")

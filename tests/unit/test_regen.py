"""Regeneration: templated ids + loss mask, sampling defaults, resume scan, both backends.

The engine tests use a tiny random checkpoint (`tiny_model_dir`); the token-layout tests also
use the default target's real tokenizer (tokenizer only, no weights). The endpoint backend is
exercised against a loopback HTTP server written here (ok / flaky / failing / slow / 400).
"""

from __future__ import annotations

from dataclasses import replace

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from draftsmith.data.regen import (
    ChatTokens,
    RegenConfig,
    answer_slots,
    errors_path,
    load_records,
    recommended_sampling,
    resolve_sampling,
    run_regen,
    scan_output,
    turn_seed,
)
from draftsmith.data.sources.conversation import Conversation
from draftsmith.errors import DraftsmithError
from fake_http import JsonHandler, serve  # (tests/unit helper)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The CI machine has 2 cores shared with other jobs; OpenMP spinning on both makes tiny
    # models ~20x slower there. Restore the setting for other test modules.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", seed=3)


def _conv(i: int, turns: int = 2, system: str | None = None, content: str | None = None) -> Conversation:
    msgs = [{"role": "system", "content": system}] if system else []
    for t in range(turns):
        msgs.append({"role": "user", "content": content or f"question {i}.{t}: what is {i} + {t}?"})
        msgs.append({"role": "assistant", "content": f"reference answer {t}"})
    return Conversation(id=f"t/{i}", source="test", split="train", messages=msgs)


# ---- templated ids and loss mask ------------------------------------------------------


def _build(tok, eos, messages, answers):
    """Run ChatTokens over `messages` with scripted answers [(ids, finish_reason)]."""
    ct = ChatTokens(tok, eos)
    prompts = []
    for block, (ids, finish) in zip(answer_slots(messages), answers):
        prompts.append(ct.open_turn(block))
        ct.close_turn(ids, finish)
    return ct, prompts


@pytest.mark.parametrize("which", ["default-target", "tiny"])
def test_mask_covers_exactly_the_generated_tokens(which, default_target_dir, tiny):
    from draftsmith.models.loading import load_tokenizer

    tok = load_tokenizer(default_target_dir if which == "default-target" else tiny)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    eot = next(iter(eos))
    system = [{"role": "system", "content": "Be brief."}] if which == "tiny" else []
    messages = system + [
        {"role": "user", "content": "Write hello world in Python."},
        {"role": "assistant", "content": "original answer, replaced"},
        {"role": "user", "content": "And in C?"},
    ]
    a1 = tok("```python\nprint('hello world')\n```", add_special_tokens=False)["input_ids"] + [eot]  # stopped
    a2 = tok("#include <stdio.h>\nint main", add_special_tokens=False)["input_ids"]  # hit max tokens
    ct, prompts = _build(tok, eos, messages, [(a1, "stop"), (a2, "length")])

    ids, mask = ct.ids, ct.mask
    assert len(ids) == len(mask)
    # 1. the masked tokens are exactly the generated ones, in order (stop token included)
    assert [t for t, m in zip(ids, mask) if m] == a1 + a2
    # 2. every prompt the target saw is a prefix of input_ids and is what the chat template
    #    gives for the history so far (the same call LLM.apply_chat_template makes)
    history = ct.messages
    for k, prompt in enumerate(prompts):
        assert ids[: len(prompt)] == prompt
        upto = history[: [i for i, m in enumerate(history) if m["role"] == "user"][k] + 1]
        want = tok.apply_chat_template(upto, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert prompt == want
    # 3. the whole sequence is the template of the regenerated conversation
    full = tok(tok.apply_chat_template(history, tokenize=False), add_special_tokens=False)["input_ids"]
    assert ids == full
    # 4. mask spans decode to the answers (+ end-of-turn token for the one that stopped)
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assert [tok.decode(s) for s in spans] == [
        history[-3]["content"] + "<|im_end|>", history[-1]["content"]]
    assert [m["role"] for m in history if m["role"] != "system"] == ["user", "assistant"] * 2
    assert ct.turns[0]["finish_reason"] == "stop" and ct.turns[1]["generated_tokens"] == len(a2)


def test_text_backend_gets_end_of_turn_token(tiny):
    """Endpoint answers are text: ids are its encoding, plus the end-of-turn token if it stopped."""
    from draftsmith.models.loading import load_tokenizer

    tok = load_tokenizer(tiny)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ct = ChatTokens(tok, {eot})
    ct.open_turn([{"role": "user", "content": "hi"}])
    enc = tok("hello", add_special_tokens=False)["input_ids"]
    ct.close_turn(enc, "stop", content="hello")
    assert [t for t, m in zip(ct.ids, ct.mask) if m] == enc + [eot]
    assert ct.ids == tok(tok.apply_chat_template(ct.messages, tokenize=False), add_special_tokens=False)["input_ids"]


def test_answer_slots_every_user_turn_answered():
    msgs = [
        {"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
        {"role": "user", "content": "u3"}, {"role": "assistant", "content": "a3"},
    ]
    assert answer_slots(msgs) == [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}],
        [{"role": "user", "content": "u2"}], [{"role": "user", "content": "u3"}],
    ]


def test_sampling_defaults(tmp_path):
    assert recommended_sampling(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "origin": "fallback"}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    s = resolve_sampling(tmp_path, None, None, None, 64, 1)
    assert (s.temperature, s.top_p, s.top_k, s.origin) == (0.6, 0.95, 20, "generation_config")
    s = resolve_sampling(tmp_path, 0.0, 1.0, None, 64, 1)
    assert (s.temperature, s.top_p, s.top_k) == (0.0, 1.0, 20) and s.origin.startswith("cli")
    with pytest.raises(DraftsmithError):
        resolve_sampling(tmp_path, -1.0, None, None, 64, 1)
    assert turn_seed(0, "a", 0) == turn_seed(0, "a", 0)
    assert len({turn_seed(0, "a", 0), turn_seed(0, "a", 1), turn_seed(0, "b", 0), turn_seed(1, "a", 0)}) == 4


def test_scan_output_drops_only_a_truncated_last_line(tmp_path):
    out = tmp_path / "r.jsonl"
    good = [json.dumps({"id": f"x{i}", "v": i}) + "\n" for i in range(3)]
    out.write_text("".join(good) + '{"id": "x3", "v"')
    done, dropped = scan_output(out)
    assert sorted(done) == ["x0", "x1", "x2"] and dropped == len('{"id": "x3", "v"')
    assert out.read_text() == "".join(good)  # repaired in place
    out.write_text(good[0] + "garbage\n" + good[1])
    with pytest.raises(DraftsmithError, match=r"r\.jsonl:2"):
        scan_output(out)


# ---- built-in engine backend ----------------------------------------------------------


def _cfg(tiny: Path, out: Path, **kw) -> RegenConfig:
    base = dict(target=str(tiny), out=out, max_new_tokens=6, max_len=256, batch_size=3, overwrite=True)
    base.update(kw)
    return RegenConfig(**base)


def test_engine_backend_turn_by_turn_and_batch_independent(tiny, tmp_path):
    from draftsmith.data.regen_backends import EngineBackend

    convs = [_conv(i, turns=1 + i % 3) for i in range(5)]
    cfg = _cfg(tiny, tmp_path / "a.jsonl")
    be = EngineBackend(cfg)
    be.prompt_log = []
    s = run_regen(cfg, conversations=convs, backend=be)
    assert (s.written, s.errors) == (5, 0)
    assert not errors_path(cfg.out).exists()  # a run without failures leaves no empty errors file
    recs = {r["id"]: r for r in load_records(cfg.out)}
    assert set(recs) == {c.id for c in convs}
    for c in convs:
        r = recs[c.id]
        n_user = len(c.user_turns())
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"] * n_user
        assert [m["content"] for m in r["messages"][::2]] == list(c.user_turns())
        assert all(m["content"] != f"reference answer {t}" for t, m in enumerate(r["messages"][1::2]))
        assert len(r["turns"]) == n_user and sum(r["loss_mask"]) >= sum(t["generated_tokens"] for t in r["turns"])
        assert r["target"]["weights_hash"] and r["format_version"] == 1
        assert r["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 0, "max_new_tokens": 6, "seed": 0,
                                 "origin": "fallback"}
        # each turn's prompt, as submitted to the engine, is a prefix of the final ids
        prompts = [p for cid, _, p in be.prompt_log if cid == c.id]
        assert len(prompts) == n_user
        for p, t in zip(prompts, r["turns"]):
            assert r["input_ids"][: len(p)] == p and t["prompt_tokens"] == len(p)
            assert all(m == 0 for m in r["loss_mask"][: len(p)][-3:])  # generation prompt is not trained on
    # Prefix caching (on by default in regen): a later turn starts in the row that holds its conversation
    prompt_lens = [t["prompt_tokens"] for r in recs.values() for t in r["turns"]]
    assert s.prompt_tokens == sum(prompt_lens)
    earlier = sum(t["prompt_tokens"] for r in recs.values() for t in r["turns"][:-1])  # each later turn reuses at least these
    assert earlier > 0 and earlier <= s.cached_prompt_tokens < s.prompt_tokens
    off = run_regen(replace(cfg, out=tmp_path / "off.jsonl", enable_prefix_caching=False), conversations=convs)
    assert off.cached_prompt_tokens == 0 and off.prompt_tokens == s.prompt_tokens
    # Per-answer seeds: a different batch size gives the same conversations.
    cfg1 = _cfg(tiny, tmp_path / "b.jsonl", batch_size=1)
    run_regen(cfg1, conversations=list(reversed(convs)))
    assert {r["id"]: r for r in load_records(cfg1.out)} == recs


def test_progress_rate_counts_answered_turns(tiny, tmp_path, monkeypatch):
    """The bar's tok/s counts every answered turn as it ends, not only finished conversations
    (with 64 long conversations in flight the first finish late: the old rate read 7 tok/s on a
    machine generating several times that)."""
    from draftsmith.data.regen import RegenSink, RegenSummary

    class Bar:
        postfix = ""

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def update(self, n):
            pass

    sink = RegenSink(tmp_path / "o.jsonl", tmp_path / "e.jsonl", Bar(), RegenSummary())
    sink.t0 = sink._drawn = sink.t0 - 4.0  # as if 4 s had passed
    sink.answered(100)  # a turn ends; no conversation has finished
    assert sink.summary.generated_tokens == 0 and 24.0 < float(sink.bar.postfix.split()[0]) <= 25.0
    sink.close()
    calls: list[int] = []
    real = RegenSink.answered
    monkeypatch.setattr(RegenSink, "answered", lambda self, n: (calls.append(n), real(self, n))[1])
    convs = [_conv(i, turns=1 + i % 3) for i in range(4)]
    s = run_regen(_cfg(tiny, tmp_path / "a.jsonl"), conversations=convs)
    assert len(calls) == sum(len(c.user_turns()) for c in convs) and sum(calls) == s.generated_tokens


def test_prompt_too_long_goes_to_errors_file(tiny, tmp_path):
    long = _conv(0, turns=1, content="x" * 400)  # byte tokenizer: > 400 tokens > --max-len
    second_too_long = Conversation(id="t/late", source="test", split="train", messages=[
        {"role": "user", "content": "short"}, {"role": "user", "content": "y" * 230}])
    ok = _conv(1, turns=1)
    cfg = _cfg(tiny, tmp_path / "r.jsonl", max_len=200)
    s = run_regen(cfg, conversations=[long, second_too_long, ok])
    assert (s.written, s.errors) == (2, 1)
    errs = [json.loads(x) for x in errors_path(cfg.out).read_text().splitlines()]
    assert [e["id"] for e in errs] == ["t/0"] and "context limit" in errs[0]["reason"]
    recs = {r["id"]: r for r in load_records(cfg.out)}
    assert recs["t/late"]["dropped_user_turns"] == 1 and len(recs["t/late"]["turns"]) == 1


def test_resume_guards(tiny, tmp_path):
    convs = [_conv(0, turns=1), _conv(1, turns=1)]
    cfg = _cfg(tiny, tmp_path / "r.jsonl")
    run_regen(cfg, conversations=convs[:1])
    with pytest.raises(DraftsmithError, match="--resume"):
        run_regen(_cfg(tiny, cfg.out, overwrite=False), conversations=convs)
    with pytest.raises(DraftsmithError, match="cannot resume.*sampl"):
        run_regen(_cfg(tiny, cfg.out, overwrite=False, resume=True, temperature=0.2), conversations=convs)
    s = run_regen(_cfg(tiny, cfg.out, overwrite=False, resume=True), conversations=convs)
    assert (s.skipped_done, s.written) == (1, 1) and [r["id"] for r in load_records(cfg.out)] == ["t/0", "t/1"]


# ---- OpenAI-compatible endpoint backend -----------------------------------------------


class _FakeOpenAI(JsonHandler):
    """Modes by path prefix: /ok, /flaky (500 on every first try), /broken (always 503),
    /slow (answers only once the test is over: past any client timeout), /bad (400)."""

    state: dict = {}

    def do_GET(self):  # /v1/models
        self._send(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def do_POST(self):
        req = self.read_json()
        mode = self.path.strip("/").split("/")[0]
        st = self.state
        with st["lock"]:
            st["requests"].append((mode, req))
            st["inflight"] += 1
            st["max_inflight"] = max(st["max_inflight"], st["inflight"])
            key = json.dumps(req["messages"])
            st["seen"][key] = st["seen"].get(key, 0) + 1
            first = st["seen"][key] == 1
        try:
            if mode == "slow":
                # the stall is what is tested (the client's timeout): hold the answer until the
                # fixture ends rather than for a fixed time the client might outlast on a slow machine
                st["release"].wait(60)
            else:
                # simulated service time, part of the test: requests overlap in flight, so the
                # concurrency bound (max_inflight) is really exercised
                time.sleep(0.02)
            if mode == "broken" or (mode == "flaky" and first):
                return self._send(503 if mode == "broken" else 500, {"error": "overloaded"})
            if mode == "bad":
                return self._send(400, {"error": {"message": "maximum context length exceeded"}})
            if mode == "strict" and "return_token_ids" in req:  # a server that refuses unknown fields
                return self._send(400, {"error": {"message": "Unrecognized request argument supplied: return_token_ids"}})
            if mode == "strict422" and "return_token_ids" in req:  # FastAPI with extra="forbid"
                return self._send(422, {"detail": [{"type": "extra_forbidden", "loc": ["body", "return_token_ids"],
                                                    "msg": "Extra inputs are not permitted"}]})
            last = req["messages"][-1]["content"]
            choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": f"echo: {last[::-1]}"}}
            out = {"choices": [choice], "model": req["model"]}
            if mode.startswith("ids") and req.get("return_token_ids"):  # the target's own tokens, as vLLM sends them
                choice["token_ids"] = st["ids_of"](choice["message"]["content"], mode)
                out["prompt_token_ids"] = st["prompt_of"](req["messages"], mode)
                if mode == "idsreason":  # a server-side reasoning parser took text out of the content
                    choice["message"]["reasoning"] = "thought"
            return self._send(200, out)
        finally:
            with st["lock"]:
                st["inflight"] -= 1


@pytest.fixture()
def fake_server():
    _FakeOpenAI.state = {"lock": threading.Lock(), "requests": [], "inflight": 0, "max_inflight": 0, "seen": {},
                         "release": threading.Event()}
    srv, url = serve(_FakeOpenAI)
    try:
        yield url, _FakeOpenAI.state
    finally:
        _FakeOpenAI.state["release"].set()  # /slow handlers still stalled answer (to a client long gone)
        srv.shutdown()
        srv.server_close()


def _ecfg(tiny, tmp_path, url, name, **kw):
    base = dict(endpoint=url, concurrency=3, retries=2, retry_backoff=0.01, request_timeout=0.3, max_len=256)
    base.update(kw)
    return _cfg(tiny, tmp_path / f"{name}.jsonl", **base)


def test_endpoint_backend_turn_by_turn_with_bounded_concurrency(tiny, tmp_path, fake_server):
    from draftsmith.models.loading import load_tokenizer

    url, st = fake_server
    convs = [_conv(i, turns=2) for i in range(6)]
    s = run_regen(_ecfg(tiny, tmp_path, f"{url}/ok", "ok", concurrency=2), conversations=convs)
    assert (s.written, s.errors) == (6, 0)
    assert st["max_inflight"] <= 2
    tok = load_tokenizer(tiny)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    recs = {r["id"]: r for r in load_records(tmp_path / "ok.jsonl")}
    for c in convs:
        r = recs[c.id]
        answers = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert answers == [f"echo: {u[::-1]}" for u in c.user_turns()]
        want = [t for a in answers for t in tok(a, add_special_tokens=False)["input_ids"] + [eot]]
        assert [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m] == want
        assert r["target"]["endpoint"] == f"{url}/ok" and r["target"]["served_model"] == "fake-model"
    # the second turn was sent after the regenerated first answer, with the per-turn seed
    second = [req for _, req in st["requests"] if len(req["messages"]) == 3]
    assert len(second) == 6 and all(req["messages"][1]["content"].startswith("echo: ") for req in second)
    assert all(req["temperature"] == 0.7 and req["top_p"] == 0.8 and req["max_tokens"] == 6 for _, req in st["requests"])
    assert {req["seed"] for req in second} == {turn_seed(0, c.id, 1) for c in convs}


def test_endpoint_answer_ids_from_the_server(tiny, tmp_path, fake_server):
    """`return_token_ids`: a server that sends the answer's token ids for our prompt ids, decoding to
    its text, gives them to the record for the conversation's last turn (`answer_ids: "server"`;
    an earlier answer is re-encoded from text in the next turn's prompt, so it is the text's
    encoding; here the same ids, so the records equal a text server's); ids that decode to other
    text, a prompt the server tokenized otherwise, or reasoning split off the content fall back to
    encoding the text; a server that refuses the field (400, or FastAPI's 422) is asked once more
    without it, and not again."""
    from draftsmith.models.loading import load_tokenizer

    url, st = fake_server
    tok = load_tokenizer(tiny)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    st["ids_of"] = lambda text, mode: (enc("#") if mode == "idsbad" else []) + enc(text) + [eot]
    st["prompt_of"] = lambda msgs, mode: [0] if mode == "idsprompt" else enc(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    convs = [_conv(i, turns=2) for i in range(3)]
    recs = {}
    for mode, source in (("ok", "text"), ("ids", "server"), ("idsbad", "text"), ("idsprompt", "text"),
                         ("idsreason", "text"), ("strict", "text"), ("strict422", "text")):
        s = run_regen(_ecfg(tiny, tmp_path, f"{url}/{mode}", mode), conversations=convs)
        assert (s.written, s.errors) == (3, 0), mode
        recs[mode] = {r["id"]: r for r in load_records(tmp_path / f"{mode}.jsonl")}
        for r in recs[mode].values():
            assert [t["answer_ids"] for t in r["turns"]] == ["text", source], mode
            assert (r["input_ids"], r["loss_mask"]) == (recs["ok"][r["id"]]["input_ids"], recs["ok"][r["id"]]["loss_mask"])
    for mode in ("strict", "strict422"):
        sent = [req for m, req in st["requests"] if m == mode]
        refused = sum("return_token_ids" in req for req in sent)  # the first requests in flight (concurrency 3)
        assert 1 <= refused <= 3 and len(sent) == 6 + refused
        assert not any("return_token_ids" in req for req in sent if len(req["messages"]) == 3)  # later turns


def test_endpoint_retries_then_errors(tiny, tmp_path, fake_server):
    url, st = fake_server
    convs = [_conv(i, turns=1) for i in range(3)]
    # 500 on each first try: retried, all succeed
    s = run_regen(_ecfg(tiny, tmp_path, f"{url}/flaky", "flaky"), conversations=convs)
    assert (s.written, s.errors) == (3, 0)
    # always 503: 1 + 2 retries each, then the errors file
    s = run_regen(_ecfg(tiny, tmp_path, f"{url}/broken", "broken"), conversations=convs)
    assert (s.written, s.errors) == (0, 3)
    errs = [json.loads(x) for x in errors_path(tmp_path / "broken.jsonl").read_text().splitlines()]
    assert sorted(e["id"] for e in errs) == [c.id for c in convs]
    assert all("gave up after 3 attempts" in e["reason"] and "HTTP 503" in e["reason"] for e in errs)
    assert sum(1 for m, _ in st["requests"] if m == "broken") == 9
    # timeouts: retried, then the errors file
    s = run_regen(_ecfg(tiny, tmp_path, f"{url}/slow", "slow", retries=1), conversations=convs[:2])
    assert (s.written, s.errors) == (0, 2)
    errs = [json.loads(x) for x in errors_path(tmp_path / "slow.jsonl").read_text().splitlines()]
    assert all("timeout" in e["reason"] for e in errs)
    # a 400 is not retried
    s = run_regen(_ecfg(tiny, tmp_path, f"{url}/bad", "bad"), conversations=convs[:1])
    assert s.errors == 1 and sum(1 for m, _ in st["requests"] if m == "bad") == 1
    assert "context length" in json.loads(errors_path(tmp_path / "bad.jsonl").read_text())["reason"]


def test_scan_output_reads_lines_as_utf8(tmp_path):
    """--resume's scan of the output: a line that is not UTF-8 is a damaged line (it was a
    UnicodeDecodeError traceback), and a last line cut inside a character is dropped."""
    out = tmp_path / "r.jsonl"
    good = [(json.dumps({"id": f"x{i}", "v": "café"}, ensure_ascii=False) + "\n").encode() for i in range(2)]
    out.write_bytes(good[0] + b"a\x00b\x00\n" + good[1])
    with pytest.raises(DraftsmithError, match=r"r\.jsonl:2 is not a complete regen record"):
        scan_output(out)
    out.write_bytes(good[0] + good[1][:-4])  # cut between the two bytes of "é"
    done, dropped = scan_output(out)
    assert list(done) == ["x0"] and dropped == len(good[1]) - 4 and out.read_bytes() == good[0]


def test_a_prompt_file_nested_too_deeply_is_one_error(tmp_path):
    """regen --mix FILE.jsonl: a line of 5000 `[` was a RecursionError traceback."""
    from draftsmith.data.sources import load_mix

    f = tmp_path / "deep.jsonl"
    f.write_text('{"prompt": "hi"}\n' + "[" * 5000 + "\n")
    with pytest.raises(DraftsmithError, match=r"deep\.jsonl:2: JSON nested too deeply to read"):
        load_mix(str(f))


def test_a_bad_prompt_record_says_what_a_cli_user_can_do(tmp_path):
    """regen --mix FILE: the error for a bad record told CLI users to "pass on_error='skip'",
    which no flag does; it says to fix or remove the line."""
    from draftsmith.data.sources import load_mix

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"input_ids": [1, 2]}\n')
    with pytest.raises(DraftsmithError) as e:
        load_mix(str(f))
    assert str(e.value).endswith("p.jsonl:2: needs exactly one of 'messages' (chat list) or 'prompt' (string); "
                                 "fix or remove that line and run again"), str(e.value)


def test_exclude_leaves_out_ids_from_a_regen_file_or_an_id_list(tiny, tmp_path, capsys):
    """--exclude extends a data set made elsewhere: the ids in a regen JSONL (a killed run's
    incomplete last record is no id) or a plain id list are not regenerated; the records written
    equal a run over the remaining conversations alone."""
    from draftsmith.data.regen_records import read_ids

    convs = [_conv(i, turns=1) for i in range(5)]
    first = _cfg(tiny, tmp_path / "first.jsonl")
    run_regen(first, conversations=convs[:2])
    with open(first.out, "ab") as f:
        f.write(b'{"id": "t/4", "messa')  # cut mid-record: t/4 was not done there
    ids_txt = tmp_path / "ids.txt"
    ids_txt.write_text("t/3\n\n")
    assert read_ids(first.out) == {"t/0", "t/1"} and read_ids(ids_txt) == {"t/3"}
    cfg = _cfg(tiny, tmp_path / "more.jsonl", exclude=(first.out, ids_txt))
    s = run_regen(cfg, conversations=convs)
    assert s.written == 2 and [r["id"] for r in load_records(cfg.out)] == ["t/2", "t/4"]
    alone = _cfg(tiny, tmp_path / "alone.jsonl")
    run_regen(alone, conversations=[convs[2], convs[4]])
    assert load_records(alone.out) == load_records(cfg.out)
    with pytest.raises(DraftsmithError, match="leaves none of the 2"):
        run_regen(_cfg(tiny, tmp_path / "none.jsonl", exclude=(first.out,)), conversations=convs[:2])
    with pytest.raises(DraftsmithError, match="--exclude .*no such file"):
        _cfg(tiny, tmp_path / "x.jsonl", exclude=(tmp_path / "missing.jsonl",))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "t/0"}\n{"no_id": 1}\n{"id": "t/1"}\n')
    with pytest.raises(DraftsmithError, match="--exclude .*bad.jsonl is not a readable regen JSONL"):
        read_ids(bad)
    bom = tmp_path / "bom.txt"  # an id list saved with a byte-order mark and CRLF line ends
    bom.write_bytes(b"\xef\xbb\xbft/3\r\nt/1\r\n")
    assert read_ids(bom) == {"t/3", "t/1"}
    bom.write_bytes(b'\xef\xbb\xbf{"id": "t/2"}\n')
    assert read_ids(bom) == {"t/2"}
    nl_less = tmp_path / "nl.jsonl"  # a complete record without its newline: --resume redoes it, so not done
    nl_less.write_bytes(b'{"id": "t/0"}\n{"id": "t/1"}')
    assert read_ids(nl_less) == {"t/0"}
    with pytest.raises(DraftsmithError, match="--exclude .*is --out"):
        _cfg(tiny, first.out, overwrite=False, resume=True, exclude=(first.out,))
    other = tmp_path / "other.txt"
    other.write_text("elsewhere/1\n")
    run_regen(_cfg(tiny, tmp_path / "w.jsonl", exclude=(other,)), conversations=convs[:1])
    assert "none of its 1 ids is in this selection" in capsys.readouterr().err

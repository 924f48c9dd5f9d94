"""Bad input to `draftsmith regen` found by hunt 55: each case was data loss, a traceback or a
run that did nothing useful with exit 0, and is now refused with one line before --out is touched."""

from __future__ import annotations

import json

import pytest

from draftsmith.data.regen_records import scan_output
from draftsmith.errors import DraftsmithError


def test_resume_never_cuts_a_whole_line_that_is_no_record(tmp_path):
    """`regen --resume --out prompts.jsonl` (a one-line prompt file, no regen record in it): its
    complete last line was dropped as "an incomplete last record from a killed run" and the file
    truncated to nothing. Only a last line cut before its newline is a killed run's write."""
    out = tmp_path / "prompts.jsonl"
    out.write_text('{"prompt": "hi"}\n')
    with pytest.raises(DraftsmithError, match=r"prompts\.jsonl:1 is not a regen record"):
        scan_output(out)
    assert out.read_text() == '{"prompt": "hi"}\n'  # untouched
    good = json.dumps({"id": "x0"}) + "\n"
    out.write_text(good + '{"messages": []}\n')
    with pytest.raises(DraftsmithError, match=r"prompts\.jsonl:2 is not a regen record"):
        scan_output(out)
    assert out.read_text() == good + '{"messages": []}\n'
    out.write_text(good + '{"id": "x1", "v')  # a killed run's cut write: still dropped
    assert scan_output(out) == ({"x0": {"id": "x0"}}, len('{"id": "x1", "v'))
    assert out.read_text() == good


@pytest.mark.parametrize("flags", [{"overwrite": True}, {"resume": True}])
def test_out_that_is_the_prompt_file_is_refused(tmp_path, monkeypatch, flags):
    """`regen --mix prompts.jsonl --out prompts.jsonl --overwrite` deleted the user's prompts (read
    first, then replaced by the answers); with --resume their lines were read as records. Refused
    before the target loads (the target here does not exist), the prompts untouched."""
    from draftsmith.data.regen import RegenConfig, run_regen

    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    text = '{"prompt": "hi"}\n{"prompt": "there"}\n'
    prompts.write_text(text)
    for mix, out in (("prompts.jsonl", prompts), ("code:1,prompts.jsonl:2", tmp_path / "." / "prompts.jsonl")):
        cfg = RegenConfig(target="no-such-target", mix=mix, out=out, max_samples=1, **flags)
        with pytest.raises(DraftsmithError, match=r"is the prompt file --mix reads"):
            run_regen(cfg)
        assert prompts.read_text() == text


# ---- --endpoint: checked before --out is touched -----------------------------------------

import socket  # noqa: E402
from http.server import SimpleHTTPRequestHandler  # noqa: E402

from fake_http import JsonHandler, serve as _serve  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama", seed=3)


class _ChatOnly(JsonHandler):
    """An OpenAI-compatible server serving the model `served`; /v1/models (optional) lists `models`,
    or is a 404 where that is None."""

    posts: list = []
    models: list | None = None

    def do_GET(self):
        if self.models is None:
            return self.send_error(404)
        self._send(200, {"object": "list", "data": [{"id": m} for m in self.models]})

    def do_POST(self):
        req = self.read_json()
        self.posts.append(req)
        if req["model"] != "served":
            return self._send(404, {"error": {"message": f"The model `{req['model']}` does not exist."}})
        self._send(200, {"choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "ok"}}]})


def _run(tiny, out, **kw):
    from draftsmith.data.regen import RegenConfig, run_regen
    from draftsmith.data.sources.conversation import Conversation

    conv = Conversation(id="c/0", source="test", split="train", messages=[{"role": "user", "content": "hi"}])
    base = dict(target=str(tiny), out=out, max_new_tokens=4, overwrite=True, retries=1, retry_backoff=0.01,
                request_timeout=5.0)
    cfg = RegenConfig(**{**base, **kw})
    return run_regen(cfg, conversations=[conv])


def test_an_endpoint_that_cannot_answer_is_refused_before_the_output_is_touched(tiny, tmp_path):
    """regen --endpoint at nothing (connection refused), at a URL without http://, at a web server
    that is no OpenAI API (python -m http.server) or with a timeout of 0: every conversation was
    retried into the errors file and the run ended 'ok' with 0 written, --overwrite's old output
    deleted. Now one line each, before --out is opened."""
    out = tmp_path / "regen.jsonl"
    old = '{"id": "earlier"}\n'
    out.write_text(old)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    web, web_url = _serve(lambda *a, **k: SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k))
    try:
        for kw, match in (({"endpoint": closed}, r"cannot connect \(ConnectError"),
                          ({"endpoint": "localhost:8000"}, r"--endpoint must be an http\(s\) URL"),
                          ({"endpoint": f"{web_url}/v1"}, r"POST .*/v1/chat/completions answered HTTP 501"),
                          ({"endpoint": web_url, "request_timeout": 0.0}, r"--request-timeout must be a positive")):
            with pytest.raises(DraftsmithError, match=match):
                _run(tiny, out, **kw)
            assert out.read_text() == old, kw
            assert not (tmp_path / "regen.jsonl.errors.jsonl").exists()
    finally:
        web.shutdown()
        web.server_close()


def test_a_server_without_v1_models_is_checked_with_one_chat_request(tiny, tmp_path):
    """/v1/models is optional: where it lists nothing, one request of one token checks the URL; a
    wrong --endpoint-model (the server's 404 for every request) is refused with the server's
    message, the right one regenerates as before."""
    _ChatOnly.posts = []
    srv, url = _serve(_ChatOnly)
    try:
        with pytest.raises(DraftsmithError, match=r"HTTP 404 \(.*The model `typo` does not exist"):
            _run(tiny, tmp_path / "a.jsonl", endpoint=url, endpoint_model="typo")
        assert not (tmp_path / "a.jsonl").exists()
        s = _run(tiny, tmp_path / "b.jsonl", endpoint=url, endpoint_model="served")
        assert (s.written, s.errors) == (1, 0)
        assert [p["max_tokens"] for p in _ChatOnly.posts] == [1, 1, 4]  # the two checks, then the answer
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_endpoint_model_the_server_does_not_list_is_checked(tiny, tmp_path):
    """--endpoint-model with a typo, against a server that lists its models (vLLM, Draftsmith's):
    every request was a 404 into the errors file; the name it lists needs no check request."""
    _ChatOnly.posts, _ChatOnly.models = [], ["served"]
    srv, url = _serve(_ChatOnly)
    try:
        with pytest.raises(DraftsmithError, match=r"HTTP 404 \(.*The model `typo` does not exist"):
            _run(tiny, tmp_path / "a.jsonl", endpoint=url, endpoint_model="typo")
        for name in ("served", None):  # given, or the first listed
            s = _run(tiny, tmp_path / f"{name}.jsonl", endpoint=url, endpoint_model=name)
            assert (s.written, s.errors) == (1, 0)
        assert [p["max_tokens"] for p in _ChatOnly.posts] == [1, 4, 4]
    finally:
        _ChatOnly.models = None
        srv.shutdown()
        srv.server_close()


def test_a_run_in_which_every_conversation_failed_is_an_error(tiny, tmp_path, capsys):
    """regen --max-len 3 (no prompt fits): '0 written, 1 errors' and exit 0, so `regen && cache`
    went on with an empty file; now the summary, then one error line with the first reason, exit 2."""
    from draftsmith.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi there"}\n')
    out = tmp_path / "r.jsonl"
    argv = ["regen", "--target", str(tiny), "--mix", str(prompts), "--out", str(out), "--max-tokens", "2",
            "--threads", "1"]
    capsys.readouterr()
    assert main([*argv, "--max-len", "3"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("draftsmith: error: every conversation failed (1); the first: prompt of turn 1 has ")
    assert err[-1].endswith("the context limit (--max-len) is 3, which leaves no room to answer "
                            f"(all in {out}.errors.jsonl)")
    # a resumed run appends to the errors file: the reason quoted is this run's, not the first line's
    errors = tmp_path / "r.jsonl.errors.jsonl"
    errors.write_text(json.dumps({"id": "old", "reason": "an earlier run's reason"}) + "\n" + errors.read_text())
    assert main([*argv, "--max-len", "4", "--resume"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "earlier run" not in last and "the context limit (--max-len) is 4" in last, last
    assert main([*argv, "--overwrite"]) == 0  # one that answers


class _Shaped(_ChatOnly):
    """A server whose chat answer is `answer` (no /v1/models)."""

    answer: dict = {}

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(200, self.answer)


def test_the_one_token_probe_checks_a_chat_completions_shape_only(tiny, tmp_path):
    """regen --endpoint's probe (one token, where /v1/models lists nothing): a 200 that is no chat
    completion is refused before anything is written; one whose single token leaves content null
    (a reasoning parser's <think>) is a chat completion all the same, and the run goes on."""
    srv, url = _serve(_Shaped)
    try:
        _Shaped.answer = {"hello": "world"}
        with pytest.raises(DraftsmithError, match="answered 200 with no chat completion"):
            _run(tiny, tmp_path / "a.jsonl", endpoint=f"{url}/v1", endpoint_model="m")
        _Shaped.answer = {"choices": [{"index": 0, "finish_reason": "length",
                                       "message": {"role": "assistant", "content": None}}]}
        s = _run(tiny, tmp_path / "b.jsonl", endpoint=f"{url}/v1", endpoint_model="m")
        assert s.written == 0 and s.errors == 1  # (the run itself: no text content to keep)
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("argv,says", [
    # '' was falsy: the built-in engine ran instead, the user believing the server answered
    (["--endpoint", ""], "--endpoint is empty; give an OpenAI-compatible server's URL, e.g. http://host:8000/v1, "
                         "or leave --endpoint out to regenerate with the built-in engine"),
    # parsed by the cache's layer parser, which named its own flag (--layers), after the target loaded
    (["--features-out", "feats", "--feature-layers", "abc"],
     "--feature-layers expects comma-separated 0-based layer ids, e.g. 1,14,27 (or default), got 'abc'"),
    (["--features-out", "feats", "--feature-layers", ","], "--feature-layers expects comma-separated"),
])
def test_flags_that_cannot_work_are_refused_in_their_own_names(tmp_path, monkeypatch, capsys, argv, says):
    """Refused before the target loads (it does not exist here: the error would be another)."""
    from draftsmith.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["regen", "--target", "no-such-target", "--out", "r.jsonl", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"draftsmith: error: {says}") and "\n" not in err, err
    assert not (tmp_path / "r.jsonl").exists()

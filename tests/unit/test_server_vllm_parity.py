"""The server against vLLM's OpenAI server, field by field (tiny model, real HTTP, the official
`openai` client where it sends the request): null for an optional field, vLLM's lax number and
bool coercions, stream_options' defaults, completions' `max_tokens: null`, `request_id` /
`X-Request-Id`, `return_tokens_as_token_ids`, the vLLM fields Draftsmith refuses rather than
ignores, seeds / logit_bias / truncate_prompt_tokens as vLLM reads them, chat `echo`'s
prompt_logprobs. Each behaviour cites the vLLM source it follows in its test's docstring."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_unit import _assert_openai_error, serve_cli, tiny_dir, tiny_server  # noqa: F401 (fixtures)

MSGS = [{"role": "user", "content": "hi"}]


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_null_is_unset_and_lax_numbers_as_vllm_reads_them(tiny_server):
    """vLLM's request models (entrypoints/openai/chat_completion/protocol.py, completion/protocol.py)
    declare chat `n`, `stream`, `parallel_tool_calls`, `stream_options` and completions `echo`,
    `stream` Optional, so null (what the openai client sends for None) is accepted: here, the field
    unset. Its non-Optional fields (completions `n`, `ignore_eos`, `min_tokens`, chat `echo`, ...)
    refuse null, here too. Its pydantic models are lax: "3", 3.0, "0" and chat `logprobs: 1` are
    read as numbers / a bool; "3.5", 3.5 for an int and "abc" stay 400s, as does true for a number."""
    url = tiny_server()
    c = _client(url)
    base = dict(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    want = c.chat.completions.create(**base).choices[0].message.content
    got = c.chat.completions.create(**base, n=None, stream=None, parallel_tool_calls=None, stream_options=None,
                                    seed=None, top_p=None, logprobs=None, top_logprobs=None, stop=None,
                                    presence_penalty=None, frequency_penalty=None, logit_bias=None, user=None,
                                    extra_body={"top_k": None, "cache_salt": None, "prompt_logprobs": None})
    assert got.choices[0].message.content == want and len(got.choices) == 1
    comp = dict(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    want_c = c.completions.create(**comp).choices[0].text
    got_c = c.completions.create(**comp, echo=None, stream=None, logprobs=None, seed=None, stream_options=None)
    assert got_c.choices[0].text == want_c and got_c.choices[0].logprobs is None
    with httpx.Client(base_url=url, timeout=60) as h:
        # vLLM's non-Optional fields keep refusing null
        for path, body, param in [("/v1/completions", {"prompt": "abc", "n": None}, "n"),
                                  ("/v1/completions", {"prompt": "abc", "ignore_eos": None}, "ignore_eos"),
                                  ("/v1/chat/completions", {"messages": MSGS, "echo": None}, "echo"),
                                  ("/v1/chat/completions", {"messages": MSGS, "min_tokens": None}, "min_tokens"),
                                  ("/v1/chat/completions", {"messages": None}, "messages")]:
            _assert_openai_error(h.post(path, json={**body, "max_tokens": 2}), 400, param)
        # lax numbers and bools, as pydantic's lax mode reads them
        r = h.post("/v1/completions", json={"prompt": "abc", "max_tokens": "4", "temperature": "0", "n": 1.0,
                                            "seed": 5.0, "stream": "false", "top_k": "0", "logprobs": "1"})
        assert r.status_code == 200, r.text
        (ch,) = r.json()["choices"]
        assert ch["text"] == want_c and len(ch["logprobs"]["tokens"]) == r.json()["usage"]["completion_tokens"] == 4
        assert all(len(top) <= 2 for top in ch["logprobs"]["top_logprobs"])
        r = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0, "logprobs": 1,
                                                 "top_logprobs": "2", "presence_penalty": 0, "top_p": 1})
        assert r.status_code == 200, r.text
        (ch,) = r.json()["choices"]
        assert ch["message"]["content"] == want and len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2
        r = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0, "logprobs": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
        # what lax mode refuses stays a 400 naming the field
        for field, value in [("max_tokens", "3.5"), ("max_tokens", 3.5), ("max_tokens", "abc"), ("n", "two"),
                             ("temperature", "hot"), ("temperature", True), ("max_tokens", True), ("stream", 2),
                             ("seed", "1e3")]:
            _assert_openai_error(h.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, field: value}),
                                 400, field)
        _assert_openai_error(h.post("/v1/chat/completions", json={"messages": MSGS, "logprobs": 2}), 400, "logprobs")


def _chunks(h: httpx.Client, path: str, body: dict) -> list[dict]:
    with h.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_stream_options_include_usage_defaults_to_true_once_given(tiny_server):
    """vLLM's StreamOptions: `include_usage: Optional[bool] = True` (0.10 protocol.py @0052bed3 and
    HEAD), read as `bool(stream_options.include_usage)` whenever stream_options is given
    (serve/utils/api_utils.py: should_include_usage), continuous usage only with it. So `{}` sends
    the usage chunk, `{"continuous_usage_stats": true}` usage on every chunk too; include_usage
    false or null, none; no stream_options, none."""
    url = tiny_server()
    with httpx.Client(base_url=url, timeout=60) as h:
        for path, body in [("/v1/completions", {"prompt": "abc"}), ("/v1/chat/completions", {"messages": MSGS})]:
            body = {**body, "max_tokens": 4, "temperature": 0}
            whole = h.post(path, json=body).json()["usage"]
            for opts, last, every in [({}, True, False), ({"continuous_usage_stats": True}, True, True),
                                      ({"include_usage": True}, True, False), (None, False, False),
                                      ({"include_usage": False, "continuous_usage_stats": True}, False, False),
                                      ({"include_usage": None}, False, False)]:
                chunks = _chunks(h, path, {**body, "stream_options": opts})
                tail = chunks[-1]
                assert (not tail["choices"] and tail["usage"]["completion_tokens"] == whole["completion_tokens"]) == last
                assert all("usage" in c for c in chunks[:-1] if c["choices"]) == every, (path, opts)
                assert any("usage" in c for c in chunks) == (last or every), (path, opts)
    c = _client(url)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, stream=True,
                                            stream_options={}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_completions_max_tokens_null_is_the_rest_of_the_context(tiny_server):
    """vLLM's CompletionRequest `max_tokens: Optional[int] = 16`: left out, 16; null reaches
    get_max_tokens (serve/utils/api_utils.py) as None: the rest of the context (max_model_len -
    prompt), within the generation config's max_tokens (max_new_tokens). Echo with null too."""
    url = tiny_server()
    c = _client(url)
    prompt = "ab" * 115
    n_prompt = len(httpx.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=60).json()["tokens"])
    rest = 256 - n_prompt  # the tiny server's context is 256
    assert 16 < rest <= 32
    kw = dict(model="tiny", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert c.completions.create(**kw).usage.completion_tokens == 16
    r = c.completions.create(**kw, max_tokens=None)
    assert r.usage.completion_tokens == rest and r.choices[0].finish_reason == "length"
    r = c.completions.create(**kw, max_tokens=None, echo=True)
    assert r.usage.completion_tokens == rest and r.choices[0].text.startswith(prompt)
    # the generation config's max_new_tokens caps it, as vLLM's override_max_tokens
    c = _client(tiny_server(llm_kw={"override_generation_config": {"max_new_tokens": rest - 3}}))
    assert c.completions.create(**kw, max_tokens=None).usage.completion_tokens == rest - 3


def test_request_id_and_x_request_id_name_the_response(tiny_server):
    """vLLM's response id is `chatcmpl-{id}` / `cmpl-{id}`, the id being the X-Request-Id header,
    else the body's `request_id`, else random (_base_request_id: the header first, the body's
    request_id its default; chat_completion/serving.py and completion/serving.py); every chunk of a
    stream carries it. Two requests sent at once with one id both complete, each with its own
    text (the engine's ids stay the server's). `X-Request-Id` comes back as a response header only
    with vLLM's --enable-request-id-headers (XRequestIdMiddleware; ServeOptions.request_id_headers)."""
    url = tiny_server()
    c = _client(url)
    r = c.chat.completions.with_raw_response.create(model="tiny", messages=MSGS, max_tokens=2,
                                                    extra_body={"request_id": "body-1"})
    assert r.parse().id == "chatcmpl-body-1" and "x-request-id" not in r.headers
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, extra_body={"request_id": "body-1"},
                                  extra_headers={"X-Request-Id": "hdr-1"})
    assert r.id == "chatcmpl-hdr-1"
    assert c.completions.create(model="tiny", prompt="abc", max_tokens=2, extra_body={"request_id": "b2"}).id == "cmpl-b2"
    assert c.completions.create(model="tiny", prompt="abc", max_tokens=2,
                                extra_headers={"X-Request-Id": "h2"}).id == "cmpl-h2"
    ids = {c.completions.create(model="tiny", prompt="abc", max_tokens=2).id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-") and len(i) == 37 for i in ids)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, stream=True,
                                            extra_body={"request_id": "s-1"}))
    assert {ch.id for ch in chunks} == {"chatcmpl-s-1"}
    with httpx.Client(base_url=url, timeout=30) as h:
        _assert_openai_error(h.post("/v1/completions", json={"prompt": "abc", "request_id": None}), 400, "request_id")
        # two streams at once under one id: each gets its own tokens, both finish
        bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "request_id": "same"}
                  for p in ("abc", "xyz xyz")]
        want = [h.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
        with h.stream("POST", "/v1/completions", json={**bodies[0], "stream": True}) as first:
            lines = first.iter_lines()
            got0 = ""
            for line in lines:  # the first one is running before the second one comes
                if line.startswith("data: {"):
                    got0 += json.loads(line[6:])["choices"][0]["text"]
                    break
            chunks = _chunks(h, "/v1/completions", bodies[1])
            assert {ch["id"] for ch in chunks} == {"cmpl-same"}
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == want[1]
            got0 += "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines if line.startswith("data: {"))
        assert got0 == want[0]
    url = tiny_server(request_id_headers=True)
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "echo-me"})
        assert r.headers["x-request-id"] == "echo-me" and r.json()["id"] == "cmpl-echo-me"
        r = h.get("/health")
        assert len(r.headers["x-request-id"]) == 32  # a fresh uuid4 hex, on every route
        with h.stream("POST", "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "stream": True},
                      headers={"X-Request-Id": "s"}) as r:
            assert r.headers["x-request-id"] == "s"


def test_return_tokens_as_token_ids(tiny_server):
    """vLLM's `return_tokens_as_token_ids: true` (protocol.py; _get_decoded_token /
    format_token_id_placeholder): every token of a logprobs object is `token_id:N`, the generated
    ones and the top ones (chat's top_logprobs, completions' top_logprobs keys), an echoed prompt's
    too, whole and streamed; numbers, bytes and text_offset are the plain request's."""
    url = tiny_server()
    with httpx.Client(base_url=url, timeout=60) as h:
        body = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True,
                "return_token_ids": True}
        plain = h.post("/v1/completions", json=body).json()["choices"][0]
        got = h.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
        ids = plain["prompt_token_ids"] + plain["token_ids"]
        lp, lp0 = got["logprobs"], plain["logprobs"]
        assert got["text"] == plain["text"] and lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert lp["token_logprobs"] == lp0["token_logprobs"] and lp["text_offset"] == lp0["text_offset"]
        assert lp["top_logprobs"][0] is None
        for top, top0, t, x in zip(lp["top_logprobs"][1:], lp0["top_logprobs"][1:], ids[1:], lp["token_logprobs"][1:]):
            assert top[f"token_id:{t}"] == x and all(k.startswith("token_id:") for k in top)
            # (text keys merge tokens that read the same, e.g. two halves of a character: ids do not)
            assert set(top0.values()) <= set(top.values()) and len(top) >= len(top0)
        streamed = [c["choices"][0]["logprobs"] for c in _chunks(h, "/v1/completions",
                                                                 {**body, "return_tokens_as_token_ids": True})]
        assert sum((x["tokens"] for x in streamed if x), []) == lp["tokens"]
        cbody = {"messages": MSGS, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                 "return_token_ids": True}
        plain = h.post("/v1/chat/completions", json=cbody).json()["choices"][0]
        got = h.post("/v1/chat/completions", json={**cbody, "return_tokens_as_token_ids": True}).json()["choices"][0]
        content, content0 = got["logprobs"]["content"], plain["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in plain["token_ids"]]
        assert [e["bytes"] for e in content] == [e["bytes"] for e in content0]
        for e, e0 in zip(content, content0):
            assert e["logprob"] == e0["logprob"] and len(e["top_logprobs"]) == 2
            assert all(t["token"].startswith("token_id:") for t in e["top_logprobs"])
            assert [t["logprob"] for t in e["top_logprobs"]] == [t["logprob"] for t in e0["top_logprobs"]]
        streamed = [c["choices"][0]["logprobs"] for c in _chunks(h, "/v1/chat/completions",
                                                                 {**cbody, "return_tokens_as_token_ids": True})
                    if c["choices"]]
        assert [e["token"] for x in streamed if x for e in x["content"]] == [e["token"] for e in content]
        # false or null: plain text
        off = h.post("/v1/chat/completions", json={**cbody, "return_tokens_as_token_ids": None}).json()["choices"][0]
        assert off["logprobs"] == plain["logprobs"]


def test_vllm_options_draftsmith_does_not_honour_are_refused(tiny_server):
    """vLLM fields that were silently ignored get a 400 that says why: use_beam_search (vLLM runs
    beam search; here it returned n greedy copies), logits_processors (vLLM 0.10 refuses it too
    without --logits-processor-pattern: protocol.py get_logits_processors), 0.10's top-level
    structural_tag and response_format structural_tag (vLLM compiles them), a structured-outputs
    backend other than llguidance's names (V1 refuses a request-level backend other than the
    server's: v1/engine/processor.py). "auto", "guidance" and "llguidance" are accepted."""
    import openai

    url = tiny_server()
    c = _client(url)
    with pytest.raises(openai.BadRequestError, match="beam search"):
        c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, n=2, extra_body={"use_beam_search": True})
    with httpx.Client(base_url=url, timeout=60) as h:
        for path, base in [("/v1/completions", {"prompt": "abc"}), ("/v1/chat/completions", {"messages": MSGS})]:
            base = {**base, "max_tokens": 3, "temperature": 0}
            for extra, param, says in [
                ({"use_beam_search": True, "n": 2}, "use_beam_search", "beam search"),
                ({"logits_processors": ["my.Processor"]}, "logits_processors", "logits_processors"),
                ({"structural_tag": '{"structures": [], "triggers": []}'}, "structural_tag", "structural_tag"),
                ({"guided_choice": ["yes"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
                 "llguidance"),
                ({"structured_outputs": {"choice": ["yes"], "backend": "xgrammar"}}, "structured_outputs",
                 "llguidance"),
                ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
                 "response_format", "structural_tag"),
                ({"use_beam_search": None}, "use_beam_search", ""),  # (vLLM's non-Optional bool)
            ]:
                _assert_openai_error(h.post(path, json={**base, **extra}), 400, param, says=says)
            # what is accepted: false / empty, and llguidance's names, the grammar applied
            for extra in ({"use_beam_search": False, "logits_processors": [], "length_penalty": 1.0},
                          {"structural_tag": None, "guided_decoding_backend": None}):
                assert h.post(path, json={**base, **extra}).status_code == 200
            for backend in ("auto", "guidance", "llguidance"):
                for extra in ({"guided_choice": ["yes", "no"], "guided_decoding_backend": backend},
                              {"structured_outputs": {"choice": ["yes", "no"], "backend": backend}}):
                    r = h.post(path, json={**base, "max_tokens": 8, **extra})
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    assert (ch["text"] if "text" in ch else ch["message"]["content"]) in ("yes", "no")
            # a backend alone asks for no grammar
            assert h.post(path, json={**base, "structured_outputs": {"backend": "guidance"}}).status_code == 200


def test_seed_logit_bias_and_truncate_prompt_tokens_as_vllm_reads_them(tiny_server):
    """vLLM's sampling_params.py @00388f65: `seed: -1` is no seed (__post_init__), other seeds
    anywhere in int64 (protocol.py: ge=-2**63, le=2**63-1); logit_bias values clamped to
    [-100, 100] (from_optional). truncate_prompt_tokens -1 (HEAD protocol.py: ge=-1) keeps as many
    of the prompt's last tokens as the context holds beside max_tokens (renderers/params.py:
    max_input_tokens = max_model_len - max_tokens)."""
    url = tiny_server()
    engine = tiny_server.servers[-1].app.app.state.server.llm.engine
    seen = []
    add = engine.add_request
    engine.add_request = lambda ids, params, *a, **k: seen.append(params) or add(ids, params, *a, **k)
    with httpx.Client(base_url=url, timeout=60) as h:
        body = {"prompt": "abc", "max_tokens": 2}
        for extra, seeds in [({"seed": -1}, [None]), ({"seed": -1, "n": 2}, [None, None]),
                             ({"seed": -5, "n": 2}, [-5, -4]), ({"seed": -(2**63)}, [-(2**63)]), ({"seed": 7}, [7])]:
            seen.clear()
            assert h.post("/v1/completions", json={**body, **extra}).status_code == 200
            assert [p.seed for p in seen] == seeds, extra
        a, b = (h.post("/v1/completions", json={**body, "max_tokens": 8, "seed": -9, "temperature": 1.5}).json()
                ["choices"][0]["text"] for _ in range(2))
        assert a == b  # a negative seed reproduces
        for seed in (-(2**63) - 1, 2**63):
            _assert_openai_error(h.post("/v1/completions", json={**body, "seed": seed}), 400, "seed", says="-1: no seed")
        seen.clear()
        r = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2,
                                                 "logit_bias": {"5": 150, "6": -1e9, "7": 3.5}})
        assert r.status_code == 200, r.text
        assert seen[0].logit_bias == {5: 100.0, 6: -100.0, 7: 3.5}
        # truncate_prompt_tokens -1: the prompt's last max_len - max_tokens tokens (the context is 256)
        long = "the start is dropped; " * 20  # 440 byte tokens
        for extra, kept in [({"max_tokens": 6}, 250), ({}, 240)]:  # (completions' max_tokens: 16 when left out)
            seen.clear()
            r = h.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": -1, **extra})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == kept
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}], "max_tokens": 6,
                                                 "truncate_prompt_tokens": -1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 250
        for k in (-2, 0):
            _assert_openai_error(h.post("/v1/completions", json={"prompt": long, "truncate_prompt_tokens": k}), 400,
                                 "truncate_prompt_tokens", says="or -1")


def test_echo_returns_prompt_logprobs_as_vllm_does(tiny_server):
    """vLLM's to_sampling_params (0.10 protocol.py and HEAD): with `echo` and no prompt_logprobs,
    chat's prompt_logprobs is top_logprobs (0 when unset) and completions' is logprobs, so a whole
    chat response with echo carries top-level prompt_logprobs (each prompt token's own logprob,
    plus top_logprobs more), completions with echo + logprobs per choice; the same objects as
    asking prompt_logprobs: k. A stream shows none; an explicit prompt_logprobs wins."""
    url = tiny_server()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    with httpx.Client(base_url=url, timeout=60) as h:
        chat = {"messages": msgs, "max_tokens": 3, "temperature": 0, "echo": True, "add_generation_prompt": False,
                "continue_final_message": True}
        plain = {**chat, "echo": False}
        for extra, k in [({}, 0), ({"logprobs": True, "top_logprobs": 2}, 2), ({"prompt_logprobs": 1}, 1)]:
            r = h.post("/v1/chat/completions", json={**chat, **extra}).json()
            want = h.post("/v1/chat/completions", json={**plain, **extra, "prompt_logprobs": k}).json()
            assert r["prompt_logprobs"] == want["prompt_logprobs"] and r["prompt_logprobs"][0] is None, extra
            assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
            assert r["choices"][0]["message"]["content"].startswith("Hel")
        assert "prompt_logprobs" not in h.post("/v1/chat/completions", json=plain).json()
        chunks = _chunks(h, "/v1/chat/completions", chat)
        assert not any("prompt_logprobs" in c for c in chunks)
        comp = {"prompt": "abcabc", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
        (ch,) = h.post("/v1/completions", json=comp).json()["choices"]
        (want,) = h.post("/v1/completions", json={**comp, "echo": False, "prompt_logprobs": 1}).json()["choices"]
        assert ch["prompt_logprobs"] == want["prompt_logprobs"] and ch["prompt_logprobs"][0] is None
        assert "prompt_logprobs" not in h.post("/v1/completions", json={**comp, "logprobs": None}).json()["choices"][0]


def test_server_default_for_token_ids_and_request_id_headers(tiny_server, serve_cli):
    """vLLM's --return-tokens-as-token-ids: `token_id:N` where a request does not say, its own
    false (or true) winning; serve's flags reach the server's options, both off by default."""
    url = tiny_server(return_tokens_as_token_ids=True)
    body = {"messages": MSGS, "max_tokens": 3, "temperature": 0, "logprobs": True, "return_token_ids": True}
    with httpx.Client(base_url=url, timeout=60) as h:
        as_ids = h.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert [e["token"] for e in as_ids["logprobs"]["content"]] == [f"token_id:{t}" for t in as_ids["token_ids"]]
        for says in (None, True):
            same = h.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": says}).json()
            assert same["choices"][0]["logprobs"] == as_ids["logprobs"]
        text = h.post("/v1/chat/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert not any(e["token"].startswith("token_id:") for e in text["choices"][0]["logprobs"]["content"])
    opts = serve_cli()["options"]
    assert (opts.request_id_headers, opts.return_tokens_as_token_ids) == (False, False)
    opts = serve_cli("--enable-request-id-headers", "--return-tokens-as-token-ids")["options"]
    assert (opts.request_id_headers, opts.return_tokens_as_token_ids) == (True, True)

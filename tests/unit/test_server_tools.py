"""Tool calling on the server (tiny model): a named or required tool_choice decodes under its
schema (the same text as LLM.chat under that grammar, with speculation or without), auto reads
the model's hermes calls; whole and streamed answers agree; a conversation with earlier calls
reaches the chat template; bad tool requests are clear 400s."""

from __future__ import annotations

import json

import httpx
import pytest
from test_server_unit import _assert_openai_error, serve_cli, tiny_dir, tiny_server  # noqa: F401 (fixtures)

from draftsmith.api import LLM
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.structured import StructuredOutputsParams as SO
from draftsmith.server.protocol import ChatCompletionRequest
from draftsmith.server.tools import forced_schema

UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": UNIT}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "weather?"}]


def _stream(h: httpx.Client, body: dict) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat answer as a client accumulates it: content, [(name, arguments)], finish_reason."""
    content, calls, finish = "", {}, None
    with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (ch,) = json.loads(line[6:])["choices"]
            content += ch["delta"].get("content") or ""
            for c in ch["delta"].get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
                else:
                    calls[c["index"]][1] += c["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _whole(h: httpx.Client, body: dict) -> tuple[dict, str]:
    r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (ch,) = r.json()["choices"]
    return ch["message"], ch["finish_reason"]


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


def test_forced_tool_calls_decode_under_their_schema(tiny_dir, tiny_server):
    """tool_choice named and "required": the arguments are LLM.chat's text under the forced
    schema (on an n-gram server too: lossless under speculation), whole = streamed."""
    ref = LLM(str(tiny_dir), max_batch=1, max_len=256)
    # the random model would fill JSON's optional whitespace for ever: steer it off whitespace
    no_ws = {t: -100.0 for c in " \n\r\t" for t in ref.encode(c, add_special_tokens=False)}

    def want(req_body: dict) -> str:
        schema = forced_schema(ChatCompletionRequest.model_validate(req_body))
        sp = SamplingParams(max_tokens=96, temperature=0.0, structured_outputs=SO(json=schema), logit_bias=no_ws)
        return ref.chat(MSGS, sp, tools=TOOLS)[0].text

    base = {"messages": MSGS, "tools": TOOLS, "max_tokens": 96, "temperature": 0,
            "logit_bias": {str(t): b for t, b in no_ws.items()}}
    named = {**base, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    required = {**base, "tool_choice": "required"}
    for url in (tiny_server(), tiny_server(llm_kw={"drafter": "ngram", "policy": "fixed"})):
        with httpx.Client(base_url=url, timeout=60) as h:
            msg, finish = _whole(h, named)
            args = want(named)
            assert json.loads(args)["unit"] in ("c", "f")  # the greedy text is the schema's JSON
            assert msg["content"] is None and _calls(msg) == [("get_weather", args)] and finish == "stop"
            assert msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
            assert _stream(h, named) == ("", [("get_weather", args)], "stop")

            msg, finish = _whole(h, required)
            text = want(required)
            listed = json.loads(text)  # the whole array, ended by the grammar ("stop")
            calls = _calls(msg)
            assert calls == [(c["name"], json.dumps(c["parameters"])) for c in listed]  # each element a call
            assert all(name in ("get_weather", "now") for name, _ in calls)
            assert msg["content"] is None and finish == "tool_calls"  # OpenAI's for "required"
            assert _stream(h, required) == ("", calls, "tool_calls")
            # a model keen on more calls (',' favoured) makes several, or one with parallel_tool_calls off
            comma = {**required["logit_bias"], **{str(t): 8.0 for t in ref.encode(",", add_special_tokens=False)}}
            many = _whole(h, {**required, "logit_bias": comma, "max_tokens": 200})[0]
            one = _whole(h, {**required, "logit_bias": comma, "max_tokens": 200, "parallel_tool_calls": False})
            assert len(_calls(many)) >= 2 and len(_calls(one[0])) == 1 and one[1] == "tool_calls"


def test_auto_tool_choice_reads_hermes_calls(tiny_dir, tiny_server):
    """tool_choice "auto" on a server with the hermes parser: content before the call, the call
    parsed, finish_reason tool_calls, whole = streamed (the tiny model's text forced into a
    call by a regex, as a model that calls tools writes it); without the parser it is a 400."""
    regex = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"unit": "(c|f)"\}\}\n</tool_call>'
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "structured_outputs": {"regex": regex}}
    url = tiny_server(tool_call_parser="hermes")
    with httpx.Client(base_url=url, timeout=60) as h:
        msg, finish = _whole(h, body)
        assert msg["content"] == "Checking.\n" and finish == "tool_calls"
        ((name, args),) = _calls(msg)
        assert name == "get_weather" and json.loads(args)["unit"] in ("c", "f")
        assert _stream(h, body) == ("Checking.\n", [(name, args)], "tool_calls")
        plain = {**body, "structured_outputs": {"regex": r"No call needed\."}}  # no call: all content
        assert _whole(h, plain) == ({"role": "assistant", "content": "No call needed."}, "stop")
        assert _stream(h, plain) == ("No call needed.", [], "stop")
        none = {**body, "tool_choice": "none"}  # the text is not read for calls
        assert _whole(h, none)[0]["content"].startswith("Checking.\n<tool_call>")
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        _assert_openai_error(h.post("/v1/chat/completions", json=body), 400, "tool_choice",
                             says="--enable-auto-tool-choice")


def test_tool_calls_with_n_choices_and_logprobs(tiny_server):
    """n = 2 with logprobs, streamed: each choice read for calls on its own, and every generated
    token's logprobs entry arrives once, though the reader holds the call's text back until its
    end tag (they go with the chunk that carries the call)."""
    regex = r'Hm\.<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 120, "temperature": 0, "n": 2, "logprobs": True,
            "top_logprobs": 1, "structured_outputs": {"regex": regex}}
    with httpx.Client(base_url=tiny_server(tool_call_parser="hermes"), timeout=60) as h:
        whole = h.post("/v1/chat/completions", json=body).json()
        content, calls, entries, usage = {}, {}, {}, None
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with h.stream("POST", "/v1/chat/completions", json=stream) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for ch in chunk["choices"]:
                    i = ch["index"]
                    content[i] = content.get(i, "") + (ch["delta"].get("content") or "")
                    calls[i] = calls.get(i, []) + [c["function"]["name"] for c in ch["delta"].get("tool_calls", [])]
                    entries[i] = entries.get(i, 0) + len((ch["logprobs"] or {}).get("content") or [])
    for ch in whole["choices"]:
        i = ch["index"]
        assert ch["message"]["content"] == content[i] == "Hm." and [c["function"]["name"] for c in
                                                                    ch["message"]["tool_calls"]] == calls[i] == ["now"]
        assert ch["finish_reason"] == "tool_calls" and len(ch["logprobs"]["content"]) == entries[i]
    assert sum(entries.values()) == usage["completion_tokens"] == whole["usage"]["completion_tokens"]


TEMPLATE = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.role }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
            "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}")


def test_a_conversation_with_calls_reaches_the_chat_template(tiny_dir, tiny_server):
    """serve --chat-template: the tools and an assistant's earlier calls (arguments as objects)
    and the tool's answer, as a tool-aware template writes them; LLM.chat the same."""
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    want = '[get_weather][now]user:weather?|assistant:<get_weather {"unit": "c"}>|tool:sunny#c1|'
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    url = tiny_server(chat_template=TEMPLATE)
    with httpx.Client(base_url=url, timeout=60) as h:
        r = h.post("/tokenize", json={"messages": msgs, "tools": TOOLS, "add_generation_prompt": False}).json()
        assert llm.tokenizer.decode(r["tokens"]) == want
        for tools in ([], TOOLS + TOOLS[:1]):  # the tool checks of chat requests
            _assert_openai_error(h.post("/tokenize", json={"messages": msgs, "tools": tools}), 400, "tools")
        body = {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 6, "temperature": 0}
        msg, _ = _whole(h, body)
        sp = SamplingParams(max_tokens=6, temperature=0.0)
        tmpl_msgs = [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"unit": "c"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        assert msg["content"] == llm.chat(tmpl_msgs, sp, tools=TOOLS, chat_template=TEMPLATE)[0].text


@pytest.mark.parametrize("extra,param,says", [
    ({"tools": []}, "tools", "empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one way to constrain"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", "'function'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tool_choice", "bogus"),  # the schema does not compile
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 5000}}],
      "tool_choice": "none"}, "messages", "bytes"),  # tool definitions count toward the prompt's size
])
def test_bad_tool_requests_are_clear_400s(tiny_server, extra, param, says):
    from draftsmith.server.app import Limits

    with httpx.Client(base_url=tiny_server(limits=Limits(max_prompt_bytes=4096)), timeout=60) as h:
        r = h.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **extra})
        _assert_openai_error(r, 400, param, says=says)


def test_serve_tool_and_template_flags(serve_cli, tmp_path):
    """`serve --chat-template` (a file or the template itself, its syntax checked before the model
    loads), `--enable-auto-tool-choice --tool-call-parser hermes`, `--reasoning-parser`, and their
    errors."""
    from draftsmith.errors import DraftsmithError

    run, loads = serve_cli, serve_cli.loads
    kw = run()
    assert kw["chat_template"] is None and kw["tool_call_parser"] is None
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert run("--chat-template", str(path))["chat_template"] == TEMPLATE
    assert run("--chat-template", TEMPLATE)["chat_template"] == TEMPLATE
    hf_only = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert run("--chat-template", hf_only)["chat_template"] == hf_only  # HF's loop controls are Jinja here too
    assert run("--enable-auto-tool-choice", "--tool-call-parser", "hermes")["tool_call_parser"] == "hermes"
    assert run("--tool-call-parser", "hermes")["tool_call_parser"] is None  # auto stays off, as vLLM's
    assert kw["reasoning_parser"] is None and run("--reasoning-parser", "deepseek_r1")["reasoning_parser"] == "deepseek_r1"
    assert kw["structured_outputs_in_reasoning"] is False
    assert run("--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning")["structured_outputs_in_reasoning"]
    assert kw["scheduling_policy"] == "fcfs" and run("--scheduling-policy", "priority")["scheduling_policy"] == "priority"
    n = len(loads)
    for flags, says in [(["--chat-template", str(tmp_path / "missing.jinja")], "neither a file nor"),
                        (["--chat-template", "{% for m in messages %}"], "not a valid Jinja template"),
                        (["--chat-template", str(tmp_path)], "neither a file nor"),  # a directory
                        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                        (["--enable-auto-tool-choice", "--tool-call-parser", "mistral"], "not known"),
                        (["--reasoning-parser", "granite"], "not known")]:
        with pytest.raises(DraftsmithError, match=says):
            run(*flags)
    assert len(loads) == n  # refused before loading the model


def test_a_forced_call_cut_short_is_never_content(tiny_server):
    """tool_choice "required" cut by max_tokens before its first call's object closed (the parity
    report's tools.required_cut: the JSON fragment came back as the message's content): no
    tool_calls and content "" (vLLM's whole answer), finish_reason "length"; streamed, no content
    delta and no call; the Responses and Messages routes (tool_choice "required" / "any") show no
    text either. A named call cut short stays a call with its arguments cut (vLLM's too)."""
    body = {"messages": MSGS, "tools": TOOLS, "max_tokens": 3, "temperature": 0, "tool_choice": "required"}
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        r = h.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        (ch,) = r.json()["choices"]
        assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 3
        assert ch["message"]["content"] == "" and "tool_calls" not in ch["message"]
        assert _stream(h, body) == ("", [], "length")
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        msg, finish = _whole(h, named)
        assert msg["content"] is None and finish == "length" and [n for n, _ in _calls(msg)] == ["get_weather"]

        rtools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                  for t in TOOLS]
        resp = h.post("/v1/responses", json={"input": "weather?", "tools": rtools, "tool_choice": "required",
                                             "max_output_tokens": 3, "temperature": 0}).json()
        assert resp["status"] == "incomplete" and [i["type"] for i in resp["output"]] == ["message"]
        assert [c["text"] for c in resp["output"][0]["content"]] in ([], [""])  # (an empty message: no JSON)
        mtools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        m = h.post("/v1/messages", json={"model": "tiny", "messages": MSGS, "tools": mtools, "max_tokens": 3,
                                        "tool_choice": {"type": "any"}, "temperature": 0}).json()
        assert m["stop_reason"] == "max_tokens" and m["content"] == []

"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on the tiny test server,
through the official `anthropic` client: the chat route's greedy answer to the same conversation
as a Message, whole and streamed (the client's final message = the whole one, ids aside; every
event of the SSE stream checked against the package's types); stop_reason max_tokens,
stop_sequence (with the sequence), end_turn and tool_use; a forced tool call whose input keeps
to the schema, and its round trip (tool_use, thinking and tool_result blocks reaching the chat
template as the chat route's messages: the same prompt, the same answer); an open think block
answered as a thinking block; count_tokens = the chat route's prompt; usage with the prefix
cache's tokens apart (whole: the chat route's cached_tokens; a stream gives the prompt whole in
both its usages); system messages and Claude Code's billing header; vLLM's extras (seed,
priority, chat_template_kwargs); the key as x-api-key (or Bearer); bad requests as Anthropic's
400s naming the field, and every other error on these paths (405, 413, 429, 500, 503) in
Anthropic's shape; an engine error midway as `event: error`. Without a model: reasoning, text and
calls as blocks in order, whatever the split of the answer; a cut call's input read as the
anthropic package reads it (jiter's partial mode), whole = streamed.

One server serves the module (starting one per test would cost more than the tests)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from pydantic import TypeAdapter
from test_server_responses_api import THINKING_TEMPLATE
from test_server_unit import _fail_step, _ThreadServer, tiny_dir  # noqa: F401 (fixture)

from draftsmith.api import LLM

KEY = "sk-local"
COMPACT = {"whitespace_flexible": False}  # (llguidance: no free whitespace; the random model loves "\r")
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False, "x-guidance": COMPACT}
NOW = {"type": "object", "properties": {}, "additionalProperties": False, "x-guidance": COMPACT}
TOOLS = [{"name": "get_weather", "description": "The weather now.", "input_schema": UNIT},
         {"name": "now", "input_schema": NOW}]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                                **({"description": t["description"]} if "description" in t else {})}}
              for t in TOOLS]
GREEDY = {"extra_body": {"temperature": 0}}
TEMPLATE = THINKING_TEMPLATE + "{% if shout %}SHOUT{% endif %}"  # (a variable for chat_template_kwargs)  # (anthropic 1.x's create has no temperature argument)
_EVENT = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def server(tiny_dir):
    """The module's server: key KEY, a tool-aware template that writes an assistant's reasoning,
    --reasoning-parser qwen3, --tool-call-parser hermes, prefix caching."""
    from draftsmith.server.app import ServeOptions, create_app

    llm = LLM(str(tiny_dir), max_batch=2, max_len=256, enable_prefix_caching=True)
    opts = ServeOptions(chat_template=TEMPLATE, reasoning_parser="qwen3", tool_call_parser="hermes")
    s = _ThreadServer(create_app(llm, "tiny", api_key=KEY, options=opts))
    s.url = s.start()
    yield s
    s.stop()


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def h(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _chat(h: httpx.Client, messages: list[dict], **body) -> dict:
    r = h.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _events(h: httpx.Client, body: dict) -> list[dict]:
    """A streamed Message's events (each `event:` line its data's type; each an SDK event), checked:
    message_start first, message_delta and message_stop last, each block started, built and
    stopped before the next one starts."""
    events, kind = [], None
    with h.stream("POST", "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == kind
                _EVENT.validate_python(events[-1])
    assert events[0]["type"] == "message_start" and [e["type"] for e in events[-2:]] == ["message_delta",
                                                                                       "message_stop"]
    open_, started = None, 0
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_ is None and e["index"] == started
            open_, started = started, started + 1
        else:
            assert e["index"] == open_, e
            open_ = None if e["type"] == "content_block_stop" else open_
    assert open_ is None
    return events


def _bare(m: Message) -> dict:
    """`m` without its ids, its usage's prompt tokens as one number (prefix caching splits them
    differently from one request to the next)."""
    d = m.model_dump(exclude={"id"})
    u = d["usage"]
    u["input_tokens"] += u.pop("cache_read_input_tokens") or 0
    for block in d["content"]:
        block.pop("id", None)
        block.pop("parsed_output", None)  # (the stream's ParsedTextBlock)
    return d


def _count(client: anthropic.Anthropic, **body) -> int:
    return client.messages.count_tokens(model="tiny", **body).input_tokens


def test_a_message_is_the_chat_routes_answer(client, h):
    """system + a user message: the chat route's greedy answer as one text block, max_tokens as
    stop_reason, usage (input_tokens + cache_read_input_tokens = the chat route's prompt =
    count_tokens; the second request reads the prompt from the prefix cache, as many tokens as
    the chat route's cached_tokens for the same request); streamed (text_stream, the final
    message) = whole, ids aside; the raw events in Anthropic's order, message_start's and
    message_delta's usage split as the whole Message's (message_start goes out with the first
    content, when the prefix cache's count is known)."""
    msgs = [{"role": "user", "content": "hi"}]
    chat = _chat(h, [{"role": "system", "content": "Be brief."}, *msgs], max_tokens=8)
    body = {"model": "tiny", "max_tokens": 8, "system": "Be brief.", "messages": msgs, "metadata": {"user_id": "u"},
            "service_tier": "auto", "thinking": {"type": "disabled"}}
    m = client.messages.create(**body, extra_body={"temperature": 0, "unknown": 1})
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", "tiny")
    assert [(b.type, b.text) for b in m.content] == [("text", chat["choices"][0]["message"]["content"])]
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    prompt = chat["usage"]["prompt_tokens"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt == _count(client, system="Be brief.",
                                                                                       messages=msgs)
    assert m.usage.output_tokens == 8 and m.usage.cache_read_input_tokens > 0  # (chat's request cached its prompt)
    again = _chat(h, [{"role": "system", "content": "Be brief."}, *msgs], max_tokens=8)["usage"]
    m2 = client.messages.create(**body, **GREEDY)
    assert m2.usage.cache_read_input_tokens == again["prompt_tokens_details"]["cached_tokens"] > 0
    with client.messages.stream(**body, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and _bare(final) == _bare(m)
    events = _events(h, {**body, "temperature": 0})
    start = events[0]["message"]
    usage = {"input_tokens": m2.usage.input_tokens, "cache_read_input_tokens": m2.usage.cache_read_input_tokens}
    assert (start["content"], start["stop_reason"], start["usage"]) == ([], None, {**usage, "output_tokens": 0})
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == tuple(usage.values())
    assert [e["type"] for e in events[1:3]] == ["content_block_start", "content_block_delta"] and events[1][
        "content_block"] == {"type": "text", "text": ""}
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == {**usage, "output_tokens": 8}


def test_stop_sequences_and_end_turn(client, h):
    """A stop sequence the greedy answer writes ends it there: stop_reason "stop_sequence" with the
    sequence, which the text leaves out (whole and streamed); an answer the model ends itself
    (here an output_config json_schema grammar's) is "end_turn", the chat route's text."""
    msgs = [{"role": "user", "content": "go"}]
    text = client.messages.create(model="tiny", max_tokens=12, messages=msgs, **GREEDY).content[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 2) if text.index(text[i:i + 2]) == i)  # (first at i)
    body = {"model": "tiny", "max_tokens": 12, "messages": msgs, "stop_sequences": ["never written", stop]}
    m = client.messages.create(**body, **GREEDY)
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", stop, text[:text.index(stop)])
    with client.messages.stream(**body, **GREEDY) as s:
        assert _bare(s.get_final_message()) == _bare(m)
    schema = {"enum": ["yes", "no"]}
    m = client.messages.create(model="tiny", max_tokens=12, messages=msgs, extra_body={  # (newer clients: an argument)
        "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    chat = _chat(h, msgs, max_tokens=12, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "o", "schema": schema}})
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None)
    assert m.content[0].text == chat["choices"][0]["message"]["content"] and json.loads(m.content[0].text) in ("yes",
                                                                                                                "no")


def test_a_tool_use_round_trip(client, h):
    """tool_choice {"type": "tool"} forces a call: one tool_use block (toolu_ id, the name, an input
    that keeps to the schema, the chat route's arguments), stop_reason "tool_use"; streamed as
    input_json_delta pieces, the final message the whole one. The assistant's turn sent back (a
    thinking block, the tool_use) with a tool_result (is_error: its content after "Error: ") and,
    in a user message of its own (one turn with the one before, as Anthropic merges them), text
    is the chat route's conversation: the same prompt (count_tokens = /tokenize) and answer.
    "any" (sampled, seed 0: the random model writes the call array's whitespace forever when
    greedy) with disable_parallel_tool_use is the chat route's "required" with
    parallel_tool_calls false: one tool_use; without it the same seed makes two calls."""
    msgs = [{"role": "user", "content": "weather?"}]
    body = {"model": "tiny", "max_tokens": 40, "messages": msgs, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    m = client.messages.create(**body, **GREEDY)
    (call,) = m.content
    chat = _chat(h, msgs, max_tokens=40, tools=CHAT_TOOLS,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (want,) = chat["choices"][0]["message"]["tool_calls"]
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", json.loads(want["function"]["arguments"]))
    assert call.id.startswith("toolu_") and call.input["unit"] in ("c", "f") and m.stop_reason == "tool_use"
    with client.messages.stream(**body, **GREEDY) as s:
        assert _bare(s.get_final_message()) == _bare(m)
    events = _events(h, {**body, "temperature": 0})
    assert events[1]["content_block"]["input"] == {} and json.loads("".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")) == call.input

    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": "look", "signature": "sig"},
                                             *[b.to_dict() for b in m.content]]}
    back = [*msgs, turn, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny"}],
         "is_error": True}]}, {"role": "user", "content": [{"type": "text", "text": "thanks"}]}]
    chat_back = [*msgs, {"role": "assistant", "content": None, "reasoning": "look", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Error: sunny"},
                 {"role": "user", "content": "thanks"}]
    tok = h.post("/tokenize", json={"messages": chat_back, "tools": CHAT_TOOLS}).json()
    assert _count(client, messages=back, tools=TOOLS) == tok["count"]
    assert f'assistant:(look)<get_weather {json.dumps(call.input)}>|tool:Error: sunny#{call.id}|user:thanks|' in (
        h.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"])
    m = client.messages.create(model="tiny", max_tokens=6, messages=back, tools=TOOLS, tool_choice={"type": "none"},
                               **GREEDY)
    chat = _chat(h, chat_back, max_tokens=6, tools=CHAT_TOOLS, tool_choice="none")
    assert [b.text for b in m.content] == [chat["choices"][0]["message"]["content"]]

    sampled = {**body, "max_tokens": 200, "extra_body": {"temperature": 1, "seed": 0}}
    m = client.messages.create(**{**sampled, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    msg = _chat(h, msgs, max_tokens=200, tools=CHAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=1, seed=0)["choices"][0]["message"]
    (one,) = m.content
    assert one.type == "tool_use" and m.stop_reason == "tool_use" and [(one.name, one.input)] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    m = client.messages.create(**{**sampled, "tool_choice": {"type": "any"}})
    assert [b.type for b in m.content] == ["tool_use", "tool_use"] and m.stop_reason == "tool_use"


def test_an_open_think_block_is_a_thinking_block(client, h):
    """An assistant's last message (prefill) is continued; one that opens a think block makes the
    answer reasoning (--reasoning-parser qwen3): a thinking block (signature ""), the chat route's
    reasoning for the same conversation, streamed as thinking_delta events."""
    msgs = [{"role": "user", "content": "think"}, {"role": "assistant", "content": "<think>\nplan"}]
    m = client.messages.create(model="tiny", max_tokens=6, messages=msgs, **GREEDY)
    chat = _chat(h, msgs, max_tokens=6, continue_final_message=True, add_generation_prompt=False)
    (block,) = m.content
    assert (block.type, block.thinking, block.signature) == ("thinking", chat["choices"][0]["message"]["reasoning"], "")
    assert m.stop_reason == "max_tokens"
    events = _events(h, {"model": "tiny", "max_tokens": 6, "messages": msgs, "temperature": 0})
    assert events[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta") == block.thinking


def test_the_key_goes_as_x_api_key_or_bearer(server):
    """With --api-key, both routes take the key as `x-api-key` (the anthropic client's) or
    `Authorization: Bearer`; a wrong or missing key is a 401 in Anthropic's shape."""
    body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    ok = [anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0),
          anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)]
    for c in ok:
        assert c.messages.create(**body).usage.output_tokens == 1
        assert c.messages.count_tokens(model="tiny", messages=body["messages"]).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert "x-api-key" in r.json()["error"]["message"]


def _assert_anthropic_error(r: httpx.Response, status: int, says: str, kind: str = "invalid_request_error") -> None:
    assert r.status_code == status, r.text
    d = r.json()
    assert d == {"type": "error", "error": {"type": kind, "message": d["error"]["message"]}}, d
    assert says in d["error"]["message"], d
    assert "Traceback" not in d["error"]["message"]


def test_bad_requests_are_anthropic_400s_naming_the_field(client, h):
    """Every mistake is a 400 in Anthropic's shape whose message names the field; the client
    raises it as a BadRequestError. An unknown model and the routes this server has not are 404s."""
    user = [{"role": "user", "content": "hi"}]
    base = {"model": "tiny", "max_tokens": 4, "messages": user}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    call = {"type": "tool_use", "id": "t", "name": "f"}  # (no input)
    for body, says in [
        ({"model": "tiny", "messages": user}, "max_tokens: Field required"),
        ({**base, "max_tokens": 0}, "max_tokens must be at least 1"),
        ({**base, "messages": []}, "messages: give at least one user or assistant message"),
        ({**base, "messages": [{"role": "system", "content": "x"}]}, "give at least one user or assistant message"),
        ({**base, "messages": [{"role": "tool", "content": "x"}]},
         "messages[0].role: must be 'user', 'assistant' or 'system'"),
        ({**base, "messages": [*user, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                        {**call, "input": {}}]}]},
         "messages[1].content[1]: the last assistant turn, which the answer would continue, has a tool_use"),
        ({**base, "messages": [*user, {"role": "assistant", "content": [{**call, "input": {}}]},
                               {"role": "assistant", "content": "more"}]},  # (one turn: the call would be lost)
         "messages[1].content[0]: the last assistant turn, which the answer would continue, has a tool_use"),
        ({**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]},
         "messages[0].content[1]: image blocks are not supported"),
        ({**base, "messages": [*user, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages[1].content[0]: tool_result blocks do not belong in assistant messages"),
        ({**base, "messages": [{"role": "user", "content": [{**call, "input": {}}]}]},
         "messages[0].content[0]: tool_use blocks do not belong in user messages"),
        ({**base, "messages": [*user, {"role": "assistant", "content": [call]}]},
         "messages[1].content[0].input: Field required"),
        ({**base, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                             "content": [image]}]}]},
         "messages[0].content[0].content[0]: image blocks are not supported"),
        ({**base, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({**base, "system": [{"type": "image"}]}, "system[0]: image blocks are not supported"),
        ({**base, "stop_sequences": "x"}, "stop_sequences: Input should be a valid list"),
        ({**base, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0]: tools of type 'web_search_20250305' are not supported"),
        ({**base, "tools": [{"name": "f"}]}, "tools[0].input_schema: Field required"),
        ({**base, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({**base, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice names 'nope'"),
        ({**base, "tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({**base, "tool_choice": {"type": "sometimes"}}, "tool_choice.type: Input should be"),
        ({**base, "thinking": "on"}, "thinking: Input should be a valid dictionary"),
        ({**base, "tools": [TOOLS[0], {"name": "f", "input_schema": {"type": "object", "properties": {
            "a": {"type": "nonsense"}}}}], "tool_choice": {"type": "any"}}, "tools[1].input_schema: "),
        ({**base, "tools": [{"name": "g", "input_schema": {"type": "object", "properties": {"a": {"type": "bad"}}}},
                            {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "bad"}}}}],
          "tool_choice": {"type": "tool", "name": "f"}}, "tools[1].input_schema: "),  # the named tool's
        ({**base, "chat_template_kwargs": {"tokenize": 1}},
         "chat_template_kwargs: tokenize is not a template variable"),
        ({**base, "output_config": {"format": {"type": "xml"}}}, "output_config.format must be"),
        ({**base, "output_format": {"type": "xml"}}, "output_config.format must be"),
        ({**base, "output_format": {"type": "json_schema", "schema": {}},
          "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_format and output_config.format"),
        ({**base, "max_tokens": 500}, "maximum context length is 256 tokens"),
        ({**base, "temperature": "hot"}, "temperature: Input should be a valid number"),
    ]:
        _assert_anthropic_error(h.post("/v1/messages", json=body), 400, says)
    _assert_anthropic_error(h.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": [
        {"role": "user", "content": [image]}]}), 400, "messages[0].content[0]: image blocks are not supported")
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    _assert_anthropic_error(h.post("/v1/messages", json={**base, "model": "claude"}), 404, "tiny", "not_found_error")
    _assert_anthropic_error(h.post("/v1/messages/batches", json={}), 404, "not supported", "not_found_error")


def test_every_error_on_these_paths_is_anthropics(server, h, monkeypatch):
    """Not only the handlers' own errors: a 405 (GET /v1/messages), a body over the size limit
    (413 request_too_large), a busy server (429 rate_limit_error), the engine not running (503,
    api_error: Anthropic's overloaded_error is its 529) and an unexpected exception (500 api_error)
    are in Anthropic's shape on these paths; the chat route's stay OpenAI's."""
    from draftsmith.server import routes

    st = server.app.app.state.server
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    _assert_anthropic_error(h.get("/v1/messages"), 405, "Method Not Allowed")
    big = {**body, "metadata": {"pad": "x" * st.limits.max_body_bytes}}
    _assert_anthropic_error(h.post("/v1/messages", json=big), 413, "larger than this server's limit",
                            "request_too_large")
    st.queued_tokens = st.max_queued_tokens  # (as if other requests held the queue)
    try:
        _assert_anthropic_error(h.post("/v1/messages", json=body), 429, "the server is busy", "rate_limit_error")
    finally:
        st.queued_tokens = 0
    monkeypatch.setattr(type(st.loop), "alive", property(lambda self: False))
    _assert_anthropic_error(h.post("/v1/messages", json=body), 503, "the engine is not running", "api_error")
    monkeypatch.undo()

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(routes, "messages_chat_request", boom)
    t = TestClient(server.app.app, raise_server_exceptions=False)  # (uvicorn drops the connection after it;
    _assert_anthropic_error(t.post("/v1/messages", json=body, headers={"x-api-key": KEY}), 500,  # no lifespan)
                            "internal server error: RuntimeError", "api_error")
    monkeypatch.undo()
    r = h.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def _billing(nonce: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.154.abc; cc_entrypoint=cli; cch={nonce};"


def test_system_messages_and_the_billing_header(client, h):
    """Messages of role system (a string or text blocks, anywhere) join `system` in one system
    message, in order; a user message on each side of one is one turn. Claude Code's billing
    header (a block of `system`, a line of a system string) is left out: two requests that differ
    only in its nonce render the same prompt, so the second reads it from the prefix cache (as
    many tokens as the chat route's same conversation does)."""
    msgs = [{"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "there"}, {"role": "system", "content": _billing("ffff") + "\nNo lies."}]
    chat_msgs = [{"role": "system", "content": "You are Claude Code.\nBe brief.\nNo lies."},
                 {"role": "user", "content": "hi\nthere"}]
    tok = h.post("/tokenize", json={"messages": chat_msgs}).json()
    blocks = [{"type": "text", "text": _billing("1a2b3")}, {"type": "text", "text": "You are Claude Code."}]
    assert _count(client, system=blocks, messages=msgs) == tok["count"]
    assert _count(client, system=_billing("zz") + "\nYou are Claude Code.", messages=msgs) == tok["count"]
    one_block = [{"type": "text", "text": _billing("77") + "\nYou are Claude Code."}]  # header and text in one block
    assert _count(client, system=one_block, messages=msgs) == tok["count"]
    after = [*msgs, {"role": "assistant", "content": "ok"}]  # a system message after an assistant's: no prefill
    turn = _count(client, system="S", messages=[*after, {"role": "system", "content": "T"}])
    assert turn > _count(client, system="S\nT", messages=after)  # the turn closed, a new one opened: not continued
    body = {"model": "tiny", "max_tokens": 2, "messages": msgs}
    first = client.messages.create(**body, system=blocks, **GREEDY)
    cached = _chat(h, chat_msgs, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]
    blocks[0]["text"] = _billing("9f8e7")
    m = client.messages.create(**body, system=blocks, **GREEDY)
    assert m.usage.cache_read_input_tokens == cached > 0 and m.content == first.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == tok["count"]


def test_vllm_extras_reach_the_chat_request(client, h):
    """vLLM's fields, sent in extra_body: temperature 1 with seed 7 is one answer three times (the
    chat route's); priority without --scheduling-policy priority is the chat route's 400;
    chat_template_kwargs reaches the template (count_tokens and usage count what /tokenize does);
    structured_outputs constrains the answer; min_p, repetition_penalty and cache_salt are taken.
    `thinking` of any type is accepted (and has no effect)."""
    user = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny", "max_tokens": 6, "messages": user}
    seeded = {"temperature": 1, "seed": 7, "min_p": 0.0, "repetition_penalty": 1.0, "cache_salt": "s"}
    got = [_bare(client.messages.create(**body, extra_body=seeded)) for _ in range(3)]
    assert got[0] == got[1] == got[2]
    chat = _chat(h, user, max_tokens=6, **seeded)["choices"][0]["message"]
    assert "".join(b.get("text") or b.get("thinking") for b in got[0]["content"]) == (
        (chat["reasoning"] or "") + (chat["content"] or ""))
    r, c = (h.post(path, json={**body, "priority": 1}) for path in ("/v1/messages", "/v1/chat/completions"))
    _assert_anthropic_error(r, 400, c.json()["error"]["message"])
    shout = {"chat_template_kwargs": {"shout": True}}
    tok = h.post("/tokenize", json={"messages": user, **shout}).json()
    assert h.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("SHOUT")
    assert _count(client, messages=user, extra_body=shout) == tok["count"] > _count(client, messages=user)
    u = client.messages.create(**body, extra_body={**shout, "temperature": 0}).usage
    assert u.input_tokens + u.cache_read_input_tokens == tok["count"]
    m = client.messages.create(**body, extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 0})
    assert m.content[0].text in ("yes", "no") and m.stop_reason == "end_turn"
    for thinking in ({"type": "enabled"}, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 1024}):
        assert h.post("/v1/messages", json={**body, "max_tokens": 1, "thinking": thinking}).status_code == 200
    # the structured-outputs beta's output_format is output_config.format (it was ignored: free text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    beta = h.post("/v1/messages", json={**body, "max_tokens": 24, "temperature": 0,
                                        "output_format": {"type": "json_schema", "schema": schema}}).json()
    fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    want = _chat(h, user, max_tokens=24, temperature=0, response_format=fmt)["choices"][0]["message"]["content"]
    assert beta["content"][0]["text"] == want and want.lstrip().startswith("{"), beta


def test_a_call_cut_by_max_tokens_is_the_same_whole_and_streamed(client, h):
    """A forced call cut by max_tokens: the whole Message (its input what the anthropic package's
    stream accumulator reads from the cut arguments) is the streamed one, at every cut (the
    compact arguments' keys end in tokens that close the object too: the input is {} or whole)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    inputs = []
    for n in range(2, 12):
        m = client.messages.create(**body, max_tokens=n, **GREEDY)
        with client.messages.stream(**body, max_tokens=n, **GREEDY) as s:
            assert _bare(s.get_final_message()) == _bare(m), n
        inputs.append(m.content[0].input)
    assert inputs[0] == {} and inputs[-1].get("unit") in ("c", "f"), inputs


def test_auto_tool_choice_needs_the_tool_call_parser():
    """tools without tool_choice ask for "auto" (Anthropic's default), which reads calls from free
    text: a server without --tool-call-parser refuses it in Anthropic's words."""
    from draftsmith.server.messages_error import AnthropicError
    from draftsmith.server.messages_request import MessagesRequest, chat_request

    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "tools": TOOLS,
                                          "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(AnthropicError, match="--tool-call-parser hermes.*\"type\": \"any\""):
        chat_request(req, auto_tools=False)
    assert chat_request(req, auto_tools=True).tool_choice == "auto"


def test_an_engine_error_midway_is_an_error_event(server, client, h):
    """A step that fails midway: the stream's last event is `error` (Anthropic's body, api_error),
    which the client raises; the server serves on."""
    body = {"model": "tiny", "max_tokens": 30, "messages": [{"role": "user", "content": "fail"}]}
    _fail_step(server.app.app.state.server.llm.engine, after=3)
    with h.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error" and json.loads(lines[-1][6:]) == {
        "type": "error", "error": {"type": "api_error", "message": json.loads(lines[-1][6:])["error"]["message"]}}
    _fail_step(server.app.app.state.server.llm.engine, after=3)
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(**body) as s:
            s.get_final_message()
    assert client.messages.create(**body).stop_reason in ("end_turn", "max_tokens")


THINK_TEXT_CALLS = ('<think>plan</think>Hi.<tool_call>{"name": "now", "arguments": {}}</tool_call>\nThen.\n'
                    '<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>\nBye')


def _blocks(text: str, cuts: list[int], finish: str = "stop") -> tuple[list[dict], list[dict], tuple]:
    """`text` read by a chat answer's reader (reasoning, hermes calls) in pieces cut at `cuts`: the
    content blocks, their events, the stop_reason."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.messages_content import MessageContent
    from draftsmith.server.answer import PartsReader
    from draftsmith.server.tools import ToolPlan

    reader = PartsReader(AnswerFormat(ToolPlan("auto", parser="hermes"), reasoning=True).reader(always=True))
    content, events = MessageContent(), []
    bounds = [0, *cuts, len(text)]
    for k in range(len(bounds) - 1):
        piece = text[bounds[k]:bounds[k + 1]]
        d = reader.finish(piece) if k == len(bounds) - 2 else reader.push(piece)
        events += content.read(d.get("parts", []))
    events += content.end()
    return content.blocks, events, content.stop_reason(reader.finish_reason(finish), None)


def test_blocks_follow_the_answer_however_it_is_split():
    """The content builder alone: reasoning, text, a call, text, a call, text are six blocks in
    that order, the same whether the answer comes whole, in two pieces (every cut) or a character
    at a time; each block's events (start, deltas, stop) build it, before the next one starts;
    stop_reason "tool_use"."""
    blocks, events, stop = _blocks(THINK_TEXT_CALLS, [])
    got = [(b["type"], b.get("thinking") or b.get("text") or (b["name"], b["input"])) for b in blocks]
    assert got == [("thinking", "plan"), ("text", "Hi."), ("tool_use", ("now", {})), ("text", "\nThen."),
                   ("tool_use", ("f", {"a": [1]})), ("text", "\nBye")]
    assert stop == ("tool_use", None) and all(b["id"].startswith("toolu_") for b in blocks if b["type"] == "tool_use")
    n = len(THINK_TEXT_CALLS)
    for cuts in [*([i] for i in range(1, n)), list(range(1, n))]:
        split, events, _ = _blocks(THINK_TEXT_CALLS, cuts)
        assert [{k: v for k, v in b.items() if k != "id"} for b in split] == [
            {k: v for k, v in b.items() if k != "id"} for b in blocks], cuts
        rebuilt: list[dict] = []
        for e in events:
            _EVENT.validate_python(e)
            if e["type"] == "content_block_start":
                assert e["index"] == len(rebuilt)
                rebuilt.append({**e["content_block"], "json": ""})
            elif e["type"] == "content_block_delta":
                field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "json"}[
                    e["delta"]["type"]]
                rebuilt[e["index"]][field] += e["delta"]["partial_json" if field == "json" else field]
            else:
                b = rebuilt[e["index"]]
                if b["type"] == "tool_use":
                    b["input"] = json.loads(b["json"])
                del b["json"]
        assert rebuilt == split
    assert _blocks('<think>a', [], "length")[1:] == ([
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                      "signature": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "a"}},
        {"type": "content_block_stop", "index": 0}], ("max_tokens", None))
    assert _blocks("", [])[0] == [] and _blocks("", [])[2] == ("end_turn", None)


def test_a_cut_call_is_read_as_the_anthropic_package_reads_it():
    """A call the answer's end cuts: its block's input is what the package's accumulator makes of
    the streamed input_json_delta pieces (jiter's partial mode: completed keys kept, an unfinished
    string, number or literal dropped); partial_json agrees with jiter at every cut of JSON texts."""
    from jiter import from_json

    from draftsmith.server.partial_json import loads_partial

    from anthropic.lib.streaming._messages import accumulate_event

    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.messages_content import MessageContent
    from draftsmith.server.tools import ToolPlan

    reader, content = AnswerFormat(ToolPlan("named", name="f")).parts_reader(), MessageContent()
    cut = '{"unit": "fahrenheit", "days": [1, 2], "note": "it is'
    events = content.read(reader.push(cut[:20])["parts"]) + content.read(reader.finish(cut[20:])["parts"])
    events += content.end()
    blocks = content.blocks
    assert blocks[0]["input"] == {"unit": "fahrenheit", "days": [1, 2]}
    assert content.stop_reason(reader.finish_reason("length"), None) == ("max_tokens", None)

    snap, bufs = None, {}
    for e in [{"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "model": "t",
                                                    "content": [], "stop_reason": None, "stop_sequence": None,
                                                    "usage": {"input_tokens": 1, "output_tokens": 0}}}, *events]:
        snap = accumulate_event(event=_EVENT.validate_python(e), current_snapshot=snap, json_bufs=bufs)
    assert snap.content[0].input == blocks[0]["input"]
    for doc in ['{"unit": "fahrenheit", "n": [1, 2.5, -3e2, true, false, null, {"k": "v\\"q\\u00e9"}], "o": {}, '
                '"e": [], "z": -0, "t": "\u00e9\U0001F600"}', '{ "a" : [ 1 , { "b" : null } ] , "c" : "x y" }',
                '[1, "a", {"b": [true]}]']:
        for k in range(len(doc) + 1):
            try:
                want = ("ok", from_json(doc[:k].encode(), partial_mode=True))
            except ValueError:
                want = ("error",)
            try:
                got = ("ok", loads_partial(doc[:k]))
            except ValueError:
                got = ("error",)
            assert got == want, doc[:k]
    from draftsmith.server.messages_content import _input

    assert _input('{"a": ' + "[" * 5000) == {}  # nesting deeper than the reader follows: no input, no 500

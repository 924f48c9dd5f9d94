"""POST /v1/responses on the tiny test server: the chat route's answer as a Response, whole and
streamed (the final response.completed = the whole response, ids aside; every object checked
against the official `openai` package's types); text.format = the chat route's response_format;
function tools named, required and auto (with reasoning) as function_call items; input items
(function_call, function_call_output, ...) reaching the chat template; incomplete at
max_output_tokens; bad requests and stored-response routes as clear 4xx errors."""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent, ResponseUsage
from pydantic import TypeAdapter
from test_server_tools import TEMPLATE
from test_server_unit import _assert_openai_error, tiny_dir, tiny_server  # noqa: F401 (fixtures)

from draftsmith.api import LLM
from draftsmith.core.sampling import SamplingParams

COMPACT = {"whitespace_flexible": False}  # (llguidance: no free whitespace; the random model loves "\r")
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False, "x-guidance": COMPACT}
NOW = {"type": "object", "properties": {}, "additionalProperties": False, "x-guidance": COMPACT}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": UNIT},
         {"type": "function", "name": "now", "parameters": NOW}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
_EVENT = TypeAdapter(ResponseStreamEvent)


def _sdk(response: dict) -> None:
    """`response` parses as the openai package's Response (its usage: the fields vLLM sends,
    without OpenAI's newer cache_write_tokens)."""
    Response.model_validate({**response, "usage": None})
    u = response["usage"]
    if u is not None:
        assert set(u) == set(ResponseUsage.model_fields)
        assert u["input_tokens_details"].keys() == {"cached_tokens"} and u["output_tokens_details"].keys() == {
            "reasoning_tokens"}
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]


def _bare(obj):
    """`obj` without what differs between two answers to one request: ids and created_at."""
    if isinstance(obj, dict):
        return {k: None if k in ("id", "call_id", "item_id", "created_at") else _bare(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_bare(x) for x in obj]
    return obj


def _whole(h: httpx.Client, body: dict) -> dict:
    r = h.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "response" and d["id"].startswith("resp_") and d["error"] is None
    _sdk(d)
    return d


def _stream(h: httpx.Client, body: dict) -> tuple[list[dict], dict]:
    """The events of a streamed response (each checked: SDK type, `event:` line, sequence), and
    its final Response, checked against the items' events (done items, text rebuilt from deltas)."""
    events, kind = [], None
    with h.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind
                events.append(ev)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed"
    for ev in events:
        _EVENT.validate_python({**ev, "response": {**ev["response"], "usage": None}} if "response" in ev else ev)
    final = events[-1]["response"]
    _sdk(final)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert [i["id"] for i in added] == [i["id"] for i in final["output"]]
    assert [done[i] for i in sorted(done)] == final["output"]
    for i, item in enumerate(final["output"]):
        pieces = {t: "".join(e["delta"] for e in events if e["type"] == t and e["output_index"] == i)
                  for t in ("response.output_text.delta", "response.reasoning_text.delta",
                            "response.function_call_arguments.delta")}
        if item["type"] == "message":
            assert pieces["response.output_text.delta"] == item["content"][0]["text"]
        elif item["type"] == "reasoning":
            assert pieces["response.reasoning_text.delta"] == item["content"][0]["text"]
        else:
            assert pieces["response.function_call_arguments.delta"] == item["arguments"]
    return events, final


def _text(d: dict) -> str:
    (msg,) = [i for i in d["output"] if i["type"] == "message"]
    return msg["content"][0]["text"]


def test_a_response_whole_and_streamed(tiny_dir, tiny_server):
    """Text in, text out: the chat route's greedy answer to [instructions as a system message,
    the input as a user's] as a Response ("incomplete" at max_output_tokens, "completed" where
    the answer ends), the request's fields echoed, usage; streamed = whole."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (ref,) = llm.chat(msgs, SamplingParams(max_tokens=8, temperature=0.0))
    assert ref.finish_reason == "length"
    body = {"model": "tiny", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0,
            "metadata": {"k": "v"}, "user": "u1", "store": False, "reasoning": {"effort": "low"}, "unknown": 1}
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        d = _whole(h, body)
        assert (d["status"], d["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
        (msg,) = d["output"]
        assert msg["id"].startswith("msg_") and (msg["type"], msg["role"], msg["status"]) == (
            "message", "assistant", "incomplete")
        assert msg["content"] == [{"type": "output_text", "text": ref.text, "annotations": [], "logprobs": []}]
        assert d["usage"] == {"input_tokens": len(llm.apply_chat_template(msgs)), "input_tokens_details": {
            "cached_tokens": 0}, "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(llm.apply_chat_template(msgs)) + 8}
        assert {k: d[k] for k in ("model", "instructions", "max_output_tokens", "metadata", "user", "reasoning",
                                  "temperature", "top_p", "tool_choice", "tools", "text", "parallel_tool_calls")} == {
            "model": "tiny", "instructions": "Be brief.", "max_output_tokens": 8, "metadata": {"k": "v"},
            "user": "u1", "reasoning": {"effort": "low"}, "temperature": 0.0, "top_p": 1.0, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "parallel_tool_calls": True}
        events, final = _stream(h, body)
        assert _bare(final) == _bare(d)
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * (len(events) - 8), "response.output_text.done",
            "response.content_part.done", "response.output_item.done", "response.completed"]
        # an answer that ends ("completed"); vLLM's structured_outputs, as on chat; logprobs asked for
        ends = {"input": "hi", "temperature": 0, "structured_outputs": {"regex": "Hello\\."},
                "include": ["message.output_text.logprobs"], "top_logprobs": 2}
        d = _whole(h, ends)
        assert (d["status"], d["incomplete_details"], _text(d), d["output"][0]["status"]) == (
            "completed", None, "Hello.", "completed")
        lp = d["output"][0]["content"][0]["logprobs"]
        assert len(lp) == d["usage"]["output_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lp)
        events, final = _stream(h, ends)
        assert _bare(final) == _bare(d)
        assert [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]] == lp


def test_text_format_is_the_chat_routes_response_format(tiny_server):
    """text.format json_schema / json_object: the answer the chat route gives under the same
    response_format (json_schema: parseable JSON of the schema), whole = streamed; echoed."""
    schema = {"enum": ["yes", "no"]}
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        for fmt, rf in [({"type": "json_schema", "name": "yn", "schema": schema, "strict": True},
                         {"type": "json_schema", "json_schema": {"name": "yn", "schema": schema}}),
                        ({"type": "json_object"}, {"type": "json_object"})]:
            chat = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "json?"}],
                                                        "max_tokens": 24, "temperature": 0, "response_format": rf})
            body = {"input": "json?", "max_output_tokens": 24, "temperature": 0, "text": {"format": fmt}}
            d = _whole(h, body)
            assert _text(d) == chat.json()["choices"][0]["message"]["content"] and d["text"] == {"format": fmt}
            if fmt["type"] == "json_schema":
                assert json.loads(_text(d)) in schema["enum"] and d["status"] == "completed"
                assert _bare(_stream(h, body)[1]) == _bare(d)


def test_function_tools(tiny_server):
    """Flat function tools: a named tool_choice is a function_call item with the chat route's
    arguments (decoded under the schema); "required" and "none" give the chat route's answer
    (calls as items); whole = streamed, with the arguments' events."""
    msgs = [{"role": "user", "content": "weather?"}]
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        def chat(choice) -> dict:
            r = h.post("/v1/chat/completions", json={"messages": msgs, "tools": CHAT_TOOLS, "tool_choice": choice,
                                                     "max_tokens": 40, "temperature": 0})
            return r.json()["choices"][0]["message"]

        body = {"input": "weather?", "tools": TOOLS, "max_output_tokens": 40, "temperature": 0}
        named = {**body, "tool_choice": {"type": "function", "name": "get_weather"}}
        d = _whole(h, named)
        (call,) = d["output"]
        (want,) = chat({"type": "function", "function": {"name": "get_weather"}})["tool_calls"]
        assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
        assert {k: call[k] for k in ("type", "name", "arguments", "status")} == {
            "type": "function_call", "name": "get_weather", "arguments": want["function"]["arguments"],
            "status": "completed"}
        assert json.loads(call["arguments"])["unit"] in ("c", "f") and d["status"] == "completed"
        assert d["tool_choice"] == named["tool_choice"] and d["tools"] == [
            {"type": "function", "description": None, "strict": None, **t} for t in TOOLS]
        events, final = _stream(h, named)
        assert _bare(final) == _bare(d)
        assert "response.function_call_arguments.done" in [e["type"] for e in events]
        for choice in ("required", "none"):
            d, msg = _whole(h, {**body, "tool_choice": choice}), chat(choice)
            calls = [(i["name"], i["arguments"]) for i in d["output"] if i["type"] == "function_call"]
            assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
            texts = [i["content"][0]["text"] for i in d["output"] if i["type"] == "message"]
            assert texts == ([] if msg["content"] is None else [msg["content"]])


def test_auto_tool_calls_after_reasoning(tiny_server):
    """serve --reasoning-parser qwen3 --tool-call-parser hermes: an answer with reasoning, text and
    two calls (the tiny model's text forced by a regex) is a reasoning item, a message and two
    function_call items; reasoning_tokens counts the tokens through </think>; logprobs cover
    every token; whole = streamed."""
    regex = (r'<think>\nplan [a-z]{1,4}\n</think>\n\nChecking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
             r'\{"unit": "(c|f)"\}\}\n</tool_call>\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>')
    body = {"input": "weather?", "tools": TOOLS, "max_output_tokens": 200, "temperature": 0,
            "structured_outputs": {"regex": regex}, "include": ["message.output_text.logprobs"]}
    url = tiny_server(tool_call_parser="hermes", reasoning_parser="qwen3", structured_outputs_in_reasoning=True)
    with httpx.Client(base_url=url, timeout=60) as h:
        d = _whole(h, body)
        assert [i["type"] for i in d["output"]] == ["reasoning", "message", "function_call", "function_call"]
        thought = d["output"][0]
        assert thought["id"].startswith("rs_") and thought["summary"] == []
        assert thought["content"][0]["type"] == "reasoning_text" and thought["content"][0]["text"].startswith("\nplan ")
        assert _text(d) == "\n\nChecking.\n" and d["status"] == "completed"
        assert [(i["name"], json.loads(i["arguments"])) for i in d["output"][2:]][1] == ("now", {})
        assert len({i["call_id"] for i in d["output"][2:]}) == 2
        # the byte-level tiny tokenizer: one token per byte of "<think>...</think>"
        assert d["usage"]["output_tokens_details"]["reasoning_tokens"] == len(
            f"<think>{thought['content'][0]['text']}</think>".encode())
        assert len(d["output"][1]["content"][0]["logprobs"]) == d["usage"]["output_tokens"]
        events, final = _stream(h, body)
        assert _bare(final) == _bare(d)
        kinds = [e["type"] for e in events]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_calls_as_items_without_a_model():
    """The mapping alone: a "required" answer (a JSON array) is a function_call item per element,
    "completed"; a named call cut by max_output_tokens is an "incomplete" item and response."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.engine_loop import Event
    from draftsmith.server.responses import usage
    from draftsmith.server.responses_api import ResponsesFormat
    from draftsmith.server.tools import ToolPlan

    def answer(plan: ToolPlan, text: str, finish: str) -> dict:
        fmt = ResponsesFormat("m", {}, token_text=None, logprobs=False)
        fmt.with_answer(AnswerFormat(plan))
        fmt.with_prompts([[1, 2]], 1)
        ev = Event("finished", 0, token_ids=[7] * 5, text=text, finish_reason=finish)
        return fmt.response([ev], usage(2, [ev]))

    d = answer(ToolPlan("required"), '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": '
               '{"unit": "c"}}]', "stop")
    assert d["status"] == "completed" and [(i["type"], i["name"], i["arguments"], i["status"]) for i in d["output"]] == [
        ("function_call", "now", "{}", "completed"), ("function_call", "get_weather", '{"unit": "c"}', "completed")]
    assert len({i["id"] for i in d["output"]}) == 2 and all(i["id"][3:] == i["call_id"][5:] for i in d["output"])
    d = answer(ToolPlan("named", name="get_weather"), '{"unit": "', "length")
    assert (d["status"], d["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [(i["name"], i["arguments"], i["status"]) for i in d["output"]] == [("get_weather", '{"unit": "', "incomplete")]


def test_input_items_reach_the_chat_template(tiny_dir, tiny_server):
    """A conversation as input items (a developer message, a user's text parts, a reasoning item
    (ignored), an assistant's message and its function_call, the function_call_output) is the chat
    messages the template already reads: the same prompt (usage) and answer as the chat route's."""
    items = [{"role": "developer", "content": "be kind"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather"},
                                                             {"type": "input_text", "text": "?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"unit": "c"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    msgs = [{"role": "developer", "content": "be kind"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    with httpx.Client(base_url=tiny_server(chat_template=TEMPLATE), timeout=60) as h:
        tok = h.post("/tokenize", json={"messages": msgs, "tools": CHAT_TOOLS}).json()
        assert llm.tokenizer.decode(tok["tokens"]) == ('[get_weather][now]developer:be kind|user:weather?|assistant:'
                                                       'Checking.<get_weather {"unit": "c"}>|tool:sunny#c1|')
        chat = h.post("/v1/chat/completions", json={"messages": msgs, "tools": CHAT_TOOLS, "tool_choice": "none",
                                                    "max_tokens": 6, "temperature": 0}).json()
        d = _whole(h, {"input": items, "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 6,
                       "temperature": 0})
        assert d["usage"]["input_tokens"] == tok["count"] == chat["usage"]["prompt_tokens"]
        assert _text(d) == chat["choices"][0]["message"]["content"]


BAD = [
    ({"input": None}, "input", "field required"),  # (None: left out)
    ({"input": []}, "input", "empty"),
    ({"input": 5}, "input", ""),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input",
     "input[0].content[0]: content of type 'input_image' is not supported"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "keeps no responses"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "'web_search_call' are not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]: tools of type 'web_search' are not supported"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "tools[0].name"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "none"}, "tools", "unique"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "function tools only"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # "auto" (the default) needs the parser
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "'grammar' is not supported"),
    ({"text": {"format": "json"}}, "text", "must be an object"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text", "bogus"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not text.format and structured_outputs"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "maximum context length"),
    ({"max_output_tokens": "8"}, "max_output_tokens", "integer"),
    ({"temperature": 3.0}, "temperature", "[0, 2]"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 99}, "top_logprobs", "[0, 20]"),
    ({"metadata": {"k": 1}}, "metadata", "string"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "keeps no responses"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"input": "x" * 5000}, "input", "bytes"),
]


def test_bad_requests_are_clear_400s(tiny_server):
    """Every mistake a 400 in OpenAI's error shape, naming the Responses field (not the chat
    request's it became); a stored response's routes a 404: nothing is stored."""
    from draftsmith.server.app import Limits

    with httpx.Client(base_url=tiny_server(limits=Limits(max_prompt_bytes=4096)), timeout=60) as h:
        for extra, param, says in BAD:
            body = {"input": "hi", "max_output_tokens": 4, **extra}
            body = {k: v for k, v in body.items() if v is not None}
            _assert_openai_error(h.post("/v1/responses", json=body), 400, param, says=says)
        _assert_openai_error(h.post("/v1/responses", json={"input": "hi", "model": "gpt-4o"}), 404, "model")
        for method, path in [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                             ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")]:
            err = _assert_openai_error(h.request(method, path), 404, "response_id", says="keeps no responses")
            assert err["type"] == "not_found_error"
        ok = h.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": []})  # (OpenAI's default)
        assert ok.status_code == 200 and ok.json()["tools"] == []  # and still serving

"""POST /v1/responses on the tiny test server: the chat route's answer as a Response, whole and
streamed (the final response.completed = the whole response, ids aside; every object checked
against the official `openai` package's types; each item closed before the next is added);
text.format = the chat route's response_format; function tools named, required and auto (with
reasoning) as function_call items, text before / between / after calls as messages of their own
(also without a model, however the answer is split); input items (function_call,
function_call_output, reasoning, developer messages, ...) reaching the chat template (developer
messages folded into one leading system message where the template does not name the role);
incomplete at max_output_tokens (the items the cut left unfinished); logprobs read from the
decoding that wrote the text (a SentencePiece tokenizer); null optional fields; an engine error
midway as `error` + `response.failed`; bad requests and stored-response routes as clear 4xx
errors."""

from __future__ import annotations

import json
from functools import partial

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
    _items_one_at_a_time(events[2:-1], final["output"])
    return events, final


def _items_one_at_a_time(events: list[dict], output: list[dict]) -> None:
    """The item events of a stream: each item added, built and done (its *.done events, then
    output_item.done) before the next is added, as OpenAI's; the done items are `output`; an
    item's deltas add up to it (a message's logprobs too)."""
    open_, added = None, 0
    for ev in events:
        if ev["type"] == "response.output_item.added":
            assert open_ is None and ev["output_index"] == added, ev
            open_, added = added, added + 1
        else:
            assert ev["output_index"] == open_, ev  # (every item event is its open item's)
            if ev["type"] == "response.output_item.done":
                open_ = None
    assert open_ is None
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == output
    for i, item in enumerate(output):
        kinds = [e["type"] for e in events if e["output_index"] == i]
        assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.output_item.done", kinds
        pieces = {t: "".join(e["delta"] for e in events if e["type"] == t and e["output_index"] == i)
                  for t in ("response.output_text.delta", "response.reasoning_text.delta",
                            "response.function_call_arguments.delta")}
        if item["type"] == "message":
            assert pieces["response.output_text.delta"] == item["content"][0]["text"]
            assert [x for e in events if e["type"] == "response.output_text.delta" and e["output_index"] == i
                    for x in e["logprobs"]] == item["content"][0]["logprobs"]
            assert kinds[-3:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done"]
        elif item["type"] == "reasoning":
            assert pieces["response.reasoning_text.delta"] == item["content"][0]["text"]
            assert kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done",
                                  "response.output_item.done"]
        else:
            assert pieces["response.function_call_arguments.delta"] == item["arguments"]
            assert kinds[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]


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
        lp = d["output"][0]["content"][0]["logprobs"]  # (the byte-level tiny tokenizer: a token per byte)
        assert "".join(e["token"] for e in lp) == "Hello." and all(len(e["top_logprobs"]) == 2 for e in lp)
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


def test_structured_outputs_backend_is_checked_on_the_responses_route(tiny_server):
    """vLLM's structured_outputs extra with a `backend` as on the chat route: llguidance's names
    ("guidance") accepted, the grammar applied; another backend a 400 that says why; a backend
    alone asks for no grammar."""
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        base = {"input": "json?", "max_output_tokens": 24, "temperature": 0}
        for backend in ("guidance", "auto", "llguidance"):
            d = _whole(h, {**base, "structured_outputs": {"json": {"enum": ["yes", "no"]}, "backend": backend}})
            assert json.loads(_text(d)) in ("yes", "no")
        _assert_openai_error(h.post("/v1/responses", json={**base, "structured_outputs": {
            "choice": ["yes"], "backend": "xgrammar"}}), 400, "structured_outputs", says="llguidance")
        _whole(h, {**base, "structured_outputs": {"backend": "guidance"}})


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
    function_call items; reasoning_tokens counts the tokens through </think>; the message's
    logprobs are its text's tokens; whole = streamed."""
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
        # the message's logprobs: its own tokens' (not the reasoning's or the calls')
        assert "".join(e["token"] for e in d["output"][1]["content"][0]["logprobs"]) == "\n\nChecking.\n"
        events, final = _stream(h, body)
        assert _bare(final) == _bare(d)
        kinds = [e["type"] for e in events]
        assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_text_before_between_and_after_calls(tiny_server):
    """--tool-call-parser hermes: text before, between and after two calls is three messages, in
    the answer's order, each with its own text's logprobs, each item closed before the next is
    added (whole = streamed); cut by max_output_tokens in the last text, that message is the
    "incomplete" item, not a call."""
    regex = (r'Hi\.\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>\nThen\.\n<tool_call>\n'
             r'\{"name": "get_weather", "arguments": \{"unit": "c"\}\}\n</tool_call>\nDone\.')
    full = ('Hi.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nThen.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>\nDone.')
    body = {"input": "weather?", "tools": TOOLS, "max_output_tokens": 200, "temperature": 0,
            "structured_outputs": {"regex": regex}, "include": ["message.output_text.logprobs"]}
    with httpx.Client(base_url=tiny_server(tool_call_parser="hermes"), timeout=60) as h:
        for limit, last, status in [(200, "\nDone.", "completed"), (len(full) - 2, "\nDon", "incomplete")]:
            d = _whole(h, {**body, "max_output_tokens": limit})
            got = [(i["type"], i.get("name") or i["content"][0]["text"], i["status"]) for i in d["output"]]
            assert got == [("message", "Hi.\n", "completed"), ("function_call", "now", "completed"),
                           ("message", "\nThen.", "completed"), ("function_call", "get_weather", "completed"),
                           ("message", last, status)]
            assert d["status"] == status and json.loads(d["output"][3]["arguments"]) == {"unit": "c"}
            for msg in d["output"][::2]:  # (the byte-level tiny tokenizer: a token per byte)
                assert "".join(e["token"] for e in msg["content"][0]["logprobs"]) == msg["content"][0]["text"]
            events, final = _stream(h, {**body, "max_output_tokens": limit})
            assert _bare(final) == _bare(d)


def test_an_empty_think_block_is_reasoning_tokens(tiny_server):
    """--reasoning-parser qwen3: an answer with an empty <think></think> has no reasoning item,
    but its tokens are reasoning_tokens (the think block was written); the message's logprobs
    are its text's alone; whole = streamed."""
    body = {"input": "hi", "max_output_tokens": 40, "temperature": 0, "include": ["message.output_text.logprobs"],
            "structured_outputs": {"regex": r"<think></think>Hi\."}}
    with httpx.Client(base_url=tiny_server(reasoning_parser="qwen3", structured_outputs_in_reasoning=True),
                      timeout=60) as h:
        d = _whole(h, body)
        assert [i["type"] for i in d["output"]] == ["message"] and _text(d) == "Hi."
        assert d["usage"]["output_tokens_details"]["reasoning_tokens"] == len("<think></think>")
        assert "".join(e["token"] for e in d["output"][0]["content"][0]["logprobs"]) == "Hi."
        assert _bare(_stream(h, body)[1]) == _bare(d)


def test_null_is_the_default_of_every_optional_field(tiny_server):
    """As OpenAI's and vLLM's: an optional field sent as null is its default (was a 400 for
    stream, parallel_tool_calls, store, background and priority)."""
    nulls = dict.fromkeys(("model", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
                           "tool_choice", "parallel_tool_calls", "user", "metadata", "store", "reasoning", "include",
                           "top_logprobs", "truncation", "previous_response_id", "conversation", "background", "seed",
                           "top_k", "min_p", "repetition_penalty", "priority", "cache_salt", "structured_outputs"))
    body = {"input": "hi", **nulls, "max_output_tokens": 3, "text": {"format": None, "verbosity": None}}
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        d = _whole(h, body)  # (stream null: a whole response)
        assert {k: d[k] for k in ("parallel_tool_calls", "tool_choice", "tools", "metadata", "text", "temperature",
                                  "top_p", "background", "top_logprobs", "instructions", "reasoning")} == {
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "metadata": {},
            "text": {"format": {"type": "text"}, "verbosity": None}, "temperature": 1.0, "top_p": 1.0,
            "background": False, "top_logprobs": None, "instructions": None, "reasoning": None}
        assert d["output"][0]["content"][0]["logprobs"] == []
        d = _whole(h, {"input": "hi", **nulls})  # (max_output_tokens null too: the rest of the context)
        assert d["status"] in ("completed", "incomplete")


def test_an_engine_error_midway_is_error_then_response_failed(tiny_server):
    """An engine step that fails midway: the stream sends `error` (the documented flat fields and
    the chat route's error object under `error`), then `response.failed` (status "failed", error
    {"code": "server_error", "message"}, the output so far), and ends; the openai package's
    responses.stream raises it as an APIError with the engine's message."""
    import openai
    from test_server_unit import _fail_step

    url = tiny_server()
    engine = tiny_server.servers[-1].app.app.state.server.llm.engine
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 40, "temperature": 0}
    why = "internal error in the engine; the request was aborted"
    with httpx.Client(base_url=url, timeout=60) as h:
        _fail_step(engine, after=4)
        events = []
        with h.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        for ev in events:
            _EVENT.validate_python({**ev, "response": {**ev["response"], "usage": None}} if "response" in ev else ev)
        assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        err, failed = events[-2:]
        assert err["type"] == "error" and (err["code"], err["message"], err["param"]) == ("internal_error", why, None)
        assert err["error"] == {"message": why, "type": "internal_error", "param": None, "code": None}
        resp = failed["response"]
        assert failed["type"] == "response.failed" and (resp["status"], resp["error"]) == (
            "failed", {"code": "server_error", "message": why})
        _sdk(resp)
        assert all(i["status"] in ("completed", "incomplete") for i in resp["output"])
        assert _whole(h, {**body, "max_output_tokens": 2})["status"] in ("completed", "incomplete")  # still serving
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    _fail_step(engine, after=4)
    with client.responses.stream(**body) as stream, pytest.raises(openai.APIError, match=why.split(";")[0]):
        stream.get_final_response()


def _byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer's decoding: token t is the byte t."""
    return bytes(ids).decode("utf-8", errors="replace")


THINK_TEXT_CALLS = ('<think>plan</think>Hi.<tool_call>{"name": "now", "arguments": {}}</tool_call>\nThen ü.\n'
                    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nDo')


def _built(text: str, cuts: list[int], cut: bool = False, answer=None) -> tuple[list[dict], list[dict]]:
    """`text` read (by `answer`'s reader, an AnswerFormat; default: reasoning, hermes calls) in
    pieces cut at `cuts` (character offsets), each piece's tokens its UTF-8 bytes, token i's
    logprobs entry {"i": i}: the output items and their events, as a stream sends them (`cut`:
    the answer ran out of tokens)."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.answer import PartsReader
    from draftsmith.server.responses_output import ResponseOutput
    from draftsmith.server.tools import ToolPlan

    answer = answer or AnswerFormat(ToolPlan("auto", parser="hermes"), reasoning=True)
    reader = PartsReader(answer.reader(always=True))
    out = ResponseOutput("h", _byte_decode, logprobs=True)
    bounds, events, n = [0, *cuts, len(text)], [], 0
    for k in range(len(bounds) - 1):
        piece = text[bounds[k]:bounds[k + 1]]
        ids = list(piece.encode())
        last = k == len(bounds) - 2
        d = reader.finish(piece) if last else reader.push(piece)
        events += out.read(d.get("parts", []), ids, [{"i": i} for i in range(n, n + len(ids))], cut=cut and last)
        n += len(ids)
    events += out.end(cut)
    return out.items, [{"type": kind, **fields} for kind, fields in events]


def test_items_follow_the_answer_however_it_is_split():
    """The output builder alone: reasoning, text, a call, text, a call, text are six items in that
    order, each closed before the next is added; the same items (logprobs included) whether the
    answer comes whole, in two pieces (every cut), in three (about 300 of the ~10,700 ways, evenly
    spread: all of them take ~20 s) or a character at a time (a stream's final Response = the
    whole one); each message's logprobs are its own text's tokens (not </think>'s, a call's or the
    whitespace dropped before one); cut by max_output_tokens, the last item (the text that got the
    last character) is "incomplete", the calls are not."""
    import itertools

    items, events = _built(THINK_TEXT_CALLS, [])
    _items_one_at_a_time(events, items)
    got = [(i["type"], i.get("name") or i["content"][0]["text"], i["status"]) for i in items]
    assert got == [("reasoning", "plan", "completed"), ("message", "Hi.", "completed"),
                   ("function_call", "now", "completed"), ("message", "\nThen ü.", "completed"),
                   ("function_call", "f", "completed"), ("message", "\nDo", "completed")]
    assert [json.loads(i["arguments"]) for i in items if i["type"] == "function_call"] == [{}, {"a": 1}]
    raw = THINK_TEXT_CALLS.encode()
    for item in (i for i in items if i["type"] == "message"):
        text = item["content"][0]["text"].encode()
        start = raw.index(text, raw.index(b"</think>"))
        assert [e["i"] for e in item["content"][0]["logprobs"]] == list(range(start, start + len(text)))
    whole = _bare(items)
    ones = [[i] for i in range(1, len(THINK_TEXT_CALLS))]
    twos = list(itertools.combinations(range(1, len(THINK_TEXT_CALLS)), 2))  # (a sample of them: docstring)
    for split in [*ones, *map(list, twos[::len(twos) // 300]), list(range(1, len(THINK_TEXT_CALLS)))]:
        items, events = _built(THINK_TEXT_CALLS, split)
        _items_one_at_a_time(events, items)
        assert _bare(items) == whole, split
    items, events = _built(THINK_TEXT_CALLS, list(range(1, len(THINK_TEXT_CALLS))), cut=True)
    _items_one_at_a_time(events, items)
    assert [i["status"] for i in items] == ["completed"] * 5 + ["incomplete"]


def test_cut_marks_the_items_it_left_unfinished():
    """Cut by max_output_tokens, an item is "incomplete" where the cut left it unfinished (the
    last character went to it and did not close it), not because it is the last one: a hermes
    call closed by </tool_call> with only dropped whitespace after it, or a reasoning closed by
    </think>, is "completed"; a call block without its end tag, a reasoning cut before a named
    call's (empty) arguments, and that call, are "incomplete"; whole = a character at a time."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.tools import ToolPlan

    hermes, named = ToolPlan("auto", parser="hermes"), ToolPlan("named", name="f")
    cases = [
        (AnswerFormat(hermes), 'Hi<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n',
         [("message", "completed"), ("function_call", "completed")]),
        (AnswerFormat(hermes), 'Hi<tool_call>{"name": "f", "arguments": {}}',
         [("message", "completed"), ("function_call", "incomplete")]),
        (AnswerFormat(hermes), 'Hi<tool_call>{"name": "f", "arguments": {}}</tool_call>\nBy',
         [("message", "completed"), ("function_call", "completed"), ("message", "incomplete")]),
        (AnswerFormat(reasoning=True), "<think>plan</think>", [("reasoning", "completed")]),
        (AnswerFormat(reasoning=True), "<think>plan</think>Hi",
         [("reasoning", "completed"), ("message", "incomplete")]),
        (AnswerFormat(reasoning=True), "<think>plan", [("reasoning", "incomplete")]),
        (AnswerFormat(named, reasoning=True), "<think>plan, still thinking",
         [("reasoning", "incomplete"), ("function_call", "incomplete")]),
        (AnswerFormat(named, reasoning=True), '<think>plan</think>{"a": ', [("reasoning", "completed"),
                                                                          ("function_call", "incomplete")]),
        (AnswerFormat(ToolPlan("required")), '[{"name": "f", "parameters": {}}, {"na',  # (the cut call: no item,
         [("function_call", "completed")]),                                          # its JSON is not text)
        (AnswerFormat(ToolPlan("required")), '[{"name": "f", "para', [("message", "incomplete")]),  # (no item: empty)
        (AnswerFormat(reasoning=True), "<think></think>", [("message", "incomplete")]),  # (no item: an empty message)
    ]
    for answer, text, want in cases:
        items, events = _built(text, [], cut=True, answer=answer)
        _items_one_at_a_time(events, items)
        assert [(i["type"], i["status"]) for i in items] == want, text
        assert _bare(_built(text, list(range(1, len(text))), cut=True, answer=answer)[0]) == _bare(items), text
        assert {i["status"] for i in _built(text, [], answer=answer)[0]} == {"completed"}  # (not cut)


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's: "▁" for a space, a Metaspace
    decoder that drops the first token's leading space), with the think and tool-call tags as
    added tokens (as Qwen's and Hermes') and a special token <|x|> that decoding skips."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "\u2581Hi", "!", "\u2581there", "\u2581plan", "\u2581ok", "\u2581",
              '{"name":\u2581"now",\u2581"arguments":\u2581{}}', "\u2581Done"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    tok.add_special_tokens(["<|x|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return fast, fast.convert_tokens_to_ids


def _decoded(answer, decode, ids: list[int], per_token: bool, cut: bool = False) -> tuple[list[dict], list, int]:
    """The items, events and reasoning_tokens of an answer of token `ids` whose text is `decode`'s
    (the engine's): whole, or streamed a token at a time as the server streams it (each push's
    text from server/text.py's StreamText, the last one the whole text)."""
    from draftsmith.server.answer import PartsReader
    from draftsmith.server.responses_output import ResponseOutput
    from draftsmith.server.text import StreamText

    reader, out = PartsReader(answer.reader(always=True)), ResponseOutput("h", decode, logprobs=True)
    chunks = [[t] for t in ids] if per_token else [list(ids)]
    stream, events, n, d = StreamText(decode, []), [], 0, {}
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        d = reader.finish(stream.finish(decode(ids))) if last else reader.push(stream.push(chunk))
        events += out.read(d.get("parts", []), chunk, [{"i": i} for i in range(n, n + len(chunk))], cut=cut and last)
        n += len(chunk)
    events += out.end(cut)
    return out.items, [{"type": kind, **fields} for kind, fields in events], out.reasoning_tokens(d["thinks"], n)


def test_logprobs_follow_the_decoding_on_sentencepiece_tokenizers():
    """A SentencePiece-style tokenizer (Metaspace: the answer's first "▁" is dropped from the
    text) and a special token skipped mid-answer: every token's logprobs entry lands on the
    message whose text it wrote, none lost, none shifted (a token's bytes say " Hi", the text
    "Hi"); an end-of-text token on none; reasoning_tokens through </think>; whole = streamed a
    token at a time."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.tools import ToolPlan

    tok, ids = _metaspace_tokenizer()
    decode = partial(tok.decode, skip_special_tokens=True)
    plain = AnswerFormat()
    for pieces, text in [(["\u2581Hi", "!", "\u2581there", "!"], "Hi! there!"),
                         (["\u2581Hi", "<|x|>", "!", "\u2581there", "<|x|>", "!", "</s>"], "Hi! there!"),
                         (["\u2581", "\u2581Hi", "!"], " Hi!")]:
        answer = ids(pieces)
        assert decode(answer) == text
        for per_token in (False, True):
            items, events, _ = _decoded(plain, decode, answer, per_token)
            _items_one_at_a_time(events, items)
            (msg,) = items
            assert msg["content"][0]["text"] == text
            written = len(pieces) - (pieces[-1] == "</s>")  # (the end-of-text token wrote nothing of it)
            assert [e["i"] for e in msg["content"][0]["logprobs"]] == list(range(written)), (pieces, per_token)
    # the prompt opened <think> (Qwen3's): the answer's first piece is "▁ok"; text before, between
    # and after a hermes call; a skipped special token in the first text
    thinking = AnswerFormat(ToolPlan("auto", parser="hermes"), reasoning=True, thinking=True)
    pieces = ["\u2581ok", "\u2581plan", "</think>", "\u2581Hi", "<|x|>", "!", "<tool_call>",
              '{"name":\u2581"now",\u2581"arguments":\u2581{}}', "</tool_call>", "\u2581Done", "!", "</s>"]
    answer = ids(pieces)
    assert decode(answer) == 'ok plan</think> Hi!<tool_call>{"name": "now", "arguments": {}}</tool_call> Done!'
    whole = None
    for per_token in (False, True):
        items, events, reasoning = _decoded(thinking, decode, answer, per_token)
        _items_one_at_a_time(events, items)
        assert [(i["type"], i.get("name") or i["content"][0]["text"]) for i in items] == [
            ("reasoning", "ok plan"), ("message", " Hi!"), ("function_call", "now"), ("message", " Done!")]
        assert [[e["i"] for e in i["content"][0]["logprobs"]] for i in items if i["type"] == "message"] == [
            [3, 4, 5], [9, 10]]
        assert reasoning == 3  # ("▁ok", "▁plan", "</think>")
        whole = whole or _bare(items)
        assert _bare(items) == whole
    # cut in the reasoning: all of the tokens are reasoning_tokens
    items, _, reasoning = _decoded(thinking, decode, answer[:2], False, cut=True)
    assert [(i["type"], i["status"]) for i in items] == [("reasoning", "incomplete")] and reasoning == 2




def test_calls_as_items_without_a_model():
    """The mapping alone: a "required" answer (a JSON array) is a function_call item per element,
    "completed"; a named call cut by max_output_tokens is an "incomplete" item and response."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.engine_loop import Event
    from draftsmith.server.responses import usage
    from draftsmith.server.responses_api import ResponsesFormat
    from draftsmith.server.tools import ToolPlan

    def answer(plan: ToolPlan, text: str, finish: str) -> dict:
        fmt = ResponsesFormat("m", {})
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


# TEMPLATE, writing an assistant's reasoning too (as Qwen3's writes reasoning_content)
THINKING_TEMPLATE = TEMPLATE.replace("{{ m.role }}:{{ m.content }}", "{{ m.role }}:{% if m.reasoning_content %}"
                                     "({{ m.reasoning_content }}){% endif %}{{ m.content }}")


def test_input_items_reach_the_chat_template(tiny_dir, tiny_server):
    """A conversation as input items is the chat messages the template already reads: a developer
    message (a system one: the template does not name the role), a user's text parts, reasoning
    items (their text the reasoning of the assistant message after them: a message item's or the
    one its function_call items make; content's text, else the summaries'; one with no assistant
    message after it an assistant message of its own, as vLLM's; one without text nothing), an
    assistant's message and its function_call, the function_call_outputs: the same prompt (usage)
    and answer as the chat route's."""
    c1 = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}
    c2 = {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    items = [{"role": "developer", "content": "be kind"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather"},
                                                             {"type": "input_text", "text": "?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
              "content": [{"type": "reasoning_text", "text": "look"}], "status": "completed"},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"unit": "c"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "a"},
                                                             {"type": "summary_text", "text": "b"}]},
             {"type": "function_call", "call_id": "c2", "name": "now", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c2", "output": "noon"},
             {"type": "reasoning", "id": "rs_3", "summary": [], "content": [{"type": "reasoning_text", "text": "done"}],
              "encrypted_content": None},
             {"role": "user", "content": "thanks"},
             {"type": "reasoning", "id": "rs_4", "summary": []}]
    msgs = [{"role": "developer", "content": "be kind"}, {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Checking.", "reasoning": "look", "tool_calls": [c1]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": None, "reasoning": "a\n\nb", "tool_calls": [c2]},
            {"role": "tool", "tool_call_id": "c2", "content": "noon"},
            {"role": "assistant", "content": None, "reasoning": "done"}, {"role": "user", "content": "thanks"}]
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    with httpx.Client(base_url=tiny_server(chat_template=THINKING_TEMPLATE), timeout=60) as h:
        tok = h.post("/tokenize", json={"messages": msgs, "tools": CHAT_TOOLS}).json()
        assert llm.tokenizer.decode(tok["tokens"]) == (
            '[get_weather][now]system:be kind|user:weather?|assistant:(look)Checking.<get_weather {"unit": "c"}>|'
            'tool:sunny#c1|assistant:(a\n\nb)<now {}>|tool:noon#c2|assistant:(done)|user:thanks|')
        chat = h.post("/v1/chat/completions", json={"messages": msgs, "tools": CHAT_TOOLS, "tool_choice": "none",
                                                    "max_tokens": 6, "temperature": 0}).json()
        d = _whole(h, {"input": items, "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 6,
                       "temperature": 0})
        assert d["usage"]["input_tokens"] == tok["count"] == chat["usage"]["prompt_tokens"]
        assert _text(d) == chat["choices"][0]["message"]["content"]


# TEMPLATE, naming the developer role as a template that reads it does (a quoted literal)
DEVELOPER_TEMPLATE = TEMPLATE.replace("{{ m.role }}:", "{% if m.role == 'developer' %}developer{% else %}"
                                      "{{ m.role }}{% endif %}:")
# TEMPLATE behind a guard that refuses a system message anywhere but first (as Qwen3.5's-style
# templates raise "System message must be at the beginning"); "developer" only in a comment
GUARD_TEMPLATE = ("{# no developer role here #}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                  "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}"
                  + TEMPLATE)


def test_which_templates_name_the_developer_role():
    """A template names the developer role where it holds 'developer' or "developer" (a quoted
    literal, as `m.role == 'developer'`); the word in a comment or prose does not count. Where it
    does not, the leading system and developer messages are one system message (their texts
    joined by a blank line, empty ones left out); a later developer message, and a leading run
    without one, go as sent."""
    from draftsmith.server.protocol import ChatMessage
    from draftsmith.server.tools import names_developer, template_messages

    assert names_developer(DEVELOPER_TEMPLATE) and names_developer('{% if m.role == "developer" %}{% endif %}')
    assert names_developer({"default": TEMPLATE, "tool_use": DEVELOPER_TEMPLATE})
    assert names_developer([{"name": "default", "template": DEVELOPER_TEMPLATE}])
    for no in (TEMPLATE, GUARD_TEMPLATE, "{# the developer role is written as sent #}" + TEMPLATE,
               "You are a developer's assistant. " + TEMPLATE, None, "", {"default": TEMPLATE}):
        assert not names_developer(no), no

    def roles(msgs: list[tuple[str, str]], developer: bool = False) -> list[tuple[str, str]]:
        got = template_messages([ChatMessage(role=r, content=c) for r, c in msgs], developer=developer)
        return [(m["role"], m["content"]) for m in got]

    sd = [("system", "instr"), ("developer", "dev"), ("user", "hi")]
    assert roles(sd) == [("system", "instr\n\ndev"), ("user", "hi")]
    assert roles(sd, developer=True) == sd
    assert roles([("developer", "a"), ("system", ""), ("developer", "b"), ("user", "hi"), ("developer", "c")]) == [
        ("system", "a\n\nb"), ("user", "hi"), ("developer", "c")]
    later = [("user", "hi"), ("assistant", "yo"), ("developer", "dev"), ("user", "q")]
    assert roles(later) == later
    systems = [("system", "a"), ("system", "b"), ("user", "hi")]
    assert roles(systems) == systems


def test_developer_messages_are_system_ones_where_the_template_has_no_developer(tiny_dir, tiny_server):
    """A template that does not name the developer role (Qwen2.5's drops such a message, SmolLM2's
    and TEMPLATE write a role the model never saw) gets a leading developer message as a system
    message, on chat, /tokenize and responses alike; a template that names the role (as a quoted
    literal: DEVELOPER_TEMPLATE) gets it as sent."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    dev = [{"role": "developer", "content": "be kind"}, {"role": "user", "content": "hi"}]
    for template, role in [(TEMPLATE, "system"), (DEVELOPER_TEMPLATE, "developer")]:
        with httpx.Client(base_url=tiny_server(chat_template=template), timeout=60) as h:
            tok = h.post("/tokenize", json={"messages": dev}).json()
            assert llm.tokenizer.decode(tok["tokens"]) == f"{role}:be kind|user:hi|"
            body = {"max_tokens": 4, "temperature": 0}
            chat = h.post("/v1/chat/completions", json={"messages": dev, **body}).json()
            same = h.post("/v1/chat/completions", json={"messages": [{**dev[0], "role": role}, dev[1]], **body}).json()
            assert chat["usage"] == same["usage"] and chat["choices"][0]["message"] == same["choices"][0]["message"]
            d = _whole(h, {"input": dev, "max_output_tokens": 4, "temperature": 0})
            assert d["usage"]["input_tokens"] == tok["count"] and _text(d) == chat["choices"][0]["message"]["content"]


def test_developer_messages_on_a_template_that_wants_one_leading_system_message(tiny_dir, tiny_server):
    """A template that refuses a system message anywhere but first and does not name the
    developer role: `instructions` + a developer item (responses) and system + developer (chat,
    as agent SDKs send them) are one leading system message, not a 400 naming a role the client
    never sent; a developer message later in the conversation goes as sent (not a second system
    message the template would refuse); the template's own rule still holds."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    body = {"max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=tiny_server(chat_template=GUARD_TEMPLATE), timeout=60) as h:
        def prompt(msgs: list[dict]) -> tuple[str, int]:
            r = h.post("/tokenize", json={"messages": msgs})
            assert r.status_code == 200, r.text
            return llm.tokenizer.decode(r.json()["tokens"]), r.json()["count"]

        def chat(msgs: list[dict]) -> dict:
            r = h.post("/v1/chat/completions", json={"messages": msgs, **body})
            assert r.status_code == 200, r.text
            return r.json()

        sd = [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "be kind"},
              {"role": "user", "content": "hi"}]
        text, count = prompt(sd)
        assert text == "system:be brief\n\nbe kind|user:hi|"
        got, same = chat(sd), chat([{"role": "system", "content": "be brief\n\nbe kind"}, sd[2]])
        assert got["usage"] == same["usage"] and got["choices"][0]["message"] == same["choices"][0]["message"]
        d = _whole(h, {"instructions": "be brief", "input": sd[1:], "max_output_tokens": 4, "temperature": 0})
        assert d["usage"]["input_tokens"] == count and _text(d) == got["choices"][0]["message"]["content"]
        later = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                 {"role": "developer", "content": "be kind"}, {"role": "user", "content": "q"}]
        text, count = prompt(later)
        assert text == "user:hi|assistant:yo|developer:be kind|user:q|"
        assert chat(later)["usage"]["prompt_tokens"] == count
        assert _whole(h, {"input": later, "max_output_tokens": 4, "temperature": 0})["usage"]["input_tokens"] == count
        _assert_openai_error(h.post("/v1/chat/completions", json={"messages": [sd[2], sd[0]], **body}), 400,
                             "messages", says="System message must be at the beginning")


BAD = [
    ({"input": None}, "input", "field required"),  # (None: left out)
    ({"input": []}, "input", "empty"),
    ({"input": 5}, "input", "input must be a string or a list of input items (objects with a role or a type)"),
    ({"input": ["hi"]}, "input", "input must be a string or a list of input items (objects with a role or a type)"),
    ({"input": {"role": "user", "content": "hi"}}, "input", "list of input items"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input", "encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [{"text": "x"}]}]}, "input", "input[0].summary.0.type"),
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
    ({"top_logprobs": 21}, "top_logprobs", "[0, 20]"),  # (without include too, as OpenAI's)
    ({"top_logprobs": -1}, "top_logprobs", "[0, 20]"),
    ({"max_output_tokens": 150}, None, "(its input + max_output_tokens), over this server's limit of 150; lower "
     "max_output_tokens or send a shorter input"),  # (chat's words, n and prompts, are not a Response's)
    ({"metadata": {"k": 1}}, "metadata", "string"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "keeps no responses"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"input": "x" * 5000}, "input", "bytes"),
]


def test_bad_requests_are_clear_400s(tiny_server):
    """Every mistake a 400 in OpenAI's error shape, naming the Responses field (not the chat
    request's it became) and worded for it; a stored response's routes a 404: nothing is stored;
    POST /v1/responses/input_tokens a 404 that says it is not supported."""
    from draftsmith.server.app import Limits

    with httpx.Client(base_url=tiny_server(limits=Limits(max_prompt_bytes=4096, max_queued_tokens=150)),
                      timeout=60) as h:
        for extra, param, says in BAD:
            body = {"input": "hi", "max_output_tokens": 4, **extra}
            body = {k: v for k, v in body.items() if v is not None}
            _assert_openai_error(h.post("/v1/responses", json=body), 400, param, says=says)
        _assert_openai_error(h.post("/v1/responses", json={"input": "hi", "model": "gpt-4o"}), 404, "model")
        for method, path in [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
                             ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items")]:
            err = _assert_openai_error(h.request(method, path), 404, "response_id", says="keeps no responses")
            assert err["type"] == "not_found_error"
        err = _assert_openai_error(h.post("/v1/responses/input_tokens", json={"input": "hi"}), 404, None,
                                   says="input_tokens is not supported")
        assert err["type"] == "not_found_error" and "/tokenize" in err["message"]
        ok = h.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "tools": []})  # (OpenAI's default)
        assert ok.status_code == 200 and ok.json()["tools"] == []  # and still serving

"""POST /v1/responses on the tiny test server: the chat route's answer as a Response, whole and
streamed (the final response.completed = the whole response, ids aside; every object checked
against the official `openai` package's types; each item closed before the next is added);
text.format = the chat route's response_format; function tools named, required and auto (with
reasoning) as function_call items, text before / between / after calls as messages of their own
(also without a model, however the answer is split); input items (function_call,
function_call_output, reasoning, developer messages, ...) reaching the chat template; incomplete
at max_output_tokens (the item that got the last token); null optional fields; an engine error
midway as `error` + `response.failed`; bad requests and stored-response routes as clear 4xx
errors."""

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


class _ByteTokens:
    """A byte-level TokenText: token t is the byte t."""

    @staticmethod
    def bytes(t: int) -> bytes:
        return bytes([t])


THINK_TEXT_CALLS = ('<think>plan</think>Hi.<tool_call>{"name": "now", "arguments": {}}</tool_call>\nThen ü.\n'
                    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nDo')


def _built(text: str, cuts: list[int], cut: bool = False) -> tuple[list[dict], list[dict]]:
    """`text` read (reasoning, hermes calls) in pieces cut at `cuts` (character offsets), each
    piece's tokens its UTF-8 bytes, token i's logprobs entry {"i": i}: the output items and
    their events, as a stream sends them (`cut`: the answer ran out of tokens)."""
    from draftsmith.server.answer import AnswerReader
    from draftsmith.server.reasoning import ReasoningReader
    from draftsmith.server.responses_api import PartsReader
    from draftsmith.server.responses_output import ResponseOutput
    from draftsmith.server.tool_calls import HermesReader

    reader = PartsReader(AnswerReader(ReasoningReader(False), HermesReader()))
    out = ResponseOutput("h", _ByteTokens(), logprobs=True)
    bounds, events, n = [0, *cuts, len(text)], [], 0
    for k in range(len(bounds) - 1):
        piece = text[bounds[k]:bounds[k + 1]]
        ids = list(piece.encode())
        d = reader.finish(piece) if k == len(bounds) - 2 else reader.push(piece)
        events += out.read(d.get("parts", []), ids, [{"i": i} for i in range(n, n + len(ids))])
        n += len(ids)
    events += out.end(cut)
    return out.items, [{"type": kind, **fields} for kind, fields in events]


def test_items_follow_the_answer_however_it_is_split():
    """The output builder alone: reasoning, text, a call, text, a call, text are six items in that
    order, each closed before the next is added; the same items (logprobs included) whether the
    answer comes whole, in three pieces or a character at a time (a stream's final Response =
    the whole one); each message's logprobs are its own text's tokens (not </think>'s, a call's
    or the whitespace dropped before one); cut by max_output_tokens, the last item (the text that
    got the last token) is "incomplete", the calls are not."""
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
    cuts = list(itertools.combinations(range(1, len(THINK_TEXT_CALLS)), 2))
    for split in [*map(list, cuts[::max(1, len(cuts) // 300)]), list(range(1, len(THINK_TEXT_CALLS)))]:
        items, events = _built(THINK_TEXT_CALLS, split)
        _items_one_at_a_time(events, items)
        assert _bare(items) == whole, split
    items, events = _built(THINK_TEXT_CALLS, list(range(1, len(THINK_TEXT_CALLS))), cut=True)
    _items_one_at_a_time(events, items)
    assert [i["status"] for i in items] == ["completed"] * 5 + ["incomplete"]


def test_calls_as_items_without_a_model():
    """The mapping alone: a "required" answer (a JSON array) is a function_call item per element,
    "completed"; a named call cut by max_output_tokens is an "incomplete" item and response."""
    from draftsmith.server.answer import AnswerFormat
    from draftsmith.server.engine_loop import Event
    from draftsmith.server.responses import usage
    from draftsmith.server.responses_api import ResponsesFormat
    from draftsmith.server.tools import ToolPlan

    def answer(plan: ToolPlan, text: str, finish: str) -> dict:
        fmt = ResponsesFormat("m", {}, token_text=None)
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


def test_developer_messages_are_system_ones_where_the_template_has_no_developer(tiny_dir, tiny_server):
    """A template that does not name the developer role (Qwen2.5's drops such a message, SmolLM2's
    and TEMPLATE write a role the model never saw) gets a developer message as a system message,
    on chat, /tokenize and responses alike; a template that names the role gets it as sent."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    dev = [{"role": "developer", "content": "be kind"}, {"role": "user", "content": "hi"}]
    for template, role in [(TEMPLATE, "system"), ("{# the developer role is written as sent #}" + TEMPLATE,
                                                  "developer")]:
        with httpx.Client(base_url=tiny_server(chat_template=template), timeout=60) as h:
            tok = h.post("/tokenize", json={"messages": dev}).json()
            assert llm.tokenizer.decode(tok["tokens"]) == f"{role}:be kind|user:hi|"
            body = {"max_tokens": 4, "temperature": 0}
            chat = h.post("/v1/chat/completions", json={"messages": dev, **body}).json()
            same = h.post("/v1/chat/completions", json={"messages": [{**dev[0], "role": role}, dev[1]], **body}).json()
            assert chat["usage"] == same["usage"] and chat["choices"][0]["message"] == same["choices"][0]["message"]
            d = _whole(h, {"input": dev, "max_output_tokens": 4, "temperature": 0})
            assert d["usage"]["input_tokens"] == tok["count"] and _text(d) == chat["choices"][0]["message"]["content"]


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

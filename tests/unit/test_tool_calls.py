"""Tool calling's readers and rules (server/tool_calls.py, server/tools.py), without a model:
an answer's text -> content and tool calls, the same streamed (every split of the text) as whole;
tool_choice's checks and the schema a forced call decodes under."""

from __future__ import annotations

import itertools
import json

import pytest

from draftsmith.server.protocol import APIError, ChatCompletionRequest
from draftsmith.server.answer import AnswerReader
from draftsmith.server.tool_calls import HermesReader, NamedReader, RequiredReader
from draftsmith.server.tools import forced_schema, template_messages, tool_plan


def merged(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Deltas as a client accumulates them -> (content, [(name, arguments)]); checks that a
    call's first delta has its id, type and name and later ones only more arguments."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            i = c["index"]
            if i not in calls:
                assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" and i == len(calls)
                calls[i] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[i][1] += c["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def streamed(make, pieces: list[str]) -> tuple[str, list[tuple[str, str]], str]:
    """-> (content, calls, finish_reason of an answer the engine ended with "stop")."""
    r = make()
    deltas = [r.push(p) for p in pieces[:-1]] + [r.finish(pieces[-1])]
    return (*merged(deltas), r.tool_calls_finish("stop"))


def every_split(make, text: str) -> None:
    """Streamed in any two or three pieces, or a character at a time: the same as whole."""
    want = streamed(make, [text])
    cuts = list(itertools.combinations(range(len(text) + 1), 2))
    for a, b in cuts[:: max(1, len(cuts) // 400)]:
        assert streamed(make, [text[:a], text[a:b], text[b:]]) == want, (a, b)
    assert streamed(make, list(text) + [""]) == want
    return want


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
ARGS = '{"city": "Paris", "unit": "c"}'

HERMES = [  # (text, content, calls)
    ("Sunny, I think.", "Sunny, I think.", []),
    ("Let me check.\n" + CALL, "Let me check.\n", [("get_weather", ARGS)]),
    (CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n", "",
     [("get_weather", ARGS), ("get_weather", ARGS.replace("Paris", "Oslo"))]),
    (CALL + "\nDone.", "\nDone.", [("get_weather", ARGS)]),  # text after a call is kept
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),  # no arguments: an empty object
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", '{"x": 1}')]),  # as a string
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),  # kept as written
    ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
    ('x<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}', "x", [("f", '{"a": [1, 2]}')]),  # no end tag
    ('x<tool_call>{"name": "f", "argu', 'x<tool_call>{"name": "f", "argu', []),  # cut: kept as text
    ("2 < 3 and <tool", "2 < 3 and <tool", []),  # a tag's start that never completes
    ("héllo 🌍" + CALL, "héllo 🌍", [("get_weather", ARGS)]),
    (CALL + " x <tool_call> y", " x <tool_call> y", [("get_weather", ARGS)]),  # not a call: its space kept
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', "", [("f", "{}")]),
    ("<tool_call>" + "[" * 3000 + "</tool_call>", "<tool_call>" + "[" * 3000 + "</tool_call>", []),  # too deep
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_reader_whole_and_every_split(text, content, calls):
    got = every_split(HermesReader, text)
    assert got == (content, calls, "tool_calls" if calls else "stop")
    r = HermesReader()
    msg = AnswerReader(None, r).message(text)
    assert r.tool_calls_finish("length") == "length"  # an answer cut short is not a clean call
    assert msg["content"] == (content or (None if calls else ""))
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls
    assert len({c["id"] for c in msg.get("tool_calls", [])}) == len(calls)  # ids are unique
    assert all(set(c) == {"id", "type", "function"} for c in msg.get("tool_calls", []))  # no delta "index"


def test_hermes_reader_one_call_when_parallel_calls_are_off():
    text = CALL + "\n" + CALL.replace("Paris", "Oslo")
    content, calls, finish = every_split(lambda: HermesReader(max_calls=1), text)
    assert calls == [("get_weather", ARGS)] and finish == "tool_calls"
    assert content == "\n" + CALL.replace("Paris", "Oslo")  # the second call stays in the text, not lost


def test_hermes_reader_holds_back_only_what_may_become_a_tag():
    r = HermesReader()
    assert r.push("Let me <tool") == {"content": "Let me "}
    assert r.push("box> open") == {"content": "<toolbox> open"}
    assert r.push(" <tool_call>{\"name\": \"f\", ") == {"content": " "}
    d = r.push('"arguments": {}}</tool_call>')
    assert d["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"} and "content" not in d
    assert r.push("\n  ") == {}  # whitespace after a call waits for what follows it
    assert r.finish("") == {} and r.tool_calls_finish("stop") == "tool_calls"


REQUIRED = [
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    ('  [ {"name": "f", "parameters": {"s": "]},["}} ]  ', "", [("f", '{"s": "]},["}')]),
    # cut by max_tokens (or a grammar error): the calls completed, never the grammar's JSON as content
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "para', "", [("f", '{"a": 1}')]),
    ('[{"name": "f", "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),  # cut before the ]
    ('[{"name": "f", "para', "", []),  # cut in the first call: nothing (vLLM: no tool_calls, content "")
    ('[{\n    "name', "", []),  # (the parity report's fragment)
    ('[{"name": "f", "parameters": {"s": "]},[', "", []),  # cut in a string that looks like the array's end
    ('{"name": "f"}', "", []),  # not an array (a grammar keeps this from happening): nothing either
    ("[" * 3000, "", []),  # too deep for json: nothing, no exception
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", REQUIRED)
def test_required_reader_whole_and_every_split(text, content, calls):
    assert every_split(RequiredReader, text) == (content, calls, "tool_calls" if calls else "stop")


@pytest.mark.parametrize("text,content,calls", REQUIRED)
def test_a_required_answer_cut_short_is_never_content(text, content, calls):
    """The whole message of a "required" answer cut by max_tokens: the calls it completed, no
    content (null beside calls, "" without: vLLM's message for an array it cannot validate), and
    finish_reason "length"; its stream has no content delta at all (every split)."""
    r = RequiredReader()
    msg = AnswerReader(None, r).message(text)
    assert msg["content"] == (None if calls else "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls
    assert r.tool_calls_finish("length") == "length"
    r = AnswerReader(None, RequiredReader())
    deltas = [r.push(ch) for ch in text] + [r.finish("")]
    assert not any("content" in d for d in deltas)


def test_named_reader_is_all_arguments():
    text = '{"city": "Paris"}'
    assert every_split(lambda: NamedReader("get_weather"), text) == ("", [("get_weather", text)], "stop")
    assert every_split(lambda: NamedReader("f"), "\n\n" + text) == ("", [("f", text)], "stop")  # after reasoning
    msg = AnswerReader(None, NamedReader("f")).message("")
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("body,param,says", [
    ({"tools": []}, "tools", "empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),  # auto is the default with tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "unique"),
])
def test_tool_choice_checks(body, param, says):
    with pytest.raises(APIError) as e:
        tool_plan(_req(**body), parser=None)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


def test_tool_plans_and_forced_schemas():
    assert tool_plan(_req(), None) is None and tool_plan(_req(tool_choice="none"), None) is None
    plan = tool_plan(_req(tools=TOOLS, tool_choice="none"), None)
    assert plan.mode == "none"
    assert forced_schema(_req(tools=TOOLS, tool_choice="none")) is None
    assert tool_plan(_req(tools=TOOLS), "hermes").mode == "auto" and forced_schema(_req(tools=TOOLS)) is None
    named = _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert tool_plan(named, None).name == "get_weather"
    assert forced_schema(named) == TOOLS[0]["function"]["parameters"]
    assert forced_schema(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})) == \
        {"type": "object", "properties": {}}  # no parameters: an empty object
    req = forced_schema(_req(tools=TOOLS, tool_choice="required"))
    assert req["type"] == "array" and req["minItems"] == 1 and "maxItems" not in req
    names = [alt["properties"]["name"]["enum"] for alt in req["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert forced_schema(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))["maxItems"] == 1


def test_required_schema_lifts_defs_to_its_root():
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    with_defs = lambda name, d: {"type": "function", "function": {"name": name, "parameters": {  # noqa: E731
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": d}}}}
    schema = forced_schema(_req(tools=[with_defs("a", item), with_defs("b", item)], tool_choice="required"))
    assert schema["$defs"] == {"P": item}
    assert all("$defs" not in alt["properties"]["parameters"] for alt in schema["items"]["anyOf"])
    with pytest.raises(APIError, match="define \\$defs/P differently"):
        forced_schema(_req(tools=[with_defs("a", item), with_defs("b", {"type": "string"})], tool_choice="required"))
    old = {"type": "function", "function": {"name": "c", "parameters": {  # draft-07's definitions, too
        "type": "object", "properties": {"p": {"$ref": "#/definitions/Q"}}, "definitions": {"Q": item}}}}
    schema = forced_schema(_req(tools=[old], tool_choice="required"))
    assert schema["definitions"] == {"Q": item} and "$defs" not in schema
    tree = {"type": "function", "function": {"name": "t", "parameters": {  # recursive through its root
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    with pytest.raises(APIError, match="refer to their own root"):
        forced_schema(_req(tools=[tree], tool_choice="required"))
    for bad in (5, [item]):
        odd = {"type": "function", "function": {"name": "o", "parameters": {"type": "object", "$defs": bad}}}
        with pytest.raises(APIError, match=r"\$defs that is not an object"):
            forced_schema(_req(tools=[odd], tool_choice="required"))
    assert forced_schema(_req(tools=[tree], tool_choice={"type": "function", "function": {"name": "t"}}))  # fine


def test_messages_with_calls_as_a_template_reads_them():
    req = _req(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert template_messages(req.messages) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "not json"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    json.dumps(template_messages(req.messages))  # plain data

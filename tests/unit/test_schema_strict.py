"""JSON schemas are closed as vLLM's default structured-outputs backend closes them (xgrammar's
strict mode, core/structured.strict_json_schema): an object schema that lists its properties
and leaves additionalProperties unset takes no other property, on every path a schema reaches
the grammar engine by (response_format json_schema, strict or not; structured_outputs.json;
guided_json; a named or "required" tool_choice); what a schema or xgrammar leaves open stays
open; the caller's schema is never changed."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from draftsmith.core.structured import Grammars, StructuredOutputsParams as SO, strict_json_schema
from draftsmith.server.protocol import ChatCompletionRequest
from draftsmith.server.structured import structured_outputs

A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}  # the parity report's schema


@pytest.fixture(scope="module")
def accepts(tiny_model_dir):
    """`accepts(spec, text)`: the spec's grammar takes `text` whole (a byte-level tokenizer: any text)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])

    def run(spec: SO, text: str) -> bool:
        m = grammars.matcher(spec)
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting())

    return run


CLOSED = [  # (schema, what strict_json_schema makes of it)
    (A, {**A, "additionalProperties": False}),
    ({"type": "object", "properties": {}}, {"type": "object", "properties": {}, "additionalProperties": False}),  # {} only
    ({"properties": {"o": {"type": "object", "properties": {"b": {}}}}},  # nested, and no "type": still an object
     {"properties": {"o": {"type": "object", "properties": {"b": {}}, "additionalProperties": False}},
      "additionalProperties": False}),
    ({"type": "object", "patternProperties": {"^x": {}}},
     {"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False}),
    ({"type": "array", "items": {"properties": {"b": {}}}},
     {"type": "array", "items": {"properties": {"b": {}}, "additionalProperties": False}}),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"properties": {"b": {}}}]},  # a tuple: no more items
     {"type": "array", "prefixItems": [{"type": "integer"}, {"properties": {"b": {}}, "additionalProperties": False}],
      "items": False}),
    ({"type": "array", "prefixItems": [{}], "unevaluatedItems": {"type": "string"}},
     {"type": "array", "prefixItems": [{}], "unevaluatedItems": {"type": "string"}, "items": {"type": "string"}}),
    ({"anyOf": [{"properties": {"b": {}}}, {"type": "null"}]},
     {"anyOf": [{"properties": {"b": {}}, "additionalProperties": False}, {"type": "null"}]}),
    ({"oneOf": [{"properties": {"b": {}}}, {"properties": {"c": {}}}]},
     {"oneOf": [{"properties": {"b": {}}, "additionalProperties": False},
                {"properties": {"c": {}}, "additionalProperties": False}]}),
    ({"allOf": [{"properties": {"b": {}}}, {"required": ["b"]}]},  # the only member that lists properties
     {"allOf": [{"properties": {"b": {}}, "additionalProperties": False}, {"required": ["b"]}]}),
    ({"properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"properties": {"q": {}}}},
      "definitions": {"Q": {"properties": {"r": {}}}}},
     {"properties": {"p": {"$ref": "#/$defs/P"}}, "additionalProperties": False,
      "$defs": {"P": {"properties": {"q": {}}, "additionalProperties": False}},
      "definitions": {"Q": {"properties": {"r": {}}, "additionalProperties": False}}}),
    ({"type": "object", "properties": {}, "additionalProperties": {"properties": {"b": {}}}},  # a map of closed objects
     {"type": "object", "properties": {}, "additionalProperties": {"properties": {"b": {}}, "additionalProperties": False}}),
    # unevaluatedProperties alone is the object's additionalProperties (xgrammar reads it so; llguidance ignores it)
    ({**A, "unevaluatedProperties": {"type": "string"}},
     {**A, "unevaluatedProperties": {"type": "string"}, "additionalProperties": {"type": "string"}}),
    ({**A, "unevaluatedProperties": False}, {**A, "unevaluatedProperties": False, "additionalProperties": False}),
]

KEPT = [  # schemas strict_json_schema leaves as they are
    {**A, "additionalProperties": True},
    {**A, "additionalProperties": False},
    {**A, "additionalProperties": {"type": "string"}},
    {"type": "object"},  # xgrammar's built-in any object (json_object's schema)
    {"type": "object", "description": "anything", "maxProperties": 3},  # no properties listed: open
    {"type": "array", "maxItems": 3},
    {"type": "array", "prefixItems": [{}], "items": {"type": "integer"}},
    {},
    # combined: closing one would forbid what another lists (llguidance intersects them)
    {"allOf": [{"properties": {"b": {}}}, {"properties": {"c": {}}}]},
    {"properties": {"k": {}}, "anyOf": [{"properties": {"x": {}}}, {"required": ["k"]}]},
    {"$ref": "#/$defs/B", "properties": {"z": {}}, "$defs": {"B": {"properties": {"q": {}}}}},
    {"allOf": [{"$ref": "#/$defs/B"}, {"properties": {"z": {}}}], "$defs": {"B": {"properties": {"q": {}}}}},
    # ... through a chain of $refs (A names B: B stays open too) and a combined schema's own members
    {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"z": {}}}],
     "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"properties": {"q": {}}}}},
    {"allOf": [{"$ref": "#/$defs/A"}, {"properties": {"z": {}}}],
     "$defs": {"A": {"anyOf": [{"properties": {"q": {}}}, {"allOf": [{"$ref": "#/$defs/C"}]}]},
               "C": {"properties": {"r": {}}}}},
    # conditions: closing inside them changes the logic
    {"not": {"properties": {"b": {}}}, "if": {"properties": {"b": {}}}, "then": {"properties": {"c": {}}}},
    True,
]


@pytest.mark.parametrize("schema,closed", CLOSED)
def test_strict_json_schema_closes_what_the_schema_leaves_open(schema, closed):
    before = copy.deepcopy(schema)
    assert strict_json_schema(schema) == closed
    assert schema == before  # the caller's schema is not changed
    assert strict_json_schema(closed) == closed  # closing twice changes nothing more


@pytest.mark.parametrize("schema", KEPT)
def test_strict_json_schema_keeps_what_is_open_on_purpose(schema):
    assert strict_json_schema(schema) == schema


def test_a_json_schema_takes_no_undeclared_property(accepts):
    """The parity report's case (rf.json_schema: only `a` listed, the model wrote `"b": 2` too):
    refused now, nested objects, $defs, array items and tuples alike; the key order and the
    schema's own rules are as before; the caller's dict is not changed."""
    schema = copy.deepcopy(A)
    spec = SO(json=schema)
    assert schema == A
    assert accepts(spec, '{"a": 1}') and not accepts(spec, '{"a": 1, "b": 2}') and not accepts(spec, '{"b": 2}')
    nested = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/I"}},
                                               "pair": {"type": "array", "prefixItems": [{"type": "integer"}]}},
              "$defs": {"I": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
    spec = SO(json=nested)
    assert accepts(spec, '{"items": [{"id": 1}], "pair": [1]}')
    assert not accepts(spec, '{"items": [{"id": 1, "x": 0}]}')  # in a $defs object, an array's item
    assert not accepts(spec, '{"pair": [1, 2]}')  # a tuple takes the items it lists, no more
    assert not accepts(spec, '{"items": [], "z": 0}')
    assert not accepts(SO(json=json.dumps(A)), '{"a": 1, "b": 2}')  # the schema as JSON text: the same


def test_a_schema_combined_through_a_chain_of_refs_takes_every_part_s_properties(accepts):
    """allOf [A, {z}] where A is only {"$ref": B} and B lists q: an object with q and z is what the
    schema asks for (closing B, the end of the chain, made it unsatisfiable); a key neither lists is
    still refused where the schema closes it (here nothing closes the combination: JSON Schema's meaning)."""
    schema = {"type": "object", "allOf": [{"$ref": "#/$defs/A"}, {"properties": {"z": {"type": "integer"}}}],
              "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"properties": {"q": {"type": "integer"}}}},
              "properties": {"inner": {"type": "object", "properties": {"k": {}}}}}
    spec = SO(json=schema)
    assert accepts(spec, '{"q": 1, "z": 2}')
    assert not accepts(spec, '{"q": 1, "inner": {"k": 1, "x": 2}}')  # an uncombined object elsewhere stays closed


def test_what_the_schema_or_xgrammar_leaves_open_stays_open(accepts):
    """additionalProperties true or a schema is kept; `{"type": "object"}` and json_object are any
    object (xgrammar's built-in one); an object listing no properties is open; `"properties": {}`
    is the empty object only (as xgrammar's strict mode makes it)."""
    assert accepts(SO(json={**A, "additionalProperties": True}), '{"a": 1, "b": [2]}')
    typed = SO(json={**A, "additionalProperties": {"type": "string"}})
    assert accepts(typed, '{"a": 1, "b": "x"}') and not accepts(typed, '{"a": 1, "b": 2}')
    uneval = SO(json={**A, "unevaluatedProperties": {"type": "string"}})  # (llguidance alone would ignore it)
    assert accepts(uneval, '{"a": 1, "b": "x"}') and not accepts(uneval, '{"a": 1, "b": 2}')
    for spec in (SO(json={"type": "object"}), SO(json_object=True), SO(json={"type": "object", "maxProperties": 3})):
        assert accepts(spec, '{"x": {"y": [1]}}')
    empty = SO(json={"type": "object", "properties": {}})
    assert accepts(empty, "{}") and not accepts(empty, '{"x": 1}')


def test_a_schema_only_the_closing_makes_unsatisfiable_keeps_its_own_meaning(accepts):
    """minProperties above the properties listed cannot be met by a closed object: xgrammar's strict
    mode refuses it and vLLM's "auto" backend falls back to llguidance, open: so here too (the
    grammar of the schema as written, not a 400)."""
    import llguidance

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 2}
    spec = SO(json=schema)
    loose = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": True,
                                                                                         "lenient": True})
    assert spec.grammar_text() == loose
    assert accepts(spec, '{"b": 2, "c": 3}')  # (as llguidance reads the schema as written)


def test_a_schema_xgrammar_does_not_support_stays_open(accepts):
    """vLLM's "auto" backend gives a schema with a feature xgrammar does not support (anywhere in
    it) to guidance, which leaves objects open (backend_xgrammar.py has_xgrammar_unsupported_json_features):
    pydantic's set field (`uniqueItems`) keeps the model's extra key; the same schema without it
    is closed; so is one with patternProperties beside properties."""
    tags = {"type": "array", "items": {"type": "string"}}
    model = {"type": "object", "properties": {"name": {"type": "string"}, "tags": tags}, "required": ["name", "tags"]}
    as_set = {**model, "properties": {**model["properties"], "tags": {**tags, "uniqueItems": True}}}
    extra = '{"name": "x", "tags": ["a"], "more": 1}'
    assert accepts(SO(json=model), '{"name": "x", "tags": ["a"]}') and not accepts(SO(json=model), extra)
    assert accepts(SO(json=as_set), extra)
    nested = {"type": "object", "properties": {"m": as_set}}  # (anywhere: the whole schema goes to guidance)
    assert accepts(SO(json=nested), '{"m": {"name": "x", "tags": [], "z": 0}, "y": 1}')
    pattern = {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^x": {"type": "integer"}}}
    assert accepts(SO(json=pattern), '{"a": 1, "x1": 2, "other": "s"}')
    one = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}  # (xgrammar's: closed)
    assert accepts(SO(json=one), '{"x1": 2}') and not accepts(SO(json=one), '{"x1": 2, "other": "s"}')
    assert not accepts(SO(json={**A, "properties": {"a": {"type": "integer", "minimum": 0}}}), '{"a": 1, "b": 2}')


def test_the_json_grammar_cache_is_small_and_compiles_once(monkeypatch):
    """_json_grammar keeps as many grammars as Grammars does (64: a request's schema text can be
    megabytes), and a schema it closes is compiled once (closed), not also as written."""
    import llguidance

    from draftsmith.core.structured import _json_grammar

    assert _json_grammar.cache_info().maxsize == 64
    real, texts = llguidance.LLMatcher, []

    class Counting:
        validate_grammar = staticmethod(real.validate_grammar)

        @staticmethod
        def grammar_from_json_schema(text, defaults=None):
            texts.append(json.loads(text))
            return real.grammar_from_json_schema(text, defaults=defaults)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    options = json.dumps({"whitespace_flexible": True, "lenient": True})
    _json_grammar.__wrapped__(json.dumps(A), options)
    assert texts == [strict_json_schema(A)]
    texts.clear()
    _json_grammar.__wrapped__(json.dumps({"type": "object"}), options)  # (nothing to close: as written, once)
    assert texts == [{"type": "object"}]


def _req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}  # an SDK's usual tool
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "now"}}]  # (no parameters: the empty object)


@pytest.mark.parametrize("body,good,bad", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": A}}},
     '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": A, "strict": True}}},
     '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"structured_outputs": {"json": A}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"guided_json": A}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     '{"city": "Paris"}', '{"city": "Paris", "location": "x"}'),
    ({"tools": TOOLS, "tool_choice": "required"},
     '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]',
     '[{"name": "get_weather", "parameters": {"city": "Paris", "action": "x"}}]'),  # (tools.required_n2's "action")
    ({"tools": TOOLS, "tool_choice": "required"}, '[{"name": "now", "parameters": {}}]',
     '[{"name": "now", "parameters": {"x": 1}}]'),
])
def test_every_request_path_is_strict(accepts, body, good, bad):
    req = _req(**body)
    before = copy.deepcopy(req.model_dump())
    spec = structured_outputs(req)
    assert accepts(spec, good) and not accepts(spec, bad)
    assert req.model_dump() == before  # the request's schemas are not changed

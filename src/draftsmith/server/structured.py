"""A request's grammar: OpenAI's `response_format`, vLLM's `structured_outputs` object and its
older `guided_*` fields, and the JSON a forced tool call must be (server/tools.py), checked and
turned into one StructuredOutputsParams (core/structured.py)."""

from __future__ import annotations

from typing import Any, Callable

from draftsmith.core.structured import StructuredOutputsParams
from draftsmith.errors import DraftsmithError
from draftsmith.server.protocol import LLGUIDANCE, APIError, NamedToolChoice, backend_refusal
from draftsmith.server.tools import forced_schema

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "whitespace_pattern")
# vLLM backend switches, nothing to do here (disable_additional_properties: every JSON schema is
# already closed as vLLM's default xgrammar backend closes it, core/structured.strict_json_schema;
# backend: llguidance's names only, checked in structured_outputs)
_IGNORED_KEYS = ("disable_fallback", "disable_additional_properties", "backend")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def asks_structure(req: Any) -> bool:
    """Whether the request has any field that asks for a grammar (so the cheap path skips the rest)."""
    rf = req.response_format
    choice = getattr(req, "tool_choice", None)
    so = req.structured_outputs
    return bool((rf and rf.get("type") not in (None, "text"))
                or (so and (any(k != "backend" for k in so) or so["backend"] not in LLGUIDANCE))
                or any(getattr(req, name) is not None for name in _GUIDED)
                or choice == "required" or isinstance(choice, NamedToolChoice))


def structured_outputs(req: Any, check: Callable[[StructuredOutputsParams], None] | None = None,
                       reasoning: str | None = None) -> StructuredOutputsParams | None:
    """The request's grammar, from whichever of its fields asks for one (one at most):
    OpenAI's `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}} or
    {"type": "json_object"}; "text" = none), vLLM's `structured_outputs` object ({"json": ...},
    {"regex": ...}, {"choice": [...]}, {"grammar": "<GBNF or Lark>"}, {"json_object": true};
    disable_any_whitespace, whitespace_pattern) and
    vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. `check`:
    the target's grammar compiler (core/structured.Grammars.check); its error is a 400 too.
    `reasoning`: where the grammar starts for a thinking model (StructuredOutputsParams.reasoning)."""
    asked: dict[str, dict] = {}
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise APIError(400, "response_format of type json_schema needs json_schema: {\"name\": ..., \"schema\": "
                               "a JSON schema object}", param="response_format", code="invalid_value")
            # without a schema (OpenAI makes it optional): any JSON object
            asked["response_format"] = dict(json=js["schema"]) if "schema" in js else dict(json_object=True)
        elif kind == "json_object":
            asked["response_format"] = dict(json_object=True)
        elif kind not in (None, "text"):
            raise APIError(400, f"response_format type {kind!r} is not supported: use text, json_object or json_schema "
                           "(or structured_outputs with regex, choice or grammar)", param="response_format",
                           code="unsupported_parameter")
    so = req.structured_outputs
    if so and "backend" in so:  # (every route's structured_outputs: chat, completions, responses, messages)
        if so["backend"] is not None and so["backend"] not in LLGUIDANCE:
            raise APIError(400, backend_refusal(so["backend"]), param="structured_outputs",
                           code="unsupported_parameter")
        so = {k: v for k, v in so.items() if k != "backend"}  # (a backend alone asks for no grammar)
    if so:
        other = sorted(k for k, v in so.items()
                       if k not in _STRUCTURED_KEYS + _IGNORED_KEYS and v is not None and v is not False)
        if other:
            raise APIError(400, f"structured_outputs.{other[0]} is not supported; use one of "
                           f"{', '.join(_STRUCTURED_KEYS[:5])} (and disable_any_whitespace, whitespace_pattern)",
                           param="structured_outputs", code="unsupported_parameter")
        asked["structured_outputs"] = {k: v for k, v in so.items() if k in _STRUCTURED_KEYS and v is not None}
    for name, key in _GUIDED.items():
        if getattr(req, name) is not None:
            asked[name] = {key: getattr(req, name)}
    schema = forced_schema(req)
    if schema is not None:
        asked["tool_choice"] = {"json": schema}
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"give one way to constrain the output, not {' and '.join(asked)}",
                       param=list(asked)[1], code="invalid_value")
    (param, spec), = asked.items()
    if req.guided_whitespace_pattern is not None and ("json" in spec or "json_object" in spec):
        spec.setdefault("whitespace_pattern", req.guided_whitespace_pattern)  # vLLM's, for any JSON kind
    if reasoning is not None:
        spec["reasoning"] = reasoning
    try:
        spec = StructuredOutputsParams(**spec)
        if check is not None:
            check(spec)
        return spec
    except (DraftsmithError, TypeError) as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None

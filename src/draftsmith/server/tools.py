"""Tool calling on /v1/chat/completions, with vLLM's rules: what a request's `tools`,
`tool_choice` and `parallel_tool_calls` ask for (`ToolPlan`), the messages of a conversation
with earlier calls as a chat template reads them, and the grammar a forced call decodes under.

- `tool_choice: {"type": "function", "function": {"name": F}}`: the answer is F's arguments, a
  JSON object decoded under F's `parameters` schema (a grammar: server/structured.py);
- `"required"`: one or more calls, a JSON array `[{"name": ..., "parameters": {...}}, ...]`
  decoded under a schema that allows exactly the request's functions (at most one call with
  `parallel_tool_calls: false`);
- `"auto"` (the default when tools are given): the model decides; its text is parsed for calls
  by the server's `--tool-call-parser` (hermes: `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`, Qwen2.5's and Hermes' format), which `serve --enable-auto-tool-choice` turns on;
  without it, "auto" is refused, as vLLM refuses it;
- `"none"`: no calls; the tools still reach the chat template.

A forced call is a grammar like any other, so speculative decoding stays lossless under it
(core/structured.py). server/tool_calls.py turns the generated text into the message's calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from draftsmith.server.protocol import APIError, ChatMessage, NamedToolChoice

TOOL_CALL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request asked of its tools. `mode`: none, auto, required or named; `name`:
    the named function; `parallel`: more than one call allowed; `parser`: auto's text parser."""

    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None


def check_tools(tools: list | None) -> list[str]:
    """The functions' names; a 400 for an empty list or two functions of one name (chat and
    /tokenize alike)."""
    if tools is None:
        return []
    if not tools:
        raise APIError(400, "tools must not be an empty list: give at least one tool or leave the field out",
                       param="tools", code="invalid_value")
    names = [t.function.name for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise APIError(400, f"tools: two functions are named {dup!r}; names must be unique", param="tools",
                       code="invalid_value")
    return names


def tool_plan(req: Any, parser: str | None) -> ToolPlan | None:
    """The request's tool plan (None without tools), checked as vLLM checks it; `parser`: the
    server's auto tool-call parser (None: auto tool choice is off)."""
    tools, choice = req.tools, req.tool_choice
    names = check_tools(tools)
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: list the functions the model may call in `tools`",
                           param="tool_choice", code="invalid_value")
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools "
                           f"({', '.join(names)})", param="tool_choice", code="invalid_value")
        return ToolPlan("named", name=choice.function.name, parallel=req.parallel_tool_calls)
    mode = choice or "auto"
    if mode == "auto" and parser is None:
        raise APIError(400, '"auto" tool choice (the default when tools are given) needs a server started with '
                       "`draftsmith serve --enable-auto-tool-choice --tool-call-parser hermes`; or send "
                       'tool_choice "required", "none" or a named function',
                       param="tool_choice", code="invalid_value")
    return ToolPlan(mode, parallel=req.parallel_tool_calls, parser=parser if mode == "auto" else None)


def forced_schema(req: Any) -> dict | None:
    """The JSON schema a request's tool_choice forces its answer into (None: nothing forced)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        fn = next((t.function for t in tools if t.function.name == choice.function.name), None)
        return None if fn is None else _parameters(fn.parameters)
    if choice != "required":
        return None
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    alternatives = []
    for t in tools:
        params = dict(_parameters(t.function.parameters))
        # a function's "#/$defs/..." refer to its own schema's root: move them to the new root
        for where in defs:
            moved = params.pop(where, None) or {}
            if not isinstance(moved, dict):
                raise APIError(400, f"tools: {t.function.name}'s parameters have a {where} that is not an object",
                               param="tools", code="invalid_value")
            for key, sub in moved.items():
                if key in defs[where] and defs[where][key] != sub:
                    raise APIError(400, f"tools: two functions define {where}/{key} differently; tool_choice "
                                   "\"required\" needs one meaning for each name", param="tools", code="invalid_value")
                defs[where][key] = sub
        ref = _root_ref([params, *(d for d in defs.values())])
        if ref is not None:
            raise APIError(400, f"tools: {t.function.name}'s parameters refer to their own root ({{\"$ref\": {ref!r}}}), "
                           "which tool_choice \"required\" cannot keep (its schema has a root of its own); use $defs, "
                           "or name the function in tool_choice", param="tools", code="invalid_value")
        alternatives.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                              "parameters": params},
                             "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update({where: d for where, d in defs.items() if d})
    return schema


def _root_ref(node: Any) -> str | None:
    """A `$ref` into the schema's own root other than its $defs / definitions (None: there is none)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
            return ref
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    return next((r for r in map(_root_ref, children) if r is not None), None)


def _parameters(params: dict | None) -> dict:
    return params if params is not None else {"type": "object", "properties": {}}


_DEVELOPER = re.compile(r"""(['"])developer\1""")


def names_developer(template: Any) -> bool:
    """Whether a chat template (a string, or named templates: a dict or a list of
    `{"name", "template"}`) names the developer role: `'developer'` or `"developer"` as a
    quoted literal, as a template that reads the role compares it (`message.role ==
    'developer'`); the word in a comment or in prose does not count."""
    if isinstance(template, dict):
        return any(names_developer(t) for t in template.values())
    if isinstance(template, (list, tuple)):
        return any(names_developer(t.get("template") if isinstance(t, dict) else t) for t in template)
    return isinstance(template, str) and _DEVELOPER.search(template) is not None


def template_messages(messages: list[ChatMessage], developer: bool = True) -> list[dict]:
    """The messages as a chat template reads them: text content ("" for none), an assistant's
    earlier calls with their arguments as objects (as vLLM hands them to HF templates, which
    write them with `tojson`) and its reasoning (`reasoning` or `reasoning_content`, handed on
    as `reasoning_content`), a tool message's `tool_call_id`.

    `developer`: the template names the developer role (`names_developer`). Where it does not
    (Qwen2.5's drops such a message unseen; SmolLM2's writes a role its model never saw, after
    its own default system prompt), developer messages among the conversation's leading system
    and developer messages are one system message: that run's texts joined by a blank line (the
    empty ones left out), OpenAI's meaning of the role. One system message, first: templates that
    refuse a system message anywhere else ("System message must be at the beginning") still take
    `instructions` + a developer message, or an SDK's system + developer. A developer message
    later in the conversation goes as sent (a second system message there would be refused by
    those templates); so does a leading run without a developer message."""
    lead = 0
    if not developer:
        while lead < len(messages) and messages[lead].role in ("system", "developer"):
            lead += 1
        if not any(m.role == "developer" for m in messages[:lead]):
            lead = 0
    out: list[dict] = []
    if lead:
        out.append({"role": "system", "content": "\n\n".join(t for t in (m.text() for m in messages[:lead]) if t)})
    for m in messages[lead:]:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        thought = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thought is not None:  # (Qwen3's template reads it as reasoning_content)
            d["reasoning_content"] = thought
        out.append(d)
    return out


def prompt_texts(messages: list[ChatMessage], tools: list[dict] | None) -> list[str]:
    """Every text a chat prompt carries: the messages' and the tool definitions' (for the
    server's prompt-size limit)."""
    return ([m.text() for m in messages] + [c.function.arguments for m in messages for c in m.tool_calls or []]
            + [(m.reasoning if m.reasoning is not None else m.reasoning_content) or "" for m in messages]
            + ([json.dumps(tools, ensure_ascii=False)] if tools else []))


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text

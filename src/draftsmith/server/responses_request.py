"""The Responses API's request (POST /v1/responses), read into the chat request that
/v1/chat/completions serves: the same messages, chat template, sampling, grammar and tool plan.

- `input`: a string (one user message) or a list of items: messages (`type` "message" or none;
  role user, system, developer or assistant; content a string or `input_text` / `output_text`
  parts), `function_call` items (an assistant's earlier calls: consecutive ones, and one right
  after an assistant's message, are that message's `tool_calls`), `function_call_output` items
  (tool messages), `reasoning` items (their text, from `content`'s reasoning_text parts or else
  `summary`, is the `reasoning` of the assistant message that follows: a message item or the one
  its function_call items make; with no assistant message after it, an assistant message of its
  own with only that reasoning, as vLLM makes every reasoning item). `instructions` is a system
  message before them. Where the template does not name the `developer` role, the leading
  system and developer messages (`instructions` included) reach it as one system message and a
  later developer message as sent (server/tools.py's template_messages, as on chat).
- `text.format` -> `response_format` (text, json_object, json_schema); flat function `tools`
  `{"type": "function", "name", "description", "parameters", "strict"}` and `tool_choice`
  ("auto", "none", "required", `{"type": "function", "name"}`) -> chat's tools and tool_choice;
  `max_output_tokens` -> max_tokens; `include: ["message.output_text.logprobs"]` with
  `top_logprobs` -> logprobs (top_logprobs is checked against OpenAI's 0..20 either way); vLLM's
  extras seed, top_k, min_p, repetition_penalty, priority, cache_salt and structured_outputs
  (regex, choice, grammar, ...) as on chat. Any optional field may be null: its default.
- Stateless, as vLLM without its response store: `store` is accepted and nothing is kept, so
  `previous_response_id`, `conversation` and `background` are refused. `reasoning` is accepted
  and echoed (reasoning text comes from the server's --reasoning-parser, not from an effort).

Every mistake is a 400 that names the field (`input[2].content[0]`, `tools[1]`, ...); errors the
chat machinery raises later name the Responses field (`responses_error`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from draftsmith.server.protocol import APIError, ChatCompletionRequest, _in_range, _Req
from draftsmith.server.request_fields import VllmExtras, chat_of, parse
from draftsmith.server.state import TooManyTokens

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NOT_INPUT = "input must be a string or a list of input items (objects with a role or a type)"
NO_STORE = ("this server keeps no responses (it is stateless, as vLLM without its response store): send the "
             "whole conversation in `input`, earlier outputs included (function_call and function_call_output items)")


class _Text(_Req):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class _Message(_Req):
    type: Literal["message"] | None = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[dict[str, Any]]


class _FunctionCall(_Req):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr


class _FunctionCallOutput(_Req):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: StrictStr | list[dict[str, Any]]


class _SummaryText(_Req):
    type: Literal["summary_text"]
    text: StrictStr


class _ReasoningText(_Req):
    type: Literal["reasoning_text"]
    text: StrictStr


class _Reasoning(_Req):
    type: Literal["reasoning"]
    summary: list[_SummaryText] | None = None
    content: list[_ReasoningText] | None = None
    encrypted_content: StrictStr | None = None

    def text(self, where: str) -> str:
        """Its text: the content's (reasoning_text parts), else the summary's (vLLM's order)."""
        if self.content:
            return "".join(c.text for c in self.content)
        if self.summary:
            return "\n\n".join(s.text for s in self.summary)
        if self.encrypted_content:
            raise APIError(400, f"{where}: a reasoning item's encrypted_content cannot be read by this server; send "
                           "its text in content (reasoning_text parts) or summary", param="input",
                           code="unsupported_parameter")
        return ""


class _FunctionTool(_Req):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponsesRequest(VllmExtras):
    """POST /v1/responses's body (unknown fields are ignored, as on the other routes). Every
    optional field may be null, as OpenAI's and vLLM's: null is the field's default. vLLM's
    extras (seed, min_p, ... : server/request_fields.py) and top_k as on /v1/chat/completions."""

    model: StrictStr | None = None
    input: Any  # a string or a list of items (input_messages checks it)
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool | None = None  # (None: false)
    text: dict[str, Any] | None = None  # {"format": {...}, "verbosity": ...}
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None  # (None: "auto")
    parallel_tool_calls: StrictBool | None = None  # (None: true)
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None  # accepted; nothing is stored
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: echoed
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None  # (None: false)
    top_k: StrictInt | None = None  # (vLLM's)

    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def echo(self, tools: list[dict] | None, fmt: dict | None) -> dict:
        """What a Response object repeats of its request (`tools`: chat's, `fmt`: text.format, as read)."""
        fmt = fmt or {"type": "text"}
        if fmt["type"] == "json_schema":
            fmt = {**fmt, "name": fmt.get("name") or "response"}  # (as the grammar's request names it)
        text = {**(self.text or {}), "format": fmt}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": self.reasoning, "background": False,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p, "text": text,
                "tool_choice": self.tool_choice or "auto", "truncation": "disabled", "user": self.user,
                "tools": [{"type": "function", **t["function"]} for t in tools or []],
                "top_logprobs": self.top_logprobs}

    def text_format(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type"), str)):
            raise APIError(400, 'text.format must be an object with a type: {"type": "text"}, {"type": "json_object"} '
                           'or {"type": "json_schema", "name": ..., "schema": {...}}', param="text", code="invalid_value")
        return fmt


def chat_request(req: ResponsesRequest) -> tuple[ChatCompletionRequest, dict]:
    """`req` as the chat route's request, and what its Response repeats of it (`echo`); a 400
    for what this server cannot do."""
    for field, asked in (("previous_response_id", req.previous_response_id is not None),
                         ("conversation", req.conversation is not None), ("background", bool(req.background))):
        if asked:
            raise APIError(400, f"{field} is not supported: {NO_STORE}", param=field, code="unsupported_parameter")
    if req.truncation == "auto":
        raise APIError(400, 'truncation "auto" is not supported: this server never drops input to fit the context '
                       '(a prompt that does not fit is a 400); send "disabled" or leave it out', param="truncation",
                       code="unsupported_parameter")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise APIError(400, f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                       param="max_output_tokens", code="invalid_value")
    top_logprobs = _in_range(req.top_logprobs, "top_logprobs")  # (OpenAI's range, with include or not)
    messages = input_messages(req.input)
    if not messages:
        raise APIError(400, "input is empty: give a string or at least one message", param="input",
                       code="invalid_value")
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    tools = chat_tools(req.tools)
    choice = chat_tool_choice(req.tool_choice)
    fmt = req.text_format()
    stream = bool(req.stream)
    body: dict[str, Any] = {
        "messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": stream, "user": req.user, "top_k": req.top_k, **req.extras(), "tools": tools,
        "parallel_tool_calls": req.parallel_tool_calls,
        "tool_choice": None if choice == "auto" and tools is None else choice,  # (auto without tools: none)
        "response_format": response_format(fmt),
        "logprobs": True if req.logprobs() else None,
        "top_logprobs": (top_logprobs or 0) if req.logprobs() else None,
        "stream_options": {"include_usage": True} if stream else None,
    }
    return chat_of(body), req.echo(tools, fmt)


def input_messages(items: Any) -> list[dict]:
    """`input` as chat messages (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, f"{_NOT_INPUT}; got {_json_kind(items)}", param="input", code="invalid_value")
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{_NOT_INPUT}; {where} is {_json_kind(item)}", param="input", code="invalid_value")
        kind = item.get("type") or "message"
        last = out[-1] if out else None
        if kind == "message":
            m = _parse(_Message, item, where)
            text = _text(m.content, f"{where}.content")
            if m.role == "assistant" and _reasoning_only(last):  # the reasoning before it is its own
                last["content"] = text
            else:
                out.append({"role": m.role, "content": text})
        elif kind == "function_call":
            c = _parse(_FunctionCall, item, where)
            call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            if last is not None and last["role"] == "assistant":  # the same turn: one message, its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            o = _parse(_FunctionCallOutput, item, where)
            out.append({"role": "tool", "tool_call_id": o.call_id, "content": _text(o.output, f"{where}.output")})
        elif kind == "reasoning":
            thought = _parse(_Reasoning, item, where).text(where)
            if thought and _reasoning_only(last):
                last["reasoning"] += "\n\n" + thought
            elif thought:  # the next assistant message's (or its own, where none follows: vLLM's)
                out.append({"role": "assistant", "content": None, "reasoning": thought})
        else:
            raise APIError(400, f"{where}: items of type {kind!r} are not supported; this server reads message, "
                           "function_call, function_call_output and reasoning items"
                           + (f" ({NO_STORE})" if kind == "item_reference" else ""),
                           param="input", code="unsupported_parameter")
    return out


def _reasoning_only(message: dict | None) -> bool:
    """`message` is an assistant's built from a reasoning item alone (so far)."""
    return (message is not None and message["role"] == "assistant" and "reasoning" in message
            and message["content"] is None and not message.get("tool_calls"))


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    for t, name in ((bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return type(value).__name__


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}` (none
    for an empty list: a Response's own `tools` default)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; this server calls "
                           'function tools only: {"type": "function", "name": ..., "parameters": {...}}',
                           param="tools", code="unsupported_parameter")
        t = _parse(_FunctionTool, tool, f"tools[{i}]", param="tools")
        out.append({"type": "function", "function": t.model_dump(exclude={"type"})})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict | None:
    """Responses' tool_choice as chat's ("auto", "none", "required" or a named function)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto"
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...} '
                   f"(function tools only), got {choice!r}", param="tool_choice", code="invalid_value")


def response_format(fmt: dict | None) -> dict | None:
    """`text.format` as chat's response_format (None: free text)."""
    kind = None if fmt is None else fmt["type"]
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise APIError(400, 'text.format of type json_schema needs schema, a JSON schema object: {"type": '
                           '"json_schema", "name": ..., "schema": {...}}', param="text", code="invalid_value")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "response", "schema": schema,
                                                       "strict": fmt.get("strict")}}
    raise APIError(400, f"text.format type {kind!r} is not supported: use text, json_object or json_schema",
                   param="text", code="unsupported_parameter")


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's (or a call output's) text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text"):
            raise APIError(400, f"{where}[{j}]: content of type {part.get('type')!r} is not supported; this server "
                           "reads text only (input_text, output_text)", param="input", code="unsupported_parameter")
        parts.append(_parse(_Text, part, f"{where}[{j}]").text)
    return "".join(parts)


def _parse(model: type[BaseModel], item: dict, where: str, param: str = "input") -> Any:
    return parse(model, item, where, param)


# what the chat machinery calls a field, and its name in a Responses request
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens", "response_format": "text",
           "logprobs": "top_logprobs"}
_WORDS = re.compile(r"\b(max_tokens|response_format)\b")


def responses_error(e: APIError) -> APIError:
    """An error of the chat machinery as a Responses request names its fields."""
    if isinstance(e, TooManyTokens):  # (worded for chat's prompts and n, which a Response has not)
        return APIError(e.status, f"this request may need up to {e.tokens} tokens (its input + max_output_tokens), "
                        f"over this server's limit of {e.limit}; lower max_output_tokens or send a shorter input",
                        type=e.type, param=e.param, code=e.code)
    message = _WORDS.sub(lambda m: {"max_tokens": "max_output_tokens", "response_format": "text.format"}[m.group(1)],
                         e.message)
    return APIError(e.status, message, type=e.type, param=_PARAMS.get(e.param, e.param), code=e.code)

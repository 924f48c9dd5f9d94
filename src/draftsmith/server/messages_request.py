"""Anthropic's Messages API request (POST /v1/messages, and the prompt fields of POST
/v1/messages/count_tokens), read into the chat request that /v1/chat/completions serves: the same
messages, chat template, sampling, grammar and tool plan.

- `system` (a string or text blocks) and the `messages` of role system (the anthropic package's
  MessageParam allows it; Claude Code sends its system prompt so) -> one system message first:
  their text, `system`'s first, joined by "\n". Claude Code's `x-anthropic-billing-header: ...;
  cch=<nonce>;` text block (a line of a string) is left out: its nonce changes with every request
  and would make every prompt differ from its first tokens on, so the prefix cache never matched.
- `messages`, role user or assistant, `content` a string or blocks; consecutive messages of one
  role are one turn (their blocks in order, as Anthropic merges them; system messages between
  them do not part them):
  - user: a run of `text` blocks -> a user message; each `tool_result` block (`content` a string
    or text blocks) -> a tool message answering its `tool_use_id`, its content after "Error: "
    where `is_error` is true (so the model reads that the call failed); in the order the blocks come;
  - assistant: `text` blocks -> its content, `tool_use` blocks {id, name, input} -> its
    `tool_calls` (input as JSON arguments), `thinking` blocks -> its `reasoning` (as the
    Responses API's reasoning items: the template reads it as reasoning_content; several joined
    by a blank line; the signature is not checked). A chat message holds its text apart from its
    calls, so the template writes the text first, also text that came after a tool_use block;
  - the last message sent an assistant's: the answer continues its turn (Anthropic's prefill;
    chat's continue_final_message; not where a system message comes after it); a continued turn
    with a tool_use block is a 400 (its result is missing, and the call would not be rendered).
  A message's (and `system`'s) text blocks are joined by "\n": clients such as Claude Code send
  a prompt and its reminders as blocks of their own. `image`, `document`, `redacted_thinking`
  and server tools' blocks are a 400.
- `max_tokens` (required, at least 1) -> max_tokens; `stop_sequences` -> stop; `temperature`,
  `top_p`, `top_k` as sent; `tools` [{name, description, input_schema}] -> chat's function tools;
  `tool_choice` auto / any / tool / none -> "auto" (needs the server's tool-call parser) /
  "required" / the named function / "none", `disable_parallel_tool_use` -> parallel_tool_calls
  false; `output_config.format` {"type": "json_schema", "schema"} -> response_format.
- vLLM's extras, as on /v1/chat/completions and /v1/responses (the anthropic package sends them
  in `extra_body`): seed, min_p, repetition_penalty, priority, cache_salt, structured_outputs
  (server/request_fields.py) and chat_template_kwargs (count_tokens reads it too: it changes the
  prompt).
- Accepted and ignored: `metadata`, `service_tier`, `thinking` (any object: enabled, disabled,
  adaptive; reasoning text comes from the server's --reasoning-parser), `output_config.effort`,
  blocks' `cache_control` and `citations`; unknown fields, as on the other routes. Any optional
  field may be null: its default.

Every mistake is a 400 that names the field (`messages[2].content[0]`, `tools[1].input_schema`);
server/messages_error.py words the chat machinery's later errors for a Messages request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from draftsmith.server.messages_error import AnthropicError
from draftsmith.server.protocol import ChatCompletionRequest, _Req
from draftsmith.server.request_fields import VllmExtras, chat_of, parse

_TEXT_ONLY = "this server's models read text only"
BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request line (see the module docstring)


class _TextBlock(_Req):
    type: Literal["text"]
    text: StrictStr


class _ToolUse(_Req):
    type: Literal["tool_use"]
    id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    input: dict[str, Any]


class _ToolResult(_Req):
    type: Literal["tool_result"]
    tool_use_id: StrictStr = Field(min_length=1)
    content: StrictStr | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None


class _Thinking(_Req):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class _Message(_Req):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]]


class _Tool(_Req):
    type: Literal["custom"] | None = None
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    strict: StrictBool | None = None


class _ToolChoice(_Req):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class CountTokensRequest(_Req):
    """POST /v1/messages/count_tokens's body: the prompt's fields."""

    model: StrictStr
    messages: list[Any]  # (chat_messages reads them)
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted, ignored
    chat_template_kwargs: dict[str, Any] | None = None  # (vLLM's)


class MessagesRequest(CountTokensRequest, VllmExtras):
    """POST /v1/messages's body."""

    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    stream: StrictBool | None = None  # (None: false)
    metadata: dict[str, Any] | None = None  # accepted, ignored
    service_tier: StrictStr | None = None  # accepted, ignored
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}, "effort"}
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name of output_config.format


def chat_request(req: MessagesRequest, auto_tools: bool) -> ChatCompletionRequest:
    """`req` as the chat route's request; `auto_tools`: the server reads tool calls from free text
    (--tool-call-parser), which tool_choice auto (the default with tools) needs."""
    if req.max_tokens < 1:
        raise AnthropicError(400, f"max_tokens must be at least 1, got {req.max_tokens}", param="max_tokens")
    stream = bool(req.stream)
    body = {**prompt_fields(req), **req.extras(), "max_tokens": req.max_tokens, "stop": req.stop_sequences or None,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            "response_format": response_format(output_config(req))}
    choice = body.get("tool_choice")
    if choice == "auto" and not auto_tools:
        raise AnthropicError(400, 'tool_choice {"type": "auto"} (the default when tools are given) needs a server '
                             "started with `draftsmith serve --enable-auto-tool-choice --tool-call-parser hermes`; "
                             'or send tool_choice {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}',
                             param="tool_choice")
    return chat_of(body)


def count_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """`req` as a chat request whose prompt (chat template, tools) is the one /v1/messages renders."""
    return chat_of(prompt_fields(req))


def prompt_fields(req: CountTokensRequest) -> dict[str, Any]:
    """The chat request's fields that make its prompt: messages, template options, tools."""
    system, messages, prefill = chat_messages(req.messages)
    if req.system is not None:
        system.insert(0, _system(req.system, "system"))
    system = [text for text in system if text]
    if system:
        messages.insert(0, {"role": "system", "content": "\n".join(system)})
    tools = chat_tools(req.tools)
    choice, parallel = chat_tool_choice(req.tool_choice, tools)
    return {"messages": messages, "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
            "chat_template_kwargs": req.chat_template_kwargs}


def chat_messages(messages: list[Any]) -> tuple[list[str], list[dict], bool]:
    """`messages` as chat messages (see the module docstring): (the system messages' texts, the
    user and assistant turns' chat messages, the last turn is an assistant's prefill)."""
    system: list[str] = []
    turns: list[tuple[str, list[tuple[dict, str]]]] = []  # (role, its blocks with where each is)
    last = ""  # the last message's role
    for i, item in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise AnthropicError(400, f"{where}: a message is an object with a role and content", param="messages")
        m = _parse(_Message, item, where)
        last = m.role
        if m.role == "system":
            system.append(_system(m.content, f"{where}.content"))
            continue
        if m.role not in ("user", "assistant"):
            raise AnthropicError(400, f"{where}.role: must be 'user', 'assistant' or 'system', got {m.role!r}",
                                 param="messages")
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        located = [(b, f"{where}.content[{j}]") for j, b in enumerate(blocks)]
        if turns and turns[-1][0] == m.role:  # (one turn, as Anthropic merges them)
            turns[-1][1].extend(located)
        else:
            turns.append((m.role, located))
    if not turns:
        raise AnthropicError(400, "messages: give at least one user or assistant message", param="messages")
    out: list[dict] = []
    for role, located in turns:
        out += _user(located) if role == "user" else [_assistant(located)]
    # Anthropic's prefill: the last message sent is an assistant's (a system message after it is not)
    prefill = last == "assistant"
    calls = [at for b, at in located if b.get("type") == "tool_use"] if prefill else []
    if calls:  # (a continued message's calls would be rendered after the text the answer continues: lost)
        raise AnthropicError(400, f"{calls[0]}: the last assistant turn, which the answer would continue, has a "
                             "tool_use block; send the tool's result in a user message's tool_result block after "
                             "it", param="messages")
    return system, out, prefill


def _user(blocks: list[tuple[dict, str]]) -> list[dict]:
    """A user's blocks: its runs of text user messages, its tool results tool messages, in order."""
    out: list[dict] = []
    texts: list[str] = []
    for block, at in blocks:
        kind = _kind(block, at, ("text", "tool_result"), "user")
        if kind == "text":
            texts.append(_parse(_TextBlock, block, at).text)
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        r = _parse(_ToolResult, block, at)
        content = "" if r.content is None else _text(r.content, f"{at}.content")
        if r.is_error:
            content = f"Error: {content}" if content else "Error"
        out.append({"role": "tool", "tool_call_id": r.tool_use_id, "content": content})
    if texts or not out:  # (no blocks at all: an empty user message, as sent)
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[tuple[dict, str]]) -> dict:
    """An assistant's blocks as one message: its text, its calls, its reasoning."""
    texts, thoughts, calls = [], [], []
    for block, at in blocks:
        kind = _kind(block, at, ("text", "tool_use", "thinking"), "assistant")
        if kind == "text":
            texts.append(_parse(_TextBlock, block, at).text)
        elif kind == "thinking":
            thoughts.append(_parse(_Thinking, block, at).thinking)
        else:
            u = _parse(_ToolUse, block, at)
            calls.append({"id": u.id, "type": "function",
                          "function": {"name": u.name, "arguments": json.dumps(u.input, ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning"] = "\n\n".join(thoughts)
    return message


def _kind(block: Any, at: str, allowed: tuple[str, ...], role: str) -> str:
    """A content block's type, one of `allowed` in a `role` message; else a 400 that says why."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in allowed:
        return kind
    if not isinstance(kind, str):
        why = "a content block is an object with a type"
    elif kind in ("image", "document"):
        why = f"{kind} blocks are not supported: {_TEXT_ONLY}"
    elif kind == "redacted_thinking":
        why = "redacted_thinking blocks cannot be read by this server; send the reasoning as a thinking block"
    elif kind in ("text", "tool_use", "tool_result", "thinking"):
        why = f"{kind} blocks do not belong in {role} messages"
    else:
        why = f"blocks of type {kind!r} are not supported"
    raise AnthropicError(400, f"{at}: {why}; {role} messages here hold {', '.join(allowed)} blocks",
                         param="messages")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Anthropic's client tools as chat's function tools (None for none)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise AnthropicError(400, f"tools[{i}]: tools of type {kind!r} are not supported; this server calls "
                                 "client tools only: {\"name\", \"description\", \"input_schema\"}", param="tools")
        t = _parse(_Tool, tool, f"tools[{i}]", param="tools")
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def chat_tool_choice(choice: dict[str, Any] | None, tools: list[dict] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls (auto without tools: none)."""
    if choice is None:
        return ("auto" if tools else None), None
    c = _parse(_ToolChoice, choice, "tool_choice", param="tool_choice")
    parallel = None if c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use
    if c.type == "tool":
        if not c.name:
            raise AnthropicError(400, 'tool_choice.name: give the tool to call: {"type": "tool", "name": ...}',
                                 param="tool_choice")
        return {"type": "function", "function": {"name": c.name}}, parallel
    if c.type in ("auto", "none") and not tools:
        return None, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[c.type], parallel


def output_config(req: MessagesRequest) -> dict[str, Any] | None:
    """`output_config`, with the beta's `output_format` read as its `format`."""
    if req.output_format is None:
        return req.output_config
    if (req.output_config or {}).get("format") is not None:
        raise AnthropicError(400, "output_format and output_config.format both give the output's format; give one "
                             "(output_format is the beta's name of output_config.format)", param="output_format")
    return {**(req.output_config or {}), "format": req.output_format}


def response_format(config: dict[str, Any] | None) -> dict | None:
    """`output_config.format` as chat's response_format (None: free text)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise AnthropicError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                             param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(content: str | list[dict[str, Any]], where: str) -> str:
    """A system prompt's text (`system`, a system message's content) without Claude Code's
    billing-header block or line."""
    def strip(text: str) -> str:
        return "".join(line for line in text.splitlines(keepends=True) if not line.startswith(BILLING_HEADER))

    if isinstance(content, str):
        return strip(content)
    kept = []  # (index, block): text blocks without the header's lines, left out where nothing else is left
    for j, b in enumerate(content):
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) \
                and BILLING_HEADER in b["text"]:
            b = {**b, "text": strip(b["text"])}
            if not b["text"].strip():
                continue
        kept.append((j, b))
    return _text([b for _, b in kept], where, [j for j, _ in kept])


def _text(content: str | list[dict[str, Any]], where: str, at: list[int] | None = None) -> str:
    """A string, or text blocks joined by "\n" (`at`: each block's index in what was sent)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in zip(at or range(len(content)), content):
        loc = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            why = f"{kind} blocks are not supported: {_TEXT_ONLY}" if isinstance(kind, str) else "not a text block"
            raise AnthropicError(400, f"{loc}: {why}; give text blocks", param=where.split("[")[0])
        texts.append(_parse(_TextBlock, block, loc).text)
    return "\n".join(texts)


def _parse(model: type[BaseModel], item: Any, where: str, param: str = "messages") -> Any:
    return parse(model, item, where, param, error=AnthropicError)

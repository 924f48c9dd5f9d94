"""The HTTP routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (with
GET / DELETE /v1/responses/{id}: a 404, nothing is stored; POST /v1/responses/input_tokens: a
404, not supported), Anthropic's POST /v1/messages and /v1/messages/count_tokens (the key also
as `x-api-key`; errors in Anthropic's shape), GET /v1/models[/{id}],
vLLM's POST /tokenize and /detokenize (behind the API key when there is one), GET /health,
GET /version, GET /metrics (Prometheus text)."""

from __future__ import annotations

import asyncio
import hmac
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from draftsmith import __version__
from draftsmith.core.structured import StructuredOutputsParams
from draftsmith.errors import DraftsmithError
from draftsmith.server.answer import AnswerFormat
from draftsmith.server.body import parse_body, reject_unsupported, text_bytes
from draftsmith.server.generate import generate
from draftsmith.server.messages_api import MessagesFormat
from draftsmith.server.messages_error import AnthropicError
from draftsmith.server.messages_request import CountTokensRequest, MessagesRequest, count_request
from draftsmith.server.messages_request import chat_request as messages_chat_request
from draftsmith.server.metrics import CONTENT_TYPE
from draftsmith.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeRequest)
from draftsmith.server.responses import ResponseFormat
from draftsmith.server.responses_api import ResponsesFormat
from draftsmith.server.responses_request import NO_STORE, ResponsesRequest, chat_request, responses_error
from draftsmith.server.reasoning import leaves_open, opens_thinking
from draftsmith.server.state import ServerState
from draftsmith.server.structured import asks_structure
from draftsmith.server.tools import check_tools, names_developer, prompt_texts, template_messages, tool_plan


_THINK_TAIL = 8  # prompt tokens read for a <think> the template's generation prompt ends in


def _ids(request: Request, req: ChatCompletionRequest | CompletionRequest, prefix: str) -> tuple[str, str]:
    """The response's id and the engine's: vLLM's `PREFIX-{id}`, the id the client's X-Request-Id
    header or else its body's `request_id` gives (vLLM's _base_request_id), else a random one; the
    engine's is always the server's own, so two requests sent with one id never meet there."""
    own = uuid.uuid4().hex
    return f"{prefix}-{request.headers.get('x-request-id') or req.request_id or own}", f"{prefix}-{own}"


def add_routes(app: FastAPI, st: ServerState) -> None:
    """Register every route of the server over `st` on `app`."""

    async def _auth(request: Request) -> None:
        if st.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), st.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send `Authorization: Bearer KEY` with this "
                           "server's key", code="invalid_api_key")

    auth = [Depends(_auth)]

    async def _anthropic_auth(request: Request) -> None:
        """Anthropic's clients send the key as `x-api-key: KEY`; `Authorization: Bearer KEY` works too."""
        key = request.headers.get("x-api-key")
        if st.api_key is None or (key is not None and hmac.compare_digest(key.strip().encode(), st.api_key.encode())):
            return
        try:
            await _auth(request)
        except APIError:
            raise AnthropicError(401, "missing or incorrect API key: send `x-api-key: KEY` (or `Authorization: "
                                 "Bearer KEY`) with this server's key", code="invalid_api_key") from None

    anthropic_auth = [Depends(_anthropic_auth)]
    # a template that does not name the developer role drops or mislabels its messages: the leading
    # ones go as (one) system message (tools.template_messages)
    developer_role = names_developer(st.options.chat_template or getattr(st.front.tokenizer, "chat_template", None))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await parse_body(request, CompletionRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        reject_unsupported(req)
        raw = req.prompt
        if isinstance(raw, str):
            items: list = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [list(raw)]
        else:
            items = list(raw)
        if not items:
            raise APIError(400, "prompt is empty", param="prompt")
        st.check_size(len(items), req.n, text_bytes(items), "prompt")
        prompts: list[list[int]] = []
        for it in items:
            if isinstance(it, str):
                prompts.append(st.front.encode(it, req.add_special_tokens))
            else:
                bad = [t for t in it if not 0 <= t < st.vocab_size]
                if bad:
                    raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {st.vocab_size})",
                                   param="prompt", code="invalid_value")
                prompts.append(list(it))
        rid, key = _ids(request, req, "cmpl")
        fmt = ResponseFormat(chat=False, rid=rid, key=key, model=st.model_id)
        # 16 when left out; null: the rest of the context (vLLM's get_max_tokens), both within the
        # generation config's max_tokens (sampling.sampling_params)
        max_tokens = req.max_tokens
        if req.echo:  # the prompt, as the client sent it, starts each choice's text (and logprobs)
            texts = [it if isinstance(it, str) else st.front.decode(it) for it in items]
            fmt.with_echo(list(zip(texts, prompts)), echo_only=max_tokens == 0)
            if max_tokens == 0:  # the prompt alone (the engine's one token is dropped)
                max_tokens = 1
        return await generate(st, request, req, prompts, max_tokens, fmt, "prompt")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        reject_unsupported(req)
        rid, key = _ids(request, req, "chatcmpl")
        fmt = ResponseFormat(chat=True, rid=rid, key=key, model=st.model_id)
        return await _chat(request, req, fmt)

    @app.post("/v1/responses", dependencies=auth)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless (server/responses_request.py): the request as a chat
        request, its answer as a Response (server/responses_api.py, responses_stream.py)."""
        req: ResponsesRequest = await parse_body(request, ResponsesRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        chat, echo = chat_request(req)
        fmt = ResponsesFormat(st.model_id, echo)
        try:
            return await _chat(request, chat, fmt)
        except APIError as e:
            raise responses_error(e) from None

    @app.post("/v1/responses/input_tokens", dependencies=auth)
    async def input_tokens() -> Response:
        raise APIError(404, "POST /v1/responses/input_tokens is not supported by this server; count a prompt's "
                       "tokens with POST /tokenize (vLLM's: `messages`, and `tools`, as a chat request sends them)",
                       type="not_found_error", code="unsupported_endpoint")

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], dependencies=auth)
    @app.api_route("/v1/responses/{response_id}/{action:path}", methods=["GET", "POST"], dependencies=auth)
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"no response {response_id!r}: {NO_STORE}", param="response_id", type="not_found_error",
                       code="response_not_found")

    @app.post("/v1/messages", dependencies=anthropic_auth)
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (server/messages_request.py): the request as a chat request,
        its answer as a Message (server/messages_api.py, messages_stream.py)."""
        # (errors on these paths are Anthropic's: server/app.py's handlers, messages_error)
        req: MessagesRequest = await parse_body(request, MessagesRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        chat = messages_chat_request(req, auto_tools=st.options.tool_call_parser is not None)
        try:
            return await _chat(request, chat, MessagesFormat(st.model_id))
        except APIError as e:  # a forced call's grammar: name the tool whose input_schema does not compile
            if e.status == 400 and e.param == "tool_choice" and chat.tools:
                raise await _bad_input_schema(chat) or e from None
            raise

    async def _bad_input_schema(chat: ChatCompletionRequest) -> AnthropicError | None:
        """The first of `chat`'s tools whose schema alone does not compile (the one tool_choice names
        first), as `tools[i].input_schema`'s 400."""
        named = chat.tool_choice.function.name if hasattr(chat.tool_choice, "function") else None
        order = sorted(enumerate(chat.tools), key=lambda it: it[1].function.name != named)
        for i, tool in order:
            schema = tool.function.parameters or {"type": "object"}
            try:
                await asyncio.to_thread(st.front.grammars.check, StructuredOutputsParams(json=schema))
            except (DraftsmithError, TypeError) as e:
                return AnthropicError(400, f"tools[{i}].input_schema: {e}", param="tools")
        return None

    @app.post("/v1/messages/count_tokens", dependencies=anthropic_auth)
    async def count_tokens(request: Request) -> dict:
        """The tokens of the prompt /v1/messages would render (system, messages, tools)."""
        req: CountTokensRequest = await parse_body(request, CountTokensRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        chat = count_request(req)
        check_tools(chat.tools)
        return {"input_tokens": len(_chat_ids(chat))}

    @app.api_route("/v1/messages/{action:path}", methods=["GET", "POST", "DELETE"], dependencies=anthropic_auth)
    async def other_messages(action: str) -> Response:
        raise AnthropicError(404, f"/v1/messages/{action} is not supported by this server (it serves POST "
                             "/v1/messages and /v1/messages/count_tokens; message batches are not kept)")

    async def _chat(request: Request, req: ChatCompletionRequest, fmt: ResponseFormat) -> Response:
        """One chat request, answered in `fmt`'s shape (chat completions, a Response or a Message)."""
        opts = st.options
        plan = tool_plan(req, opts.tool_call_parser)
        if plan is not None and plan.mode == "auto":
            req.skip_special_tokens = False  # a model's <tool_call> tags may be special tokens (as vLLM's hermes)
        ids = _chat_ids(req, req.n)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.echo and req.messages[-1].role == "assistant":  # vLLM's: the answer continues it
            fmt.with_chat_echo(req.messages[-1].text())
        # (a grammar that constrains the reasoning too decides the whole answer: read from its start)
        thinking = opts.reasoning_parser is not None and not (opts.structured_outputs_in_reasoning
                                                              and asks_structure(req)) and (
            leaves_open(req.messages[-1].text()) if req.continue_final_message
            else opens_thinking(st.front.decode(ids[-_THINK_TAIL:], skip_special_tokens=False)))
        fmt.with_answer(AnswerFormat(plan if plan is not None and plan.mode != "none" else None,
                                     reasoning=opts.reasoning_parser is not None, thinking=thinking,
                                     include_reasoning=req.include_reasoning,
                                     grammar_in_reasoning=opts.structured_outputs_in_reasoning))
        return await generate(st, request, req, [ids], max_tokens, fmt, "messages")

    def _chat_ids(req, n: int = 1) -> list[int]:
        """The request's messages through the chat template, with its template options and tools."""
        if getattr(req, "chat_template", None) is not None:
            raise APIError(400, "a request's own chat_template is not accepted: the server's template renders every "
                           "chat (set it with `draftsmith serve --chat-template`); vLLM refuses it too unless "
                           "started with --trust-request-chat-template", param="chat_template")
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        st.check_size(1, n, text_bytes(prompt_texts(req.messages, tools)), "messages")
        kwargs = {**(st.options.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
        try:
            return st.front.apply_chat_template(template_messages(req.messages, developer=developer_role),
                                                add_generation_prompt=req.add_generation_prompt,
                                                continue_final_message=req.continue_final_message,
                                                chat_template_kwargs=kwargs, tools=tools,
                                                chat_template=st.options.chat_template)
        except DraftsmithError as e:
            msg = str(e)
            param = next((f for f in ("continue_final_message", "chat_template_kwargs") if msg.startswith(f)), "messages")
            raise APIError(400, msg, param=param) from None
        except Exception as e:  # template errors (e.g. a role order the template rejects)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> dict:
        req: TokenizeRequest = await parse_body(request, TokenizeRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt (a string) or messages (a chat), not both or neither",
                           param="prompt" if req.prompt is not None else "messages")
        if req.prompt is not None:
            st.check_size(1, 1, text_bytes([req.prompt]), "prompt")
            ids = st.front.encode(req.prompt, req.add_special_tokens)
        else:
            check_tools(req.tools)
            ids = _chat_ids(req)
        strs = st.front.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None  # vLLM's: pieces
        return {"count": len(ids), "max_model_len": st.max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < st.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {st.vocab_size})",
                           param="tokens", code="invalid_value")
        return {"prompt": st.front.tokenizer.decode(req.tokens)}  # special tokens kept, as vLLM's

    def _model_card() -> dict:
        return {"id": st.model_id, "object": "model", "created": st.created, "owned_by": "draftsmith",
                "max_model_len": st.max_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        st.check_model(model_id)
        return _model_card()

    @app.get("/health")
    async def health() -> Response:
        if st.loop.alive:
            return JSONResponse({"status": "ok", "model": st.model_id})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}  # (vLLM's route; Draftsmith's version)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

"""OpenAI-compatible HTTP API over one Engine: `create_app(llm)` and `serve(llm, host, port)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}],
GET /health, GET /metrics (Prometheus text).

Threads: uvicorn's event loop runs the handlers; the engine runs in its own thread
(`EngineLoop`), which owns the Engine. A handler tokenizes with its own copy of the
tokenizer, validates, sends the request's choices to the engine thread as one `add`
command, and reads events from a per-request asyncio queue. A finished response, a client
disconnect or a cancelled handler all end in an `abort` of whatever is still unfinished,
which frees the KV rows on the engine thread at once. A non-streaming request has a watcher
task that checks for a disconnect every `_DISCONNECT_POLL_S`, however busy its queue is.

Admission (`Limits`; `serve --max-choices-per-request / --max-prompt-bytes / --max-queued-tokens`):
prompts x n per request; bytes of prompt text per request (the body may be 6x that + 1 MiB:
a JSON \\u escape is 6 bytes); tokens queued server-wide (prompt + max_tokens of every choice
admitted and unfinished: past it a request gets a 429, or a 400 if it alone is larger).
With an API key, the /v1 routes need `Authorization: Bearer KEY`; /health and /metrics stay open.

Ranges the server enforces beyond SamplingParams: temperature finite in [0, 2] (OpenAI's
range); seed in [0, 2**63 - 1] (a torch generator's int64 range; choice i uses seed + i, so
seed + n - 1 must fit too); top_k -1 or 0 = all tokens, and a top_k at or above the vocabulary
size keeps all tokens too (as vLLM); stop_token_ids inside the vocabulary.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from draftsmith.api import LLM
from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.server.engine_loop import EngineLoop, Event, SubRequest
from draftsmith.server.metrics import CONTENT_TYPE, ServerMetrics
from draftsmith.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, validation_error,
)
from draftsmith.server.text import StreamText

log = logging.getLogger("draftsmith.server")

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed")
_DISCONNECT_POLL_S = 0.25
_MAX_TEMPERATURE = 2.0
_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much work may wait (see the module docstring)."""

    max_choices: int = 256  # prompts x n of one request
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of one request's prompt text
    max_queued_tokens: int | None = None  # None: 32 x max_batch x max_len

    def __post_init__(self) -> None:
        for name in ("max_choices", "max_prompt_bytes", "max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise DraftsmithError(f"{name} must be a positive integer, got {v}")

    @property
    def max_body_bytes(self) -> int:
        return 6 * self.max_prompt_bytes + (1 << 20)


class _Front:
    """The HTTP thread's tokenizer: a private copy (the engine thread decodes with the
    original; fast tokenizers are not safe to share across threads), used through LLM's
    own encode / apply_chat_template so prompts match `LLM.generate` exactly."""

    apply_chat_template = LLM.apply_chat_template
    encode = LLM.encode

    def __init__(self, llm: LLM) -> None:
        self.target = llm.target
        self.tokenizer = copy.deepcopy(llm.tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class ServerState:
    def __init__(self, llm: LLM, model_name: str | None = None, api_key: str | None = None,
                 limits: Limits | None = None) -> None:
        self.llm = llm
        self.model_id = model_name or llm.target.target_id
        self.max_len = llm.engine.max_len
        self.vocab_size = llm.target.model.config.vocab_size
        self.api_key = api_key or None
        self.limits = limits or Limits()
        self.max_queued_tokens = self.limits.max_queued_tokens or 32 * llm.engine.config.max_batch * self.max_len
        self.queued_tokens = 0  # prompt + max_tokens of the choices admitted and unfinished (event loop only)
        self.front = _Front(llm)
        self.metrics = ServerMetrics(self.model_id, llm.engine.config.max_batch)
        self.loop = EngineLoop(llm.engine, self.metrics)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

    def check_size(self, n_prompts: int, n: int, prompt_bytes: int, prompt_param: str) -> None:
        lim = self.limits
        if n_prompts * n > lim.max_choices:
            raise APIError(400, f"this request asks for {n_prompts} prompt(s) x n={n} = {n_prompts * n} choices; "
                           f"this server allows at most {lim.max_choices} per request", param="n",
                           code="too_many_choices")
        if prompt_bytes > lim.max_prompt_bytes:
            raise APIError(400, f"the prompt text is {prompt_bytes} bytes; this server allows at most "
                           f"{lim.max_prompt_bytes} bytes per request", param=prompt_param, code="prompt_too_large")

    def reserve(self, tokens: int, choices: int) -> None:
        """Count `tokens` as queued, or refuse: 400 if the request alone is over the limit, else 429."""
        limit = self.max_queued_tokens
        if tokens > limit:
            raise APIError(400, f"this request may need up to {tokens} tokens (prompt + max_tokens over its "
                           f"{choices} choice(s)), over this server's limit of {limit}; lower max_tokens, n or "
                           "the number of prompts", code="too_many_tokens")
        if self.queued_tokens + tokens > limit:
            raise APIError(429, f"the server is busy: {self.queued_tokens} tokens are queued and this request may "
                           f"need {tokens} more, over the limit of {limit}; retry later",
                           type="rate_limit_exceeded", code="too_many_queued_tokens")
        self.queued_tokens += tokens

    def check_sampling(self, req: Any) -> None:
        """The ranges SamplingParams accepts but the server does not (see the module docstring)."""
        t = req.temperature
        if t is not None and not 0.0 <= t <= _MAX_TEMPERATURE:  # NaN and infinity fail too
            raise APIError(400, f"temperature must be a number in [0, {_MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}",
                           param="temperature", code="invalid_value")
        if req.seed is not None and not 0 <= req.seed <= _MAX_SEED - (req.n - 1):
            msg = "seed must be an integer in [0, 2**63 - 1]"
            if req.n > 1:
                msg += f"; choice i uses seed + i, so with n={req.n} it must be at most {_MAX_SEED - req.n + 1}"
            raise APIError(400, f"{msg}, got {req.seed}", param="seed", code="invalid_value")
        if req.top_k is not None and req.top_k < -1:
            raise APIError(400, f"top_k must be -1 or 0 (all tokens) or a positive integer, got {req.top_k}",
                           param="top_k", code="invalid_value")
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param="stop_token_ids", code="invalid_value")

    def sampling(self, req: Any, max_tokens: int | None, prompt_len: int, index: int, prompt_param: str) -> SamplingParams:
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty: give at least one token", param=prompt_param)
        if prompt_len >= self.max_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_len} tokens, but the prompt has "
                f"{prompt_len} tokens, which leaves no room to generate. Shorten the prompt.",
                param=prompt_param, code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = self.max_len - prompt_len
        if max_tokens <= 0:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens",
                           code="invalid_value")
        if prompt_len + max_tokens > self.max_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                "completion). Reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )
        stop = req.stop if req.stop is not None else ()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else float(req.temperature),
                top_p=1.0 if req.top_p is None else float(req.top_p),
                top_k=req.top_k if req.top_k and 0 < req.top_k < self.vocab_size else 0,  # else all tokens
                min_p=0.0 if req.min_p is None else float(req.min_p),
                seed=None if req.seed is None else req.seed + index,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
            )
        except DraftsmithError as e:
            msg = str(e)
            param = next((f for f in _SAMPLING_FIELDS if msg.startswith(f)), None)
            raise APIError(400, msg, param=param, code="invalid_value") from None


# ---- helpers --------------------------------------------------------------------------


async def _read_body(request: Request, limit: int) -> bytes:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        got = f"Content-Type {ctype!r}" if ctype else "no Content-Type"
        raise APIError(415, f"send the request body as JSON with `Content-Type: application/json` (got {got})",
                       code="unsupported_media_type")
    body = bytearray()
    async for chunk in request.stream():  # ClientDisconnect if the client leaves mid-body
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                           code="request_too_large")
    return bytes(body)


async def _parse(request: Request, model: type[BaseModel], max_bytes: int) -> Any:
    raw = await _read_body(request, max_bytes)
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode()  # lone surrogates ("\ud800") cannot be encoded
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the request body has a lone UTF-16 surrogate (such as \\ud800) in a string; "
                       "strings must be valid Unicode", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _reject_unsupported(req: Any) -> None:
    bad = req.unsupported()
    if bad:
        raise APIError(400, f"{bad[0]} is not supported by this server", param=bad[0], code="unsupported_parameter")


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Put a `disconnected` event on `q` once the client has gone, checking on a timer: a busy
    queue (a fan-out finishing choice after choice) must not hide the disconnect."""
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    q.put_nowait(Event("disconnected"))


def _text_bytes(texts: list) -> int:
    return sum(len(t.encode()) for t in texts if isinstance(t, str))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _AbortingStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Format:
    """What differs between the completions and chat APIs: the shape of the objects."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat, self.rid, self.model = chat, rid, model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def opening(self, index: int) -> dict | None:
        if not self.chat:
            return None
        return {**self._head("chat.completion.chunk"), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

    def response(self, finals: list[Event], usage: dict) -> dict:
        if self.chat:
            choices = [{"index": e.index, "message": {"role": "assistant", "content": e.text},
                        "logprobs": None, "finish_reason": e.finish_reason} for e in finals]
            return {**self._head("chat.completion"), "choices": choices, "usage": usage}
        choices = [{"index": e.index, "text": e.text, "logprobs": None, "finish_reason": e.finish_reason}
                   for e in finals]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}


def _usage(prompt_tokens: int, finals: list[Event]) -> dict:
    completion = sum(len(e.token_ids) for e in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


# ---- the app --------------------------------------------------------------------------


def create_app(llm: LLM, model_name: str | None = None, *, api_key: str | None = None,
               limits: Limits | None = None) -> FastAPI:
    """The app over `llm`. `api_key`: required as `Authorization: Bearer KEY` on /v1 routes."""
    st = ServerState(llm, model_name, api_key, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st.loop.start()
        try:
            yield
        finally:
            st.loop.stop()

    app = FastAPI(title="Draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = st

    def _error(e: APIError) -> JSONResponse:
        st.metrics.record_error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(APIError(400, str(e.errors()[:1])))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(APIError(e.status_code, str(e.detail), type=typ))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left mid-body: nobody to answer, nothing to log

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(APIError(500, f"internal server error: {type(e).__name__}", type="internal_error"))

    async def _auth(request: Request) -> None:
        if st.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), st.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send `Authorization: Bearer KEY` with this "
                           "server's key", code="invalid_api_key")

    auth = [Depends(_auth)]

    async def generate(request: Request, req: Any, prompts: list[list[int]], max_tokens: int | None,
                       fmt: _Format, prompt_param: str) -> Response:
        if not st.loop.alive:
            raise APIError(503, "the engine is not running", type="service_unavailable")
        n = req.n
        st.check_sampling(req)
        subs: list[SubRequest] = []
        aloop = asyncio.get_running_loop()
        q: asyncio.Queue[Event] = asyncio.Queue()

        def sink(ev: Event) -> None:
            try:
                aloop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:  # event loop closed: the server is gone
                pass

        now = time.perf_counter()
        for p, ids in enumerate(prompts):
            for i in range(n):
                params = st.sampling(req, max_tokens, len(ids), i, prompt_param)
                index = p * n + i
                subs.append(SubRequest(request_id=f"{fmt.rid}-{index}", index=index, prompt_ids=ids,
                                       params=params, stream=req.stream, sink=sink, t_arrival=now))
        prompt_tokens = sum(len(ids) for ids in prompts)
        reserved = sum(len(s.prompt_ids) + s.params.max_tokens for s in subs)
        st.reserve(reserved, len(subs))
        done: set[int] = set()

        def close() -> None:
            """Abort what is unfinished and give the reserved tokens back (idempotent)."""
            nonlocal reserved
            left = [s.request_id for s in subs if s.index not in done]
            if left:
                st.loop.abort(left)
                done.update(s.index for s in subs)
            st.queued_tokens -= reserved
            reserved = 0

        st.loop.add(subs)
        try:
            ack = await q.get()
        except BaseException:
            close()
            raise
        if ack.kind == "error":
            close()
            raise APIError(400, ack.message, param=prompt_param)

        if not req.stream:
            finals: dict[int, Event] = {}
            watcher = asyncio.create_task(_watch_disconnect(request, q))
            try:
                while len(finals) < len(subs):
                    ev = await q.get()
                    if ev.kind == "disconnected":
                        return Response(status_code=499)
                    if ev.kind == "error":
                        raise APIError(500, ev.message, type="internal_error")
                    if ev.kind == "finished":
                        finals[ev.index] = ev
                        done.add(ev.index)
            finally:
                watcher.cancel()
                close()
            ordered = [finals[i] for i in sorted(finals)]
            return JSONResponse(fmt.response(ordered, _usage(prompt_tokens, ordered)))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stops = {s.index: s.params.stop for s in subs}

        async def events() -> AsyncIterator[str]:
            texts = {s.index: StreamText(st.front.decode, stops[s.index]) for s in subs}
            finals: list[Event] = []
            try:
                for s in subs:
                    opening = fmt.opening(s.index)
                    if opening:
                        yield _sse(opening)
                while len(finals) < len(subs):
                    ev = await q.get()
                    if ev.kind == "tokens":
                        delta = texts[ev.index].push(ev.token_ids)
                        if delta:
                            yield _sse(fmt.chunk(ev.index, delta, None))
                    elif ev.kind == "finished":
                        done.add(ev.index)
                        finals.append(ev)
                        yield _sse(fmt.chunk(ev.index, texts[ev.index].finish(ev.text), ev.finish_reason))
                    elif ev.kind == "error":
                        st.metrics.record_error(500)
                        yield _sse(APIError(500, ev.message, type="internal_error").body())
                        return
                if include_usage:
                    yield _sse(fmt.usage_chunk(_usage(prompt_tokens, finals)))
                yield "data: [DONE]\n\n"
            finally:
                close()

        return _AbortingStream(events(), on_close=close)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        _reject_unsupported(req)
        raw = req.prompt
        if isinstance(raw, str):
            items: list = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            items = [list(raw)]
        else:
            items = list(raw)
        if not items:
            raise APIError(400, "prompt is empty", param="prompt")
        st.check_size(len(items), req.n, _text_bytes(items), "prompt")
        prompts: list[list[int]] = []
        for it in items:
            if isinstance(it, str):
                prompts.append(st.front.encode(it))
            else:
                bad = [t for t in it if not 0 <= t < st.vocab_size]
                if bad:
                    raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {st.vocab_size})",
                                   param="prompt", code="invalid_value")
                prompts.append(list(it))
        fmt = _Format(chat=False, rid=f"cmpl-{uuid.uuid4().hex}", model=st.model_id)
        return await generate(request, req, prompts, req.max_tokens if req.max_tokens is not None else 16,
                              fmt, "prompt")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest, st.limits.max_body_bytes)
        st.check_model(req.model)
        _reject_unsupported(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        st.check_size(1, req.n, _text_bytes([m["content"] for m in messages]), "messages")
        try:
            ids = st.front.apply_chat_template(messages)
        except DraftsmithError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # template errors (e.g. a role order the template rejects)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        fmt = _Format(chat=True, rid=f"chatcmpl-{uuid.uuid4().hex}", model=st.model_id)
        return await generate(request, req, [ids], max_tokens, fmt, "messages")

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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          model_name: str | None = None, api_key: str | None = None, limits: Limits | None = None) -> None:
    """Serve `llm` until interrupted (blocking)."""
    import uvicorn

    uvicorn.run(create_app(llm, model_name, api_key=api_key, limits=limits), host=host, port=port,
                log_level=log_level, timeout_graceful_shutdown=5)

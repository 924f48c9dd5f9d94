"""OpenAI-compatible HTTP API over one Engine: `create_app(llm)` and `serve(llm, host, port)`.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}],
GET /health, GET /metrics (Prometheus text).

Threads: uvicorn's event loop runs the handlers; the engine runs in its own thread
(`EngineLoop`), which owns the Engine. A handler tokenizes with its own copy of the
tokenizer, validates, sends the request's choices to the engine thread as one `add`
command, and reads events from a per-request asyncio queue. A finished response, a client
disconnect or a cancelled handler all end in an `abort` of whatever is still unfinished,
which frees the KV rows on the engine thread at once.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
_DISCONNECT_POLL_S = 0.5


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
    def __init__(self, llm: LLM, model_name: str | None = None) -> None:
        self.llm = llm
        self.model_id = model_name or llm.target.target_id
        self.max_len = llm.engine.max_len
        self.vocab_size = llm.target.model.config.vocab_size
        self.front = _Front(llm)
        self.metrics = ServerMetrics(self.model_id, llm.engine.config.max_batch)
        self.loop = EngineLoop(llm.engine, self.metrics)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_id}`.",
                           param="model", code="model_not_found")

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
                top_k=req.top_k or 0,
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


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
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


def create_app(llm: LLM, model_name: str | None = None) -> FastAPI:
    st = ServerState(llm, model_name)

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

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(APIError(500, f"internal server error: {type(e).__name__}", type="internal_error"))

    async def generate(request: Request, req: Any, prompts: list[list[int]], max_tokens: int | None,
                       fmt: _Format, prompt_param: str) -> Response:
        if not st.loop.alive:
            raise APIError(503, "the engine is not running", type="service_unavailable")
        n = req.n
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
        done: set[int] = set()

        def abort_unfinished() -> None:
            left = [s.request_id for s in subs if s.index not in done]
            if left:
                st.loop.abort(left)
                done.update(s.index for s in subs)

        st.loop.add(subs)
        try:
            ack = await q.get()
        except BaseException:
            abort_unfinished()
            raise
        if ack.kind == "error":
            raise APIError(400, ack.message, param=prompt_param)

        if not req.stream:
            finals: dict[int, Event] = {}
            try:
                while len(finals) < len(subs):
                    try:
                        ev = await asyncio.wait_for(q.get(), timeout=_DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            abort_unfinished()
                            return Response(status_code=499)
                        continue
                    if ev.kind == "error":
                        raise APIError(500, ev.message, type="internal_error")
                    if ev.kind == "finished":
                        finals[ev.index] = ev
                        done.add(ev.index)
            finally:
                abort_unfinished()
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
                abort_unfinished()

        return _AbortingStream(events(), on_close=abort_unfinished)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await _parse(request, CompletionRequest)
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        st.check_model(req.model)
        _reject_unsupported(req)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
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

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
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
          model_name: str | None = None) -> None:
    """Serve `llm` until interrupted (blocking)."""
    import uvicorn

    uvicorn.run(create_app(llm, model_name), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)

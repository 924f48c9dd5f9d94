"""OpenAI-compatible HTTP API over one Engine: `create_app(llm)` and `serve(llm, host, port)`.

Endpoints (server/routes.py): POST /v1/completions, POST /v1/chat/completions, POST /v1/responses
(OpenAI's Responses API, stateless: a chat request inside, its answer as a Response; nothing is
stored, so GET / DELETE /v1/responses/{id} are 404s), POST /v1/messages and
/v1/messages/count_tokens (Anthropic's Messages API: a chat request inside, its answer as a
Message, errors in Anthropic's shape), GET /v1/models[/{id}], POST /tokenize,
POST /detokenize, GET /health, GET /version, GET /metrics (Prometheus text). With an API key,
the /v1 routes and /tokenize, /detokenize need `Authorization: Bearer KEY` (the Messages routes
take `x-api-key: KEY` too); /health, /version and /metrics stay open.

Roles: state (ServerState, Limits: admission), body (reading and validating a request body),
sampling (SamplingParams per choice, the ranges the server enforces), structured (a request's
grammar from response_format / structured_outputs / guided_* / a forced tool call), tools (what
tools and tool_choice ask), tool_calls (an answer's text -> content and tool calls), reasoning
(<think> ... </think> -> reasoning), answer (the two together: a chat answer's message), answer_parts
(an answer's pieces in the order it writes them), generate (one request on
the engine thread, whole or streamed), streaming (server-sent events), responses (the
completions / chat objects), responses_request / responses_api / responses_output / responses_stream
(the Responses API: its request as a chat request, the answer as a Response, its output items,
its stream's events), messages_request / messages_api / messages_content / messages_stream /
messages_error (Anthropic's Messages API: its request as a chat request, the answer as a Message,
its content blocks, its stream's events, its errors), request_fields (what the Responses and
Messages requests share: vLLM's extras, field errors), partial_json (a cut call's arguments, read
as the anthropic package reads them), routes (the handlers), engine_loop,
protocol, text, metrics.
This module builds the app: lifespan (the engine thread), error handlers, routes.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from draftsmith.api import LLM
from draftsmith.server.messages_error import messages_error
from draftsmith.server.protocol import APIError
from draftsmith.server.routes import add_routes
from draftsmith.server.state import Limits, ServeOptions, ServerState

__all__ = ["Limits", "ServeOptions", "create_app", "serve"]

log = logging.getLogger("draftsmith.server")


class _RequestIdHeader:
    """vLLM's XRequestIdMiddleware (serve --enable-request-id-headers): each HTTP response carries
    `X-Request-Id`, the request's own header or else a fresh uuid4 hex."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", rid)
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(llm: LLM, model_name: str | None = None, *, api_key: str | None = None,
               limits: Limits | None = None, options: ServeOptions | None = None) -> FastAPI:
    """The app over `llm`. `api_key`: required as `Authorization: Bearer KEY` on /v1 routes;
    `limits`: admission; `options`: how chat requests are read and work is ordered (ServeOptions)."""
    st = ServerState(llm, model_name, api_key, limits, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st.loop.start()
        try:
            yield
        finally:
            st.loop.stop()

    app = FastAPI(title="Draftsmith", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = st

    def _error(request: Request, e: APIError) -> JSONResponse:
        """`e` as JSON: in Anthropic's shape on the Messages API's paths (every error there), else OpenAI's."""
        path = request.url.path.removeprefix(request.scope.get("root_path", "") or "")  # (behind a --root-path)
        if path == "/v1/messages" or path.startswith("/v1/messages/"):
            e = messages_error(e)
        st.metrics.record_error(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(request, APIError(400, str(e.errors()[:1])))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(request, APIError(e.status_code, str(e.detail), type=typ))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, e: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left mid-body: nobody to answer, nothing to log

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(request, APIError(500, f"internal server error: {type(e).__name__}", type="internal_error"))

    add_routes(app, st)
    if st.options.request_id_headers:
        app.add_middleware(_RequestIdHeader)
    return app


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          model_name: str | None = None, api_key: str | None = None, limits: Limits | None = None,
          options: ServeOptions | None = None) -> None:
    """Serve `llm` until interrupted (blocking)."""
    app = create_app(llm, model_name, api_key=api_key, limits=limits, options=options)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

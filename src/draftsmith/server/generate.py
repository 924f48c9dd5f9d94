"""One generation request, from parsed prompts to the HTTP response.

Threads: uvicorn's event loop runs the handlers; the engine runs in its own thread
(`EngineLoop`), which owns the Engine. A handler tokenizes with its own copy of the
tokenizer, validates, sends the request's choices to the engine thread as one `add`
command, and reads events from a per-request asyncio queue. A finished response, a client
disconnect or a cancelled handler all end in an `abort` of whatever is still unfinished,
which frees the KV rows on the engine thread at once. A non-streaming request has a watcher
task that checks for a disconnect every `_DISCONNECT_POLL_S`, however busy its queue is.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from draftsmith.server.engine_loop import Event, SubRequest
from draftsmith.server.protocol import APIError
from draftsmith.server.responses import ResponseFormat, usage
from draftsmith.server.sampling import check_sampling, sampling_params
from draftsmith.server.state import ServerState
from draftsmith.server.streaming import AbortingStream, stream_events
from draftsmith.server.structured import asks_structure, structured_outputs

_DISCONNECT_POLL_S = 0.25


async def _watch_disconnect(request: Request, q: asyncio.Queue) -> None:
    """Put a `disconnected` event on `q` once the client has gone, checking on a timer: a busy
    queue (a fan-out finishing choice after choice) must not hide the disconnect."""
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    q.put_nowait(Event("disconnected"))


async def generate(st: ServerState, request: Request, req: Any, prompts: list[list[int]], max_tokens: int | None,
                   fmt: ResponseFormat, prompt_param: str) -> Response:
    """Admit `req`'s choices (n per prompt), run them on the engine thread, answer whole or streamed."""
    if not st.loop.alive:
        raise APIError(503, "the engine is not running", type="service_unavailable")
    n = req.n
    req.prompt_logprobs_k()  # (its range first)
    if req.prompt_logprobs and req.stream:  # (0 is allowed, as vLLM's: nothing to send)
        raise APIError(400, "prompt_logprobs are not available when streaming (stream: true); ask for them in a "
                       "whole response", param="prompt_logprobs", code="invalid_value")
    if req.priority and st.options.scheduling_policy != "priority":
        raise APIError(400, "priority needs a server started with `draftsmith serve --scheduling-policy priority` "
                       "(this one admits requests first come, first served)", param="priority", code="invalid_value")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                       code="invalid_value")
    check_sampling(req, st.vocab_size)
    k = req.truncate_prompt_tokens
    if k is not None:  # vLLM's: the prompt's last k tokens (usage counts those)
        if k == -1:  # vLLM's (HEAD): as many as the context holds beside max_tokens
            k = max(1, st.max_len - (max_tokens or 0))
        if k < 1:
            raise APIError(400, f"truncate_prompt_tokens must be a positive integer, or -1 (as many of the "
                           f"prompt's last tokens as the context holds beside max_tokens), got {k}",
                           param="truncate_prompt_tokens", code="invalid_value")
        if getattr(req, "echo", False):
            raise APIError(400, "truncate_prompt_tokens cannot be combined with echo (which returns the whole prompt)",
                           param="truncate_prompt_tokens", code="invalid_value")
        prompts = [ids[-k:] for ids in prompts]
    # (a grammar compiles in a worker thread: a large schema may take a second; the event loop serves on)
    structured = await asyncio.to_thread(structured_outputs, req, st.front.grammars.check,
                                         fmt.answer.grammar_reasoning()) if asks_structure(req) else None
    fmt.with_logprobs(req.top_logprobs_k(), st.front.token_text, as_ids=st.options.return_tokens_as_token_ids
                     if req.return_tokens_as_token_ids is None else bool(req.return_tokens_as_token_ids))
    fmt.with_decode(partial(st.front.decode, skip_special_tokens=req.skip_special_tokens))
    fmt.with_prompts(prompts, n)
    shown = req.shown_prompt_logprobs()
    if shown is not None:
        fmt.with_prompt_logprobs(shown, st.front.token_text)
    if req.return_token_ids:
        fmt.with_token_ids()
    if st.request_metrics.enabled:
        fmt.with_request_metrics()
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
            params = sampling_params(req, max_tokens, len(ids), i, prompt_param, max_len=st.max_len,
                                     vocab_size=st.vocab_size, structured=structured, defaults=st.llm.default_sampling)
            index = p * n + i
            subs.append(SubRequest(request_id=f"{fmt.key}-{index}", index=index, prompt_ids=ids,
                                   params=params, stream=req.stream, sink=sink, t_arrival=now,
                                   cache_salt=req.cache_salt, priority=req.priority))
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
                    raise (APIError(400, ev.message) if ev.status == 400
                           else APIError(500, ev.message, type="internal_error"))
                if ev.kind == "finished":
                    finals[ev.index] = ev
                    done.add(ev.index)
        finally:
            watcher.cancel()
            close()
        ordered = [fmt.visible(finals[i]) for i in sorted(finals)]
        return JSONResponse(fmt.response(ordered, usage(prompt_tokens, ordered, n)))

    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage) or st.options.force_include_usage
    events = stream_events(st, subs, q, fmt, prompt_tokens, n, include_usage, done, close,
                           continuous_usage=bool(include_usage and opts and opts.continuous_usage_stats))
    return AbortingStream(fmt.events(events), on_close=close)

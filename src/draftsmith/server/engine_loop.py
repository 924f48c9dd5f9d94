"""The engine thread: the only thread that touches the Engine.

HTTP handlers (asyncio thread) send commands through a thread-safe queue: `add` (a group
of sub-requests, the n choices / prompts of one HTTP request, added atomically) and
`abort`. The engine thread drains the queue, runs one `engine.step()` while anything is
unfinished, and reports back through each sub-request's `sink`, a callable that hands the
event to the request's asyncio queue with `loop.call_soon_threadsafe`. With nothing to do
it sleeps on a condition variable; a command wakes it.

Events to a sink, in order: one `added` (or one `error`) for the whole group, then per
sub-request zero or more `tokens` (streaming sub-requests only) and exactly one `finished`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.engine import Engine
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.server.metrics import ServerMetrics
from draftsmith.server.request_metrics import RequestMetricsOptions, request_metrics

log = logging.getLogger("draftsmith.server")


@dataclass
class Event:
    kind: str  # "added" | "tokens" | "finished" | "error" (the app adds "disconnected")
    index: int = -1  # choice index (for tokens / finished)
    token_ids: list[int] = field(default_factory=list)  # new ids (tokens); all output ids (finished)
    text: str = ""  # final visible text (finished)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop_token_id or stop string that ended it (finished)
    message: str = ""  # error
    cached_tokens: int = 0  # prompt tokens whose KV was reused (finished, the first tokens event; prefix caching)
    logprobs: list | None = None  # per token of token_ids, when the request asked (core/logprobs.py)
    prompt_logprobs: list | None = None  # per prompt token (finished; the first tokens event)
    metrics: dict | None = None  # the request's metrics object (finished; serve --enable-per-request-metrics ...)
    status: int = 500  # error: the HTTP status it answers (400: the request's own grammar failed)


@dataclass
class SubRequest:
    request_id: str
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    sink: Callable[[Event], None]
    t_arrival: float = field(default_factory=time.perf_counter)
    cache_salt: str | None = None  # vLLM's: prefix-cached KV shared only with the same salt
    priority: int = 0  # vLLM's: lower is admitted first (serve --scheduling-policy priority)


@dataclass
class _Live:
    sub: SubRequest
    seq: Request
    sent: int = 0  # output tokens already reported
    t_last: float | None = None
    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    committed: int = 0
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    forced_proposed: int = 0
    forced_accepted: int = 0
    scheduled: bool = False  # its scheduling is in the metrics


def _copy(logprobs: list | None) -> list | None:
    return None if logprobs is None else list(logprobs)


def _diff(new: list[int], old: list[int]) -> list[int]:
    return [v - (old[k] if k < len(old) else 0) for k, v in enumerate(new)]


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics,
                 request_metrics: RequestMetricsOptions | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_metrics = request_metrics or RequestMetricsOptions()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._stopping = False
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)

    # ---- called from other threads ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def add(self, subs: list[SubRequest]) -> None:
        self._put(("add", subs))

    def abort(self, request_ids: list[str]) -> None:
        self._put(("abort", list(request_ids)))

    def _put(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        with self._cond:
            self._cond.notify()

    # ---- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._stopping and self._commands.empty() and not eng.has_unfinished():
                    self._publish_load()
                    self._cond.wait()
                if self._stopping:
                    break
            try:
                self._iteration()
            except Exception:  # a bug, not a user error: fail what is in flight, keep serving
                log.exception("engine step failed; aborting %d request(s)", len(self._live))
                self._fail_all("internal error in the engine; the request was aborted")
            self._publish_load()
        self._fail_all("the server is shutting down")

    def _iteration(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._add(cmd[1])
            else:
                self._abort(cmd[1])
        if self.engine.has_unfinished():
            self._after_step(self.engine.step())

    def _publish_load(self) -> None:
        eng = self.engine
        self.metrics.set_load(
            waiting=len(eng.waiting), running=len(eng.running),
            rows_in_use=eng.config.max_batch - len(eng.free_rows),
        )

    def _add(self, subs: list[SubRequest]) -> None:
        added: list[SubRequest] = []
        try:
            for sub in subs:
                seq = self.engine.add_request(sub.prompt_ids, sub.params, sub.request_id, cache_salt=sub.cache_salt,
                                              priority=sub.priority)
                if self.request_metrics.keeps_steps:
                    seq.stats.step_counts = {}
                    if self.request_metrics.spec_decode == "detailed":
                        seq.stats.step_log = []
                self._live[sub.request_id] = _Live(sub=sub, seq=seq)
                added.append(sub)
        except Exception as e:  # DraftsmithError = bad input; anything else is reported too
            for sub in added:
                self.engine.abort(sub.request_id)
                self._live.pop(sub.request_id, None)
            msg = str(e) if isinstance(e, DraftsmithError) else f"could not add the request: {e}"
            if not isinstance(e, DraftsmithError):
                log.exception("add_request failed")
            subs[0].sink(Event("error", message=msg))
            return
        for sub in subs:
            self.metrics.record_admitted(len(sub.prompt_ids))
        subs[0].sink(Event("added"))

    def _abort(self, request_ids: list[str]) -> None:
        now = time.perf_counter()
        for rid in request_ids:
            live = self._live.pop(rid, None)
            if live is None:
                continue  # finished already
            self.engine.abort(rid)
            self._account(live, now)
            self.metrics.record_finished("abort", now - live.sub.t_arrival, live.seq.stats.cached_tokens)
            live.sub.sink(Event("finished", index=live.sub.index, token_ids=list(live.seq.output_ids),
                                text=live.seq.text, finish_reason="abort",
                                cached_tokens=live.seq.stats.cached_tokens, logprobs=_copy(live.seq.logprobs),
                                prompt_logprobs=_copy(live.seq.prompt_logprobs), metrics=self._metrics_of(live.seq)))

    def _account(self, live: _Live, now: float) -> int:
        """Report new tokens and speculative-stat deltas of one request; returns #new tokens."""
        seq, st = live.seq, live.seq.stats
        if st.rounds != live.rounds:
            self.metrics.record_round_deltas(
                proposed=st.proposed - live.proposed, accepted=st.accepted - live.accepted,
                rounds=st.rounds - live.rounds, committed=st.committed - live.committed,
                pos_proposed=_diff(st.proposed_at, live.proposed_at),
                pos_accepted=_diff(st.accepted_at, live.accepted_at),
                forced_proposed=st.forced_proposed - live.forced_proposed,
                forced_accepted=st.forced_accepted - live.forced_accepted,
            )
            live.proposed, live.accepted = st.proposed, st.accepted
            live.forced_proposed, live.forced_accepted = st.forced_proposed, st.forced_accepted
            live.rounds, live.committed = st.rounds, st.committed
            live.proposed_at, live.accepted_at = list(st.proposed_at), list(st.accepted_at)
        n = len(seq.output_ids) - live.sent
        if n > 0:
            if live.t_last is None:
                self.metrics.record_tokens(ttft=now - live.sub.t_arrival, itl=None, n=n)
                # tokens beyond the first in the first delivery share no gap: none observed
            else:
                self.metrics.record_tokens(ttft=None, itl=now - live.t_last, n=n)
            live.t_last = now
        return max(n, 0)

    def _after_step(self, finished: list[Request]) -> None:
        now = time.perf_counter()
        verify_tokens = 0
        done: list[str] = []
        for rid, live in self._live.items():
            seq = live.seq
            if not live.scheduled and seq.stats.t_scheduled is not None:  # given its row in this step
                live.scheduled = True
                self.metrics.record_scheduled(len(seq.prompt_ids), self.engine.prefix_caching
                                              and seq.prompt_logprobs is None, seq.stats.cached_tokens)
            before_rounds, before_proposed, before_forced = live.rounds, live.proposed, live.forced_proposed
            n = self._account(live, now)
            if live.rounds > before_rounds:
                verify_tokens += ((live.rounds - before_rounds) + (live.proposed - before_proposed)
                                  + (live.forced_proposed - before_forced))
            if seq.finished and seq.finish_reason == "error":  # its own grammar failed: this request alone
                done.append(rid)
                self.metrics.record_finished("error", now - live.sub.t_arrival, seq.stats.cached_tokens)
                live.sub.sink(Event("error", index=live.sub.index, message=seq.error or "the request failed",
                                    status=400))
            elif seq.finished:
                done.append(rid)
                self.metrics.record_finished(seq.finish_reason or "stop", now - live.sub.t_arrival,
                                             seq.stats.cached_tokens)
                live.sub.sink(Event("finished", index=live.sub.index, token_ids=list(seq.output_ids),
                                    text=seq.text, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                    cached_tokens=seq.stats.cached_tokens, logprobs=_copy(seq.logprobs),
                                    prompt_logprobs=_copy(seq.prompt_logprobs), metrics=self._metrics_of(seq)))
            elif n > 0 and live.sub.stream:
                first = live.sent == 0
                live.sub.sink(Event("tokens", index=live.sub.index, token_ids=list(seq.output_ids[live.sent :]),
                                    logprobs=None if seq.logprobs is None else seq.logprobs[live.sent :],
                                    prompt_logprobs=_copy(seq.prompt_logprobs) if first else None,
                                    cached_tokens=seq.stats.cached_tokens if first else 0))
            live.sent = len(seq.output_ids)
        for rid in done:
            del self._live[rid]
        if verify_tokens:
            self.metrics.record_step(verify_tokens)

    def _metrics_of(self, seq: Request) -> dict | None:
        """A finished request's metrics object (server/request_metrics.py); None where not asked."""
        if not self.request_metrics.enabled:
            return None
        return request_metrics(self.request_metrics, seq.stats, len(seq.output_ids))

    def _fail_all(self, message: str) -> None:
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            live.sub.sink(Event("error", index=live.sub.index, message=message))
        self._live.clear()

"""The load generator: closed-loop users or Poisson arrivals, against the in-process engine
or any OpenAI-compatible streaming server.

    run_engine(engine, requests, concurrency, offsets=None)              -> RunResult
    run_endpoint(url, model, requests, concurrency, offsets=None, ...)   -> RunResult

`offsets` None = closed loop: `concurrency` users, each sends its next request the moment the
previous one finishes. Otherwise offsets[i] is request i's arrival time (s after start); at
most `concurrency` run at once and the rest queue (queueing counts in TTFT and end-to-end).

In-process, the engine is stepped on this thread; a token is "delivered" when the step that
committed it returns (that is when a server could send it). Over HTTP, a token is delivered
when its streamed chunk arrives.

A request with `followups` is a conversation: when a turn's answer ends (without error), its next
turn is sent at once by the same user (it keeps its concurrency slot), the answer and the next user
message appended to the messages (`next_turn`). Every turn is a record of its own (`turn` 0, 1, …).
In-process, a run starts with nothing in the prefix cache (`KVCache.forget`), so a configuration
reuses only what its own requests left (its conversations' earlier turns, a prompt the list
repeats), never another configuration's prefill.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import httpx

from draftsmith.bench.metrics import RequestRecord, RunResult, sha_of_ids, sha_of_text
from draftsmith.core.request import Status
from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_id: str
    messages: tuple[dict, ...]
    token_ids: tuple[int, ...] | None
    params: SamplingParams
    followups: tuple[str, ...] = ()  # the conversation's next user turns
    turn: int = 0


def next_turn(req: BenchRequest, answer: str,
              tokenize: Callable[[list[dict]], list[int]] | None = None) -> BenchRequest:
    """The conversation's next turn: the answer and the next user message appended."""
    msgs = (*req.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": req.followups[0]})
    ids = None if tokenize is None else tuple(tokenize(list(msgs)))
    return replace(req, messages=msgs, token_ids=ids, followups=req.followups[1:], turn=req.turn + 1)


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of n requests at `rate` per second; the first arrives at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _noop(_: RequestRecord) -> None:
    pass


# ---- in-process ---------------------------------------------------------------------------


def run_engine(engine, requests: Sequence[BenchRequest], concurrency: int, offsets: Sequence[float] | None = None,
               on_done: Callable[[RequestRecord], None] = _noop,
               tokenize: Callable[[list[dict]], list[int]] | None = None) -> RunResult:
    """Drive `engine` (built with max_batch >= concurrency) until every request finished.
    `tokenize` (chat messages -> prompt ids) builds the later turns of conversations."""
    if engine.has_unfinished():
        raise DraftsmithError("the engine has unfinished requests; a bench run needs it idle")
    if any(r.followups for r in requests) and tokenize is None:
        raise DraftsmithError("requests with later turns need `tokenize` to build their prompts")
    engine.cache.forget()
    pending = deque(range(len(requests)))
    live: dict[int, tuple] = {}  # id(seq) -> (seq, request, t_arrival, state)
    records: list[list[RequestRecord]] = [[] for _ in requests]  # per request: one record per turn
    steps = forwards = 0
    # the decode phase: every step's time but the engine's own admission (prefill) time, and the
    # tokens its rounds delivered (all of them: prefill stops before a prompt's last token)
    step_s, decode_tokens = 0.0, 0
    prefill0 = engine.prefill_s
    t0 = time.perf_counter()
    t_last = t0

    def submit(i: int, t_arr: float, req: BenchRequest | None = None) -> None:
        req = req or requests[i]
        seq = engine.add_request(list(req.token_ids), req.params, request_id=f"bench-{req.index}-{req.turn}")
        live[id(seq)] = (seq, req, i, t_arr, {"seen": 0, "last": None, "first": None, "deliveries": []})

    arrived: deque[int] = deque()  # Poisson: arrived, waiting for one of the `concurrency` slots
    while pending or live or arrived:
        now = time.perf_counter()
        if offsets is None:
            while pending and len(live) < concurrency:
                submit(pending.popleft(), now)
        else:
            while pending and offsets[pending[0]] <= now - t0:
                arrived.append(pending.popleft())
            # the queue is here, not in the engine: a conversation's next turn keeps the slot
            # its previous turn had, ahead of requests that arrived meanwhile
            while arrived and len(live) < concurrency:
                i = arrived.popleft()
                submit(i, t0 + offsets[i])
            if not live:
                time.sleep(max(0.0, t0 + offsets[pending[0]] - time.perf_counter()))
                continue
        waiting = [v[0] for v in live.values() if v[0].status is Status.WAITING]
        t_step = time.perf_counter()
        engine.step()
        t = time.perf_counter()
        steps += 1
        step_s += t - t_step
        forwards += 1 + any(s.status is not Status.WAITING and len(s.prompt_ids) > 1 for s in waiting)
        for key, (seq, req, i, t_arr, st) in list(live.items()):
            n = len(seq.output_ids) - st["seen"]
            if n > 0:
                decode_tokens += n
                if st["first"] is None:
                    st["first"] = t  # tokens delivered with the first one have no gap to split
                else:
                    st["deliveries"].append([t - st["last"], n])
                st["last"] = t
                st["seen"] = len(seq.output_ids)
            if seq.finished:
                del live[key]
                rec = _engine_record(req, seq, t0, t_arr, st, t)
                records[i].append(rec)
                t_last = t
                on_done(rec)
                if req.followups and rec.error is None:  # the same user asks the next question at once
                    nxt = None
                    try:
                        nxt = next_turn(req, engine.decode(seq.output_ids), tokenize)
                        submit(i, t, nxt)
                    except Exception as e:  # noqa: BLE001 - e.g. the conversation outgrew the context: a failed turn
                        why = str(e) if isinstance(e, DraftsmithError) else f"{type(e).__name__}: {e}"
                        rec = RequestRecord(index=req.index, prompt_id=req.prompt_id, turn=req.turn + 1,
                                            t_arrival=t - t0, error=f"turn {req.turn + 2}: {why}"[:300],
                                            prompt_tokens=None if nxt is None else len(nxt.token_ids))
                        records[i].append(rec)
                        on_done(rec)
    prefill_s = engine.prefill_s - prefill0
    return RunResult([r for rs in records for r in rs], wall_s=t_last - t0, engine_steps=steps,
                     batched_forwards=forwards, decode_s=step_s - prefill_s, decode_tokens=decode_tokens,
                     prefill_s=prefill_s)


def _engine_record(req: BenchRequest, seq, t0: float, t_arr: float, st: dict, t_end: float) -> RequestRecord:
    s = seq.stats
    first = st["first"]
    return RequestRecord(
        index=req.index, prompt_id=req.prompt_id, turn=req.turn, t_arrival=t_arr - t0,
        ttft=None if first is None else first - t_arr, e2e=t_end - t_arr,
        deliveries=st["deliveries"], output_tokens=len(seq.output_ids),
        output_sha=sha_of_ids(seq.output_ids), finish_reason=seq.finish_reason,
        error="aborted" if seq.finish_reason == "abort" else seq.error if seq.finish_reason == "error" else None,
        proposed=s.proposed, accepted=s.accepted, rounds=s.rounds, committed=s.committed,
        target_forwards=s.target_forwards, proposed_at=list(s.proposed_at), accepted_at=list(s.accepted_at),
        prompt_tokens=len(seq.prompt_ids), cached_tokens=s.cached_tokens,
    )


# ---- over HTTP ------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """The server root of an OpenAI base URL (where /metrics and /health live)."""
    u = url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


def run_endpoint(url: str, model: str, requests: Sequence[BenchRequest], concurrency: int,
                 offsets: Sequence[float] | None = None, timeout: float = 600.0,
                 on_done: Callable[[RequestRecord], None] = _noop) -> RunResult:
    """Stream every request through POST {url}/chat/completions; same arrival rules as in-process."""
    return asyncio.run(_run_endpoint(url, model, requests, concurrency, offsets, timeout, on_done))


async def _run_endpoint(url, model, requests, concurrency, offsets, timeout, on_done) -> RunResult:
    records: list[list[RequestRecord]] = [[] for _ in requests]  # per request: one record per turn
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        t0 = time.perf_counter()
        ends: list[float] = []

        async def one(i: int, t_arr: float) -> None:
            req = requests[i]
            while True:  # a conversation's turns, one after the other
                rec, text = await _stream_one(client, url, model, req, t0, t_arr)
                records[i].append(rec)
                t_arr = time.perf_counter()
                ends.append(t_arr)
                on_done(rec)
                if not req.followups or rec.error is not None or rec.finish_reason is None:
                    break  # no next turn after a failed answer, or one the stream cut short
                req = next_turn(req, text)

        if offsets is None:
            queue: deque[int] = deque(range(len(requests)))

            async def user() -> None:
                while queue:
                    i = queue.popleft()
                    await one(i, time.perf_counter())

            await asyncio.gather(*(user() for _ in range(min(concurrency, len(requests)))))
        else:
            sem = asyncio.Semaphore(concurrency)

            async def gated(i: int, t_arr: float) -> None:
                async with sem:
                    await one(i, t_arr)

            tasks = []
            for i, off in enumerate(offsets):
                delay = t0 + off - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(gated(i, t0 + off)))
            await asyncio.gather(*tasks)
        wall = (max(ends) if ends else time.perf_counter()) - t0
    return RunResult([r for rs in records for r in rs], wall_s=wall)


async def _stream_one(client, url: str, model: str, req: BenchRequest, t0: float,
                      t_arr: float) -> tuple[RequestRecord, str]:
    """One streamed chat completion: its record and the answer's text."""
    p = req.params
    body = {"model": model, "messages": [dict(m) for m in req.messages], "max_tokens": p.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "stream": True,
            "stream_options": {"include_usage": True}}
    if p.seed is not None:
        body["seed"] = p.seed
    so = p.structured_outputs
    if so is not None and so.json is not None:  # bench --json-schema: OpenAI's response_format
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    rec = RequestRecord(index=req.index, prompt_id=req.prompt_id, turn=req.turn, t_arrival=t_arr - t0)
    parts: list[str] = []
    chunks = 0
    usage = None
    last = None
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread())[:300].decode("utf-8", "replace")
                rec.error = f"HTTP {r.status_code}: {detail}"
                return rec, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return rec, ""
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") or ch.get("text")
                    if text:
                        t = time.perf_counter()
                        if last is None:
                            rec.ttft = t - t_arr
                        else:
                            rec.deliveries.append([t - last, 1])
                        last = t
                        chunks += 1
                        parts.append(text)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                        if rec.finish_reason in ("abort", "error"):  # as an aborted request in process
                            rec.error = f"the server ended the answer with finish_reason {rec.finish_reason!r}"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, counted in the report
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return rec, ""
    rec.e2e = time.perf_counter() - t_arr
    if rec.ttft is None:
        rec.ttft = rec.e2e
    rec.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else chunks
    text = "".join(parts)
    rec.output_sha = sha_of_text(text)
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return rec, text


def scrape_counters(url: str, timeout: float = 30.0, model: str | None = None) -> dict | None:
    """draftsmith_* (or vLLM's vllm:spec_decode_*, or SGLang's sglang:*, of `model` where the
    series name models) counters from {server}/metrics, or None if it exposes none."""
    try:
        r = httpx.get(f"{base_url(url)}/metrics", timeout=timeout)
        if r.status_code != 200:
            return None
        return counters_from_text(r.text, model)
    except (httpx.HTTPError, ValueError):
        return None


def counters_from_text(text: str, model: str | None = None) -> dict | None:
    """The draftsmith_* counters of a Prometheus exposition text, else vLLM's (a vLLM server's
    vllm:spec_decode_*: _vllm_counters), else SGLang's (sglang:*: _sglang_counters); only
    `model`'s series where they carry a model_name. None if there are none of these."""
    # Imported here: importing draftsmith.server loads FastAPI and the app (0.55 s measured),
    # which only endpoint runs need.
    from draftsmith.server.metrics import parse_metrics

    m = parse_metrics(text)
    if "draftsmith_draft_tokens_proposed_total" not in m:
        return _vllm_counters(m, model) or _sglang_counters(m, model)

    def positions(name: str) -> dict[int, float]:
        out = {}
        for k, v in m.items():
            if k.startswith(name + "{"):
                out[int(k.split('position="', 1)[1].split('"', 1)[0])] = v
        return out

    rounds = m.get("draftsmith_verification_rounds_total", 0.0)
    return {
        "proposed": m["draftsmith_draft_tokens_proposed_total"],
        "accepted": m.get("draftsmith_draft_tokens_accepted_total", 0.0),
        "rounds": rounds,
        # the server exports τ (a gauge over all rounds) and the round count: committed = τ × rounds
        "committed": m.get("draftsmith_mean_accepted_length", 0.0) * rounds,
        "generation_tokens": m.get("draftsmith_generation_tokens_total", 0.0),
        "finished": sum(v for k, v in m.items() if k.startswith("draftsmith_requests_finished_total")),
        "engine_steps": m.get("draftsmith_engine_steps_total"),
        "position_proposed": positions("draftsmith_draft_position_proposed_total"),
        "position_accepted": positions("draftsmith_draft_position_accepted_total"),
        "rss_bytes": m.get("process_resident_memory_bytes"),
    }


def _series_sum(m: dict[str, float], name: str) -> float | None:
    """The sum of every series of `name` (all label sets: engines), None where there is none."""
    vals = [v for k, v in m.items() if k == name or k.startswith(name + "{")]
    return sum(vals) if vals else None


def _of_model(m: dict[str, float], model: str | None) -> dict[str, float]:
    """The series of `model` (vLLM's model_name label), and those without the label; all where
    `model` is None or no series names it (a server that labels with another name)."""
    if model is None:
        return m
    from draftsmith.server.metrics import escape_label

    mine = f'model_name="{escape_label(model)}"'
    kept = {k: v for k, v in m.items() if "model_name=" not in k or mine in k}
    return kept if any(mine in k for k in kept) else m


def _vllm_counters(m: dict[str, float], model: str | None = None) -> dict | None:
    """A vLLM server's speculative counters (vllm:spec_decode_*), in the draftsmith_* reading:
    rounds = the steps that drafted, committed = their drafts accepted + one token each (so τ is
    vLLM's mean acceptance length, over the steps that drafted; vLLM does not count the others);
    positions from vllm:spec_decode_num_accepted_tokens_per_pos (diff_counters decides whether
    they can be read as conditional acceptance). None where the server has no such counters."""
    m = _of_model(m, model)
    if not any(k.startswith("vllm:spec_decode_") for k in m):
        return None
    drafts = _series_sum(m, "vllm:spec_decode_num_drafts_total") or 0.0  # (a series not yet written: 0)
    accepted_at: dict[int, float] = {}
    for k, v in m.items():
        if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{") and 'position="' in k:
            pos = int(k.split('position="', 1)[1].split('"', 1)[0]) + 1  # (vLLM's positions are 0-based)
            accepted_at[pos] = accepted_at.get(pos, 0.0) + v
    accepted = _series_sum(m, "vllm:spec_decode_num_accepted_tokens_total") or 0.0
    return {
        "names": "vllm",
        "proposed": _series_sum(m, "vllm:spec_decode_num_draft_tokens_total") or 0.0,
        "accepted": accepted, "rounds": drafts, "committed": drafts + accepted,
        "generation_tokens": _series_sum(m, "vllm:generation_tokens_total"),
        "finished": _series_sum(m, "vllm:request_success_total") or 0.0,
        "engine_steps": None, "position_proposed": {}, "position_accepted": accepted_at,
        "rss_bytes": m.get("process_resident_memory_bytes"),
    }


# SGLang's speculative gauges (scheduler side, one series per scheduler rank that logs): set every
# decode-log interval (--decode-log-interval decode batches) from that window alone, so they
# describe the scheduler's last window before the scrape, not a run; read, never differenced.
_SGLANG_GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate",
                  "sglang:spec_num_steps", "sglang:spec_num_draft_tokens")


def _sglang_counters(m: dict[str, float], model: str | None = None) -> dict | None:
    """An SGLang server's speculative metrics (--enable-metrics), in the draftsmith_* reading.
    SGLang counts, per finished request, its verify steps (sglang:spec_verify_calls_total, a
    counter since SGLang PR #25689, May 2026), output tokens (sglang:generation_tokens_total) and the request
    (sglang:num_requests_total): rounds = verify steps, committed = output tokens less one per
    request (a request's first token comes from its prefill, not from a verify step). It counts
    no proposed or accepted drafts and nothing per position: None / empty. rounds is None where
    the verify counter has no series (an older SGLang, or no speculative request finished yet);
    the acceptance gauges are kept as read (`gauges`: name -> value per series). None where the
    server exports no sglang:* metric (any of them marks SGLang: a series appears once written)."""
    m = _of_model(m, model)
    if not any(k.startswith("sglang:") for k in m):
        return None
    gen = _series_sum(m, "sglang:generation_tokens_total") or 0.0  # (a series not yet written: 0)
    finished = _series_sum(m, "sglang:num_requests_total") or 0.0
    gauges = {name: [v for k, v in sorted(m.items()) if k == name or k.startswith(name + "{")]
              for name in _SGLANG_GAUGES}
    return {
        "names": "sglang",
        "proposed": None, "accepted": None,
        "rounds": _series_sum(m, "sglang:spec_verify_calls_total"), "committed": gen - finished,
        "generation_tokens": gen, "finished": finished,
        "engine_steps": None, "position_proposed": {}, "position_accepted": {},
        "gauges": {k: v for k, v in gauges.items() if v},
        "rss_bytes": m.get("process_resident_memory_bytes"),
    }


def _delta(before: dict, after: dict, k: str) -> int | None:
    """Counter `k`'s increase between two scrapes (None where either lacks it)."""
    if before.get(k) is None or after.get(k) is None:
        return None
    return int(round(after[k] - before[k]))


def diff_counters(before: dict | None, after: dict | None) -> dict:
    """Counts for one measured run from two scrapes; {"unavailable": why} when there are none."""
    if before is None or after is None:
        return {"unavailable": "the server exposes no draftsmith_*, vllm:spec_decode_* or sglang:* metrics on "
                               "/metrics (SGLang: launch it with --enable-metrics)"}
    if before.get("names") != after.get("names") or any(
            after.get(k) is not None and before.get(k) is not None and after[k] < before[k]
            for k in ("proposed", "accepted", "rounds", "finished", "generation_tokens")):
        return {"unavailable": "the server's counters went backwards during the run (restarted?)"}
    if after.get("names") == "vllm":
        return _diff_vllm(before, after)
    if after.get("names") == "sglang":
        return _diff_sglang(before, after)

    d = partial(_delta, before, after)
    width = max(list(after["position_proposed"]) + [0])
    pos_p = [int(after["position_proposed"].get(k, 0) - before["position_proposed"].get(k, 0)) for k in range(1, width + 1)]
    pos_a = [int(after["position_accepted"].get(k, 0) - before["position_accepted"].get(k, 0)) for k in range(1, width + 1)]
    rounds, finished = d("rounds"), d("finished")
    return {
        "source": "server /metrics (difference around the measured run)",
        "proposed": d("proposed"), "accepted": d("accepted"), "rounds": rounds, "committed": d("committed"),
        "generation_tokens": d("generation_tokens"), "engine_steps": d("engine_steps"),
        # a request takes part in one prefill forward and one forward per round
        "target_forwards": None if rounds is None or finished is None else rounds + finished,
        "position_proposed": pos_p, "position_accepted": pos_a, "server_rss_bytes": after.get("rss_bytes"),
    }


def _diff_vllm(before: dict, after: dict) -> dict:
    """diff_counters of two vLLM scrapes. Per position: vLLM counts the steps that accepted more
    than k drafts, not those that proposed k; where every drafting step of the run proposed the
    same K drafts (draft tokens = K x steps: EAGLE, draft models, DFlash at a fixed K), each
    position was proposed by every step, so conditional acceptance is exact; otherwise (n-gram's
    shorter drafts) it is left out rather than guessed."""
    d = partial(_delta, before, after)
    rounds, proposed = d("rounds"), d("proposed")
    width = max(list(after["position_accepted"]) + [0])
    pos_a = [int(after["position_accepted"].get(k, 0) - before["position_accepted"].get(k, 0))
             for k in range(1, width + 1)]
    exact = bool(rounds) and proposed == rounds * width
    return {
        "source": "vLLM's /metrics (vllm:spec_decode_*, difference around the measured run; tau over the steps "
                  "that drafted)",
        "proposed": proposed, "accepted": d("accepted"), "rounds": rounds, "committed": d("committed"),
        "generation_tokens": d("generation_tokens"), "engine_steps": None, "target_forwards": None,
        "position_proposed": [rounds] * width if exact else [], "position_accepted": pos_a if exact else [],
        "server_rss_bytes": after.get("rss_bytes"),
    }


def _gauge_text(gauges: dict[str, list[float]]) -> str:
    return "; ".join(f"{k} " + ", ".join(f"{v:.4g}" for v in vs) for k, vs in gauges.items()) or "none"


def _diff_sglang(before: dict, after: dict) -> dict:
    """diff_counters of two SGLang scrapes: rounds and committed are differences of counters, so
    tau (committed / rounds) is over the run's speculative requests alone; SGLang counts no
    proposed drafts, so there is no acceptance rate and no per-position acceptance. Its
    acceptance gauges go along as read after the run (`gauges`), never differenced. Without the
    verify counter nothing is derived: unavailable, with the gauges in the reason."""
    if after["rounds"] is None:
        if before["rounds"] is not None:
            return {"unavailable": "the server's counters went backwards during the run (restarted?)"}
        return {"unavailable": "SGLang's /metrics has no sglang:spec_verify_calls_total counter (an SGLang older than "
                               "that counter, or no request of the run was decoded speculatively), so no count of the "
                               "run; its gauges after the run (the scheduler's last decode-log window, not this run): "
                               + _gauge_text(after["gauges"]),
                "gauges": after["gauges"]}
    # a series not yet written before the run (no speculative request had finished): 0
    before = dict(before, rounds=before["rounds"] or 0.0)
    d = partial(_delta, before, after)
    rounds, finished = d("rounds"), d("finished")
    return {
        "source": "SGLang's /metrics (difference around the measured run: rounds = sglang:spec_verify_calls_total, "
                  "committed = sglang:generation_tokens_total less one first token per sglang:num_requests_total; "
                  "no proposed-draft counter, so no acceptance rate; sglang:spec_accept_length / spec_accept_rate "
                  "are gauges of the scheduler's last decode-log window, kept as read after the run in each "
                  "unit's counters.gauges, not differenced)",
        "proposed": None, "accepted": None, "rounds": rounds, "committed": d("committed"),
        "generation_tokens": d("generation_tokens"), "engine_steps": None,
        # a request takes part in one prefill forward and one forward per verify step
        "target_forwards": None if rounds is None or finished is None else rounds + finished,
        "position_proposed": [], "position_accepted": [], "gauges": after["gauges"],
        "server_rss_bytes": after.get("rss_bytes"),
    }

"""Server pieces that need no model: stop-string holdback, metrics text, request models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from draftsmith.server.metrics import ServerMetrics, parse_metrics
from draftsmith.server.protocol import ChatCompletionRequest, CompletionRequest, validation_error
from draftsmith.server.text import StreamText, safe_prefix, stop_holdback


def test_stop_holdback_keeps_possible_stop_prefixes():
    assert stop_holdback("hello wor", ("world",)) == 3
    assert stop_holdback("hello w", ("world", "xyz")) == 1
    assert stop_holdback("hello", ("world",)) == 0
    assert stop_holdback("ab", ("abc", "bcd")) == 2  # longest candidate wins
    assert safe_prefix("hello wor", ("world",)) == "hello "
    assert safe_prefix("hello world and more", ("world",)) == "hello "
    assert safe_prefix("caf\ufffd", ()) == "caf"  # incomplete multi-byte character held back


def test_stream_text_never_leaks_past_a_stop():
    # A toy "tokenizer": token id = one character.
    full = "The answer is 42. END of text"
    decode = lambda ids: "".join(full[i] for i in ids)  # noqa: E731
    final = full[: full.find("END")]  # the engine's visible text once "END" completes
    st = StreamText(decode, ("END", "42!"))
    sent = ""
    for i in range(full.find("END") + 3):  # the engine finishes when "END" is complete
        sent += st.push([i])
        assert final.startswith(sent)  # nothing past the stop, ever
        if decode(list(range(i + 1))).endswith("42"):
            assert not sent.endswith("4") and not sent.endswith("42")  # "42!" still possible
    sent += st.finish(final)
    assert sent == final == "The answer is 42. "


def test_stream_text_releases_held_tail_when_stop_does_not_complete():
    chars = list("abcabd")
    st = StreamText(lambda ids: "".join(chars[i] for i in ids), ("abc!",))
    out = "".join(st.push([i]) for i in range(len(chars)))
    assert out == "abcabd"  # "abc" was held until "a" showed it was no stop; "ab" until "d"
    assert st.finish("abcabd") == ""


def test_metrics_render_and_parse():
    m = ServerMetrics("tiny", kv_rows_total=4)
    m.record_round_deltas(proposed=5, accepted=3, rounds=2, committed=5, pos_proposed=[2, 2, 1], pos_accepted=[2, 1])
    m.record_step(verify_tokens=7)
    m.set_load(waiting=1, running=2, rows_in_use=2)
    m.record_tokens(ttft=0.2, itl=None, n=1)
    m.record_tokens(ttft=None, itl=0.3, n=3)
    m.record_finished("length", 1.5)
    m.record_error(400)
    text = m.render()
    assert "# TYPE draftsmith_time_to_first_token_seconds histogram" in text
    v = parse_metrics(text)
    assert v["draftsmith_draft_tokens_proposed_total"] == 5
    assert v["draftsmith_draft_acceptance_rate"] == pytest.approx(0.6)
    assert v["draftsmith_mean_accepted_length"] == pytest.approx(2.5)
    assert v['draftsmith_draft_position_acceptance_rate{position="2"}'] == pytest.approx(0.5)
    assert v['draftsmith_draft_position_acceptance_rate{position="3"}'] == 0.0
    assert v["draftsmith_kv_rows_in_use"] == 2 and v["draftsmith_num_requests_waiting"] == 1
    assert v["draftsmith_inter_token_latency_seconds_count"] == 3
    assert v['draftsmith_inter_token_latency_seconds_bucket{le="0.1"}'] == 3
    assert v['draftsmith_verify_tokens_per_step_bucket{le="8.0"}'] == 1
    assert v['draftsmith_http_errors_total{status="400"}'] == 1


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": 3}, "stop"),
    ],
)
def test_completion_request_type_errors_name_the_param(body, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    err = validation_error(e.value)
    assert err.status == 400 and err.param == param


def test_chat_request_parsing():
    r = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "unknown_field": 1}
    )
    assert r.messages[0].text() == "ab" and r.max_tokens is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).unsupported() == ["logprobs"]


# ---- the engine thread, over a fake engine (no model) ---------------------------------


class _FakeEngine:
    """Just enough of Engine: one token per step per running request, finish at max_tokens."""

    def __init__(self, rows: int = 2) -> None:
        from collections import deque
        from types import SimpleNamespace

        self.config = SimpleNamespace(max_batch=rows)
        self.free_rows = list(range(rows))
        self.waiting, self.running = deque(), []
        self.steps = 0
        self.polls = 0
        self.fail_next = False

    def add_request(self, prompt_ids, params, request_id):
        from draftsmith.engine.sequence import Sequence
        from draftsmith.errors import DraftsmithError

        if not prompt_ids:
            raise DraftsmithError("prompt is empty")
        s = Sequence(request_id=request_id, prompt_ids=list(prompt_ids), params=params, generator=None)
        self.waiting.append(s)
        return s

    def has_unfinished(self):
        self.polls += 1
        return bool(self.waiting or self.running)

    def _finish(self, s, reason):
        from draftsmith.engine.sequence import Status

        s.finish_reason, s.status, s.text = reason, Status.FINISHED, "x" * len(s.output_ids)
        if s.row >= 0:
            self.free_rows.append(s.row)
            s.row = -1

    def abort(self, rid):
        for s in list(self.waiting) + self.running:
            if s.request_id == rid:
                (self.waiting.remove if s in self.waiting else self.running.remove)(s)
                self._finish(s, "abort")
                return True
        return False

    def step(self):
        self.steps += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        while self.waiting and self.free_rows:
            s = self.waiting.popleft()
            s.row = self.free_rows.pop()
            self.running.append(s)
        done = []
        for s in self.running:
            s.output_ids.append(7)
            s.stats.record_round(proposed=1, accepted=1 if len(s.output_ids) % 2 else 0, committed=1)
            if len(s.output_ids) >= s.params.max_tokens:
                self._finish(s, "length")
                done.append(s)
        self.running = [s for s in self.running if s not in done]
        return done


def test_engine_loop_events_abort_failure_and_idle():
    import queue as q_
    import time

    from draftsmith.core.sampling import SamplingParams
    from draftsmith.server.engine_loop import EngineLoop, SubRequest

    eng = _FakeEngine(rows=2)
    metrics = ServerMetrics("fake", 2)
    loop = EngineLoop(eng, metrics)  # type: ignore[arg-type]
    events: q_.Queue = q_.Queue()
    loop.start()
    try:
        def sub(rid, n, stream=True, prompt=(1, 2)):
            return SubRequest(rid, 0, list(prompt), SamplingParams(max_tokens=n), stream, events.put)

        loop.add([sub("a", 3)])
        got = [events.get(timeout=5) for _ in range(4)]
        assert [e.kind for e in got] == ["added", "tokens", "tokens", "finished"]
        assert got[-1].token_ids == [7, 7, 7] and got[-1].finish_reason == "length"
        time.sleep(0.2)
        steps, polls = eng.steps, eng.polls
        time.sleep(0.3)
        assert (eng.steps, eng.polls) == (steps, polls)  # asleep on the condition, not spinning

        loop.add([sub("bad", 3, prompt=())])
        assert events.get(timeout=5).kind == "error"

        loop.add([sub("long", 10**6, stream=False)])
        assert events.get(timeout=5).kind == "added"
        deadline = time.monotonic() + 5
        while metrics.snapshot()["kv_rows_in_use"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        loop.abort(["long"])
        ev = events.get(timeout=5)
        assert (ev.kind, ev.finish_reason) == ("finished", "abort")
        deadline = time.monotonic() + 5
        while metrics.snapshot()["kv_rows_in_use"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        eng.fail_next = True  # a failing step fails what is in flight; the loop keeps serving
        loop.add([sub("f", 5)])
        assert [events.get(timeout=5).kind for _ in range(2)] == ["added", "error"]
        loop.add([sub("g", 1)])
        assert [events.get(timeout=5).kind for _ in range(2)] == ["added", "finished"]
        assert loop.alive
    finally:
        loop.stop()
    assert not loop.alive

"""The OpenAI-compatible server against the real default target, through the official client.

Two servers on 127.0.0.1, started once for the module:
- `draftsmith serve --drafter ngram` in a subprocess (the CLI path);
- drafter none, in process: `create_app(LLM(...))` under uvicorn in a background thread.
The in-process LLM also produces the `LLM.generate` references, before its server starts
(the engine belongs to the server thread afterwards). A `draftsmith generate --json`
subprocess runs alongside for the CLI parity case. Greedy parity at max_tokens 8; the whole module is
bounded by the load (32 x 8 tokens) and disconnect (3 streams) cases.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from waiting import wait_until  # tests/waiting.py

from draftsmith.api import LLM
from draftsmith.core.sampling import SamplingParams
from draftsmith.server.metrics import parse_metrics

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MAX_LEN = 512
MAX_TOKENS = 8
PROMPTS = [
    "Hello, my name is",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CLI_PROMPT = PROMPTS[1]
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None, log_path) -> None:
    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout=START_TIMEOUT_S, interval=0.1, message=f"server at {url} not healthy")


class _ThreadServer:
    """uvicorn in a background thread on an ephemeral loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self) -> str:
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive(), timeout=60,
                   message="in-process server did not start")
        if not self.server.started:
            raise RuntimeError("in-process server thread ended before the server started")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def env(default_target_dir, tmp_path_factory):
    """Start everything, overlapping the three model loads; yield URLs, references, CLI output."""
    tmp = tmp_path_factory.mktemp("server")
    port = _free_port()
    srv_log = tmp / "serve.log"
    cli_out, cli_err = tmp / "cli.json", tmp / "cli.err"
    base_env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    srv = subprocess.Popen(
        [sys.executable, "-m", "draftsmith", "serve", "--target", MODEL, "--drafter", "ngram",
         "--host", "127.0.0.1", "--port", str(port), "--max-len", str(MAX_LEN), "--max-batch", "8",
         "--num-speculative-tokens", "4", "--policy", "fixed", "--log-level", "warning"],
        stdout=open(srv_log, "w"), stderr=subprocess.STDOUT, env=base_env,
    )
    cli = subprocess.Popen(
        [sys.executable, "-m", "draftsmith", "generate", "--target", MODEL, "--drafter", "ngram", "--policy", "fixed",
         "--prompt", CLI_PROMPT, "--max-new-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"],
        stdout=open(cli_out, "w"), stderr=open(cli_err, "w"), env=base_env,
    )
    thread_server = None
    try:
        llm = LLM(MODEL, drafter="none", max_batch=8, max_len=MAX_LEN)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        refs = {p: llm.generate([p], greedy)[0] for p in PROMPTS}  # one at a time, like the server sees them
        chat_ref = llm.chat(CHAT, greedy)[0]
        with_lp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)
        lp_refs = {"completion": llm.generate([PROMPTS[1]], with_lp)[0], "chat": llm.chat(CHAT, with_lp)[0]}
        tok = llm.tokenizer
        prompt_ids = {p: llm.encode(p) for p in PROMPTS}
        chat_ids = llm.apply_chat_template(CHAT)
        from draftsmith.server.app import create_app

        thread_server = _ThreadServer(create_app(llm))
        plain_url = thread_server.start()
        ngram_url = f"http://127.0.0.1:{port}"
        _wait_healthy(ngram_url, srv, srv_log)

        def cli_result() -> dict:
            assert cli.wait(timeout=START_TIMEOUT_S) == 0, cli_err.read_text()[-2000:]
            return json.loads(cli_out.read_text())

        yield {
            "ngram": ngram_url, "plain": plain_url, "refs": refs, "chat_ref": chat_ref, "tok": tok,
            "prompt_ids": prompt_ids, "chat_ids": chat_ids, "cli": cli_result, "lp_refs": lp_refs,
            "target": llm.target,  # the loaded smollm2-135m, for tests that build another LLM on it
        }
    finally:
        if thread_server is not None:
            thread_server.stop()
        for p in (srv, cli):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def _stream_completion(client: OpenAI, **kw) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for ch in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    return text, finish, usage


def _server_names():
    return ["ngram", "plain"]


def test_models_health_and_metrics(env):
    for name in _server_names():
        c = _client(env[name])
        assert [m.id for m in c.models.list().data] == [MODEL]
        assert httpx.get(f"{env[name]}/health").json()["status"] == "ok"
        m = _metrics(env[name])
        assert m["draftsmith_kv_rows_total"] == 8 and m["draftsmith_kv_rows_in_use"] == 0


@pytest.mark.parametrize("server", _server_names())
def test_completions_greedy_equal_llm_generate(env, server):
    c = _client(env[server])
    for p in PROMPTS:
        ref = env["refs"][p]
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(env["prompt_ids"][p])
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        text, finish, usage = _stream_completion(c, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert (text, finish) == (ref.text, ref.finish_reason)
        assert usage.completion_tokens == len(ref.token_ids) and usage.prompt_tokens == len(env["prompt_ids"][p])


@pytest.mark.parametrize("server", _server_names())
def test_chat_greedy_equal_llm_chat(env, server):
    c, ref = _client(env[server]), env["chat_ref"]
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(env["chat_ids"]), len(ref.token_ids))
    parts, finish = [], None
    for ch in c.chat.completions.create(messages=CHAT, model=MODEL, max_tokens=MAX_TOKENS, temperature=0, stream=True):
        parts.append(ch.choices[0].delta.content or "")
        finish = ch.choices[0].finish_reason or finish
    assert "".join(parts) == ref.text and finish == ref.finish_reason


@pytest.mark.parametrize("server", _server_names())
def test_logprobs_through_the_openai_client(env, server):
    """Completions `logprobs=2` and chat `logprobs=True, top_logprobs=2`, whole and streamed, read
    by the official client: the numbers of `LLM.generate(SamplingParams(logprobs=2))` (the n-gram
    server's from verify blocks)."""
    c = _client(env[server])
    ref = env["lp_refs"]["completion"]
    want = [(d[t].decoded_token, d[t].logprob) for t, d in zip(ref.token_ids, ref.outputs[0].logprobs)]
    r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [w[0] for w in want] and lp.token_logprobs == pytest.approx([w[1] for w in want], abs=1e-4)
    assert all(len(top) == 2 for top in lp.top_logprobs) and "".join(lp.tokens) == ref.text  # greedy: in the top 2
    ref = env["lp_refs"]["chat"]
    want = [(d[t].decoded_token, d[t].logprob) for t, d in zip(ref.token_ids, ref.outputs[0].logprobs)]
    kw = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2)
    content = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    for got in (content, streamed):
        assert [e.token for e in got] == [w[0] for w in want]
        assert [e.logprob for e in got] == pytest.approx([w[1] for w in want], abs=1e-4)
        assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in got)


def test_structured_outputs_through_the_openai_client(env):
    """The official client's `chat.completions.parse(response_format=<a pydantic model>)` (a strict
    JSON schema): both servers answer the same JSON (greedy: the n-gram server's verify blocks
    masked position by position equal plain decoding), it parses into the model, and streamed
    equals whole."""
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    msgs = [{"role": "user", "content": "Invent a person. Reply in JSON with name, age and city."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=96, temperature=0)
    got = {}
    for server in _server_names():
        r = _client(env[server]).chat.completions.parse(response_format=Person, **kw)
        assert r.choices[0].finish_reason == "stop"
        got[server] = r.choices[0].message
        assert isinstance(got[server].parsed, Person) and got[server].parsed.name
    assert got["ngram"].content == got["plain"].content
    assert list(json.loads(got["plain"].content)) == ["name", "age", "city"]  # the schema's order
    schema = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}
    chunks = _client(env["ngram"]).chat.completions.create(stream=True, response_format=schema, **kw)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    whole = _client(env["plain"]).chat.completions.create(response_format=schema, **kw).choices[0].message.content
    assert streamed == whole and Person.model_validate_json(whole)


def test_tool_calls_through_the_openai_client(env):
    """Tool calling with the official client: `chat.completions.parse(tools=[pydantic_function_tool(
    GetWeather)], tool_choice=<named>)` parses the call's arguments into the model; tool_choice
    "required" gives a call to a listed function; both servers (the n-gram one speculative) make
    the same calls, and a call streamed through the client equals the whole one."""
    from typing import Literal

    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str
        unit: Literal["celsius", "fahrenheit"]

    tool = openai.pydantic_function_tool(GetWeather)
    msgs = [{"role": "user", "content": "What's the weather in Paris? Use the tool."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=64, temperature=0, tools=[tool])
    named = {"type": "function", "function": {"name": "GetWeather"}}
    got = {}
    for server in _server_names():
        r = _client(env[server]).chat.completions.parse(tool_choice=named, **kw)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop" and call.function.name == "GetWeather"
        assert isinstance(call.function.parsed_arguments, GetWeather) and call.function.parsed_arguments.city
        r = _client(env[server]).chat.completions.create(tool_choice="required", **kw)
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name == "GetWeather" and GetWeather.model_validate_json(c.function.arguments)
                             for c in calls)
        got[server] = (call.function.arguments, [c.function.arguments for c in calls])
    assert got["ngram"] == got["plain"]
    args, names = "", []
    for ch in _client(env["ngram"]).chat.completions.create(tool_choice=named, stream=True, **kw):
        for c in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            names += [c.function.name] if c.function.name else []
            args += c.function.arguments or ""
    assert names == ["GetWeather"] and args == got["plain"][0]


def test_responses_through_the_openai_client(env):
    """POST /v1/responses with the official client: `responses.create` whole (the plain server) and
    `stream=True` (the n-gram server, speculative) give the chat route's greedy answer as a
    Response; `responses.stream` reaches its final response; `responses.parse(text_format=<a
    pydantic model>)` parses into the model and equals the chat route's answer under that schema."""
    from pydantic import BaseModel

    ref = env["chat_ref"]
    status = "incomplete" if ref.finish_reason == "length" else "completed"
    kw = dict(model=MODEL, input=CHAT[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0)
    r = _client(env["plain"]).responses.create(**kw)
    assert (r.output_text, r.status, r.output[0].type) == (ref.text, status, "message")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(env["chat_ids"]), len(ref.token_ids))
    events = list(_client(env["ngram"]).responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ref.text
    assert events[-1].type == "response.completed" and events[-1].response.output_text == ref.text
    with _client(env["ngram"]).responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == ref.text

    class City(BaseModel):
        name: str
        country: str

    ask = "Name a city and its country, as JSON."
    r = _client(env["plain"]).responses.parse(model=MODEL, input=ask, text_format=City, max_output_tokens=48,
                                              temperature=0)
    assert isinstance(r.output_parsed, City) and r.status == "completed"
    chat = _client(env["plain"]).chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ask}],
                                                        max_tokens=48, temperature=0, response_format=City)
    assert chat.choices[0].message.content == r.output_text  # (the client sends one strict schema to both)


def test_ngram_server_drafts_and_matches_cli_generate(env):
    """Speculation happened on the ngram server (and its greedy output equals plain's above);
    the CLI's `generate --json` gives the same text as the server for the same prompt."""
    m = _metrics(env["ngram"])
    assert m["draftsmith_draft_tokens_proposed_total"] > 0
    assert m["draftsmith_draft_tokens_accepted_total"] > 0  # the repeat prompt is n-gram friendly
    assert m["draftsmith_mean_accepted_length"] > 1.0
    assert 'draftsmith_draft_position_acceptance_rate{position="1"}' in m
    # the same counters under vLLM's names (server/metrics_vllm.py)
    vllm = lambda name, extra="": m[f'vllm:{name}{{model_name="{MODEL}",engine="0"{extra}}}']  # noqa: E731
    assert vllm("spec_decode_num_draft_tokens_total") == m["draftsmith_draft_tokens_proposed_total"]
    assert vllm("spec_decode_num_accepted_tokens_total") == m["draftsmith_draft_tokens_accepted_total"]
    assert vllm("spec_decode_num_drafts_total") == m['draftsmith_draft_position_proposed_total{position="1"}']
    assert vllm("spec_decode_num_accepted_tokens_per_pos_total", ',position="0"') == \
        m['draftsmith_draft_position_accepted_total{position="1"}']
    assert vllm("generation_tokens_total") == m["draftsmith_generation_tokens_total"] > 0
    assert _metrics(env["plain"])["draftsmith_draft_tokens_proposed_total"] == 0
    cli = env["cli"]()["results"][0]
    r = _client(env["ngram"]).completions.create(model=MODEL, prompt=CLI_PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == cli["text"] == env["refs"][CLI_PROMPT].text
    assert r.usage.completion_tokens == len(cli["token_ids"])


def test_stop_strings_cut_and_never_leak_in_streams(env):
    c, tok = _client(env["ngram"]), env["tok"]
    p = PROMPTS[0]
    ref = env["refs"][p]
    words = ref.text.split()
    assert len(words) >= 4, ref.text
    stop = f"{words[2]} {words[3]}"  # spans tokens: its first word is held back until resolved
    expected = ref.text[: ref.text.find(stop)]
    never = ref.text[: ref.text.find(words[2]) + 1] + "\x00never"  # a long false prefix
    # exact usage: tokens up to the one that completed the stop string
    k = next(k for k in range(1, len(ref.token_ids) + 1) if stop in tok.decode(ref.token_ids[:k], skip_special_tokens=True))
    r = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=[never, stop])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (expected, "stop", k)
    chunks = []
    for ch in c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=[never, stop], stream=True):
        chunks.append(ch.choices[0].text)
        assert expected.startswith("".join(chunks))  # nothing past the stop at any point
    assert "".join(chunks) == expected
    # a stop string that never completes: the held-back text is released, output unchanged
    text, finish, _ = _stream_completion(c, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stop=never)
    assert (text, finish) == (ref.text, ref.finish_reason)
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    chat_stop = env["chat_ref"].text.split()[1]
    r = c.chat.completions.create(model=MODEL, messages=msg, max_tokens=MAX_TOKENS, temperature=0, stop=chat_stop)
    assert r.choices[0].message.content == env["chat_ref"].text[: env["chat_ref"].text.find(chat_stop)]
    assert r.choices[0].finish_reason == "stop"


def test_n_choices_and_seeds(env):
    c = _client(env["ngram"])
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0.9, top_p=0.95)
    a = c.completions.create(n=2, seed=123, **kw)
    assert [ch.index for ch in a.choices] == [0, 1]
    assert a.usage.prompt_tokens == len(env["prompt_ids"][PROMPTS[0]])  # the prompt counts once
    b = c.completions.create(n=1, seed=124, **kw)  # choice i of a request with seed s uses s + i
    assert b.choices[0].text == a.choices[1].text
    assert all(ch.finish_reason in ("stop", "length") for ch in a.choices)
    assert a.usage.completion_tokens <= 16 and a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    parts: dict[int, str] = {0: "", 1: ""}
    for ch in c.completions.create(n=2, seed=123, stream=True, **kw):
        for choice in ch.choices:
            parts[choice.index] += choice.text
    assert [parts[0], parts[1]] == [ch.text for ch in a.choices]


BAD_COMPLETIONS = [
    (b'{"prompt": "x",', 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "x", "stream": "maybe"}, 400, "stream", None),  # ("yes" is true, as vLLM's lax pydantic reads it)
    ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "word " * (MAX_LEN + 10), "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ({"prompt": "x", "top_p": 0.0}, 400, "top_p", None),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ({"prompt": "x", "n": 0}, 400, "n", None),
    ({"prompt": "x", "stop": [""]}, 400, "stop", None),
    ({"prompt": [10**9]}, 400, "prompt", None),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
]
BAD_CHATS = [
    ({"messages": "hi"}, 400, "messages", None),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model", "model_not_found"),
    ({"messages": [{"role": "user", "content": "word " * MAX_LEN}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
]


def test_bad_inputs_get_openai_style_4xx_and_the_server_keeps_serving(env):
    url = env["ngram"]
    with httpx.Client(base_url=url, timeout=30) as h:
        for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHATS)):
            for body, status, param, code in cases:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = h.post(path, headers={"content-type": "application/json"}, **kw)
                assert r.status_code == status, (path, body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
                assert err["param"] == param, (body, err)
                if code:
                    assert err["code"] == code, (body, err)
        r = h.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
    c = _client(url)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == env["tok"].decode(env["refs"][PROMPTS[0]].token_ids[:4], skip_special_tokens=True)
    m = _metrics(url)
    assert m['draftsmith_http_errors_total{status="400"}'] >= len(BAD_COMPLETIONS) + len(BAD_CHATS) - 2
    assert not any(k.startswith('draftsmith_http_errors_total{status="5') for k in m)
    assert m["draftsmith_kv_rows_in_use"] == 0


def test_load_32_concurrent_streams(env):
    url = env["ngram"]
    before = _metrics(url)
    n_clients = 32

    async def one(client: AsyncOpenAI, i: int):
        text, finish, usage = "", None, None
        if i % 2:
            stream = await client.completions.create(
                model=MODEL, prompt=f"Question {i}: what is {i} plus {i}?", max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].text
                    finish = ch.choices[0].finish_reason or finish
                usage = ch.usage or usage
        else:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Name a fruit, number {i}."}], max_tokens=8,
                temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
            async for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
                usage = ch.usage or usage
        return text, finish, usage

    async def main():
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=150) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(n_clients))), timeout=170)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(results) == n_clients
    for text, finish, usage in results:
        assert finish in ("stop", "length")
        assert usage is not None and 1 <= usage.completion_tokens <= 8
        assert finish == "stop" or usage.completion_tokens == 8
    after = _metrics(url)
    finished = lambda m: sum(v for k, v in m.items() if k.startswith("draftsmith_requests_finished_total"))  # noqa: E731
    assert finished(after) - finished(before) == n_clients
    assert after["draftsmith_kv_rows_in_use"] == 0 and after["draftsmith_num_requests_waiting"] == 0
    assert not any(k.startswith('draftsmith_http_errors_total{status="5') for k in after)
    assert after["draftsmith_time_to_first_token_seconds_count"] - before["draftsmith_time_to_first_token_seconds_count"] == n_clients
    print(f"32 concurrent streams finished in {elapsed:.1f}s")


def test_client_disconnect_aborts_and_frees_rows(env):
    url = env["ngram"]
    c = _client(url)
    before = _metrics(url).get('draftsmith_requests_finished_total{finish_reason="abort"}', 0)
    streams = []
    for i in range(3):
        s = c.completions.create(model=MODEL, prompt=f"Write a very long story, part {i}.", max_tokens=400,
                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(s))  # the request is running once its first chunk arrives
        streams.append(s)
    # the engine thread publishes its load right after the step
    wait_until(lambda: _metrics(url)["draftsmith_kv_rows_in_use"] == 3, interval=0.05,
               message=lambda: f"rows in use: {_metrics(url)['draftsmith_kv_rows_in_use']}, want 3")
    for s in streams:
        s.close()

    def rows_freed() -> dict | None:
        m = _metrics(url)
        return m if m["draftsmith_kv_rows_in_use"] == 0 else None

    m = wait_until(rows_freed, interval=0.05,
                   message=lambda: f"rows still in use: {_metrics(url)['draftsmith_kv_rows_in_use']}")
    assert m['draftsmith_requests_finished_total{finish_reason="abort"}'] - before == 3
    assert m["draftsmith_num_requests_running"] == 0
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_a_seed_fixes_the_output_under_a_load_dependent_policy(env, default_target_dir):
    """Issue 15 item 3 through HTTP: batch-schedule picks K by how many requests run, and a
    sampling draft model (q != p) drafts; the same seeded request alone, under concurrent load
    and again gives one output, equal to plain decoding with that seed."""
    from concurrent.futures import ThreadPoolExecutor

    from draftsmith.server.app import create_app

    llm = LLM(env["target"], drafter=f"draft-model:{MODEL}", policy="batch-schedule", num_speculative_tokens=6,
              max_batch=8, max_len=MAX_LEN)  # MODEL as env loaded it (not loaded again)
    plain = LLM(llm.target, drafter="none", max_batch=8, max_len=MAX_LEN)
    want = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=77))[0].text
    server = _ThreadServer(create_app(llm))
    url = server.start()
    try:
        c = _client(url)
        kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, top_p=0.95, seed=77)
        alone = c.completions.create(**kw).choices[0].text
        load = [dict(model=MODEL, prompt=p, max_tokens=24, temperature=1.0) for p in PROMPTS * 3]
        with ThreadPoolExecutor(8) as pool:
            others = [pool.submit(c.completions.create, **o) for o in load]
            under_load = [pool.submit(c.completions.create, **kw) for _ in range(3)]
            texts = [f.result().choices[0].text for f in under_load]
            [f.result() for f in others]
        assert alone == want and texts == [want] * 3
        assert llm.engine.last_step.rows >= 1  # the engine really served them
    finally:
        server.stop()

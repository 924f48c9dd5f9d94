"""Regeneration backends: the built-in engine (batched) and any OpenAI-compatible endpoint.

Both replay a conversation turn by turn through `ChatTokens` and report each finished
conversation (or its failure) to the sink; they differ only in who samples the answers.

- `EngineBackend`: several conversations' current turns run in one engine (continuous
  batching: when a turn finishes, that conversation's next turn joins the running batch).
  Each answer has its own seeded generator, so batching does not change what is sampled.
- `EndpointBackend`: `POST {url}/v1/chat/completions` with httpx, `concurrency`
  conversations in flight; 5xx / 408 / 429 / timeouts / connection errors are retried with
  exponential backoff, then the conversation goes to the errors file. Each request asks for
  the answer's token ids (`return_token_ids`, vLLM's and Draftsmith's). The last turn of a
  conversation takes them where they decode to the message's text (no reasoning split off by a
  server-side parser) and the prompt ids the server sends back, if it does, are ours (same
  tokenizer and template): the answer's ids exactly as the target wrote them. Every other answer is the local
  tokenizer's encoding of its text (see ChatTokens), because that is what the server puts in the
  next turn's prompt (a chat endpoint renders the conversation from text), and one record holds
  each answer once. A server that refuses the field (a 400 or 422 naming it) is asked again
  without it, and not asked again. Each turn records which (`answer_ids`: "server" or "text"):
  a text's encoding can differ from the tokens the target sampled.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from draftsmith.core.sampling import SamplingParams
from draftsmith.data.chat_tokens import ChatTokens, answer_slots
from draftsmith.data.feature_recorder import FeatureRecorder
from draftsmith.data.features import parse_layer_ids, store_dtype
from draftsmith.data.regen_config import RegenConfig, resolve_sampling, turn_seed
from draftsmith.data.regen_records import make_record
from draftsmith.engine.builder import build_engine
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json
from draftsmith.models.loading import legacy_weights_fingerprint, load_tokenizer, read_config, weights_fingerprint
from draftsmith.models.registry import resolve_target
from draftsmith.models.target import eos_token_ids, load_target


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@dataclass
class _ConvState:
    conv: Any
    ct: ChatTokens
    blocks: list
    k: int = 0
    dropped: int = 0
    request_ids: list[str] = field(default_factory=list)


def _too_long(n: int, max_len: int, k: int) -> str:
    return (f"prompt of turn {k + 1} has {n} tokens; the context limit (--max-len) is {max_len}, "
            "which leaves no room to answer")


class EngineBackend:
    """Batched regeneration with Draftsmith's own engine (plain decoding, no drafter).

    With cfg.features_out the engine's drafter is a `FeatureRecorder` (plain decoding that keeps
    the target's features of every fed position): a finished conversation's last tokens go
    through one more one-token request (the "tail", its sampled token dropped), and the record is
    reported with the features of all its tokens."""

    records_features = True  # run_regen: this backend can serve --features-out

    def __init__(self, cfg: RegenConfig, target=None) -> None:
        self.cfg = cfg
        self.target = target or load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)
        self.tokenizer = self.target.tokenizer
        self.eos = eos_token_ids(self.target)
        self.sampling = resolve_sampling(self.target.path, cfg.temperature, cfg.top_p, cfg.top_k,
                                         cfg.max_new_tokens, cfg.seed)
        max_len = min(cfg.max_len or 2048, self.target.model.config.max_position_embeddings)
        self.recorder: FeatureRecorder | None = None
        if cfg.features_out is not None:
            layers = parse_layer_ids(cfg.feature_layers, self.target.model.config.num_layers)
            self.recorder = FeatureRecorder(layers, max_len, store_dtype(cfg.feature_dtype))
        self.engine = build_engine(self.target, drafter=self.recorder or "none", max_batch=cfg.batch_size,
                                   max_len=max_len, enable_prefix_caching=cfg.enable_prefix_caching,
                                   adaptive_threads=cfg.adaptive_threads)
        self.max_len = self.engine.max_len
        self.target_info = {"id": self.target.target_id, "weights_hash": self.target.weights_hash}
        self.legacy_weights_hash = self.target.legacy_weights_hash
        self.prompt_log: list[tuple[str, int, list[int]]] | None = None  # tests: (id, turn, prompt ids)

    def _params(self, conv_id: str, k: int) -> SamplingParams:
        s = self.sampling
        return SamplingParams(max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, seed=turn_seed(s.seed, conv_id, k))

    def release(self) -> None:
        """Free the engine (its KV cache) and the feature record: the run is over."""
        self.engine = None
        self.recorder = None

    def run(self, todo: Sequence, sink) -> None:
        queue = deque(todo)
        by_request: dict[str, _ConvState] = {}
        tails: set[str] = set()

        def finish(st: _ConvState) -> None:
            """Report st's record; with the recorder, first feed its last tokens (the tail)."""
            if self.recorder is None or len(st.ct.ids) >= self.max_len:  # too long: the catch-up pass
                sink.record(make_record(st.conv, st.ct, self.target_info, self.sampling, st.dropped))
                return
            rid = f"{st.conv.id}#tail"
            self.recorder.want(rid)
            self.engine.add_request(list(st.ct.ids), SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
            by_request[rid] = st
            tails.add(rid)

        def advance(st: _ConvState) -> None:
            """Submit st's next turn, or finish it (record / error)."""
            try:
                while st.k < len(st.blocks):
                    prompt = st.ct.open_turn(st.blocks[st.k])
                    if len(prompt) >= self.max_len:
                        st.ct.cancel_turn()
                        if st.k == 0:
                            sink.error(st.conv, _too_long(len(prompt), self.max_len, st.k))
                            return
                        st.dropped = sum(1 for b in st.blocks[st.k:] for m in b if m["role"] == "user")
                        break
                    if self.prompt_log is not None:
                        self.prompt_log.append((st.conv.id, st.k, list(prompt)))
                    rid = f"{st.conv.id}#{st.k}"
                    self.engine.add_request(prompt, self._params(st.conv.id, st.k), request_id=rid)
                    by_request[rid] = st
                    return
                finish(st)
            except DraftsmithError as e:
                sink.error(st.conv, _one_line(e))
            except Exception as e:  # a template / tokenizer failure on this conversation only
                sink.error(st.conv, f"{type(e).__name__}: {_one_line(e)}")

        while queue or by_request:
            while queue and len(by_request) < self.cfg.batch_size:
                conv = queue.popleft()
                try:
                    st = _ConvState(conv, ChatTokens(self.tokenizer, self.eos), answer_slots(conv.messages))
                except DraftsmithError as e:
                    sink.error(conv, _one_line(e))
                    continue
                if not st.blocks:
                    sink.error(conv, "conversation has no user turn to answer")
                    continue
                advance(st)
            if not by_request:
                continue
            for seq in self.engine.step():
                st = by_request.pop(seq.request_id)
                if seq.request_id in tails:
                    tails.discard(seq.request_id)
                    features = self.recorder.take(seq.request_id)
                    if features is None or features[1].shape[0] != len(st.ct.ids):
                        raise RuntimeError(f"{st.conv.id}: the tail request left without its conversation's features")
                    sink.record(make_record(st.conv, st.ct, self.target_info, self.sampling, st.dropped), features)
                    continue
                sink.summary.prompt_tokens += len(seq.prompt_ids)
                sink.summary.cached_prompt_tokens += seq.stats.cached_tokens
                sink.answered(len(seq.output_ids))
                try:
                    st.ct.close_turn(seq.output_ids, seq.finish_reason or "")
                except DraftsmithError as e:
                    sink.error(st.conv, _one_line(e))
                    continue
                st.k += 1
                advance(st)


# ---- OpenAI-compatible endpoint -------------------------------------------------------


def chat_completions_url(endpoint: str) -> str:
    u = endpoint.rstrip("/")
    if u.endswith("/chat/completions"):
        return u
    if u.endswith("/v1"):
        return u + "/chat/completions"
    return u + "/v1/chat/completions"


def _names_token_ids(r) -> bool:
    """Whether an error response is about the return_token_ids field (its message or param)."""
    try:
        err = r.json()
        err = err.get("error", err) if isinstance(err, dict) else err
        return "return_token_ids" in json.dumps(err)
    except ValueError:
        return "return_token_ids" in r.text


def _check_endpoint_options(cfg: RegenConfig) -> None:
    """--endpoint's URL and request settings, before anything is sent or written (a URL without
    http:// or a timeout of 0 failed every request into the errors file)."""
    try:
        url = httpx.URL(cfg.endpoint)
        ok = url.scheme in ("http", "https") and bool(url.host)
    except (httpx.InvalidURL, TypeError):
        ok = False
    if not ok:
        raise DraftsmithError(f"--endpoint must be an http(s) URL, e.g. http://host:8000/v1; got {cfg.endpoint!r}")
    if not (math.isfinite(cfg.request_timeout) and cfg.request_timeout > 0):
        raise DraftsmithError(f"--request-timeout must be a positive number of seconds, got {cfg.request_timeout}")
    if not (math.isfinite(cfg.retry_backoff) and cfg.retry_backoff >= 0):
        raise DraftsmithError(f"--retry-backoff must be a number of seconds >= 0, got {cfg.retry_backoff}")


def endpoint_unreachable(endpoint: str, e: Exception) -> DraftsmithError:
    return DraftsmithError(f"--endpoint {endpoint}: cannot connect ({type(e).__name__}: {_one_line(e)}); "
                           "start the server or fix the URL, e.g. http://host:8000/v1")


def served_models(endpoint: str, models_url: str, timeout: float) -> tuple[list[str], str]:
    """GET /v1/models before anything is written: the served models' names, and where there are
    none what the server answered (/v1/models is optional: a chat endpoint may still answer). A
    server that cannot be reached (refused, no such host) is an error here; it was each request
    retried into the errors file, the run ending 'ok' with 0 written (and --overwrite's old output
    gone). A slow answer is left to the run's timeouts and retries. (regen and bench --endpoint)"""
    try:
        r = httpx.get(models_url, timeout=min(10.0, timeout))
    except httpx.TimeoutException:
        return [], "timed out"
    except httpx.TransportError as e:
        raise endpoint_unreachable(endpoint, e) from None
    if r.status_code != 200:
        return [], f"answered HTTP {r.status_code} ({r.reason_phrase})"
    try:
        names = [str(m["id"]) for m in r.json().get("data") or [] if isinstance(m, dict) and m.get("id")]
    except Exception:  # not JSON, or not a model list
        names = []
    return names, "" if names else "answered 200 with no model list"


def check_chat(endpoint: str, chat_url: str, model: str, timeout: float) -> None:
    """One request of one token where /v1/models listed nothing (or not the model asked for): a
    URL that is no OpenAI-compatible chat endpoint (a web server's 404 / 405 / 501, a 200 that is
    no chat completion) or that refuses every request (a 4xx: wrong model name, a key needed) is
    an error before anything is written. 5xx, 408 / 429 and timeouts are left to the run's retries."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    try:
        r = httpx.post(chat_url, json=body, timeout=timeout)
    except httpx.TimeoutException:
        return
    except httpx.TransportError as e:
        raise endpoint_unreachable(endpoint, e) from None
    why = None
    if r.status_code == 200:  # (a chat completion's shape only: one token may leave content null,
        try:                  # a reasoning parser's <think>, which _parse would refuse as a reply)
            ok = isinstance(r.json()["choices"][0]["message"], dict)
        except (ValueError, LookupError, TypeError):
            ok = False
        if not ok:
            why = "answered 200 with no chat completion"
    elif r.status_code in (501, 505) or (400 <= r.status_code < 500 and r.status_code not in (408, 409, 429)):
        json_body = "json" in r.headers.get("content-type", "")  # an error's message; not a web page
        why = f"answered HTTP {r.status_code} ({' '.join(r.text.split())[:200] if json_body else r.reason_phrase})"
    if why is not None:
        raise DraftsmithError(f"--endpoint {endpoint}: POST {chat_url} {why}; give an OpenAI-compatible "
                              "server's URL, e.g. http://host:8000/v1 (and --endpoint-model, the name it serves)")


class _Failed(Exception):
    """The conversation cannot be completed (reason goes to the errors file)."""


class EndpointBackend:
    """Regeneration against any OpenAI-compatible server (vLLM, SGLang, Draftsmith's own)."""

    def __init__(self, cfg: RegenConfig) -> None:
        if not cfg.endpoint:
            raise DraftsmithError("EndpointBackend needs --endpoint URL")
        if cfg.concurrency <= 0:
            raise DraftsmithError(f"--concurrency must be positive, got {cfg.concurrency}")
        _check_endpoint_options(cfg)
        self.cfg = cfg
        target_id, path = resolve_target(cfg.target)
        self.tokenizer = load_tokenizer(path)
        config = read_config(path)
        eos = set(config.eos_token_ids)
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            e = read_json(gen, "generation config").get("eos_token_id")
            eos.update(e if isinstance(e, list) else ([] if e is None else [e]))
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos = tuple(sorted(eos))
        self.sampling = resolve_sampling(path, cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.seed)
        self.url = chat_completions_url(cfg.endpoint)
        self.vocab = max(len(self.tokenizer), config.vocab_size)  # the ids the target may write
        served, _ = served_models(cfg.endpoint, self.url[: -len("/chat/completions")] + "/models",
                                  cfg.request_timeout)
        self.model_name = cfg.endpoint_model or (served[0] if served else target_id)
        if self.model_name not in served:
            # /v1/models (optional) listed nothing, or not --endpoint-model: is the URL a chat endpoint
            # at all, and does it serve that name (vLLM and Draftsmith's server 404 any other)?
            check_chat(cfg.endpoint, self.url, self.model_name, cfg.request_timeout)
        self.target_info = {"id": target_id, "weights_hash": weights_fingerprint(path),
                            "endpoint": cfg.endpoint, "served_model": self.model_name}
        self.legacy_weights_hash = legacy_weights_fingerprint(path)
        self.max_len = cfg.max_len
        self.ask_ids = True  # send return_token_ids (off once the server refuses the field)

    def run(self, todo: Sequence, sink) -> None:
        asyncio.run(self._run_all(list(todo), sink))

    async def _run_all(self, todo: list, sink) -> None:
        it = iter(todo)
        limits = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
        async with httpx.AsyncClient(timeout=self.cfg.request_timeout, limits=limits) as client:

            async def worker() -> None:
                for conv in it:  # shared iterator: each conversation is taken by one worker
                    try:
                        rec = await self._conversation(client, conv, sink)
                    except _Failed as e:
                        sink.error(conv, str(e))
                    except DraftsmithError as e:
                        sink.error(conv, _one_line(e))
                    except Exception as e:  # one bad conversation never stops the run
                        sink.error(conv, f"{type(e).__name__}: {_one_line(e)}")
                    else:
                        sink.record(rec)

            await asyncio.gather(*(worker() for _ in range(min(self.cfg.concurrency, max(1, len(todo))))))

    async def _conversation(self, client, conv, sink) -> dict:
        ct = ChatTokens(self.tokenizer, self.eos)
        blocks = answer_slots(conv.messages)
        if not blocks:
            raise _Failed("conversation has no user turn to answer")
        dropped = 0
        for k, block in enumerate(blocks):
            prompt = ct.open_turn(block)
            if self.max_len and len(prompt) >= self.max_len:
                ct.cancel_turn()
                if k == 0:
                    raise _Failed(_too_long(len(prompt), self.max_len, k))
                dropped = sum(1 for b in blocks[k:] for m in b if m["role"] == "user")
                break
            room = self.max_len - len(prompt) if self.max_len else None  # servers 400 on prompt + max_tokens > ctx
            content, finish, served = await self._complete(client, ct.messages + list(block), conv.id, k, room)
            last = k == len(blocks) - 1  # (an earlier answer is re-encoded from text in the next prompt)
            served = self._own_tokens(served, prompt, content) if last else None
            if served is not None:  # the target's own tokens
                ids = served
            else:
                ids = list(self.tokenizer(content, add_special_tokens=False)["input_ids"]) if content else []
            ct.close_turn(ids, finish, content=content)
            ct.turns[-1]["answer_ids"] = "server" if served is not None else "text"
            sink.answered(len(ids))
        return make_record(conv, ct, self.target_info, self.sampling, dropped)

    async def _complete(self, client, messages: list[dict], conv_id: str, k: int,
                        room: int | None = None) -> tuple[str, str, tuple | None]:
        """-> the answer's text, finish_reason and what the server sent of its tokens (_parse)."""
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model_name, "messages": messages,
            "max_tokens": s.max_new_tokens if room is None else max(1, min(s.max_new_tokens, room)),
            "temperature": s.temperature, "top_p": s.top_p, "seed": turn_seed(s.seed, conv_id, k),
        }
        if s.top_k:
            body["top_k"] = s.top_k  # vLLM / SGLang extension
        reason = ""
        attempts = self.cfg.retries + 1
        for attempt in range(attempts):
            retry_after = 0.0
            try:
                if self.ask_ids:
                    body["return_token_ids"] = True
                r = await client.post(self.url, json=body)
                if r.status_code in (400, 422) and _names_token_ids(r) and body.pop("return_token_ids", None):
                    self.ask_ids = False  # a server that refuses unknown fields: text it is
                    r = await client.post(self.url, json=body)
            except httpx.TimeoutException as e:
                reason = f"timeout after {self.cfg.request_timeout:g}s ({type(e).__name__})"
            except httpx.TransportError as e:
                reason = f"connection error: {type(e).__name__}: {_one_line(e)}"
            else:
                if r.status_code == 200:
                    return self._parse(r, self.vocab)
                text = " ".join(r.text.split())[:300]
                reason = f"HTTP {r.status_code}: {text}"
                if not (r.status_code >= 500 or r.status_code in (408, 409, 429)):
                    raise _Failed(f"turn {k + 1}: {reason}")  # a client error will not go away
                try:
                    retry_after = min(float(r.headers.get("retry-after", 0)), 60.0)
                except ValueError:
                    retry_after = 0.0
            if attempt + 1 < attempts:
                delay = self.cfg.retry_backoff * (2 ** attempt) * (1.0 + 0.25 * random.random())
                await asyncio.sleep(max(delay, retry_after))
        raise _Failed(f"turn {k + 1}: gave up after {attempts} attempts; last error: {reason}")

    def _own_tokens(self, served: tuple | None, prompt: list[int], content: str) -> list[int] | None:
        """The served answer ids where they are this target's for this prompt and text (None:
        encode the text). `served`: (answer ids, the prompt ids the server saw or None, whether
        the message had reasoning split off)."""
        if served is None:
            return None
        ids, prompt_ids, reasoning = served
        if reasoning or (prompt_ids is not None and list(prompt_ids) != list(prompt)):
            return None  # a server-side parser took text out of the answer, or another tokenizer / template
        body = ids[:-1] if ids and ids[-1] in self.eos else ids
        if self.tokenizer.decode(body, skip_special_tokens=True) != content:
            return None  # the text is not these tokens' (special tokens dropped, another tokenizer, ...)
        return ids

    @staticmethod
    def _parse(r, vocab: int) -> tuple[str, str, tuple | None]:
        try:
            data = r.json()
            choice = data["choices"][0]
            message = choice["message"]
            content = message["content"]
            finish = choice.get("finish_reason") or "stop"
            ids = choice.get("token_ids")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise _Failed(f"malformed chat-completions response ({type(e).__name__}: {_one_line(e)})") from None
        if not isinstance(content, str):
            raise _Failed("chat-completions response has no text content")
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
            return content, str(finish), None  # not sent (or not this tokenizer's): the text is encoded locally
        reasoning = bool(message.get("reasoning") or message.get("reasoning_content"))
        return content, str(finish), (ids, data.get("prompt_token_ids"), reasoning)

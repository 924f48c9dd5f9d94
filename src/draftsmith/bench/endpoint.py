"""The endpoint backend: each configuration an OpenAI-compatible server (`--endpoint
LABEL=URL`), its draft counts the difference of its /metrics counters around each run."""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.bench.config import BenchConfig
from draftsmith.bench.loadgen import diff_counters, run_endpoint, scrape_counters
from draftsmith.bench.machine import proc_bytes
from draftsmith.bench.metrics import RunResult
from draftsmith.bench.phases import Phase
from draftsmith.data.regen_backends import check_chat, served_models
from draftsmith.errors import DraftsmithError


def probe(url: str, model: str | None, timeout: float) -> str:
    """The model to send to the server at `url` (its /v1 base), checked before anything is
    measured or written: `model`, else the first /v1/models lists; a name it does not list is
    asked for one token (regen --endpoint's checks). A web server that is no OpenAI API, a model
    it does not serve, a server that cannot be reached: one line each, not a run of failures."""
    served, why = served_models(url, f"{url}/models", timeout)
    if model is None and not served:
        raise DraftsmithError(f"--endpoint {url}: GET {url}/models {why}, so there is no model name to send; give "
                              "an OpenAI-compatible server's URL, e.g. http://host:8000/v1, or name the model with "
                              "--endpoint-model")
    model = model or served[0]
    if model not in served:
        check_chat(url, f"{url}/chat/completions", model, timeout)
    return model


class EndpointRunner:
    kind = "endpoint"

    def __init__(self, label: str, url: str, model: str, timeout: float) -> None:
        self.label, self.url, self.model, self.timeout = label, url, model, timeout
        self.info = {"url": url, "model": model}

    def run(self, requests, concurrency, offsets, on_done) -> RunResult:
        before = scrape_counters(self.url, model=self.model)
        res = run_endpoint(self.url, self.model, requests, concurrency, offsets, self.timeout, on_done)
        res.counters = diff_counters(before, scrape_counters(self.url, model=self.model))
        return res


class EndpointBackend:
    weights_hash = None
    max_prompt_tokens = None
    peers = None

    def __init__(self, cfg: BenchConfig, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.endpoints = [(e, probe(e.url, cfg.endpoint_model, cfg.request_timeout)) for e in cfg.endpoints]

    tokenize = None

    def runners(self, phase: Phase, max_len: int) -> list:
        return [EndpointRunner(e.label, e.url, model, self.cfg.request_timeout) for e, model in self.endpoints]

    def memory(self, runner) -> dict:
        return {"rss_bytes": proc_bytes("VmRSS"), "rss_scope": "the bench client process, not the server"}

    def reset_peak(self) -> None:
        pass

    def release(self, runners: list) -> None:
        runners.clear()

    def setup(self) -> dict:
        return {"mode": "endpoint", "target": {"id": ", ".join(sorted({m for _, m in self.endpoints})),
                                               "weights_hash": None, "served_models": {e.label: m for e, m in self.endpoints}},
                "drafters": [{"label": e.label, "spec": e.url, "kind": "endpoint", "checkpoint": None,
                              "served_model": m} for e, m in self.endpoints]}

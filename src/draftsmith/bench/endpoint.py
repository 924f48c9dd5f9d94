"""The endpoint backend: each configuration an OpenAI-compatible server (`--endpoint
LABEL=URL`), its draft counts the difference of its /metrics counters around each run."""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.bench.config import BenchConfig
from draftsmith.bench.loadgen import diff_counters, endpoint_model, run_endpoint, scrape_counters
from draftsmith.bench.machine import proc_bytes
from draftsmith.bench.metrics import RunResult
from draftsmith.bench.phases import Phase


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
        self.endpoints = []
        for e in cfg.endpoints:
            model = cfg.endpoint_model or endpoint_model(e.url)
            self.endpoints.append((e, model))

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

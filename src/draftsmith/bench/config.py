"""Typed configuration of one `draftsmith bench` run, and the parsers for its CLI spellings.

    BenchConfig(target="smollm2-135m", drafters=("ngram",), workload="humaneval",
                concurrency=(1, 4, 16), requests=16, max_tokens=64, arrival=parse_arrival("closed"))

The baseline (`none`: plain decoding through the same engine) is always measured in-process,
first in every tier; `drafters` lists only the speculative configurations. With `endpoints`
the same load generator drives OpenAI-compatible servers instead, one configuration per
endpoint (the server's own drafter is whatever it was started with).

`control=True` measures plain decoding a second time, as one more configuration (label
`control`, an engine of its own): an A/A pair whose ratio, 1.00 in an ideal run, is the noise
of this run on this machine, next to the speedups it qualifies (docs/MEASURING.md).

`turns=N` makes each request a conversation: its first N user turns, each sent when the previous
answer ends (closed loop within the conversation), the answer so far in the next turn's prompt;
with `enable_prefix_caching` the in-process engines reuse a turn's KV for the next (vLLM's flag).

`fingerprint()` is what must not change between an interrupted run and its `--resume`: the
measured work (target, drafters, prompts, sampling, arrival, warm-up, repeats, policy). The
tier list may change (resume adds tiers); cost, bandwidth and goodput (SLO) inputs only affect
the report.
"""

from __future__ import annotations

import json

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from draftsmith.errors import DraftsmithError

BASELINE = "none"
CONTROL = "control"  # plain decoding measured again as a configuration (the A/A control)
PEER_KINDS = ("hf", "llamacpp")  # bench/peers.py, bench/llamacpp.py
SPLITS = ("heldout", "train", "all")


@dataclass(frozen=True)
class Arrival:
    """closed: a fixed number of users, each sends its next request when the last one ends.
    poisson: requests arrive at `rate` per second (exponential gaps, seeded); at most
    `concurrency` run at once, the rest queue (their queueing time counts in TTFT)."""

    mode: Literal["closed", "poisson"] = "closed"
    rate: float | None = None

    @property
    def label(self) -> str:
        return "closed" if self.mode == "closed" else f"poisson:{self.rate:g}"


@dataclass(frozen=True)
class EndpointSpec:
    label: str
    url: str  # base URL including /v1, e.g. http://127.0.0.1:8000/v1


def parse_arrival(spec: str) -> Arrival:
    s = spec.strip().lower()
    if s == "closed":
        return Arrival("closed")
    if s.startswith("poisson:"):
        try:
            rate = float(s.split(":", 1)[1])
        except ValueError:
            rate = float("nan")
        if not (rate > 0 and math.isfinite(rate)):
            raise DraftsmithError(f"--arrival poisson:RATE needs a positive number of requests per second, got {spec!r}")
        return Arrival("poisson", rate)
    raise DraftsmithError(f"--arrival must be 'closed' or 'poisson:RATE' (requests/s), got {spec!r}")


GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys: time to first token, per output token, end to end


def parse_goodput(specs) -> tuple[tuple[str, float], ...]:
    """`ttft:500 tpot:50` (or comma-separated; a list of such strings, of (metric, ms) pairs, or a
    dict) → (("ttft", 500.0), ("tpot", 50.0)): service-level objectives in milliseconds, vLLM's
    `--goodput` spelling."""
    if isinstance(specs, dict):
        specs = [f"{k}:{v}" for k, v in specs.items()]
    elif isinstance(specs, str):
        specs = [specs]
    parts = [p if isinstance(p, str) else ":".join(map(str, p)) for p in specs]  # "ttft:500" or ("ttft", 500)
    items = [x for part in parts for x in part.replace(",", " ").split()]
    if not items:
        raise DraftsmithError("--goodput needs at least one METRIC:MILLISECONDS, e.g. ttft:500 tpot:50")
    out: dict[str, float] = {}
    for item in items:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        try:
            ms = float(val) if sep else float("nan")
        except ValueError:
            ms = float("nan")
        if key not in GOODPUT_METRICS or not (ms > 0 and math.isfinite(ms)):
            raise DraftsmithError(f"--goodput takes METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)} "
                                  f"and a positive number, e.g. ttft:500 tpot:50; got {item!r}")
        if key in out:
            raise DraftsmithError(f"--goodput gives {key} twice")
        out[key] = ms
    return tuple(out.items())


def parse_concurrency(spec: str) -> tuple[int, ...]:
    try:
        tiers = tuple(int(x) for x in spec.replace(" ", "").split(",") if x)
    except ValueError:
        raise DraftsmithError(f"--concurrency must be comma-separated positive integers, e.g. 1,4,16; got {spec!r}") from None
    if not tiers or any(t <= 0 for t in tiers):
        raise DraftsmithError(f"--concurrency must be comma-separated positive integers, e.g. 1,4,16; got {spec!r}")
    return tuple(sorted(set(tiers)))


def parse_endpoint(spec: str, index: int = 0) -> EndpointSpec:
    """`URL` or `LABEL=URL`. A label `none` marks the no-speculation baseline server."""
    label, sep, url = spec.partition("=")
    if not sep or "://" in label:
        label, url = ("endpoint" if index == 0 else f"endpoint-{index + 1}"), spec
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DraftsmithError(f"--endpoint must be an http(s) URL (optionally LABEL=URL), got {spec!r}")
    if not url.endswith("/v1"):
        url += "/v1"
    return EndpointSpec(label.strip(), url)


@dataclass(frozen=True)
class BenchConfig:
    target: str = "smollm2-135m"
    drafters: tuple[str, ...] = ("ngram",)  # speculative configs; the `none` baseline is always added
    workload: str = "humaneval"  # built-in source / alias, or a .jsonl / .parquet prompt file
    split: str | None = None  # heldout | train | all; default heldout for built-ins, all for files
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    requests: int = 16  # measured requests per tier (per config, per repeat)
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 64
    arrival: Arrival = field(default_factory=Arrival)
    warmup: int = 2  # unmeasured requests per config at the start of each tier
    repeats: int = 1  # interleaved repetitions of each tier (ratio spread across them)
    seed: int = 0
    num_speculative_tokens: int | None = None  # K; default: checkpoint block size, else 5
    policy: str = "auto"
    endpoints: tuple[EndpointSpec, ...] = ()
    endpoint_model: str | None = None
    request_timeout: float = 600.0
    peers: tuple[str, ...] = ()  # ("hf",), ("llamacpp",) or both
    peer_assistant: str | None = None  # HF assistant_model directory / alias
    peer_lookup_tokens: int = 10  # prompt-lookup draft length of the HF and llama.cpp peers
    peer_gguf: str | None = None  # llama.cpp peer: a GGUF (default: the built-in target at the engine dtype)
    dollars_per_hour: float | None = None
    goodput: tuple[tuple[str, float], ...] = ()  # SLOs (metric, ms): report requests/s meeting all of them
    mem_bandwidth_gbs: float | None = None  # default: measured after the run (docs/MEASURING.md #8)
    max_prompt_tokens: int | None = None  # longer prompts are skipped (default: what fits the context)
    out: Path = Path("runs/bench")
    resume: bool = False
    overwrite: bool = False
    device: str | None = None
    dtype: str | None = None
    drafter_dtype: str = "auto"  # what model drafters compute in (drafters/precision.py)
    control: bool = False  # also measure plain decoding again as a configuration (the A/A control)
    turns: int = 1  # user turns per request (a conversation: each turn's prompt holds the answers so far)
    enable_prefix_caching: bool = False  # in-process engines reuse the KV of a prompt prefix a free row holds
    # every request's answer keeps to this JSON schema (its JSON text): structured outputs in-process,
    # response_format json_schema for --endpoint servers (tool calls, extraction, JSON APIs)
    json_schema: str | None = None
    progress: bool | None = None  # None = only on a terminal

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", tuple(self.drafters))
        object.__setattr__(self, "concurrency", tuple(sorted(set(int(c) for c in self.concurrency))))
        object.__setattr__(self, "endpoints", tuple(self.endpoints))
        object.__setattr__(self, "peers", tuple(self.peers))
        object.__setattr__(self, "out", Path(self.out))
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise DraftsmithError("concurrency tiers must be positive integers")
        for name in ("requests", "max_tokens", "repeats", "turns"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise DraftsmithError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise DraftsmithError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if not self.temperature >= 0:
            raise DraftsmithError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.split is not None and self.split not in SPLITS:
            raise DraftsmithError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS

        k = self.num_speculative_tokens
        if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:  # (K = 1000 profiled 1000-token blocks for minutes)
            raise DraftsmithError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
        if BASELINE in self.drafters:
            object.__setattr__(self, "drafters", tuple(d for d in self.drafters if d != BASELINE))
        if len(set(self.drafters)) != len(self.drafters):
            raise DraftsmithError(f"a drafter is given twice: {', '.join(self.drafters)}")
        if CONTROL in self.drafters:
            raise DraftsmithError(f"{CONTROL!r} is not a drafter: pass --control to measure plain decoding again "
                                  "as an A/A control")
        bad = [p for p in self.peers if p not in PEER_KINDS]
        if bad:
            raise DraftsmithError(f"unknown peer {bad[0]!r}; known: {', '.join(PEER_KINDS)}")
        if len(set(self.peers)) != len(self.peers):
            raise DraftsmithError(f"a peer is given twice: {', '.join(self.peers)}")
        if self.peer_assistant and "hf" not in self.peers:
            raise DraftsmithError("--peer-assistant needs --peers hf")
        if self.peer_gguf and "llamacpp" not in self.peers:
            raise DraftsmithError("--peer-gguf needs --peers llamacpp")
        if self.turns > 1 and self.peers:
            raise DraftsmithError("--peers measures single-turn requests (HF generate and llama.cpp keep no "
                                  "conversation here); drop --turns or --peers")
        if self.endpoints:
            if self.enable_prefix_caching:
                raise DraftsmithError("--enable-prefix-caching sets up the in-process engines; with --endpoint, start "
                                      "the server with it (draftsmith serve --enable-prefix-caching, vLLM's default)")
            if self.peers:
                raise DraftsmithError("--peers runs HF transformers / llama.cpp in this process; it cannot be "
                                      "combined with --endpoint")
            if self.control:
                raise DraftsmithError("--control measures the in-process plain engine twice; with --endpoint, give "
                                      "the baseline server a second time under another label (LABEL=URL) instead")
            labels = [e.label for e in self.endpoints]
            if len(set(labels)) != len(labels):
                raise DraftsmithError(f"--endpoint labels must be unique (LABEL=URL), got {', '.join(labels)}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except (ValueError, RecursionError) as e:
                raise DraftsmithError(f"--json-schema is not JSON ({e}); give a schema object or a file holding one") from None
            if not isinstance(schema, dict):
                raise DraftsmithError(f"--json-schema must be a JSON object (a schema), got {type(schema).__name__}")
            if self.peers:
                raise DraftsmithError("--json-schema cannot be combined with --peers: HF generate and llama.cpp "
                                      "would decode without the schema, so their outputs would not be comparable")
        object.__setattr__(self, "goodput", parse_goodput(self.goodput) if self.goodput else ())
        if self.dollars_per_hour is not None and not self.dollars_per_hour >= 0:
            raise DraftsmithError(f"dollars per hour must be >= 0, got {self.dollars_per_hour}")
        if self.mem_bandwidth_gbs is not None and not self.mem_bandwidth_gbs > 0:
            raise DraftsmithError(f"memory bandwidth must be > 0 GB/s, got {self.mem_bandwidth_gbs}")
        if self.resume and self.overwrite:
            raise DraftsmithError("--resume and --overwrite exclude each other")
        if self.peer_lookup_tokens < 1:
            raise DraftsmithError("peer_lookup_tokens must be >= 1")

    @property
    def schema(self) -> dict | None:
        """The parsed --json-schema (None: answers are free text)."""
        return json.loads(self.json_schema) if self.json_schema is not None else None

    @property
    def endpoint_mode(self) -> bool:
        return bool(self.endpoints)

    @property
    def config_labels(self) -> tuple[str, ...]:
        """Measured configurations in interleaving order (baseline first)."""
        if self.endpoint_mode:
            return tuple(e.label for e in self.endpoints)
        return (BASELINE, *self.drafters, *((CONTROL,) if self.control else ()))

    def fingerprint(self, prompt_ids: list[str], target_hash: str | None) -> dict:
        return {
            "target": self.target if not self.endpoint_mode else None, "target_weights_hash": target_hash,
            "drafters": list(self.drafters) if not self.endpoint_mode else [],
            "endpoints": [[e.label, e.url] for e in self.endpoints],
            "workload": self.workload, "split": self.split, "prompt_ids": list(prompt_ids),
            "requests": self.requests, "temperature": self.temperature, "top_p": self.top_p,
            "max_tokens": self.max_tokens, "arrival": self.arrival.label, "warmup": self.warmup,
            "repeats": self.repeats, "seed": self.seed, "num_speculative_tokens": self.num_speculative_tokens,
            "policy": self.policy, "peers": list(self.peers), "peer_assistant": self.peer_assistant,
            "peer_lookup_tokens": self.peer_lookup_tokens, "peer_gguf": self.peer_gguf, "device": self.device, "dtype": self.dtype,
            "drafter_dtype": self.drafter_dtype, "control": self.control,
            **({"turns": self.turns} if self.turns > 1 else {}),
            **({"enable_prefix_caching": True} if self.enable_prefix_caching else {}),
            **({"json_schema": self.schema} if self.json_schema is not None else {}),
        }

"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Written by the engine thread, read by the HTTP thread: every update and the rendering hold
one lock. No dependency on prometheus_client; the format is a few lines of text.

Speculative metrics (all cumulative since start):
  draftsmith_draft_tokens_proposed_total / _accepted_total     counters
  draftsmith_draft_acceptance_rate                              accepted / proposed
  draftsmith_mean_accepted_length                               τ: committed tokens per
                                                                verification round, bonus incl.
  draftsmith_draft_position_{proposed,accepted}_total{position} rounds that proposed / accepted
                                                                at least `position` drafts
  draftsmith_draft_position_acceptance_rate{position}           accepted / proposed at position
  draftsmith_verify_tokens_per_step                             histogram: target tokens verified
                                                                per engine step (1 + drafts per row,
                                                                forced drafts included)
  draftsmith_forced_tokens_{proposed,accepted}_total            the grammars' forced drafts
                                                                (core/grammar_drafts.py; not in the
                                                                draft_tokens counters)

The same numbers under vLLM's names (`vllm:...`, labels model_name and engine="0") follow, so
dashboards and autoscalers built for vLLM read this server: server/metrics_vllm.py.
"""

from __future__ import annotations

import math
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
VERIFY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def escape_label(v: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def family_lines(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric family's exposition: HELP, TYPE and a line per (labels, value) sample
    (labels written in full: '{a="x"}', or '' for none)."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{labels} {_fmt(v)}" for labels, v in samples)]


def histogram_lines(name: str, help_: str, h: Histogram, labels: str = "") -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name, labels)]


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, times: int = 1) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += times
                break
        self.sum += v * times
        self.count += times

    def lines(self, name: str, labels: str = "") -> list[str]:
        """Exposition lines; `labels` ('a="x",b="y"') go before `le` and on _sum / _count."""
        out, acc = [], 0
        pre, own = (f"{labels},", f"{{{labels}}}") if labels else ("", "")
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{pre}le="{_fmt(float(b))}"}} {acc}')
        out.append(f'{name}_bucket{{{pre}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{own} {_fmt(self.sum)}")
        out.append(f"{name}_count{own} {self.count}")
        return out


class ServerMetrics:
    """Everything /metrics reports. Mutators are called from the engine thread."""

    def __init__(self, model: str, kv_rows_total: int, num_spec_tokens: int = 0) -> None:
        self.lock = threading.Lock()
        self.model = model
        self.kv_rows_total = kv_rows_total
        self.num_spec_tokens = num_spec_tokens  # K (0: no drafter): vLLM's spec_decode families, K positions
        # speculative decoding
        self.proposed = 0
        self.accepted = 0
        self.rounds = 0
        self.committed = 0
        self.pos_proposed: list[int] = []
        self.pos_accepted: list[int] = []
        self.forced_proposed = 0
        self.forced_accepted = 0
        self.steps = 0
        self.verify_tokens = Histogram(VERIFY_BUCKETS)
        # load
        self.waiting = 0
        self.running = 0
        self.kv_rows_in_use = 0
        # requests
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        # at scheduling (a KV row given), as vLLM counts them: prompt tokens, those looked up in the
        # prefix cache (with it on, unless the request asked for its prompt's logprobs) and found there
        self.scheduled_prompt_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.itl_step = Histogram(ITL_BUCKETS)  # vLLM's reading: one observation per delivery, the whole gap
        self.e2e = Histogram(E2E_BUCKETS)

    # ---- updates --------------------------------------------------------------------

    def record_round_deltas(
        self, proposed: int, accepted: int, rounds: int, committed: int,
        pos_proposed: list[int], pos_accepted: list[int], forced_proposed: int = 0, forced_accepted: int = 0,
    ) -> None:
        with self.lock:
            self.proposed += proposed
            self.accepted += accepted
            self.forced_proposed += forced_proposed
            self.forced_accepted += forced_accepted
            self.rounds += rounds
            self.committed += committed
            for acc, new in ((self.pos_proposed, pos_proposed), (self.pos_accepted, pos_accepted)):
                if len(new) > len(acc):
                    acc.extend([0] * (len(new) - len(acc)))
                for k, v in enumerate(new):
                    acc[k] += v

    def record_step(self, verify_tokens: int) -> None:
        with self.lock:
            self.steps += 1
            self.verify_tokens.observe(verify_tokens)

    def set_load(self, waiting: int, running: int, rows_in_use: int) -> None:
        with self.lock:
            self.waiting, self.running, self.kv_rows_in_use = waiting, running, rows_in_use

    def record_tokens(self, ttft: float | None, itl: float | None, n: int) -> None:
        """n new tokens of one request: ttft for its first delivery, else the gap since the
        previous delivery split evenly over the n tokens it brought."""
        with self.lock:
            self.generation_tokens += n
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None and n > 0:
                self.itl.observe(itl / n, times=n)
                self.itl_step.observe(itl)

    def record_admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def record_scheduled(self, prompt_tokens: int, looked_up: bool, cached_tokens: int) -> None:
        """A request got its KV row (its prompt is prefilled from here)."""
        with self.lock:
            self.scheduled_prompt_tokens += prompt_tokens
            if looked_up:
                self.prefix_queries += prompt_tokens
                self.prefix_hits += cached_tokens

    def record_finished(self, reason: str, e2e: float, cached_tokens: int = 0) -> None:
        with self.lock:
            self.cached_prompt_tokens += cached_tokens
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(e2e)

    def record_error(self, status: int) -> None:
        with self.lock:
            key = str(status)
            self.errors[key] = self.errors.get(key, 0) + 1

    # ---- reads ----------------------------------------------------------------------

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "waiting": self.waiting, "running": self.running, "kv_rows_in_use": self.kv_rows_in_use,
                "proposed": self.proposed, "accepted": self.accepted,
            }

    def _acc_at(self, k: int) -> int:
        return self.pos_accepted[k] if k < len(self.pos_accepted) else 0

    def render(self) -> str:
        with self.lock:
            lines: list[str] = []

            def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                lines.extend(family_lines(name, kind, help_, samples))

            def hist(name: str, help_: str, h: Histogram) -> None:
                lines.extend(histogram_lines(name, help_, h))

            m = ""
            family("draftsmith_model_info", "gauge", "The served model.", [(f'{{model="{escape_label(self.model)}"}}', 1)])
            family("draftsmith_draft_tokens_proposed_total", "counter",
                   "Draft tokens proposed to the verifier.", [("", self.proposed)])
            family("draftsmith_draft_tokens_accepted_total", "counter",
                   "Draft tokens accepted by the verifier.", [("", self.accepted)])
            family("draftsmith_forced_tokens_proposed_total", "counter",
                   "Tokens a request's grammar forced, drafted for verification (not counted as draft tokens).",
                   [("", self.forced_proposed)])
            family("draftsmith_forced_tokens_accepted_total", "counter",
                   "Forced tokens the verifier accepted.", [("", self.forced_accepted)])
            family("draftsmith_draft_acceptance_rate", "gauge",
                   "Accepted / proposed draft tokens since start (0 before any draft).",
                   [("", self.accepted / self.proposed if self.proposed else 0.0)])
            family("draftsmith_mean_accepted_length", "gauge",
                   "Mean tokens committed per verification round (tau), bonus token included.",
                   [("", self.committed / self.rounds if self.rounds else 0.0)])
            family("draftsmith_verification_rounds_total", "counter",
                   "Verification rounds summed over requests.", [("", self.rounds)])
            family("draftsmith_draft_position_proposed_total", "counter",
                   "Rounds that proposed at least `position` draft tokens.",
                   [(f'{{position="{k + 1}"}}', v) for k, v in enumerate(self.pos_proposed)])
            family("draftsmith_draft_position_accepted_total", "counter",
                   "Rounds that accepted at least `position` draft tokens.",
                   [(f'{{position="{k + 1}"}}', self._acc_at(k)) for k in range(len(self.pos_proposed))])
            family("draftsmith_draft_position_acceptance_rate", "gauge",
                   "Acceptance at draft position `position`, given it was proposed.",
                   [(f'{{position="{k + 1}"}}', self._acc_at(k) / p if p else 0.0)
                    for k, p in enumerate(self.pos_proposed)])
            family("draftsmith_engine_steps_total", "counter",
                   "Engine steps that ran a target forward.", [("", self.steps)])
            hist("draftsmith_verify_tokens_per_step",
                 "Target tokens verified per engine step (per row: pending token + drafts).",
                 self.verify_tokens)
            family("draftsmith_num_requests_waiting", "gauge",
                   "Requests queued in the engine, waiting for a KV row.", [(m, self.waiting)])
            family("draftsmith_num_requests_running", "gauge",
                   "Requests holding a KV row.", [(m, self.running)])
            family("draftsmith_kv_rows_in_use", "gauge", "KV cache rows in use.", [(m, self.kv_rows_in_use)])
            family("draftsmith_kv_rows_total", "gauge", "KV cache rows (max batch).", [(m, self.kv_rows_total)])
            family("draftsmith_prompt_tokens_total", "counter",
                   "Prompt tokens of requests accepted by the engine.", [("", self.prompt_tokens)])
            family("draftsmith_prompt_tokens_cached_total", "counter",
                   "Prompt tokens of finished requests whose KV prefix caching reused (not prefilled).",
                   [("", self.cached_prompt_tokens)])
            family("draftsmith_generation_tokens_total", "counter",
                   "Output tokens committed.", [("", self.generation_tokens)])
            family("draftsmith_requests_finished_total", "counter",
                   "Finished engine requests by finish reason (one per choice).",
                   [(f'{{finish_reason="{r}"}}', v) for r, v in sorted(self.finished.items())])
            family("draftsmith_http_errors_total", "counter",
                   "Error responses by HTTP status.",
                   [(f'{{status="{s}"}}', v) for s, v in sorted(self.errors.items())])
            hist("draftsmith_time_to_first_token_seconds",
                 "Time from request arrival to its first committed token.", self.ttft)
            hist("draftsmith_inter_token_latency_seconds",
                 "Time between committed tokens of a request (a round's gap split over its tokens).",
                 self.itl)
            hist("draftsmith_e2e_request_latency_seconds",
                 "Time from request arrival to finish.", self.e2e)
            from draftsmith.server.metrics_vllm import vllm_lines  # (it reads this module's classes)

            lines.extend(vllm_lines(self))
            return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> dict[str, float]:
    """Parse exposition text into {'name{labels}': value} (for tests and tools)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out

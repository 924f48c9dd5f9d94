"""`LLM.get_metrics()`: the offline engine's cumulative counters in the shape vLLM's
`LLM.get_metrics()` returns (vllm.v1.metrics.reader: Counter, Vector, Gauge), under vLLM's
names, so a script written against vLLM's offline API (its speculative-decoding example reads
the spec_decode counters this way) runs here unchanged:

    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts": drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos = m.values

Counters since the LLM was made, over every generate() / chat() call: vllm:prompt_tokens
(each sample's: n samples of a prompt count it n times, as vLLM's child requests do),
vllm:generation_tokens, vllm:request_success{finished_reason}, and with a drafter
vllm:spec_decode_num_drafts (rounds that drafted), _num_draft_tokens, _num_accepted_tokens and
the Vector _num_accepted_tokens_per_pos ([k] = rounds that accepted more than k drafts; K
entries); gauges vllm:num_requests_running / _waiting (0 between calls: generate() runs to the
end). The HTTP server's /metrics has the same names (server/metrics_vllm.py). A grammar's forced
drafts are not drafts here, as there.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters by position (vLLM's type for vllm:spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class OfflineTotals:
    """What `LLM.get_metrics()` reports, summed over finished requests."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, prompt_tokens: int, output_tokens: int, finish_reason: str, stats) -> None:
        """One finished request (`stats`: its core.request stats: proposed, accepted,
        proposed_at, accepted_at)."""
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += output_tokens
        self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
        self.drafts += stats.proposed_at[0] if stats.proposed_at else 0
        self.draft_tokens += stats.proposed
        self.accepted_tokens += stats.accepted
        if len(stats.proposed_at) > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(stats.proposed_at) - len(self.accepted_per_pos)))
        for k, a in enumerate(stats.accepted_at):
            self.accepted_per_pos[k] += a

    def metrics(self, model_name: str, num_spec_tokens: int) -> list[Metric]:
        """vLLM's list; the spec_decode ones only with a drafter (K = num_spec_tokens > 0)."""
        labels = {"model_name": model_name, "engine": "0"}
        out: list[Metric] = [
            Gauge("vllm:num_requests_running", dict(labels), 0.0),
            Gauge("vllm:num_requests_waiting", dict(labels), 0.0),
            Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.generation_tokens),
        ]
        out += [Counter("vllm:request_success", {**labels, "finished_reason": r}, n)
                for r, n in sorted(self.finished.items())]
        if num_spec_tokens <= 0:
            return out
        per_pos = self.accepted_per_pos + [0] * max(0, num_spec_tokens - len(self.accepted_per_pos))
        out += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), self.drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), self.draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), self.accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), per_pos),
        ]
        return out

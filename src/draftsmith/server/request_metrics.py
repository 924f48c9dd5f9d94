"""Per-request metrics in a response's `metrics` object, as vLLM returns them with
`--enable-per-request-metrics` (timing) and `--per-request-spec-decode-metrics summary|detailed`
(`metrics.speculative_decoding`), so clients and benchmark tools that read vLLM's fields (AIPerf's
per-request acceptance, for one) read this server.

Timing (milliseconds; null where a time is missing, e.g. a request aborted before it ran):
    queue_time_ms            entered the engine -> given a KV row (scheduled)
    time_to_first_token_ms   scheduled -> its first output token committed
    generation_time_ms       first -> last output token committed
    mean_itl_ms              generation_time_ms / (tokens - 1); null under 2 tokens
    tokens_per_second        tokens / (scheduled -> last token)
With speculative decoding several tokens commit in one step and share its time.

speculative_decoding (null without a drafter), from the verification steps that had drafts:
    num_spec_steps, num_draft_tokens, num_accepted_draft_tokens (bonus tokens excluded),
    num_spec_tokens (K, the most drafts a step), mean_acceptance_length (1 + accepted / steps;
    1.0 without steps), draft_acceptance_rate (accepted / drafted; 0.0 without drafts),
    acceptance_histogram ([j] = steps that accepted exactly j drafts, K + 1 entries),
    acceptance_histogram_by_draft_length ({"k": its k + 1 buckets} per draft length seen: the
    prefix scheduler varies k), and with `detailed` per_step_drafted / per_step_accepted.
A grammar's forced drafts (core/grammar_drafts.py) are not the drafter's and are not counted.

The object describes one generation: it is null for a request of several choices (n > 1, or
several prompts). Streams carry it on the usage chunk (stream_options.include_usage); a
Response (/v1/responses) in its body, streamed in response.completed's.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.core.request import RequestStats

SPEC_DECODE_LEVELS = ("none", "summary", "detailed")


@dataclass(frozen=True)
class RequestMetricsOptions:
    timing: bool = False  # --enable-per-request-metrics
    spec_decode: str = "none"  # --per-request-spec-decode-metrics
    num_spec_tokens: int = 0  # K of the engine's policy; 0: no drafter

    def __post_init__(self) -> None:
        if self.spec_decode not in SPEC_DECODE_LEVELS:
            raise ValueError(f"spec_decode must be one of {SPEC_DECODE_LEVELS}, got {self.spec_decode!r}")

    @property
    def enabled(self) -> bool:
        return self.timing or self.spec_decode != "none"

    @property
    def keeps_steps(self) -> bool:
        """Whether requests count their steps (RequestStats.step_counts, and step_log for
        `detailed`): only where they are reported."""
        return self.spec_decode != "none" and self.num_spec_tokens > 0


def request_metrics(opts: RequestMetricsOptions, stats: RequestStats, tokens: int) -> dict:
    """The `metrics` object of one finished request (`tokens`: its output tokens)."""
    out: dict = {}
    if opts.timing:
        out.update(timing(stats, tokens))
    if opts.spec_decode != "none":
        detailed = stats.step_log if opts.spec_decode == "detailed" else None
        out["speculative_decoding"] = (spec_decoding(stats.step_counts or {}, opts.num_spec_tokens, detailed)
                                       if opts.keeps_steps else None)
    return out


def without_tokens(metrics: dict | None) -> dict | None:
    """`metrics` of a request whose output the client does not see (completions' echo with
    max_tokens 0): its timing as of zero tokens."""
    if metrics is None or "tokens_per_second" not in metrics:
        return metrics
    return {**metrics, "time_to_first_token_ms": None, "generation_time_ms": None, "mean_itl_ms": None,
            "tokens_per_second": None}


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000.0


def timing(stats: RequestStats, tokens: int) -> dict:
    """The timing fields of a request with `tokens` output tokens (0: all but the queue time are
    null, e.g. completions' echo with max_tokens 0, whose one engine token the client never sees)."""
    if tokens <= 0:
        return {"time_to_first_token_ms": None, "generation_time_ms": None,
                "queue_time_ms": _ms(stats.t_arrival, stats.t_scheduled), "mean_itl_ms": None,
                "tokens_per_second": None}
    first, last = stats.t_first_token, stats.t_last_token
    generation = _ms(first, last)
    run = _ms(stats.t_scheduled, last)
    return {
        "time_to_first_token_ms": _ms(stats.t_scheduled, first),
        "generation_time_ms": generation,
        "queue_time_ms": _ms(stats.t_arrival, stats.t_scheduled),
        "mean_itl_ms": generation / (tokens - 1) if generation is not None and tokens >= 2 else None,
        "tokens_per_second": tokens / (run / 1000.0) if run else None,
    }


def spec_decoding(counts: dict[tuple[int, int], int], k: int,
                  per_step: list[tuple[int, int]] | None = None) -> dict:
    """vLLM's metrics.speculative_decoding from the steps' {(drafted, accepted): count}, K = `k`;
    with `per_step` (each step's pair in order) the detailed arrays too."""
    steps = sum(counts.values())
    drafted = sum(p * c for (p, _), c in counts.items())
    accepted = sum(a * c for (_, a), c in counts.items())
    hist = [0] * (max([k] + [p for p, _ in counts]) + 1)
    by_length: dict[int, list[int]] = {}
    for (p, a), c in counts.items():
        hist[a] += c
        by_length.setdefault(p, [0] * (p + 1))[a] += c
    out = {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": hist,
        "acceptance_histogram_by_draft_length": {str(p): h for p, h in sorted(by_length.items())},
        "num_spec_steps": steps,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
    }
    if per_step is not None:
        out["per_step_accepted"] = [a for _, a in per_step]
        out["per_step_drafted"] = [p for p, _ in per_step]
    return out

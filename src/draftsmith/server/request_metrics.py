"""Per-request metrics in a response's `metrics` object, as vLLM returns them with
`--enable-per-request-metrics` (timing) and `--per-request-spec-decode-metrics summary|detailed`
(`metrics.speculative_decoding`), so clients and benchmark tools that read vLLM's fields (AIPerf's
per-request acceptance, for one) read this server.

Timing (milliseconds; null where a time is missing, e.g. a request aborted before it ran):
    queue_time_ms            entered the engine -> given a KV row (scheduled)
    time_to_first_token_ms   scheduled -> its first output token committed
    generation_time_ms       first -> last output token
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
        """Whether requests log their steps (RequestStats.step_log): only where they are reported."""
        return self.spec_decode != "none" and self.num_spec_tokens > 0


def request_metrics(opts: RequestMetricsOptions, stats: RequestStats, tokens: int) -> dict:
    """The `metrics` object of one finished request (`tokens`: its output tokens)."""
    out: dict = {}
    if opts.timing:
        out.update(timing(stats, tokens))
    if opts.spec_decode != "none":
        out["speculative_decoding"] = (spec_decoding(stats.step_log or [], opts.num_spec_tokens,
                                                     opts.spec_decode == "detailed")
                                       if opts.keeps_steps else None)
    return out


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (b - a) * 1000.0


def timing(stats: RequestStats, tokens: int) -> dict:
    first, last = stats.t_first_token, stats.t_finish if stats.t_first_token is not None else None
    generation = _ms(first, last)
    run = _ms(stats.t_scheduled, last)
    return {
        "time_to_first_token_ms": _ms(stats.t_scheduled, first),
        "generation_time_ms": generation,
        "queue_time_ms": _ms(stats.t_arrival, stats.t_scheduled),
        "mean_itl_ms": generation / (tokens - 1) if generation is not None and tokens >= 2 else None,
        "tokens_per_second": tokens / (run / 1000.0) if run else None,
    }


def spec_decoding(steps: list[tuple[int, int]], k: int, detailed: bool) -> dict:
    """vLLM's metrics.speculative_decoding of the steps' (drafted, accepted) pairs, K = `k`."""
    drafted = sum(p for p, _ in steps)
    accepted = sum(a for _, a in steps)
    width = max([k] + [p for p, _ in steps]) + 1
    hist = [0] * width
    by_length: dict[int, list[int]] = {}
    for p, a in steps:
        hist[a] += 1
        by_length.setdefault(p, [0] * (p + 1))[a] += 1
    out = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": hist,
        "acceptance_histogram_by_draft_length": {str(p): h for p, h in sorted(by_length.items())},
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": k,
    }
    if detailed:
        out["per_step_accepted"] = [a for _, a in steps]
        out["per_step_drafted"] = [p for p, _ in steps]
    return out

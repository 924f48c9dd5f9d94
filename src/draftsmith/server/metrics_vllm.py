"""/metrics under vLLM's names, beside Draftsmith's own: the families a vLLM dashboard, alert
or autoscaler reads (vLLM V1's Prometheus logger and its SpecDecodingProm), from the same
counters, with vLLM's labels `model_name` and `engine` ("0": one engine).

    vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc          gauges
    vllm:prompt_tokens_total, vllm:generation_tokens_total                   counters (prompt tokens
                                                                             when a request is given
                                                                             its KV row: n choices, n
                                                                             prompts, as vLLM's)
    vllm:request_success_total{finished_reason}                              stop / length / abort
    vllm:num_preemptions_total                                               always 0: Draftsmith
                                                                             never preempts a row
    vllm:prefix_cache_queries_total / _hits_total                            prompt tokens looked up
                                                                             (prefix caching on; not a
                                                                             request that asked for its
                                                                             prompt's logprobs) / found
    vllm:spec_decode_num_drafts_total                                        rounds that drafted
    vllm:spec_decode_num_draft_tokens_total / _num_accepted_tokens_total     draft tokens
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}             rounds that accepted
                                                                             more than `position`
                                                                             drafts (0-based; K series
                                                                             from the start)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds                                         histograms (Draftsmith's
                                                                             buckets; ITL one gap per
                                                                             delivery, as vLLM's, where
                                                                             draftsmith_'s splits it
                                                                             over its tokens)
The spec_decode families are left out without a drafter (K = 0), as vLLM leaves them out
without a speculative config.

vLLM's PromQL reads the same way: acceptance = rate(accepted) / rate(draft tokens), mean
acceptance length = 1 + rate(accepted) / rate(drafts). A grammar's forced drafts
(core/grammar_drafts.py) are not drafts here, as in the draftsmith_draft_* counters; a round
whose drafts the grammar refused all of is no drafting round here (vLLM counts it, with 0
drafts). KV usage is rows in use / rows (Draftsmith's KV cache is one row per running request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftsmith.server.metrics import ServerMetrics


def vllm_lines(m: ServerMetrics) -> list[str]:
    """vLLM-named exposition lines of `m` (the caller holds m.lock)."""
    from draftsmith.server.metrics import escape_label, family_lines, histogram_lines

    labels = f'model_name="{escape_label(m.model)}",engine="0"'
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend(family_lines(name, kind, help_, [(f"{{{labels}{extra}}}", v) for extra, v in samples]))

    one = lambda v: [("", v)]  # noqa: E731
    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", one(m.running))
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", one(m.waiting))
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           one(m.kv_rows_in_use / m.kv_rows_total if m.kv_rows_total else 0.0))
    family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           one(m.scheduled_prompt_tokens))
    family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           one(m.generation_tokens))
    reasons = {"stop": 0, "length": 0, "abort": 0, **m.finished}
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           [(f',finished_reason="{escape_label(r)}"', v) for r, v in sorted(reasons.items())])
    family("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", one(0))
    family("vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.", one(m.prefix_queries))
    family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           one(m.prefix_hits))
    if m.num_spec_tokens > 0:
        drafts = m.pos_proposed[0] if m.pos_proposed else 0
        family("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", one(drafts))
        family("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", one(m.proposed))
        family("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
               one(m.accepted))
        family("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
               "Accepted tokens per draft position.",
               [(f',position="{k}"', m.pos_accepted[k] if k < len(m.pos_accepted) else 0)
                for k in range(max(m.num_spec_tokens, len(m.pos_proposed)))])
    for name, help_, h in (("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft),
                           ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                            m.itl_step),
                           ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                            m.e2e)):
        lines.extend(histogram_lines(name, help_, h, labels))
    return lines


"""Decide: `draftsmith bench`, the speedup / latency / cost report across concurrency tiers.

    from draftsmith.bench import BenchConfig, run_bench
    report_json = run_bench(BenchConfig(target="smollm2-135m", drafters=("ngram",), concurrency=(1, 4, 16)))

Modules: config (BenchConfig), workload (prompt sets), loadgen (closed loop / Poisson,
in-process engine or OpenAI-compatible endpoint), metrics, peers (HF transformers), verdict,
machine (machine facts), inprocess / endpoint (the backends), phases, tier + tier_lines (one
tier's run and results lines), results (setup.json / results.jsonl), report + report_markdown
+ report_plots (report.json / report.md / PNGs), runner (run_bench: interleaving, streaming, resume).

This package only re-exports; no module under it imports the package itself.
"""

from draftsmith.bench.config import Arrival, BenchConfig, EndpointSpec, parse_arrival, parse_concurrency, parse_endpoint
from draftsmith.bench.report_markdown import report_headline as headline_table  # (report.json path) -> markdown
from draftsmith.bench.runner import run_bench

__all__ = ["Arrival", "BenchConfig", "EndpointSpec", "headline_table", "parse_arrival", "parse_concurrency",
           "parse_endpoint", "run_bench"]

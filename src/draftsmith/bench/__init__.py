"""Decide: `draftsmith bench`, the speedup / latency / cost report across concurrency tiers.

    from draftsmith.bench import BenchConfig, run_bench
    report_json = run_bench(BenchConfig(target="smollm2-135m", drafters=("ngram",), concurrency=(1, 4, 16)))

Modules: config (BenchConfig), workload (prompt sets), loadgen (closed loop / Poisson,
in-process engine or OpenAI-compatible endpoint), metrics, peers (HF transformers), verdict,
report (report.json / report.md / PNGs), runner (run_bench: interleaving, streaming, resume).
"""

from draftsmith.bench.config import Arrival, BenchConfig, EndpointSpec, parse_arrival, parse_concurrency, parse_endpoint

__all__ = ["Arrival", "BenchConfig", "EndpointSpec", "headline_table", "parse_arrival", "parse_concurrency",
           "parse_endpoint", "run_bench"]


def run_bench(config: BenchConfig, log=None):
    """Run (or --resume) a bench; returns the path of report.json (report.md and PNGs beside it)."""
    from draftsmith.bench.runner import run_bench as _run

    return _run(config, log=log)


def headline_table(report_json) -> str:
    """The markdown headline (bullets + per-tier table) of a written report.json."""
    import json
    from pathlib import Path

    from draftsmith.bench.report import headline_table as _table

    rep = json.loads(Path(report_json).read_text())
    return "\n".join(f"- {h}" for h in rep["headline"]) + "\n\n" + _table(rep)

"""`draftsmith bench` (Decide): speedup / latency / cost across concurrency tiers, go/no-go per tier."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.cli.options import (
    add_drafter_dtype, add_job, add_max_tokens, add_progress, add_target_args, int_in, json_text_or_file, opt_auto,
    policy_arg, policy_help, positive_int,
)
from draftsmith.drafters import registry
from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS
from draftsmith.errors import DraftsmithError

HELP = "speedup / latency / cost report across concurrency tiers, go/no-go per tier"
EXAMPLE = "draftsmith bench --drafter ngram --drafter dspark:runs/smollm2-135m-dspark --concurrency 1,4,16 --peers hf"


def add_parser(sub) -> None:
    b = add_job(sub, "bench", HELP, EXAMPLE)
    add_target_args(b)
    b.add_argument("--drafter", action="append", default=[],
                   help=f"{registry.usage()}; repeatable. The no-speculation baseline (none) is always measured")
    add_drafter_dtype(b)
    b.add_argument("--workload", default="humaneval",
                   help="humaneval | mtbench | sharegpt | code | chat | a .jsonl/.parquet prompt file")
    b.add_argument("--split", default=None, choices=["heldout", "train", "all"],
                   help="prompt split (default: heldout for built-in sources, all for a file)")
    b.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated tiers, e.g. 1,4,16")
    b.add_argument("--requests", type=positive_int, default=16, help="measured requests per tier and configuration")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against the baseline)")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    add_max_tokens(b, 64, "new tokens per request", dest="max_tokens")
    b.add_argument("--arrival", default="closed", help="closed (a user per concurrency slot) or poisson:RATE (req/s)")
    b.add_argument("--warmup", type=int, default=2, help="unmeasured requests per configuration at each tier's start")
    b.add_argument("--repeats", type=positive_int, default=1, help="interleaved repetitions per tier")
    b.add_argument("--turns", type=positive_int, default=1,
                   help="user turns per request: each request is a conversation of up to this many turns, each "
                        "sent when the previous answer ends, the answers so far in its prompt (time to first token "
                        "reported per turn)")
    b.add_argument("--enable-prefix-caching", action="store_true",
                   help="in-process engines reuse the KV of a prompt prefix a free row still holds (a conversation's "
                        "next turn); every configuration starts each run with nothing cached")
    b.add_argument("--control", action="store_true",
                   help="also measure plain decoding a second time as a configuration (an A/A control): its ratio "
                        "to the baseline is this run's noise, reported next to the speedups")
    b.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="every answer keeps to this JSON schema (structured outputs in-process, response_format "
                        "json_schema with --endpoint): measure traffic such as tool calls and extraction")
    b.add_argument("--seed", type=int, default=0, help="prompt-selection and sampling seed")
    b.add_argument("--num-speculative-tokens", "-k", type=int_in(1, MAX_SPECULATIVE_TOKENS), default=None,
                   help="draft length K (default: the checkpoint's block size, else 5)")
    b.add_argument("--policy", default="auto", type=policy_arg, metavar="POLICY[:KEY=VALUE,...]",
                   help=policy_help())
    b.add_argument("--endpoint", action="append", default=[], metavar="[LABEL=]URL",
                   help="benchmark an OpenAI-compatible server instead (repeatable; label `none` = the baseline)")
    b.add_argument("--endpoint-model", default=None, help="model name to send (default: the server's first)")
    b.add_argument("--request-timeout", type=float, default=600.0, help="--endpoint: seconds per request")
    b.add_argument("--peers", default=None, metavar="hf,llamacpp",
                   help="also run HF transformers and/or llama.cpp (llama-cpp-python, an optional extra) at batch 1 "
                        "on the same prompts, comma-separated (default: off)")
    b.add_argument("--peer-assistant", default=None, metavar="PATH",
                   help="--peers hf: a draft model for HF assisted generation (assistant_model)")
    b.add_argument("--peer-lookup-tokens", type=positive_int, default=10, help="--peers: the peers' prompt-lookup draft length (HF prompt_lookup_num_tokens, llama.cpp "
                        "num_pred_tokens)")
    b.add_argument("--peer-gguf", default=None, metavar="FILE",
                   help="--peers llamacpp: the GGUF to run (default: a built-in target's GGUF rewritten at the engine "
                        "dtype, the same weights)")
    b.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="service-level objectives, e.g. --goodput ttft:500 tpot:50 (ms; metrics ttft, tpot, e2el as "
                        "in vLLM): the report adds each configuration's goodput, the requests per second that met "
                        "all of them, and its ratio to the baseline's")
    b.add_argument("--dollars-per-hour", type=float, default=None,
                   help="machine price, for cost per 1M output tokens (default: unset: no cost figures)")
    b.add_argument("--mem-bandwidth-gbs", type=float, default=None,
                   help="memory bandwidth for the physical-limit column (default: measured after the run)")
    b.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="skip longer prompts (default: what fits the context with --max-tokens)")
    b.add_argument("--out", type=Path, default=Path("runs/bench"), help="report.json, report.md, PNGs, results.jsonl")
    b.add_argument("--resume", action="store_true",
                   help="keep finished tiers in --out and run the rest (same measured work, machine and --threads)")
    b.add_argument("--overwrite", action="store_true", help="discard earlier results in --out")
    add_progress(b)
    b.add_argument("--no-table", action="store_true",
                   help="do not print the headline table at the end (the report files have it)")
    b.add_argument("--json", action="store_true", help="print report.json to stdout")
    b.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from draftsmith.bench import BenchConfig, headline_table, run_bench
    from draftsmith.bench.config import parse_arrival, parse_concurrency, parse_endpoint, parse_goodput

    cfg = BenchConfig(
        target=args.target, drafters=tuple(args.drafter), workload=args.workload, split=args.split,
        concurrency=parse_concurrency(args.concurrency), requests=args.requests, temperature=args.temperature,
        top_p=args.top_p, max_tokens=args.max_tokens, arrival=parse_arrival(args.arrival), warmup=args.warmup,
        repeats=args.repeats, seed=args.seed, num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, endpoints=tuple(parse_endpoint(e, i) for i, e in enumerate(args.endpoint)),
        endpoint_model=args.endpoint_model, request_timeout=args.request_timeout,
        peers=tuple(p.strip() for p in args.peers.split(',') if p.strip()) if args.peers else (), peer_assistant=args.peer_assistant,
        peer_lookup_tokens=args.peer_lookup_tokens, peer_gguf=args.peer_gguf, dollars_per_hour=args.dollars_per_hour,
        mem_bandwidth_gbs=args.mem_bandwidth_gbs, max_prompt_tokens=args.max_prompt_tokens, out=args.out,
        resume=args.resume, overwrite=args.overwrite, device=opt_auto(args.device), dtype=opt_auto(args.dtype),
        drafter_dtype=args.drafter_dtype, control=args.control, progress=args.progress, turns=args.turns,
        enable_prefix_caching=args.enable_prefix_caching,
        json_schema=json_text_or_file(args.json_schema, "--json-schema") if args.json_schema is not None else None,
        goodput=parse_goodput(args.goodput) if args.goodput is not None else (),
    )
    path = run_bench(cfg)
    if args.json:
        print(path.read_text())
    if not args.no_table:
        print(headline_table(path), file=sys.stderr)
    print(f"bench: report -> {path}, {path.with_name('report.md')}", file=sys.stderr)
    failed, total, first = _failures(path)
    if failed == total > 0:  # (exit 0 here let a script take a report of nothing for a result)
        raise DraftsmithError(f"every request failed ({total}); the first: {first} (all in {path})")
    if failed:
        print(f"bench: {failed} of {total} requests failed; the first: {first}", file=sys.stderr)
    return 0


def _failures(report: Path) -> tuple[int, int, str | None]:
    """(failed, all, the first failure's reason) over the measured requests of the report's tiers."""
    rows = [r for t in json.loads(report.read_text())["tiers"] for r in t["results"]]
    reasons = [x["error"] for r in rows for x in r["per_request"] if x.get("error") is not None]
    return len(reasons), sum(len(r["per_request"]) for r in rows), reasons[0] if reasons else None

"""A drafter in two precisions side by side at batch 1 (`--drafter-dtype`, drafters/precision.py).

    .venv/bin/python benchmarks/ab_drafter_dtype.py [--drafter dspark:smollm2-135m]
        [--dtypes float32,auto] [--workloads humaneval,mtbench] [--prompts 8] [--tokens 128]
        [--passes 3] [--out benchmarks/results/ab_drafter_dtype<cpu kind>.json] [--no-md]

One float32 target and one process; per workload an engine for plain decoding and one for the
drafter in each dtype, sharing one KV cache; the same held-out prompts, greedy; the engines take
turns, the order reversed every other pass. Per pass and configuration: ms per output token,
ms per round, the target forward, drafting and the rest of a round (the drafter's context
upkeep is in the rest), τ, and whether the outputs equal plain decoding's. Prefill steps are
left out. Ratios (plain ms/token ÷ the configuration's) are taken within a pass, then the
median over passes (docs/MEASURING.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import sections  # noqa: E402
from bench_runtime import cpu_model  # noqa: E402
from round_breakdown import run  # noqa: E402

from draftsmith.bench.workload import load_workload  # noqa: E402
from draftsmith.core.sampling import SamplingParams  # noqa: E402
from draftsmith.engine.builder import build_engine  # noqa: E402
from draftsmith.models.prompts import encode_chat  # noqa: E402
from draftsmith.models.target import load_target  # noqa: E402
from draftsmith.policy.fixed import FixedK  # noqa: E402


def outputs(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy outputs, one request at a time (batch 1, as measured)."""
    out = []
    for p in prompts:
        req = engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        out.append(list(req.output_ids))
    return out


def drafter_dtype_of(engine) -> str | None:
    """The dtype of the drafter's weights (a block drafter's backbone, else its model)."""
    d = engine.drafter
    for obj in (getattr(d, "backbone", None), getattr(getattr(d, "model", None), "backbone", None),
                getattr(d, "model", None)):
        params = list(obj.parameters()) if hasattr(obj, "parameters") else []
        if params:
            return str(params[0].dtype).removeprefix("torch.")
    return None


def measure(target, workload: str, args) -> dict:
    wl = load_workload(workload, None, args.prompts, max_prompt_tokens=1024,
                       tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
    prompts = [list(p.token_ids) for p in wl.prompts]
    engines = {"plain": build_engine(target, "none", FixedK(0), 0, 1, 2048)}
    for dt in args.dtypes:
        engines[dt] = build_engine(target, args.drafter, "auto", args.k, 1, 2048, cache=engines["plain"].cache,
                                   drafter_dtype=dt)
    passes = []
    for p in range(args.passes):
        order = list(engines) if p % 2 == 0 else list(reversed(engines))
        row = {}
        for name in order:
            r = run(engines[name], prompts, args.tokens)
            n_tok, n = sum(1 + x[4] for x in r), len(r)
            wall = sum(x[0] for x in r)
            row[name] = {"ms_per_token": 1000 * wall / n_tok, "ms_per_round": 1000 * wall / n,
                         "target_ms": 1000 * sum(x[1] for x in r) / n, "drafting_ms": 1000 * sum(x[2] for x in r) / n,
                         "rest_ms": 1000 * sum(x[0] - x[1] - x[2] for x in r) / n, "tau": n_tok / n, "rounds": n}
            print(f"{workload} pass {p + 1} {name:9s} {row[name]['ms_per_token']:5.1f} ms/token "
                  f"{row[name]['ms_per_round']:5.1f} ms/round drafting {row[name]['drafting_ms']:4.1f} "
                  f"rest {row[name]['rest_ms']:4.1f} tau {row[name]['tau']:.2f}", flush=True)
        passes.append(row)
    ref = outputs(engines["plain"], prompts, args.tokens)
    same = {dt: outputs(engines[dt], prompts, args.tokens) == ref for dt in args.dtypes}
    summary = {}
    for name in engines:
        med = lambda key: statistics.median(pr[name][key] for pr in passes)  # noqa: E731
        summary[name] = {
            "dtype": drafter_dtype_of(engines[name]) if name != "plain" else None,
            "x_plain": statistics.median(pr["plain"]["ms_per_token"] / pr[name]["ms_per_token"] for pr in passes),
            "ms_per_token": med("ms_per_token"), "ms_per_round": med("ms_per_round"), "drafting_ms": med("drafting_ms"),
            "rest_ms": med("rest_ms"), "tau": med("tau"), "same_as_plain": same.get(name),
        }
    return {"prompts": [p.id for p in wl.prompts], "passes": passes, "summary": summary}


def markdown(res: dict, kind: str) -> str:
    a = res["args"]
    lines = [f"## Drafter precision: `{a['drafter']}` in {' vs '.join(a['dtypes'])} beside a float32 target "
             f"(`--drafter-dtype`){kind}", "",
             f"`benchmarks/ab_drafter_dtype.py --drafter {a['drafter']} --dtypes {','.join(a['dtypes'])} --workloads "
             f"{','.join(a['workloads'])} --prompts {a['prompts']} --tokens {a['tokens']} --passes {a['passes']}` on "
             f"{res['date']} (JSON: `benchmarks/results/{res['json']}`). {res['cpu']}, {res['threads']} torch threads, "
             "float32 target smollm2-135m, batch 1, greedy, held-out prompts, the prefix scheduler (the default "
             "policy). One process: plain decoding and the drafter in each dtype share one KV cache and take turns, "
             "the order reversed every other pass; prefill steps excluded. × plain = the median over passes of plain "
             "ms/token ÷ the configuration's in the same pass; the other columns are medians over passes. Drafting = "
             "the drafter's propose; rest = the round outside the target forward and drafting (the drafter's "
             f"context upkeep is there). Load average {res['load'][0]:.2f} at the start, {res['load'][1]:.2f} at the "
             "end.",
             "", "| workload | configuration | drafter dtype | × plain | ms/token | ms/round | drafting ms | rest ms | τ "
             "| outputs = plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for wl, r in res["workloads"].items():
        for name, s in r["summary"].items():
            label = name if name == "plain" else f"{a['drafter']} ({name})"
            lines.append(f"| {wl} | {label} | {s['dtype'] or '–'} "
                         f"| {s['x_plain']:.2f} | {s['ms_per_token']:.1f} | {s['ms_per_round']:.1f} | "
                         f"{s['drafting_ms']:.1f} | {s['rest_ms']:.1f} | {s['tau']:.2f} | "
                         f"{'–' if s['same_as_plain'] is None else ('yes' if s['same_as_plain'] else 'NO')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--dtypes", default="float32,auto")
    ap.add_argument("--workloads", default="humaneval,mtbench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--k", type=int, default=7, help="at most K drafts a round")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    tag, kind = sections.cpu_kind()
    args.out = args.out or Path(__file__).parent / "results" / f"ab_drafter_dtype{tag}.json"
    load0 = os.getloadavg()[0]
    target = load_target("smollm2-135m")
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu_model()} ({os.cpu_count()} CPUs)",
           "threads": torch.get_num_threads(), "json": args.out.name,
           "args": {"drafter": args.drafter, "dtypes": args.dtypes, "workloads": args.workloads.split(","),
                    "prompts": args.prompts, "tokens": args.tokens, "passes": args.passes, "k": args.k},
           "workloads": {}}
    for wl in res["args"]["workloads"]:
        res["workloads"][wl] = measure(target, wl, args)
    res["load"] = [load0, os.getloadavg()[0]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res, kind)
    print(md)
    if not args.no_md:
        sections.write_section(f"<!-- ab_drafter_dtype{tag}:begin -->", f"<!-- ab_drafter_dtype{tag}:end -->", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Forced drafts on a busy batch: does drafting what the grammar forces ever slow a batch down?
(issues 11, 12)

    .venv/bin/python benchmarks/bench_forced_batch.py [--batches 1,8,32] [--max-tokens 96] [--no-write]

The forward is padded to its widest row, so one row's forced run widens every row's forward:
the engine verifies only as many forced drafts as pay for that (core/grammar_drafts.py: the prefix
scheduler's `forced_lengths` from its step times; without a cost model, plain decoding's,
`fit_forced`: as if a forward cost time in proportion to its tokens). Per batch size B: B held-out
MT-Bench questions (cycled where there are fewer) asked for bench_structured.py's six-field JSON
record, chat template, greedy, float32, torch threads pinned (no thread governor), one `chat` call
of B requests (all admitted at once), with forced drafts off and on, for plain decoding and for
n-gram under the default policy, in a rotating order, `--repeats` times (the fastest counts).
Reports output tokens per second, the speedup of forced drafts on over off (same tokens: outputs
must be equal) and the forced drafts accepted / proposed. Writes benchmarks/results/bench_forced_batch-KIND.json and its BENCHMARKS.md section.
Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import sections
from bench_structured import RECORD, SCHEMAS, prompts

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

from draftsmith import LLM, SamplingParams, StructuredOutputsParams
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    target = load_target("smollm2-135m", dtype="float32")
    B_max = max(batches)
    threads = torch.get_num_threads()
    configs = {(d, f): LLM(target, drafter=d, forced_drafts=f, max_batch=B_max, max_len=1024, threads=threads)
               for d in ("none", "ngram") for f in (0, 16)}
    ask = SCHEMAS["record"][1]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                        structured_outputs=StructuredOutputsParams(json=RECORD))
    questions = [text for _, text in prompts(40)]
    for llm in configs.values():  # first-call costs, the grammar's compilation, the scheduler's profile
        llm.chat([[{"role": "user", "content": questions[0] + ask}]], sp, use_tqdm=False)
    t_start, load0 = time.time(), os.getloadavg()[0]
    rows = []
    for i, B in enumerate(batches):
        convs = [[{"role": "user", "content": questions[j % len(questions)] + ask}] for j in range(B)]
        runs: dict = {}
        order = list(configs)
        for rep in range(a.repeats):
            for key in order[(i + rep) % len(order):] + order[: (i + rep) % len(order)]:
                llm = configs[key]
                t0 = time.perf_counter()
                outs = llm.chat(convs, sp, use_tqdm=False)
                wall = time.perf_counter() - t0
                st = llm.last_stats
                if key not in runs or wall < runs[key]["wall_s"]:
                    runs[key] = {"wall_s": wall, "tokens": st.output_tokens, "ids": [o.token_ids for o in outs],
                                 "forced": (st.forced_accepted, st.forced_proposed), "tau": st.tau}
        for d in ("none", "ngram"):
            off, on = runs[(d, 0)], runs[(d, 16)]
            rows.append({"batch": B, "drafter": d, "off_s": off["wall_s"], "on_s": on["wall_s"],
                         "off_tok_s": off["tokens"] / off["wall_s"], "on_tok_s": on["tokens"] / on["wall_s"],
                         "speedup": off["wall_s"] / on["wall_s"], "outputs_equal": on["ids"] == off["ids"],
                         "forced_accepted": on["forced"][0], "forced_proposed": on["forced"][1],
                         "tau_off": off["tau"], "tau_on": on["tau"]})
            print(json.dumps(rows[-1]), flush=True)
    result = {"batches": batches, "max_tokens": a.max_tokens, "torch_threads": threads, "repeats": a.repeats,
              "load_average": [load0, os.getloadavg()[0]], "wall_s": round(time.time() - t_start), "rows": rows}
    tag, title = sections.cpu_kind()
    key = f"bench_forced_batch{tag}"
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    if a.no_write:
        return
    lines = [f"## Forced drafts on a busy batch (issues 11, 12){title}", "",
             f"`benchmarks/bench_forced_batch.py` (JSON: `benchmarks/results/{key}.json`): per batch size B, B "
             f"held-out MT-Bench questions asked for a six-field JSON record (bench_structured.py's *record*), one "
             f"`chat` call of B requests, greedy, float32, {a.max_tokens} new tokens at most, forced drafts off "
             f"and on (at most 16), plain decoding (no cost model: `fit_forced`, as if a forward cost time in "
             f"proportion to its tokens) and n-gram under the default policy (the prefix scheduler's "
             f"`forced_lengths`), {threads} torch threads pinned, in a rotating order, {a.repeats} repeats (the "
             f"fastest counts). Load average {result['load_average'][0]:.2f} at the start, {result['load_average'][1]:.2f} "
             f"at the end; {result['wall_s']} s in all.", "",
             "| B | drafter | tok/s, forced off | tok/s, forced on | speedup (on / off) | τ off → on "
             "| forced drafts accepted | outputs equal |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['drafter']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | "
                     f"{r['speedup']:.2f} | {r['tau_off']:.2f} → {r['tau_on']:.2f} | "
                     f"{r['forced_accepted']}/{r['forced_proposed']} | {'yes' if r['outputs_equal'] else 'NO'} |")
    sections.write_section(f"<!-- {key}:begin -->", f"<!-- {key}:end -->", "\n".join(lines))


if __name__ == "__main__":
    main()

"""Draft-length policies side by side under concurrency, in lockstep: every engine takes one step in turn.

    .venv/bin/python benchmarks/ab_lockstep.py [--drafter dspark:smollm2-135m] [--k 7]
        [--policies 'prefix-scheduler:choose_plan=best-prefix;prefix-scheduler:choose_plan=columns']
        [--workload humaneval] [--concurrency 16] [--prompts 32] [--tokens 64] [--rounds 2]
        [--warm 1,4] [--warm-workload mtbench]
        [--section NAME] [--out benchmarks/results/ab_lockstep.json] [--no-md]

One process, the default target (float32), plain decoding and the drafter under each policy, each
engine with its own KV cache. A round runs every engine over the same held-out prompts, closed
loop: --concurrency requests in flight, a finished one replaced by the next prompt at once, greedy,
--tokens new tokens each. The engines advance in lockstep, one step each in turn (the order
rotating every step), so the steps compared are milliseconds apart: this VM's speed drifts from
one minute to the next (stop 57: plain decoding's median step 27.4 and 31.1 ms in two passes
minutes apart, benchmarks/results/ab_step_split-mtbench-avx2-zen3.txt), which moves a ratio of
two passes run one after the other by more than the effects measured here (ab_policy.py's
--interleave prompt does the same at batch 1 a prompt at a time). Each engine's time is the sum
of its own steps, prefills included; its ratio to plain's is the tokens/s ratio (the same tokens:
greedy outputs equal plain's, checked). The measured prompts are distinct (the held-out split has
~34 HumanEval prompts: more is refused rather than cycled). --warm C1,C2,...: before the rounds,
each engine serves --warm-workload's held-out prompts at those concurrencies (8 at the first, 16
at the others), as a server that met lighter load first (bench_builtin's tiers run 1, 4, 16, 32
in one server).

Reported per policy: the ratio per round and its median, steps that drafted and steps that verified
a draft (per round), drafts accepted, and whether every output equals plain's. The JSON goes to
--out and the table to its own section of BENCHMARKS.md (per CPU kind) unless --no-md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import sections
import torch
from ab_policy import shown

from draftsmith.bench.workload import load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.profile import cpu_model

WARM_PROMPTS = 16


class Loop:
    """One engine's closed loop over a list of prompts: keeps `concurrency` requests in flight."""

    def __init__(self, engine, prompts: list[list[int]], concurrency: int, tokens: int) -> None:
        self.engine, self.queue, self.concurrency, self.tokens = engine, list(prompts), concurrency, tokens
        self.requests: list = []
        self.seconds, self.steps, self.drafted, self.verified, self.accepted = 0.0, 0, 0, 0, 0

    def busy(self) -> bool:
        return bool(self.queue) or self.engine.has_unfinished()

    def step(self) -> None:
        e = self.engine
        while self.queue and e.num_running + e.num_waiting < self.concurrency:
            self.requests.append(e.add_request(self.queue.pop(0), SamplingParams(max_tokens=self.tokens,
                                                                                 temperature=0.0)))
        t0 = time.perf_counter()
        e.step()
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        info = e.last_step
        self.drafted += bool(info.drafted)
        self.verified += info.block_len > 1
        self.accepted += info.accepted or 0

    def outputs(self) -> list[list[int]]:
        return [list(r.output_ids) for r in self.requests]


def lockstep(loops: dict[str, Loop]) -> None:
    """Step every busy loop once, in an order that rotates every tick, until all are done."""
    names, tick = list(loops), 0
    while any(lp.busy() for lp in loops.values()):
        k = tick % len(names)
        for n in names[k:] + names[:k]:
            if loops[n].busy():
                loops[n].step()
        tick += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--k", type=int, default=7, help="drafts per round asked of the drafter")
    ap.add_argument("--policies", default="prefix-scheduler:choose_plan=best-prefix;prefix-scheduler:choose_plan=columns",
                    help="comma-separated policy specs (a spec's own options are separated by ',' too: "
                         "separate specs with ';' when any has options after the first)")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", default="1,4", help="concurrencies served before the rounds ('' for none)")
    ap.add_argument("--warm-workload", default="mtbench", help="the prompts served at --warm (not measured)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--section", default="", help="results and BENCHMARKS.md section under this name")
    ap.add_argument("--no-md", action="store_true", help="leave BENCHMARKS.md alone")
    args = ap.parse_args()
    specs = split_specs(args.policies)
    warm = [int(c) for c in args.warm.split(",") if c.strip()]
    if args.concurrency < 1 or args.prompts < 1 or args.tokens < 1 or args.rounds < 1 or any(c < 1 for c in warm):
        raise SystemExit("--concurrency, --prompts, --tokens, --rounds and --warm's concurrencies must be >= 1")
    tag, kind = sections.cpu_kind()
    name = f"ab_lockstep-{args.section}" if args.section else "ab_lockstep"
    args.out = args.out or Path(__file__).parent / "results" / f"{name}{tag}.json"
    target = load_target("smollm2-135m")

    def tokenize(m):
        return encode_chat(target.tokenizer, list(m), target.target_id)

    w = load_workload(args.workload, None, args.prompts, max_prompt_tokens=1024, tokenize=tokenize)
    if w.reused:
        raise SystemExit(f"--prompts {args.prompts}: {args.workload}'s held-out split has only "
                         f"{len(w.prompts) - w.reused} prompts that fit; ask for at most that many")
    prompts = [list(p.token_ids) for p in w.prompts]
    warm_prompts = [list(p.token_ids) for p in load_workload(args.warm_workload, None, WARM_PROMPTS,
                                                             max_prompt_tokens=1024, tokenize=tokenize).prompts]
    allp = prompts + warm_prompts
    rows = max([args.concurrency] + warm)
    max_len = max(len(p) for p in allp) + args.tokens + args.k + 2
    engines = {"plain": build_engine(target, "none", FixedK(0), 0, rows, max_len)}
    for i, spec in enumerate(specs):
        engines[f"policy{i}"] = build_engine(target, args.drafter, spec, args.k, rows, max_len)
    for c in warm:  # each engine alone: what it learns there is its own
        for n, e in engines.items():
            lockstep({n: Loop(e, warm_prompts[: 8 if c == warm[0] else WARM_PROMPTS], c, args.tokens)})
    result = {"setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "specs": specs,
                        "out": shown(args.out), "machine": cpu_model(), "cpu_kind": kind.lstrip(", "),
                        "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                        "prompts_used": len(prompts), "loadavg_start": os.getloadavg()},
              "rounds": []}
    for r in range(args.rounds):
        loops = {n: Loop(e, prompts, args.concurrency, args.tokens) for n, e in engines.items()}
        lockstep(loops)
        plain = loops["plain"]
        row = {n: {"seconds": lp.seconds, "x_plain": plain.seconds / lp.seconds, "steps": lp.steps,
                   "drafted": lp.drafted, "verified": lp.verified, "accepted": lp.accepted,
                   "equal_to_plain": lp.outputs() == plain.outputs()} for n, lp in loops.items()}
        result["rounds"].append(row)
        print(f"round {r}: " + "; ".join(f"{n} {x['seconds']:.1f} s {x['x_plain']:.3f}x (verified {x['verified']}/"
                                         f"{x['steps']}, = plain {x['equal_to_plain']})" for n, x in row.items()),
              flush=True)
    result["setup"]["loadavg_end"] = os.getloadavg()
    result["summary"] = {n: {"spec": spec, "x_plain_median": statistics.median(rr[n]["x_plain"] for rr in result["rounds"]),
                             "equal_to_plain": all(rr[n]["equal_to_plain"] for rr in result["rounds"])}
                         for n, spec in [("plain", "none")] + [(f"policy{i}", s) for i, s in enumerate(specs)]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    for n, s in result["summary"].items():
        print(f"{n} {s['spec']}: median {s['x_plain_median']:.3f}x plain, outputs = plain {s['equal_to_plain']}")
    if not args.no_md:
        marker = f"{name}{tag.replace('-', ':')}"
        sections.write_section(f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", markdown(result, kind))


def split_specs(text: str) -> list[str]:
    """Policy specs from --policies: ';'-separated when given so, else ','-separated (each a bare
    name or name:options with no ',' inside)."""
    parts = text.split(";") if ";" in text else text.split(",")
    specs = [p.strip() for p in parts if p.strip()]
    if not specs:
        raise SystemExit("--policies: give at least one policy spec")
    return specs


def markdown(res: dict, kind: str) -> str:
    s = res["setup"]
    lines = [f"## Policies under concurrency {s['concurrency']}, in lockstep (issue 12){kind}", "",
             f"`benchmarks/ab_lockstep.py --drafter {s['drafter']} --k {s['k']} --policies '{';'.join(s['specs'])}' "
             f"--workload {s['workload']} --concurrency {s['concurrency']} --prompts {s['prompts']} --tokens {s['tokens']} "
             f"--rounds {s['rounds']} --warm '{s['warm']}' --warm-workload {s.get('warm_workload', s['workload'])}{' --section ' + s['section'] if s['section'] else ''}` on "
             f"{s['date']} (JSON: `{s['out']}`). {s['machine']}, {s['cpus']} CPUs, {s['threads']} torch threads, "
             f"float32 target smollm2-135m, held-out prompts, greedy. One process; plain decoding and the drafter under "
             f"each policy have their own KV cache and serve the same prompts closed loop ({s['concurrency']} in "
             "flight), one step each in turn, so that the steps compared are milliseconds apart. Time: the sum of an "
             "engine's steps, prefills included; × plain = plain's time / the policy's (> 1: faster). Before the "
             + (f"rounds each engine served held-out {s.get('warm_workload', s['workload'])} prompts at concurrency "
                f"{s['warm']} (8 at the first, {WARM_PROMPTS} at each other). " if s['warm'] else "rounds: no warm-up. ")
             + f"Load average {s['loadavg_start'][0]:.2f} at the start, {s['loadavg_end'][0]:.2f} at the end.", "",
             "| policy | × plain (median) | × plain per round | s per round | steps that drafted / verified a draft / "
             "all (per round) | drafts accepted | outputs = plain |", "|---|---|---|---|---|---|---|"]

    def each(xs, fmt) -> str:
        return " / ".join(fmt(x) for x in xs)

    for n, summ in res["summary"].items():
        if n == "plain":
            continue
        rr = [x[n] for x in res["rounds"]]
        lines.append(f"| `{summ['spec']}` | **{summ['x_plain_median']:.3f}** | "
                     f"{each(rr, lambda x: format(x['x_plain'], '.3f'))} | {each(rr, lambda x: format(x['seconds'], '.1f'))} | "
                     f"{' ; '.join(str(x['drafted']) + ' / ' + str(x['verified']) + ' / ' + str(x['steps']) for x in rr)} | "
                     f"{each(rr, lambda x: str(x['accepted']))} | {'yes' if summ['equal_to_plain'] else '**no**'} |")
    lines.append(f"| plain | 1 | – | {each(res['rounds'], lambda x: format(x['plain']['seconds'], '.1f'))} | – | – | – |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

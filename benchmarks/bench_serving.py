"""Serving throughput and latency vs concurrency: plain vs fixed K vs the prefix scheduler.

    .venv/bin/python benchmarks/bench_serving.py [--tiers 1,2,4,8,16,32] [--max-tokens 48]
        [--k 5] [--reps 2] [--threads 1] [--budget-s 840] [--out benchmarks/results/bench_serving.json]

In-process engine on the default target (smollm2-135m, fp32), greedy, chat-templated first
user turns of HumanEval and MT-Bench (alternating). Three configurations share one loaded
target (one Engine each, same KV budget):

    plain             no drafter (FixedK(0)): the baseline
    fixed-k           n-gram drafter, every row verifies up to K drafts
    prefix-scheduler  n-gram drafter, verify lengths from DSpark Algorithm 1 on the
                      machine's profiled SPS(B); the n-gram drafter has no confidences, so
                      each request's running per-position acceptance stands in for them

Closed loop per tier C: C requests in flight, a finished one is replaced at once, until
max(C, 4) requests are done (same prompts, same order for every configuration). The three
configurations run side by side, interleaved step by step (A B C A B C ...): each engine's
time is the sum of its own steps, so all three see the same background load moment by moment
(this machine is shared). Throughput = output tokens / engine time (ramp-up and drain
included, identically for all). Latency = per-request end-to-end time on the same clock
(add_request -> last token). Counts next to times: target forwards per output token (decode
+ prefill forwards of the engine / tokens: a system figure, 1/C of the per-request one
without speculation) and tau (tokens committed per verification round, bonus included).
Greedy outputs of the three must be identical (MEASURING.md rule 2); the script checks.
A second pass over all tiers adds a repetition while the time budget lasts.

Writes the JSON (every number) and a section between markers in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_serving:begin -->", "<!-- bench_serving:end -->"
CONFIGS = ("plain", "fixed-k", "prefix-scheduler")


def load_prompts(tokenizer_llm, n: int, max_prompt: int) -> list[tuple[str, list[int]]]:
    """(source id, prompt ids): HumanEval and MT-Bench first user turns, alternating."""
    from draftsmith.data.sources.packaged import HumanEvalSource, MTBenchSource

    pools = []
    for src in (HumanEvalSource(), MTBenchSource()):
        pool = []
        for conv in src.conversations():
            ids = tokenizer_llm.apply_chat_template([{"role": "user", "content": conv.user_turns()[0]}])
            if len(ids) <= max_prompt:
                pool.append((conv.id, ids))
        pools.append(pool)
    out = []
    for i in range(n):
        pool = pools[i % 2]
        out.append(pool[(i // 2) % len(pool)])
    return out


class ClosedLoop:
    """One configuration's clients: C requests in flight until every prompt is done.

    Time is the engine's own: `clock` adds up the wall time of this engine's steps only, so
    configurations stepped alternately share the machine's load moment by moment while
    each is timed as if it ran alone. Request latency is measured on the same clock.
    """

    def __init__(self, engine, prompts: list[list[int]], C: int, params) -> None:
        self.engine, self.C, self.params = engine, C, params
        self.queue = list(enumerate(prompts))
        self.in_flight: dict[int, object] = {}
        self.arrival: dict[int, float] = {}
        self.latency: dict[int, float] = {}
        self.done: dict[int, object] = {}
        self.n = len(prompts)
        self.clock = 0.0
        self.steps = self.prefills = self.padded = self.useful = 0

    @property
    def finished(self) -> bool:
        return len(self.done) == self.n

    def step(self) -> None:
        while self.queue and len(self.in_flight) < self.C:
            i, ids = self.queue.pop(0)
            self.in_flight[i] = self.engine.add_request(ids, self.params, request_id=f"p{i}")
            self.arrival[i] = self.clock
        waiting = self.engine.num_waiting
        t0 = time.perf_counter()
        finished = self.engine.step()
        self.clock += time.perf_counter() - t0
        self.steps += 1
        self.prefills += self.engine.num_waiting < waiting
        ls = self.engine.last_step
        self.padded += ls.rows * ls.block_len
        self.useful += ls.useful_tokens
        for s in finished:
            i = int(s.request_id[1:])
            self.done[i] = self.in_flight.pop(i)
            self.latency[i] = self.clock - self.arrival[i]

    def result(self) -> dict:
        seqs = [self.done[i] for i in range(self.n)]
        tokens = sum(len(s.output_ids) for s in seqs)
        rounds = sum(s.stats.rounds for s in seqs)
        return {
            "engine_time_s": self.clock,
            "output_tokens": tokens,
            "tokens_per_s": tokens / self.clock,
            "latency_s": [self.latency[i] for i in range(self.n)],
            "decode_steps": self.steps,
            "prefill_forwards": self.prefills,
            "forwards_per_token": (self.steps + self.prefills) / tokens,
            "tau": sum(s.stats.committed for s in seqs) / rounds,
            "draft_proposed": sum(s.stats.proposed for s in seqs),
            "draft_accepted": sum(s.stats.accepted for s in seqs),
            "mean_step_tokens_padded": self.padded / self.steps,
            "mean_step_tokens_useful": self.useful / self.steps,
            "outputs": [list(s.output_ids) for s in seqs],
        }


def run_tier(engines: dict, prompts: list[list[int]], C: int, params) -> dict[str, dict]:
    """Step the configurations' closed loops alternately (A B C A B C ..., the first of each
    cycle rotating) until all are done."""
    loops = {name: ClosedLoop(eng, prompts, C, params) for name, eng in engines.items()}
    names = list(loops)
    cycle = 0
    while not all(lp.finished for lp in loops.values()):
        for name in names[cycle % len(names):] + names[: cycle % len(names)]:
            if not loops[name].finished:
                loops[name].step()
        cycle += 1
    return {name: lp.result() for name, lp in loops.items()}


def requests_for(C: int) -> int:
    """Requests per tier and pass: C in flight; at least 4 so low tiers see several prompts."""
    return max(C, 4)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarize(tier_runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    base = tier_runs["plain"]
    for name, runs in tier_runs.items():
        lat = [x for r in runs for x in r["latency_s"]]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base)]
        out[name] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "ratio_vs_plain_median": statistics.median(ratios),
            "ratio_vs_plain_min": min(ratios),
            "ratio_vs_plain_max": max(ratios),
            "latency_p50_s": statistics.median(lat),
            "latency_p95_s": pct(lat, 0.95),
            "forwards_per_token": statistics.median(r["forwards_per_token"] for r in runs),
            "tau": statistics.median(r["tau"] for r in runs),
            "acceptance": sum(r["draft_accepted"] for r in runs) / max(1, sum(r["draft_proposed"] for r in runs)),
            "drafts_verified_per_request_round": sum(r["draft_proposed"] for r in runs)
            / max(1, sum(r["output_tokens"] / r["tau"] for r in runs)),
            "mean_step_tokens_padded": statistics.median(r["mean_step_tokens_padded"] for r in runs),
        }
    return out


def build_engines(llm, k: int, max_batch: int, max_len: int, sps):
    from draftsmith.drafters.base import NoDrafter
    from draftsmith.drafters.ngram import NgramDrafter
    from draftsmith.engine.engine import Engine, EngineConfig
    from draftsmith.models.target import eos_token_ids
    from draftsmith.policy.fixed import FixedK
    from draftsmith.policy.prefix_scheduler import PrefixScheduler

    cfg = EngineConfig(max_batch=max_batch, max_len=max_len)
    eos = eos_token_ids(llm.target)
    model, tok = llm.target.model, llm.tokenizer
    return {
        "plain": llm.engine,
        "fixed-k": Engine(model, tok, NgramDrafter(), FixedK(k), cfg, eos_token_ids=eos),
        "prefix-scheduler": Engine(model, tok, NgramDrafter(), PrefixScheduler(sps, max_k=k), cfg, eos_token_ids=eos),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2, help="passes over the tiers (while the budget lasts)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=840.0, help="skip remaining tiers past this wall time")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_serving.json")
    ap.add_argument("--no-md", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--reuse-profile", action="store_true",
                    help="use a cached SPS(B) table if present (default: profile now, under this run's load)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from draftsmith import LLM, SamplingParams
    from draftsmith.policy.profile import ProfileConfig, load_or_profile

    t_start = time.perf_counter()
    tiers = [int(x) for x in args.tiers.split(",")]
    max_batch = max(tiers)
    load0 = os.getloadavg()
    llm = LLM("smollm2-135m", drafter="none", policy="fixed", num_speculative_tokens=0,
              max_batch=max_batch, max_len=args.max_len)
    log = lambda m: print(f"[bench] {m}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    sps = load_or_profile(llm.target.model, weights_hash=llm.target.weights_hash, name=llm.target.target_id,
                          config=ProfileConfig(max_batch=max_batch, max_k=args.k, warmup=1, repeats=3), log=log,
                          refresh=not args.reuse_profile)
    profile_s = time.perf_counter() - t0
    log(f"SPS(B) ready in {profile_s:.0f}s: " + ", ".join(f"{b}:{s:.1f}" for b, s in zip(sps.tokens, sps.steps_per_s)))
    engines = build_engines(llm, args.k, max_batch, args.max_len, sps)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = load_prompts(llm, requests_for(max_batch), args.max_len - args.max_tokens - args.k - 2)

    # Warm-up: allocator, kernels, first-call paths.
    run_tier(engines, [ids for _, ids in prompts[:2]], 2, SamplingParams(max_tokens=8, temperature=0.0))

    # Pass r runs every tier once (configurations interleaved, order rotated per pass); a
    # second pass adds a repetition to each tier while the time budget lasts.
    runs: dict[int, dict[str, list[dict]]] = {C: {n: [] for n in CONFIGS} for C in tiers}
    loads: dict[int, list[float]] = {C: [] for C in tiers}
    tier_s: dict[int, float] = {}  # wall time of each tier's first pass
    out_of_time = False
    for rep in range(args.reps):
        for C in tiers:
            elapsed = time.perf_counter() - t_start
            if elapsed + (tier_s.get(C, 0.0) if rep else 0.0) > args.budget_s:
                out_of_time = True
                continue  # a smaller tier may still fit
            batch = [ids for _, ids in prompts[: requests_for(C)]]
            loads[C].append(os.getloadavg()[0])
            t_tier = time.perf_counter()
            for name, r in run_tier(engines, batch, C, params).items():
                runs[C][name].append(r)
            tier_s.setdefault(C, time.perf_counter() - t_tier)
            last = {n: runs[C][n][-1] for n in CONFIGS}
            log(f"pass {rep + 1} C={C}: " + " | ".join(
                f"{n} {r['tokens_per_s']:.1f} tok/s x{r['tokens_per_s'] / last['plain']['tokens_per_s']:.2f} "
                f"tau {r['tau']:.2f}" for n, r in last.items()) + f" | {time.perf_counter() - t_start:.0f}s")
        if out_of_time:
            log(f"time budget ({args.budget_s:.0f}s): pass {rep + 1} skipped some tiers")
            break

    results = {"tiers": {}, "skipped_tiers": [C for C in tiers if not runs[C]["plain"]]}
    for C in tiers:
        if not runs[C]["plain"]:
            continue
        mismatched = sum(
            a != b for name in CONFIGS[1:] for r, p in zip(runs[C][name], runs[C]["plain"])
            for a, b in zip(r["outputs"], p["outputs"])
        )
        summ = summarize(runs[C])
        for r in (r for rs in runs[C].values() for r in rs):
            r.pop("outputs")
        results["tiers"][str(C)] = {
            "concurrency": C, "requests": requests_for(C), "reps": len(runs[C]["plain"]), "summary": summ,
            "runs": runs[C], "greedy_mismatches": mismatched, "loadavg_1m": loads[C],
        }

    results["setup"] = {
        "target": llm.target.target_id, "weights_hash": llm.target.weights_hash, "dtype": "float32",
        "drafter": "ngram (max_ngram 3, min_ngram 1)", "k": args.k, "max_tokens": args.max_tokens,
        "temperature": 0.0, "reps": args.reps, "torch_threads": args.threads, "max_batch": max_batch,
        "max_len": args.max_len, "prompts": "chat-templated first user turns, HumanEval and MT-Bench alternating",
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs ({_cpu()})", "torch": torch.__version__,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(), "profile_s": profile_s,
        "sps": sps.to_dict(), "wall_s": time.perf_counter() - t_start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    log(f"wrote {args.out}")
    if not args.no_md:
        write_markdown(results, args.out)
    return 0


def _cpu() -> str:
    from draftsmith.policy.profile import machine_fingerprint

    return machine_fingerprint(torch.device("cpu"))["cpu"]


def verdict(results: dict) -> str:
    """The goal, checked mechanically: >= 0.97x plain at every tier, and the C=1 speedup."""
    tiers = results["tiers"]
    parts = []
    for name in CONFIGS[1:]:
        ratios = {C: t["summary"][name]["ratio_vs_plain_median"] for C, t in tiers.items()}
        below = [C for C, r in ratios.items() if r < 0.97]
        parts.append(
            f"{name}: median ratio {', '.join(f'C={C} {r:.2f}' for C, r in ratios.items())}; "
            + (f"below 0.97x at C = {', '.join(below)}" if below else "at or above 0.97x at every measured tier")
        )
    return "Goal check (>= 0.97x plain at every tier, keep the low-concurrency speedup): " + "; ".join(parts) + "."


def write_markdown(results: dict, json_path: Path) -> None:
    s = results["setup"]
    lines = [
        BEGIN,
        "## Serving: plain vs fixed K vs the prefix scheduler (issue 5)",
        "",
        f"`benchmarks/bench_serving.py` (JSON: `{json_path.relative_to(ROOT)}`), one run, {s['wall_s']:.0f} s. "
        f"Machine: {s['machine']}, torch {s['torch']}, {s['torch_threads']} torch thread. **Shared and noisy**: "
        f"load average {s['loadavg_start'][0]:.1f} at the start, {s['loadavg_end'][0]:.1f} at the end (2 cores; "
        "other engineers' jobs were running), so absolute tokens/s are low and vary; the ratios (same tier, "
        "configurations interleaved step by step, each timed on its own steps) and the counts are the point.",
        "",
        f"Setup: target `{s['target']}` fp32, greedy, max_tokens {s['max_tokens']}, {s['prompts']}; "
        f"n-gram drafter (no confidences: the scheduler uses each request's running per-position acceptance), "
        f"K = {s['k']}; closed loop, C requests in flight, max(C, 4) requests per tier and pass; the three "
        "configurations stepped alternately (A B C A B C ...), tokens/s and latency on each engine's own step "
        f"time; up to {s['reps']} passes over the tiers while the time budget lasts; "
        f"engine max_batch {s['max_batch']}. SPS(B) profiled on this machine in {s['profile_s']:.0f} s "
        "(steps/s at B tokens): " + ", ".join(f"{b}: {v:.1f}" for b, v in zip(s["sps"]["tokens"], s["sps"]["steps_per_s"])) + ".",
        "",
        "| C | reps | config | out tok/s | × plain (median [min, max]) | latency p50 / p95 s (engine time) | fwd/token | τ | drafts verified / round | acceptance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for C, t in results["tiers"].items():
        for name, v in t["summary"].items():
            lines.append(
                f"| {C} | {t['reps']} | {name} | {v['tokens_per_s_median']:.1f} | {v['ratio_vs_plain_median']:.2f} "
                f"[{v['ratio_vs_plain_min']:.2f}, {v['ratio_vs_plain_max']:.2f}] | "
                f"{v['latency_p50_s']:.1f} / {v['latency_p95_s']:.1f} | {v['forwards_per_token']:.2f} | "
                f"{v['tau']:.2f} | {v['drafts_verified_per_request_round']:.2f} | {v['acceptance']:.2f} |"
            )
    mism = {C: t["greedy_mismatches"] for C, t in results["tiers"].items()}
    lines += ["", f"Greedy outputs identical across configurations: mismatched requests per tier {mism}."]
    if results["skipped_tiers"]:
        lines.append(f"Skipped tiers (time budget): {results['skipped_tiers']}.")
    lines += ["", verdict(results), END]
    md = ROOT / "BENCHMARKS.md"
    text = md.read_text() if md.is_file() else "# Benchmarks\n"
    block = "\n".join(lines)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(text)


if __name__ == "__main__":
    sys.exit(main())

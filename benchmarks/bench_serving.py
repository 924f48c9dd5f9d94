"""Serving throughput and latency vs concurrency: plain vs fixed K vs the prefix scheduler.

    .venv/bin/python benchmarks/bench_serving.py [--drafter ngram | dspark:CKPT ...]
        [--tiers 1,2,4,8,16,32] [--max-tokens 48] [--k 5] [--scale 1] [--threads 1]
        [--budget-s 1100] [--out benchmarks/results/bench_serving[_KIND].json]

In-process engine on the default target (smollm2-135m, fp32), greedy, chat-templated first
user turns of HumanEval and MT-Bench (alternating). Five configurations share one loaded
target (one Engine and drafter instance each, same KV budget):

    plain             no drafter (FixedK(0)): the baseline
    fixed-k           the drafter (default n-gram), every row verifies up to K drafts
    prefix-static     verify lengths from DSpark Algorithm 1 on the SPS(B) profiled at
                      start-up only (static_prefix_scheduler); a drafter without confidences
                      (n-gram) gets each request's running per-position acceptance instead
    prefix-scheduler  the default PrefixScheduler: plus the online cost model (SPS(B) corrected
                      from measured rounds, the drafter's time per round), a 3% minimum
                      predicted gain, the server's pooled acceptance as a new request's prior,
                      cheap drafts scored even when not verified, and periodic probing
    prefix-calibrated the same with `realized_check` (off by default): predicted gains scaled
                      by the measured realized / predicted gain of earlier drafting rounds

Closed loop per tier C: C requests always in flight; a finished one is replaced at once by
the next prompt (the same prompt sequence for every configuration). The configurations
run side by side, stepped alternately (A B C D A B C D ...): each engine's time is the sum of its
own steps, so all of them see the same background load moment by moment (this machine is
shared). The measured window is (20 + 1.5 C) s of each engine's own time (x --scale) after
its initial batched prefill; replacement prefills are inside it, as in serving.
Requests get max_tokens spread over [M/2, 3M/2] (mean M = --max-tokens) by request index, the
same for every configuration, so they do not finish in lockstep (a lockstep batch is replaced
by one huge padded prefill that lands in some windows and not others). Decode throughput =
output tokens / engine time over the window's steps without a prefill (the primary ratio:
every request costs one prefill in every configuration); end-to-end throughput includes them. Latency = end-to-end time
(engine clock) of requests that completed inside the window. Counts next to times: target
forwards per output token (decode + prefill forwards / tokens: a system figure) and tau
(tokens committed per verification round, bonus included). Greedy outputs must be identical
across configurations for requests all of them completed (docs/MEASURING.md rule 2); checked.

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

import sections

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def markers(drafter: str) -> tuple[str, str]:
    """BENCHMARKS.md section markers: one section per drafter kind."""
    kind = drafter.partition(":")[0]
    tag = "" if kind == "ngram" else f":{kind}"
    return f"<!-- bench_serving{tag}:begin -->", f"<!-- bench_serving{tag}:end -->"


CONFIGS = ("plain", "fixed-k", "prefix-static", "prefix-scheduler", "prefix-calibrated")


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
    """One configuration's clients: always C requests in flight (a finished one is replaced
    at once by the next prompt, cycling through the list).

    Time is the engine's own: `clock` adds up the wall time of this engine's steps only, so
    configurations stepped alternately share the machine's load moment by moment while each
    is timed as if it ran alone. The measured window starts after the first step (the
    initial batched prefill of C prompts); replacement prefills are inside it, as in serving.
    """

    def __init__(self, engine, prompts: list[list[int]], C: int, max_tokens: int) -> None:
        self.engine, self.prompts, self.C, self.max_tokens = engine, prompts, C, max_tokens
        self.next_i = 0
        self.in_flight: dict[int, object] = {}
        self.arrival: dict[int, float] = {}
        self.latency: dict[int, float] = {}
        self.outputs: dict[int, list[int]] = {}
        self.seqs: list = []
        self.clock = 0.0  # engine time inside the window
        self.history: list[tuple[float, int, bool]] = []  # (step s, tokens, had a prefill), window
        self.first = True
        self.steps = self.prefills = self.padded = self.useful = 0

    def step(self) -> None:
        while len(self.in_flight) < self.C:
            i = self.next_i
            self.next_i += 1
            params = SamplingParams(max_tokens=staggered(i, self.max_tokens), temperature=0.0)
            s = self.engine.add_request(self.prompts[i % len(self.prompts)], params, request_id=f"p{i}")
            self.in_flight[i], self.arrival[i] = s, self.clock
            self.seqs.append(s)
        before = sum(len(s.output_ids) for s in self.in_flight.values())
        waiting = self.engine.num_waiting
        t0 = time.perf_counter()
        finished = self.engine.step()
        dt = time.perf_counter() - t0
        tokens = sum(len(s.output_ids) for s in self.in_flight.values()) - before
        for s in finished:
            i = int(s.request_id[1:])
            del self.in_flight[i]
            self.outputs[i] = list(s.output_ids)
            if not self.first:
                self.latency[i] = self.clock + dt - self.arrival[i]
        if self.first:  # the initial prefill of C prompts: outside the window
            self.first = False
            self.arrival = {i: 0.0 for i in self.arrival}
            return
        prefill = self.engine.num_waiting < waiting
        self.clock += dt
        self.history.append((dt, tokens, prefill))
        self.steps += 1
        self.prefills += prefill
        ls = self.engine.last_step
        self.padded += ls.rows * ls.block_len
        self.useful += ls.useful_tokens

    def close(self) -> None:
        self.engine.abort_all()  # free every row for the next tier

    def result(self) -> dict:
        tokens = sum(t for _, t, _ in self.history)
        rounds = sum(s.stats.rounds for s in self.seqs)
        dec_t = sum(dt for dt, _, p in self.history if not p)
        dec_n = sum(n for _, n, p in self.history if not p)
        return {
            "engine_time_s": self.clock,
            "output_tokens": tokens,
            "tokens_per_s": tokens / self.clock,
            "decode_tokens_per_s": dec_n / dec_t if dec_t else float("nan"),
            "decode_time_s": dec_t,
            "history": self.history,
            "latency_s": list(self.latency.values()),
            "completed": len(self.latency),
            "decode_steps": self.steps,
            "prefill_forwards": self.prefills,
            "forwards_per_token": (self.steps + self.prefills) / max(tokens, 1),
            "tau": sum(s.stats.committed for s in self.seqs) / max(rounds, 1),
            "draft_proposed": sum(s.stats.proposed for s in self.seqs),
            "draft_accepted": sum(s.stats.accepted for s in self.seqs),
            "mean_step_tokens_padded": self.padded / max(self.steps, 1),
            "mean_step_tokens_useful": self.useful / max(self.steps, 1),
        }


def staggered(i: int, max_tokens: int) -> int:
    """max_tokens of request i: spread over [max_tokens / 2, 3 max_tokens / 2] (mean
    max_tokens), the same for every configuration, so requests do not finish in lockstep
    and get replaced by one huge batched prefill."""
    return max_tokens // 2 + (i * 17) % (max_tokens + 1)


def run_tier(engines: dict, prompts: list[list[int]], C: int, max_tokens: int, seconds: float) -> dict[str, dict]:
    """Step the configurations alternately (A B C A B C ..., the first of each cycle
    rotating) until each has run `seconds` of its own engine time in the window."""
    loops = {name: ClosedLoop(eng, prompts, C, max_tokens) for name, eng in engines.items()}
    names = list(loops)
    cycle = 0
    while any(lp.first or lp.clock < seconds for lp in loops.values()):
        for name in names[cycle % len(names):] + names[: cycle % len(names)]:
            if loops[name].first or loops[name].clock < seconds:
                loops[name].step()
        cycle += 1
    out = {}
    for name, lp in loops.items():
        lp.close()
        out[name] = lp.result()
        out[name]["outputs"] = lp.outputs
    return out


def tier_seconds(C: int, scale: float) -> float:
    """Engine seconds per configuration: longer for big C (a step takes longer there)."""
    return scale * (20.0 + 1.5 * C)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def quarter_rates(history: list[tuple[float, int, bool]]) -> list[float]:
    """Decode tokens/s in each quarter of the window (by engine time; prefill steps left out)."""
    history = [(dt, n) for dt, n, p in history if not p]
    total = sum(dt for dt, _ in history)
    bins = [[0.0, 0] for _ in range(4)]
    t = 0.0
    for dt, n in history:
        q = min(3, int(4 * (t + dt / 2) / total))
        bins[q][0] += dt
        bins[q][1] += n
        t += dt
    return [n / dt if dt else float("nan") for dt, n in bins]


def summarize(runs: dict[str, dict], C: int) -> dict[str, dict]:
    out = {}
    base = runs["plain"]
    base_q = quarter_rates(base["history"])
    for name, r in runs.items():
        ratios = [a / b for a, b in zip(quarter_rates(r["history"]), base_q)]
        out[name] = {
            "decode_tokens_per_s": r["decode_tokens_per_s"],
            "ratio_vs_plain": r["decode_tokens_per_s"] / base["decode_tokens_per_s"],
            "tokens_per_s": r["tokens_per_s"],
            "e2e_ratio_vs_plain": r["tokens_per_s"] / base["tokens_per_s"],
            "ratio_quarters_min": min(ratios),
            "ratio_quarters_max": max(ratios),
            "completed": r["completed"],
            "latency_p50_s": statistics.median(r["latency_s"]) if r["latency_s"] else float("nan"),
            "latency_p95_s": pct(r["latency_s"], 0.95),
            "s_per_token_per_request": C / r["decode_tokens_per_s"],  # C requests share the throughput
            "forwards_per_token": r["forwards_per_token"],
            "tau": r["tau"],
            "acceptance": r["draft_accepted"] / max(1, r["draft_proposed"]),
            "mean_step_tokens_padded": r["mean_step_tokens_padded"],
        }
    return out


def build_engines(llm, k: int, max_batch: int, max_len: int, sps, drafter: str = "ngram"):
    from draftsmith.engine.builder import build_engine
    from draftsmith.policy.fixed import FixedK
    from draftsmith.policy.prefix_scheduler import PrefixScheduler, static_prefix_scheduler

    policies = {"fixed-k": FixedK(k), "prefix-static": static_prefix_scheduler(sps, max_k=k),
                "prefix-scheduler": PrefixScheduler(sps, max_k=k),
                "prefix-calibrated": PrefixScheduler(sps, max_k=k, realized_check=True)}
    engines = {"plain": llm.engine}
    for name, pol in policies.items():  # one drafter instance per engine: drafters keep per-row state
        engines[name] = build_engine(llm.target, drafter, pol, k, max_batch, max_len)
    return engines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="ngram", help="ngram, or KIND:CHECKPOINT of a trained drafter")
    ap.add_argument("--tiers", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="engine seconds per configuration and tier = scale * (20 + 1.5 C)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=1100.0, help="skip tiers that would pass this wall time")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/bench_serving.json, bench_serving_KIND.json for a trained drafter)")
    ap.add_argument("--no-md", action="store_true", help="do not touch BENCHMARKS.md")
    ap.add_argument("--reuse-profile", action="store_true",
                    help="use a cached SPS(B) table if present (default: profile now, under this run's load)")
    args = ap.parse_args()
    if args.out is None:  # one JSON per drafter kind, like the BENCHMARKS.md sections
        kind = args.drafter.split(":")[0]
        args.out = ROOT / "benchmarks" / "results" / ("bench_serving.json" if kind == "ngram" else f"bench_serving_{kind}.json")
    args.out = args.out.resolve()  # the report names it relative to the repository

    torch.set_num_threads(args.threads)
    from draftsmith import LLM
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
    engines = build_engines(llm, args.k, max_batch, args.max_len, sps, args.drafter)
    prompts = [ids for _, ids in load_prompts(llm, 64, args.max_len - args.max_tokens - args.k - 2)]

    # Warm-up: allocator, kernels, first-call paths.
    run_tier(engines, prompts[:2], 2, 8, 1.0)

    # One pass over the tiers; inside a tier the configurations are stepped alternately.
    results: dict = {"tiers": {}, "skipped_tiers": []}
    for C in tiers:
        seconds = tier_seconds(C, args.scale)
        if time.perf_counter() - t_start + 4.4 * seconds > args.budget_s:
            results["skipped_tiers"].append(C)
            log(f"C={C}: skipped (would pass the {args.budget_s:.0f}s budget)")
            continue
        load_before = os.getloadavg()[0]
        runs = run_tier(engines, prompts, C, args.max_tokens, seconds)
        outs = {name: r.pop("outputs") for name, r in runs.items()}
        common = set.intersection(*(set(o) for o in outs.values()))
        mismatched = sum(outs[n][i] != outs["plain"][i] for n in CONFIGS[1:] for i in common)
        summ = summarize(runs, C)
        results["tiers"][str(C)] = {
            "concurrency": C, "engine_seconds": seconds, "summary": summ, "runs": runs,
            "greedy_compared": len(common), "greedy_mismatches": mismatched,
            "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
        }
        log(f"C={C}: " + " | ".join(
            f"{n} {v['decode_tokens_per_s']:.1f} tok/s x{v['ratio_vs_plain']:.2f} (e2e x{v['e2e_ratio_vs_plain']:.2f}) "
            f"tau {v['tau']:.2f}"
            for n, v in summ.items()) + f" | compared {len(common)}, mismatches {mismatched}"
            f" | {time.perf_counter() - t_start:.0f}s")

    results["setup"] = {
        "target": llm.target.target_id, "weights_hash": llm.target.weights_hash, "dtype": "float32",
        "drafter": args.drafter, "k": args.k, "max_tokens": args.max_tokens,
        "temperature": 0.0, "scale": args.scale, "torch_threads": args.threads, "max_batch": max_batch,
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
        ratios = {C: t["summary"][name]["ratio_vs_plain"] for C, t in tiers.items()}
        below = [C for C, r in ratios.items() if r < 0.97]
        parts.append(
            f"{name}: {', '.join(f'C={C} {r:.2f}x' for C, r in ratios.items())}; "
            + (f"below 0.97x at C = {', '.join(below)}" if below else "at or above 0.97x at every measured tier")
        )
    return "Goal check (>= 0.97x plain at every tier, keep the low-concurrency speedup): " + "; ".join(parts) + "."


def write_markdown(results: dict, json_path: Path) -> None:
    s = results["setup"]
    begin, end = markers(s["drafter"])
    kind = s["drafter"].partition(":")[0]
    # its own torch threads keep the load average near their count: only more than that is others'
    quiet = max(s["loadavg_start"][0], s["loadavg_end"][0]) < s["torch_threads"] + 0.5
    drafter_note = ("n-gram drafter (no confidences: the schedulers use each request's running per-position "
                    "acceptance)" if kind == "ngram" else
                    f"`{s['drafter']}` drafter (its confidence head drives Algorithm 1 in the schedulers)")
    lines = [
        begin,
        f"## Serving: plain vs fixed K vs the prefix scheduler, {kind} drafter (issue 5)",
        "",
        f"`benchmarks/bench_serving.py --drafter {s['drafter']}` (JSON: `{json_path.relative_to(ROOT)}`), one run, "
        f"{s['wall_s']:.0f} s. Machine: {s['machine']}, torch {s['torch']}, {s['torch_threads']} torch thread(s); "
        f"load average {s['loadavg_start'][0]:.1f} at the start, {s['loadavg_end'][0]:.1f} at the end (2 cores"
        + ("; nothing else running)." if quiet else "; **shared and noisy**: other jobs were running, so absolute "
           "tokens/s are low and drift; the ratios (same tier, configurations stepped alternately, each timed on "
           "its own steps) and the counts are the point)."),
        "",
        f"Setup: target `{s['target']}` fp32, greedy, max_tokens staggered over {s['max_tokens'] // 2}.."
        f"{s['max_tokens'] // 2 + s['max_tokens']} by request index (mean {s['max_tokens']}, same for every "
        f"configuration, so requests do not finish in lockstep), {s['prompts']}; "
        f"{drafter_note}, K = {s['k']}; engine max_batch {s['max_batch']}. Closed loop: C requests always in flight (a finished "
        "request is replaced at once); the configurations are stepped alternately (A B C D A B C D ...) and "
        "each is timed on its own steps, so all see the same background load; measured window = "
        f"{s['scale']:g} x (20 + 1.5 C) s of each engine's time after the initial prefill (replacement prefills "
        "included). SPS(B) profiled on this machine at start-up in "
        f"{s['profile_s']:.0f} s (steps/s at B tokens): "
        + ", ".join(f"{b}: {v:.1f}" for b, v in zip(s["sps"]["tokens"], s["sps"]["steps_per_s"])) + ".",
        "",
        "| C | config | decode tok/s | × plain [quarters min, max] | e2e tok/s (× plain) | s/token/request | done | latency p50 / p95 s | fwd/token | τ | acceptance | step tokens (padded) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for C, t in results["tiers"].items():
        for name, v in t["summary"].items():
            lines.append(
                f"| {C} | {name} | {v['decode_tokens_per_s']:.1f} | {v['ratio_vs_plain']:.2f} "
                f"[{v['ratio_quarters_min']:.2f}, {v['ratio_quarters_max']:.2f}] | {v['tokens_per_s']:.1f} "
                f"({v['e2e_ratio_vs_plain']:.2f}) | {v['s_per_token_per_request']:.2f} | "
                f"{v['completed']} | {v['latency_p50_s']:.1f} / {v['latency_p95_s']:.1f} | {v['forwards_per_token']:.3f} | "
                f"{v['tau']:.2f} | {v['acceptance']:.2f} | {v['mean_step_tokens_padded']:.1f} |"
            )
    cmp = {C: f"{t['greedy_mismatches']}/{t['greedy_compared']}" for C, t in results["tiers"].items()}
    lines += [
        "",
        "Columns: decode tok/s = output tokens / engine time over steps without a prefill (speculation "
        "changes decode; every request costs one prefill in every configuration, but finite windows catch "
        "different numbers of prefills, so end-to-end tok/s is noisier); quarters = the decode ratio in each "
        "quarter of the window; e2e tok/s = all tokens / all engine time in the window, prefills included; "
        "s/token/request = C / decode tok/s; done = requests completed inside the window (latency is "
        "theirs, engine time, end to end); fwd/token = engine forwards (decode + prefill) per output token, a "
        "system figure; τ = tokens committed per verification round, bonus included; acceptance = accepted / "
        "verified drafts; step tokens = rows × verify width of the forward, averaged over steps.",
        "",
        f"Greedy outputs identical across configurations (mismatched / compared requests per tier): {cmp}.",
    ]
    if results["skipped_tiers"]:
        lines.append(f"Skipped tiers (time budget): {results['skipped_tiers']}.")
    lines += ["", "Configurations: prefix-static = Algorithm 1 on the start-up SPS(B) profile only (the paper's "
              "scheduler); prefix-scheduler = Draftsmith's default: the same plus the online cost model (SPS(B) "
              "corrected from measured rounds, the drafter's time per round), no drafting below a 3% predicted gain, "
              "the server's pooled acceptance as a new request's prior, cheap drafts scored even when not verified, "
              "and probe rounds for dear drafters (after 16 idle rounds, backing off while probes verify nothing).", "", verdict(results)]
    sections.write_section(begin, end, "\n".join(lines[1:]))


if __name__ == "__main__":
    sys.exit(main())

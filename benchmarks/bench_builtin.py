"""The built-in DSpark drafter against plain decoding, on held-out prompts (issue 12 goals).

    .venv/bin/python benchmarks/bench_builtin.py [--work runs/bench-builtin] [--drafter dspark:smollm2-135m]
        [--eval-prompts 12] [--tokens 128] [--requests 8] [--tiers 1,4,16,32] [--tier-requests 2]
        [--compare dspark:runs/builtin/dspark-v2 ...] [--tier-policy prefix-scheduler:padded_search=columns ...]

Every stage is a plain `draftsmith` CLI call, skipped when its report exists (delete it to redo). A
rerun of the script continues where it stopped: a bench stage killed before its report.json (its
directory holds its setup.json) goes on with `draftsmith bench --resume`, which keeps the
tiers it finished (its stage time is then this run's part only); an eval stage killed so runs again.

1. eval   held-out HumanEval + MT-Bench, T = 0, γ = the drafter's block size: τ, conditional
          acceptance per position; n-gram prompt lookup as the training-free reference
2. bench  batch 1 (concurrency 1), the default policy (auto: the prefix scheduler, at most γ drafts), T = 0, --tokens new tokens:
          plain vs the drafter vs n-gram stepped side by side on held-out HumanEval, then MT-Bench;
          every speculative output is compared with plain decoding's (a difference voids it);
          --compare drafters (e.g. the previous built-in) join these two stages, side by side
3. tiers  the prefix scheduler at each serving tier (--tiers), held-out HumanEval prompts:
          the speedup must never fall below ~1 (it turns speculation off where it does not pay);
          --tier-policy SPEC (repeatable) runs the tiers once per policy spec instead, each with
          plain stepped side by side (default: prefix-scheduler)

The bench stages measure plain decoding a second time beside the others (`bench --control`, an
A/A pair): its ratio says how far this run's noise moves a ratio of 1.

Writes <work>/results.json, benchmarks/results/bench_builtin.json and its BENCHMARKS.md section.
Run on an idle machine: every number here is a ratio measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import sections
from bench_drafters import bench_out, cli, eval_out

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("humaneval", "mtbench")


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-builtin")
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--eval-prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tiers", default="1,4,16,32")
    ap.add_argument("--tier-requests", type=int, default=2, help="requests per tier = this x concurrency")
    ap.add_argument("--tier-tokens", type=int, default=64)
    ap.add_argument("--compare", action="append", default=[], metavar="DRAFTER",
                    help="another drafter for the eval and batch-1 stages (repeatable), e.g. a previous built-in")
    ap.add_argument("--tier-policy", action="append", default=[], metavar="SPEC",
                    help="policy of the tiers stage (repeatable; default prefix-scheduler)")
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    stage_s: dict[str, float] = {}
    earlier = json.loads((w / "results.json").read_text()).get("setup", {}) if (w / "results.json").is_file() else {}
    t_all = time.perf_counter()
    ran = 0  # stages measured by this invocation

    def stage(name: str, out: Path, *argv: str) -> None:
        if (out / "report.json").is_file():
            print(f"== {name}: reused {out}", flush=True)
            if name in earlier.get("stage_s", {}):  # a reused stage keeps the time it took when it ran
                stage_s[name] = earlier["stage_s"][name]
            return
        nonlocal ran
        t0 = time.perf_counter()
        cli(*argv, *(eval_out(out) if argv[0] == "eval" else bench_out(out)))
        stage_s[name] = round(time.perf_counter() - t0, 1)
        ran += 1

    extra = [a for d in args.compare for a in ("--drafter", d)]
    stage("eval-T0", w / "eval-T0", "eval", "--drafter", args.drafter, *extra, "--drafter", "ngram",
          "--tasks", ",".join(WORKLOADS), "--max-prompts", str(args.eval_prompts),
          "--max-tokens", str(args.tokens), "--temperature", "0")
    for wl in WORKLOADS:
        stage(f"bench-{wl}", w / f"bench-{wl}", "bench", "--drafter", args.drafter, *extra, "--drafter", "ngram",
              "--workload", wl, "--concurrency", "1", "--requests", str(args.requests),
              "--max-tokens", str(args.tokens), "--warmup", "1", "--temperature", "0", "--control")
    tiers = [int(c) for c in args.tiers.split(",")]
    args.tier_policy = args.tier_policy or ["prefix-scheduler"]
    for spec in args.tier_policy:
        name = tier_stage(spec)
        stage(name, w / name, "bench", "--drafter", args.drafter, "--policy", spec,
              "--workload", "humaneval", "--concurrency", args.tiers,
              "--requests", str(args.tier_requests * max(tiers)), "--max-tokens", str(args.tier_tokens),
              "--warmup", "1", "--temperature", "0", "--repeats", "2",  # n = 1 cannot tell drift from a loss
              "--control")  # plain again, side by side: how far a ratio of 1 moves in this run

    res = collect(w, args)
    res["setup"] = {"drafter": args.drafter, "compare": args.compare, "eval_prompts": args.eval_prompts, "tokens": args.tokens,
                    "requests": args.requests, "tiers": tiers, "tier_requests": args.tier_requests,
                    "tier_policies": args.tier_policy,
                    "tier_tokens": args.tier_tokens, "machine": machine(),
                    "stage_s": stage_s, "wall_s": round(time.perf_counter() - t_all, 1),
                    "loadavg_end": os.getloadavg()}
    if ran == 0 and earlier:  # nothing measured now: the run's own wall time and final load stand
        res["setup"].update(wall_s=earlier.get("wall_s"), loadavg_end=earlier.get("loadavg_end"))
    (w / "results.json").write_text(json.dumps(res, indent=1))
    tag, kind = sections.cpu_kind()
    dest = ROOT / "benchmarks" / "results" / f"bench_builtin{tag}.json"
    dest.write_text(json.dumps(res, indent=1))
    print(f"wrote {dest}")
    if not args.no_md:
        marker = f"bench_builtin{tag.replace('-', ':')}"
        sections.write_section(f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", markdown(res, tag, kind))
    return 0


def machine() -> str:
    """CPU model, the kernels' instruction set and the CPU count, e.g. 'AMD EPYC (avx2 kernels), 2 CPUs'."""
    from draftsmith.kernels.build import cpu_kernels
    from draftsmith.policy.profile import cpu_model

    isa = cpu_kernels().isa
    return f"{cpu_model()} ({isa + ' kernels' if isa else 'no Draftsmith kernels'}), {os.cpu_count()} CPUs"


def collect(w: Path, args) -> dict:
    res: dict = {"eval": {}, "bench": {}, "tiers": []}
    ev = json.loads((w / "eval-T0" / "report.json").read_text())
    for d in ev["drafters"]:
        res["eval"][d["label"]] = {
            "dtype": d.get("dtype"),  # what a trained drafter computed in (--drafter-dtype auto)
            "tau": d["overall"]["tau"], "tasks": {t: v["tau"] for t, v in d["tasks"].items()},
            "conditional_acceptance": d["overall"]["conditional_acceptance"],
            "acceptance_rate": d["overall"]["acceptance_rate"]}
    res["eval_prompts"] = ev.get("prompts")
    for wl in WORKLOADS:
        rep = json.loads((w / f"bench-{wl}" / "report.json").read_text())
        res["bench"][wl] = {r["label"]: {"speedup": r["speedup"], "tokens_per_s": r["system_tokens_per_s"],
                                         "tau": r["tau"], "acceptance": r["acceptance_rate"],
                                         "spread": r.get("speedup_spread"), "void": r.get("void")}
                            for r in rep["tiers"][0]["results"]}
    for spec in args.tier_policy:
        rep = json.loads((w / tier_stage(spec) / "report.json").read_text())
        for t in rep["tiers"]:
            for r in t["results"]:
                if r["label"] != "none":
                    res["tiers"].append({"concurrency": t["concurrency"], "label": r["label"], "policy": spec,
                                         "speedup": r["speedup"], "spread": r.get("speedup_spread"),
                                         "tau": r["tau"], "void": r.get("void"),
                                         "requests": r.get("requests", r.get("n"))})
    return res


def tier_stage(spec: str) -> str:
    """The tiers stage's directory for a policy spec ('tiers' for the default scheduler)."""
    if spec == "prefix-scheduler":
        return "tiers"
    return "tiers-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in spec)


def markdown(r: dict, tag: str = "", kind: str = "") -> str:
    s = r["setup"]
    d = s["drafter"]
    json_name = f"bench_builtin{tag}.json"
    lines = ["## Built-in drafter: `" + d + "` against plain decoding (issue 12)" + kind, "",
             f"`benchmarks/bench_builtin.py` (JSON: `benchmarks/results/{json_name}`). Machine: "
             f"{s['machine']}, no GPU, float32 target, T = 0, held-out prompts only; the drafter computes in "
             f"{r['eval'].get(d, {}).get('dtype') or 'the target dtype'} (`--drafter-dtype auto`, the default). "
             "How the drafter was made: `src/draftsmith/builtin/dspark/smollm2-135m/TRAINING.md`.", "",
             f"Held-out τ (tokens per verification round, bonus included; γ = the drafter's block size), "
             f"{s['eval_prompts']} prompts per task, {s['tokens']} new tokens per turn:", "",
             "| drafter | τ HumanEval | τ MT-Bench | τ all | acceptance | conditional acceptance k = 1.. |",
             "|---|---|---|---|---|---|"]
    for lab, e in r["eval"].items():
        ca = ", ".join(_f(x) for x in e["conditional_acceptance"])
        lines.append(f"| {lab} | {_f(e['tasks'].get('humaneval'))} | {_f(e['tasks'].get('mtbench'))} | "
                     f"{_f(e['tau'])} | {_f(e['acceptance_rate'])} | {ca} |")
    lines += ["", f"Batch 1 wall clock (`draftsmith bench`, concurrency 1, {s['requests']} held-out requests × "
              f"{s['tokens']} tokens, default policy = auto (the prefix scheduler), plain decoding stepped side by side in the same run; "
              "speedup = tokens/s ÷ plain's):", "",
              "| workload | drafter | speedup | tokens/s | τ | acceptance | outputs = plain |", "|---|---|---|---|---|---|---|"]
    for wl, rows in r["bench"].items():
        for lab, x in rows.items():
            if lab == "none":
                lines.append(f"| {wl} | plain | 1.00 | {_f(x['tokens_per_s'], 1)} | – | – | – |")
                continue
            if lab == "control":
                lines.append(f"| {wl} | plain again (A/A control: the run's noise) | {_f(x['speedup'])} | "
                             f"{_f(x['tokens_per_s'], 1)} | – | – | {'NO (void)' if x['void'] else 'yes'} |")
                continue
            lines.append(f"| {wl} | {lab} | {_f(x['speedup'])} | {_f(x['tokens_per_s'], 1)} | {_f(x['tau'])} | "
                         f"{_f(x['acceptance'])} | {'NO (void)' if x['void'] else 'yes'} |")
    lines += ["", f"Serving tiers with the prefix scheduler (held-out HumanEval, {s['tier_tokens']} tokens, "
              f"{s['tier_requests'] * max(s['tiers'])} requests per tier, closed loop; the scheduler verifies "
              "nothing where it predicts no gain, so τ 1.00 means it kept speculation off):", "",
              "| policy | concurrency | speedup vs plain (min–max, n) | τ | outputs = plain |", "|---|---|---|---|---|"]
    for t in r["tiers"]:
        sp = t.get("spread") or {}
        rng = f" ({_f(sp['min'])}–{_f(sp['max'])}, n = {sp.get('n')})" if sp.get("min") is not None else ""
        pol = "plain again (A/A control)" if t["label"] == "control" else f"`{t.get('policy', 'prefix-scheduler')}`"
        lines.append(f"| {pol} | {t['concurrency']} | {_f(t['speedup'])}{rng} | "
                     f"{_f(t['tau'])} | {'NO (void)' if t['void'] else 'yes'} |")
    lines += ["", f"Stage times (s): {s['stage_s']}; load average at the end {s['loadavg_end'][0]:.1f}."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

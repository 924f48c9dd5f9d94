"""Multi-turn chat traffic through `draftsmith bench --turns` with prefix caching (issues 11, 12).

    .venv/bin/python benchmarks/bench_multiturn.py [--drafter dspark:smollm2-135m --drafter ...]
        [--concurrency 1,4] [--requests 8] [--turns 2] [--max-tokens 128] [--goodput "ttft:1000 tpot:60"]
        [--work runs/bench-multiturn] [--no-write]

The product's own bench, as a user would run it on a chat service: held-out MT-Bench
conversations, each request a conversation of `--turns` user turns (a turn is sent when the
previous answer ends, the answers so far in its prompt), `--enable-prefix-caching` in every
engine (each run starts with nothing cached), plain decoding as the baseline and again as the A/A
control, greedy, the default policy. Per tier and configuration: the speedup and its spread, τ,
the time to first token of the first and of the later turns, the share of later turns' prompts
the prefix cache held, goodput under the SLO and whether outputs equal plain decoding's. Writes
benchmarks/results/bench_multiturn-KIND.json (numbers only, no paths) and its BENCHMARKS.md
section (per CPU kind). Run on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sections

from draftsmith.bench import BenchConfig, run_bench
from draftsmith.bench.config import parse_concurrency, parse_goodput
from draftsmith.bench.report_markdown import slo_text

ROOT = Path(__file__).resolve().parents[1]


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{1e3 * seconds:.0f}"


def _one_minute(load) -> str:
    return "?" if not load else f"{load[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", default=None)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--goodput", default="ttft:1000 tpot:60")
    ap.add_argument("--work", type=Path, default=ROOT / "runs/bench-multiturn")
    ap.add_argument("--no-write", action="store_true", help="print the rows; leave BENCHMARKS.md alone")
    a = ap.parse_args()
    drafters = tuple(a.drafter or ("dspark:smollm2-135m", "lookup:dspark:smollm2-135m"))
    cfg = BenchConfig(drafters=drafters, workload="mtbench", concurrency=parse_concurrency(a.concurrency),
                      requests=a.requests, max_tokens=a.max_tokens, warmup=1, turns=a.turns, enable_prefix_caching=True,
                      control=True, goodput=parse_goodput(a.goodput), out=a.work, overwrite=True, progress=False)
    t0 = time.time()
    rep = json.loads(run_bench(cfg).read_text())
    rows = []
    for t in rep["tiers"]:
        for r in t["results"]:
            turns = r.get("by_turn") or []
            later = [b for b in turns if b["turn"] > 1]
            prompt = sum(b["prompt_tokens"] or 0 for b in later)
            eq = r.get("equality") or {}
            sp = r.get("speedup_spread") or {}
            rows.append({
                "concurrency": t["concurrency"], "config": r["label"], "speedup": r.get("speedup"),
                "speedup_min": sp.get("min"), "speedup_max": sp.get("max"), "units": sp.get("n"),
                "tokens_per_s": r["system_tokens_per_s"], "tau": r.get("tau"),
                "ttft_turn1_p50_s": turns[0]["ttft_s"]["p50"] if turns else None,
                "ttft_later_p50_s": later[0]["ttft_s"]["p50"] if later else None,
                "later_prompt_tokens": prompt, "later_cached_tokens": sum(b["cached_tokens"] or 0 for b in later),
                "goodput_rps": (r.get("goodput") or {}).get("requests_per_s"),
                "goodput_met": (r.get("goodput") or {}).get("met"), "turns_measured": (r.get("goodput") or {}).get("requests"),
                "outputs_equal": (f"{eq['compared'] - eq['mismatches']}/{eq['compared']}" if eq.get("checked") else "–"),
                "verdict": r["verdict"]["decision"],
            })
    tag, title = sections.cpu_kind()
    key = f"bench_multiturn{tag}"
    setup = rep["setup"]
    result = {"command": {"drafters": list(drafters), "concurrency": list(cfg.concurrency), "requests": a.requests,
                          "turns": a.turns, "max_tokens": a.max_tokens, "goodput_ms": dict(cfg.goodput)},
              "prompt_ids": setup["workload"]["prompt_ids"], "total_turns": setup["workload"].get("total_turns"),
              "machine": {k: setup["machine"].get(k) for k in ("cpu_model", "cpu_count", "torch_threads")},
              "load_average": [rep["machine_load"]["loadavg_start"], rep["machine_load"]["loadavg_end"]],
              "wall_s": round(time.time() - t0), "rows": rows}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/{key}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(rows, indent=1))
    if a.no_write:
        return
    slo = slo_text(dict(cfg.goodput))
    lines = [f"## Multi-turn chat traffic: `draftsmith bench --turns {a.turns} --enable-prefix-caching` "
             f"(issues 11, 12){title}", "",
             f"`benchmarks/bench_multiturn.py` (JSON: `benchmarks/results/{key}.json`): `draftsmith bench` on "
             f"{a.requests} held-out MT-Bench conversations per tier and configuration, {a.turns} user turns each "
             f"({result['total_turns']} turns; a turn is sent when the previous answer ends, the answers so far in "
             f"its prompt), greedy, {a.max_tokens} new tokens per turn, prefix caching on in every engine (each run "
             f"starts with nothing cached), the default policy, plain decoding as the baseline and again as the A/A "
             f"control, configurations interleaved per conversation at concurrency 1 and per request list above. "
             f"Machine: {result['machine']['cpu_count']} × {result['machine']['cpu_model']}, "
             f"{result['machine']['torch_threads']} torch threads; load average {_one_minute(result['load_average'][0])} "
             f"at the start, {_one_minute(result['load_average'][1])} at the end; {result['wall_s']} s in all. TTFT of a later turn "
             f"counts from the previous answer's end; goodput = turns per second meeting {slo}.", "",
             "| concurrency | configuration | speedup (min–max, n) | tokens/s | τ | TTFT ms turn 1 / later | "
             "later prompts cached | goodput turns/s (met) | outputs = plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = "1.00" if r["config"] == "none" else (
            f"{r['speedup']:.2f} ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}, n = {r['units']})" if r["speedup"] else "–")
        cached = f"{r['later_cached_tokens'] / r['later_prompt_tokens']:.0%}" if r["later_prompt_tokens"] else "–"
        tau = "–" if r["tau"] is None or r["config"] in ("none", "control") else f"{r['tau']:.2f}"
        good = "–" if r["goodput_rps"] is None else f"{r['goodput_rps']:.3f} ({r['goodput_met']}/{r['turns_measured']})"
        lines.append(f"| {r['concurrency']} | {'plain again (A/A control)' if r['config'] == 'control' else r['config']} "
                     f"| {sp} | {r['tokens_per_s']:.1f} | {tau} | {_ms(r['ttft_turn1_p50_s'])} / "
                     f"{_ms(r['ttft_later_p50_s'])} | {cached} | {good} | {r['outputs_equal']} |")
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    sections.write_section(begin, end, "\n".join(lines))


if __name__ == "__main__":
    main()

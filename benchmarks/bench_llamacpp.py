"""Draftsmith against llama.cpp on the same weights at the same precision (issue 11 goal:
Draftsmith's best configuration >= 1.0x llama.cpp plain on held-out code at batch 1).

    .venv/bin/python benchmarks/bench_llamacpp.py [--work runs/bench-llamacpp] [--dtypes float32,bfloat16]
        [--requests 12] [--tokens 128] [--drafter dspark:smollm2-135m]

Per dtype, one `draftsmith bench` run (concurrency 1, closed loop, T = 0, held-out HumanEval,
the default policy, auto: the prefix scheduler) with `--peers llamacpp`: our plain decoding, n-gram and the
built-in drafter, llama.cpp plain and llama.cpp prompt lookup, interleaved on the same
prompts (token ids) in one process, each with the same number of threads. llama.cpp runs the
packaged GGUF rewritten at that dtype (models/gguf_precision.py): the weights our target runs.
A stage is skipped when its report exists (delete it to redo). Needs the optional extra:
`pip install 'draftsmith[llamacpp]'`.

Writes <work>/results.json, benchmarks/results/bench_llamacpp.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import sections
from bench_drafters import bench_out, cli

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_llamacpp:begin -->", "<!-- bench_llamacpp:end -->"
PLAIN, PEER = "none", "llamacpp:generate"


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-llamacpp")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    t_all = time.perf_counter()
    res: dict = {"runs": {}}
    for dt in args.dtypes.split(","):
        out = args.work / dt
        if not (out / "report.json").is_file():
            cli("bench", "--dtype", dt, "--threads", str(args.threads), "--drafter", "ngram", "--drafter", args.drafter,
                "--workload", "humaneval", "--concurrency", "1", "--requests", str(args.requests),
                "--max-tokens", str(args.tokens), "--warmup", "1", "--temperature", "0", "--peers", "llamacpp",
                *bench_out(out))  # (a stage killed before its report resumes)
        res["runs"][dt] = collect(json.loads((out / "report.json").read_text()))
    res["setup"] = {"drafter": args.drafter, "requests": args.requests, "tokens": args.tokens, "threads": args.threads,
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "wall_s": round(time.perf_counter() - t_all),
                    "loadavg_end": os.getloadavg()}
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "results.json").write_text(json.dumps(res, indent=1))
    dest = ROOT / "benchmarks" / "results" / "bench_llamacpp.json"
    dest.write_text(json.dumps(res, indent=1))
    print(f"wrote {dest}")
    md = markdown(res)
    print(md)
    if not args.no_md:
        sections.write_section(BEGIN, END, md)
    return 0


def collect(rep: dict) -> dict:
    """Ours (tokens/s, speedup vs our plain, τ, outputs = plain) and the peers (tokens/s,
    ours ÷ theirs overall and per request, outputs = our plain)."""
    rows = {r["label"]: r for r in rep["tiers"][0]["results"]}
    ours = {lab: {"tokens_per_s": r["system_tokens_per_s"], "speedup": r["speedup"], "tau": r["tau"],
                  "void": r.get("void")} for lab, r in rows.items() if r.get("kind", "") != "peer"
            and not lab.startswith(("llamacpp:", "hf:"))}
    peers = {}
    for p in rep["peers"]["peers"]:
        peers[p["label"]] = {"tokens_per_s": p["system_tokens_per_s"], "ours_vs_peer": p["ours_vs_peer"],
                             "ours_vs_peer_per_request": p["ours_vs_peer_per_request"],
                             "same_output_as_our_plain": p.get("same_output_as_our_baseline"),
                             "info": {**p["info"], "gguf": Path(p["info"]["gguf"]).name}}  # no machine paths
    return {"ours": ours, "peers": peers, "bandwidth": rep.get("machine", {}).get("mem_bandwidth_gbs")}


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = ["## Draftsmith vs llama.cpp, same weights and precision (issue 11)", "",
             f"`benchmarks/bench_llamacpp.py` (JSON: `benchmarks/results/bench_llamacpp.json`). Machine: {s['machine']}, "
             f"{s['threads']} threads for both engines, batch 1 (concurrency 1, closed loop), T = 0, "
             f"{s['requests']} held-out HumanEval requests × {s['tokens']} new tokens, chat template, prefill included. "
             "One `draftsmith bench --peers llamacpp` run per dtype: every configuration on the same prompt token ids, "
             "interleaved in one process. llama.cpp (llama-cpp-python, built from source by pip) runs the packaged "
             "Q4_1 GGUF rewritten at the dtype (every tensor dequantized: the weights our target runs). "
             f"Wall time {s['wall_s']} s; load average at the end {', '.join(f'{x:.1f}' for x in s['loadavg_end'])}.", "",
             "| dtype | configuration | tokens/s | ÷ our plain | ÷ llama.cpp plain (per-request median) | τ | "
             "outputs = our plain |", "|---|---|---|---|---|---|---|"]
    for dt, r in res["runs"].items():
        peer = r["peers"].get(PEER, {})
        base = r["ours"].get(PLAIN, {}).get("tokens_per_s")
        for lab, o in r["ours"].items():
            vs = peer.get("ours_vs_peer", {}).get(lab)
            per = (peer.get("ours_vs_peer_per_request", {}).get(lab) or {}).get("median")
            same = "–" if lab == PLAIN else ("no (void)" if o.get("void") else "yes")
            name = "Draftsmith plain" if lab == PLAIN else f"Draftsmith {lab}"
            lines.append(f"| {dt} | {name} | {_f(o['tokens_per_s'], 1)} | {_f(o['speedup'])} | {_f(vs)} ({_f(per)}) | "
                         f"{_f(o['tau'])} | {same} |")
        for lab, p in r["peers"].items():
            eq = p.get("same_output_as_our_plain") or {}
            lines.append(f"| {dt} | {lab} | {_f(p['tokens_per_s'], 1)} | {_f(p['tokens_per_s'] / base if base else None)} | "
                         f"{_f(p['tokens_per_s'] / peer['tokens_per_s'] if peer.get('tokens_per_s') else None)} | – | "
                         f"{eq.get('equal', '–')}/{eq.get('compared', '–')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

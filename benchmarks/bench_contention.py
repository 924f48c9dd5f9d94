"""Plain decoding beside a busy process: the thread policies side by side (issue 11, item 2).

    .venv/bin/python benchmarks/bench_contention.py [--tokens 128] [--rounds 2] [--no-write]

A victim process decodes one held-out HumanEval prompt greedily (`LLM.generate`, default target,
float32) and reports ms/token, prefill included; first alone, then beside a load process: a real
`draftsmith regen` at batch 64 (whole multi-turn conversations, contexts up to 2,048 tokens: the
kind of neighbour that keeps every core busy with long parallel regions). Victim policies:

- fixed: `LLM(threads=<physical cores>)`, the default before the thread governor;
- adaptive: `LLM()` (threads not given: models/threads.ThreadGovernor, every 2 s, the cores the
  rest of the machine leaves free; the first 2 s run at all cores, inside the measurement);
- passive: fixed, with OMP_WAIT_POLICY=PASSIVE (threads sleep at once when they wait);
- one thread: `LLM(threads=1)`.

The load runs with its threads fixed (`--threads <cores>`, the old default) for the fixed,
passive and one-thread victims, and with its default (adaptive) for the adaptive victim: the
before and after of two Draftsmith processes sharing a machine. Each victim runs `--rounds`
times per condition, interleaved; medians. Writes its section of BENCHMARKS.md (per CPU kind) and
benchmarks/results/bench_contention[-kind].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sections

ROOT = Path(__file__).resolve().parents[1]
VICTIM = r'''
import json, sys, time
from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource
threads, tokens = (None if sys.argv[1] == "auto" else int(sys.argv[1])), int(sys.argv[2])
llm = LLM("smollm2-135m", threads=threads)
conv = next(iter(HumanEvalSource().conversations(split="heldout")))
ids = llm.apply_chat_template([{"role": "user", "content": conv.messages[0]["content"]}])
llm.generate([ids], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
t = time.perf_counter()
out = llm.generate([ids], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)[0]
wall = time.perf_counter() - t
gov = llm.engine.governor
print(json.dumps({"ms_per_token": 1e3 * wall / len(out.token_ids), "tokens": len(out.token_ids),
                  "threads_at_end": gov.threads if gov is not None else threads}))
'''


def victim(threads: str, tokens: int, env: dict[str, str]) -> dict:
    p = subprocess.run([sys.executable, "-c", VICTIM, threads, str(tokens)], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=1800, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"victim failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def start_load(out: Path, threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "draftsmith", "regen", "--mix", "code:0.4,chat:0.6", "--split", "train",
           "--max-samples", "2000", "--batch-size", "64", "--max-tokens", "256", "--seed", "3", "--out", str(out),
           "--no-progress"] + (["--threads", str(threads)] if threads else [])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    time.sleep(40)  # model load, the first prefills: the load is decoding 64 rows by then
    if p.poll() is not None:
        raise SystemExit("the load process (draftsmith regen) ended early")
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from draftsmith.models.threads import physical_cores

    cores = physical_cores()
    policies = {"fixed": (str(cores), {}), "adaptive": ("auto", {}),
                "passive": (str(cores), {"OMP_WAIT_POLICY": "PASSIVE"}), "one thread": ("1", {})}
    runs: dict[tuple[str, str], list[dict]] = {}
    load0, t0 = os.getloadavg(), time.time()
    for _ in range(args.rounds):
        for name, (th, env) in policies.items():
            runs.setdefault(("alone", name), []).append(victim(th, args.tokens, env))
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as d:
        for load_threads, names in ((cores, ["fixed", "passive", "one thread"]), (None, ["adaptive"])):
            load = start_load(Path(d) / f"load-{load_threads}.jsonl", load_threads)
            try:
                for _ in range(args.rounds):
                    for name in names:
                        th, env = policies[name]
                        runs.setdefault(("beside regen", name), []).append(victim(th, args.tokens, env))
            finally:
                load.kill()
                load.wait()
    rows = []
    for (cond, name), rs in runs.items():
        rows.append({"condition": cond, "policy": name, "ms_per_token": round(statistics.median(r["ms_per_token"] for r in rs), 1),
                     "runs": [round(r["ms_per_token"], 1) for r in rs], "threads_at_end": [r["threads_at_end"] for r in rs]})
    tag, title = sections.cpu_kind()
    result = {"cores": cores, "tokens": args.tokens, "rounds": args.rounds, "rows": rows,
              "load_before": load0[0], "wall_s": round(time.time() - t0)}
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / f"benchmarks/results/bench_contention{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if args.no_write:
        return
    by = {(r["condition"], r["policy"]): r for r in rows}
    lines = [f"## Plain decoding beside a busy process: thread policies (issue 11){title}", "",
             f"`benchmarks/bench_contention.py` (JSON: `benchmarks/results/bench_contention{tag}.json`): {cores} physical "
             f"cores; a victim process decodes one held-out HumanEval prompt greedily ({args.tokens} tokens, default "
             "target, float32, prefill included), alone and beside `draftsmith regen` at batch 64 (whole conversations); "
             f"medians of {args.rounds} runs, interleaved. The load's threads: fixed at the cores beside the fixed, "
             f"passive and one-thread victims; its default (adaptive) beside the adaptive victim. {result['wall_s']} s in all.",
             "", "| victim threads | alone ms/token | beside regen ms/token | × alone | runs beside | threads at the end |",
             "|---|---|---|---|---|---|"]
    for name in policies:
        a, b = by[("alone", name)], by[("beside regen", name)]
        lines.append(f"| {name} | {a['ms_per_token']} | {b['ms_per_token']} | {b['ms_per_token'] / a['ms_per_token']:.1f} | "
                     f"{', '.join(map(str, b['runs']))} | {', '.join(map(str, b['threads_at_end']))} |")
    begin, end = f"<!-- bench_contention{tag}:begin -->", f"<!-- bench_contention{tag}:end -->"
    sections.write_section(begin, end, "\n".join(lines))


if __name__ == "__main__":
    main()

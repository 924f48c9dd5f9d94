"""Two draft-length policies for one drafter at batch 1, plain decoding side by side, in one process.

    .venv/bin/python benchmarks/ab_policy.py [--drafter dspark:smollm2-135m] [--k 7]
        [--base prefix-scheduler:stop_drafting=false] [--policy prefix-scheduler]
        [--workloads humaneval,mtbench] [--prompts 8] [--tokens 128] [--temperature 0] [--rounds 3]
        [--interleave prompt|pass] [--dtype float32] [--burst ON,OFF] [--section NAME]
        [--out benchmarks/results/ab_policy.json] [--no-md]

Three engines on the default target share one KV cache: plain decoding, the drafter under --base
and under --policy. Every round of the measurement runs each engine over the same held-out prompts
(batch 1, one request at a time; seeded per prompt when --temperature > 0). By default
(--interleave prompt) a round runs each prompt on the three engines before the next prompt, the
engines' order rotating from prompt to prompt, so that the runs compared are seconds apart (this
VM's speed drifts from one minute to the next); --interleave pass runs each engine over all the
prompts in turn, the order of the engines reversed every other round. Reported per workload:
the median wall time of a round of the measurement (each request's first step, its prefill and
first round, excluded) and its ratio to plain's, the median drafting time of a step that drafted,
the steps that drafted, and
whether the outputs of the two policies are identical (a policy changes the work, never a greedy
or seeded output) and equal to plain's. The JSON goes to --out, and the table to its own section of
BENCHMARKS.md (one per kind of CPU and target dtype, as bench_runtime's) unless --no-md.

--burst ON,OFF runs a load beside the measurement, the whole time: one process that keeps a core
busy for ON seconds, then sleeps OFF seconds, and again (another tenant on a shared machine;
what the prefix scheduler's online cost model must ride out). --section NAME names the JSON
and the BENCHMARKS.md section apart from the default one (ab_policy-NAME<cpu kind>).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import sections
import torch

from draftsmith.bench.workload import load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.profile import cpu_model


def run(engine, prompts: list[list[int]], tokens: int, temperature: float, first_seed: int = 0) -> dict:
    """One pass over the prompts: outputs, wall seconds of the decoding steps, drafting times, and
    per decoding step (wall seconds, its engine.last_step) for a closer look (ab_step_split.py).
    With temperature > 0, prompt i is seeded first_seed + i."""
    outs, wall, drafting, steps, per_step = [], 0.0, [], 0, []
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=temperature,
                                             seed=first_seed + i if temperature > 0 else None))
        first = True
        while engine.has_unfinished():
            t0 = time.perf_counter()
            done = engine.step()
            dt = time.perf_counter() - t0
            outs.extend(list(s.output_ids) for s in done)
            if first:  # the prefill and its round
                first = False
                continue
            wall, steps = wall + dt, steps + 1
            per_step.append((dt, engine.last_step))
            if engine.last_step.drafted:
                drafting.append(engine.last_step.draft_s)
    return {"outputs": outs, "wall_s": wall, "steps": steps, "drafting_s": drafting, "per_step": per_step}


BURST = "import time\nwhile True:\n    t = time.time()\n    while time.time() - t < {on}:\n        pass\n    time.sleep({off})\n"


def burst_seconds(spec: str) -> tuple[float, float]:
    """--burst ON,OFF -> (busy seconds > 0, idle seconds >= 0)."""
    try:
        on, off = (float(x) for x in spec.split(","))
    except ValueError:
        on, off = 0.0, -1.0
    if not (on > 0 and off >= 0):
        raise SystemExit(f"--burst {spec!r}: expected ON,OFF seconds (busy > 0, idle >= 0), e.g. 8,8")
    return on, off


def burst(on: float, off: float) -> subprocess.Popen:
    """A process that keeps one core busy `on` seconds, then sleeps `off` seconds, until killed."""
    return subprocess.Popen([sys.executable, "-c", BURST.format(on=on, off=off)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--k", type=int, default=7, help="drafts per round asked of the drafter")
    ap.add_argument("--base", default="prefix-scheduler:stop_drafting=false")
    ap.add_argument("--policy", default="prefix-scheduler")
    ap.add_argument("--workloads", default="humaneval,mtbench")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interleave", choices=("prompt", "pass"), default="prompt",
                    help="prompt: every engine runs a prompt before the next prompt (drift-robust); "
                         "pass: every engine runs all prompts in turn")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores)")
    ap.add_argument("--dtype", default="float32", help="the target's (and the drafter's) dtype: float32 or bfloat16")
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: benchmarks/results/ab_policy<cpu kind>.json)")
    ap.add_argument("--burst", default=None, metavar="ON,OFF",
                    help="a load beside the measurement: one core busy ON s, idle OFF s, repeated")
    ap.add_argument("--section", default="", help="results and BENCHMARKS.md section under this name")
    ap.add_argument("--no-md", action="store_true", help="leave BENCHMARKS.md alone")
    args = ap.parse_args()
    load_s = burst_seconds(args.burst) if args.burst else None
    tag, kind = sections.cpu_kind()
    dtag = "" if args.dtype in ("float32", "fp32") else f"-{args.dtype}"
    name = f"ab_policy-{args.section}" if args.section else "ab_policy"
    args.out = args.out or Path(__file__).parent / "results" / f"{name}{tag}{dtag}.json"
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target("smollm2-135m", dtype=args.dtype)
    plain = build_engine(target, "none", FixedK(0), 0, 1, 2048)
    engines = {"plain": plain,
               "base": build_engine(target, args.drafter, args.base, args.k, 1, 2048, cache=plain.cache),
               "policy": build_engine(target, args.drafter, args.policy, args.k, 1, 2048, cache=plain.cache)}
    result = {"setup": {**{k: v for k, v in vars(args).items() if k != "out"}, "out": shown(args.out),
                        "machine": cpu_model(), "cpu_kind": kind.lstrip(", ") or "AVX-512 + BF16 CPU",
                        "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                        "loadavg_start": os.getloadavg()},
              "workloads": {}}
    load = burst(*load_s) if load_s else None
    try:
        measure(args, engines, target, result)
    finally:
        if load is not None:
            load.kill()
    result["setup"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_md:
        marker = f"{name}{tag.replace('-', ':')}{dtag.replace('-', ':')}"
        sections.write_section(f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->", markdown(result, args, kind))


def measure(args, engines: dict, target, result: dict) -> None:
    """Every workload: the rounds of the three engines, and its row of the results."""
    for wl in args.workloads.split(","):
        w = load_workload(wl, None, args.prompts, max_prompt_tokens=1024,
                          tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
        prompts = [list(p.token_ids) for p in w.prompts]
        runs: dict[str, list[dict]] = {k: [] for k in engines}
        for r in range(args.rounds):
            for name, x in one_round(engines, prompts, args.tokens, args.temperature, r, args.interleave).items():
                runs[name].append(x)
                print(f"{wl} round {r} {name:6s} {x['wall_s']:6.2f} s, {x['steps']} steps, "
                      f"{len(x['drafting_s'])} drafted", flush=True)
        plain_s = statistics.median(x["wall_s"] for x in runs["plain"])
        row = {"prompts": len(prompts), "plain_s": plain_s}
        for name in ("base", "policy"):
            xs = runs[name]
            wall = statistics.median(x["wall_s"] for x in xs)
            row[name] = {"spec": getattr(args, name), "wall_s": wall, "x_plain": plain_s / wall,
                         "per_round_x_plain": [p["wall_s"] / x["wall_s"] for p, x in zip(runs["plain"], xs)],
                         "drafting_ms_median": 1e3 * statistics.median(d for x in xs for d in x["drafting_s"])
                         if any(x["drafting_s"] for x in xs) else None,
                         "drafting_rounds": [len(x["drafting_s"]) for x in xs],
                         "steps": [x["steps"] for x in xs]}
        outs = {k: v[0]["outputs"] for k, v in runs.items()}
        row["same_outputs"] = all(x["outputs"] == outs[k] for k, v in runs.items() for x in v) and \
            outs["base"] == outs["policy"]
        row["equal_to_plain"] = outs["policy"] == outs["plain"] and outs["base"] == outs["plain"]
        result["workloads"][wl] = row
        print(f"{wl}: plain {plain_s:.2f} s; base {row['base']['x_plain']:.3f}x plain "
              f"(drafting {row['base']['drafting_ms_median']} ms); policy {row['policy']['x_plain']:.3f}x "
              f"(drafting {row['policy']['drafting_ms_median']} ms); same outputs {row['same_outputs']}, "
              f"equal to plain {row['equal_to_plain']}", flush=True)


def one_round(engines: dict, prompts: list[list[int]], tokens: int, temperature: float, r: int,
              interleave: str = "prompt") -> dict[str, dict]:
    """Round r of every engine over the prompts. interleave "pass": each engine runs all prompts
    in turn (the order of the engines reversed every other round). "prompt": each prompt runs on
    every engine before the next prompt (the order rotating from prompt to prompt), so the runs
    compared are seconds apart, not a pass apart: on a VM whose speed drifts from one minute to
    the next (stop 57: plain decoding's median step 27.4 and 31.1 ms in two passes) the
    pass-level ratios move with the drift, the prompt-level ones much less."""
    names = list(engines)
    if interleave == "pass":
        return {n: run(engines[n], prompts, tokens, temperature)
                for n in (names if r % 2 == 0 else names[::-1])}
    parts: dict[str, list[dict]] = {n: [] for n in names}
    for i, p in enumerate(prompts):
        k = (i + r) % len(names)
        for n in names[k:] + names[:k]:
            parts[n].append(run(engines[n], [p], tokens, temperature, first_seed=i))
    return {n: merged(xs) for n, xs in parts.items()}


def merged(xs: list[dict]) -> dict:
    """run()'s results of consecutive single prompts as one pass's."""
    return {"outputs": [o for x in xs for o in x["outputs"]], "wall_s": sum(x["wall_s"] for x in xs),
            "steps": sum(x["steps"] for x in xs), "drafting_s": [d for x in xs for d in x["drafting_s"]],
            "per_step": [s for x in xs for s in x["per_step"]]}


def shown(path: Path) -> str:
    """A path as BENCHMARKS.md names it: relative to the repository when inside it."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return path.name


def markdown(res: dict, args, kind: str) -> str:
    """The BENCHMARKS.md section of one run: per workload, both policies against plain."""
    s = res["setup"]
    lines = [f"## Draft-length policies side by side: `{s['base']}` vs `{s['policy']}` (issues 11, 12){kind}"
             f"{'' if s['dtype'] == 'float32' else ', ' + s['dtype'] + ' target'}"
             f"{', beside a load' if s.get('burst') else ''}", "",
             f"`benchmarks/ab_policy.py --drafter {s['drafter']} --k {s['k']} --base {s['base']} --policy {s['policy']} "
             f"--workloads {s['workloads']} --prompts {s['prompts']} --tokens {s['tokens']} --temperature {s['temperature']} "
             f"--rounds {s['rounds']} --interleave {s.get('interleave', 'pass')}{'' if s['dtype'] == 'float32' else ' --dtype ' + s['dtype']}"
             f"{' --burst ' + s['burst'] if s.get('burst') else ''}{' --section ' + s['section'] if s.get('section') else ''}` "
             f"on {s['date']} (JSON: `{shown(Path(args.out))}`). {s['machine']}, "
             f"{s['cpus']} CPUs, {s['threads']} torch threads, {s['dtype']} target smollm2-135m, batch 1, held-out prompts. "
             "Plain decoding and the drafter under both policies share one process and one KV cache; each round runs "
             + ("the three over the same prompts, each prompt on all three before the next (their order rotating "
                "from prompt to prompt). " if s.get("interleave") == "prompt" else
                "the three over the same prompts, one pass each, the order reversed every other round. ")
             + "Wall time: the decoding steps of "
             "a round, each request's first step (prefill) excluded; the median over rounds, and the ratio plain / "
             "policy of each round (> 1: faster than plain). Drafting: the median time of a step that drafted. "
             + (f"A load ran beside it the whole time (--burst {s['burst']}: one process keeping a core busy "
                f"{s['burst'].split(',')[0]} s, then idle {s['burst'].split(',')[1]} s, repeated). " if s.get('burst') else "")
             + f"Load average {s['loadavg_start'][0]:.2f} at the start, {s['loadavg_end'][0]:.2f} at the end.", "",
             "| workload | prompts | plain s | policy | s | × plain (median) | × plain per round | drafting ms | "
             "steps that drafted (per round) | steps | outputs: same both policies / = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for wl, row in res["workloads"].items():
        for name in ("base", "policy"):
            r = row[name]
            ms = "–" if r["drafting_ms_median"] is None else f"{r['drafting_ms_median']:.2f}"
            lines.append(f"| {wl} | {row['prompts']} | {row['plain_s']:.2f} | `{r['spec']}` | {r['wall_s']:.2f} | "
                         f"**{r['x_plain']:.3f}** | {' / '.join(f'{x:.2f}' for x in r['per_round_x_plain'])} | {ms} | "
                         f"{' / '.join(map(str, r['drafting_rounds']))} | {' / '.join(map(str, r['steps']))} | "
                         f"{'yes' if row['same_outputs'] else '**no**'} / {'yes' if row['equal_to_plain'] else '**no**'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

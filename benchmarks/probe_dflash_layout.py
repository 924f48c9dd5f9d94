"""DFlash's two block layouts at equal steps, same data (issue 12): anchor-first vs mask-first.

    .venv/bin/python benchmarks/probe_dflash_layout.py --cache CACHE --eval-cache HELDOUT_CACHE
        [--steps 2400] [--work runs/dflash-layout] [--prompts 8] [--no-write]

Trains recipes/smollm2-135m-dflash.yaml twice for the same number of optimizer steps (same seed,
data, feature cache, schedule), once per `drafter.layout`, one after the other, then:

- teacher-forced held-out scores at every checkpoint (train/evaluate.py, fixed anchors on the
  --eval-cache conversations): `acc@1` / `acc` = top-1 agreement with the data token at the first
  block position / over all positions;
- `draftsmith eval` of both drafters side by side in one run: τ at T = 0 with γ = 7 on held-out
  HumanEval and MT-Bench prompts, conditional acceptance per position.

Equal steps, not equal minutes: the two layouts cost the same per step (γ + 1 vs γ block inputs),
and steps make the comparison independent of what else runs on the machine. A finished run in
--work is reused. Writes benchmarks/results/probe_dflash_layout.json and its BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import sections
from bench_drafters import cli, eval_out

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- probe_dflash_layout:begin -->", "<!-- probe_dflash_layout:end -->"
LAYOUTS = ("anchor-first", "mask-first")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--eval-cache", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "dflash-layout")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per task for draftsmith eval")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    res: dict = {}
    runs = {}
    for layout in LAYOUTS:
        out = runs[layout] = args.work / f"dflash-{layout}"
        info = out / "train_info.json"
        if not (info.is_file() and json.loads(info.read_text())["step"] >= args.steps):
            cli("train", "--config", "recipes/smollm2-135m-dflash.yaml", *(["--resume"] if out.is_dir() else []),
                f"out={out}", f"drafter.layout={layout}", f"data.cache={args.cache}",
                f"data.eval_cache={args.eval_cache}", "data.eval_samples=24", "train.budget_minutes=null",
                f"train.max_steps={args.steps}", f"train.save_every={args.steps // 4}")
        rows = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines() if x.strip()]
        res[layout] = {"steps": json.loads(info.read_text())["step"], "heldout": rows}
    report = args.work / "eval"
    if not (report / "report.json").is_file():
        cli("eval", *[a for layout in LAYOUTS for a in ("--drafter", f"dflash:{runs[layout]}")],
            "--temperature", "0", "--block-size", "7", "--max-prompts", str(args.prompts), *eval_out(report))
    res["eval"] = json.loads((report / "report.json").read_text())
    res["setup"] = {"steps": args.steps, "prompts": args.prompts, "cache": str(args.cache),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "loadavg_end": os.getloadavg()}
    (ROOT / "benchmarks" / "results" / "probe_dflash_layout.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    print(text)
    if not args.no_write:
        sections.write_section(BEGIN, END, text)
    return 0


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = ["## DFlash block layouts: anchor-first vs mask-first, equal steps (issue 12)", "",
             f"`benchmarks/probe_dflash_layout.py --steps {s['steps']}`: recipes/smollm2-135m-dflash.yaml "
             f"(2 draft layers, draft vocabulary 8192, CE loss) for {s['steps']} steps per layout on the same "
             f"feature cache ({s['cache']}), one after the other. Machine: {s['machine']}.", "",
             "Teacher-forced on the held-out conversations (top-1 agreement with the data token):", "",
             "| step | " + " | ".join(f"{lay} acc@1 | {lay} acc" for lay in LAYOUTS) + " |",
             "|---|" + "---|---|" * len(LAYOUTS)]
    by_step = {lay: {r["step"]: r for r in res[lay]["heldout"]} for lay in LAYOUTS}
    for step in sorted(set.intersection(*(set(v) for v in by_step.values()))):
        cells = []
        for lay in LAYOUTS:
            r = by_step[lay][step]
            cells += [f"{r.get('acc@1', float('nan')):.3f}", f"{r.get('acc', float('nan')):.3f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", f"`draftsmith eval`, both in one run: T = 0, γ = 7, {s['prompts']} held-out prompts per task:", "",
              "| layout | τ HumanEval | τ MT-Bench | τ all | conditional acceptance, positions 1 / 2 / 3 |",
              "|---|---|---|---|---|"]
    for lay, d in zip(LAYOUTS, res["eval"]["drafters"]):
        tau = {t: d["tasks"][t]["tau"] for t in d["tasks"]}
        cond = d["overall"].get("conditional_acceptance") or []
        lines.append(f"| {lay} | {tau.get('humaneval', float('nan')):.2f} | {tau.get('mtbench', float('nan')):.2f} | "
                     f"{d['overall']['tau']:.2f} | " + " / ".join(f"{c:.2f}" for c in cond[:3]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Equal-time probes for the built-in drafter's recipe (issue 12, item 3): τ per training minute.

    .venv/bin/python benchmarks/probe_builtin.py --cache CACHE --eval-cache HELDOUT_CACHE [--minutes 4]
        [--work runs/builtin-probes] [--no-write]

Trains the DSpark recipe (recipes/smollm2-135m-dspark.yaml, draft vocabulary 8192, rank 96) for
--minutes of wall clock in three variants, one after the other on the same data, and scores
each on the same held-out windows (train/evaluate.py, fixed anchors):

    A  the recipe (the paper's loss: 0.1 CE + 0.9 TV + conf, position decay γ)
    B  A + kl_weight 1.0 + position_decay 4 (DeepSpec's)
    C  B + init_from_target (draft layers start as the target's last two)

Held-out numbers are teacher-forced: `greedy` = the draft's argmax is the target's (T = 0
acceptance of a position whose prefix was accepted), `accept` = mean 1 − TV (the same at T = 1).
Writes benchmarks/results/probe_builtin.json and its BENCHMARKS.md section. Idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import sections
from bench_drafters import cli

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- probe_builtin:begin -->", "<!-- probe_builtin:end -->"
VARIANTS = {
    "A": [],
    "B": ["drafter.kl_weight=1.0", "drafter.position_decay=4.0"],
    "C": ["drafter.kl_weight=1.0", "drafter.position_decay=4.0", "drafter.init_from_target=true"],
}
LABELS = {"A": "recipe (paper loss)", "B": "+ KL, decay 4", "C": "+ KL, decay 4, init from target"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--eval-cache", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "builtin-probes")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    common = [f"data.cache={args.cache}", f"data.eval_cache={args.eval_cache}", "data.eval_samples=48",
              "drafter.draft_vocab_size=8192", "drafter.rank=96", "train.save_every=100000", "train.log_every=50"]
    res = {}
    for name, extra in VARIANTS.items():
        out = args.work / name
        if not (out / "heldout.jsonl").is_file():
            cli("train", "--config", "recipes/smollm2-135m-dspark.yaml", "--budget", f"{args.minutes:g}",
                f"out={out}", *common, *extra, "--overwrite")
        rows = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines() if x.strip()]
        info = json.loads((out / "train_info.json").read_text())
        res[name] = {"steps": info["step"], "heldout": rows[-1], "overrides": extra}
    res["setup"] = {"minutes": args.minutes, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
                    "loadavg_end": os.getloadavg()}
    (ROOT / "benchmarks" / "results" / "probe_builtin.json").write_text(json.dumps(res, indent=1))
    if not args.no_write:
        sections.write_section(BEGIN, END, markdown(res))
    return 0


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = ["## Recipe probes for the built-in drafter: equal time, same data (issue 12)", "",
             f"`benchmarks/probe_builtin.py --minutes {s['minutes']:g}`: the DSpark recipe (draft vocabulary 8192, "
             f"rank 96) for {s['minutes']:g} minutes each, one after the other; held-out numbers teacher-forced on "
             "the same 48 held-out conversations. Machine: " + s["machine"] + ".", "",
             "| variant | steps | held-out greedy agreement (T = 0) | first position | accept (1 − TV, T = 1) |",
             "|---|---|---|---|---|"]
    for name in VARIANTS:
        r = res[name]
        h = r["heldout"]
        lines.append(f"| {LABELS[name]} | {r['steps']} | {h.get('greedy', float('nan')):.3f} | "
                     f"{h.get('greedy@1', float('nan')):.3f} | {h.get('accept', float('nan')):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

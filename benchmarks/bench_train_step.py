"""Training throughput: milliseconds per optimizer step of each recipe, fp32 vs bf16 autocast,
and with / without the target statistics computed once per window (issue 12, item 2).

    .venv/bin/python benchmarks/bench_train_step.py --cache runs/builtin/cache [--steps 12]
        [--max-samples 200] [--no-write]

Each recipe (recipes/smollm2-135m-{eagle3,dflash,dspark}.yaml, its batch and anchors as
written) runs 3 warm-up steps and then `--steps` timed steps on the same cached batches, in
one process, interleaved in rounds, the order rotated each round (medians): train.dtype=fp32, bf16 with the target's full-vocabulary distribution at every
step (the path before the statistics), and the trainer's own path (bf16, statistics computed for
every window first: their one-time cost is reported per 100 windows). Recipes whose loss does not
read the target's distribution have no statistics (both bf16 columns are then the same path).
Writes benchmarks/results/bench_train_step.json and its BENCHMARKS.md section. Idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sections

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

from draftsmith.models.target import cpu_has_fast_bf16
from draftsmith.train.config import load_train_config
from draftsmith.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench_train_step:begin -->", "<!-- bench_train_step:end -->"
KINDS = ("eagle3", "dflash", "dspark")


def prepare(recipe: Path, cache: Path, dtype: str, out: Path, stats: bool, max_samples: int):
    """A trainer after 3 warm-up steps, and its statistics' seconds per 100 windows (or None)."""
    cfg = load_train_config(recipe, [f"data.cache={cache}", f"out={out}", f"train.dtype={dtype}",
                                     f"data.max_samples={max_samples}", "data.eval_cache=null", "train.init_from=null",
                                     "train.progress=\"off\"", "train.tensorboard=\"off\""])
    tr = Trainer(cfg, overwrite=True)
    tr._setup()
    tr.total_steps = 1000
    tr._make_optimizer()
    per100 = None
    if stats:
        t0 = time.perf_counter()
        tr._share_target_stats()
        if tr.data.target_stats is not None:
            per100 = (time.perf_counter() - t0) / len(tr.data.windows) * 100
    for s in range(3):
        tr._forward_backward(s)
        tr._optimizer_step()
    return tr, per100


def timed(tr: Trainer, first: int, steps: int) -> float:
    t0 = time.perf_counter()
    for s in range(first, first + steps):
        tr._forward_backward(s)
        tr._optimizer_step()
    return (time.perf_counter() - t0) / steps * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, required=True, help="a feature cache with layers 1, 14, 27")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (medians over them)")
    ap.add_argument("--max-samples", type=int, default=200, help="cache samples read (bounds the statistics' cost)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            recipe = ROOT / "recipes" / f"smollm2-135m-{kind}.yaml"
            cols = {"fp32": ("fp32", True), "bf16_full": ("bf16", False), "bf16": ("bf16", True)}
            runs = {c: prepare(recipe, args.cache, dt, Path(tmp) / f"{kind}-{c}", st, args.max_samples)
                    for c, (dt, st) in cols.items()}
            times: dict[str, list[float]] = {c: [] for c in cols}
            per = max(1, args.steps // args.rounds)
            names_ = list(cols)
            for r in range(args.rounds):  # interleaved, the order rotated each round: drift and order fall alike
                for c in names_[r % 3:] + names_[:r % 3]:
                    times[c].append(timed(runs[c][0], 3 + r * per, per))
            rows[kind] = {c: round(statistics.median(v), 1) for c, v in times.items()}
            per100 = runs["bf16"][1]
            rows[kind]["stats_s_per_100_windows"] = None if per100 is None else round(per100, 2)
            del runs
            print(kind, rows[kind], flush=True)
    res = {"ms_per_step": rows, "steps": args.steps, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "bf16_hardware": cpu_has_fast_bf16(),
           "loadavg_end": os.getloadavg()}
    (ROOT / "benchmarks" / "results" / "bench_train_step.json").write_text(json.dumps(res, indent=1))
    if not args.no_write:
        names = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}
        lines = ["## Training throughput: fp32 vs bf16 autocast, target statistics (issue 12)", "",
                 f"`benchmarks/bench_train_step.py --cache {args.cache}` (JSON: "
                 f"`benchmarks/results/bench_train_step.json`). Machine: {res['machine']}, {res['threads']} torch "
                 f"threads, bf16 hardware: {res['bf16_hardware']}. Each recipe's own batch and anchors; "
                 f"{args.steps} timed steps after 3 warm-up steps, one process, the three columns interleaved in "
                 f"{args.rounds} rounds (medians). \"full vocabulary\": the target's "
                 "distribution from its whole lm_head at every step (before the statistics); \"statistics\": the "
                 "trainer's path, the rest log-sum-exp and argmax computed once per window (one-time cost in the last "
                 "column; – where the recipe's loss does not read the target's distribution).", "",
                 "| recipe | fp32 ms/step | bf16, full vocabulary | bf16, statistics | bf16 vs fp32 | statistics vs full "
                 "| statistics s / 100 windows |", "|---|---|---|---|---|---|---|"]
        for k, r in rows.items():
            st = r["stats_s_per_100_windows"]
            lines.append(f"| {names[k]} | {r['fp32']:.0f} | {r['bf16_full']:.0f} | {r['bf16']:.0f} | "
                         f"{r['fp32'] / r['bf16']:.2f}× | {r['bf16_full'] / r['bf16']:.2f}× | "
                         f"{'–' if st is None else f'{st:.1f}'} |")
        lines += ["", f"Load average at the end {res['loadavg_end'][0]:.1f}."]
        sections.write_section(BEGIN, END, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

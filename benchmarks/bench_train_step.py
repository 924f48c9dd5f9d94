"""Training throughput: milliseconds per optimizer step of each recipe, fp32 vs bf16 autocast
(issue 12, item 2).

    .venv/bin/python benchmarks/bench_train_step.py --cache runs/builtin/cache [--steps 12] [--no-write]

Each recipe (recipes/smollm2-135m-{eagle3,dflash,dspark}.yaml, its batch and anchors as
written) runs 3 warm-up steps and then `--steps` timed steps on the same cached batches, in
one process, once with train.dtype=fp32 and once with bf16, the two interleaved per recipe.
Writes benchmarks/results/bench_train_step.json and its BENCHMARKS.md section. Idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def ms_per_step(recipe: Path, cache: Path, dtype: str, steps: int, out: Path) -> float:
    cfg = load_train_config(recipe, [f"data.cache={cache}", f"out={out}", f"train.dtype={dtype}",
                                     "train.progress=\"off\"", "train.tensorboard=\"off\""])
    tr = Trainer(cfg, overwrite=True)
    tr._setup()
    tr.total_steps = 1000
    tr._make_optimizer()
    for s in range(3):
        tr._forward_backward(s)
        tr._optimizer_step()
    t0 = time.perf_counter()
    for s in range(3, 3 + steps):
        tr._forward_backward(s)
        tr._optimizer_step()
    return (time.perf_counter() - t0) / steps * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, required=True, help="a feature cache with layers 1, 14, 27")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            recipe = ROOT / "recipes" / f"smollm2-135m-{kind}.yaml"
            rows[kind] = {d: round(ms_per_step(recipe, args.cache, d, args.steps, Path(tmp) / f"{kind}-{d}"), 1)
                          for d in ("fp32", "bf16")}
            print(kind, rows[kind], flush=True)
    res = {"ms_per_step": rows, "steps": args.steps, "threads": torch.get_num_threads(),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "bf16_hardware": cpu_has_fast_bf16(),
           "loadavg_end": os.getloadavg()}
    (ROOT / "benchmarks" / "results" / "bench_train_step.json").write_text(json.dumps(res, indent=1))
    if not args.no_write:
        names = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}
        lines = ["## Training throughput: fp32 vs bf16 autocast (issue 12)", "",
                 f"`benchmarks/bench_train_step.py --cache {args.cache}` (JSON: "
                 f"`benchmarks/results/bench_train_step.json`). Machine: {res['machine']}, {res['threads']} torch "
                 f"threads, bf16 hardware: {res['bf16_hardware']}. Each recipe's own batch and anchors; "
                 f"{args.steps} timed steps after 3 warm-up steps, one process.", "",
                 "| recipe | fp32 ms/step | bf16 ms/step | bf16 speedup |", "|---|---|---|---|"]
        for k, r in rows.items():
            lines.append(f"| {names[k]} | {r['fp32']:.0f} | {r['bf16']:.0f} | {r['fp32'] / r['bf16']:.2f}× |")
        lines += ["", f"Load average at the end {res['loadavg_end'][0]:.1f}."]
        sections.write_section(BEGIN, END, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

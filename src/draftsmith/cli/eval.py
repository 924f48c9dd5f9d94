"""`draftsmith calibrate` and `draftsmith eval` (Verify): drafters against the target on held-out prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.cli.options import (
    add_drafter_dtype, add_job, add_max_tokens, add_progress, add_target_args, opt_auto, positive_int,
)
from draftsmith.drafters import registry
from draftsmith.errors import DraftsmithError

CALIBRATE_HELP = "fit Sequential Temperature Scaling on held-out data; store calibration.json"
CALIBRATE_EXAMPLE = "draftsmith calibrate --drafter dspark:runs/smollm2-135m-dspark --data data/heldout.jsonl"
EVAL_HELP = "τ, per-position acceptance and calibration of drafters on held-out prompts"
EVAL_EXAMPLE = ("draftsmith eval --drafter ngram --drafter dspark:runs/smollm2-135m-dspark "
                "--tasks humaneval,mtbench --temperature 1")


def add_calibrate_parser(sub) -> None:
    c = add_job(sub, "calibrate", CALIBRATE_HELP, CALIBRATE_EXAMPLE)
    add_target_args(c, dtype=False)
    c.add_argument("--drafter", required=True,
                   help=f"KIND:CHECKPOINT of a trainable kind ({', '.join(registry.trainable_kinds())}), "
                        "e.g. dspark:runs/smollm2-135m-dspark")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=Path, help="held-out regen JSONL (draftsmith regen --split heldout)")
    src.add_argument("--tasks", help="held-out prompts of these sources, e.g. humaneval,mtbench")
    _add_eval_run_args(c, max_prompts=16, seed=1)
    c.add_argument("--json", action="store_true", help="print the result as JSON")
    c.set_defaults(func=cmd_calibrate)


def add_eval_parser(sub) -> None:
    e = add_job(sub, "eval", EVAL_HELP, EVAL_EXAMPLE)
    add_target_args(e, dtype=False)
    e.add_argument("--drafter", action="append", required=True, help=f"{registry.usage()}; repeat to compare")
    e.add_argument("--tasks", default="humaneval,mtbench", help="comma-separated sources (held-out split only)")
    e.add_argument("--confidence-threshold", type=float, default=None,
                   help="verify only the prefix whose cumulative confidence stays >= this (default: off)")
    e.add_argument("--out", type=Path, default=Path("runs/eval"), help="report.json, report.md, PNG plots")
    e.add_argument("--overwrite", action="store_true", help="replace the report files an earlier eval left in --out")
    _add_eval_run_args(e, max_prompts=8, seed=0)
    e.add_argument("--json", action="store_true", help="print report.json to stdout")
    e.set_defaults(func=cmd_eval)


def _add_eval_run_args(p: argparse.ArgumentParser, max_prompts: int, seed: int) -> None:
    p.add_argument("--temperature", type=float, default=1.0, help="target sampling temperature (0 = greedy)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="draft tokens per round γ (default: the checkpoint's block size)")
    p.add_argument("--max-prompts", type=positive_int, default=max_prompts, help="per task")
    add_max_tokens(p, 128, "new tokens per turn")
    p.add_argument("--max-turns", type=positive_int, default=2, help="user turns replayed per conversation")
    p.add_argument("--max-batch", type=positive_int, default=4, help="requests decoded together")
    p.add_argument("--seed", type=int, default=seed, help="prompt-selection and sampling seed")
    p.add_argument("--bins", type=positive_int, default=10, help="calibration bins")
    add_drafter_dtype(p)
    add_progress(p)


def _tasks(spec: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in spec.split(",") if t.strip())
    if not tasks:
        raise DraftsmithError("--tasks is empty; e.g. --tasks humaneval,mtbench")
    return tasks


def cmd_calibrate(args) -> int:
    from draftsmith.eval.jobs import CalibrateOptions, run_calibrate

    res = run_calibrate(CalibrateOptions(
        target=args.target, drafter=args.drafter, data=args.data, tasks=_tasks(args.tasks) if args.tasks else (),
        temperature=args.temperature, block_size=args.block_size, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, max_turns=args.max_turns, seed=args.seed,
        n_bins=args.bins, device=opt_auto(args.device), drafter_dtype=args.drafter_dtype, progress=args.progress))
    if args.json:
        print(json.dumps(res))
    else:
        fmt = lambda xs: " ".join("–" if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"calibrate: {res['rounds']} held-out rounds ({res['requests']} requests); temperatures "
              f"{fmt(res['temperatures'])}; cumulative ECE per position {fmt(res['ece_before'])} -> "
              f"{fmt(res['ece_after'])} (in-sample) -> {res['calibration']}, applied to {res['regime']} requests",
              file=sys.stderr)
        if res["replaced_regime"] not in (None, res["regime"]):
            print(f"calibrate: this replaced the fit for {res['replaced_regime']} requests, which now use raw "
                  f"confidences (one fit per checkpoint: calibrate a copy to keep both)", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from draftsmith.eval.jobs import EvalOptions, print_summary, run_eval

    if args.temperature < 0:
        raise DraftsmithError(f"--temperature must be >= 0, got {args.temperature}")
    report = run_eval(EvalOptions(
        target=args.target, drafters=tuple(args.drafter), tasks=_tasks(args.tasks), temperature=args.temperature,
        block_size=args.block_size, confidence_threshold=args.confidence_threshold, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, max_turns=args.max_turns, seed=args.seed,
        n_bins=args.bins, out=args.out, overwrite=args.overwrite, device=opt_auto(args.device),
        drafter_dtype=args.drafter_dtype, progress=args.progress))
    if args.json:
        print(json.dumps(report))
    print_summary(report)
    print(f"eval: report -> {args.out / 'report.json'}, {args.out / 'report.md'}", file=sys.stderr)
    return 0

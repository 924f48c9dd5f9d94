"""What the prefix scheduler's cost model believes, round by round, against what its rounds measured
(issue 12: the serving tier at 4 rows).

    .venv/bin/python benchmarks/trace_step_cost.py [--concurrency 4] [--requests 32] [--passes 3]
        [--policy prefix-scheduler] [--drafter dspark:smollm2-135m] [--out runs/trace-step-cost.json]

Closed loop at --concurrency rows on held-out HumanEval prompts (64 new tokens, T = 0): plain decoding
and the drafter under --policy in one process, one KV cache, a pass each in turn (the order reversed
every other pass). After every round of the speculative engine it records the round (rows, verify
width, forward and drafting time, drafts accepted) and the policy's StepCost (policy/cost.py): the
machine factor, the predicted forward time at 1, 2 and 3 columns of this many rows and the drafting
time. Prints per pass the two engines' times, the measured median forward per width at full rows,
and the model's predicted ratio t(2 columns) / t(1 column), at the pass's end and its range, beside
the ratio of the measured medians: the ratio is what choose() weighs a one-draft verify by, so a
model whose ratio wanders from the measured one drafts where it loses (or the reverse).
A diagnostic, not a benchmark: one run's numbers, with the machine's noise in them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
from trace_tier_plans import closed_loop, engine_pair


def rounded(x):
    """x with every float in it rounded to 3 places (for printing)."""
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32, help="held-out HumanEval has 34: more would repeat prompts")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--policy", default="prefix-scheduler")
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/trace-step-cost.json"))
    args = ap.parse_args()
    C = args.concurrency
    plain, spec, w = engine_pair(C, args.drafter, args.policy, args.requests)
    cost = getattr(spec.policy, "cost", None)
    if cost is None:
        raise SystemExit(f"--policy {args.policy}: it has no online cost model to trace (try prefix-scheduler)")
    if w.reused:
        raise SystemExit(f"--requests {args.requests}: the held-out split has {len(w.prompts) - w.reused} prompts")
    prompts = [list(p.token_ids) for p in w.prompts]

    def run(engine, trace: list | None) -> float:
        def on_step(s, dt: float, admitted: bool) -> None:
            if trace is not None and s is not None and s.rows:
                trace.append({"rows": s.rows, "width": s.block_len, "forward_s": s.forward_s, "draft_s": s.draft_s,
                              "drafted": s.drafted, "accepted": s.accepted, "machine": cost.machine(),
                              "t1": cost.target_time(C), "t2": cost.target_time(2 * C), "t3": cost.target_time(3 * C),
                              "draft_time": cost.draft_time(C)})
        return closed_loop(engine, prompts, C, on_step)

    passes = []
    for p in range(args.passes):
        trace: list[dict] = []
        times = {}
        for name in (["plain", "spec"] if p % 2 == 0 else ["spec", "plain"]):
            times[name] = run(plain if name == "plain" else spec, trace if name == "spec" else None)
        full = [x for x in trace if x["rows"] == C]
        measured = {wd: 1e3 * statistics.median(x["forward_s"] for x in full if x["width"] == wd)
                    for wd in (1, 2, 3) if any(x["width"] == wd for x in full)}
        model = [x["t2"] / x["t1"] for x in full]
        row = {"pass": p, "plain_s": times["plain"], "spec_s": times["spec"], "x_plain": times["plain"] / times["spec"],
               "rounds_per_width": {wd: sum(1 for x in full if x["width"] == wd) for wd in sorted({x["width"] for x in full})},
               "measured_forward_ms": measured,
               "measured_t2_over_t1": measured[2] / measured[1] if 1 in measured and 2 in measured else None,
               "model_t2_over_t1_end": model[-1] if model else None,
               "model_t2_over_t1_range": [min(model), max(model)] if model else None,
               "accepted_per_width2_round": statistics.mean(x["accepted"] or 0 for x in full if x["width"] == 2)
               if any(x["width"] == 2 for x in full) else None}
        passes.append({**row, "rounds": trace})
        print(json.dumps(rounded(row)), flush=True)
    print("cost model at the end:", json.dumps(cost.summary()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": {k: str(v) for k, v in vars(args).items()}, "passes": passes}) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The prefix scheduler's plans against what its rounds realized, at one serving tier (issues 11, 12).

    .venv/bin/python benchmarks/trace_tier_plans.py [--concurrency 16] [--requests 48] [--rounds 2]
        [--policy prefix-scheduler] [--drafter dspark:smollm2-135m] [--out runs/trace-tier-plans.json]

Closed loop at --concurrency rows on held-out HumanEval prompts (64 new tokens, T = 0), plain
decoding and the drafter under --policy in one process, one KV cache, interleaved (order reversed
every other round). For every full round of the speculative engine (all rows in flight, no
admission in it) it records the plan choose() made (plan_best_prefix, plan_columns or
plan_replayed: its lengths and predicted gain, the running confidences at drafts 1 and 2, the
drafting time it assumed, the cost model's step times at 1-4 columns), the drafts trim()'s column
search expected to be accepted (the survivals of the columns it opened), the forward width that
ran, the drafts accepted, and the measured forward, drafting, backlog-consuming and round times.
Prints, per width, the median times and the realized gain of its rounds against the median plain
width round of the same run, i.e. what a drafting round gained where the plan promised a gain.
A diagnostic, not a benchmark: its ratios are one run's, and the machine's noise is in them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import draftsmith.policy.prefix_scheduler as ps
from draftsmith.bench.workload import load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK


def engine_pair(concurrency: int, drafter: str, policy: str, requests: int):
    """The default target's plain decoding and `drafter` under `policy` (K = 7) on one KV cache for
    `concurrency` rows, and the first `requests` held-out HumanEval prompts: (plain, spec, workload)."""
    target = load_target("smollm2-135m")
    plain = build_engine(target, "none", FixedK(0), 0, concurrency, 2048)
    spec = build_engine(target, drafter, policy, 7, concurrency, 2048, cache=plain.cache)
    w = load_workload("humaneval", None, requests, max_prompt_tokens=1024,
                      tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
    return plain, spec, w


def closed_loop(engine, prompts: list[list[int]], concurrency: int,
                on_step: Callable[[object, float, bool], None] | None = None) -> float:
    """Serve `prompts` closed loop (64 new tokens each, T = 0): `concurrency` in flight, a finished
    request replaced at once. After every step on_step(engine.last_step, its seconds, whether the
    step admitted a request). Returns the sum of the step times."""
    q, total = list(prompts), 0.0
    while q or engine.has_unfinished():
        admitted = False
        while q and engine.num_running + engine.num_waiting < concurrency:
            engine.add_request(q.pop(0), SamplingParams(max_tokens=64, temperature=0))
            admitted = True
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        total += dt
        if on_step is not None:
            on_step(engine.last_step, dt, admitted)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policy", default="prefix-scheduler")
    ap.add_argument("--drafter", default="dspark:smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("runs/trace-tier-plans.json"))
    args = ap.parse_args()
    C = args.concurrency
    plain, spec, w = engine_pair(C, args.drafter, args.policy, args.requests)
    prompts = [list(p.token_ids) for p in w.prompts]
    plans: list[dict] = []  # this step's plans: the first is choose()'s (a probe's ceiling check, trim's come after)
    depth = [0]  # (plan_replayed calls plan_columns without history: only the outer call is recorded)
    for name in ("plan_best_prefix", "plan_columns", "plan_replayed"):  # choose()'s planners, watched
        planner = getattr(ps, name)

        def watched(*a, _planner=planner, _replay=name == "plan_replayed", **k):
            depth[0] += 1
            try:
                ell, gain = _planner(*a, **k)
            finally:
                depth[0] -= 1
            if depth[0]:
                return ell, gain
            if _replay:  # (recent vectors first: the running estimates are its second argument)
                a = a[1:]
            conf, step_time, a = a[0], a[1], a[2:]
            plans.append({"gain": gain, "ell": ell, "conf1": [c[0] for c in conf if c],
                          "conf2": [c[1] for c in conf if len(c) > 1],
                          "step_s": [step_time(len(conf) * width) for width in range(1, 5)],
                          "draft_time": k.get("draft_time", a[-1] if a and isinstance(a[-1], float) else 0.0)})
            return ell, gain
        setattr(ps, name, watched)
    trims: list[float] = []  # trim()'s expected accepted drafts (sum of the survivals it opened)
    column_search = ps._column_search

    def watched_trim(conf, sps, opened=0):
        search = column_search(conf, sps, opened)
        trims.append(search.tau - len(conf))
        return search.ell
    ps.admit_columns = watched_trim

    def run(engine, trace: bool) -> tuple[float, list[dict]]:
        rounds: list[dict] = []
        consumed = [getattr(engine.drafter, "consumed_s", 0.0)]

        def on_step(s, dt: float, admitted: bool) -> None:
            now = getattr(engine.drafter, "consumed_s", 0.0)
            if trace and s is not None and s.rows == C and not admitted:
                rounds.append({"round_s": dt, "width": s.block_len, "drafted": s.drafted, "accepted": s.accepted,
                               "forward_s": s.forward_s, "draft_s": s.draft_s, "consumed_s": now - consumed[0],
                               "trim_tau": trims[0] if trims else None, "plan": plans[0] if plans else None})
            consumed[0] = now
            plans.clear()
            trims.clear()  # (the planners run inside a step: what they logged belongs to this one)

        plans.clear()
        trims.clear()
        return closed_loop(engine, prompts, C, on_step), rounds

    times: dict[str, list[float]] = {"plain": [], "spec": []}
    traced: list[list[dict]] = []
    for r in range(args.rounds):
        for name in (["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]):
            t, rounds = run(plain if name == "plain" else spec, name == "spec")
            times[name].append(t)
            if name == "spec":
                traced.append(rounds)
            print(f"round {r} {name}: {t:.1f} s", flush=True)
    summary = []
    for r, rounds in enumerate(traced):
        narrow = [x["round_s"] for x in rounds if x["width"] == 1 and not x["drafted"]]  # plain rounds
        base = statistics.median(narrow) if narrow else None
        for width in sorted({x["width"] for x in rounds if x["width"] > 1}):
            xs = [x for x in rounds if x["width"] == width]
            acc = statistics.mean(x["accepted"] or 0 for x in xs)
            rt = statistics.median(x["round_s"] for x in xs)
            gains = [x["plan"]["gain"] for x in xs if x["plan"]]
            row = {"round": r, "width": width, "n": len(xs), "accepted_per_round": acc,
                   "round_ms": 1e3 * rt, "forward_ms": 1e3 * statistics.median(x["forward_s"] for x in xs),
                   "draft_ms": 1e3 * statistics.median(x["draft_s"] for x in xs),
                   "plain_round_ms": None if base is None else 1e3 * base,
                   "planned_gain": statistics.median(gains) if gains else None,
                   "realized_gain": None if base is None else (C + acc) / C * base / rt}
            summary.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print("spec x plain per round:", [f"{p / s:.3f}" for p, s in zip(times["plain"], times["spec"])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"setup": {k: str(v) for k, v in vars(args).items()}, "times": times,
                                    "summary": summary, "rounds": traced}) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Batch 1: the built-in DSpark drafter with its STS fit applied to every row (how calibration.json
was read before regimes) vs applied in its own regime only (drafters/calibration.py: the built-in's
fit is for sampled rows, so greedy rows use raw confidences), plain decoding side by side, in one
process and one KV cache; each prompt runs on the three engines before the next (ab_policy.one_round).

    .venv/bin/python benchmarks/ab_sts_regime.py [--workloads humaneval,mtbench] [--temperature 0]
        [--rounds 3] [--prompts 12] [--tokens 96] [--out benchmarks/results/ab_sts_regime.json]

Prints and writes per workload: each round's plain / engine wall-time ratio of the decoding steps
(prefill excluded; > 1: faster than plain), the median, drafts accepted and steps that drafted, and
whether the greedy outputs of the two are identical and equal to plain's. The prefix scheduler
(default policy) plans on the confidences, so this is where a calibration changes speed."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
from ab_policy import one_round
from draftsmith.bench.workload import load_workload
from draftsmith.drafters.calibration import STSFit
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="humaneval,mtbench")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ab_sts_regime.json"))
    a = ap.parse_args()
    target = load_target("smollm2-135m")
    plain = build_engine(target, "none", FixedK(0), 0, 1, 2048)
    engs = {"plain": plain,
            "own-regime": build_engine(target, "dspark:smollm2-135m", "prefix-scheduler", 7, 1, 2048, cache=plain.cache),
            "every-row": build_engine(target, "dspark:smollm2-135m", "prefix-scheduler", 7, 1, 2048, cache=plain.cache)}
    fit = engs["own-regime"].drafter.sts
    engs["every-row"].drafter.sts = STSFit(fit.temperatures)  # no regime: every row, as before regimes
    out = {"setup": {**vars(a), "out": str(a.out), "fit": {"temperatures": list(fit.temperatures), "regime": fit.regime}}}
    for wl in a.workloads.split(","):
        w = load_workload(wl, None, a.prompts, max_prompt_tokens=1024,
                          tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
        prompts = [list(p.token_ids) for p in w.prompts]
        one_round(engs, prompts[:2], 16, a.temperature, 0)  # warm-up
        rs = [one_round(engs, prompts, a.tokens, a.temperature, r) for r in range(a.rounds)]
        names = ("own-regime", "every-row")
        ratio = {k: [r["plain"]["wall_s"] / r[k]["wall_s"] for r in rs] for k in names}
        greedy = a.temperature == 0
        out[wl] = {"plain_s": [r["plain"]["wall_s"] for r in rs], "ratio": ratio,
                   "median": {k: statistics.median(v) for k, v in ratio.items()},
                   "accepted": {k: [sum(s.accepted or 0 for _, s in r[k]["per_step"]) for r in rs] for k in names},
                   "drafted_steps": {k: [sum(1 for _, s in r[k]["per_step"] if s.drafted) for r in rs] for k in names},
                   "steps": {k: [r[k]["steps"] for r in rs] for k in engs},
                   "outputs_same": all(r[names[0]]["outputs"] == r[names[1]]["outputs"] for r in rs) if greedy else None,
                   "equal_plain": all(r[names[0]]["outputs"] == r["plain"]["outputs"] for r in rs) if greedy else None}
        print(wl, json.dumps(out[wl]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

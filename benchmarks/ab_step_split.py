"""Where a policy's time goes at batch 1: plain vs the built-in DSpark drafter idle (`FixedK(0)`:
attached, never asked to draft), under a prefix scheduler that never drafts
(`min_gain=0.99,probe_every=0,cheap_draft=0`), and under `prefix-scheduler:choose_plan=best-prefix`
and `:choose_plan=columns`; one process, one KV cache, 12 held-out prompts x 96 tokens, T = 0.

    .venv/bin/python benchmarks/ab_step_split.py [WORKLOAD=mtbench] [ROUNDS=2]

The rounds are ab_policy.py's (`one_round`, --interleave prompt: each prompt runs on every engine
before the next). Per engine and round: wall time of the decoding steps (each request's prefill step
excluded), split into steps that did not draft and steps that drafted (median step, forward and
drafting time; for the steps that did not draft, the median of step - forward: the host-side work
around the forward, what an idle drafter and its policy add), how many drafting steps verified any
draft, and the drafts accepted. A diagnostic: on a VM whose speed drifts from one minute to the
next, the split says more than the wall ratios."""

from __future__ import annotations

import statistics
import sys

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
from ab_policy import one_round
from draftsmith.bench.workload import load_workload
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK

SPECS = {"idle": FixedK(0), "never-drafts": "prefix-scheduler:min_gain=0.99,probe_every=0,cheap_draft=0",
         "best-prefix": "prefix-scheduler:choose_plan=best-prefix", "columns": "prefix-scheduler:choose_plan=columns"}


def ms(steps: list, what) -> float:
    return 1e3 * statistics.median(what(x) for x in steps) if steps else float("nan")


def main() -> None:
    wl = sys.argv[1] if len(sys.argv) > 1 else "mtbench"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    target = load_target("smollm2-135m")
    plain = build_engine(target, "none", FixedK(0), 0, 1, 2048)
    engines = {"plain": plain, **{k: build_engine(target, "dspark:smollm2-135m", v, 7, 1, 2048, cache=plain.cache)
                                  for k, v in SPECS.items()}}
    w = load_workload(wl, None, 12, max_prompt_tokens=1024,
                      tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
    prompts = [list(p.token_ids) for p in w.prompts]
    for r in range(rounds):
        for name, x in one_round(engines, prompts, 96, 0.0, r).items():
            nd = [(dt, s) for dt, s in x["per_step"] if not s.drafted]
            d = [(dt, s) for dt, s in x["per_step"] if s.drafted]
            print(f"{r} {name:12s} {x['wall_s']:6.2f} s; plain steps {len(nd)} median {ms(nd, lambda t: t[0]):.1f} ms "
                  f"(fwd {ms(nd, lambda t: t[1].forward_s):.1f}, host {ms(nd, lambda t: t[0] - t[1].forward_s):.2f}); "
                  f"drafted steps {len(d)} median "
                  f"{ms(d, lambda t: t[0]):.1f} ms (fwd {ms(d, lambda t: t[1].forward_s):.1f}, draft "
                  f"{ms(d, lambda t: t[1].draft_s):.1f}), verified in {sum(1 for _, s in d if s.block_len > 1)}, "
                  f"accepted {sum(s.accepted or 0 for _, s in d)}; sum plain-step s {sum(t for t, _ in nd):.2f}, "
                  f"sum drafted-step s {sum(t for t, _ in d):.2f}", flush=True)


if __name__ == "__main__":
    main()

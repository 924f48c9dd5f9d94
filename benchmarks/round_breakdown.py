"""Where a speculative round's time goes at batch 1, next to plain decoding's step, in one process.

    .venv/bin/python benchmarks/round_breakdown.py [--workload mtbench] [--prompts 6] [--tokens 128]
        [--drafter ngram --drafter dspark:smollm2-135m] [--policy auto] [--passes 2]

One target, one engine per configuration (plain first), the same held-out prompts, greedy; the
configurations take turns, `--passes` times. Per configuration and pass: ms per output token,
ms per round, the target forward's and the drafter's mean time per round (what the prefix scheduler's cost model learns), the
rest of a round outside the target forward and the drafter, and the median target forward per
verify width (1 = a round without drafts). Prefill steps are left out. A diagnostic, not a
benchmark of record: read ratios within one pass (a shared VM moves everything between passes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from draftsmith.bench.workload import load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.builder import build_engine
from draftsmith.eval.runner import default_block_size, load_drafter
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK


def run(engine, prompts: list[list[int]], tokens: int) -> list[tuple[float, float, float, int, int]]:
    """Per round after prefill: (wall s, target forward s, drafting s, verify width, accepted)."""
    rows = []
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0.0))
        first = True
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if first:  # the admission step: prefill + the first round
                first = False
                continue
            s = engine.last_step
            rows.append((wall, s.forward_s, s.draft_s, s.block_len, s.accepted))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--workload", default="mtbench")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", action="append", default=[])
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    drafters = args.drafter or ["ngram", "dspark:smollm2-135m"]
    t = load_target(args.target)
    wl = load_workload(args.workload, None, args.prompts,
                       tokenize=lambda m: encode_chat(t.tokenizer, list(m), t.target_id), max_prompt_tokens=1024)
    prompts = [list(p.token_ids) for p in wl.prompts]
    engines = {"plain": build_engine(t, "none", FixedK(0), 0, 1, 2048)}
    for spec in drafters:
        k = default_block_size(load_drafter(spec, t, 1, 64), fallback=5)
        engines[spec] = build_engine(t, spec, args.policy, k, 1, 2048, cache=engines["plain"].cache)
    print(f"{args.target}, {args.workload}: {len(prompts)} held-out prompts x {args.tokens} tokens, batch 1, "
          f"policy {args.policy}")
    for p in range(args.passes):
        for name, eng in engines.items():
            r = run(eng, prompts, args.tokens)
            n_tok = sum(1 + x[4] for x in r)
            wall = sum(x[0] for x in r)
            by_w = defaultdict(list)
            for x in r:
                by_w[x[3]].append(x[1])
            fw = " ".join(f"{w}: {1000 * statistics.median(v):.1f} (n {len(v)})" for w, v in sorted(by_w.items()))
            rest = sum(x[0] - x[1] - x[2] for x in r) / len(r)
            print(f"pass {p + 1} {name:24s} {1000 * wall / n_tok:5.1f} ms/token  {1000 * wall / len(r):5.1f} ms/round  "
                  f"target {1000 * sum(x[1] for x in r) / len(r):5.1f}  drafting {1000 * sum(x[2] for x in r) / len(r):4.1f}  rest {1000 * rest:4.1f}  "
                  f"| target forward ms by width: {fw}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a policy's time goes at batch 1: plain vs the built-in DSpark drafter under
`prefix-scheduler:choose_plan=best-prefix` and `:choose_plan=columns`, one process, one KV cache,
interleaved (order reversed every other round), 12 held-out prompts x 96 tokens, T = 0.

    .venv/bin/python benchmarks/ab_step_split.py [WORKLOAD=mtbench] [ROUNDS=2]

Per engine and round: wall time of the decoding steps (each request's prefill step excluded),
split into steps that did not draft and steps that drafted (median step, forward and drafting
time), how many drafting steps verified any draft, and the drafts accepted. A diagnostic: on a
VM whose speed drifts from one minute to the next, the split says more than the wall ratios."""
import sys, time, statistics
import draftsmith  # noqa
from draftsmith.bench.workload import load_workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.engine.builder import build_engine
from draftsmith.models.prompts import encode_chat
from draftsmith.models.target import load_target
from draftsmith.policy.fixed import FixedK
wl = sys.argv[1] if len(sys.argv) > 1 else "mtbench"
R = int(sys.argv[2]) if len(sys.argv) > 2 else 2
target = load_target("smollm2-135m")
plain = build_engine(target, "none", FixedK(0), 0, 1, 2048)
engines = {"plain": plain,
           "best-prefix": build_engine(target, "dspark:smollm2-135m", "prefix-scheduler:choose_plan=best-prefix", 7, 1, 2048, cache=plain.cache),
           "columns": build_engine(target, "dspark:smollm2-135m", "prefix-scheduler:choose_plan=columns", 7, 1, 2048, cache=plain.cache)}
w = load_workload(wl, None, 12, max_prompt_tokens=1024,
                  tokenize=lambda m: encode_chat(target.tokenizer, list(m), target.target_id))
prompts = [list(p.token_ids) for p in w.prompts]
def run(engine):
    nd, d, wall, acc = [], [], 0.0, 0
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=96, temperature=0))
        first = True
        while engine.has_unfinished():
            t0 = time.perf_counter(); engine.step(); dt = time.perf_counter() - t0
            if first: first = False; continue
            wall += dt
            s = engine.last_step
            (d if s.drafted else nd).append((dt, s.forward_s, s.draft_s, s.block_len, s.accepted or 0))
    return wall, nd, d
for r in range(R):
    for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
        wall, nd, d = run(engines[name])
        f = lambda xs, i: 1e3 * statistics.median(x[i] for x in xs) if xs else float("nan")
        print(f"{r} {name:12s} {wall:6.2f} s; plain steps {len(nd)} median {f(nd,0):.1f} ms (fwd {f(nd,1):.1f}); "
              f"drafted steps {len(d)} median {f(d,0):.1f} ms (fwd {f(d,1):.1f}, draft {f(d,2):.1f}), "
              f"verified in {sum(1 for x in d if x[3] > 1)}, accepted {sum(x[4] for x in d)}; "
              f"sum plain-step s {sum(x[0] for x in nd):.2f}, sum drafted-step s {sum(x[0] for x in d):.2f}", flush=True)

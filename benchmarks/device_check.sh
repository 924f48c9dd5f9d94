#!/usr/bin/env bash
# GPU check (issue 11), at most ~8 minutes on a lent GPU machine:
#   1. the CUDA tests (pytest -m gpu),
#   2. `draftsmith profile --device cuda --dtype bfloat16 --json` (step times vs the floor),
#   3. a short side-by-side bench: plain vs n-gram vs the built-in DSpark drafter, interleaved,
#      greedy, held-out HumanEval and MT-Bench prompts;
#   4. the same under a JSON schema (bench_structured.py's *record*): plain without and with the
#      grammar's forced drafts, the built-in drafter without and with drafting inside the grammar.
# Results go under $OUT (the device tool's folder), default ./device-out.
#   bash benchmarks/device_check.sh            # on the GPU machine
#   bash benchmarks/device_check.sh --dry-run  # the same steps on the CPU, small (part of make test)
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda DTYPE=bfloat16 PROMPTS=8 TOKENS=128 REPEATS=7
if [ "${1:-}" = "--dry-run" ]; then
  DEVICE=cpu DTYPE="${DRY_RUN_DTYPE:-float32}" PROMPTS=2 TOKENS="${DRY_RUN_TOKENS:-16}" REPEATS=1
fi
OUT="${OUT:-device-out}"
PY="${PY:-.venv/bin/python}"
mkdir -p "$OUT"
command -v "$PY" >/dev/null || make venv >/dev/null  # PY may be a path or a command (python3)
echo "== device_check: device=$DEVICE dtype=$DTYPE out=$OUT"

echo "== 1. CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_cuda.py | tee "$OUT/gpu_tests.txt"

echo "== 2. profile"
"$PY" -m draftsmith.cli profile --device "$DEVICE" --dtype "$DTYPE" --repeats "$REPEATS" --json > "$OUT/profile.json"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode %.2f ms, floor %.2f ms, verify(8) %.2f steps' % (d['decode_ms'], d['floor_ms'], d['verify_in_decode_steps'][d['tokens'].index(8)]))" "$OUT/profile.json"

# Steps 3 and 4 run in one Python process: the target is imported and loaded once for both.
echo "== 3. plain vs n-gram vs built-in DSpark"
"$PY" - "$DEVICE" "$DTYPE" "$PROMPTS" "$TOKENS" "$OUT/quick_bench.json" "$OUT/structured.json" <<'PYEOF'
import itertools, json, statistics, sys
from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource, MTBenchSource
device, dtype, n, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
plain = LLM("smollm2-135m", device=device, dtype=dtype)
drafters = {"ngram": LLM(plain.target, drafter="ngram", num_speculative_tokens=5),
            "dspark": LLM(plain.target, drafter="dspark:smollm2-135m", num_speculative_tokens=7)}
convs = []
for source in (HumanEvalSource(), MTBenchSource()):  # half code, half chat
    convs += [(source.name, c) for c in itertools.islice(source.conversations(split="heldout"), max(1, n // 2))]
params = SamplingParams(max_tokens=tokens, temperature=0.0)
NEAR_TIE = 0.5  # logits: bf16 rounds a logit of ~30 to steps of 0.125, and 30 layers add up
reference = None

def fp32_gap(prompt, prefix):
    """The float32 target's top-1 minus top-2 logit after prompt + prefix (the shared output so far).
    A speculative output may leave bf16 plain decoding only where this is small: a K-token verify
    and a 1-token step round differently (README, --dtype); a large gap there would be a bug."""
    global reference
    import torch
    if reference is None:
        reference = LLM(plain.target.target_id, device=device, dtype="float32").target.model
    x = torch.tensor([list(prompt) + list(prefix)], device=reference.device)
    with torch.no_grad():
        logits = reference(x, reference.new_cache(1, x.shape[1] + 1)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])

for llm in (plain, *drafters.values()):  # warm up
    llm.generate([plain.apply_chat_template([{"role": "user", "content": "hi"}])], SamplingParams(max_tokens=8, temperature=0.0))
rows = []
for task, c in convs:  # interleaved per prompt: plain, then each drafter (docs/MEASURING.md)
    ids = plain.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}])
    a = plain.generate([ids], params)[0]; ta = plain.last_stats
    row = {"task": task, "plain_ms_per_token": 1e3 * ta.wall_time_s / ta.output_tokens}
    for name, llm in drafters.items():
        b = llm.generate([ids], params)[0]; tb = llm.last_stats
        row[f"{name}_ms_per_token"] = 1e3 * tb.wall_time_s / tb.output_tokens
        row[f"{name}_speedup"] = row["plain_ms_per_token"] / row[f"{name}_ms_per_token"]
        row[f"{name}_tau"] = tb.tau
        row[f"{name}_identical"] = a.token_ids == b.token_ids
        if not row[f"{name}_identical"]:  # where, and how close the target's top two were there
            i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                     min(len(a.token_ids), len(b.token_ids)))
            row[f"{name}_diverged_at"], row[f"{name}_fp32_gap"] = i, fp32_gap(ids, a.token_ids[:i])
    rows.append(row)
res = {"device": device, "dtype": dtype, "prompts": len(rows), "max_tokens": tokens, "rows": rows,
       "median_plain_ms_per_token": statistics.median(r["plain_ms_per_token"] for r in rows),
       "all_identical": all(r[f"{k}_identical"] for r in rows for k in drafters),
       "near_tie_logits": NEAR_TIE,
       "max_gap_at_divergence": max([r[f"{k}_fp32_gap"] for r in rows for k in drafters
                                     if not r[f"{k}_identical"]], default=None)}
for k in drafters:
    res[f"median_{k}_speedup"] = statistics.median(r[f"{k}_speedup"] for r in rows)
    res[f"mean_{k}_tau"] = statistics.fmean(r[f"{k}_tau"] for r in rows)
json.dump(res, open(out, "w"), indent=1)
print(f"plain {res['median_plain_ms_per_token']:.2f} ms/token; " + "; ".join(
    f"{k} {res[f'median_{k}_speedup']:.2f}x plain (tau {res[f'mean_{k}_tau']:.2f})" for k in drafters)
    + f"; outputs identical: {res['all_identical']}")
if not res["all_identical"]:
    print(f"  divergences at bf16 near-ties: largest float32 top-2 gap there {res['max_gap_at_divergence']:.3f} "
          f"(a bug if > {NEAR_TIE})")
    if dtype == "float32" or res["max_gap_at_divergence"] > NEAR_TIE:
        sys.exit("device_check: a drafter's output differs from plain decoding at T=0, not at a near-tie")
drafters.clear()
llm = reference = None  # step 3's drafters and float32 reference go; step 4 builds on plain.target
print("== 4. structured outputs: forced drafts, drafting inside the grammar", flush=True)
sys.path.insert(0, "benchmarks")
from bench_structured import RECORD, SCHEMAS
from draftsmith import StructuredOutputsParams
out = sys.argv[6]
base = LLM(plain.target, forced_drafts=0)  # smollm2-135m on device / dtype, as loaded for step 3
configs = {"plain, no forced drafts": base, "plain": LLM(base.target),
           "dspark, drafts not masked": LLM(base.target, drafter="dspark:smollm2-135m"),
           "dspark": LLM(base.target, drafter="dspark:smollm2-135m")}
configs["dspark, drafts not masked"].drafter.grammar_masks = False
params = SamplingParams(max_tokens=tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(json=RECORD))
ask = SCHEMAS["record"][1]
for llm in configs.values():  # warm up: first calls, the grammar's compilation
    llm.chat([{"role": "user", "content": "Say hi." + ask}], params)
rows = []
for c in itertools.islice(MTBenchSource().conversations(split="heldout"), n):
    msgs = [{"role": "user", "content": c.messages[0]["content"] + ask}]
    row, first = {}, None
    for name, llm in configs.items():  # interleaved per prompt (docs/MEASURING.md)
        (o,) = llm.chat(msgs, params)
        st = llm.last_stats
        first = first or o.token_ids
        row[name] = {"ms_per_token": 1e3 * st.wall_time_s / st.output_tokens, "tau": st.tau,
                     "identical": o.token_ids == first}
    rows.append(row)
res = {"device": device, "dtype": dtype, "prompts": len(rows), "max_tokens": tokens, "rows": rows,
       "all_identical": all(r[k]["identical"] for r in rows for k in configs), "configs": {}}
for k in configs:
    res["configs"][k] = {"speedup_p50": statistics.median(r["plain, no forced drafts"]["ms_per_token"] / r[k]["ms_per_token"]
                                                          for r in rows),
                         "tau_mean": statistics.fmean(r[k]["tau"] for r in rows)}
json.dump(res, open(out, "w"), indent=1)
print("; ".join(f"{k} {v['speedup_p50']:.2f}x (tau {v['tau_mean']:.2f})" for k, v in res["configs"].items())
      + f"; outputs identical: {res['all_identical']}")
if not res["all_identical"] and dtype == "float32":
    sys.exit("device_check: an output under the schema differs from plain decoding's at T=0 in float32")
PYEOF
echo "== device_check: done; results in $OUT"

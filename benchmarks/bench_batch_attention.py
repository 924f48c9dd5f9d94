"""A batched step over rows of mixed context lengths: what attention costs (issue 11, issue 12).

    .venv/bin/python benchmarks/bench_batch_attention.py [--rows 16,64] [--tokens 1,4]
        [--lengths 50-1500] [--rounds 5] [--label L] [--no-md]

The target (smollm2-135m) steps B cache rows, each at its own context length drawn uniformly
from --lengths (a serving batch, a regeneration batch), S new tokens a row, in float32 and
bfloat16. Two paths, interleaved in one process, the order alternating by round (medians):

- one call:  every layer's attention is one kernel call in which each row reads only its own
             keys (models/attention.attend_rows, the default on a CPU)
- per run:   the path before it: the batch cut into runs of rows of similar length, one masked
             kernel call per run (each row of a run reads the run's longest context)

Also the attention kernel alone at the step's geometry, over 12 caches in turn (so the
keys come from memory, as in a real step, not from the last call's cache lines): ms a layer and
the key/value bytes it reads per second. Every run is appended, with --label (e.g. the kernel
change being measured), to benchmarks/results/bench_batch_attention.json and the section shows
them all, so two kernel builds run alternately (A B A B) sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import sections

import draftsmith  # noqa: F401  (OpenMP settings before torch)
import torch

import draftsmith.models.decoder as decoder_module
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.attention import use_step_kernel
from draftsmith.models.target import load_target

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_batch_attention.json"
BEGIN, END = "<!-- bench_batch_attention:begin -->", "<!-- bench_batch_attention:end -->"
LAYERS = 12  # caches cycled through by the kernel-alone timing (hundreds of MB: from memory)


def step_ms(dec, B: int, S: int, lengths: torch.Tensor, rounds: int) -> dict[str, float]:
    cache = dec.new_cache(B, int(lengths.max()) + S + 1)
    g = torch.Generator().manual_seed(1)
    V = dec.config.vocab_size
    with torch.inference_mode():
        for r in range(B):  # real keys and values: each row prefilled with its own tokens
            n = int(lengths[r])
            dec(torch.randint(0, V, (1, n), generator=g), cache, rows=torch.tensor([r]), compute_logits=False)
            cache.lengths[r] = n
        step = torch.randint(0, V, (B, S), generator=g)
        rows = torch.arange(B)
        times: dict[str, list[float]] = {"one call": [], "per run": []}
        dec(step, cache, rows=rows)  # warm
        for rnd in range(rounds):
            for mode in (("one call", "per run") if rnd % 2 == 0 else ("per run", "one call")):
                decoder_module.use_step_kernel = use_step_kernel if mode == "one call" else (lambda *a: False)
                try:
                    t0 = time.perf_counter()
                    dec(step, cache, rows=rows)
                    times[mode].append(time.perf_counter() - t0)
                finally:
                    decoder_module.use_step_kernel = use_step_kernel
    return {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}


def kernel_ms(dec, B: int, S: int, lengths: torch.Tensor, reps: int = 3) -> tuple[float, float]:
    """The attention kernel alone at the target's attention geometry, LAYERS caches in turn."""
    c, dtype = dec.config, dec.dtype
    KV, H, D, T = c.num_kv_heads, c.num_heads, c.head_dim, int(lengths.max()) + S + 1
    g = torch.Generator().manual_seed(2)
    ks = [torch.randn(B, KV, T, D, generator=g).to(dtype) for _ in range(LAYERS)]
    vs = [torch.randn(B, KV, T, D, generator=g).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(B, H, S, D, generator=g).to(dtype)
    rows, pos = torch.arange(B), lengths[:, None] + torch.arange(S)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for k, v in zip(ks, vs):
            torch.ops.draftsmith.attention_rows(q, k, v, rows, pos, D ** -0.5)
        best = min(best, (time.perf_counter() - t0) / LAYERS)
    read = float((lengths + S).sum()) * KV * D * 2 * ks[0].element_size()
    return round(best * 1e3, 3), round(read / best / 1e9, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--lengths", default="50-1500")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--no-md", action="store_true")
    args = ap.parse_args()
    if not cpu_kernels().ok:
        print(f"Draftsmith's CPU kernels do not run here: {cpu_kernels().reason}", file=sys.stderr)
        return 1
    lo, hi = (int(x) for x in args.lengths.split("-"))
    rows = []
    for dtype in ("float32", "bfloat16"):
        dec = load_target("smollm2-135m", dtype=dtype).model
        for B in (int(x) for x in args.rows.split(",")):
            lengths = torch.randint(lo, hi + 1, (B,), generator=torch.Generator().manual_seed(B))
            for S in (int(x) for x in args.tokens.split(",")):
                ms = step_ms(dec, B, S, lengths, args.rounds)
                k_ms, gbs = kernel_ms(dec, B, S, lengths)
                row = {"dtype": dtype, "rows": B, "tokens": S, "mean_length": round(float(lengths.float().mean())),
                       **{f"step_ms {k}": v for k, v in ms.items()}, "kernel_ms_per_layer": k_ms, "kernel_gbs": gbs}
                rows.append(row)
                print(row, flush=True)
        del dec
    runs = json.loads(OUT.read_text()) if OUT.is_file() else []
    runs.append({"label": args.label, "isa": torch.ops.draftsmith.isa(), "machine": f"{platform.machine()} "
                 f"{os.cpu_count()} CPUs", "threads": torch.get_num_threads(), "lengths": args.lengths,
                 "rounds": args.rounds, "time": time.strftime("%Y-%m-%d %H:%M"), "rows": rows})
    OUT.write_text(json.dumps(runs, indent=1))
    if not args.no_md:
        sections.write_section(BEGIN, END, markdown(runs))
    return 0


def markdown(runs: list[dict]) -> str:
    lines = ["## Batched steps over rows of mixed lengths: attention (issues 11, 12)", "",
             "`benchmarks/bench_batch_attention.py` (JSON: `benchmarks/results/bench_batch_attention.json`, every "
             "run kept). smollm2-135m, B cache rows at context lengths drawn uniformly from the range, S new tokens "
             "a row. Step ms: the whole target forward, \"one call\" (each layer's attention one kernel call, each "
             "row over its own keys) vs \"per run\" (the path before: one masked call per run of rows of similar "
             "length), interleaved in one process, medians. Kernel: the attention call alone, over 12 layer-sized "
             "caches in turn, ms a layer and key/value bytes read per second.", ""]
    for run in runs:
        lines += [f"Run {run['time']}{' — ' + run['label'] if run['label'] else ''} ({run['machine']}, "
                  f"{run['threads']} threads, kernels {run['isa']}, lengths {run['lengths']}):", "",
                  "| dtype | rows | tokens | mean length | step ms, one call | step ms, per run | per run ÷ one call "
                  "| kernel ms / layer | kernel GB/s |", "|---|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            one, per = r["step_ms one call"], r["step_ms per run"]
            lines.append(f"| {r['dtype']} | {r['rows']} | {r['tokens']} | {r['mean_length']} | {one:.1f} | "
                         f"{per:.1f} | {per / one:.2f}× | {r['kernel_ms_per_layer']:.2f} | {r['kernel_gbs']:.1f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Compute rate of the few-row linear kernels (issue 11): GMAC/s on a cache-resident weight.

    .venv/bin/python benchmarks/kernel_rate.py [--rows 1,4,8,16,32] [--threads 1,2] [--n 512] [--k 576]

A verify step of K tokens multiplies every weight by K rows: where the weights stream from DRAM at
one row, the arithmetic of K rows may take longer than the stream. This measures what the kernels
(kernels/gemv.cpp, Draftsmith's build for this CPU) compute per second when the weight sits in the
caches (default [512, 576]: 1.2 MB float32, 0.6 MB bfloat16, split over the threads; at one thread the
float32 weight outgrows a 1 MB L2, a Zen 4's, and is read from L3): the ceiling a verify step's linears
reach when DRAM is not the limit. Best of 5 timings of 500 calls each, per rows
count, thread count and dtype. Prints a markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.kernels.build import cpu_kernels


def rate(fn, macs: int, calls: int = 500) -> float:
    for _ in range(calls // 5):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return macs / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", type=int, default=512, help="output features (a multiple of 32 splits evenly)")
    ap.add_argument("--k", type=int, default=576, help="input features")
    a = ap.parse_args()
    st = cpu_kernels()
    if not st.ok:
        sys.exit(f"the CPU kernels do not run here: {st.reason}")
    op = torch.ops.draftsmith
    rows = [int(r) for r in a.rows.split(",")]
    w = torch.randn(a.n, a.k, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"kernels: {st.isa}; weight [{a.n}, {a.k}]; GMAC/s (multiply-adds per second)\n")
    print("| dtype | threads | " + " | ".join(f"rows={m}" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for dtype in ("float32", "bfloat16"):
        bf16 = dtype == "bfloat16"
        if bf16 and not st.bf16:
            continue
        packed = op.pack_bf16(w.bfloat16()) if bf16 else op.pack_f32(w)
        for threads in (int(t) for t in a.threads.split(",")):
            torch.set_num_threads(threads)
            cells = []
            for m in rows:
                x = torch.randn(m, a.k).to(torch.bfloat16 if bf16 else torch.float32)
                if bf16:
                    fn = lambda: op.gemv_bf16(x, packed, a.n, a.k, None)  # noqa: E731
                else:
                    fn = lambda: op.gemv_f32(x, packed, a.n, None)  # noqa: E731
                cells.append(f"{rate(fn, m * a.n * a.k):.0f}")
            print(f"| {dtype} | {threads} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

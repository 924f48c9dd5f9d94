"""What reading a greedy round's logits costs (issue 11): one-hot probabilities vs the argmax.

    .venv/bin/python benchmarks/probe_warp.py [--threads 2] [--vocab 49152] [--positions 1,8,16,32,64,128]

The engine verifies an all-greedy batch from the argmax of every position (`verify_greedy`); the
timed step of bench_runtime and the SPS profile (`policy/roofline.step_runner`) built one-hot
probabilities instead until stop 65 (`target_probs` at T = 0). Times both on random float32 logits
[1, N, V], each the median of 31 calls after 5 untimed, in microseconds. Prints only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.core.sampling import SamplingParams
from draftsmith.core.warp import argmax_rows, target_probs


def median_us(f) -> float:
    for _ in range(5):
        f()
    ts = []
    for _ in range(31):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--positions", default="1,8,16,32,64,128")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    greedy = [SamplingParams(temperature=0.0)]
    for n in (int(p) for p in a.positions.split(",")):
        x = torch.randn(1, n, a.vocab, generator=torch.Generator().manual_seed(n))
        one_hot = median_us(lambda: target_probs(x, greedy))
        argmax = median_us(lambda: argmax_rows(x.reshape(n, -1)).tolist())
        print(f"{n} positions: one-hot {one_hot:.0f} us, argmax {argmax:.0f} us", flush=True)


if __name__ == "__main__":
    main()

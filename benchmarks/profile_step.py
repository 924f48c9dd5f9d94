"""Where one target forward's time goes, by token count (issue 11): torch's profiler over the step.

    .venv/bin/python benchmarks/profile_step.py [--dtype bfloat16] [--widths 1,8,16] [--threads 2] [--context 200]

Per width (new tokens on one row after `--context` cached, as bench_runtime's verify(K)): the median
step time over 15 steps, then a profile of 5 more, its ops by self time. With Draftsmith's kernels a
decoder layer is one `draftsmith::layer` call (linears, attention, norms, RoPE); the lm_head is a
`draftsmith::gemv_*`; the rest is the model's Python and torch's bookkeeping. Prints only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)
import torch

from draftsmith.models.loading import load_decoder
from draftsmith.models.registry import resolve_target
from draftsmith.policy.roofline import step_runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    _, path = resolve_target(a.target)
    model = load_decoder(path, dtype=getattr(torch, a.dtype))
    for width in (int(w) for w in a.widths.split(",")):
        run = step_runner(model, 1, width, a.context)
        for _ in range(3):
            run(time.perf_counter)
        step = statistics.median(run(time.perf_counter) for _ in range(15))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                run(time.perf_counter)
        print(f"\n{a.target} {a.dtype}, {a.threads} threads, {width} new tokens after {a.context}: "
              f"{1e3 * step:.2f} ms a step (median of 15); profile of 5 steps:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=32))


if __name__ == "__main__":
    main()

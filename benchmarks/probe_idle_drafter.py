"""What a drafter costs when the scheduler lets it draft nothing (issues 11, 12): timers around the engine's hooks.

    .venv/bin/python benchmarks/probe_idle_drafter.py [--rows 32] [--tokens 64] [--repeats 2]

One `LLM.generate()` of `--rows` held-out HumanEval prompts x `--tokens` new tokens (T = 0, EOS
ignored, all prompts admitted together: a serving tier's closed loop at its start), plain and with
the built-in DSpark drafter under the default policy, alternating, `--repeats` times each. Each
engine's admission (the target's prefill and the drafter's start), its rounds, and the drafter's
and policy's calls (`start`, `propose`, `on_verified`, `choose`, `update`, ...) are wrapped in
accumulating wall-clock timers; totals in seconds over the repeats (nested: the rounds include the
drafter's propose / on_verified and the policy's calls, the admission the drafter's start). At 16-32
rows the default policy on a 2-core CPU drafts nothing, so the drafter's share is its upkeep alone.
Prints only.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import time

import draftsmith  # noqa: F401  (OpenMP settings: must come before torch)

from draftsmith import LLM, SamplingParams
from draftsmith.data.sources import HumanEvalSource

DRAFTER_CALLS = ("start", "propose", "on_verified", "release", "backlog_positions")
POLICY_CALLS = ("choose", "update", "observe", "queued", "trim", "draft_gate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    total: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                total[key] += time.perf_counter() - t0
                calls[key] += 1

        object.__setattr__(obj, name, wrapper)  # (policies are frozen dataclasses)

    plain = LLM("smollm2-135m", max_batch=a.rows, max_len=1024)  # (prompts + tokens fit: half the default cache)
    spec = LLM(plain.target, drafter="dspark:smollm2-135m", max_batch=a.rows, max_len=1024)
    convs = list(itertools.islice(HumanEvalSource().conversations(split="heldout"), a.rows))
    prompts = [plain.apply_chat_template([{"role": "user", "content": c.messages[0]["content"]}]) for c in convs]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    for llm in (plain, spec):  # warm-up (and the SPS profile, where it is not cached)
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    for name, llm in (("plain", plain), ("dspark", spec)):
        e = llm.engine
        timed(e, "_admit", f"{name} admission (prefill)")
        timed(e, "_round", f"{name} rounds")
        for m in DRAFTER_CALLS:
            if hasattr(e.drafter, m):
                timed(e.drafter, m, f"{name} drafter.{m}")
        for m in POLICY_CALLS:
            if hasattr(e.policy, m):
                timed(e.policy, m, f"{name} policy.{m}")
    for _ in range(a.repeats):
        for name, llm in (("plain", plain), ("dspark", spec)):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            total[f"{name} generate()"] += time.perf_counter() - t0
    for key in sorted(total):
        print(f"{key:40s} {total[key]:8.3f} s" + (f"  ({calls[key]} calls)" if calls[key] else ""))


if __name__ == "__main__":
    main()

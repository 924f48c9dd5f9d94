"""`make demo`: the default target on built-in code and chat prompts, plain vs n-gram.

Runs A/B interleaved per prompt (MEASURING.md rule 1), checks that speculative greedy output
equals plain output (rule 2: otherwise the speed number is void) and prints a side-by-side
table with counts (target forwards per token, τ) next to times.
"""

from __future__ import annotations

import statistics
import sys
import time

from draftsmith import LLM, SamplingParams

DEMO_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function `is_palindrome(s)` that ignores case and punctuation, with a docstring and two doctest examples."),
    ("code", "Complete this function:\n\ndef merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"),
    ("code", "Refactor this code to use a dict comprehension:\n\nresult = {}\nfor name in names:\n    result[name] = len(name)\n"),
    ("chat", "Summarise the plot of Romeo and Juliet in five sentences."),
    ("chat", "Give me three tips for writing clear emails at work, each with a short example."),
    ("chat", "Explain what a hash table is to a beginner programmer."),
)


def main(max_new_tokens: int = 96, k: int = 5) -> int:
    print("draftsmith demo: smollm2-135m, greedy, batch 1, plain vs n-gram prompt lookup\n", flush=True)
    t0 = time.perf_counter()
    plain = LLM("smollm2-135m", drafter="none")
    ngram = LLM("smollm2-135m", drafter="ngram", num_speculative_tokens=k)
    print(f"loaded target in {time.perf_counter() - t0:.1f}s\n", flush=True)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    warm = plain.apply_chat_template([{"role": "user", "content": "Hi"}])
    plain.generate([warm], SamplingParams(max_tokens=4, temperature=0.0))
    ngram.generate([warm], SamplingParams(max_tokens=4, temperature=0.0))

    header = f"{'kind':<5} {'prompt':<34} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>8} {'fwd/tok':>8} {'τ':>5} {'acc':>5} {'same':>5}"
    print(header)
    print("-" * len(header))
    ratios: list[float] = []
    all_same = True
    for kind, prompt in DEMO_PROMPTS:
        ids = plain.apply_chat_template([{"role": "user", "content": prompt}])
        a = plain.generate([ids], params)[0]
        sa = plain.last_stats
        b = ngram.generate([ids], params)[0]
        sb = ngram.last_stats
        same = a.token_ids == b.token_ids
        all_same &= same
        ratio = sb.tokens_per_s / sa.tokens_per_s
        ratios.append(ratio)
        short = prompt.replace("\n", " ")[:32] + ".."
        print(
            f"{kind:<5} {short:<34} {sa.tokens_per_s:>11.1f} {sb.tokens_per_s:>11.1f} {ratio:>7.2f}x "
            f"{sb.forwards_per_token:>8.2f} {sb.tau:>5.2f} {sb.acceptance_rate:>5.2f} {'yes' if same else 'NO':>5}",
            flush=True,
        )
    print("-" * len(header))
    print(f"median speedup {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x); "
          f"greedy outputs identical: {'yes' if all_same else 'NO — speed numbers void'}")
    print("\nSample (n-gram, last prompt):\n" + b.text.strip()[:400])
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())

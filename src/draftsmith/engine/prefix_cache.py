"""Automatic prefix caching: a new request starts in a free KV-cache row that already holds
the keys and values of its prompt's first tokens, and prefills only the rest.

When a request finishes, its row keeps the KV of the tokens it committed (`KVCache.remember`)
until the row is needed again. Admission places each new request in the free row whose tokens
share the longest prefix with its prompt; requests without a match take a row that holds
nothing, else the least recently finished one. What this saves is prefill: a chat's next turn
(its prompt is the last turn's prompt + answer + the new user message), a system prompt every
request shares, or the same prompt asked again. Multi-turn regeneration prefilled 2.5 context
tokens per answer token without it and 0.6 with it (the 616 conversations of one real run).

What a prompt token's KV holds does not depend on the row or how it got there, so a reused
prefix is the same computation up to float summation order, not always to the bit: attention
over a long prefill (SDPA past 64 queries) and a token-by-token decode round differently from a
short step, so outputs can differ from a run without prefix caching where the target's top two
tokens nearly tie (measured: 13 of 32 greedy bfloat16 answers of 64 tokens on the default target,
none of 23 sampled float32 multi-turn conversations). That is why it is opt-in for inference
(`LLM(enable_prefix_caching=True)`, `serve --enable-prefix-caching`) and on by default only for
`regen`, whose data needs the target's distribution, not one run's bits.

A request's `cache_salt` (vLLM's) keeps its prefix to requests with the same salt: a row is
matched only by requests whose salt equals the one its KV was computed under (none for none),
so tenants that cannot share a salt cannot learn from timing that another sent a prompt.

A context-cache drafter needs the target's features of every prompt token, which a reused prefix
does not recompute. EAGLE-3, DFlash and DSpark keep their context per row as the KV cache keeps
keys and values (drafters/feature_queue.py: `follows_prefix_cache`), so a prompt reuses what the
row's KV and the drafter's context both still hold (`place(..., drafter_held=...)`; EAGLE-3 one
position less, as its context position also reads the next token). A drafter that builds its
context from a request's own prompt features alone turns prefix caching off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from draftsmith.models.kv_cache import KVCache


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two 1-D id tensors share."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def place(feeds: Sequence[Sequence[int]], free_rows: Sequence[int], cache: KVCache,
          drafter_held: Callable[[int], torch.Tensor | None] | None = None,
          salts: Sequence[str | None] | None = None) -> list[tuple[int, int]]:
    """(row, reused tokens) for each feed (the prompt tokens a request prefills), one distinct
    free row each (len(feeds) <= len(free_rows)). Longest matches are served first, so that a
    conversation's next turn gets its own row back even when a new request matches it too; a
    request whose best row went to a longer match takes its next best. `drafter_held(row)`: the
    ids whose context a drafter that follows the prefix cache holds in the row (None: nothing);
    a row is then matched on what it and the KV cache both hold. `salts`: each feed's
    cache_salt; a feed matches only rows remembered under the same one."""
    held = {r: t for r in free_rows if (t := cache.remembered(r)) is not None}
    match = held
    if drafter_held is not None:
        match = {r: t[:n] for r, t in held.items() if (d := drafter_held(r)) is not None and (n := common_prefix(t, d))}
    ids = [torch.tensor(f, dtype=torch.int32) for f in feeds] if match else []  # nothing to match: no copies
    salts = salts or [None] * len(feeds)
    pairs = [(common_prefix(f, t), i, r) for i, f in enumerate(ids) for r, t in match.items()
             if cache.salt(r) == salts[i]]
    out: list[tuple[int, int] | None] = [None] * len(feeds)
    taken: set[int] = set()
    for m, i, r in sorted((p for p in pairs if p[0] > 0), key=lambda p: (-p[0], p[1], p[2])):
        if out[i] is None and r not in taken:
            out[i] = (r, m)
            taken.add(r)
    # The rest: a row that holds nothing (lowest first), then the least recently remembered.
    spare = [r for r in sorted(free_rows) if r not in held] + [r for r in cache.remembered_order() if r in held]
    spare = [r for r in spare if r not in taken]
    for i in range(len(feeds)):
        if out[i] is None:  # it shares nothing with any row left (a pair with one would have been served)
            out[i] = (spare.pop(0), 0)
    return [o for o in out if o is not None]

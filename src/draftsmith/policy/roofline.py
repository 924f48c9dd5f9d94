"""What a target forward costs on this hardware, next to its physical limit.

Decode is memory-bound: one step streams every weight once, so its floor is
`weight_bytes / read bandwidth`, both measured here in the same run (docs/MEASURING.md #8). A
verify of K tokens should cost about one decode step where the kernels stream weights well;
`runtime_profile` puts the measured step times next to that floor. `draftsmith profile` prints
it as JSON; the SPS(B) part is the table the prefix scheduler uses (policy/profile.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from draftsmith.core.warp import argmax_rows


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, the input embedding as one
    row (a lookup) unless it is tied to the lm_head (then it is read whole, as the lm_head)."""
    seen: set[int] = set()
    total = 0
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is emb and not tied:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int = 512 << 20, repeats: int = 9) -> float:
    """Read bandwidth in GB/s: a `sum` over `nbytes` of float32 with torch's threads, the fastest
    of `repeats` (the limit is what the hardware can do; a shared machine only ever slows a
    repeat down: 40-68 GB/s were seen on the same 2 cores within a minute)."""
    dev = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    times = []
    for i in range(repeats + 2):
        _sync(dev)
        t0 = time.perf_counter()
        x.sum()
        _sync(dev)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def step_runner(model, rows: int, width: int, context_len: int = 200, cache=None) -> Callable[[Callable[[], float]], float]:
    """A function that runs one target forward of [rows, width] new tokens after `context_len`
    cached ones, with what the engine reads of a greedy round's logits (the argmax of every
    position: engine.py verifies an all-greedy batch by `verify_greedy`), and returns its
    seconds by `clock`. KV contents do not change the cost: the rows simply claim
    `context_len` cached tokens. `cache` (>= rows rows, >= context_len + width + 1 positions)
    may be shared between runners: its first `rows` rows are used."""
    if cache is None:
        cache = model.new_cache(rows, context_len + width + 1)
    cache.lengths[:rows] = context_len
    ids = torch.randint(0, model.config.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    row_ids = torch.arange(rows)

    def run(clock: Callable[[], float] = time.perf_counter) -> float:
        _sync(model.device)
        t0 = clock()
        out = model(ids, cache, rows=row_ids)
        argmax_rows(out.logits.reshape(rows * width, -1)).tolist()  # (the engine reads the tokens)
        _sync(model.device)
        return clock() - t0

    return run


def step_time(model, rows: int, width: int, context_len: int = 200, repeats: int = 7, warmup: int = 2,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of one target forward of [rows, width] new tokens after `context_len`
    cached ones (step_runner), over `repeats` steps after `warmup` untimed ones."""
    run = step_runner(model, rows, width, context_len)
    for _ in range(warmup):
        run(clock)
    return statistics.median(run(clock) for _ in range(repeats))


def runtime_profile(model, tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), context_len: int = 200,
                    repeats: int = 7) -> dict:
    """One row of `tokens` new tokens per forward (a batch-1 verify of tokens − 1 drafts), the
    decode floor and each step in decode steps."""
    bw = measure_bandwidth(model.device)
    wb = weight_bytes(model)
    step_ms = [1e3 * step_time(model, 1, t, context_len, repeats) for t in tokens]
    decode_ms = step_ms[tokens.index(1)] if 1 in tokens else 1e3 * step_time(model, 1, 1, context_len, repeats)
    floor_ms = 1e3 * wb / (bw * 1e9)
    return {
        "tokens": list(tokens), "step_ms": step_ms, "decode_ms": decode_ms,
        "verify_in_decode_steps": [s / decode_ms for s in step_ms],
        "weight_bytes": wb, "bandwidth_gbs": bw, "floor_ms": floor_ms,
        "decode_over_floor": decode_ms / floor_ms, "context_len": context_len,
        "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type,
        "linear_backend": model.linear_backend, "threads": torch.get_num_threads(),
        **({"cpu_kernels": _kernel_note()} if model.device.type == "cpu" else {}),
    }


def _kernel_note() -> str:
    """Whether Draftsmith's CPU kernels run here, and where they are or why not."""
    from draftsmith.kernels.build import cpu_kernels

    st = cpu_kernels()
    return (f"loaded ({'float32 + bfloat16' if st.bf16 else 'float32'}): {st.reason}" if st.ok
            else f"not available: {st.reason}")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)

"""One tier (phase) of a bench: the same requests for every configuration, warmed up, then run
in alternating order per interleaving unit (A B C, C B A, …; docs/MEASURING.md #1).

A unit is one request at concurrency 1 in a closed loop (so the ratio's spread is per prompt),
else the whole request list; `repeats` repeats the units.
"""

from __future__ import annotations

from collections.abc import Callable

from draftsmith.bench.config import BenchConfig
from draftsmith.bench.loadgen import BenchRequest, poisson_offsets
from draftsmith.bench.machine import loadavg, utc_now
from draftsmith.bench.metrics import RunResult
from draftsmith.bench.phases import Phase
from draftsmith.bench.tier_lines import phase_lines
from draftsmith.bench.workload import Workload
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.structured import StructuredOutputsParams


def _requests(cfg: BenchConfig, wl: Workload, n: int, index_base: int = 0) -> list[BenchRequest]:
    out = []
    grammar = StructuredOutputsParams(json=cfg.schema) if cfg.json_schema is not None else None
    for j in range(n):
        p = wl.prompts[j % len(wl.prompts)]
        seed = cfg.seed * 1_000_003 + index_base + j
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed,
                                structured_outputs=grammar)
        out.append(BenchRequest(j, p.id, p.messages, p.token_ids, params, p.followups))
    return out


def run_phase(backend, cfg: BenchConfig, phase: Phase, wl: Workload, max_len: int, bar, fp_sha: str,
              log: Callable[[str], None]) -> list[dict]:
    started, load0 = utc_now(), loadavg()
    runners = backend.runners(phase, max_len)
    try:
        C, N = phase.concurrency, cfg.requests
        reqs = _requests(cfg, wl, N)
        closed = phase.arrival.mode == "closed"
        offsets = None if closed else poisson_offsets(N, phase.arrival.rate, cfg.seed * 7919 + C)

        def tick(label: str):
            def f(_rec) -> None:
                bar.set_description_str(f"bench {phase.key} {label}", refresh=False)
                bar.update(1)
            return f

        # warm-up (docs/MEASURING.md #4): unmeasured requests per configuration, at this tier's concurrency
        if cfg.warmup:
            warm = _requests(cfg, wl, cfg.warmup, index_base=10_000_000)
            for r in runners:
                r.run(warm, 1 if r.kind == "peer" else min(C, cfg.warmup), None, tick(r.label))
        per_request_units = closed and C == 1
        unit_lists = [[i] for i in range(N)] if per_request_units else [list(range(N))]
        units = unit_lists * cfg.repeats
        runs: dict[str, list[RunResult]] = {r.label: [] for r in runners}
        mem: dict[str, dict] = {}
        for u, idx in enumerate(units):
            order = runners if u % 2 == 0 else list(reversed(runners))
            sub = [reqs[i] for i in idx]
            offs = None if offsets is None else [offsets[i] - offsets[idx[0]] for i in idx]
            for r in order:
                backend.reset_peak()
                res = r.run(sub, C, offs, tick(r.label))
                runs[r.label].append(res)
                m = backend.memory(r)
                prev = mem.get(r.label)
                if prev and prev.get("cuda_peak_allocated_bytes") is not None:
                    m["cuda_peak_allocated_bytes"] = max(m["cuda_peak_allocated_bytes"], prev["cuda_peak_allocated_bytes"])
                mem[r.label] = m
        return phase_lines(cfg, phase, runners, runs, mem, started, load0, fp_sha, per_request_units, log)
    finally:
        backend.release(runners)

"""Per-request records and their aggregation into one (tier, configuration) summary.

Definitions (also written into report.json):
  system tokens/s      output tokens of all measured requests / wall time of the measured runs
  per-user tokens/s    per request: output tokens / end-to-end latency; mean, median, worst
  TTFT                 arrival (or queue entry) -> first output token delivered
  inter-token latency  gap between deliveries of one request, split evenly over the tokens a
                       delivery brought (a speculative round delivers several at once); over a
                       server: one sample per streamed chunk
  TPOT                 per request: (end-to-end − TTFT) / (output tokens − 1)
  acceptance rate      accepted draft tokens / proposed draft tokens (counts)
  τ                    committed tokens / verification rounds, bonus token included (counts)
  per-position         rounds that accepted >= k drafts / rounds that proposed >= k
  target forwards/tok  target forward passes each request took part in (prefill included),
                       summed, / output tokens: 1 + 1/len for plain decoding
  engine steps/tok     batched target forwards (one per engine step, plus one per prefill) /
                       output tokens: what bounds a memory-bandwidth-bound decoder
  decode tokens/s      (in-process) output tokens / the engine steps' time less the time the
                       engine spent admitting requests (prefill, the drafter's start): the
                       decode phase apart from prompt processing, which can be most of a closed
                       loop's wall time at high concurrency; a diagnostic, system tokens/s stays
                       the headline
  prefill share        the engine's admitting time / wall time (the rest of the wall time is the
                       decode phase, the load generator's own work and idle waits for arrivals)
Percentiles use linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    index: int  # position in the tier's request list (same prompt, same seed for every config)
    prompt_id: str
    t_arrival: float  # seconds since the run's start (a later turn: when the previous answer ended)
    ttft: float | None = None
    e2e: float | None = None
    deliveries: list[list[float]] = field(default_factory=list)  # [[gap_s, tokens], ...] after the first
    output_tokens: int = 0
    output_sha: str | None = None  # sha256 of the output token ids (in-process) or text (endpoint)
    finish_reason: str | None = None
    error: str | None = None
    # speculative counts (in-process only)
    proposed: int | None = None
    accepted: int | None = None
    rounds: int | None = None
    committed: int | None = None
    target_forwards: int | None = None
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    turn: int = 0  # 0 = the first user turn of the request's conversation
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the prefix cache held (in-process; a server's usage field)

    def to_json(self) -> dict:
        d = asdict(self)
        d["deliveries"] = [[round(g, 7), int(n)] for g, n in self.deliveries]
        for k in ("t_arrival", "ttft", "e2e"):
            if d[k] is not None:
                d[k] = round(d[k], 7)
        return d

    @staticmethod
    def from_json(d: dict) -> "RequestRecord":
        return RequestRecord(**d)

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None


@dataclass
class RunResult:
    """One measured run of one configuration over a list of requests."""

    records: list[RequestRecord]
    wall_s: float
    engine_steps: int | None = None
    batched_forwards: int | None = None
    counters: dict | None = None  # endpoint: /metrics differences, or {"unavailable": reason}
    # in-process: the engine's time admitting requests (prefill), the rest of its steps' time
    # (the decode phase) and the tokens those steps delivered
    decode_s: float | None = None
    decode_tokens: int | None = None
    prefill_s: float | None = None


def sha_of_ids(ids: Sequence[int]) -> str:
    return hashlib.sha256((",".join(map(str, ids))).encode()).hexdigest()[:16]


def sha_of_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile, q in [0, 100]; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(xs: Sequence[float]) -> dict:
    xs = [float(x) for x in xs if x is not None]
    return {"n": len(xs), "mean": statistics.fmean(xs) if xs else None,
            "p50": percentile(xs, 50), "p95": percentile(xs, 95), "p99": percentile(xs, 99),
            "max": max(xs) if xs else None}


def spread(xs: Sequence[float]) -> dict:
    xs = [float(x) for x in xs if x is not None and math.isfinite(x)]
    return {"n": len(xs), "median": statistics.median(xs) if xs else None,
            "min": min(xs) if xs else None, "max": max(xs) if xs else None}


def itl_samples(records: Sequence[RequestRecord]) -> list[float]:
    out: list[float] = []
    for r in records:
        for gap, n in r.deliveries:
            n = int(n)
            if n > 0:
                out.extend([gap / n] * n)
    return out


def _sum(xs) -> int | None:
    xs = list(xs)
    return None if any(x is None for x in xs) or not xs else int(sum(xs))


def position_acceptance(proposed_at: Sequence[int], accepted_at: Sequence[int]) -> list[float | None]:
    return [(a / p if p else None) for p, a in zip(proposed_at, list(accepted_at) + [0] * len(proposed_at))]


def _turn_summary(ok: Sequence[RequestRecord], turn: int) -> dict:
    prompt = [r.prompt_tokens for r in ok]
    cached = [r.cached_tokens for r in ok]
    return {"turn": turn + 1, "requests": len(ok), "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
            "prompt_tokens": _sum(prompt), "cached_tokens": _sum(cached),
            "output_tokens": sum(r.output_tokens for r in ok)}


def summarize(runs: Sequence[RunResult], *, counts_from_endpoint: dict | None = None) -> dict:
    """Aggregate the measured runs (one per interleaving unit) of one configuration."""
    records = [r for run in runs for r in run.records]
    ok = [r for r in records if r.ok]
    wall = sum(run.wall_s for run in runs)
    tokens = sum(r.output_tokens for r in ok)
    e2e = [r.e2e for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    per_user = [r.output_tokens / r.e2e for r in ok if r.e2e and r.e2e > 0]
    steps = _sum(run.engine_steps for run in runs)
    # (run_engine sets the decode-phase fields together; endpoint and peer runs set none)
    measured = bool(runs) and all(run.decode_s is not None for run in runs)
    decode = [(run.decode_tokens, run.decode_s) for run in runs]
    decode_s = sum(d for _, d in decode) if measured else None
    fwd_batched = _sum(run.batched_forwards for run in runs)
    s: dict = {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_examples": sorted({r.error for r in records if r.error})[:3],
        "output_tokens": tokens, "wall_s": wall,
        "system_tokens_per_s": tokens / wall if wall > 0 else None,
        "system_tokens_per_s_per_unit": [
            (sum(r.output_tokens for r in run.records if r.ok) / run.wall_s if run.wall_s > 0 else None) for run in runs],
        "per_user_tokens_per_s": {"mean": statistics.fmean(per_user) if per_user else None,
                                  "p50": percentile(per_user, 50), "min": min(per_user) if per_user else None},
        "ttft_s": distribution(ttft), "itl_s": distribution(itl_samples(ok)), "tpot_s": distribution(tpot),
        "e2e_s": distribution(e2e),
        "engine_steps": steps, "batched_forwards": fwd_batched,
        "engine_steps_per_token": (fwd_batched / tokens) if fwd_batched is not None and tokens else None,
        "decode_tokens_per_s": (sum(n for n, _ in decode) / decode_s) if measured and decode_s else None,
        "decode_tokens_per_s_per_unit": [(n / d if d else None) for n, d in decode] if measured else None,
        "prefill_time_share": sum(run.prefill_s for run in runs) / wall if measured and wall > 0 else None,
    }
    if counts_from_endpoint is None:
        proposed = _sum(r.proposed for r in ok)
        accepted = _sum(r.accepted for r in ok)
        rounds = _sum(r.rounds for r in ok)
        committed = _sum(r.committed for r in ok)
        forwards = _sum(r.target_forwards for r in ok)
        width = max((len(r.proposed_at) for r in ok), default=0)
        pos_p = [sum(r.proposed_at[k] for r in ok if k < len(r.proposed_at)) for k in range(width)]
        pos_a = [sum(r.accepted_at[k] for r in ok if k < len(r.accepted_at)) for k in range(width)]
        source = "engine counters"
    else:
        c = counts_from_endpoint
        proposed, accepted, rounds, committed = c.get("proposed"), c.get("accepted"), c.get("rounds"), c.get("committed")
        forwards = c.get("target_forwards")
        pos_p, pos_a = c.get("position_proposed", []), c.get("position_accepted", [])
        source = c.get("source", "server /metrics")
        if s["engine_steps_per_token"] is None and c.get("engine_steps") is not None and tokens:
            s["engine_steps"] = c["engine_steps"]
            s["engine_steps_per_token"] = c["engine_steps"] / c["generation_tokens"] if c.get("generation_tokens") else None
        tokens_for_fwd = c.get("generation_tokens") or tokens
    turns = sorted({r.turn for r in records})
    if turns != [0]:  # conversations: what each turn waited for and how much of its prompt was cached
        s["by_turn"] = [_turn_summary([r for r in ok if r.turn == t], t) for t in turns]
    s.update({
        # (SGLang's /metrics counts rounds but no proposed drafts: tau without an acceptance rate)
        "counts_source": source if proposed is not None or rounds is not None else "unavailable",
        "draft_proposed": proposed, "draft_accepted": accepted, "rounds": rounds, "committed": committed,
        "acceptance_rate": accepted / proposed if proposed else None,  # None: no drafts proposed
        "tau": (committed / rounds if rounds else None),
        "target_forwards": forwards,
        "target_forwards_per_token": (forwards / (tokens if counts_from_endpoint is None else tokens_for_fwd)
                                      if forwards is not None and tokens else None),
        "position_proposed": pos_p, "position_accepted": pos_a,
        "per_position_acceptance": position_acceptance(pos_p, pos_a),
    })
    return s

"""The results lines of a finished tier, one per configuration: its summary, equality with the
baseline (temperature 0), speedup and its spread, void reasons and verdict."""

from __future__ import annotations

import os
from typing import Any

from draftsmith.bench.config import BASELINE
from draftsmith.bench.machine import loadavg, utc_now
from draftsmith.bench.metrics import RunResult, spread, summarize
from draftsmith.bench.results import FORMAT_VERSION
from draftsmith.bench.verdict import verdict


def _sum_counters(runs: list[RunResult]) -> dict | None:
    cs = [r.counters for r in runs if r.counters is not None]
    if not cs:
        return None
    bad = next((c for c in cs if "unavailable" in c), None)
    if bad is not None:
        return {"unavailable": bad["unavailable"]}
    out: dict[str, Any] = {"source": cs[0].get("source")}
    for k in ("proposed", "accepted", "rounds", "committed", "generation_tokens", "engine_steps", "target_forwards"):
        vals = [c.get(k) for c in cs]
        out[k] = None if any(v is None for v in vals) else sum(vals)
    for k in ("position_proposed", "position_accepted"):
        width = max(len(c[k]) for c in cs)
        out[k] = [sum(c[k][i] for c in cs if i < len(c[k])) for i in range(width)]
    out["server_rss_bytes"] = cs[-1].get("server_rss_bytes")
    return out


def phase_lines(cfg, phase, runners, runs, mem, started, load0, fp_sha, per_request_units, log) -> list[dict]:
    """One results line per runner of `phase`, from its runs (`runs[label]`: one RunResult per unit)."""
    labels = [r.label for r in runners]
    base_label = BASELINE if BASELINE in labels else None
    summaries = {}
    for r in runners:
        counters = _sum_counters(runs[r.label]) if r.kind == "endpoint" else None
        if counters is not None and "unavailable" in counters:
            s = summarize(runs[r.label])
            for k in ("draft_proposed", "draft_accepted", "rounds", "committed", "acceptance_rate", "tau",
                      "target_forwards", "target_forwards_per_token"):
                s[k] = None
            s.update(position_proposed=[], position_accepted=[], per_position_acceptance=[],
                     counts_source=f"unavailable: {counters['unavailable']}")
        else:
            s = summarize(runs[r.label], counts_from_endpoint=counters)
        if counters is not None and counters.get("server_rss_bytes") is not None:
            mem[r.label]["server_rss_bytes"] = counters["server_rss_bytes"]
        summaries[r.label] = s
    greedy = cfg.temperature == 0
    lines = []
    finished, load1 = utc_now(), loadavg()
    for r in runners:
        s = summaries[r.label]
        line: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "fingerprint": fp_sha, "phase": phase.key, "tier": phase.tier,
            "concurrency": phase.concurrency, "arrival": phase.arrival.label, "label": r.label, "kind": r.kind,
            "info": r.info, "started": started, "finished": finished, "loadavg_start": load0, "loadavg_end": load1,
            "interleaving": {"unit": "request" if per_request_units else "request list", "units": len(runs[r.label]),
                             "order": "alternating (A B C, C B A, ...)", "position_in_order": labels.index(r.label)},
            "units": [{"wall_s": x.wall_s, "engine_steps": x.engine_steps, "batched_forwards": x.batched_forwards,
                       "decode_s": x.decode_s, "decode_tokens": x.decode_tokens, "prefill_s": x.prefill_s,
                       "counters": x.counters, "records": [rec.to_json() for rec in x.records]}
                      for x in runs[r.label]],
            "summary": s, "memory": mem.get(r.label, {}),
        }
        # equality with the baseline, request by request in the same unit (T = 0 only)
        eq: dict[str, Any] = {"checked": False}
        if base_label is not None and r.label != base_label:
            if greedy:
                compared, mism = 0, []
                for ub, ux in zip(runs[base_label], runs[r.label]):
                    bmap = {(rec.index, rec.turn): rec.output_sha for rec in ub.records if rec.ok}
                    for rec in ux.records:
                        if rec.ok and (rec.index, rec.turn) in bmap:
                            compared += 1
                            if rec.output_sha != bmap[(rec.index, rec.turn)]:
                                mism.append(rec.prompt_id + (f" (turn {rec.turn + 1})" if rec.turn else ""))
                eq = {"checked": True, "compared": compared, "mismatches": len(mism), "mismatched_prompts": mism[:20],
                      "against": base_label}
            else:
                eq = {"checked": False, "reason": "temperature > 0: outputs are equal in distribution, not per seed"}
        line["equality"] = eq
        # speed relative to the baseline at this tier
        if base_label is not None and r.label != base_label:
            b = summaries[base_label]
            bt, xt = b.get("system_tokens_per_s"), s.get("system_tokens_per_s")
            line["speedup"] = xt / bt if bt and xt else None
            unit_ratios = [(x / y) if x and y else None for x, y in
                           zip(s["system_tokens_per_s_per_unit"], b["system_tokens_per_s_per_unit"])]
            line["speedup_spread"] = spread(unit_ratios)
            be = {(u, rec.index, rec.turn): rec.e2e / max(rec.output_tokens, 1)
                  for u, run in enumerate(runs[base_label]) for rec in run.records if rec.ok}
            per_req = [be[(u, rec.index, rec.turn)] / (rec.e2e / max(rec.output_tokens, 1))
                       for u, run in enumerate(runs[r.label]) for rec in run.records
                       if rec.ok and (u, rec.index, rec.turn) in be and rec.e2e]
            line["per_request_speedup"] = spread(per_req)
            bd, xd = b.get("decode_tokens_per_s"), s.get("decode_tokens_per_s")
            line["decode_speedup"] = xd / bd if bd and xd else None
            line["decode_speedup_spread"] = spread(
                [(x / y) if x and y else None for x, y in
                 zip(s.get("decode_tokens_per_s_per_unit") or [], b.get("decode_tokens_per_s_per_unit") or [])])
        else:
            line["speedup"] = 1.0 if r.label == base_label else None
            line["speedup_spread"] = None
            line["per_request_speedup"] = None
            line["decode_speedup"] = 1.0 if r.label == base_label and s.get("decode_tokens_per_s") else None
            line["decode_speedup_spread"] = None
        void_reasons = []
        if r.kind != "peer" and eq.get("mismatches"):
            void_reasons.append(f"{eq['mismatches']} of {eq['compared']} greedy outputs differ from the baseline's")
        if s["errors"]:
            void_reasons.append(f"{s['errors']} of {s['requests']} requests failed")
        line["void"] = bool(void_reasons)
        line["void_reason"] = "; ".join(void_reasons) or None
        if r.kind == "peer":
            line["verdict"] = {"decision": "peer", "reason": "reference point (another toolkit)"}
        elif r.kind == "control":
            line["verdict"] = {"decision": "control", "flags": [], "reason": (
                "plain decoding measured again (A/A): its ratio to the baseline is this run's noise"
                + (f" [{line['void_reason']}]" if line["void"] else ""))}
        else:
            loads = [x[0] for x in (load0, load1) if x]
            row = {**s, "speedup": line["speedup"], "void": line["void"], "void_reason": line["void_reason"],
                   "concurrency": phase.concurrency, "loadavg": max(loads) if loads else None,
                   "cores": os.cpu_count()}
            line["verdict"] = verdict(row, summaries.get(base_label) if base_label else None,
                                      is_baseline=r.label == base_label)
        lines.append(line)
    parts = []
    for ln in lines:
        tps = ln["summary"]["system_tokens_per_s"]
        sp = ln["speedup"]
        dsp = ln.get("decode_speedup")
        decode = f", decode {dsp:.2f}×" if dsp is not None else ""
        parts.append(f"{ln['label']} {tps:.1f} tok/s" + (f" ({sp:.2f}×{decode}, {ln['verdict']['decision']})"
                                                          if sp is not None and ln['label'] != base_label else "")
                     if tps else f"{ln['label']} (no tokens)")
    log(f"bench: {phase.key} ({phase.arrival.label}) done: " + "; ".join(parts))
    return lines

"""The bench report: report.json (every number + the full setup), report.md (headline, tables,
verdicts; bench/report_markdown.py), and three PNG plots (bench/report_plots.py), all built
from setup.json + results.jsonl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from draftsmith.bench.machine import utc_now
from draftsmith.bench.report_markdown import headline_bullets, render_markdown
from draftsmith.bench.report_plots import plot_acceptance, plot_latency, plot_throughput

REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOT_THROUGHPUT = "throughput_vs_concurrency.png"
PLOT_LATENCY = "latency_percentiles.png"
PLOT_ACCEPTANCE = "acceptance_per_position.png"
OUTPUT_FILES = (REPORT_JSON, REPORT_MD, PLOT_THROUGHPUT, PLOT_LATENCY, PLOT_ACCEPTANCE)

DEFINITIONS = {
    "system_tokens_per_s": "output tokens of all measured requests / wall time of the measured runs",
    "per_user_tokens_per_s": "per request: output tokens / end-to-end latency (mean, median, worst)",
    "ttft_s": "request arrival (queue entry) to its first output token",
    "itl_s": "gap between a request's token deliveries split evenly over the tokens delivered "
             "(endpoint: one sample per streamed chunk)",
    "tpot_s": "per request: (end-to-end - TTFT) / (output tokens - 1)",
    "e2e_s": "request arrival to its last token",
    "by_turn": "--turns: per user turn of the conversations, its TTFT (from the previous answer's end) and the "
               "prompt tokens sent and found in the prefix cache (in-process: the engine's; a server: usage."
               "prompt_tokens_details.cached_tokens where it reports it)",
    "acceptance_rate": "accepted draft tokens / proposed draft tokens (counts)",
    "tau": "committed tokens / verification rounds, bonus token included (counts)",
    "per_position_acceptance": "rounds that accepted >= k drafts / rounds that proposed >= k",
    "target_forwards_per_token": "target forwards each request took part in (prefill included) / output tokens",
    "engine_steps_per_token": "batched target forwards (steps + prefills) / output tokens",
    "speedup": "system tokens/s / the baseline's at the same tier, measured interleaved in the same run",
    "speedup_spread": "median/min/max of that ratio over interleaving units (a unit is one request at "
                      "concurrency 1 closed loop, else the whole request list)",
    "per_request_speedup": "per request: baseline seconds per token / this configuration's, same prompt and unit",
    "decode_tokens_per_s": "in-process: output tokens / (the engine steps' time less the engine's time admitting "
                           "requests: the target's prefill and the drafter's start); the decode phase apart from "
                           "prompt processing, which can be most of a closed loop's wall time at high concurrency. "
                           "A drafter's deferred prompt work (features consumed when its row first drafts) stays in "
                           "it. A diagnostic beside system tokens/s, not a headline",
    "prefill_time_share": "in-process: the engine's time admitting requests / wall time",
    "decode_speedup": "decode tokens/s / the baseline's at the same tier (the A/A control's is its noise); "
                      "decode_speedup_spread: its median/min/max over interleaving units",
    "cost_per_1m_output_tokens": "dollars_per_hour / 3600 / system tokens/s x 1e6",
    "goodput": "--goodput: measured requests that met every SLO (ttft, tpot = (e2e - ttft) / (tokens - 1), e2el; "
               "ms) / wall time of the measured runs; a failed request meets none; vs_baseline = its ratio to the "
               "baseline's at the same tier",
    "bandwidth_bound_tokens_per_s": "tokens/s if every batched target forward took only the time to read the "
                                    "weights once at the assumed memory bandwidth (docs/MEASURING.md #8)",
    "fraction_of_bound": "measured system tokens/s / bandwidth_bound_tokens_per_s",
    "verdict": "void if greedy outputs differ from the baseline or requests failed; no-go if slower than the "
               "baseline (speedup < 1) or no drafts proposed or accepted; else go (acceptance is reported, not a gate)",
}


def _compact_record(r: dict) -> dict:
    keys = ("index", "prompt_id", "turn", "t_arrival", "ttft", "e2e", "output_tokens", "output_sha", "finish_reason",
            "error", "proposed", "accepted", "rounds", "committed", "target_forwards", "prompt_tokens", "cached_tokens")
    return {k: r.get(k) for k in keys}


def goodput(records: list[dict], wall_s: float, slo: dict[str, float]) -> dict:
    """Requests that met every SLO (`slo`: metric -> ms; vLLM's ttft / tpot / e2el) per second of
    the measured runs; a failed request meets none, a one-token answer has no TPOT to miss."""
    met = 0
    for r in records:
        if r.get("error") is not None or r.get("e2e") is None:
            continue
        n, ttft, e2e = r["output_tokens"], r.get("ttft") or 0.0, r["e2e"]
        tpot = (e2e - ttft) / (n - 1) if n > 1 else 0.0
        got = {"ttft": ttft, "tpot": tpot, "e2el": e2e}
        met += all(got[k] * 1000.0 <= ms for k, ms in slo.items())
    return {"slo_ms": dict(slo), "met": met, "requests": len(records),
            "fraction": met / len(records) if records else None,
            "requests_per_s": met / wall_s if wall_s > 0 else None}


def build_row(line: dict, *, weights_bytes: int | None, bandwidth_gbs: float | None,
              dollars_per_hour: float | None, slo: dict[str, float] | None = None) -> dict:
    s = line["summary"]
    tps = s.get("system_tokens_per_s")
    row: dict[str, Any] = {
        "label": line["label"], "kind": line["kind"], "info": line["info"],
        "requests": s["requests"], "errors": s["errors"], "output_tokens": s["output_tokens"], "wall_s": s["wall_s"],
        "system_tokens_per_s": tps, "system_tokens_per_s_per_unit": s["system_tokens_per_s_per_unit"],
        "per_user_tokens_per_s": s["per_user_tokens_per_s"],
        "ttft_s": s["ttft_s"], "itl_s": s["itl_s"], "tpot_s": s["tpot_s"], "e2e_s": s["e2e_s"],
        "by_turn": s.get("by_turn"),
        "acceptance_rate": s.get("acceptance_rate"), "tau": s.get("tau"), "counts_source": s.get("counts_source"),
        "draft_proposed": s.get("draft_proposed"), "draft_accepted": s.get("draft_accepted"),
        "rounds": s.get("rounds"), "committed": s.get("committed"), "target_forwards": s.get("target_forwards"),
        "target_forwards_per_token": s.get("target_forwards_per_token"),
        "engine_steps": s.get("engine_steps"), "batched_forwards": s.get("batched_forwards"),
        "engine_steps_per_token": s.get("engine_steps_per_token"),
        "per_position_acceptance": s.get("per_position_acceptance"),
        "position_proposed": s.get("position_proposed"), "position_accepted": s.get("position_accepted"),
        "memory": line.get("memory", {}),
        "cost_per_1m_output_tokens": (dollars_per_hour / 3600.0 / tps * 1e6) if dollars_per_hour is not None and tps else None,
        "speedup": line.get("speedup"), "speedup_spread": line.get("speedup_spread"),
        "per_request_speedup": line.get("per_request_speedup"),
        "decode_tokens_per_s": s.get("decode_tokens_per_s"), "prefill_time_share": s.get("prefill_time_share"),
        "decode_speedup": line.get("decode_speedup"), "decode_speedup_spread": line.get("decode_speedup_spread"),
        "equality": line.get("equality"), "void": line.get("void"), "void_reason": line.get("void_reason"),
        "verdict": line.get("verdict"), "interleaving": line.get("interleaving"),
        "loadavg_start": line.get("loadavg_start"), "loadavg_end": line.get("loadavg_end"),
        "started": line.get("started"), "finished": line.get("finished"),
        "per_request": [_compact_record(r) for u in line["units"] for r in u["records"]],
    }
    row["goodput"] = goodput([r for u in line["units"] for r in u["records"]], s["wall_s"], slo) if slo else None
    fwd = s.get("batched_forwards")
    if weights_bytes and bandwidth_gbs and fwd and tps and s["wall_s"]:
        floor = weights_bytes / (bandwidth_gbs * 1e9)
        row["bandwidth_bound_tokens_per_s"] = s["output_tokens"] / (fwd * floor)
        row["fraction_of_bound"] = tps / row["bandwidth_bound_tokens_per_s"]
    else:
        row["bandwidth_bound_tokens_per_s"] = row["fraction_of_bound"] = None
    return row


def _pooled_positions(rows: list[dict]) -> dict[str, list[float | None]]:
    pooled: dict[str, tuple[list[int], list[int]]] = {}
    for r in rows:
        pp, pa = r.get("position_proposed") or [], r.get("position_accepted") or []
        if not pp or not any(pp):
            continue
        acc = pooled.setdefault(r["label"], ([], []))
        for k, (p, a) in enumerate(zip(pp, list(pa) + [0] * len(pp))):
            if k >= len(acc[0]):
                acc[0].append(0)
                acc[1].append(0)
            acc[0][k] += p
            acc[1][k] += a
    return {lab: [(a / p if p else None) for p, a in zip(*v)] for lab, v in pooled.items()}


def _peers_section(lines: list[dict], rows_by_phase: dict[str, list[dict]]) -> dict | None:
    phase = next((ln["phase"] for ln in lines if ln["kind"] == "peer"), None)
    if phase is None:
        return None
    rows = rows_by_phase[phase]
    ours = [r for r in rows if r["kind"] != "peer"]
    peers = []
    for p in (r for r in rows if r["kind"] == "peer"):
        pe = {(x["index"]): x for x in p["per_request"] if x["e2e"]}
        entry = {"label": p["label"], "info": p["info"], "system_tokens_per_s": p["system_tokens_per_s"],
                 "ttft_s": p["ttft_s"], "itl_s": p["itl_s"], "e2e_s": p["e2e_s"], "output_tokens": p["output_tokens"],
                 "memory": p["memory"], "ours_vs_peer": {}, "ours_vs_peer_per_request": {}}
        for o in ours:
            entry["ours_vs_peer"][o["label"]] = (o["system_tokens_per_s"] / p["system_tokens_per_s"]
                                                 if o["system_tokens_per_s"] and p["system_tokens_per_s"] else None)
            ratios = []
            for x in o["per_request"]:
                y = pe.get(x["index"])
                if y and x["e2e"] and x["output_tokens"] and y["output_tokens"]:
                    ratios.append((y["e2e"] / y["output_tokens"]) / (x["e2e"] / x["output_tokens"]))
            ratios.sort()
            entry["ours_vs_peer_per_request"][o["label"]] = (
                {"n": len(ratios), "median": ratios[len(ratios) // 2] if len(ratios) % 2 else
                 (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2 if ratios else None,
                 "min": ratios[0] if ratios else None, "max": ratios[-1] if ratios else None})
        base = next((o for o in ours if o["kind"] == "baseline"), None)
        if base is not None:
            bmap = {x["index"]: x["output_sha"] for x in base["per_request"]}
            same = sum(1 for x in p["per_request"] if bmap.get(x["index"]) == x["output_sha"])
            entry["same_output_as_our_baseline"] = {"equal": same, "compared": len(p["per_request"]),
                                                    "note": "informational: float differences may flip near-ties"}
        peers.append(entry)
    return {"phase": phase, "concurrency": 1, "arrival": "closed", "peers": peers,
            "ours": [{"label": o["label"], "system_tokens_per_s": o["system_tokens_per_s"]} for o in ours],
            "timing_note": "end-to-end times are exact; HF's TTFT / inter-token come from streamer callbacks "
                           "(up to one step late), llama.cpp's from each yielded token"}


def write_report(out: Path, setup: dict, lines: list[dict], cfg, *, weights_bytes: int | None,
                 bandwidth_gbs: float | None) -> Path:
    out = Path(out)
    dollars = cfg.dollars_per_hour
    rows_by_phase: dict[str, list[dict]] = {}
    meta: dict[str, dict] = {}
    for ln in lines:
        rows_by_phase.setdefault(ln["phase"], []).append(
            build_row(ln, weights_bytes=weights_bytes, bandwidth_gbs=bandwidth_gbs, dollars_per_hour=dollars,
                      slo=dict(cfg.goodput)))
        meta[ln["phase"]] = {"phase": ln["phase"], "concurrency": ln["concurrency"], "arrival": ln["arrival"],
                             "tier": ln["tier"]}
    order = {lab: i for i, lab in enumerate(list(cfg.config_labels) + ["hf:generate", "hf:prompt-lookup", "hf:assistant"])}
    tiers = []
    for key, m in sorted(meta.items(), key=lambda kv: kv[1]["concurrency"]):
        if not m["tier"]:
            continue
        rows = sorted(rows_by_phase[key], key=lambda r: order.get(r["label"], 99))
        tiers.append({**m, "results": [r for r in rows if r["kind"] != "peer"]})
        base = next((r["goodput"] for r in rows if r["kind"] == "baseline" and r["goodput"]), None)
        for r in rows:
            if r["goodput"] and base:
                g, b = r["goodput"]["requests_per_s"], base["requests_per_s"]
                r["goodput"]["vs_baseline"] = g / b if g is not None and b else None
    peers = _peers_section(lines, rows_by_phase)
    all_rows = [r for t in tiers for r in t["results"]]
    invocations = setup.get("invocations", [])
    report = {
        "format_version": 1, "generated": utc_now(), "setup": setup,
        "machine_load": {"loadavg_start": invocations[0].get("loadavg_start") if invocations else None,
                         "loadavg_end": invocations[-1].get("loadavg_end") if invocations else None,
                         "note": "1/5/15-minute load averages; per tier values are in each result"},
        "dollars_per_hour": dollars,
        "goodput_slo_ms": dict(cfg.goodput) or None,
        "bandwidth_floor": None if not (weights_bytes and bandwidth_gbs) else {
            "weights_bytes": weights_bytes, "gb_per_s": bandwidth_gbs,
            "floor_s_per_forward": weights_bytes / (bandwidth_gbs * 1e9),
            "assumption": "each batched target forward reads every weight once; KV and activations ignored"},
        "definitions": DEFINITIONS,
        "tiers": tiers,
        "peers": peers,
        "acceptance_per_position": _pooled_positions(all_rows),
        "verdicts": [{"concurrency": t["concurrency"], "arrival": t["arrival"], "label": r["label"],
                      **r["verdict"]} for t in tiers for r in t["results"]],
        "raw_results": "results.jsonl (every request's deliveries and counts)",
        "plots": {"throughput": PLOT_THROUGHPUT, "latency": PLOT_LATENCY, "acceptance": PLOT_ACCEPTANCE},
    }
    report["headline"] = headline_bullets(tiers, peers)
    plot_throughput(tiers, peers, out / PLOT_THROUGHPUT)
    plot_latency(tiers, out / PLOT_LATENCY)
    plot_acceptance(report["acceptance_per_position"], out / PLOT_ACCEPTANCE)
    path = out / REPORT_JSON
    tmp = path.with_name(".report.json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    (out / REPORT_MD).write_text(render_markdown(report))
    return path

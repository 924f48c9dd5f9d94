"""The bench report: report.json (every number + the full setup), report.md (headline, tables,
verdicts), and three PNG plots, all built from setup.json + results.jsonl.

    throughput_vs_concurrency.png   system output tokens/s per configuration across tiers
    latency_percentiles.png         TTFT / inter-token / end-to-end P50, P95, P99 across tiers
    acceptance_per_position.png     per drafter: rounds accepting >= k drafts / rounds proposing >= k
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any


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
    "acceptance_rate": "accepted draft tokens / proposed draft tokens (counts)",
    "tau": "committed tokens / verification rounds, bonus token included (counts)",
    "per_position_acceptance": "rounds that accepted >= k drafts / rounds that proposed >= k",
    "target_forwards_per_token": "target forwards each request took part in (prefill included) / output tokens",
    "engine_steps_per_token": "batched target forwards (steps + prefills) / output tokens",
    "speedup": "system tokens/s / the baseline's at the same tier, measured interleaved in the same run",
    "speedup_spread": "median/min/max of that ratio over interleaving units (a unit is one request at "
                      "concurrency 1 closed loop, else the whole request list)",
    "per_request_speedup": "per request: baseline seconds per token / this configuration's, same prompt and unit",
    "cost_per_1m_output_tokens": "dollars_per_hour / 3600 / system tokens/s x 1e6",
    "bandwidth_bound_tokens_per_s": "tokens/s if every batched target forward took only the time to read the "
                                    "weights once at the assumed memory bandwidth (docs/MEASURING.md #8)",
    "fraction_of_bound": "measured system tokens/s / bandwidth_bound_tokens_per_s",
    "verdict": "void if greedy outputs differ from the baseline or requests failed; no-go if acceptance < 0.5, "
               "no drafts, or speedup < 1; else go",
}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _compact_record(r: dict) -> dict:
    keys = ("index", "prompt_id", "t_arrival", "ttft", "e2e", "output_tokens", "output_sha", "finish_reason", "error",
            "proposed", "accepted", "rounds", "committed", "target_forwards")
    return {k: r.get(k) for k in keys}


def build_row(line: dict, *, weights_bytes: int | None, bandwidth_gbs: float | None,
              dollars_per_hour: float | None) -> dict:
    s = line["summary"]
    tps = s.get("system_tokens_per_s")
    row: dict[str, Any] = {
        "label": line["label"], "kind": line["kind"], "info": line["info"],
        "requests": s["requests"], "errors": s["errors"], "output_tokens": s["output_tokens"], "wall_s": s["wall_s"],
        "system_tokens_per_s": tps, "system_tokens_per_s_per_unit": s["system_tokens_per_s_per_unit"],
        "per_user_tokens_per_s": s["per_user_tokens_per_s"],
        "ttft_s": s["ttft_s"], "itl_s": s["itl_s"], "tpot_s": s["tpot_s"], "e2e_s": s["e2e_s"],
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
        "equality": line.get("equality"), "void": line.get("void"), "void_reason": line.get("void_reason"),
        "verdict": line.get("verdict"), "interleaving": line.get("interleaving"),
        "loadavg_start": line.get("loadavg_start"), "loadavg_end": line.get("loadavg_end"),
        "started": line.get("started"), "finished": line.get("finished"),
        "per_request": [_compact_record(r) for u in line["units"] for r in u["records"]],
    }
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


def _headline(tiers: list[dict], peers: dict | None) -> list[str]:
    out: list[str] = []
    labels: list[str] = []
    for t in tiers:
        for r in t["results"]:
            if r["verdict"]["decision"] not in ("baseline", "peer") and r["label"] not in labels:
                labels.append(r["label"])
    for lab in labels:
        pts = [(t["concurrency"], r) for t in tiers for r in t["results"] if r["label"] == lab]
        parts = [f"c{c} {_x(r['speedup'])} {r['verdict']['decision']}" for c, r in pts]
        stops = next((c for c, r in pts if r["verdict"]["decision"] in ("no-go", "void")), None)
        goes = [c for c, r in pts if r["verdict"]["decision"] == "go"]
        if not goes:
            tail = "does not pay at any measured tier"
        elif stops is None:
            tail = "pays at every measured tier"
        else:
            tail = f"stops paying at concurrency {stops}"
        out.append(f"{lab}: {tail} ({'; '.join(parts)})")
    if peers:
        for p in peers["peers"]:
            ratios = ", ".join(f"{lab} {_x(v)}" for lab, v in p["ours_vs_peer"].items())
            out.append(f"vs {p['label']} at concurrency 1 (ours tokens/s ÷ theirs): {ratios}")
    return out


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


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
            "timing_note": "HF end-to-end times are exact; TTFT / inter-token come from streamer callbacks"}


def write_report(out: Path, setup: dict, lines: list[dict], cfg, *, weights_bytes: int | None,
                 bandwidth_gbs: float | None) -> Path:
    out = Path(out)
    dollars = cfg.dollars_per_hour
    rows_by_phase: dict[str, list[dict]] = {}
    meta: dict[str, dict] = {}
    for ln in lines:
        rows_by_phase.setdefault(ln["phase"], []).append(
            build_row(ln, weights_bytes=weights_bytes, bandwidth_gbs=bandwidth_gbs, dollars_per_hour=dollars))
        meta[ln["phase"]] = {"phase": ln["phase"], "concurrency": ln["concurrency"], "arrival": ln["arrival"],
                             "tier": ln["tier"]}
    order = {lab: i for i, lab in enumerate(list(cfg.config_labels) + ["hf:generate", "hf:prompt-lookup", "hf:assistant"])}
    tiers = []
    for key, m in sorted(meta.items(), key=lambda kv: kv[1]["concurrency"]):
        if not m["tier"]:
            continue
        rows = sorted(rows_by_phase[key], key=lambda r: order.get(r["label"], 99))
        tiers.append({**m, "results": [r for r in rows if r["kind"] != "peer"]})
    peers = _peers_section(lines, rows_by_phase)
    all_rows = [r for t in tiers for r in t["results"]]
    invocations = setup.get("invocations", [])
    report = {
        "format_version": 1, "generated": _now(), "setup": setup,
        "machine_load": {"loadavg_start": invocations[0].get("loadavg_start") if invocations else None,
                         "loadavg_end": invocations[-1].get("loadavg_end") if invocations else None,
                         "note": "1/5/15-minute load averages; per tier values are in each result"},
        "dollars_per_hour": dollars,
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
    report["headline"] = _headline(tiers, peers)
    plot_throughput(tiers, peers, out / PLOT_THROUGHPUT)
    plot_latency(tiers, out / PLOT_LATENCY)
    plot_acceptance(report["acceptance_per_position"], out / PLOT_ACCEPTANCE)
    path = out / REPORT_JSON
    tmp = path.with_name(".report.json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    (out / REPORT_MD).write_text(render_markdown(report))
    return path


# ---- markdown ------------------------------------------------------------------------------------


def _f(v, nd: int = 1, scale: float = 1.0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{v * scale:.{nd}f}"


def _pct(d: dict | None, scale: float = 1000.0) -> str:
    if not d or d.get("p50") is None:
        return "–"
    return f"{_f(d['p50'], 0, scale)} / {_f(d['p95'], 0, scale)} / {_f(d['p99'], 0, scale)}"


def _ratio_spread(d: dict | None) -> str:
    if not d or d.get("median") is None:
        return "–"
    return f"{_x(d['median'])} ({_f(d['min'], 2)}–{_f(d['max'], 2)}, n={d['n']})"


def _bytes(v: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def _mb(v) -> str:
    return "–" if v is None else f"{v / 2**20:.0f}"


def headline_table(report: dict) -> str:
    """A compact markdown table: tokens/s, speedup and verdict per tier and configuration."""
    lines = ["| concurrency | config | tokens/s | speedup (spread) | acceptance | τ | verdict |",
             "|---|---|---|---|---|---|---|"]
    for t in report["tiers"]:
        for r in t["results"]:
            sp = r.get("speedup_spread") or {}
            spread = f" ({_f(sp.get('min'), 2)}–{_f(sp.get('max'), 2)}, n={sp.get('n')})" if sp.get("n") else ""
            lines.append(f"| {t['concurrency']} | {r['label']} | {_f(r['system_tokens_per_s'])} | "
                         f"{_x(r['speedup'])}{spread} | {_f(r['acceptance_rate'], 2)} | {_f(r['tau'], 2)} | "
                         f"**{r['verdict']['decision']}**: {r['verdict']['reason']} |")
    return "\n".join(lines)


def render_markdown(rep: dict) -> str:
    st = rep["setup"]
    tgt = st.get("target", {})
    mach = st.get("machine", {})
    wl = st.get("workload", {})
    cfgd = st.get("config", {})
    md = ["# Draftsmith bench report", ""]
    md += ["## Headline", ""] + [f"- {h}" for h in rep["headline"]] + [""]
    md += [headline_table(rep), ""]
    md += ["## Setup", "",
           f"- target: `{tgt.get('id')}` (weights hash `{tgt.get('weights_hash')}`, {tgt.get('dtype', '?')} on "
           f"{tgt.get('device', '?')}, {tgt.get('parameters', '?')} parameters)",
           "- configurations: " + ", ".join(
               f"`{d['label']}`" + (f" (K={d.get('num_speculative_tokens')}, policy {d.get('policy')})"
                                    if d.get("num_speculative_tokens") else "")
               + (f" checkpoint `{d['checkpoint']}`" if d.get("checkpoint") else "") for d in st.get("drafters", [])),
           f"- workload: `{wl.get('name')}`, split **{wl.get('split')}**, {wl.get('unique_prompts')} unique prompts"
           f" ({wl.get('reused_prompts')} reused, {len(wl.get('skipped_prompts') or [])} skipped as too long)",
           f"- sampling: temperature {st['sampling']['temperature']}, top-p {st['sampling']['top_p']}, "
           f"max tokens {st['sampling']['max_tokens']}, seed {st['sampling']['seed']}",
           f"- arrival {st.get('arrival')}, {cfgd.get('requests')} requests per tier and configuration, "
           f"warm-up {st.get('warmup')}, repeats {st.get('repeats')}",
           f"- machine: {mach.get('cpu_count')} × {mach.get('cpu_model')}, torch threads {mach.get('torch_threads')}"
           + (f", GPU {mach.get('gpu')}" if mach.get("gpu") else "")
           + f"; load average at start {rep['machine_load']['loadavg_start']}, end {rep['machine_load']['loadavg_end']}",
           f"- versions: " + ", ".join(f"{k} {v}" for k, v in st.get("versions", {}).items()), ""]
    bf = rep.get("bandwidth_floor")
    if bf:
        md += [f"Physical limit (docs/MEASURING.md #8): {_bytes(bf['weights_bytes'])} of weights per batched forward "
               f"at {bf['gb_per_s']:g} GB/s = {bf['floor_s_per_forward'] * 1000:.3g} ms per forward at best; the "
               "'bound' column is the tokens/s that floor allows for each run's forward count.", ""]
    for t in rep["tiers"]:
        md += [f"## Concurrency {t['concurrency']} ({t['arrival']})", "",
               "| config | tokens/s (system) | per-user tok/s (mean / worst) | speedup | per-request speedup (median, min–max) "
               "| $/1M tok | bound tok/s (fraction) | outputs ≠ baseline | verdict |",
               "|---|---|---|---|---|---|---|---|---|"]
        for r in t["results"]:
            pu = r["per_user_tokens_per_s"]
            pr = r.get("per_request_speedup") or {}
            eq = r.get("equality") or {}
            mism = (f"{eq['mismatches']}/{eq['compared']}" if eq.get("checked") else
                    ("–" if r["kind"] == "baseline" else "not checked"))
            void = " (VOID)" if r.get("void") else ""
            md.append(
                f"| {r['label']} | {_f(r['system_tokens_per_s'])}{void} | {_f(pu['mean'])} / {_f(pu['min'])} | "
                f"{_x(r['speedup'])} | {_ratio_spread(pr)} | "
                f"{_f(r['cost_per_1m_output_tokens'], 2)} | {_f(r['bandwidth_bound_tokens_per_s'])} "
                f"({_f(r['fraction_of_bound'], 2)}) | {mism} | **{r['verdict']['decision']}**: {r['verdict']['reason']} |")
        md += ["", "| config | TTFT ms P50/P95/P99 | ITL ms P50/P95/P99 | TPOT ms P50 | E2E ms P50/P95/P99 | "
               "acceptance | τ | target fwd/tok | steps/tok | RSS MB | KV MB | peak CUDA MB |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["results"]:
            m = r["memory"]
            md.append(
                f"| {r['label']} | {_pct(r['ttft_s'])} | {_pct(r['itl_s'])} | {_f((r['tpot_s'] or {}).get('p50'), 1, 1000)} | "
                f"{_pct(r['e2e_s'])} | {_f(r['acceptance_rate'], 3)} | {_f(r['tau'], 3)} | "
                f"{_f(r['target_forwards_per_token'], 3)} | {_f(r['engine_steps_per_token'], 3)} | "
                f"{_mb(m.get('rss_bytes'))} | {_mb(m.get('kv_cache_bytes'))} | {_mb(m.get('cuda_peak_allocated_bytes'))} |")
        la = t["results"][0]
        md += ["", f"Load average during the tier: {la.get('loadavg_start')} → {la.get('loadavg_end')}.", ""]
    if rep.get("peers"):
        p = rep["peers"]
        md += [f"## Peers (concurrency 1, closed loop, same prompts; phase `{p['phase']}`)", "",
               "| peer | tokens/s | TTFT ms P50 | E2E ms P50 | ours ÷ theirs (tokens/s) | per-request median | "
               "same output as our baseline |", "|---|---|---|---|---|---|---|"]
        for e in p["peers"]:
            ratios = ", ".join(f"{k} {_x(v)}" for k, v in e["ours_vs_peer"].items())
            per_req = ", ".join(f"{k} {_x(v.get('median'))}" for k, v in e["ours_vs_peer_per_request"].items())
            same = e.get("same_output_as_our_baseline") or {}
            md.append(f"| {e['label']} | {_f(e['system_tokens_per_s'])} | {_f(e['ttft_s'].get('p50'), 0, 1000)} | "
                      f"{_f(e['e2e_s'].get('p50'), 0, 1000)} | {ratios} | {per_req} | "
                      f"{same.get('equal', '–')}/{same.get('compared', '–')} |")
        md += ["", p["timing_note"] + ".", ""]
    acc = rep.get("acceptance_per_position") or {}
    if acc:
        md += ["## Per-position acceptance (all tiers pooled)", "", "| drafter | " +
               " | ".join(f"k={k + 1}" for k in range(max(len(v) for v in acc.values()))) + " |",
               "|---|" + "---|" * max(len(v) for v in acc.values())]
        for lab, v in acc.items():
            md.append(f"| {lab} | " + " | ".join(_f(x, 2) for x in v) + " |")
        md.append("")
    skipped = wl.get("skipped_prompts") or []
    md += ["## Notes", "",
           "- Configurations of a tier ran back to back on the same requests (same prompts, seeds and arrival "
           "schedule), in alternating order; ratios are from that one run (docs/MEASURING.md #1).",
           "- At temperature 0 every speculative output is compared with the baseline's; any difference voids that "
           "configuration's speed numbers at that tier.",
           f"- Prompts: split {wl.get('split')}; ids in report.json setup.workload.prompt_ids"
           + (f"; {len(skipped)} skipped as too long" if skipped else "") + ".",
           "- Raw per-request records (every delivery) are in results.jsonl.", "",
           "## Plots", "", f"![throughput]({PLOT_THROUGHPUT})", "", f"![latency]({PLOT_LATENCY})", "",
           f"![acceptance]({PLOT_ACCEPTANCE})", "",
           "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in rep["definitions"].items()] + [""]
    return "\n".join(md)


# ---- plots ----------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _labels(tiers: list[dict]) -> list[str]:
    out: list[str] = []
    for t in tiers:
        for r in t["results"]:
            if r["label"] not in out:
                out.append(r["label"])
    return out


def plot_throughput(tiers: list[dict], peers: dict | None, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for lab in _labels(tiers):
        pts = [(t["concurrency"], r) for t in tiers for r in t["results"] if r["label"] == lab]
        xs = [c for c, r in pts if r["system_tokens_per_s"]]
        ys = [r["system_tokens_per_s"] for c, r in pts if r["system_tokens_per_s"]]
        line, = ax.plot(xs, ys, marker="o", label=lab)
        void = [(c, r["system_tokens_per_s"]) for c, r in pts if r.get("void") and r["system_tokens_per_s"]]
        if void:
            ax.scatter([v[0] for v in void], [v[1] for v in void], s=120, facecolors="none",
                       edgecolors="red", zorder=3, label=f"{lab} (void)")
    for e in (peers or {}).get("peers", []):
        if e["system_tokens_per_s"]:
            ax.scatter([1], [e["system_tokens_per_s"]], marker="x", s=60, label=e["label"], zorder=3)
    concs = sorted({t["concurrency"] for t in tiers}) or [1]
    if len(concs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs)
    ax.set_xticklabels([str(c) for c in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("system output tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_latency(tiers: list[dict], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100)
    metrics = (("ttft_s", "TTFT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency"))
    styles = (("p50", "-"), ("p95", "--"), ("p99", ":"))
    concs = sorted({t["concurrency"] for t in tiers}) or [1]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title) in zip(axes, metrics):
        for i, lab in enumerate(_labels(tiers)):
            for q, ls in styles:
                pts = [(t["concurrency"], (r[key] or {}).get(q)) for t in tiers for r in t["results"] if r["label"] == lab]
                pts = [(c, v * 1000) for c, v in pts if v is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker="o", ms=3,
                            color=colors[i % len(colors)], label=f"{lab} {q.upper()}")
        if len(concs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(concs)
        ax.set_xticklabels([str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (P50 solid, P95 dashed, P99 dotted)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_acceptance(curves: dict[str, list[float | None]], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for lab, ys in curves.items():
        pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
    if not curves:
        ax.text(0.5, 0.5, "no draft tokens were proposed", ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("rounds accepting ≥ k / rounds proposing ≥ k")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-position acceptance (all tiers pooled)")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

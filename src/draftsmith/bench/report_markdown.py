"""The bench report's text: the headline bullets, report.md, and the compact headline table
the CLI prints."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _spread_text(sp: dict | None) -> str:
    """A ratio's spread over interleaved units: "min–max, n=N", "n=1", or "" (none measured)."""
    n = (sp or {}).get("n") or 0
    if n > 1:
        return f"{_f(sp.get('min'), 2)}–{_f(sp.get('max'), 2)}, n={n}"
    return "n=1" if n == 1 else ""


def decode_cell(r: dict) -> str:
    """Decode-phase tokens/s (prefill time excluded) and its ratio to the baseline's, with the
    ratio's spread over interleaving units as speedup_cell prints it."""
    tps, sp = r.get("decode_tokens_per_s"), r.get("decode_speedup")
    if tps is None:
        return "–"
    if sp is None or r.get("kind") == "baseline":
        return _f(tps)
    t = _spread_text(r.get("decode_speedup_spread"))
    return f"{_f(tps)} ({_x(sp)}" + (f", {t}" if t else "") + ")"


def speedup_cell(r: dict) -> str:
    """A row's speedup as every report prints it: the ratio of system tokens/s to the baseline's
    at that tier, then its spread over the n interleaved units it was measured in (a unit is
    one request at concurrency 1, else one run of the whole request list)."""
    t = _spread_text(r.get("speedup_spread")) if r.get("speedup") is not None else ""
    return _x(r.get("speedup")) + (f" ({t})" if t else "")


def slo_text(slo_ms: dict[str, float]) -> str:
    """`--goodput`'s objectives as the reports print them: "ttft ≤ 500 ms, tpot ≤ 50 ms"."""
    return ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo_ms.items())


def _speed(point: tuple[int, dict]) -> float:
    return point[1]["speedup"]


def _at(c: int, r: dict) -> str:
    """One table row cited in a headline: its tier, speedup cell and flags."""
    flags = r["verdict"].get("flags") or []
    return f"concurrency {c}: {speedup_cell(r)}" + (f" [{'; '.join(flags)}]" if flags else "")


def headline_bullets(tiers: list[dict], peers: dict | None) -> list[str]:
    """One line per speculative configuration: whether it pays, citing the table row(s) that
    say so (the same numbers, tier and n as the table), then one per peer."""
    out: list[str] = []
    labels: list[str] = []
    for t in tiers:
        for r in t["results"]:
            if r["verdict"]["decision"] not in ("baseline", "peer", "control") and r["label"] not in labels:
                labels.append(r["label"])
    for lab in labels:
        pts = [(t["concurrency"], r) for t in tiers for r in t["results"] if r["label"] == lab]
        rated = [(c, r) for c, r in pts if r["verdict"]["decision"] in ("go", "no-go") and r["speedup"] is not None]
        goes = [(c, r) for c, r in rated if r["verdict"]["decision"] == "go"]
        stops = [(c, r) for c, r in rated if r["verdict"]["decision"] == "no-go"]
        if not rated:
            text = "not compared with plain decoding at any tier"
        elif not goes:
            text = f"does not pay at any measured tier; its best is {_at(*max(rated, key=_speed))}"
        elif not stops:
            text = f"pays at every measured tier; its least is {_at(*min(goes, key=_speed))}"
        elif goes[-1][0] < stops[0][0]:
            text = (f"pays up to concurrency {goes[-1][0]} (best: {_at(*max(goes, key=_speed))}) and stops paying "
                    f"at {_at(*stops[0])}")
        else:
            text = f"pays at {_at(*max(goes, key=_speed))}, not at {_at(*stops[0])}"
        voids = [(c, r) for c, r in pts if r["verdict"]["decision"] == "void"]
        if voids:
            text += f"; VOID at concurrency {', '.join(str(c) for c, _ in voids)}: {voids[0][1]['verdict']['reason']}"
        out.append(f"{lab}: {text}")
    controls = [(t["concurrency"], r) for t in tiers for r in t["results"] if r["verdict"]["decision"] == "control"]
    if controls:
        out.append("A/A control (plain decoding measured again, side by side): "
                   + "; ".join(f"concurrency {c}: {speedup_cell(r)}" for c, r in controls)
                   + ". How far it sits from 1.00 is this run's noise: speedups closer to 1 than that are not "
                     "differences")
    with_slo = [t for t in tiers if any(r.get("goodput") for r in t["results"])]
    if with_slo:
        slo = slo_text(with_slo[0]["results"][0]["goodput"]["slo_ms"])
        out.append(f"goodput ({slo}), requests/s meeting every SLO: " + "; ".join(
            f"concurrency {t['concurrency']}: " + ", ".join(
                f"{r['label']} {_f(r['goodput']['requests_per_s'], 3)}"
                + (f" ({_x(r['goodput'].get('vs_baseline'))})" if r["kind"] != "baseline" else "")
                for r in t["results"] if r.get("goodput")) for t in with_slo))
    if peers:
        for p in peers["peers"]:
            ratios = ", ".join(f"{lab} {_x(v)}" for lab, v in p["ours_vs_peer"].items())
            out.append(f"vs {p['label']} at concurrency 1 (ours tokens/s ÷ theirs): {ratios}")
    return out


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
    lines = ["| concurrency | config | tokens/s | speedup (min–max, n) | decode tok/s (× baseline, min–max, n) "
             "| acceptance | τ | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for t in report["tiers"]:
        for r in t["results"]:
            lines.append(f"| {t['concurrency']} | {r['label']} | {_f(r['system_tokens_per_s'])} | "
                         f"{speedup_cell(r)} | {decode_cell(r)} | {_f(r['acceptance_rate'], 2)} | {_f(r['tau'], 2)} | "
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
           f"max tokens {st['sampling']['max_tokens']}, seed {st['sampling']['seed']}"
           + ("; every answer keeps to a JSON schema (structured outputs; report.json setup.sampling.json_schema)"
              if st["sampling"].get("json_schema") is not None else ""),
           f"- arrival {st.get('arrival')}, {cfgd.get('requests')} requests per tier and configuration, "
           f"warm-up {st.get('warmup')}, repeats {st.get('repeats')}"
           + (f"; each request a conversation of up to {wl['turns']} user turns ({wl.get('total_turns')} turns "
              "over the request list), a turn sent when the previous answer ends" if wl.get("turns") else "")
           + f"; prefix caching: {st.get('prefix_caching', False)}",
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
               "| config | tokens/s (system) | per-user tok/s (mean / worst) | speedup (min–max, n) "
               "| per-request speedup (median, min–max, n requests) "
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
                f"{speedup_cell(r)} | {_ratio_spread(pr)} | "
                f"{_f(r['cost_per_1m_output_tokens'], 2)} | {_f(r['bandwidth_bound_tokens_per_s'])} "
                f"({_f(r['fraction_of_bound'], 2)}) | {mism} | **{r['verdict']['decision']}**: {r['verdict']['reason']} |")
        md += ["", "| config | TTFT ms P50/P95/P99 | ITL ms P50/P95/P99 | TPOT ms P50 | E2E ms P50/P95/P99 | "
               "decode tok/s (× baseline, min–max, n) | prefill share | "
               "acceptance | τ | target fwd/tok | steps/tok | RSS MB | KV MB | peak CUDA MB |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["results"]:
            m = r["memory"]
            md.append(
                f"| {r['label']} | {_pct(r['ttft_s'])} | {_pct(r['itl_s'])} | {_f((r['tpot_s'] or {}).get('p50'), 1, 1000)} | "
                f"{_pct(r['e2e_s'])} | {decode_cell(r)} | {_f(r.get('prefill_time_share'), 2)} | "
                f"{_f(r['acceptance_rate'], 3)} | {_f(r['tau'], 3)} | "
                f"{_f(r['target_forwards_per_token'], 3)} | {_f(r['engine_steps_per_token'], 3)} | "
                f"{_mb(m.get('rss_bytes'))} | {_mb(m.get('kv_cache_bytes'))} | {_mb(m.get('cuda_peak_allocated_bytes'))} |")
        turned = [r for r in t["results"] if r.get("by_turn")]
        if turned:
            md += ["", "| config | turn | requests | TTFT ms P50/P95/P99 | prompt tokens | cached by the prefix cache |",
                   "|---|---|---|---|---|---|"]
            for r in turned:
                for b in r["by_turn"]:
                    share = (f"{b['cached_tokens']} ({b['cached_tokens'] / b['prompt_tokens']:.0%})"
                             if b.get("cached_tokens") is not None and b.get("prompt_tokens") else "–")
                    md.append(f"| {r['label']} | {b['turn']} | {b['requests']} | {_pct(b['ttft_s'])} | "
                              f"{_f(b.get('prompt_tokens'), 0)} | {share} |")
        if any(r.get("goodput") for r in t["results"]):
            slo = slo_text(t["results"][0]["goodput"]["slo_ms"])
            md += ["", f"| config | goodput req/s ({slo}) | requests meeting every SLO | × baseline |",
                   "|---|---|---|---|"]
            for r in t["results"]:
                g = r.get("goodput") or {}
                md.append(f"| {r['label']} | {_f(g.get('requests_per_s'), 3)} | {g.get('met')} of {g.get('requests')} "
                          f"| {_x(g.get('vs_baseline')) if r['kind'] != 'baseline' else '–'} |")
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
        width = max(len(v) for v in acc.values())
        md += ["## Per-position acceptance (all tiers pooled)", "", "| drafter | " +
               " | ".join(f"k={k + 1}" for k in range(width)) + " |", "|---|" + "---|" * width]
        for lab, v in acc.items():  # a drafter that proposed fewer positions: "–" in the rest (one cell per column)
            md.append(f"| {lab} | " + " | ".join([_f(x, 2) for x in v] + ["–"] * (width - len(v))) + " |")
        md.append("")
    skipped = wl.get("skipped_prompts") or []
    plots = rep["plots"]
    md += ["## Notes", "",
           "- Configurations of a tier ran back to back on the same requests (same prompts, seeds and arrival "
           "schedule), in alternating order; ratios are from that one run (docs/MEASURING.md #1).",
           "- At temperature 0 every speculative output is compared with the baseline's; any difference voids that "
           "configuration's speed numbers at that tier.",
           f"- Prompts: split {wl.get('split')}; ids in report.json setup.workload.prompt_ids"
           + (f"; {len(skipped)} skipped as too long" if skipped else "") + ".",
           "- Raw per-request records (every delivery) are in results.jsonl.", "",
           "## Plots", "", f"![throughput]({plots['throughput']})", "", f"![latency]({plots['latency']})", "",
           f"![acceptance]({plots['acceptance']})", "",
           "## Definitions", ""] + [f"- **{k}**: {v}" for k, v in rep["definitions"].items()] + [""]
    return "\n".join(md)




def report_headline(report_json) -> str:
    """The markdown headline (bullets + per-tier table) of a written report.json."""
    rep = json.loads(Path(report_json).read_text())
    return "\n".join(f"- {h}" for h in rep["headline"]) + "\n\n" + headline_table(rep)

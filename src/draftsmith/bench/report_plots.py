"""The bench report's PNG plots (matplotlib, Agg backend):

    throughput_vs_concurrency.png   system output tokens/s per configuration across tiers
    latency_percentiles.png         TTFT / inter-token / end-to-end P50, P95, P99 across tiers
    acceptance_per_position.png     per drafter: rounds accepting >= k drafts / rounds proposing >= k
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.eval.plots import color_for, conditional_acceptance, legend_below, plt_agg, save


def _labels(tiers: list[dict]) -> list[str]:
    out: list[str] = []
    for t in tiers:
        for r in t["results"]:
            if r["label"] not in out:
                out.append(r["label"])
    return out


def plot_throughput(tiers: list[dict], peers: dict | None, path: Path) -> Path:
    plt = plt_agg()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for lab in _labels(tiers):
        pts = [(t["concurrency"], r) for t in tiers for r in t["results"] if r["label"] == lab]
        xs = [c for c, r in pts if r["system_tokens_per_s"]]
        ys = [r["system_tokens_per_s"] for c, r in pts if r["system_tokens_per_s"]]
        line, = ax.plot(xs, ys, marker="o", label=lab, color=color_for(lab))
        void = [(c, r["system_tokens_per_s"]) for c, r in pts if r.get("void") and r["system_tokens_per_s"]]
        if void:
            ax.scatter([v[0] for v in void], [v[1] for v in void], s=120, facecolors="none",
                       edgecolors="red", zorder=3, label=f"{lab} (void: outputs differ)")
    for e in (peers or {}).get("peers", []):
        if e["system_tokens_per_s"]:
            ax.scatter([1], [e["system_tokens_per_s"]], marker="x", s=60, label=f"{e['label']} (concurrency 1)",
                       color=color_for(e["label"]), zorder=3)
    _concurrency_axis(ax, sorted({t["concurrency"] for t in tiers}) or [1])
    ax.set_ylabel("system output tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    legend_below(ax, ncol=2)
    save(fig, path)
    return path


def _concurrency_axis(ax, concs: list[int]) -> None:
    """x = concurrency tiers: log2 scale when there are several, a tick at each."""
    if len(concs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(concs)
    ax.set_xticklabels([str(c) for c in concs])
    ax.set_xlabel("concurrency")


def plot_latency(tiers: list[dict], path: Path) -> Path:
    plt = plt_agg()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100)
    metrics = (("ttft_s", "TTFT"), ("itl_s", "inter-token latency"), ("e2e_s", "end-to-end latency"))
    styles = (("p50", "-"), ("p95", "--"), ("p99", ":"))
    concs = sorted({t["concurrency"] for t in tiers}) or [1]
    handles: dict = {}  # one legend entry per configuration (its colour); the line style is the percentile
    for ax, (key, title) in zip(axes, metrics):
        for lab in _labels(tiers):
            for q, ls in styles:
                pts = [(t["concurrency"], (r[key] or {}).get(q)) for t in tiers for r in t["results"] if r["label"] == lab]
                pts = [(c, v * 1000) for c, v in pts if v is not None]
                if pts:
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker="o", ms=3,
                                    color=color_for(lab))
                    if q == "p50":
                        handles.setdefault(lab, line)
        _concurrency_axis(ax, concs)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title}: P50 solid, P95 dashed, P99 dotted", fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    legend_below(fig, list(handles.values()), list(handles), ncol=4, fontsize=9)
    save(fig, path)
    return path


def plot_acceptance(curves: dict[str, list[float | None]], path: Path) -> Path:
    return conditional_acceptance(curves, path, title="Per-position acceptance (all tiers pooled)",
                                  ylabel="rounds accepting ≥ k / rounds proposing ≥ k",
                                  empty="no draft tokens were proposed")

"""PNG plots for `draftsmith eval` (matplotlib, headless Agg backend).

    conditional_acceptance(curves, path)     one line per drafter: P(draft k accepted | 1..k−1 were)
    reliability(before, after, path)         per position: confidence bins vs observed frequency
    threshold_sweep(points, path)            τ and acceptance vs a static confidence threshold
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path


def plt_agg():
    """pyplot on the non-interactive Agg backend (bench reports use it too)."""
    # here, not at the top: the Agg backend must be chosen before pyplot loads, and doing it at
    # import would switch the backend of a caller's own matplotlib session
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


# One colour per drafter kind, the same in every eval and bench plot; two drafters of one kind
# (a trained one and the built-in) get that kind's two shades.
_KIND_COLORS = {"none": ("#555555", "#999999"), "ngram": ("#1f77b4", "#6baed6"),
                "dspark": ("#2ca02c", "#98df8a"), "eagle3": ("#d62728", "#ff9896"),
                "dflash": ("#9467bd", "#c5b0d5"), "draft-model": ("#8c564b", "#c49c94")}
_OTHER = ("#ff7f0e", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def color_for(label: str) -> str:
    """A stable colour for a drafter label (KIND or KIND:ARG): by kind, then a shade by ARG."""
    kind, _, arg = label.partition(":")
    shades = _KIND_COLORS.get(kind)
    if shades is None:
        return _OTHER[zlib.crc32(label.encode()) % len(_OTHER)]
    named = arg and "/" not in arg and "\\" not in arg  # a built-in name, not a run directory
    return shades[1] if named else shades[0]


def conditional_acceptance(curves: Mapping[str, Sequence[float | None]], path: Path,
                           title: str = "Conditional acceptance per position",
                           ylabel: str = "P(draft k accepted | drafts 1..k−1 accepted)",
                           empty: str | None = None) -> Path:
    """One line per drafter over draft positions k = 1..; `empty`: the text shown when no
    drafter has a curve (None: an empty frame)."""
    plt = plt_agg()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, ys in curves.items():
        pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color_for(label))
    if not curves and empty:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if curves:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def reliability(before: Sequence[Sequence[dict]], after: Sequence[Sequence[dict]] | None, path: Path,
                title: str = "Reliability (cumulative confidence vs prefix survival)") -> Path:
    """`before[k]` / `after[k]`: reliability bins of position k+1 (metrics.reliability_bins).
    Only positions some round reached get a panel (the rest would be empty frames); each panel
    says how many rounds it holds; axis labels on the outer panels, one legend for the figure."""
    plt = plt_agg()
    after = list(after or [None] * len(before))
    shown = [k for k in range(len(before)) if any(b["count"] for b in (before[k] or ()))]
    n = max(1, len(shown))
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows + 0.5), dpi=100, squeeze=False)
    handles = {}
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= len(shown):
            if not shown and i == 0:
                ax.text(0.5, 0.5, "no confidences recorded", ha="center", va="center", transform=ax.transAxes)
            ax.axis("off")
            continue
        k = shown[i]
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for bins, label, marker, color in ((before[k], "raw", "o", "#1f77b4"),
                                           (after[k] if k < len(after) else None, "STS", "s", "#ff7f0e")):
            pts = [(b["confidence"], b["accuracy"]) for b in (bins or ()) if b["count"]]
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=3, color=color)
                handles[label] = line
        count = sum(b["count"] for b in before[k])
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1} ({count} rounds)", fontsize=9)
        ax.tick_params(labelsize=7)
        if i // cols == rows - 1 or i + cols >= len(shown):
            ax.set_xlabel("confidence Π c_i", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("observed: drafts 1..k accepted", fontsize=8)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def threshold_sweep(points: Sequence[dict], path: Path, title: str = "Static confidence threshold") -> Path:
    plt = plt_agg()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    xs = [p["threshold"] for p in points]
    ax.plot(xs, [p["tokens_per_step"] for p in points], marker="o", ms=3, label="tokens per step (τ)")
    ax.set_xlabel("threshold on Π c_i")
    ax.set_ylabel("tokens per step")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [p["acceptance_rate"] for p in points], color="tab:orange", marker="s", ms=3, label="acceptance")
    ax2.plot(xs, [p["verify_rate"] for p in points], color="tab:green", ls="--", label="verify rate")
    ax2.set_ylabel("rate")
    ax2.set_ylim(0, 1.02)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="lower left")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)

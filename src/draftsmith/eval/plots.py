"""PNG plots for `draftsmith eval` (matplotlib, headless Agg backend).

    conditional_acceptance(curves, path)     one line per drafter: P(draft k accepted | 1..k−1 were)
    reliability(before, after, path)         per position: confidence bins vs observed frequency
    threshold_sweep(points, path)            τ and acceptance vs a static confidence threshold
"""

from __future__ import annotations

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


def conditional_acceptance(curves: Mapping[str, Sequence[float | None]], path: Path,
                           title: str = "Conditional acceptance per position") -> Path:
    plt = plt_agg()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, ys in curves.items():
        pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | drafts 1..k−1 accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def reliability(before: Sequence[Sequence[dict]], after: Sequence[Sequence[dict]] | None, path: Path,
                title: str = "Reliability (cumulative confidence vs prefix survival)") -> Path:
    """`before[k]` / `after[k]`: reliability bins of position k+1 (metrics.reliability_bins)."""
    plt = plt_agg()
    n = max(1, len(before))
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), dpi=100, squeeze=False)
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= len(before):
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for bins, label, marker in ((before[k], "raw", "o"), ((after or [None] * n)[k], "STS", "s")):
            if not bins:
                continue
            pts = [(b["confidence"], b["accuracy"]) for b in bins if b["count"]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ms=3, label=label)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1}", fontsize=9)
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
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

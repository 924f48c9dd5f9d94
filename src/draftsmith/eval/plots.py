"""PNG plots for `draftsmith eval` (matplotlib, headless Agg backend).

    conditional_acceptance(curves, path)     one line per drafter: P(draft k accepted | 1..k−1 were)
    reliability(before, after, path)         per position: confidence bins vs observed frequency
    threshold_sweep(points, path)            τ and acceptance vs a static confidence threshold

Shared with the bench plots: `color_for` (one colour per drafter, the same in every plot) and
`legend_below` (legends go under the axes, never over the data).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.drafters.builtin import builtin_dir

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plt_agg():
    """pyplot on the non-interactive Agg backend (bench reports use it too)."""
    # here, not at the top: the Agg backend must be chosen before pyplot loads, and doing it at
    # import would switch the backend of a caller's own matplotlib session
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


# One colour per drafter kind, the same in every eval and bench plot; a built-in drafter
# (KIND:NAME shipped with the package) gets its kind's light shade, a trained one the dark.
_KIND_COLORS = {"none": ("#555555", "#999999"), "ngram": ("#1f77b4", "#6baed6"),
                "dspark": ("#2ca02c", "#98df8a"), "eagle3": ("#d62728", "#ff9896"),
                "dflash": ("#9467bd", "#c5b0d5"), "draft-model": ("#8c564b", "#c49c94")}
_NAMED = {"hf:generate": "#ff7f0e", "hf:prompt-lookup": "#e377c2", "hf:assistant": "#17becf"}  # bench peers
_OTHER = ("#7f7f7f", "#bcbd22", "#8c6d31", "#393b79", "#e7969c")


def color_for(label: str) -> str:
    """A stable colour for a drafter label (KIND or KIND:ARG): by kind, then built-in or not.

    Eval labels a trained drafter KIND:<checkpoint dir name> and bench KIND:<path>; both get
    the kind's dark shade, so the same drafter has the same colour in both reports."""
    if label in _NAMED:
        return _NAMED[label]
    kind, _, arg = label.partition(":")
    shades = _KIND_COLORS.get(kind)
    if shades is None:
        return _OTHER[zlib.crc32(label.encode()) % len(_OTHER)]
    return shades[1] if arg and builtin_dir(kind, arg) is not None else shades[0]


def legend_below(where: Axes | Figure, handles: Sequence[Artist] | None = None, labels: Sequence[str] | None = None,
                 ncol: int = 3, fontsize: float = 8) -> None:
    """A legend under the axes (`where`: an Axes) or the panels (a Figure), outside the data;
    save with bbox_inches="tight" so it is kept."""
    if handles is None:
        handles, labels = where.get_legend_handles_labels()
    if not handles:
        return
    anchor = (0.5, -0.16) if hasattr(where, "transAxes") else (0.5, 0.0)
    where.legend(handles, labels, loc="upper center", bbox_to_anchor=anchor, ncol=min(ncol, len(handles)),
                 fontsize=fontsize, frameon=False)


def save(fig: Figure, path: Path) -> Path:
    """Write the PNG, legends outside the axes included, and free the figure."""
    fig.savefig(path, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return Path(path)


def conditional_acceptance(curves: Mapping[str, Sequence[float | None]], path: Path,
                           title: str = "Conditional acceptance per position",
                           ylabel: str = "P(draft k accepted | drafts 1..k−1 accepted)",
                           empty: str | None = None) -> Path:
    """One line per drafter over draft positions k = 1..; `empty`: the text shown when no
    drafter has a curve (None: an empty frame)."""
    plt = plt_agg()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for label, ys in curves.items():
        pts = [(k + 1, y) for k, y in enumerate(ys) if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color_for(label))
    if not curves and empty:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    legend_below(ax, ncol=2)
    return save(fig, path)


def reliability(before: Sequence[Sequence[dict]], after: Sequence[Sequence[dict]] | None, path: Path,
                title: str = "Reliability (cumulative confidence vs prefix survival)") -> Path:
    """`before[k]` / `after[k]`: reliability bins of position k+1 (metrics.reliability_bins).
    Only positions some round reached get a panel (the rest would be empty frames), at most 4
    per row; each panel says how many rounds it holds and labels both axes; one legend under
    the panels."""
    plt = plt_agg()
    after = list(after or [None] * len(before))
    shown = [k for k in range(len(before)) if any(b["count"] for b in (before[k] or ()))]
    n = max(1, len(shown))
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.1 * rows), dpi=100, squeeze=False)
    handles = {}
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= len(shown):
            if not shown and i == 0:
                ax.text(0.5, 0.5, "no confidences recorded", ha="center", va="center", transform=ax.transAxes)
            ax.axis("off")
            continue
        k = shown[i]
        handles["perfect calibration"], = ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        # STS first, then raw on top: when STS changes little the two would hide each other
        for bins, label, style in ((after[k] if k < len(after) else None, "after STS",
                                    dict(marker="s", ms=6, mfc="none", ls=":", color="#ff7f0e")),
                                   (before[k], "raw", dict(marker="o", ms=3.5, ls="-", color="#1f77b4"))):
            pts = [(b["confidence"], b["accuracy"]) for b in (bins or ()) if b["count"]]
            if pts:
                handles[label], = ax.plot([p[0] for p in pts], [p[1] for p in pts], **style)
        count = sum(b["count"] for b in before[k])
        accepted = round(sum(b["accuracy"] * b["count"] for b in before[k] if b["count"]))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"k = {k + 1}: {count} rounds, {accepted} accepted 1..k", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("confidence Π c_1..c_k", fontsize=8)
        ax.set_ylabel("observed: drafts 1..k accepted", fontsize=8)
    order = [h for h in ("raw", "after STS", "perfect calibration") if h in handles]
    if len(order) > 1:
        legend_below(fig, [handles[h] for h in order], order)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def threshold_sweep(points: Sequence[dict], path: Path, title: str = "Static confidence threshold") -> Path:
    plt = plt_agg()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    xs = [p["threshold"] for p in points]
    ax.plot(xs, [p["tokens_per_step"] for p in points], marker="o", ms=3, color="#1f77b4",
            label="tokens per step τ (left axis)")
    ax.set_xlabel("threshold on the cumulative confidence Π c_1..c_k")
    ax.set_ylabel("tokens per step τ")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [p["acceptance_rate"] for p in points], color="#ff7f0e", marker="s", ms=3,
             label="acceptance (right axis)")
    ax2.plot(xs, [p["verify_rate"] for p in points], color="#2ca02c", ls="--", label="verify rate (right axis)")
    ax2.set_ylabel("rate")
    ax2.set_ylim(0, 1.02)
    lines = ax.get_lines() + ax2.get_lines()
    legend_below(ax, lines, [ln.get_label() for ln in lines])
    ax.set_title(title)
    return save(fig, path)

"""The text of `draftsmith eval`: report.md, the summary lines, the line per drafter on stderr.

report.md opens with what was measured and the headline numbers, then one table per view,
each followed by the definition of every column it has. A table's header is the keys of its
column dict, so a column cannot go undefined and a row cannot have more or fewer cells than
its header (`_table` refuses it).

A calibration score is printed only where it means something: at a position no round
verified (n = 0) there is nothing to score, and where no round accepted drafts 1..k every
outcome is "rejected", so ECE and Brier only measure how close the confidences are to 0
(an "ECE 0.000" there would read as perfect calibration). Those cells show "–", and the
note under the table says why.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ACCEPTANCE_COLUMNS = {
    "drafter": "the drafter (KIND, or KIND:CHECKPOINT for a trained one)",
    "task": "the held-out prompt set; `all` pools every task",
    "rounds": "verification rounds: one target forward that checks the drafts of one request",
    "τ": "tokens committed per verification round, the target's own (bonus) token included: 1.00 is plain "
         "decoding, K + 1 the most K drafts can give",
    "acceptance": "accepted draft tokens / draft tokens verified",
    "verify rate": "draft tokens verified / draft tokens drafted (below 1 only when --confidence-threshold cut drafts)",
    "prefix survival k=1..": "for k = 1, 2, …: rounds that accepted at least k drafts / rounds that verified at least k",
    "conditional acceptance k=1..": "for k = 1, 2, …: P(draft k accepted | drafts 1..k−1 accepted); – where no "
                                    "round got that far",
}

CALIBRATION_COLUMNS = {
    "drafter": "the drafter",
    "k": "draft position",
    "n": "rounds that verified at least k drafts: the samples scored at this position",
    "accepted": "of those, rounds that accepted drafts 1..k (the outcome the confidence predicts)",
    "ECE raw": "expected calibration error of the cumulative confidence Π c_1..c_k, as the drafter reported it, "
               "against 'drafts 1..k all accepted' (10 equal-width bins; 0 = calibrated)",
    "ECE STS": "the same after per-position temperature scaling (STS)",
    "AUROC": "how well Π c_1..c_k ranks accepted prefixes above rejected ones (0.5 = chance, 1 = perfect)",
    "Brier raw": "mean squared difference between Π c_1..c_k and the outcome (1 accepted, 0 not)",
    "Brier STS": "the same after STS",
    "cond. ECE raw": "ECE of c_k alone against 'draft k accepted', over rounds that accepted drafts 1..k−1",
    "cond. ECE STS": "the same after STS",
}

SWEEP_COLUMNS = {
    "drafter": "the drafter",
    "threshold": "a static threshold on Π c_1..c_k (after STS): each round verifies only the drafts whose "
                 "cumulative confidence stays at or above it (replayed on the recorded rounds)",
    "tokens per step": "τ under that threshold",
    "acceptance": "accepted / verified drafts under that threshold",
    "verify tokens / round": "tokens the target checks per round: 1 + drafts verified",
    "verify rate": "drafts verified / drafts drafted",
}

NOT_SCORED = ("–: not scored. Where n is 0 no round verified k drafts, so there is nothing to score; where "
              "`accepted` is 0 every outcome at that position was a rejection, so ECE and Brier would only say how "
              "close the confidences are to 0; AUROC also needs both outcomes.")


def _f(x: Any, nd: int = 3) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def _series(xs: Sequence[float | None]) -> str:
    return " ".join(_f(x, 2) for x in xs)


def _table(columns: dict[str, str], rows: list[list[str]]) -> list[str]:
    """A markdown table whose header is `columns`' keys, then one bullet per column definition."""
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells under {len(columns)} columns: {row}")
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return out + ["", "Columns:", ""] + [f"- **{k}**: {v}" for k, v in columns.items()]


def accepted_count(stats: dict) -> int:
    """Rounds whose outcome was 'accepted' among a calibration_stats' samples."""
    return round((stats.get("observed") or 0.0) * (stats.get("n") or 0))


def scored(stats: dict) -> bool:
    """Whether a position's calibration scores mean something: samples, and some accepted."""
    return bool(stats.get("n")) and accepted_count(stats) > 0


def _mean_scored_ece(positions: list[dict], view: str = "cumulative") -> float | None:
    vals = [p[view]["ece"] for p in positions if scored(p["cumulative"]) and p[view]["ece"] is not None]
    return sum(vals) / len(vals) if vals else None


def summary_lines(report: dict) -> list[str]:
    """One plain-language line per drafter: how many tokens a verification round commits."""
    out = []
    for d in report["drafters"]:
        o = d["overall"]
        tau, acc = o.get("tau"), o.get("acceptance_rate")
        if tau is None:
            out.append(f"- {d['label']}: no verification round ran (no prompt reached the drafter).")
            continue
        gamma = len(o.get("conditional_acceptance") or ()) or None
        ceiling = f" of at most {gamma + 1}" if gamma else ""
        line = (f"- {d['label']}: each verification round committed {tau:.2f} tokens on average{ceiling} "
                f"(1.00 = no gain over plain decoding); {100 * (acc or 0):.0f}% of drafted tokens were accepted.")
        cal = d.get("calibration")
        if cal:
            before, after = cal["before"]["positions"], cal["after"]["positions"]
            ks = [p["position"] for p in before if scored(p["cumulative"])]
            if ks:
                line += (f" Calibration of its confidences, mean ECE over positions {ks[0]}–{ks[-1]} (lower is "
                         f"better): {_f(_mean_scored_ece(before))} raw, {_f(_mean_scored_ece(after))} after STS.")
        out.append(line)
    return out


def _measured(report: dict) -> str:
    prompts = ", ".join(f"{t}: {n}" for t, n in report["prompts"].items())
    return (f"What was measured: each drafter proposed draft tokens for `{report['target']}` on held-out prompts "
            f"({prompts}; never used for training), and the target verified them, exactly as it does when serving "
            f"(outputs are those of plain decoding). Temperature {report['temperature']:g}, up to "
            f"{report['max_new_tokens']} new tokens per turn, {report['max_turns']} turn(s). The headline number is "
            "**τ, the mean number of tokens committed per verification round** (one target forward).")


def render_markdown(report: dict) -> str:
    lines = [f"# Drafter evaluation: {report['target']}", "", "## Summary", "", _measured(report), "",
             *summary_lines(report), "",
             "τ is what a drafter can buy: wall-clock speed also depends on what drafting and verifying cost on "
             "this machine (`draftsmith bench` measures that side by side with plain decoding).", ""]
    skipped = max((len(d.get("skipped") or ()) for d in report["drafters"]), default=0)  # same prompts each
    if skipped:
        lines += [f"{skipped} prompt turn(s) did not fit the context and were skipped (report.json: `skipped`).", ""]
    rows = [[d["label"], task, str(s["rounds"]), _f(s["tau"], 2), _f(s["acceptance_rate"]), _f(s["verify_rate"], 2),
             _series(s["prefix_survival"]), _series(s["conditional_acceptance"])]
            for d in report["drafters"] for task, s in [*d["tasks"].items(), ("all", d["overall"])]]
    lines += ["## Acceptance", "", *_table(ACCEPTANCE_COLUMNS, rows)]
    cal = [d for d in report["drafters"] if d["calibration"]]
    if cal:
        rows = []
        for d in cal:
            for pb, pa in zip(d["calibration"]["before"]["positions"], d["calibration"]["after"]["positions"]):
                b, a, cb, ca = pb["cumulative"], pa["cumulative"], pb["conditional"], pa["conditional"]
                scores = [b["ece"], a["ece"], b["auroc"], b["brier"], a["brier"], cb["ece"], ca["ece"]]
                rows.append([d["label"], str(pb["position"]), str(b["n"]), str(accepted_count(b)),
                             *(_f(x) if scored(b) else "–" for x in scores)])
        sources = "; ".join(f"{d['label']}, {d['calibration']['source']}" for d in cal)
        lines += ["", "## Calibration (per position: cumulative confidence vs drafts 1..k accepted)", "",
                  "How well a drafter's confidence predicts that its drafts will be accepted (what a confidence "
                  f"threshold or the prefix scheduler relies on). STS temperatures: {sources}.", "",
                  *_table(CALIBRATION_COLUMNS, rows), "", NOT_SCORED]
        rows = [[d["label"], f"{p['threshold']:.2f}", _f(p["tokens_per_step"], 2), _f(p["acceptance_rate"]),
                 _f(p["verify_tokens_per_round"], 2), _f(p["verify_rate"], 2)]
                for d in cal for p in d["threshold_sweep"]["points"]
                if round(p["threshold"] * 20) % 2 == 0]  # every 0.1
        lines += ["", "## Static threshold sweep (on STS confidences)", "", *_table(SWEEP_COLUMNS, rows)]
    if report.get("plots"):
        lines += ["", "## Plots", ""]
        for k, v in report["plots"].items():
            lines += [f"{k}:", "", f"![{k}]({Path(v).name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def print_summary(report: dict, file=None) -> None:
    file = file or sys.stderr  # looked up per call: a default bound at import outlives a swapped stderr
    for d in report["drafters"]:
        o = d["overall"]
        msg = (f"[{d['label']}] τ {_f(o['tau'], 2)} | acceptance {_f(o['acceptance_rate'])} | "
               f"prefix survival {_series(o['prefix_survival'])} | conditional {_series(o['conditional_acceptance'])}")
        if d["calibration"]:
            msg += (f" | mean ECE (cumulative, positions with accepted drafts) "
                    f"{_f(_mean_scored_ece(d['calibration']['before']['positions']))} -> "
                    f"{_f(_mean_scored_ece(d['calibration']['after']['positions']))}")
        print(msg, file=file)

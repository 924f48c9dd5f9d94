"""Go / no-go per tier and drafter, with the reason, from the numbers of that tier only.

    void    greedy outputs differ from the baseline's (speed numbers mean nothing), or a
            request failed
    no-go   acceptance below 0.5, no drafts proposed at all, or slower than the baseline
            (system tokens/s ratio < 1) at this tier
    go      otherwise, with the speedup
    n/a     no baseline measured at this tier (e.g. one endpoint only): acceptance alone
            cannot say go
"""

from __future__ import annotations

MIN_ACCEPTANCE = 0.5


def verdict(row: dict, baseline: dict | None, *, is_baseline: bool = False) -> dict:
    if is_baseline:
        return {"decision": "baseline", "reason": "no speculation (reference)"}
    if row.get("void"):
        return {"decision": "void", "reason": row.get("void_reason") or "measurement void"}
    reasons: list[str] = []
    acc = row.get("acceptance_rate")
    if row.get("draft_proposed") == 0:
        reasons.append("proposed no draft tokens")
    elif acc is not None and acc < MIN_ACCEPTANCE:
        reasons.append(f"acceptance {acc:.2f} < {MIN_ACCEPTANCE}")
    speedup = row.get("speedup")
    if baseline is None or speedup is None:
        if reasons:
            return {"decision": "no-go", "reason": "; ".join(reasons)}
        extra = "" if acc is None else f" (acceptance {acc:.2f})"
        return {"decision": "n/a", "reason": f"no baseline at this tier to compare speed with{extra}"}
    if speedup < 1.0:
        reasons.append(f"slower than the baseline: {speedup:.2f}× its tokens/s")
    if reasons:
        return {"decision": "no-go", "reason": "; ".join(reasons)}
    acc_s = "" if acc is None else f", acceptance {acc:.2f}"
    return {"decision": "go", "reason": f"{speedup:.2f}× the baseline's tokens/s{acc_s}"}

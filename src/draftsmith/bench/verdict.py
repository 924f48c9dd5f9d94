"""Go / no-go per tier and drafter, with the reason, from the numbers of that tier only.

    void    greedy outputs differ from the baseline's (speed numbers mean nothing), or a
            request failed
    no-go   slower than the baseline (system tokens/s ratio < 1) at this tier, or no drafts
            proposed at all, or none accepted (every round was a plain step: a speedup is noise)
    go      otherwise, with the speedup and the acceptance (acceptance is reported, not a gate:
            a block drafter that commits 2.5 tokens per round from 7 drafts accepts ~21% of
            them and still pays; speed decides)
    n/a     no baseline measured at this tier (e.g. one endpoint only): acceptance alone
            cannot say go

Flags, appended to the reason and listed under "flags", say when a number is not to be
trusted as it stands: fewer requests than the concurrency asked for (the tier was never
reached), a machine busier than its cores (load average above the core count), or a speedup
above τ — a verification round costs at least one plain step of the same batch, so a
speculative configuration cannot be more than τ× faster; above that (with 10% slack) the
measurement is noise.
"""

from __future__ import annotations

TAU_SLACK = 1.10


def flags(row: dict) -> list[str]:
    out: list[str] = []
    req, conc = row.get("requests"), row.get("concurrency")
    if req is not None and conc is not None and req < conc:
        out.append(f"only {req} requests for concurrency {conc}: the tier was not reached")
    load, cores = row.get("loadavg"), row.get("cores")
    if load is not None and cores and load > cores:
        out.append(f"noisy: load average {load:.1f} on {cores} cores")
    sp, tau = row.get("speedup"), row.get("tau")
    if sp is not None and tau is not None and tau >= 1 and sp > TAU_SLACK * tau:
        out.append(f"implausible: {sp:.2f}× with τ {tau:.2f} (cannot exceed τ); likely noise")
    return out


def verdict(row: dict, baseline: dict | None, *, is_baseline: bool = False) -> dict:
    v = _decide(row, baseline, is_baseline=is_baseline)
    f = [] if is_baseline else flags(row)
    if f:
        v = {**v, "reason": f"{v['reason']} [{'; '.join(f)}]"}
    return {**v, "flags": f}


def _decide(row: dict, baseline: dict | None, *, is_baseline: bool = False) -> dict:
    if is_baseline:
        return {"decision": "baseline", "reason": "no speculation (reference)"}
    if row.get("void"):
        return {"decision": "void", "reason": row.get("void_reason") or "measurement void"}
    acc = row.get("acceptance_rate")
    acc_s = "" if acc is None else f", acceptance {acc:.2f}"
    if row.get("draft_proposed") == 0:
        return {"decision": "no-go", "reason": "proposed no draft tokens (nothing to gain from speculation)"}
    if row.get("draft_accepted") == 0:
        return {"decision": "no-go", "reason": f"accepted none of its {row.get('draft_proposed')} draft tokens "
                                               "(nothing gained from speculation)"}
    speedup = row.get("speedup")
    if baseline is None or speedup is None:
        return {"decision": "n/a", "reason": f"no baseline at this tier to compare speed with{acc_s}"}
    if speedup < 1.0:
        return {"decision": "no-go", "reason": f"slower than the baseline: {speedup:.2f}× its tokens/s{acc_s}"}
    return {"decision": "go", "reason": f"{speedup:.2f}× the baseline's tokens/s{acc_s}"}

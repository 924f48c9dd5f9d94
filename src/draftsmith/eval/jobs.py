"""The `draftsmith eval` and `draftsmith calibrate` jobs: run, measure, write reports.

eval writes into --out:
    report.json        every number (per drafter: per task and overall acceptance, calibration
                       before / after STS, threshold sweep)
    report.md          a summary, then the same as tables with every column defined (eval/report.py)
    rounds-<label>.jsonl   every recorded round (re-analysable without re-running)
    conditional_acceptance.png, reliability-<label>.png, threshold-<label>.png

"After STS" uses the checkpoint's calibration.json when it has one (fitted on other held-out
data by `draftsmith calibrate`); otherwise temperatures are cross-fitted on the eval rounds
(two folds by request, each calibrated with the other's fit), and the report says which.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.data.outdir import check_no_other_job, check_out_dir
from draftsmith.drafters import registry
from draftsmith.drafters.builtin import is_builtin
from draftsmith.drafters.calibration import regime_name
from draftsmith.errors import DraftsmithError
from draftsmith.eval import metrics as M, plots, sts
from draftsmith.eval.report import print_summary, render_markdown, summary_lines
from draftsmith.eval.runner import (
    DEFAULT_TASKS,
    LoadedDrafter,
    default_block_size,
    group_by_task,
    heldout_conversations,
    heldout_from_regen,
    load_drafter,
    run_rounds,
)
from draftsmith.models.target import load_target

__all__ = ["CalibrateOptions", "EvalOptions", "print_summary", "render_markdown", "run_calibrate", "run_eval",
           "summary_lines"]  # the text helpers live in eval/report.py; callers import them from here


@dataclass(frozen=True)
class EvalOptions:
    target: str
    drafters: tuple[str, ...]
    tasks: tuple[str, ...] = DEFAULT_TASKS
    temperature: float = 1.0
    block_size: int | None = None
    confidence_threshold: float | None = None
    max_prompts: int | None = 8
    max_new_tokens: int = 128
    max_batch: int = 4
    max_len: int = 2048
    max_turns: int = 2
    seed: int = 0
    n_bins: int = M.DEFAULT_BINS
    out: Path | None = Path("runs/eval")
    overwrite: bool = False  # replace the report files an earlier eval left in `out`
    device: str | None = None
    drafter_dtype: str = "auto"  # what model drafters compute in (drafters/precision.py)
    progress: bool | None = None
    thresholds: tuple[float, ...] = field(default_factory=lambda: tuple(M.default_thresholds(0.05)))


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "drafter"


# What eval writes into --out (rounds-, reliability- and threshold- files: one per drafter).
_OUTPUTS = ("report.json", "report.md", "conditional_acceptance.png", "rounds-*.jsonl", "reliability-*.png",
            "threshold-*.png")


def _held(out: Path) -> list[Path]:
    return sorted(p for pattern in _OUTPUTS for p in out.glob(pattern)) if out.is_dir() else []


def _check_out(out: Path, overwrite: bool) -> None:
    """--out must not hold report files (an earlier eval's, or a bench's report.json) unless
    --overwrite: they would be replaced without a word. Another job's directory (a bench's, a
    training run's, a feature cache) is refused whatever --overwrite says."""
    check_out_dir(out)
    check_no_other_job(out, "eval", _OUTPUTS)
    held = [p.name for p in _held(out)]
    if held and not overwrite:
        raise DraftsmithError(f"--out {out} already holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}; "
                              "give a new --out, or pass --overwrite to replace them")


def _unique_label(label: str, taken: list[str]) -> str:
    """`label`, or `label (n)` when another drafter of this eval has it (two checkpoints of one
    name, say runs/a/final and runs/b/final): each drafter keeps its own rounds file and plots."""
    n, unique = 1, label
    while unique in taken or _safe(unique) in {_safe(t) for t in taken}:
        n += 1
        unique = f"{label} ({n})"
    return unique


def evaluate_drafter(target, loaded: LoadedDrafter, convs, opt: EvalOptions) -> tuple[dict, list[M.RoundRecord]]:
    gamma = opt.block_size or default_block_size(loaded)
    run = run_rounds(target, loaded, convs, gamma, temperature=opt.temperature, max_new_tokens=opt.max_new_tokens,
                     max_batch=opt.max_batch, max_len=opt.max_len, threshold=opt.confidence_threshold,
                     seed=opt.seed, max_turns=opt.max_turns, progress=opt.progress)
    recs = run.records
    res: dict[str, Any] = {
        "label": loaded.label, "spec": loaded.spec, "kind": loaded.kind,
        "checkpoint": str(loaded.checkpoint) if loaded.checkpoint else None, "dtype": loaded.dtype, "block_size": gamma,
        "confidence_threshold": opt.confidence_threshold, "requests": run.requests,
        "output_tokens": run.output_tokens, "wall_s": round(run.wall_s, 3), "skipped": run.skipped,
        "overall": M.acceptance_summary(recs, gamma),
        "tasks": {t: M.acceptance_summary(rs, gamma) for t, rs in group_by_task(recs).items()},
        "calibration": None, "threshold_sweep": None,
    }
    if any(r.confidences is not None for r in recs):
        applied = loaded.applied_at(opt.temperature)
        if applied:
            after, source, temps = sts.calibrated(recs, applied), "calibration.json", list(applied)
        else:
            after, folds = sts.cross_fitted(recs, gamma, opt.n_bins)
            source, temps = "cross-fitted on the eval rounds (2 folds by request)", folds
            if loaded.sts is not None:  # a fit of the other regime: the drafter served these rounds raw
                source += (f"; calibration.json holds a fit for {loaded.sts.regime} rounds, not these "
                           f"(draftsmith calibrate --temperature {opt.temperature:g} fits them)")
        res["calibration"] = {"source": source, "temperatures": temps,
                              "before": M.calibration_report(recs, gamma, n_bins=opt.n_bins),
                              "after": M.calibration_report(after, gamma, n_bins=opt.n_bins)}
        res["threshold_sweep"] = {"confidences": "after STS",
                                  "points": [asdict(p) for p in M.threshold_sweep(after, opt.thresholds)]}
    return res, recs


def run_eval(opt: EvalOptions) -> dict:
    if opt.confidence_threshold is not None and not 0.0 <= opt.confidence_threshold <= 1.0:
        raise DraftsmithError(f"--confidence-threshold must be in [0, 1], got {opt.confidence_threshold}")
    if opt.block_size is not None and opt.block_size < 1:
        raise DraftsmithError(f"--block-size must be >= 1, got {opt.block_size}")
    if opt.out is not None:
        _check_out(Path(opt.out), opt.overwrite)  # before the target loads
    convs = heldout_conversations(opt.tasks, opt.max_prompts)  # before the target loads: a bad task fails fast
    target = load_target(opt.target, device=opt.device)
    report: dict[str, Any] = {
        "target": target.target_id, "target_weights_hash": target.weights_hash, "split": "heldout",
        "tasks": list(opt.tasks), "prompts": {t: sum(c.task == t for c in convs) for t in opt.tasks},
        "temperature": opt.temperature, "max_new_tokens": opt.max_new_tokens, "max_turns": opt.max_turns,
        "seed": opt.seed, "drafters": [], "plots": {},
        "definitions": {"tau": "committed tokens per verification round, bonus included",
                        "prefix_survival": "rounds with >= k accepted / rounds that verified >= k",
                        "conditional_acceptance": "P(draft k accepted | drafts 1..k-1 accepted, k verified)",
                        "verify_rate": "drafts verified / drafts produced (< 1 only under a threshold)",
                        "calibration": "per position: conditional (c_k vs draft k accepted | 1..k-1 accepted) "
                                       "and cumulative (prod c_i vs drafts 1..k all accepted)"},
    }
    out = Path(opt.out) if opt.out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    all_recs: dict[str, list[M.RoundRecord]] = {}
    for spec in opt.drafters:
        loaded = load_drafter(spec, target, opt.max_batch, min(opt.max_len, target.model.config.max_position_embeddings),
                              opt.drafter_dtype)
        res, recs = evaluate_drafter(target, loaded, convs, opt)
        res["label"] = _unique_label(res["label"], list(all_recs))
        report["drafters"].append(res)
        all_recs[res["label"]] = recs
        del loaded
    if out is not None:
        for f in _held(out):  # --overwrite: no earlier drafter's rounds or plots stay beside these
            f.unlink()
        for res in report["drafters"]:
            name = _safe(res["label"])
            with open(out / f"rounds-{name}.jsonl", "w") as f:
                for r in all_recs[res["label"]]:
                    f.write(json.dumps(r.to_dict()) + "\n")
            if res["calibration"]:
                before = [p["cumulative"]["bins"] for p in res["calibration"]["before"]["positions"]]
                after = [p["cumulative"]["bins"] for p in res["calibration"]["after"]["positions"]]
                report["plots"][f"reliability:{res['label']}"] = str(plots.reliability(
                    before, after, out / f"reliability-{name}.png", title=f"{res['label']}: reliability (cumulative)"))
                report["plots"][f"threshold:{res['label']}"] = str(plots.threshold_sweep(
                    res["threshold_sweep"]["points"], out / f"threshold-{name}.png",
                    title=f"{res['label']}: static threshold"))
        curves = {r["label"]: r["overall"]["conditional_acceptance"] for r in report["drafters"]}
        report["plots"]["conditional_acceptance"] = str(plots.conditional_acceptance(
            curves, out / "conditional_acceptance.png",
            title=f"Conditional acceptance, {target.target_id}, T={opt.temperature:g}"))
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "report.md").write_text(render_markdown(report))
    return report


# ---- calibrate --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrateOptions:
    target: str
    drafter: str
    data: Path | None = None
    tasks: tuple[str, ...] = ()
    temperature: float = 1.0
    block_size: int | None = None
    max_prompts: int | None = 16
    max_new_tokens: int = 128
    max_batch: int = 4
    max_len: int = 2048
    max_turns: int = 2
    seed: int = 1
    n_bins: int = M.DEFAULT_BINS
    device: str | None = None
    drafter_dtype: str = "auto"  # what model drafters compute in (drafters/precision.py)
    progress: bool | None = None


def _refuse_builtin(spec: str, kind: str, ckpt: Path) -> None:
    if is_builtin(ckpt):
        raise DraftsmithError(f"{spec} is a built-in drafter (package data, calibrated when it was made); "
                              f"to calibrate it again, copy {ckpt} to a directory of your own and pass {kind}:THAT_DIR")


def run_calibrate(opt: CalibrateOptions) -> dict:
    """Fit STS on held-out rounds of a checkpoint's drafter and store calibration.json in it."""
    if (opt.data is None) == (not opt.tasks):
        raise DraftsmithError("give exactly one of --data HELDOUT.jsonl or --tasks T1,T2")
    kind, arg = registry.parse_spec(opt.drafter)
    if kind.trainable:  # before anything loads (a wrapped checkpoint is checked once loaded)
        _refuse_builtin(opt.drafter, kind.name, Path(arg))
    convs = heldout_from_regen(opt.data, opt.max_prompts) if opt.data is not None else \
        heldout_conversations(opt.tasks, opt.max_prompts)  # before the target loads: bad data fails fast
    target = load_target(opt.target, device=opt.device)
    loaded = load_drafter(opt.drafter, target, opt.max_batch, min(opt.max_len, target.model.config.max_position_embeddings),
                          opt.drafter_dtype)
    if loaded.checkpoint is None:
        raise DraftsmithError(f"calibrate needs a trained drafter checkpoint (KIND:PATH), got {opt.drafter!r}")
    _refuse_builtin(opt.drafter, loaded.kind, loaded.checkpoint)
    gamma = opt.block_size or default_block_size(loaded)
    run = run_rounds(target, loaded, convs, gamma, temperature=opt.temperature, max_new_tokens=opt.max_new_tokens,
                     max_batch=opt.max_batch, max_len=opt.max_len, seed=opt.seed, max_turns=opt.max_turns,
                     progress=opt.progress)
    if not run.records:  # no round reached the drafter: not a missing confidence head
        why = (f"{len(run.skipped)} held-out turns were skipped ({run.skipped[0]['reason']}); lower --max-tokens"
               if run.skipped else f"--max-tokens {opt.max_new_tokens} ended every answer before a draft; raise it")
        raise DraftsmithError(f"calibrate: no verification round ran: {why}")
    recs = [r for r in run.records if r.confidences is not None]
    if not recs:
        raise DraftsmithError(f"drafter {loaded.kind!r} reports no confidences (no confidence head); "
                              "STS applies to drafters with one (dspark)")
    temps = sts.fit_sts(recs, gamma, opt.n_bins)
    before = sts.cumulative_ece(recs, gamma, opt.n_bins)
    after = sts.cumulative_ece(sts.calibrated(recs, temps), gamma, opt.n_bins)
    previous = loaded.sts.regime if loaded.sts else None  # the fit this one replaces
    fitted_on = {"source": str(opt.data) if opt.data is not None else ",".join(opt.tasks), "split": "heldout",
                 "rounds": len(recs), "requests": run.requests, "temperature": opt.temperature, "block_size": gamma,
                 "previous_temperatures": list(loaded.temperatures) if loaded.temperatures else None,
                 "previous_regime": previous}
    path = sts.write_calibration(loaded.checkpoint, temps, before, after, fitted_on, opt.n_bins)
    return {"calibration": str(path), "temperatures": temps, "regime": regime_name(opt.temperature == 0),
            "replaced_regime": previous,
            "ece_before": before, "ece_after": after,
            "rounds": len(recs), "requests": run.requests}

"""Sequential Temperature Scaling (STS) of a drafter's per-position confidences (DSpark).

A confidence head gives c_k, the chance that draft k survives given drafts 1..k−1 did; the
prefix scheduler consumes the cumulative a_k = Π_{i≤k} c_i, the chance that drafts 1..k all
survive. STS fits one temperature per position, c'_k = σ(logit(c_k) / T_k), in order
k = 1..γ: T_k minimises the ECE of a'_k = Π_{i<k} c'_i · c'_k (earlier T_i fixed) against
the observed prefix survival (accepted ≥ k) over held-out rounds that verified ≥ k drafts.
Positions where too few rounds survived (or failed) keep T = 1 (`fit_sts(min_each=5)`).

A positive temperature is a monotone map per position, so STS never changes which of two
confidences at the same position is larger (order-preserving; AUROC per position is
unchanged). A fitted temperature > 1 softens an over-confident head, < 1 sharpens an
under-confident one (the built-in smollm2-135m drafter's fit at T = 1: 0.21-0.44 at positions 1-4).

calibration.json (next to the checkpoint's config.json; drafters/checkpoint.py reads
"temperatures" and "regime", and the drafter applies them at inference to the rows of that
regime only: "greedy" when fitted at T = 0, where a confidence is the chance the draft is the
target's argmax, else "sampled", the chance it is accepted; drafters/calibration.py):

    {"method": "sts", "format_version": 1, "temperatures": [T_1, ..., T_γ], "regime": "sampled", "n_bins": 10,
     "ece_before": [...], "ece_after": [...],      cumulative ECE per position, on the fit data
     "fitted_on": {"source", "rounds", "requests", "temperature", "split": "heldout"},
     "checkpoint": {"step": ..., "model_sha256": ...}}
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters.calibration import regime_name, sts_regime
from draftsmith.errors import DraftsmithError
from draftsmith.eval.metrics import DEFAULT_BINS, RoundRecord, cumulative_pairs, ece
from draftsmith.fileio import write_json_atomic

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT_VERSION = 1
_EPS = 1e-6


def default_grid() -> list[float]:
    """Temperatures from 0.05 to 20 on a geometric grid (T = 1 included)."""
    n = 240
    lo, hi = math.log(0.05), math.log(20.0)
    grid = [math.exp(lo + (hi - lo) * i / n) for i in range(n + 1)]
    return sorted(set(grid) | {1.0})


def _logit(c: torch.Tensor) -> torch.Tensor:
    c = c.clamp(_EPS, 1 - _EPS)
    return torch.log(c) - torch.log1p(-c)


def scale(conf: Sequence[float], temperatures: Sequence[float]) -> list[float]:
    """c'_k = σ(logit(c_k) / T_k); positions past the temperatures keep T = 1."""
    t = list(temperatures) + [1.0] * max(0, len(conf) - len(temperatures))
    return [1.0 / (1.0 + math.exp(-_logit_f(c) / t[k])) for k, c in enumerate(conf)]


def unscale(conf: Sequence[float], temperatures: Sequence[float]) -> list[float]:
    """Inverse of `scale`: the raw c_k behind calibrated confidences (c = σ(T_k · logit(c')))."""
    t = list(temperatures) + [1.0] * max(0, len(conf) - len(temperatures))
    return [1.0 / (1.0 + math.exp(-_logit_f(c) * t[k])) for k, c in enumerate(conf)]


def _logit_f(c: float) -> float:
    c = min(max(float(c), _EPS), 1 - _EPS)
    return math.log(c) - math.log1p(-c)


def _ece_batch(a: torch.Tensor, y: torch.Tensor, n_bins: int) -> torch.Tensor:
    """ECE of many candidate confidence vectors at once: a [G, n], y [n] → [G]."""
    G, n = a.shape
    bins = (a * n_bins).long().clamp(0, n_bins - 1)  # [G, n]
    count = torch.zeros(G, n_bins, dtype=torch.float64).scatter_add_(1, bins, torch.ones_like(a, dtype=torch.float64))
    conf = torch.zeros(G, n_bins, dtype=torch.float64).scatter_add_(1, bins, a.double())
    acc = torch.zeros(G, n_bins, dtype=torch.float64).scatter_add_(1, bins, y.double().expand(G, n))
    return (conf - acc).abs().sum(1) / n


def fit_sts(rounds: Sequence[RoundRecord], gamma: int, n_bins: int = DEFAULT_BINS,
            grid: Sequence[float] | None = None, min_each: int = 5) -> list[float]:
    """Temperatures T_1..T_γ fitted in order on rounds with raw confidences.

    A position keeps T = 1 unless at least `min_each` rounds survived to it and `min_each`
    did not: with one outcome only, ECE is minimised by pushing every confidence to 0 (or 1),
    an artefact of too little data rather than calibration. Among temperatures with the same
    (minimal) ECE the one closest to 1 (in log scale) wins.
    """
    grid_t = torch.tensor(list(grid or default_grid()), dtype=torch.float64)  # [G]
    closeness = grid_t.log().abs()
    temps: list[float] = []
    for k in range(1, gamma + 1):
        usable = [r for r in rounds if r.confidences is not None and r.proposed >= k and len(r.confidences) >= k]
        survived = sum(r.accepted >= k for r in usable)
        if min(survived, len(usable) - survived) < max(1, min_each):
            temps.append(1.0)
            continue
        conf = torch.tensor([list(r.confidences[:k]) for r in usable], dtype=torch.float64)  # [n, k]
        y = torch.tensor([int(r.accepted >= k) for r in usable], dtype=torch.float64)
        prefix = torch.ones(len(usable), dtype=torch.float64)
        for i, t in enumerate(temps):
            prefix = prefix * torch.sigmoid(_logit(conf[:, i]) / t)
        cand = prefix[None, :] * torch.sigmoid(_logit(conf[:, k - 1])[None, :] / grid_t[:, None])  # [G, n]
        e = _ece_batch(cand, y, n_bins)
        best = e.min()
        ties = (e <= best + 1e-12).nonzero().squeeze(-1)
        pick = ties[closeness[ties].argmin()]
        temps.append(float(grid_t[pick]))
    return temps


def calibrated(rounds: Sequence[RoundRecord], temperatures: Sequence[float]) -> list[RoundRecord]:
    """Rounds with their confidences passed through STS."""
    return [replace(r, confidences=tuple(scale(r.confidences, temperatures))) if r.confidences is not None else r
            for r in rounds]


def cumulative_ece(rounds: Sequence[RoundRecord], gamma: int, n_bins: int = DEFAULT_BINS) -> list[float | None]:
    return [ece(*cumulative_pairs(rounds, k), n_bins=n_bins) for k in range(1, gamma + 1)]


def cross_fitted(rounds: Sequence[RoundRecord], gamma: int, n_bins: int = DEFAULT_BINS,
                 folds: int = 2) -> tuple[list[RoundRecord], list[list[float]]]:
    """Out-of-fold STS: rounds of each request are calibrated with temperatures fitted on the
    other folds' requests (an honest 'after' when no separate calibration set exists)."""
    requests = sorted({(r.task, r.request) for r in rounds})
    fold_of = {req: int(hashlib.sha256(f"{req[0]}/{req[1]}".encode()).hexdigest(), 16) % folds for req in requests}
    out: list[RoundRecord] = []
    temps_per_fold = []
    for f in range(folds):
        train = [r for r in rounds if fold_of[(r.task, r.request)] != f]
        test = [r for r in rounds if fold_of[(r.task, r.request)] == f]
        temps = fit_sts(train, gamma, n_bins) if train else [1.0] * gamma
        temps_per_fold.append(temps)
        out.extend(calibrated(test, temps))
    return out, temps_per_fold


# ---- calibration.json -------------------------------------------------------------------------


def _model_sha256(ckpt: Path) -> str | None:
    f = Path(ckpt) / "model.safetensors"
    if not f.is_file():
        return None
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _train_step(ckpt: Path) -> dict[str, Any]:
    """{"step": N} from a training run's train_info.json; {} without one, or when it cannot be read
    (a damaged file is no reason to lose the fit: the temperatures do not depend on it)."""
    try:
        info = json.loads((ckpt / "train_info.json").read_text())
    except (OSError, ValueError, RecursionError):  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        return {}
    return {"step": info.get("step")} if isinstance(info, dict) else {}


def write_calibration(ckpt: Path, temperatures: Sequence[float], ece_before: Sequence[float | None],
                      ece_after: Sequence[float | None], fitted_on: Mapping[str, Any], n_bins: int) -> Path:
    """Store STS in the checkpoint directory (atomic replace)."""
    ckpt = Path(ckpt)
    if not (ckpt / "config.json").is_file():
        raise DraftsmithError(f"{ckpt} is not a drafter checkpoint (no config.json); cannot store calibration")
    data = {"method": "sts", "format_version": CALIBRATION_FORMAT_VERSION,
            "temperatures": [float(t) for t in temperatures], "n_bins": int(n_bins),
            "ece_before": list(ece_before), "ece_after": list(ece_after), "fitted_on": dict(fitted_on),
            "checkpoint": {**_train_step(ckpt), "model_sha256": _model_sha256(ckpt)}}
    regime = regime_name(sts_regime(data))  # the rows it applies to (from the temperature it was fitted at)
    if regime is not None:
        data["regime"] = regime
    path = ckpt / CALIBRATION_FILE
    write_json_atomic(path, data)
    return path


def read_calibration(ckpt: Path) -> dict[str, Any] | None:
    f = Path(ckpt) / CALIBRATION_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
        temps = [float(t) for t in data["temperatures"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise DraftsmithError(f"{f} is not a calibration file; re-run draftsmith calibrate") from None
    if any(not (t > 0 and math.isfinite(t)) for t in temps):
        raise DraftsmithError(f"{f}: temperatures must be positive, got {temps}")
    data["temperatures"] = temps
    return data

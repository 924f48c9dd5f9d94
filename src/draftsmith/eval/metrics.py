"""Acceptance and calibration metrics over verification rounds (docs/ALGORITHMS.md definitions).

The unit is one verification round of one request (`RoundRecord`): how many draft tokens
were verified, how many were accepted, how many tokens were committed (bonus / correction
included, cut by stop rules), and the drafter's per-position confidences when it has a
confidence head. Positions k are 1-based in names and reports, 0-based in lists.

    τ                     committed tokens / rounds (bonus included)
    acceptance rate α     accepted drafts / verified drafts
    prefix survival@k     rounds with ≥ k accepted / rounds that verified ≥ k
    conditional acc.@k    among rounds with 1..k−1 accepted and a k-th verified: k-th accepted
    verify rate           verified drafts / drafted tokens (< 1 only when a threshold cut drafts)

Calibration (per position k, two views):
    conditional  c_k        vs "draft k accepted", over rounds where 1..k−1 were accepted
                            (what the DSpark confidence head predicts);
    cumulative   Π_{i≤k} c_i vs "drafts 1..k all accepted", over rounds that verified ≥ k
                            (what STS calibrates and the prefix scheduler consumes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

DEFAULT_BINS = 10


@dataclass(frozen=True)
class RoundRecord:
    """One verification round of one request.

    drafted:     draft tokens the drafter produced (before any confidence threshold)
    proposed:    draft tokens sent to verification (≤ drafted)
    accepted:    draft tokens accepted (≤ proposed)
    committed:   tokens committed this round: accepted + 1, fewer when a stop rule cut it
    confidences: per drafted position c_1..c_drafted (raw head output), or None
    """

    task: str
    request: str
    drafted: int
    proposed: int
    accepted: int
    committed: int
    confidences: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.proposed <= self.drafted:
            raise ValueError(f"need 0 <= accepted <= proposed <= drafted, got {self.accepted}, "
                             f"{self.proposed}, {self.drafted}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["confidences"] = list(self.confidences) if self.confidences is not None else None
        return d

    @staticmethod
    def from_dict(d: dict) -> "RoundRecord":
        c = d.get("confidences")
        return RoundRecord(task=d["task"], request=d["request"], drafted=int(d["drafted"]),
                           proposed=int(d["proposed"]), accepted=int(d["accepted"]), committed=int(d["committed"]),
                           confidences=tuple(float(x) for x in c) if c is not None else None)


# ---- acceptance ------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def tau(rounds: Sequence[RoundRecord]) -> float | None:
    return _ratio(sum(r.committed for r in rounds), len(rounds))


def acceptance_rate(rounds: Sequence[RoundRecord]) -> float | None:
    return _ratio(sum(r.accepted for r in rounds), sum(r.proposed for r in rounds))


def verify_rate(rounds: Sequence[RoundRecord]) -> float | None:
    return _ratio(sum(r.proposed for r in rounds), sum(r.drafted for r in rounds))


def max_position(rounds: Iterable[RoundRecord]) -> int:
    return max((r.proposed for r in rounds), default=0)


def prefix_survival(rounds: Sequence[RoundRecord], gamma: int | None = None) -> list[float | None]:
    g = max_position(rounds) if gamma is None else gamma
    return [_ratio(sum(r.accepted >= k for r in rounds), sum(r.proposed >= k for r in rounds))
            for k in range(1, g + 1)]


def conditional_acceptance(rounds: Sequence[RoundRecord], gamma: int | None = None) -> list[float | None]:
    g = max_position(rounds) if gamma is None else gamma
    out = []
    for k in range(1, g + 1):
        reached = [r for r in rounds if r.accepted >= k - 1 and r.proposed >= k]
        out.append(_ratio(sum(r.accepted >= k for r in reached), len(reached)))
    return out


def acceptance_summary(rounds: Sequence[RoundRecord], gamma: int | None = None) -> dict:
    return {
        "rounds": len(rounds),
        "requests": len({(r.task, r.request) for r in rounds}),
        "committed": sum(r.committed for r in rounds),
        "drafted": sum(r.drafted for r in rounds),
        "proposed": sum(r.proposed for r in rounds),
        "accepted": sum(r.accepted for r in rounds),
        "tau": tau(rounds),
        "acceptance_rate": acceptance_rate(rounds),
        "verify_rate": verify_rate(rounds),
        "verify_tokens_per_round": _ratio(sum(1 + r.proposed for r in rounds), len(rounds)),
        "prefix_survival": prefix_survival(rounds, gamma),
        "conditional_acceptance": conditional_acceptance(rounds, gamma),
    }


# ---- calibration of one (confidence, outcome) set -----------------------------------------


def ece(conf: Sequence[float], labels: Sequence[int], n_bins: int = DEFAULT_BINS) -> float | None:
    """Expected calibration error: Σ_bins (n_b / n) |mean confidence − mean outcome| (equal-width bins)."""
    bins = reliability_bins(conf, labels, n_bins)
    n = len(conf)
    if not n:
        return None
    return sum(b["count"] / n * abs(b["confidence"] - b["accuracy"]) for b in bins if b["count"])


def reliability_bins(conf: Sequence[float], labels: Sequence[int], n_bins: int = DEFAULT_BINS) -> list[dict]:
    """Equal-width bins over [0, 1]: count, mean confidence, observed frequency (None when empty)."""
    if len(conf) != len(labels):
        raise ValueError("confidences and labels differ in length")
    sums = [[0, 0.0, 0.0] for _ in range(n_bins)]
    for c, y in zip(conf, labels):
        b = min(int(c * n_bins), n_bins - 1) if c >= 0 else 0
        sums[b][0] += 1
        sums[b][1] += c
        sums[b][2] += y
    return [{"lo": i / n_bins, "hi": (i + 1) / n_bins, "count": n,
             "confidence": s / n if n else None, "accuracy": a / n if n else None}
            for i, (n, s, a) in enumerate(sums)]


def brier(conf: Sequence[float], labels: Sequence[int]) -> float | None:
    return _ratio(sum((c - y) ** 2 for c, y in zip(conf, labels)), len(conf))


def auroc(conf: Sequence[float], labels: Sequence[int]) -> float | None:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney U)."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    ranks = [0.0] * len(conf)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and conf[order[j + 1]] == conf[order[i]]:
            j += 1
        avg = (i + j) / 2 + 1  # 1-based average rank of the tie group
        for t in range(i, j + 1):
            ranks[order[t]] = avg
        i = j + 1
    rank_sum = sum(r for r, y in zip(ranks, labels) if y)
    return (rank_sum - pos * (pos + 1) / 2) / (pos * neg)


def calibration_stats(conf: Sequence[float], labels: Sequence[int], n_bins: int = DEFAULT_BINS) -> dict:
    return {"n": len(conf), "mean_confidence": _ratio(sum(conf), len(conf)),
            "observed": _ratio(sum(labels), len(labels)), "ece": ece(conf, labels, n_bins),
            "auroc": auroc(conf, labels), "brier": brier(conf, labels),
            "bins": reliability_bins(conf, labels, n_bins)}


# ---- per-position views -----------------------------------------------------------------------


def cumulative(conf: Sequence[float]) -> list[float]:
    """a_k = Π_{i≤k} c_i."""
    out, a = [], 1.0
    for c in conf:
        a *= c
        out.append(a)
    return out


def conditional_pairs(rounds: Sequence[RoundRecord], k: int, conf_of=None) -> tuple[list[float], list[int]]:
    """(c_k, draft k accepted) over rounds that verified ≥ k drafts and accepted the first k−1."""
    conf_of = conf_of or (lambda r: r.confidences)
    xs, ys = [], []
    for r in rounds:
        c = conf_of(r)
        if c is None or r.proposed < k or r.accepted < k - 1 or len(c) < k:
            continue
        xs.append(float(c[k - 1]))
        ys.append(int(r.accepted >= k))
    return xs, ys


def cumulative_pairs(rounds: Sequence[RoundRecord], k: int, conf_of=None) -> tuple[list[float], list[int]]:
    """(Π_{i≤k} c_i, drafts 1..k all accepted) over rounds that verified ≥ k drafts."""
    conf_of = conf_of or (lambda r: r.confidences)
    xs, ys = [], []
    for r in rounds:
        c = conf_of(r)
        if c is None or r.proposed < k or len(c) < k:
            continue
        xs.append(cumulative(c[:k])[-1])
        ys.append(int(r.accepted >= k))
    return xs, ys


def calibration_report(rounds: Sequence[RoundRecord], gamma: int | None = None, conf_of=None,
                       n_bins: int = DEFAULT_BINS) -> dict | None:
    """Per position k = 1..γ: conditional and cumulative calibration stats; None without confidences."""
    conf_of = conf_of or (lambda r: r.confidences)
    if not any(conf_of(r) is not None for r in rounds):
        return None
    g = max_position(rounds) if gamma is None else gamma
    per = []
    for k in range(1, g + 1):
        per.append({"position": k,
                    "conditional": calibration_stats(*conditional_pairs(rounds, k, conf_of), n_bins),
                    "cumulative": calibration_stats(*cumulative_pairs(rounds, k, conf_of), n_bins)})
    pooled_c = [conditional_pairs(rounds, k, conf_of) for k in range(1, g + 1)]
    xs = [x for p in pooled_c for x in p[0]]
    ys = [y for p in pooled_c for y in p[1]]
    return {"positions": per, "pooled_conditional": {k: v for k, v in calibration_stats(xs, ys, n_bins).items()
                                                     if k != "bins"},
            "mean_ece_cumulative": _mean([p["cumulative"]["ece"] for p in per]),
            "mean_ece_conditional": _mean([p["conditional"]["ece"] for p in per])}


def _mean(xs: Sequence[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


# ---- static threshold sweep -------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPoint:
    threshold: float
    tokens_per_step: float | None  # τ: committed tokens per verification round
    acceptance_rate: float | None
    verify_tokens_per_round: float | None  # 1 + drafts verified
    verify_rate: float | None  # drafts verified / drafts proposed without the threshold
    rounds: int = 0


def truncate_round(r: RoundRecord, conf: Sequence[float], threshold: float) -> tuple[int, int, int]:
    """(verified, accepted, committed) had the round verified only the prefix with Π c ≥ threshold.

    The rule is a stopping time (draft k's admission depends on c_k, which is computed before
    x_k is sampled), so it is lossless; the first ℓ acceptance tests are the same events, so
    with ℓ ≤ accepted the round would have accepted all ℓ and sampled a bonus token.
    """
    ell = 0
    for a in cumulative(conf[: r.proposed]):
        if a < threshold:
            break
        ell += 1
    if r.accepted < ell:
        return ell, r.accepted, r.committed
    committed = ell + 1 if r.committed >= r.accepted + 1 else min(r.committed, ell + 1)
    return ell, ell, committed


def threshold_sweep(rounds: Sequence[RoundRecord], thresholds: Sequence[float], conf_of=None) -> list[SweepPoint]:
    """Tokens per step and acceptance vs a static threshold on the cumulative confidence."""
    conf_of = conf_of or (lambda r: r.confidences)
    usable = [r for r in rounds if conf_of(r) is not None]
    out = []
    for th in thresholds:
        ver = acc = com = 0
        for r in usable:
            v, a, c = truncate_round(r, conf_of(r), th)
            ver, acc, com = ver + v, acc + a, com + c
        n = len(usable)
        out.append(SweepPoint(threshold=float(th), tokens_per_step=_ratio(com, n), acceptance_rate=_ratio(acc, ver),
                              verify_tokens_per_round=_ratio(n + ver, n),
                              verify_rate=_ratio(ver, sum(r.proposed for r in usable)), rounds=n))
    return out


def default_thresholds(step: float = 0.05) -> list[float]:
    n = int(round(1 / step))
    return [round(i * step, 6) for i in range(n)]

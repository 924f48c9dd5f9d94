"""Eval metrics against hand-computed values; STS on synthetic over-confident heads; the recording policy."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.eval import metrics as M
from draftsmith.eval import sts
from draftsmith.eval.metrics import RoundRecord
from draftsmith.eval.runner import RecordingPolicy


def rec(drafted, proposed, accepted, committed, conf=None, request="r"):
    return RoundRecord("t", request, drafted, proposed, accepted, committed, tuple(conf) if conf else None)


# Four rounds worked out by hand in the comments below.
ROUNDS = [
    rec(4, 4, 4, 5, (0.9, 0.8, 0.7, 0.6)),  # all accepted + bonus
    rec(4, 4, 1, 2, (0.9, 0.5, 0.5, 0.5)),  # first accepted, second rejected
    rec(4, 4, 0, 1, (0.4, 0.9, 0.9, 0.9)),  # first rejected
    rec(2, 2, 2, 2, (0.8, 0.8)),  # both accepted, a stop rule cut the bonus
]


def test_acceptance_metrics_by_hand():
    assert M.tau(ROUNDS) == pytest.approx((5 + 2 + 1 + 2) / 4)  # 2.5, bonus included
    assert M.acceptance_rate(ROUNDS) == pytest.approx(7 / 14)
    assert M.verify_rate(ROUNDS) == 1.0
    # prefix survival k: rounds with >= k accepted / rounds that verified >= k
    assert M.prefix_survival(ROUNDS) == pytest.approx([3 / 4, 2 / 4, 1 / 3, 1 / 3])
    # conditional k: among rounds with 1..k-1 accepted and k verified, k accepted
    assert M.conditional_acceptance(ROUNDS) == pytest.approx([3 / 4, 2 / 3, 1.0, 1.0])
    s = M.acceptance_summary(ROUNDS, gamma=5)
    assert s["rounds"] == 4 and s["committed"] == 10 and s["verify_tokens_per_round"] == pytest.approx(18 / 4)
    assert s["prefix_survival"][4] is None and s["conditional_acceptance"][4] is None  # nobody verified 5
    assert M.tau([]) is None and M.acceptance_rate([rec(0, 0, 0, 1)]) is None
    with pytest.raises(ValueError):
        rec(2, 3, 1, 2)  # proposed > drafted


def test_calibration_scores_by_hand():
    conf, y = [0.1, 0.4, 0.8, 0.9], [0, 1, 1, 1]
    assert M.ece(conf, y, n_bins=10) == pytest.approx((0.1 + 0.6 + 0.2 + 0.1) / 4)
    assert M.ece(conf, y, n_bins=2) == pytest.approx(2 / 4 * 0.25 + 2 / 4 * 0.15)
    assert M.brier(conf, y) == pytest.approx((0.01 + 0.36 + 0.04 + 0.01) / 4)
    assert M.auroc(conf, y) == 1.0
    assert M.auroc([0.5, 0.5, 0.2, 0.9], [1, 0, 0, 1]) == pytest.approx(3.5 / 4)  # a tie counts half
    assert M.auroc([0.3, 0.7], [1, 1]) is None  # one class only
    bins = M.reliability_bins(conf, y, n_bins=2)
    assert [b["count"] for b in bins] == [2, 2]
    assert bins[0]["confidence"] == pytest.approx(0.25) and bins[0]["accuracy"] == 0.5
    assert M.reliability_bins([1.0], [1], n_bins=4)[-1]["count"] == 1  # c = 1 falls in the last bin


def test_per_position_pairs_by_hand():
    # conditional at k=2: rounds that verified >= 2 and accepted the first
    assert M.conditional_pairs(ROUNDS, 2) == ([0.8, 0.5, 0.8], [1, 0, 1])
    xs, ys = M.cumulative_pairs(ROUNDS, 2)  # every round verified >= 2
    assert xs == pytest.approx([0.72, 0.45, 0.36, 0.64]) and ys == [1, 0, 0, 1]
    rep = M.calibration_report(ROUNDS, gamma=4, n_bins=10)
    p2 = rep["positions"][1]
    assert p2["cumulative"]["n"] == 4 and p2["cumulative"]["auroc"] == 1.0
    assert p2["cumulative"]["brier"] == pytest.approx((0.28**2 + 0.45**2 + 0.36**2 + 0.36**2) / 4)
    assert M.calibration_report([rec(2, 2, 1, 2)]) is None  # no confidences, no calibration


def test_threshold_sweep_by_hand():
    # threshold 0.5 on Π c: r1 keeps 3 (0.9, 0.72, 0.504) and would then take a bonus -> 4 tokens;
    # r2 keeps 1 (0.45 < 0.5) -> 2; r3 keeps 0 -> 1; r4 keeps 2, still cut by its stop -> 2
    assert [M.truncate_round(r, r.confidences, 0.5) for r in ROUNDS] == [(3, 3, 4), (1, 1, 2), (0, 0, 1), (2, 2, 2)]
    p0, p5 = M.threshold_sweep(ROUNDS, [0.0, 0.5])
    assert p0.tokens_per_step == pytest.approx(2.5) and p0.acceptance_rate == pytest.approx(0.5) and p0.verify_rate == 1
    assert p5.tokens_per_step == pytest.approx(9 / 4) and p5.acceptance_rate == 1.0
    assert p5.verify_tokens_per_round == pytest.approx((4 + 6) / 4) and p5.verify_rate == pytest.approx(6 / 14)


def synthetic_rounds(n, gamma=4, sharpen=2.5, seed=0):
    """True conditional acceptance p_k; an over-confident head reports σ(sharpen · logit p_k)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.uniform(0.15, 0.95) for _ in range(gamma)]
        conf = tuple(1 / (1 + math.exp(-sharpen * math.log(x / (1 - x)))) for x in p)
        acc = 0
        while acc < gamma and rng.random() < p[acc]:
            acc += 1
        out.append(RoundRecord("t", f"q{i}", gamma, gamma, acc, acc + 1, conf))
    return out


def test_sts_lowers_ece_on_overconfident_heads_and_preserves_order():
    fit, test = synthetic_rounds(3000, seed=1), synthetic_rounds(3000, seed=2)
    temps = sts.fit_sts(fit, gamma=4)
    assert all(t > 1.2 for t in temps), temps  # over-confident -> softened
    assert 1.8 < temps[0] < 3.5, temps  # position 1 has an exact answer: 2.5
    before = sts.cumulative_ece(test, 4)
    after = sts.cumulative_ece(sts.calibrated(test, temps), 4)
    assert all(a < 0.5 * b for a, b in zip(after, before)), (before, after)
    assert max(after) < 0.03
    cal = sts.calibrated(test, temps)
    for k in range(4):  # order-preserving per position: same ranking, same AUROC
        raw = [r.confidences[k] for r in test]
        new = [r.confidences[k] for r in cal]
        assert sorted(range(len(raw)), key=raw.__getitem__) == sorted(range(len(new)), key=new.__getitem__)
        assert M.auroc(*M.conditional_pairs(test, k + 1)) == pytest.approx(M.auroc(*M.conditional_pairs(cal, k + 1)))


def test_sts_is_fitted_in_order_and_keeps_identity_when_calibrated():
    # an already calibrated head stays calibrated: T_1 near 1, and on held-out rounds STS costs
    # at most noise (later positions' products are small, where ECE is flat in T)
    fit, test = synthetic_rounds(4000, sharpen=1.0, seed=3), synthetic_rounds(4000, sharpen=1.0, seed=5)
    temps = sts.fit_sts(fit, gamma=4)
    assert 0.8 < temps[0] < 1.25, temps
    before = sts.cumulative_ece(test, 4)
    after = sts.cumulative_ece(sts.calibrated(test, temps), 4)
    assert all(a < b + 0.015 for a, b in zip(after, before)), (before, after)
    # on its own fit data, position k does no worse than T_k = 1 with T_<k fixed (1 is on the grid)
    for k in range(1, 5):
        with_one = temps[: k - 1] + [1.0]
        assert sts.cumulative_ece(sts.calibrated(fit, temps), k)[-1] <= \
            sts.cumulative_ece(sts.calibrated(fit, with_one), k)[-1] + 1e-12
    # positions nobody reached, or where every round failed (too little data to fit), keep T = 1
    assert sts.fit_sts([rec(1, 1, 1, 2, (0.9,))] * 10, gamma=3) == [1.0, 1.0, 1.0]
    assert sts.fit_sts([rec(2, 2, 0, 1, (0.4, 0.3))] * 10 + [rec(2, 2, 1, 2, (0.7, 0.4))] * 10, gamma=2)[1] == 1.0


def test_scale_unscale_and_calibration_file(tmp_path):
    c = [0.05, 0.5, 0.93, 0.999]
    t = [2.0, 0.5, 3.0]
    assert sts.unscale(sts.scale(c, t), t) == pytest.approx(c, rel=1e-6)
    assert sts.scale([0.8], [1.0]) == pytest.approx([0.8])
    with pytest.raises(Exception, match="not a drafter checkpoint"):
        sts.write_calibration(tmp_path, t, [], [], {}, 10)
    (tmp_path / "config.json").write_text(json.dumps({"kind": "dspark"}))
    path = sts.write_calibration(tmp_path, t, [0.1, 0.2, 0.3], [0.01, 0.02, 0.03], {"rounds": 5}, 10)
    data = json.loads(path.read_text())
    assert data["method"] == "sts" and data["temperatures"] == t and data["fitted_on"]["rounds"] == 5
    assert sts.read_calibration(tmp_path)["temperatures"] == t
    from draftsmith.drafters.checkpoint import read_calibration  # what the inference drafter loads

    assert read_calibration(tmp_path) == tuple(t)
    # the drafter's own STS (drafters apply it to confidence logits) matches eval's
    from draftsmith.drafters.losses import temperature_scale

    assert temperature_scale(torch.tensor([c[:3]]), t)[0].tolist() == pytest.approx(sts.scale(c[:3], t), rel=1e-5)


def test_cross_fitting_keeps_requests_out_of_their_own_fit():
    rounds = synthetic_rounds(400, seed=4)
    out, folds = sts.cross_fitted(rounds, 4, folds=2)
    assert len(out) == len(rounds) and len(folds) == 2
    assert sorted(r.request for r in out) == sorted(r.request for r in rounds)


def test_recording_policy_threshold_and_records():
    seqs = [SimpleNamespace(request_id="a", stats=SimpleNamespace(committed=0)),
            SimpleNamespace(request_id="b", stats=SimpleNamespace(committed=0))]
    conf = torch.tensor([[0.9, 0.5, 0.9], [0.6, 0.9, 0.0]])
    prop = Proposal(tokens=torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3, 2]), confidences=conf)
    pol = RecordingPolicy(3, threshold=0.5, tags={"a": ("task", "a"), "b": ("task", "b")})
    assert pol.choose(seqs) == [3, 3]
    assert pol.trim(seqs, prop) == [1, 2]  # row a: 0.9, then 0.45 < 0.5; row b: 0.6, 0.54
    seqs[0].stats.committed, seqs[1].stats.committed = 2, 1
    trimmed = Proposal(prop.tokens, torch.tensor([1, 2]), confidences=conf)
    pol.update(seqs, trimmed, VerifyResult(tokens=torch.zeros(2, 4, dtype=torch.long), num_accepted=torch.tensor([1, 0])))
    a, b = pol.records
    assert (a.drafted, a.proposed, a.accepted, a.committed) == (3, 1, 1, 2)
    assert (b.drafted, b.proposed, b.accepted, b.committed) == (2, 2, 0, 1)
    assert a.confidences == pytest.approx((0.9, 0.5, 0.9)) and b.confidences == pytest.approx((0.6, 0.9))
    # a drafter that applies STS reports calibrated confidences: the record holds the raw ones
    pol = RecordingPolicy(3, applied_temperatures=[2.0, 2.0, 2.0])
    pol.trim(seqs, prop)
    seqs[0].stats.committed, seqs[1].stats.committed = 3, 2
    pol.update(seqs, prop, VerifyResult(tokens=torch.zeros(2, 4, dtype=torch.long), num_accepted=torch.tensor([0, 0])))
    assert pol.records[0].confidences == pytest.approx(tuple(sts.unscale([0.9, 0.5, 0.9], [2.0] * 3)))
    assert pol.records[0].committed == 3  # committed counts are per round (deltas)


def test_report_markdown_opens_with_a_summary_and_ends_with_definitions():
    from draftsmith.eval.jobs import render_markdown

    s = {"rounds": 10, "tau": 2.5, "acceptance_rate": 0.3, "verify_rate": 1.0, "prefix_survival": [0.5, 0.2, 0.1],
         "conditional_acceptance": [0.5, 0.4, 0.5]}
    pos = lambda k, n: {"position": k, "cumulative": {"n": n, "ece": 0.0, "auroc": None, "brier": 0.0},  # noqa: E731
                        "conditional": {"ece": 0.0}}
    cal = {"before": {"positions": [pos(1, 10), pos(2, 0)]}, "after": {"positions": [pos(1, 10), pos(2, 0)]},
           "source": "x"}
    report = {"target": "t", "prompts": {"humaneval": 2}, "temperature": 0.0, "max_new_tokens": 8, "max_turns": 1,
              "drafters": [{"label": "dspark:x", "tasks": {"humaneval": s}, "overall": s, "calibration": cal,
                            "threshold_sweep": {"points": []}}],
              "definitions": {"tau": "committed tokens per verification round"}}
    md = render_markdown(report)
    head = md.split("## Summary")[1].split("|")[0]
    assert "dspark:x: each verification round committed 2.50 tokens on average of at most 4" in head
    assert "30% of drafted tokens were accepted" in head
    assert md.rstrip().endswith("- tau: committed tokens per verification round")
    assert "| dspark:x | 2 | 0 | – | – |" in md  # a position no round reached shows no ECE of 0.000


def test_plot_colours_follow_the_drafter_and_empty_positions_get_no_panel(tmp_path):
    from draftsmith.eval import plots

    assert plots.color_for("dspark:runs/a") == plots.color_for("dspark:runs/b") != plots.color_for("ngram")
    assert plots.color_for("dspark:smollm2-135m") != plots.color_for("dspark:runs/a")  # built-in: its own shade
    assert plots.color_for("x:y") == plots.color_for("x:y")  # unknown kinds: stable too
    full = [{"confidence": 0.5, "accuracy": 0.4, "count": 3}]
    empty = [{"confidence": 0.5, "accuracy": 0.0, "count": 0}]
    import matplotlib.pyplot as plt

    made = []
    real = plt.subplots
    plt.subplots = lambda *a, **k: (made.append(a), real(*a, **k))[1]
    try:
        plots.reliability([full, empty, []], None, tmp_path / "r.png")
        plots.reliability([[], []], None, tmp_path / "none.png")
    finally:
        plt.subplots = real
    assert made[0][:2] == (1, 1)  # one panel: positions 2 and 3 were never reached
    assert (tmp_path / "r.png").stat().st_size > 0 and (tmp_path / "none.png").stat().st_size > 0

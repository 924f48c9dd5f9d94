"""Eval metrics against hand-computed values; STS on synthetic over-confident heads; the recording policy."""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
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
    assert "regime" not in data  # (no temperature given: applies to every row)
    for temperature, regime in ((0.0, "greedy"), (0.7, "sampled")):  # the rows the drafter applies it to
        sts.write_calibration(tmp_path, t, [], [], {"rounds": 5, "temperature": temperature}, 10)
        assert json.loads(path.read_text())["regime"] == regime
    sts.write_calibration(tmp_path, t, [0.1, 0.2, 0.3], [0.01, 0.02, 0.03], {"rounds": 5}, 10)
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


def _report(records, gamma=4, label="dspark:runs/x"):
    """A report as eval/jobs.py builds it, from real metrics over `records` (confidences after
    STS = the raw ones; the markdown only reads the numbers)."""
    cal = {"source": "calibration.json", "temperatures": [1.0] * gamma,
           "before": M.calibration_report(records, gamma), "after": M.calibration_report(records, gamma)}
    d = {"label": label, "overall": M.acceptance_summary(records, gamma),
         "tasks": {"humaneval": M.acceptance_summary(records, gamma)}, "skipped": [], "calibration": cal,
         "threshold_sweep": {"points": [asdict(p) for p in M.threshold_sweep(records, M.default_thresholds())]}}
    return {"target": "tiny", "prompts": {"humaneval": 2}, "temperature": 1.0, "max_new_tokens": 8, "max_turns": 1,
            "drafters": [d], "plots": {"reliability:" + label: "/x/reliability-x.png"}}


def markdown_tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header cells, row cells) of every table in a markdown text (`\\|` is not a separator)."""
    import re

    tables, cur = [], None
    for ln in md.splitlines():
        if not ln.startswith("|"):
            cur = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
        if cur is None:
            cur = (cells, [])
            tables.append(cur)
        elif not set("".join(cells)) <= set("-:"):
            cur[1].append(cells)
    return tables


# Four rounds of γ = 4 where nobody ever accepted 3 drafts: positions 3 and 4 were verified
# (n = 4) but never accepted, and their Π c is ~0, so their ECE would print as 0.000.
NEVER_PAST_2 = [rec(4, 4, 2, 3, (0.9, 0.9, 0.001, 0.001)), rec(4, 4, 0, 1, (0.3, 0.2, 0.001, 0.001)),
                rec(4, 4, 1, 2, (0.8, 0.4, 0.001, 0.001)), rec(4, 4, 2, 3, (0.9, 0.8, 0.001, 0.001), request="s")]


def test_report_markdown_summary_defined_columns_and_whole_rows():
    from draftsmith.eval.report import render_markdown

    md = render_markdown(_report(NEVER_PAST_2))
    summary = md.split("## Summary")[1].split("## Acceptance")[0]
    assert "What was measured" in summary and "τ, the mean number of tokens committed per verification round" in summary
    assert "runs/x: each verification round committed 2.25 tokens on average of at most 5" in summary
    assert "31% of drafted tokens were accepted" in summary  # 5 of 16
    assert "mean ECE over positions 1–2" in summary  # positions 3, 4: nothing accepted, nothing to average
    tables = markdown_tables(md)
    assert [h[:2] for h, _ in tables] == [["drafter", "task"], ["drafter", "k"], ["drafter", "threshold"]]
    for header, rows in tables:
        assert rows and all(len(r) == len(header) for r in rows), header  # issue 15: 5 cells under 7 columns
        defined = md.split("| " + " | ".join(header) + " |")[1].split("\n\n", 2)[2].split("\n\n")[0]
        for col in header:
            assert f"- **{col}**: " in defined, col  # every column is defined under its table
    cal_header, cal_rows = tables[1]
    by_k = {r[1]: dict(zip(cal_header, r)) for r in cal_rows}
    assert by_k["1"]["ECE raw"] != "–" and by_k["2"]["AUROC"] == "1.000"
    for k in ("3", "4"):  # verified, never accepted: no "ECE 0.000", and the note says why
        row = by_k[k]
        assert (row["n"], row["accepted"]) == ("4", "0")
        assert [row[c] for c in cal_header[4:]] == ["–"] * 7
    assert "where `accepted` is 0 every outcome at that position was a rejection" in md
    assert "![reliability:dspark:runs/x](reliability-x.png)" in md


def test_report_markdown_position_never_reached_and_a_pipe_in_a_label():
    from draftsmith.eval.report import _table, render_markdown

    recs = [rec(2, 2, 1, 2, (0.9, 0.5)), rec(2, 2, 2, 3, (0.9, 0.9))]
    md = render_markdown(_report(recs, gamma=3, label="dspark:a|b"))  # position 3: never verified
    for header, rows in markdown_tables(md):
        assert all(len(r) == len(header) for r in rows), header
    assert "| dspark:a\\|b | 3 | 0 | 0 | – | – | – | – | – | – | – |" in md
    with pytest.raises(ValueError, match="5 cells under 7 columns"):
        _table({str(i): "" for i in range(7)}, [["x"] * 5])


def test_plot_colours_follow_the_drafter_and_empty_positions_get_no_panel(tmp_path):
    from draftsmith.eval import plots

    assert plots.color_for("dspark:runs/a") == plots.color_for("dspark:runs/b") != plots.color_for("ngram")
    assert plots.color_for("dspark:smollm2-135m") != plots.color_for("dspark:runs/a")  # built-in: its own shade
    # one trained checkpoint is `dspark:dspark` in eval (its directory's name) and `dspark:runs/demo/dspark`
    # in bench (the spec): one colour, not the built-in's shade
    assert plots.color_for("dspark:dspark") == plots.color_for("dspark:runs/demo/dspark")
    assert plots.color_for("x:y") == plots.color_for("x:y")  # unknown kinds: stable too
    labels = ("none", "ngram", "dspark:runs/a", "dspark:smollm2-135m", "eagle3:e", "hf:generate", "hf:prompt-lookup",
              "hf:assistant")
    assert len({plots.color_for(x) for x in labels}) == len(labels)  # what one bench plot shows: all distinct
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


def test_plots_label_every_axis_and_keep_legends_off_the_data(tmp_path, monkeypatch):
    """Issue 15: no axis without a label, no legend over a plotting area, no empty panel; the
    eval and bench plots are drawn and then measured as rendered."""
    from draftsmith.bench import report_plots
    from draftsmith.eval import plots

    figs = []
    real = plots.save

    def keep(fig, path):
        figs.append(fig)
        return real(fig, path)

    monkeypatch.setattr(plots, "save", keep)
    monkeypatch.setattr(report_plots, "save", keep)
    recs = synthetic_rounds(400, gamma=7, seed=3)
    recs = [RoundRecord(r.task, r.request, 3, 3, min(r.accepted, 3), min(r.committed, 4), r.confidences[:3])
            for r in recs]  # γ = 7 asked, 3 verified: positions 4..7 never reached
    bins = [p["cumulative"]["bins"] for p in M.calibration_report(recs, 7)["positions"]]
    plots.reliability(bins, bins, tmp_path / "rel.png")
    curves = {"dspark:runs/a": [0.7, 0.6, 0.5, 0.5, 0.4], "dspark:smollm2-135m": [0.8, 0.7, 0.6],
              "ngram": [0.3, 0.2, None], "eagle3:runs/e": [0.6, 0.5, 0.4]}
    plots.conditional_acceptance(curves, tmp_path / "cond.png")
    plots.threshold_sweep([asdict(p) for p in M.threshold_sweep(recs, M.default_thresholds())], tmp_path / "th.png")
    dist = {"p50": 0.1, "p95": 0.2, "p99": 0.3}
    tiers = [{"concurrency": c, "results": [{"label": lab, "system_tokens_per_s": tps * c, "void": False,
                                             "ttft_s": dist, "itl_s": dist, "e2e_s": dist}
                                            for lab, tps in (("none", 10.0), ("ngram", 14.0), ("dspark:runs/a", 8.0))]}
             for c in (1, 4, 16)]
    peers = {"peers": [{"label": "hf:generate", "system_tokens_per_s": 12.0}]}
    report_plots.plot_throughput(tiers, peers, tmp_path / "tp.png")
    report_plots.plot_latency(tiers, tmp_path / "lat.png")
    report_plots.plot_acceptance(curves, tmp_path / "acc.png")
    assert len(figs) == 6
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for fig in figs:
        canvas = FigureCanvasAgg(fig)  # (a closed figure has lost its pyplot canvas)
        canvas.draw()
        r = canvas.get_renderer()
        shown = [ax for ax in fig.axes if ax.axison]
        by_place: dict = {}  # a twin y axis shares its panel (and x label) with the first
        for ax in shown:
            by_place.setdefault(ax.get_position().bounds, []).append(ax)
        for group in by_place.values():
            assert any(ax.get_xlabel() for ax in group) and all(ax.get_ylabel() for ax in group)
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
        assert legends
        for leg in legends:
            for ax in shown:
                assert not leg.get_window_extent(r).overlaps(ax.get_window_extent(r))
    assert len([ax for ax in figs[0].axes if ax.axison]) == 3  # reliability: only the 3 verified positions

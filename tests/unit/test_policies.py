"""Verification-length policies: Algorithm 1 on hand-worked tables, the threshold and
batch-size policies, SPS(B) interpolation, the profile cache, and the engine running them."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.api import make_policy
from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.drafters.ngram import NgramDrafter
from draftsmith.core.request import Request, StepInfo
from draftsmith.models.loading import load_decoder
from draftsmith.policy import profile as profile_mod
from draftsmith.policy.acceptance import (
    AcceptancePrior, _Counts, cumulative, record_round, remember_drafts, running_confidences,
)
from draftsmith.policy.batch_schedule import BatchSizeSchedule, default_schedule
from draftsmith.policy.registry import parse_policy_spec
from draftsmith.policy.prefix_scheduler import (
    ColumnSearch, PrefixScheduler, admit, admit_best_prefix, admit_columns, can_gain, plan_best_prefix, plan_columns,
    plan_replayed, static_prefix_scheduler,
)
from draftsmith.policy.recent_confidences import RECENT, recent_confidences, remember_confidences
from draftsmith.kernels.build import KernelStatus
from draftsmith.policy.profile import ProfileConfig, SPSTable, load_or_profile
from draftsmith.policy.threshold import ConfidenceThreshold


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def sps_from_times(tokens, times) -> SPSTable:
    return SPSTable.from_step_times(tuple(tokens), tuple(times))


def seqs(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(), None) for i in range(n)]


def proposal(lengths, K, confidences=None) -> Proposal:
    conf = None if confidences is None else torch.tensor(confidences, dtype=torch.float32)
    return Proposal(tokens=torch.zeros(len(lengths), K, dtype=torch.long),
                    lengths=torch.tensor(lengths, dtype=torch.long), confidences=conf)


# ----------------------------------------------------------------------------- Algorithm 1


def test_algorithm1_packed_hand_worked():
    # a: row 0 -> 0.9, 0.72; row 1 -> 0.5. Order: (0,1) (0,2) (1,1).
    # SPS(2..5) = 1/1.0, 1/1.1, 1/1.2, 1/1.5. Theta_0 = 2.
    # (0,1): 2.9 / 1.1 = 2.636 > 2      admit, l_0 = 1
    # (0,2): 3.62 / 1.2 = 3.017 > 2.636 admit, l_0 = 2
    # (1,1): 4.12 / 1.5 = 2.747 < 3.017 break
    sps = sps_from_times((2, 3, 4, 5), (1.0, 1.1, 1.2, 1.5))
    assert admit([[0.9, 0.8], [0.5]], sps, "packed") == [2, 0]
    # A cheaper 5th token: (1,1) gives 4.12 / 1.25 = 3.296 > 3.017 -> admitted too.
    sps = sps_from_times((2, 3, 4, 5), (1.0, 1.1, 1.2, 1.25))
    assert admit([[0.9, 0.8], [0.5]], sps, "packed") == [2, 1]


def test_algorithm1_padded_hand_worked():
    # Padded: B = R * (1 + max l). a: row 0 -> 0.9, 0.72; row 1 -> 0.6, 0.3.
    # Order: (0,1) 0.9, (0,2) 0.72, (1,1) 0.6, (1,2) 0.3. Theta_0 = 2 * SPS(2) = 2.
    conf = [[0.9, 0.8], [0.6, 0.5]]
    # Step times 1, 1.3, 1.4 at B = 2, 4, 6:
    # (0,1): width 2, B 4: 2.9 / 1.3 = 2.231 admit; (0,2): width 3, B 6: 3.62 / 1.4 = 2.586 admit;
    # (1,1), (1,2) fit in width 3 (free): 4.22 / 1.4, 4.52 / 1.4 admit.
    assert admit(conf, sps_from_times((2, 4, 6), (1.0, 1.3, 1.4)), "padded") == [2, 2]
    # Step time 2.0 at B = 6: (0,2) gives 3.62 / 2.0 = 1.81 < 2.231: break. (1,1) would have
    # been free inside width 2 (3.5 / 1.3 = 2.69), but it ranks below the break: not admitted.
    assert admit(conf, sps_from_times((2, 4, 6), (1.0, 1.3, 2.0)), "padded") == [1, 0]


def test_admit_columns_padded_hand_worked():
    # Four rows, padded; step times 1.0, 1.18, 1.34 at B = 4, 8, 12 (a 2-core CPU's shape).
    # c = 0.45, 0.4 for every row: a = 0.45, 0.18. Theta_0 = 4 / 1.0 = 4.
    sps = sps_from_times((4, 8, 12), (1.0, 1.18, 1.34))
    conf = [[0.45, 0.4]] * 4
    # Algorithm 1: (0,1) alone opens column 1: 4.45 / 1.18 = 3.77 < 4: stop, nothing verified.
    assert admit(conf, sps, "padded") == [0, 0, 0, 0]
    # By columns: column 1 together: (4 + 1.8) / 1.18 = 4.92 > 4: open, all four verify draft 1;
    # column 2: (5.8 + 0.72) / 1.34 = 4.87 < 4.92: stop.
    assert admit_columns(conf, sps) == [1, 1, 1, 1]
    # A row with no drafts or a zero confidence stays out of the column and what follows.
    assert admit_columns([[0.45, 0.4], [], [0.0, 0.9], [0.9, 0.9]], sps_from_times((4, 8, 12), (1.0, 1.1, 1.2))) \
        == [2, 0, 0, 2]
    assert admit_columns([], sps) == [] and admit_columns([[], []], sps) == [0, 0]


def test_admit_columns_is_algorithm1_for_one_row():
    sps = sps_from_times((1, 2, 3, 4, 5), (1.0, 1.6, 1.65, 1.7, 1.75))
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        conf = [torch.rand(4, generator=g).tolist()]
        assert admit_columns(conf, sps) == admit(conf, sps, "padded")


def test_draft_gate_stops_where_the_column_search_stops():
    """The gate a DSpark drafter asks column by column (stopping at its first False) opens
    exactly the columns admit_columns opens on the full proposal, and trim() on the proposal
    cut there returns the same verify lengths: the gate changes the drafting work, never the
    schedule. Random confidences (zeros included), ragged rows, three cost curves."""
    g = torch.Generator().manual_seed(5)
    curves = [sps_from_times((4, 8, 12, 16, 20), t) for t in
              ((1.0, 1.18, 1.34, 1.5, 1.66), (1.0, 1.05, 1.1, 1.15, 1.2), (1.0, 1.6, 2.2, 2.8, 3.4))]
    stopped_early = 0
    for trial in range(600):
        sps = curves[trial % 3]
        R = 1 + trial % 4
        conf = []
        for _ in range(R):
            c = torch.rand(int(torch.randint(0, 5, (1,), generator=g)), generator=g)
            c[torch.rand(len(c), generator=g) < 0.1] = 0.0
            conf.append(c.tolist())
        forced = trial % 3  # columns opened whatever they pay (a probe's: probe_verifies)
        full = admit_columns(conf, sps, forced)
        gate, opened = ColumnSearch(R, sps, forced), 0
        for j in range(max((len(c) for c in conf), default=0)):
            if not gate.open_next([c[j] if len(c) > j else None for c in conf]):
                break
            opened += 1
        assert gate.ell == full
        if opened < max((len(c) for c in conf), default=0):
            stopped_early += 1
            assert not gate.open_next([1.0] * R)  # once refused, closed for good
        assert admit_columns([c[:opened] for c in conf], sps, forced) == full
        # a forced column opens for every row whose draft there has a confidence above 0
        assert all(e >= next((j for j, x in enumerate(c[:forced]) if x <= 0), min(forced, len(c)))
                   for e, c in zip(full, conf))
    assert stopped_early > 100


def test_draft_gate_only_for_the_column_search():
    sps = sps_from_times((4, 8, 12), (1.0, 1.18, 1.34))
    pol = PrefixScheduler(sps, max_k=2, adapt=False)
    assert isinstance(pol.draft_gate(seqs(2), [2, 2]), ColumnSearch)
    assert replace(pol, stop_drafting=False).draft_gate(seqs(2), [2, 2]) is None
    assert replace(pol, padded_search="early-stop").draft_gate(seqs(2), [2, 2]) is None
    assert replace(pol, batch_tokens="packed").draft_gate(seqs(2), [2, 2]) is None


def test_prefix_scheduler_trim_padded_search():
    sps = sps_from_times((4, 8, 12), (1.0, 1.18, 1.34))
    conf = [[0.45, 0.4]] * 4
    pol = PrefixScheduler(sps, max_k=2, adapt=False)  # padded, by columns (the default)
    assert pol.trim(seqs(4), proposal([2] * 4, 2, conf)) == [1, 1, 1, 1]
    assert replace(pol, padded_search="early-stop").trim(seqs(4), proposal([2] * 4, 2, conf)) == [0, 0, 0, 0]
    assert static_prefix_scheduler(sps, max_k=2).padded_search == "early-stop"  # the paper's
    with pytest.raises(DraftsmithError, match="padded_search"):
        PrefixScheduler(sps, padded_search="best")


def test_algorithm1_break_vs_best_prefix_appendix_a():
    # One request, a_1 = 0.8, SPS(1..3) = 1.0, 0.5, 0.45: Theta = 1.0, 0.9, then
    # 0.45 * (1.8 + 0.8 c_2). The early stop never reaches draft 2; the best prefix does
    # when c_2 > 0.528, i.e. depending on draft 1 (the biased variant, only safe for
    # confidences from past rounds).
    sps = SPSTable((1, 2, 3), (1.0, 0.5, 0.45))
    for c2 in (0.95, 0.3):
        assert admit([[0.8, c2]], sps, "packed") == [0]
    assert admit_best_prefix([[0.8, 0.95]], sps, "packed") == [2]
    assert admit_best_prefix([[0.8, 0.3]], sps, "packed") == [0]


def test_algorithm1_edges():
    flat = SPSTable((1,), (1.0,))
    assert admit([], flat) == []
    assert admit([[], []], flat) == [0, 0]  # no drafts: nothing to admit
    # Flat cost: every candidate with a > 0 improves Theta; a = 0 does not (stop there).
    assert admit([[1.0, 1.0, 0.0, 1.0], [0.5]], flat, "packed") == [2, 1]
    # Ties in a keep each row's prefix order (j ascending): c = 1 repeats a.
    assert admit([[1.0, 1.0, 1.0]], flat, "padded") == [3]


def test_can_gain_and_choose_skip_drafting_when_nothing_can_pay():
    linear = sps_from_times((1, 200), (1.0, 200.0))  # time proportional to tokens: never pays
    flat = SPSTable((1,), (1.0,))
    for bt in ("padded", "packed"):
        assert not can_gain(4, 5, linear, bt)
        assert can_gain(4, 5, flat, bt)
    assert not can_gain(0, 5, flat) and not can_gain(3, 0, flat)
    assert PrefixScheduler(linear, max_k=5).choose(seqs(3)) == [0, 0, 0]
    assert PrefixScheduler(flat, max_k=5).choose(seqs(3)) == [5, 5, 5]


def test_prefix_scheduler_trim_uses_drafter_confidences_then_running_acceptance():
    sps = sps_from_times((2, 3, 4, 5), (1.0, 1.1, 1.2, 1.5))
    pol = static_prefix_scheduler(sps, max_k=2, batch_tokens="packed")  # fixed prior, no margin
    ss = seqs(2)
    # The drafter's confidences decide (same table as the packed hand-worked case);
    # lengths cap the candidates: row 1 proposed 1 draft.
    assert pol.trim(ss, proposal([2, 1], 2, [[0.9, 0.8], [0.5, 0.99]])) == [2, 0]
    # No confidences: the request's running acceptance, starting at the prior.
    ss = seqs(2)
    prior = pol.prior
    assert running_confidences(ss[0], 2, prior) == pytest.approx([prior.mean] * 2)
    ss[0].drafter_state["policy.running_acceptance"] = _Counts([3.0, 2.0], [3.0, 1.0], [])
    ss[1].drafter_state["policy.running_acceptance"] = _Counts([3.0], [0.0], [])
    n0, a0 = prior.strength, prior.strength * prior.mean
    conf = [[(3 + a0) / (3 + n0), (1 + a0) / (2 + n0)], [a0 / (3 + n0), prior.mean]]
    assert running_confidences(ss[0], 2, prior) == pytest.approx(conf[0])
    assert running_confidences(ss[1], 2, prior) == pytest.approx(conf[1])
    # The running schedule is made before drafting (choose() caps the drafts); trim() keeps
    # what was drafted.
    assert pol.choose(ss) == admit_best_prefix(conf, sps, "packed")
    assert replace(pol, running_search="early-stop").choose(ss) == admit(conf, sps, "packed")
    assert pol.trim(ss, proposal([2, 1], 2)) == [2, 1]
    late = replace(pol, running_at="trim")  # draft max_k, schedule after drafting
    assert late.choose(ss) == [2, 2]
    assert late.trim(ss, proposal([2, 2], 2)) == admit_best_prefix(conf, sps, "packed")
    # Once the drafter has shown confidences, choose() drafts max_k and trim() decides.
    pol.trim(ss, proposal([2, 1], 2, [[0.9, 0.8], [0.5, 0.99]]))
    assert pol.choose(ss) == [2, 2]


def test_choose_predicts_what_the_column_search_will_verify_for_a_drafter_with_confidences():
    """16 rows on a CPU-like curve: the first column costs 65% of a step, later ones 16% and 9%.
    Running acceptance 0.5 at draft 1, 0.99 after (later positions are rarely verified, so their
    estimates stay where they were). The best prefix of Algorithm 1's order counts on 3 columns
    and predicts a 27% gain; trim()'s column search never opens column 1 (it does not pay
    alone), so such a round drafts and verifies nothing. With choose_plan="columns" (the default
    since stop 58: the field's comment) choose() predicts the column search's plan and keeps
    drafting off, once the drafter has proposed with confidences (the scheduler's mark, not the
    requests': these rows never drafted); where column 1 pays (0.7) it drafts as before;
    choose_plan="best-prefix" drafts on the best prefix. (Measured on a 2-core Zen 3
    at 16 rows, stop 57: plans of gain 1.04-1.14 on 3 columns, rounds that opened column 1
    only, realized 0.72-0.79 of plain.)"""
    times = sps_from_times((16, 32, 48, 64), (51.0, 84.0, 92.0, 100.0))
    step = times.step_time
    rows = 16

    def running(c1: float) -> list[Request]:
        ss = seqs(rows)
        for s in ss:  # plenty of evidence: the prior no longer matters
            s.drafter_state["policy.running_acceptance"] = _Counts([1000.0] * 3, [1000.0 * c1, 990.0, 990.0], [])
        return ss

    pol = PrefixScheduler(times, max_k=3, adapt=False, pooled_prior=False, running_at="choose", probe_every=0,
                          choose_plan="columns")
    assert pol.choose(running(0.5)) == [3] * rows  # no proposal seen yet: the best prefix, which drafts...
    assert pol.trim(seqs(rows), proposal([0] * rows, 1)) == [0] * rows  # (nothing drafted: no mark)
    assert pol.choose(running(0.5)) == [3] * rows
    pol.trim(seqs(rows), proposal([1] * rows, 1, [[0.9]] * rows))  # ...until the drafter proposes with confidences
    conf = [running_confidences(s, 3, pol.prior) for s in running(0.5)]
    ell, gain = plan_best_prefix(conf, step)
    assert ell == [3] * rows and gain > 1.2  # the prediction choose() made before
    assert plan_columns(conf, step) == ([0] * rows, 1.0)
    assert admit_columns(conf, times) == [0] * rows  # what trim() verifies on such confidences
    assert pol.choose(running(0.5)) == [0] * rows
    conf = [running_confidences(s, 3, pol.prior) for s in running(0.7)]
    ell, gain = plan_columns(conf, step)
    assert ell == admit_columns(conf, times) == [3] * rows
    tau = rows * (1 + sum(cumulative(conf[0])))
    assert gain == pytest.approx(tau / step(64) * step(16) / rows)
    assert plan_columns(conf, step, draft_time=60.0)[1] == pytest.approx(tau / (step(64) + 60.0) * step(16) / rows)
    assert pol.choose(running(0.7)) == [3] * rows
    # the paper's candidate-by-candidate search in trim(), or choose_plan="best-prefix": the best prefix
    assert replace(pol, padded_search="early-stop").choose(running(0.5)) == [3] * rows
    default = PrefixScheduler(times, max_k=3, adapt=False, pooled_prior=False, running_at="choose", probe_every=0)
    assert default.choose_plan == "columns"
    best = replace(default, choose_plan="best-prefix")
    for p in (default, best):
        p.trim(seqs(rows), proposal([1] * rows, 1, [[0.9]] * rows))
    assert default.choose(running(0.5)) == [0] * rows
    assert best.choose(running(0.5)) == [3] * rows
    assert plan_columns([], step) == ([], 1.0)


def test_choose_replays_recent_confidences_through_the_column_search():
    """4 rows on the step times measured at 4 rows on a 2-core Zen 3 (28 / 35 / 39.5 / 50 ms at 1-4
    columns) with 8 ms of drafting. A row's rounds go two ways: A = (0.45, 0.3), where trim()'s
    column search opens column 1 only (a round that realizes 0.94x plain), and B = (0.6, 0.8), two
    columns (1.23x). The running estimates average them, (0.55, 0.67), and the plan on them opens
    both columns and predicts 1.13x; replaying the rows' last 8 vectors (6 A, 2 B) gives what trim
    does over those rounds, 1.02x: below min_gain, so choose_plan="replay" does not draft where
    "columns" does (stop 60: trim opened the second column in about half the rounds "columns"
    planned it for)."""
    times = sps_from_times((4, 8, 12, 16), (28.0, 35.0, 39.5, 50.0))
    step, rows, A, B = times.step_time, 4, [0.45, 0.3], [0.6, 0.8]
    running = [[0.55, 0.67]] * rows
    assert admit_columns([A] * rows, times) == [1] * rows and admit_columns([B] * rows, times) == [2] * rows
    assert plan_columns(running, step, 8.0) == ([2] * rows, pytest.approx(4 * (1 + 0.55 + 0.55 * 0.67) / 47.5 * 7))
    recent = [[A, A, B, A, A, B, A, A]] * rows
    tokens, seconds = 6 * 4 * 1.45 + 2 * 4 * (1 + 0.6 + 0.48), 6 * 43.0 + 2 * 47.5
    assert plan_replayed(recent, running, step, 8.0) == ([2] * rows, pytest.approx(tokens / seconds * 7))
    assert tokens / seconds * 7 < 1.03 < plan_columns(running, step, 8.0)[1]
    # a row with fewer vectors cycles through its own; a row without any uses its running estimates
    mixed = plan_replayed([[B], [A, B], [], [A]], running, step, 8.0)
    assert mixed == plan_replayed([[B, B], [A, B], [running[2]] * 2, [A, A]], running, step, 8.0)
    assert mixed != plan_replayed([[B], [A], [], [A]], running, step, 8.0)
    # no history at all: the plan on the running estimates; nothing opens: no gain
    assert plan_replayed([[]] * rows, running, step, 8.0) == plan_columns(running, step, 8.0)
    assert plan_replayed([[[0.1]]] * rows, running, step, 8.0) == ([0] * rows, 1.0)

    def scheduler(plan: str) -> PrefixScheduler:
        pol = PrefixScheduler(times, max_k=2, pooled_prior=False, running_at="choose", probe_every=0,
                              cheap_draft=0.0, choose_plan=plan)
        pol.cost.observe(StepInfo(rows=rows, block_len=2, useful_tokens=2 * rows, drafted=True, draft_s=8.0,
                                  forward_s=35.0, accepted=2))  # drafting time 8 ms, the profile's forward
        pol.trim(seqs(rows), proposal([1] * rows, 1, [[0.9]] * rows))  # the drafter has confidences
        return pol

    def requests() -> list[Request]:
        ss = seqs(rows)
        for s in ss:
            s.drafter_state["policy.running_acceptance"] = _Counts([1000.0] * 2, [550.0, 670.0], [])
            for v in reversed(recent[0]):
                remember_confidences([s], [v])
        return ss

    assert recent_confidences(requests()[0]) == recent[0]
    assert scheduler("columns").cost.draft_time(rows) == pytest.approx(8.0)
    assert scheduler("columns").choose(requests()) == [2] * rows
    assert scheduler("replay").choose(requests()) == [0] * rows
    assert scheduler("best-prefix").choose(requests()) == [2] * rows


def test_recent_confidences_keep_what_the_draft_gate_was_asked():
    """The gate's search sees the column that did not open too, and a round in which no column
    opened (the drafter proposes nothing then) still leaves its vectors; at most RECENT per
    request, most recent first. Without a gate, trim() keeps the proposal's."""
    times = sps_from_times((2, 4, 6), (1.0, 1.3, 1.4))
    pol = PrefixScheduler(times, max_k=3, adapt=False, pooled_prior=False, probe_every=0, choose_plan="replay")
    ss = seqs(2)
    gate = pol.draft_gate(ss, [3, 3])
    assert gate.open_next([0.9, 0.2]) and not gate.open_next([0.1, None])
    assert gate.vectors() == [[0.9, 0.1], [0.2]]
    pol.trim(ss, proposal([1, 1], 1, [[0.9], [0.2]]))
    pol.update(ss, proposal([1, 1], 1, [[0.9], [0.2]]), VerifyResult(tokens=torch.zeros(2, 2, dtype=torch.long),
                                                                     num_accepted=torch.tensor([1, 0])))
    assert [recent_confidences(s) for s in ss] == [[[0.9, 0.1]], [[0.2]]]
    gate = pol.draft_gate(ss, [3, 3])
    assert not gate.open_next([0.01, 0.02])  # nothing opens: the drafter proposes nothing
    pol.trim(ss, Proposal.empty(2))
    pol.update(ss, Proposal.empty(2), VerifyResult(tokens=torch.zeros(2, 1, dtype=torch.long),
                                                   num_accepted=torch.tensor([0, 0])))
    assert [recent_confidences(s)[0] for s in ss] == [[0.01], [0.02]]
    columns = PrefixScheduler(times, max_k=3, adapt=False, pooled_prior=False, probe_every=0)  # the default plan
    fresh = seqs(2)
    gate = columns.draft_gate(fresh, [3, 3])
    assert gate.open_next([0.9, 0.2]) and gate.asked == []  # nothing kept for a plan that does not replay
    columns.trim(fresh, proposal([1, 1], 1, [[0.9], [0.2]]))
    assert [recent_confidences(s) for s in fresh] == [[], []]
    pol = replace(pol, stop_drafting=False)  # no gate: the proposal's confidences
    assert pol.draft_gate(ss, [3, 3]) is None
    for i in range(RECENT + 2):
        pol.trim(ss, proposal([2, 1], 2, [[0.5, i / 10], [0.3, 0.0]]))
    assert recent_confidences(ss[0])[0] == [0.5, pytest.approx((RECENT + 1) / 10)]
    assert recent_confidences(ss[1])[0] == [pytest.approx(0.3)] and len(recent_confidences(ss[0])) == RECENT


def test_running_acceptance_scores_deterministic_drafts_against_committed_output():
    prior = AcceptancePrior(mean=0.5, strength=2.0, decay=0.5)
    (s,) = seqs(1)
    no_result = VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))

    def drafted(tokens):
        return Proposal(tokens=torch.tensor([tokens]), lengths=torch.tensor([len(tokens)]))

    remember_drafts([s], drafted([5, 6, 7]))  # drafts for output positions 0, 1, 2
    s.output_ids += [5]
    record_round([s], drafted([5, 6, 7]), no_result, prior)
    assert running_confidences(s, 1, prior) == pytest.approx([0.5])  # not resolved yet: 5 matched
    s.output_ids += [9]  # 6 mismatched: drafts 1, 2 reached; 1 accepted
    record_round([s], drafted([5, 6, 7]), no_result, prior)
    assert running_confidences(s, 3, prior) == pytest.approx([(1 + 1) / 3, 1 / 3, 0.5])
    remember_drafts([s], drafted([1, 2]))  # not verified at all, still scored
    s.output_ids += [1, 2]
    record_round([s], drafted([1, 2]), no_result, prior)
    # Older evidence halves (decay 0.5): reached [0.5 + 1, 0.5 + 1], accepted [0.5 + 1, 0 + 1].
    assert running_confidences(s, 2, prior) == pytest.approx([(1.5 + 1) / 3.5, (1 + 1) / 3.5])

    # Sampled drafts (q given): only verified rounds count.
    (t,) = seqs(1)
    sampled = Proposal(tokens=torch.zeros(1, 3, dtype=torch.long), lengths=torch.tensor([3]),
                       q=torch.full((1, 3, 4), 0.25))
    remember_drafts([t], sampled)
    record_round([t], sampled, VerifyResult(torch.zeros(1, 4, dtype=torch.long), torch.tensor([1])), prior)
    assert running_confidences(t, 3, prior) == pytest.approx([2 / 3, 1 / 3, 0.5])


# ----------------------------------------------------------------------------- threshold


def test_threshold_keeps_prefix_while_cumulative_confidence_clears():
    pol = ConfidenceThreshold(threshold=0.5, max_k=4)
    # Row 0: a = 0.9, 0.72, 0.36 -> 2. Row 1: a = 0.3 -> 0. Row 2: proposed 1 only -> 1.
    conf = [[0.9, 0.8, 0.5, 1.0], [0.3, 1.0, 1.0, 1.0], [0.99, 0.99, 0.99, 0.99]]
    assert pol.trim(seqs(3), proposal([4, 4, 1], 4, conf)) == [2, 0, 1]
    assert ConfidenceThreshold(threshold=0.0, max_k=4).trim(seqs(3), proposal([4, 4, 1], 4, conf)) == [4, 4, 1]
    # Once a request's drafter has shown confidences, choose() drafts max_k.
    assert pol.choose(seqs(3)[:1]) != [4]
    ss = seqs(1)
    pol.trim(ss, proposal([1], 4, [[0.9, 0.9, 0.9, 0.9]]))
    assert pol.choose(ss) == [4]
    # Without confidences: the cap comes from the running acceptance before drafting
    # (prior 0.5 -> a = 0.5, 0.25: threshold 0.5 caps at 1); trim() keeps what was drafted.
    assert pol.choose(seqs(1)) == [1]
    assert pol.trim(seqs(1), proposal([1], 1)) == [1]
    with pytest.raises(DraftsmithError):
        ConfidenceThreshold(threshold=1.5)


# ----------------------------------------------------------------------------- batch schedule


def test_batch_schedule():
    pol = BatchSizeSchedule(((2, 6), (4, 3), (8, 1)))
    assert [pol.k_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [6, 6, 3, 3, 1, 1, 0, 0]
    assert pol.choose(seqs(3)) == [3, 3, 3]
    assert pol.trim(seqs(2), proposal([2, 0], 2)) == [2, 0]
    assert default_schedule(5) == ((2, 5), (4, 3)) and BatchSizeSchedule(default_schedule(0)).k_for(1) == 0
    for bad in ((), ((4, 2), (2, 1)), ((0, 1),), ((2, -1),)):
        with pytest.raises(DraftsmithError):
            BatchSizeSchedule(bad)


# ----------------------------------------------------------------------------- SPS table


def test_sps_interpolates_linearly_in_step_time():
    t = sps_from_times((1, 3, 7), (1.0, 2.0, 4.0))
    assert t(1) == pytest.approx(1.0) and t(3) == pytest.approx(0.5) and t(7) == pytest.approx(0.25)
    assert t.step_time(2) == pytest.approx(1.5) and t(2) == pytest.approx(1 / 1.5)
    assert t.step_time(5) == pytest.approx(3.0)
    assert t.step_time(0.5) == pytest.approx(1.0)  # below the grid: clamp
    assert t.step_time(9) == pytest.approx(5.0)  # above: continue the last segment (slope 0.5)
    falling = sps_from_times((1, 2), (1.0, 0.9))
    assert falling.step_time(10) == pytest.approx(0.9)  # never extrapolate a negative slope
    assert SPSTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    for bad in (((), ()), ((1, 1), (1.0, 1.0)), ((0,), (1.0,)), ((1,), (0.0,)), ((1, 2), (1.0,))):
        with pytest.raises(DraftsmithError):
            SPSTable(*bad)


def test_profile_grid_shapes():
    grid = ProfileConfig(max_batch=8, max_k=5, max_points=16).grid()
    bs = [b for b, _, _ in grid]
    assert bs[:4] == [1, 2, 3, 4] and bs[-1] == 48 and len(bs) <= 16 and bs == sorted(set(bs))
    for b, rows, width in grid:
        assert rows * width == b and rows <= 8 and width <= 6
    assert dict((b, (r, w)) for b, r, w in grid)[4] == (4, 1)  # decode shape preferred


# ----------------------------------------------------------------------------- profile cache

SMALL = ProfileConfig(max_batch=2, max_k=1, context_len=8, warmup=0, repeats=1)


@pytest.fixture(scope="module")
def tiny_decoder(tiny_model_dir):
    return load_decoder(tiny_model_dir("llama", seed=0))


def test_profile_times_grid_points_in_turn_so_a_burst_of_load_is_spread(tiny_decoder, monkeypatch):
    """The profile times every grid point once per pass, `repeats` passes: a burst of load that
    lasts a few steps slows one step of several points (the median drops it), where timing
    point by point slowed every step of the first points and flattened the whole table."""
    calls: list[int] = []
    burst = {3, 4, 5}  # the 4th to 6th timed steps run under load: 10x slower

    def fake_runner(model, rows, width, context_len, cache=None):
        def run(clock):
            calls.append(rows * width)
            return (10.0 if len(calls) - 1 - warm in burst else 1.0) * (1 + 0.01 * rows * width)
        return run

    cfg = ProfileConfig(max_batch=2, max_k=1, context_len=8, warmup=1, repeats=5)
    warm = len(cfg.grid())  # one untimed step per point first
    monkeypatch.setattr(profile_mod, "step_runner", fake_runner)
    table, raw = profile_mod.profile_sps(tiny_decoder, cfg)
    timed = calls[warm:]
    assert timed == [b for _ in range(5) for b, _, _ in cfg.grid()]  # round robin over the grid
    assert all(t < 2.0 for t in raw["median_s"])  # the burst is in no point's median
    assert raw["median_s"] == sorted(raw["median_s"])


def test_profile_cache_reused_per_machine_and_model(tiny_decoder, tmp_path, monkeypatch):
    calls = []
    real = profile_mod.profile_sps

    def counting(model, config, *a, **kw):
        calls.append(config)
        return real(model, config, *a, **kw)

    monkeypatch.setattr(profile_mod, "profile_sps", counting)
    t1 = load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=SMALL, home=tmp_path)
    assert len(calls) == 1
    assert all(x >= y for x, y in zip(t1.steps_per_s, t1.steps_per_s[1:]))  # made monotone
    t2 = load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=SMALL, home=tmp_path)
    assert len(calls) == 1 and t2 == t1  # second load: from the cache
    files = list((tmp_path / "profiles").glob("tiny-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["weights_hash"] == "aaa"
    load_or_profile(tiny_decoder, weights_hash="bbb", name="tiny", config=SMALL, home=tmp_path)
    assert len(calls) == 2  # another model: profiled again, in its own file
    assert len(list((tmp_path / "profiles").glob("tiny-*.json"))) == 2
    load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=replace(SMALL, context_len=16), home=tmp_path)
    assert len(calls) == 3  # another grid / context: another key
    files[0].write_text("{not json")
    load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=SMALL, home=tmp_path)
    assert len(calls) == 4  # unreadable cache: measured again
    load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=SMALL, home=tmp_path, refresh=True)
    assert len(calls) == 5
    # Draftsmith's CPU kernels rebuilt from a changed source: their speeds are new, so is the profile
    monkeypatch.setattr(tiny_decoder, "linear_backend", "kernels", raising=False)
    for build in ("build-a", "build-a", "build-b"):
        monkeypatch.setattr(profile_mod, "cpu_kernels", lambda b=build: KernelStatus(True, True, "", "avx2", b))
        load_or_profile(tiny_decoder, weights_hash="aaa", name="tiny", config=SMALL, home=tmp_path)
    assert len(calls) == 7  # build-a once, from its cache the second time, build-b again


def test_make_policy_registers_the_new_policies(tiny_model_dir, tmp_path, monkeypatch):
    assert isinstance(make_policy("threshold", 4), ConfidenceThreshold) and make_policy("threshold", 4).max_k == 4
    assert make_policy("batch-schedule", 6).schedule == default_schedule(6)
    with pytest.raises(DraftsmithError, match="needs the target"):
        make_policy("prefix-scheduler", 4)
    with pytest.raises(DraftsmithError, match="unknown draft-length policy"):
        make_policy("nope", 4)
    from draftsmith.models.target import load_target

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    target = load_target(str(tiny_model_dir("llama", seed=0)))
    pol = make_policy("prefix-scheduler", 2, target=target, max_batch=2)
    assert isinstance(pol, PrefixScheduler) and pol.max_k == 2 and pol.sps.max_tokens == 6
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    # settings in the spec: typed, checked, passed to the scheduler (the profile is reused)
    pol = make_policy("prefix-scheduler:min_gain=0.05,padded_search=columns,adapt=false,probe_every=0", 2,
                      target=target, max_batch=2)
    assert (pol.min_gain, pol.padded_search, pol.adapt, pol.probe_every) == (0.05, "columns", False, 0)
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_auto_is_the_default_scheduler_with_a_drafter_and_fixed_without(tiny_model_dir, tmp_path, monkeypatch):
    """The default policy: the prefix scheduler when a drafter drafts; plain decoding gets FixedK
    and profiles nothing."""
    from draftsmith.api import LLM
    from draftsmith.policy.fixed import FixedK

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    tiny = str(tiny_model_dir("llama", seed=0))
    plain = LLM(tiny, max_batch=2, max_len=64)
    assert isinstance(plain.policy, FixedK) and not (tmp_path / "profiles").exists()
    spec = LLM(plain.target, drafter="ngram", num_speculative_tokens=3, max_batch=2, max_len=64)
    assert isinstance(spec.policy, PrefixScheduler) and spec.policy.max_k == 3
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1
    assert isinstance(LLM(plain.target, drafter="ngram", policy="fixed", max_batch=2, max_len=64).policy, FixedK)


@pytest.mark.parametrize("spec, message", [
    ("fixed:k=3", "takes no settings"),
    ("prefix-scheduler:nope=1", "has no setting 'nope'; settings: min_gain"),
    ("prefix-scheduler:min_gain", "expected prefix-scheduler:KEY=VALUE"),
    ("prefix-scheduler:min_gain=", "expected prefix-scheduler:KEY=VALUE"),
    ("prefix-scheduler:min_gain=a lot", "'min_gain' must be a number, got 'a lot'"),
    ("prefix-scheduler:adapt=1", "'adapt' must be true or false"),
    ("prefix-scheduler:probe_every=2.5", "'probe_every' must be an integer"),
    ("prefix-scheduler:padded_search=best", "must be one of columns, early-stop, got 'best'"),
    ("prefix-scheduler:min_gain=0.1,min_gain=0.2", "sets 'min_gain' twice"),
    ("prefix-schedular:min_gain=0.1", "did you mean 'prefix-scheduler'"),
    ("prefix-scheduler:min_gain=1.5", "min_gain must be in [0, 1), got 1.5"),  # the scheduler's own check, early
    ("prefix-scheduler:probe_every=-1", "probe_every, probe_verifies and cheap_draft must be >= 0"),
    ("prefix-scheduler:probe_verifies=-1", "probe_every, probe_verifies and cheap_draft must be >= 0"),
    ("prefix-scheduler:probe_ceiling=0", "probe_ceiling must be in (0, 1]"),
    ("prefix-scheduler:probe_ceiling=1.5", "probe_ceiling must be in (0, 1]"),
    ("prefix-scheduler:choose_plan=mean", "'choose_plan' must be one of best-prefix, columns, replay, got 'mean'"),
])
def test_policy_spec_errors_say_what_is_wrong(spec, message):
    with pytest.raises(DraftsmithError, match=re.escape(message)):
        parse_policy_spec(spec)


def test_policy_spec_on_the_command_line(capsys):
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--policy", "prefix-scheduler:min_gain=lots", "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --policy" in err and "'min_gain' must be a number, got 'lots'" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- in the engine


class _ConfidentNgram(NgramDrafter):
    """n-gram drafts plus made-up confidences (c_k = 0.9, 0.5 alternating) to drive trim()."""

    def propose(self, seqs, max_lengths):
        p = super().propose(seqs, max_lengths)
        conf = torch.where(torch.arange(p.max_len) % 2 == 0, 0.9, 0.5).expand(p.batch_size, -1)
        return replace(p, confidences=conf.contiguous())


PROMPTS = ["hello world, hello world, hello", "abcabcabcabc", "def f(x):\n    return x + 1\n"]


def test_engine_greedy_output_unchanged_by_policies(tiny_model_dir):
    tiny = str(tiny_model_dir("llama", seed=0))
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    plain = [o.token_ids for o in LLM(tiny, drafter="none", max_batch=4, max_len=128).generate(PROMPTS, greedy)]
    cheap = sps_from_times((1, 4, 24), (1.0, 1.05, 1.3))  # verifying is nearly free: speculate
    runs = [(NgramDrafter(), PrefixScheduler(cheap, max_k=4)),  # running-acceptance path
            (NgramDrafter(), BatchSizeSchedule(((2, 4), (3, 2)))),
            (_ConfidentNgram(), PrefixScheduler(cheap, max_k=4)),  # drafter-confidence path
            (_ConfidentNgram(), ConfidenceThreshold(threshold=0.3, max_k=4))]
    for drafter, pol in runs:
        llm = LLM(tiny, drafter=drafter, policy=pol, max_batch=4, max_len=128)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == plain, pol.name
        assert llm.last_stats.draft_proposed > 0, pol.name

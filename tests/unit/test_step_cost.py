"""The prefix scheduler's online cost model (policy/cost.py) and what it changes in choose():
measured drift per forward size, the drafter's time per round, the minimum predicted gain."""

from __future__ import annotations

from dataclasses import replace

import pytest

import torch

from draftsmith import DraftsmithError, SamplingParams
from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.core.request import StepInfo
from draftsmith.core.request import Request
from draftsmith.policy.acceptance import AcceptancePool, AcceptancePrior, running_confidences
from draftsmith.policy.cost import StepCost
from draftsmith.policy.prefix_scheduler import PrefixScheduler, plan_best_prefix
from draftsmith.policy.profile import SPSTable

# Profiled step times: 1.0 s for 1..2 tokens, +0.1 s per token above (a GPU-like curve).
PROFILE = SPSTable.from_step_times((1, 2, 4, 8, 16), (1.0, 1.0, 1.2, 1.6, 2.4))


def info(rows, width, forward_s, draft_s=0.0, drafted=False, accepted=None) -> StepInfo:
    return StepInfo(rows=rows, block_len=width, useful_tokens=rows * width, drafted=drafted,
                    draft_s=draft_s, forward_s=forward_s, accepted=accepted)


def seqs(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(), None) for i in range(n)]


def test_no_measurements_means_the_profile():
    cost = StepCost(PROFILE)
    for b in (1, 3, 8, 20):
        assert cost.target_time(b) == pytest.approx(PROFILE.step_time(b))
        assert cost.sps(b) == pytest.approx(PROFILE(b))
    assert cost.correction(5) == 1.0 and cost.draft_time(4) == 0.0


def test_correction_needs_min_samples_then_tracks_per_size_and_interpolates():
    # every size on its own (no machine factor); alpha 1: the last measurement
    cost = StepCost(PROFILE, alpha=1.0, min_samples=2, machine_alpha=0.0)
    cost.observe(info(2, 1, forward_s=2.0))  # B=2 measured at 2x the profile
    assert cost.correction(2) == 1.0  # one sample is not enough
    cost.observe(info(2, 1, forward_s=2.0))
    assert cost.correction(2) == pytest.approx(2.0)
    assert cost.correction(16) == pytest.approx(2.0)  # outside measured sizes: the nearest
    for _ in range(2):
        cost.observe(info(2, 4, forward_s=1.6))  # B=8 measured exactly as profiled
    assert cost.correction(8) == pytest.approx(1.0)
    assert cost.correction(5) == pytest.approx(2.0 + (1.0 - 2.0) * 3 / 6)  # linear in B
    assert cost.target_time(8) == pytest.approx(1.6)
    assert cost.target_time(2) == pytest.approx(2.0)


def test_moving_average_follows_drift():
    cost = StepCost(PROFILE, alpha=0.5, min_samples=1, machine_alpha=0.0)
    cost.observe(info(1, 1, forward_s=1.0))
    cost.observe(info(1, 1, forward_s=3.0))
    assert cost.correction(1) == pytest.approx(2.0)  # 1 + 0.5 * (3 - 1)
    # With the machine factor, a round that follows another size moves both averages by their
    # share of the same residual, in logarithms: 3x what was predicted moves the machine 3 ** 0.5
    # and the shape 3 ** 0.25; a round of the same size again moves the machine alone
    cost = StepCost(PROFILE, min_samples=1, machine_alpha=0.5, shape_alpha=0.25)
    cost.observe(info(1, 1, forward_s=1.0))
    cost.observe(info(2, 1, forward_s=1.0))  # B = 2 as profiled
    cost.observe(info(1, 1, forward_s=3.0))
    assert cost.machine() == pytest.approx(3 ** 0.5) and cost.shape(1) == pytest.approx(3 ** 0.25)
    assert cost.correction(1) == pytest.approx(3 ** 0.75)
    cost.observe(info(1, 1, forward_s=3.0))  # what is left of the residual: 3 ** 0.25, half of it
    assert cost.machine() == pytest.approx(3 ** 0.625) and cost.shape(1) == pytest.approx(3 ** 0.25)


def test_a_size_running_alone_keeps_its_shape_against_the_others_whatever_the_noise():
    """Two sizes learnt side by side, then one runs alone for 600 rounds with slow spikes (a busy
    VM: every fifth round 2.5x slower): the prediction of the size that stopped running against
    the one that runs stays where it was. Updated one after the other in plain ratios (the model
    before stop 59), every spike left the running size's shape lower, and the ratio drifted until
    8 tokens were predicted cheaper than 4 (BENCHMARKS.md, stop 59, 4 rows on a 2-core Zen 3)."""
    cost = StepCost(CPU)
    for _ in range(20):
        cost.observe(info(4, 1, forward_s=1.2))  # B = 4 (4 rows, plain) as profiled
        cost.observe(info(4, 2, forward_s=1.4))  # B = 8 (one draft each) as profiled
    before = cost.target_time(8) / cost.target_time(4)
    for i in range(600):
        cost.observe(info(4, 2, forward_s=1.4 * (2.5 if i % 5 == 0 else 1.0)))
    assert cost.target_time(8) / cost.target_time(4) == pytest.approx(before, rel=0.01)
    assert before == pytest.approx(1.4 / 1.2, rel=0.01)
    # the two sizes in turn with the same spikes (every fifth round: each size gets them): every round
    # is a contrast, the shapes learn, and the spikes, which pass, leave the ratio within a few percent
    for i in range(600):
        b, t = (4, 1.2) if i % 2 == 0 else (8, 1.4)
        cost.observe(info(4, b // 4, forward_s=t * (2.5 if i % 5 == 0 else 1.0)))
    assert cost.target_time(8) / cost.target_time(4) == pytest.approx(before, rel=0.05)


def test_drafting_time_is_learned_per_row_count_only_from_rounds_that_drafted():
    cost = StepCost(PROFILE, alpha=1.0)
    cost.observe(info(4, 1, forward_s=1.2, draft_s=0.7, drafted=False))  # did not draft
    assert cost.draft_time(4) == 0.0
    cost.observe(info(4, 6, forward_s=2.0, draft_s=0.5, drafted=True))
    cost.observe(info(1, 6, forward_s=1.0, draft_s=0.2, drafted=True))
    assert cost.draft_time(4) == pytest.approx(0.5) and cost.draft_time(1) == pytest.approx(0.2)
    assert cost.draft_time(3) == pytest.approx(0.5)  # nearest measured row count
    assert cost.draft_time(2) == pytest.approx(0.2)  # tie 1 vs 3 away: 1 is nearer


def test_one_inflated_first_timing_does_not_stop_drafting_for_good():
    """A drafter's first round can carry a one-time cost (a weight layout, page faults, a
    compile) many times its real drafting time. Timings start from the smallest of their first
    min_samples measurements, so the next measured round (a probe) corrects it at once; a plain
    moving average would keep believing drafting dear (here 5.0 -> 4.51 s) and never draft."""
    pol = PrefixScheduler(PROFILE, max_k=1, min_gain=0.0)
    pol.observe(info(1, 2, forward_s=1.0, draft_s=5.0, drafted=True))  # first round: one-time cost
    assert pol.cost.draft_time(1) == pytest.approx(5.0)
    assert pol.choose(seqs(1)) == [0]  # believed: drafting costs 5 plain steps
    pol.observe(info(1, 2, forward_s=1.0, draft_s=0.1, drafted=True))  # the next (probe) round
    assert pol.cost.draft_time(1) == pytest.approx(0.1)
    assert pol.choose(seqs(1)) == [1]  # (1 + 0.5) / (1.0 + 0.1) pays again
    # Past warm-up the estimate is the moving average: a later slow round moves it, not resets it.
    for _ in range(pol.cost.min_samples):
        pol.observe(info(1, 2, forward_s=1.0, draft_s=0.1, drafted=True))
    pol.observe(info(1, 2, forward_s=1.0, draft_s=1.1, drafted=True))
    assert pol.cost.draft_time(1) == pytest.approx(0.1 + pol.cost.alpha * 1.0)
    # The forward-time correction starts from its smallest warm-up sample too.
    cost = StepCost(PROFILE, alpha=0.5, min_samples=2, machine_alpha=0.0)
    cost.observe(info(1, 1, forward_s=9.0))
    cost.observe(info(1, 1, forward_s=2.0))
    assert cost.correction(1) == pytest.approx(2.0)
    cost.observe(info(1, 1, forward_s=4.0))
    assert cost.correction(1) == pytest.approx(3.0)


def test_bad_settings_are_refused():
    with pytest.raises(DraftsmithError, match="alpha"):
        StepCost(PROFILE, alpha=0.0)
    with pytest.raises(DraftsmithError, match="min_gain"):
        PrefixScheduler(PROFILE, min_gain=1.5)


def test_plan_gain_accounts_for_drafting_time():
    conf = [[0.9, 0.9, 0.9]]  # one row, a = 0.9, 0.81, 0.729
    step = PROFILE.step_time
    ell, gain = plan_best_prefix(conf, step)
    # Free drafting: 4 tokens verified in 1.2 s vs 1 token in 1.0 s -> (1 + 2.439) / 1.2.
    assert ell == [3] and gain == pytest.approx((1 + 0.9 + 0.81 + 0.729) / 1.2)
    ell, gain = plan_best_prefix(conf, step, draft_time=3.0)  # drafting dearer than it gains
    assert ell == [0] and gain == pytest.approx(1.0)


def test_choose_drafts_only_above_the_minimum_predicted_gain():
    # 1 row, verifying 1 draft costs 1.0 s like plain: gain = 1 + a_1 with free drafting.
    pol = PrefixScheduler(PROFILE, max_k=1, min_gain=0.0)
    assert pol.choose(seqs(1)) == [1]  # prior acceptance 0.5: predicted 1.5x
    # Measured drafting of 0.6 s per round: (1 + 0.5) / (1.0 + 0.6) < 1 -> do not draft.
    for _ in range(4):
        pol.observe(info(1, 2, forward_s=1.0, draft_s=0.6, drafted=True))
    assert pol.choose(seqs(1)) == [0]
    # The same measurement with adapt=False is ignored (profile only).
    static = PrefixScheduler(PROFILE, max_k=1, min_gain=0.0, adapt=False)
    for _ in range(4):
        static.observe(info(1, 2, forward_s=1.0, draft_s=0.6, drafted=True))
    assert static.choose(seqs(1)) == [1]
    # A gain below min_gain is not worth it: 0.45 s drafting -> 1.5 / 1.45 = 1.034x.
    near = PrefixScheduler(PROFILE, max_k=1, min_gain=0.05)
    for _ in range(4):
        near.observe(info(1, 2, forward_s=1.0, draft_s=0.45, drafted=True))
    assert near.choose(seqs(1)) == [0]
    assert PrefixScheduler(PROFILE, max_k=1, min_gain=0.0, cost=near.cost).choose(seqs(1)) == [1]


def test_measured_drift_changes_the_schedule():
    """The profile says a 2-row x 4-wide forward is cheap; measured, it is 3x dearer."""
    pol = PrefixScheduler(PROFILE, max_k=3, min_gain=0.0, running_at="choose")
    assert pol.choose(seqs(2)) != [0, 0]
    for _ in range(pol.cost.min_samples):
        pol.observe(info(2, 1, forward_s=1.0))
        for w in (2, 3, 4):
            pol.observe(info(2, w, forward_s=3.0 * PROFILE.step_time(2 * w)))
    assert pol.choose(seqs(2)) == [0, 0]


def proposal(lengths, K) -> Proposal:
    return Proposal(tokens=torch.zeros(len(lengths), K, dtype=torch.long), lengths=torch.tensor(lengths))


def test_cheap_drafts_are_drafted_for_evidence_but_trim_keeps_only_what_pays():
    # Verifying costs 3x plain (a CPU-like curve): with the 0.5 prior nothing pays.
    dear = SPSTable.from_step_times((1, 2, 4), (1.0, 3.0, 3.2))
    pol = PrefixScheduler(dear, max_k=3)
    ss = seqs(1)
    for _ in range(4):  # drafting measured at 1% of a plain step: cheap
        pol.observe(info(1, 1, forward_s=1.0, draft_s=0.01, drafted=True))
    assert pol.choose(ss) == [3]  # drafted anyway: the drafts get scored
    assert pol.trim(ss, proposal([3], 3)) == [0]  # ... but none is worth verifying
    # The same drafter in "choose" mode is not run at all.
    assert PrefixScheduler(dear, max_k=3, running_at="choose", cost=pol.cost).choose(ss) == [0]


def test_dear_drafters_probe_with_backoff_while_probes_verify_nothing():
    dear = SPSTable.from_step_times((1, 2, 4), (1.0, 3.0, 3.2))
    # (probes trimmed like any round, as before stop 56: the backoff of a probe that verified nothing;
    # probe_ceiling 1: at acceptance 0.9 no round here could pay, so by default no probe is due at all)
    pol = PrefixScheduler(dear, max_k=3, probe_every=4, probe_backoff_max=8, probe_verifies=0, probe_ceiling=1.0)
    for _ in range(4):
        pol.observe(info(1, 4, forward_s=3.2, draft_s=0.5, drafted=True))  # drafting = half a step
    ss = seqs(1)
    nothing = VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))

    def run(n):
        picks = []
        for _ in range(n):
            k = pol.choose(ss)[0]
            picks.append(k)
            kept = pol.trim(ss, proposal([k], max(k, 1))) if k else [0]
            pol.update(ss, proposal(kept, max(kept[0], 0)) if kept[0] else proposal([0], 0), nothing)
        return [i for i, k in enumerate(picks, 1) if k]

    # Probes after 4 rounds that verified nothing, then 8 (backed off: the probe verified nothing), capped at 8.
    assert run(24) == [5, 13, 21]
    # By default (probe_ceiling 0.9): all four tokens at 0.9, 0.81, 0.73 commit 3.44 in 3.2 + 0.5
    # steps (0.93x plain), so a probe due is skipped as if it had not paid (the interval backs off);
    # only at probe_backoff_max does one run whatever the ceiling says. At 0.96 (3.77 tokens, 1.02x)
    # probes are due as before.
    pol = PrefixScheduler(dear, max_k=3, probe_every=4, probe_backoff_max=8, probe_verifies=0, cost=pol.cost)
    assert run(24) == [13, 21]  # skipped at 5 (interval 4 -> 8 = the cap), then every 8
    pol = replace(pol, probe_backoff_max=64)
    assert run(60) == []  # skipped at 5, 13, 29 (intervals 8, 16, 32)
    pol = replace(pol, probe_ceiling=0.96, probe_backoff_max=8)
    assert run(24) == [5, 13, 21]
    never = PrefixScheduler(dear, max_k=3, probe_every=0, cost=pol.cost)
    assert all(never.choose(seqs(1)) == [0] for _ in range(8))


def test_a_probe_is_priced_with_the_rows_backlog_a_cheap_draft_is_not():
    """Stop 61 (BENCHMARKS.md): at 16 rows the few probes of a pass cost ~10% of the decode rate,
    each paying first for its rows' queued prompt features, which the drafting time the cost model
    learns leaves out. The cost model learns a time per backlog position (StepInfo.consumed_s /
    consumed_positions, in machine units); the engine tells the scheduler each round's backlog
    (queued()); a probe that could not pay with it is skipped and backs off. A cheap draft is not
    priced so: it pays its backlog once, then is cheap every round (priced, a backlog that only
    grows while it does not draft would refuse it for good)."""
    dear = SPSTable.from_step_times((1, 2, 4), (1.0, 3.0, 3.2))
    pol = PrefixScheduler(dear, max_k=3, probe_every=4, probe_backoff_max=8, probe_verifies=0, probe_ceiling=0.96)
    assert pol.cost.backlog_time(100, 1) == 0.0  # nothing measured: nothing priced
    for _ in range(4):
        pol.observe(info(1, 4, forward_s=3.2, draft_s=0.5, drafted=True))  # drafting = half a step
    pol.observe(replace(info(1, 4, forward_s=3.2), consumed_s=0.0, consumed_positions=100))  # (the timer's 0: no rate)
    assert pol.cost.backlog_time(100, 1) == 0.0
    pol.observe(replace(info(1, 4, forward_s=3.2, draft_s=0.5, drafted=True), consumed_s=0.2, consumed_positions=100))
    assert pol.cost.backlog_time(100, 1) == pytest.approx(0.2) and pol.cost.backlog_time(0, 1) == 0.0
    assert pol.cost.backlog_time(100, 16) == pytest.approx(0.2)  # the nearest measured row count stands in
    pol.cost.observe(replace(info(16, 1, forward_s=3.2), consumed_s=0.8, consumed_positions=100))  # padded: dearer
    assert pol.cost.backlog_time(100, 16) == pytest.approx(0.8) and pol.cost.backlog_time(100, 2) == pytest.approx(0.2)
    assert pol.cost.summary()["backlog_s_per_position"] == {1: pytest.approx(0.002), 16: pytest.approx(0.008)}
    # one row whose request has 4 tokens left: about one round at the ceiling, which pays the whole
    # backlog, as any round of the stop-61 case (16 rows) does (a longer single request shares it:
    # test_a_probe_shares_its_backlog_over_the_rounds_its_requests_have_left)
    ss = [Request("r0", [1, 2, 3], SamplingParams(max_tokens=4), None)]
    nothing = VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))

    def run(sched, n, queued):
        picks = []
        for _ in range(n):
            if queued is not None:  # (None: the engine tells nothing)
                sched.queued(queued)
            k = sched.choose(ss)[0]
            picks.append(k)
            kept = sched.trim(ss, proposal([k], max(k, 1))) if k else [0]
            sched.update(ss, proposal(kept, max(kept[0], 0)) if kept[0] else proposal([0], 0), nothing)
        return [i for i, k in enumerate(picks, 1) if k]

    # At 0.96 all four tokens commit 3.77 in 3.2 + 0.5 steps (1.02x plain): probes are due. A backlog
    # of 20 positions (0.04 steps) leaves 1.007x; one of 200 (0.4 steps) 0.92x: skipped as if it had not
    # paid, until the interval reaches probe_backoff_max (8 here), where a probe runs whatever it costs.
    assert run(replace(pol), 24, queued=20) == [5, 13, 21]
    assert run(replace(pol), 24, queued=200) == [13, 21]
    assert run(replace(pol, probe_backoff_max=64), 60, queued=200) == []
    # What the engine told is used by one choose() and forgotten: a round told nothing has no backlog.
    told = replace(pol)
    for _ in range(4):  # told before each of the first 4 rounds only: the probe due at round 5 is not skipped
        told.queued(200)
        assert told.choose(ss) == [0]
        told.update(ss, proposal([0], 0), nothing)
    assert told.choose(ss) == [3]
    # A cheap drafter drafts anyway (evidence for free), its rows' backlog whatever it is.
    cheap = PrefixScheduler(dear, max_k=3, probe_every=0)
    for _ in range(4):
        cheap.observe(info(1, 1, forward_s=1.0, draft_s=0.01, drafted=True))
    cheap.observe(replace(info(1, 1, forward_s=1.0), consumed_s=0.1, consumed_positions=100))
    cheap.queued(1000)  # 1 s: a plain step's worth
    assert cheap.choose(ss) == [3]


def test_a_probe_shares_its_backlog_over_the_rounds_its_requests_have_left():
    """Stop 64 (BENCHMARKS.md, the Qwen2.5-Coder pair): a draft model that costs 1.4 plain steps a
    round of 5 drafts, whose request's prompt it never consumed (150 positions at 0.03 steps: 4.5
    steps), was never probed at batch 1 under the 0.5 prior: priced whole, the prompt made even the
    ceiling's round a loss, and every probe was skipped until the interval reached its maximum (tau
    1.00 on 5 of 6 prompts). A probe that pays leads to drafting for the rest of the request, which
    consumes the backlog once: it is spread over the rounds the shortest request has left at the
    ceiling's tokens a round, so a long request probes and a request about to end does not; several
    rows keep it whole."""
    flat = SPSTable.from_step_times((1, 2, 4, 8), (1.0, 1.0, 1.0, 1.0))
    pol = PrefixScheduler(flat, max_k=5, probe_every=4, probe_backoff_max=64, probe_verifies=0, probe_ceiling=0.9)
    for _ in range(4):
        pol.observe(info(1, 6, forward_s=1.0, draft_s=1.4, drafted=True))  # a dear round of 5 drafts
    pol.observe(replace(info(1, 6, forward_s=1.0, draft_s=1.4, drafted=True), consumed_s=3.0, consumed_positions=100))
    assert pol.cost.backlog_time(150, 1) == pytest.approx(4.5)
    nothing = VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))

    def probes(max_tokens: int, rounds: int = 12) -> list[int]:
        sched = replace(pol)
        ss = [Request("r0", [1, 2, 3], SamplingParams(max_tokens=max_tokens), None)]
        picks = []
        for _ in range(rounds):
            sched.queued(150)
            k = sched.choose(ss)[0]
            picks.append(k)
            sched.update(ss, proposal([0], 0), nothing)
        return [i for i, k in enumerate(picks, 1) if k]

    # With the 0.5 prior no round pays (tau 1.97 in 2.4 steps), so only probes draft. 512 tokens left:
    # ~109 rounds at 4.69 tokens share 4.5 steps (0.04 a round): the ceiling's round pays, the probe
    # due at round 5 runs (its drafts verified nothing here: the interval backs off to 8, round 13).
    assert probes(512) == [5]
    # 8 tokens left: one or two rounds share it, the ceiling's round loses (4.69 tokens in ~5 steps):
    # skipped as if it had not paid (4 -> 8), as the whole backlog was priced before at any length.
    assert probes(8) == []
    assert probes(8, rounds=40) == []
    assert probes(128) == [5]  # the default request length (27 rounds: 0.17 steps a round)
    # Two rows keep their backlog whole (padded, ending at different rounds: stop 61's 16-row case).
    two = replace(pol)
    rows = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=512), None) for i in range(2)]
    none = VerifyResult(torch.zeros(2, 1, dtype=torch.long), torch.tensor([0, 0]))
    for _ in range(12):
        two.queued(300)
        assert two.choose(rows) == [0, 0]
        two.update(rows, proposal([0, 0], 0), none)


def test_a_probe_verifies_a_draft_whatever_a_stale_cost_model_says():
    """Stop 56 (BENCHMARKS.md): at batch 1 drafting stopped after ~40 of 128 requests and never
    came back, though it paid 1.13x while it ran. A cost model that believes verify forwards dear
    (here: a slow stretch measured them at 3x the profile) stops drafting; its probes, trimmed by
    the same estimates, verified nothing, measured nothing and backed off to probe_backoff_max.
    A probe now verifies one draft per row: its forward and acceptance are measured, and once the
    machine is back to its profile the scheduler drafts again. DSpark-like: confidences with the
    drafts, the column search (draft_gate) deciding what is drafted."""
    ss = seqs(1)

    def serve(pol, rounds, slow):
        verified = []  # drafts verified per round
        for _ in range(rounds):
            k = pol.choose(ss)[0]
            gate = pol.draft_gate(ss, [k]) if k else None
            n = 0
            if gate is not None:  # the drafter asks column by column (confidence 0.9 each)
                while n < k and gate.open_next([0.9]):
                    n += 1
            drafted = Proposal(tokens=torch.zeros(1, max(n, 1), dtype=torch.long), lengths=torch.tensor([n]),
                               confidences=torch.full((1, max(n, 1)), 0.9))
            kept = pol.trim(ss, drafted)[0] if n else 0
            assert kept == n  # the gate's search and trim's agree
            result = VerifyResult(torch.zeros(1, kept + 1, dtype=torch.long), torch.tensor([kept]))  # all accepted
            pol.update(ss, drafted.truncated([kept]) if kept else Proposal(torch.zeros(1, 1, dtype=torch.long),
                                                                           torch.tensor([0])), result)
            w = 1 + kept
            pol.observe(info(1, w, forward_s=CPU.step_time(w) * (3.0 if slow and w > 1 else 1.0),
                             draft_s=0.02 * n, drafted=bool(n), accepted=kept if kept else None))
            verified.append(kept)
        return verified

    for probe_verifies, recovers in ((0, False), (1, True)):
        pol = PrefixScheduler(CPU, max_k=3, probe_every=4, probe_backoff_max=64, probe_verifies=probe_verifies)
        for _ in range(80):  # a long stretch in which verify forwards took 3x their profiled time
            pol.observe(info(1, 1, forward_s=CPU.step_time(1)))
            pol.observe(info(1, 4, forward_s=3 * CPU.step_time(4), draft_s=0.06, drafted=True, accepted=0))
        assert pol.cost.target_time(4) > 2.5 * CPU.step_time(4)
        assert sum(map(bool, serve(pol, 40, slow=True))) <= 5  # drafting (nearly) off: verification looks dear
        back = serve(pol, 200, slow=False)  # the machine is back to its profile
        if recovers:  # the probes measured it: they verify every 5th round, then drafting is back at full width
            assert sum(map(bool, back)) >= 35 and back[-50:].count(3) >= 9
        else:  # never again: every probe verified nothing, and backed off
            assert not any(back) and pol._interval >= 32


def test_a_probe_that_could_not_draft_stays_due_and_one_without_evidence_keeps_its_interval():
    """A probe whose rows had nothing to draft (no room left, grammar-forced rows) is still due next
    round, without backing off; a probe whose round reports no acceptance (a grammar-forced row in
    the batch: StepInfo.accepted None) is no evidence either way: the interval stays."""
    dear = SPSTable.from_step_times((1, 2, 4), (1.0, 3.0, 3.2))
    # (probe_ceiling 1: only all-accepted drafts could pay here, so by default no probe would be due)
    pol = PrefixScheduler(dear, max_k=3, probe_every=2, probe_backoff_max=64, probe_ceiling=1.0)
    for _ in range(4):
        pol.observe(info(1, 4, forward_s=3.2, draft_s=0.5, drafted=True))  # drafting dear: no plan drafts
    ss, nothing = seqs(1), VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))
    empty = Proposal(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))
    picks = []
    for _ in range(3):
        picks.append(pol.choose(ss)[0])
        pol.update(ss, empty, nothing)
    assert picks == [0, 0, 3] and pol._interval == 2
    assert pol.choose(ss) == [3]  # the probe drafted nothing: due again at once, interval kept
    one = VerifyResult(torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]))
    pol.update(ss, proposal([1], 1), one)
    pol.observe(info(1, 2, forward_s=9.0, draft_s=0.5, drafted=True, accepted=None))  # slow, but no acceptance
    assert pol._interval == 2 and not pol._probing
    pol.choose(ss)
    pol.update(ss, empty, nothing)
    pol.choose(ss)
    pol.update(ss, empty, nothing)
    assert pol.choose(ss) == [3]  # a probe after 2 rounds that verified nothing
    pol.update(ss, proposal([1], 1), one)
    pol.observe(info(1, 2, forward_s=9.0, draft_s=0.5, drafted=True, accepted=0))  # lost: back off
    assert pol._interval == 4
    for _ in range(4):
        pol.choose(ss)
        pol.update(ss, empty, nothing)
    assert pol.choose(ss) == [3]  # a probe whose drafts all have confidence 0: drafted, verified nothing
    zero = Proposal(torch.zeros(1, 3, dtype=torch.long), torch.tensor([3]), confidences=torch.zeros(1, 3))
    assert pol.trim(ss, zero) == [0]
    pol.update(ss, empty, nothing)
    assert pol._interval == 8  # wasted: back off (it is not "could not draft")


def test_pooled_prior_moves_a_new_request_towards_the_servers_acceptance():
    pool = AcceptancePool(min_weight=2.0)
    prior = AcceptancePrior()
    fresh = seqs(1)[0]
    assert running_confidences(fresh, 2, prior, pool) == pytest.approx([prior.mean] * 2)
    for _ in range(10):
        pool.add(reached=2, accepted=2)  # this drafter is nearly always right here
    c = running_confidences(fresh, 3, prior, pool)
    assert c[0] == pytest.approx(0.99) and c[1] == pytest.approx(0.99)  # clamped pooled mean
    assert c[2] == pytest.approx(prior.mean)  # position 3 never reached: the fixed prior
    pool.add(reached=1, accepted=0)
    assert pool.mean(0, 0.5) == pytest.approx(pool.accepted[0] / pool.reached[0]) and pool.mean(0, 0.5) < 0.99


def test_realized_gain_of_drafting_rounds_per_row_count():
    cost = StepCost(PROFILE, alpha=1.0, min_samples=2)
    cost.observe(info(1, 2, forward_s=1.0, draft_s=0.2, drafted=True, accepted=1))
    assert cost.realized_gain(1) is None  # one round is not enough
    cost.observe(info(1, 2, forward_s=1.0, draft_s=0.2, drafted=True, accepted=1))
    # 2 tokens in 1.2 s against plain's 1 token per 1.0 s (profile at B = 1)
    assert cost.realized_gain(1) == pytest.approx(2 / 1.2)
    for _ in range(2):  # 4 rows, 2 drafts accepted in all, 2.5 s (a forward as profiled): plain takes 1.2 s
        cost.observe(info(4, 3, forward_s=2.0, draft_s=0.5, drafted=True, accepted=2))
    assert cost.correction(4) == pytest.approx(1.0)
    assert cost.realized_gain(4) == pytest.approx(6 * 1.2 / (4 * 2.5))
    assert cost.realized_gain(3) == pytest.approx(cost.realized_gain(4))  # nearest row count
    cost.observe(info(2, 1, forward_s=1.0, drafted=False, accepted=0))  # plain rounds do not count
    cost.observe(info(2, 3, forward_s=1.0, drafted=True))  # nor rounds that report no acceptance
    assert set(cost.summary()["realized_gain"]) == {1, 4}


def test_predictions_are_scaled_by_what_drafting_rounds_realized():
    assert PrefixScheduler(PROFILE).realized_check is False  # an option: measured, it did not pay
    pol = PrefixScheduler(PROFILE, max_k=1, min_gain=0.0, probe_every=0, realized_check=True)
    ss = seqs(1)
    # prior acceptance 0.5, free drafting: predicted (1 + 0.5) / 1.0 = 1.5x
    for _ in range(pol.cost.min_samples):  # measured: nothing accepted, 1.1 s per round
        assert pol.choose(ss) == [1]
        pol.observe(info(1, 2, forward_s=1.0, draft_s=0.1, drafted=True, accepted=0))
    assert pol.cost.realized_gain(1) == pytest.approx(1 / 1.1)
    # realized / predicted, averaged over the rounds (their predictions counted 0.1 s of drafting
    # from the second round on): well below 1, and the corrected gain does not pay
    assert pol.cost.calibration(1) < 0.7
    assert pol.choose(ss) == [0]
    unchecked = PrefixScheduler(PROFILE, max_k=1, min_gain=0.0, probe_every=0, realized_check=False, cost=pol.cost)
    assert unchecked.choose(ss) == [1]  # the prediction alone still says 1.36x
    # rounds that realize more than predicted (probes, another scheduler sharing the cost model)
    # raise it again; only rounds drafted on a prediction are counted
    for _ in range(30):
        unchecked.choose(ss)
        pol._predicted = 1.36  # as choose() records it when it drafts on a prediction
        pol.observe(info(1, 2, forward_s=1.0, draft_s=0.1, drafted=True, accepted=1))
    assert pol.cost.calibration(1) > 1.0 and pol.choose(ss) == [1]
    pol.observe(info(1, 1, forward_s=1.0))  # a plain round after a drafting choice: not a sample
    assert set(pol.cost.summary()["calibration"]) == {1}


def test_a_probe_that_verifies_but_does_not_pay_backs_off_too():
    dear = SPSTable.from_step_times((1, 2, 4), (1.0, 3.0, 3.2))
    # (probe_ceiling 1: only all-accepted drafts could pay here, so by default no probe would be due)
    pol = PrefixScheduler(dear, max_k=3, probe_every=4, probe_backoff_max=16, probe_ceiling=1.0)
    for _ in range(4):
        pol.observe(info(1, 4, forward_s=3.2, draft_s=0.5, drafted=True))  # drafting = half a step
    ss = seqs(1)
    one = VerifyResult(torch.zeros(1, 2, dtype=torch.long), torch.tensor([1]))

    def run(n, accepted):
        picks = []
        for _ in range(n):
            k = pol.choose(ss)[0]
            picks.append(k)
            if k:  # the probe verifies one draft; the round takes 2.0 s for 1 + accepted tokens
                pol.update(ss, proposal([1], 1), one)
                pol.observe(info(1, 2, forward_s=1.5, draft_s=0.5, drafted=True, accepted=accepted))
            else:
                pol.update(ss, proposal([0], 0), VerifyResult(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0])))
                pol.observe(info(1, 1, forward_s=1.0))
        return [i for i, k in enumerate(picks, 1) if k]

    # 2 tokens in 2.0 s = plain's rate: break-even is not a loss, the interval stays at 4 rounds that
    # verified nothing
    assert run(12, accepted=1) == [5, 10]
    # 1 token in 2.0 s: the probes verified a draft but lost; probe after 8, then 16 rounds (the first
    # here 2 rounds in: the two rounds after the last probe of the run above count)
    assert run(32, accepted=0) == [3, 12, 29]


def test_can_gain_padded_shortcut_matches_every_draft_count():
    """Padded: a verify width costs the same however full its column, so only full columns can
    win; the shortcut must agree with trying every number of admitted drafts."""
    import random

    from draftsmith.policy.prefix_scheduler import can_gain

    rng = random.Random(0)
    for _ in range(200):
        xs = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        times, t = [], 1.0
        for _ in xs:
            t *= 1.0 + rng.random() * rng.choice((0.05, 0.5, 1.5))
            times.append(t)
        sps = SPSTable.from_step_times(xs, times)
        R, k = rng.randint(1, 32), rng.randint(1, 7)
        brute = any((R + n) * sps(R * (1 + -(-n // R))) > R * sps(R) for n in range(1, R * k + 1))
        assert can_gain(R, k, sps, "padded") == brute


# A CPU-like curve: a wider forward costs a little more than one token's.
CPU = SPSTable.from_step_times((1, 2, 4, 8), (1.0, 1.1, 1.2, 1.4))


def slow_stretch(pol: PrefixScheduler) -> None:
    """Plain and drafting rounds as profiled, then 10 drafting rounds on a machine twice as slow
    (another tenant's load), then 8 plain rounds as profiled again (the load has gone)."""
    for _ in range(4):
        pol.observe(info(1, 1, forward_s=1.0))
        pol.observe(info(1, 4, forward_s=1.2, draft_s=0.2, drafted=True))
    for _ in range(10):
        pol.observe(info(1, 4, forward_s=2.4, draft_s=0.4, drafted=True))
    for _ in range(8):
        pol.observe(info(1, 1, forward_s=1.0))


def test_speculation_comes_back_after_a_slow_stretch():
    """The machine factor: a stretch of load measured on drafting rounds is the machine's speed,
    which the plain rounds after it correct; with one average per size (machine_alpha 0), it
    stays in the drafting sizes' averages and the drafter's time, so the prediction keeps
    saying "do not draft" after the load has gone (here for good: no probes)."""
    new = PrefixScheduler(CPU, max_k=3, probe_every=0)
    old = PrefixScheduler(CPU, max_k=3, probe_every=0, cost=StepCost(CPU, machine_alpha=0.0))
    for pol in (new, old):
        assert pol.choose(seqs(1)) == [3]  # prior 0.5, 0.2 s drafting: (1 + 0.875) / 1.4 = 1.34x
        slow_stretch(pol)
    assert new.choose(seqs(1)) == [3] and old.choose(seqs(1)) == [0]
    # what the scheduler believes after the stretch: back where it was, against stuck inflated
    # (a few percent of the stretch stays between the sizes: the first plain round after it follows a
    # 4-token one, a contrast, and the 1-token shape takes shape_alpha of that round's residual)
    assert new.cost.machine() == pytest.approx(1.0, rel=0.05)
    assert new.cost.target_time(1) == pytest.approx(1.0, rel=0.01)
    assert 1.2 < new.cost.target_time(4) < 1.3 and 0.2 < new.cost.draft_time(1) < 0.22
    assert old.cost.target_time(4) > 1.9 and old.cost.draft_time(1) > 0.3
    assert old.cost.target_time(1) == pytest.approx(1.0)


def test_a_uniformly_slower_machine_moves_no_decision():
    """Every forward and the drafter twice as slow as profiled: the machine factor is 2 and
    the shapes and the drafting time are what they were, so the same plan."""
    fast, slow = PrefixScheduler(CPU, max_k=3, probe_every=0), PrefixScheduler(CPU, max_k=3, probe_every=0)
    for f in (1.0, 2.0):
        pol = fast if f == 1.0 else slow
        for _ in range(6):
            pol.observe(info(1, 1, forward_s=f * 1.0))
            pol.observe(info(1, 4, forward_s=f * 1.3, draft_s=f * 0.3, drafted=True))
    assert slow.cost.machine() == pytest.approx(2 * fast.cost.machine())
    for b in (1, 2, 4, 8):
        assert slow.cost.shape(b) == pytest.approx(fast.cost.shape(b))
    assert slow.cost.draft_time(1) == pytest.approx(2 * fast.cost.draft_time(1))
    assert slow.choose(seqs(1)) == fast.choose(seqs(1)) == [3]


def test_a_size_not_yet_measured_moves_its_shape_not_the_machine():
    cost = StepCost(CPU, min_samples=2)
    for _ in range(2):
        cost.observe(info(1, 1, forward_s=1.0))  # B = 1 known: shape 1, machine 1
    cost.observe(info(1, 8, forward_s=2.8))  # B = 8 at twice its profile: its own shape, not load
    assert cost.machine() == pytest.approx(1.0)
    cost.observe(info(1, 8, forward_s=2.8))
    assert cost.shape(8) == pytest.approx(2.0) and cost.target_time(8) == pytest.approx(2.8)
    assert cost.target_time(1) == pytest.approx(1.0)
    # now known, B = 8 informs the machine factor like any known size
    cost.observe(info(1, 8, forward_s=5.6))
    assert cost.machine() > 1.0
    for bad in ({"machine_alpha": 1.5}, {"shape_alpha": 0.0}, {"machine_alpha": 0.96}):  # (0.96 + 0.05 > 1)
        with pytest.raises(DraftsmithError, match=next(iter(bad))):
            StepCost(CPU, **bad)

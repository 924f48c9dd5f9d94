"""DSpark's hardware-aware prefix scheduler (paper Algorithm 1), with its early stop.

Per round, after drafting: request r has drafts with confidences c_{r,1..n_r} and survival
estimates a_{r,j} = prod_{i<=j} c_{r,i} (expected: draft j is accepted). Verifying more
drafts commits more tokens per step but makes the step slower; SPS(B) (policy/profile.py)
says how much slower on this machine. Algorithm 1:

    l_r = 0, tau* = R, B = R, Theta_best = R * SPS(R)
    for (r, j) in all candidates sorted by a_{r,j} descending:
        B' = tokens of the forward if row r verified j drafts;  Theta = (tau* + a_{r,j}) * SPS(B')
        if Theta > Theta_best: l_r = j, tau* += a_{r,j}, B = B', Theta_best = Theta
        else: stop

The early stop is what keeps it lossless. Candidates of one row come in order j = 1, 2, ...
(a is non-increasing in j; ties go to the smaller j), so whether draft j of row r is
verified depends only on candidates ranked above it, whose confidences come from drafts
before j. A search that skipped over a bad candidate to a later good one would let c_{r,j+1}
(a function of draft j) decide whether draft j is verified: biased output (paper appendix A;
tests/unit/test_scheduler_losslessness.py shows it).

B: the paper counts tokens (B = R + sum l_r, a ragged-batch engine: `batch_tokens="packed"`).
Draftsmith's engine pads every row to the longest verify block, so its forward processes
R * (1 + max_r l_r) tokens (`"padded"`, the default): admitting a draft inside the current
width costs nothing, widening the block costs a whole column. Any cost that depends only on
the already-admitted set keeps the argument above intact.

With padded forwards, Algorithm 1's one-candidate-at-a-time order is myopic: the candidate
that would open column j must pay for the whole column alone, and the early stop at it also
refuses the drafts of other rows that would have cost nothing once the column was open (at 4
rows on a 2-core CPU a column costs ~18% of a step: a lone draft must be accepted with
probability > 0.73 to open it, while four drafts at 0.4 each would pay). `admit_columns`
(`padded_search="columns"`, the default; BENCHMARKS.md, "Built-in drafter", measured it at
4, 16 and 32 rows) decides column by column instead: column j opens when the
drafts j of all rows still in play together pay for it, Theta = (tau* + sum_r a_{r,j}) *
SPS(R (1 + j)) > Theta_best, and then every one of them is verified; otherwise stop. It is
lossless by the same argument: whether row r verifies draft j depends on its own a_{r,1..j}
(drafts before j) and on other rows' confidences, never on its own c_{r,j+1} or later; a
row's verification is independent of other rows' drafts. One row: the same as Algorithm 1.

Drafters without confidences (n-gram): c_{r,j} is the request's running conditional
acceptance (policy/acceptance.py), computed from finished rounds only, with a prior that is
this server's pooled acceptance per position. By default (`running_at="trim"`) such a drafter
drafts max_k and the schedule runs after drafting: the engine forwards only the kept drafts,
and every draft is scored against the committed output whether verified or not, so the
estimates keep learning while nothing is verified. (`running_at="choose"` schedules before
drafting instead: nothing is drafted that would not be verified.) Such confidences do not
depend on this round's drafts at all, so the break is not needed for losslessness there,
and the scheduler takes the best prefix of the same sorted order (`running_search=
"best-prefix"`): on a CPU the first extra verify token is the expensive one and later ones
are nearly free, which the early stop cannot see past.

Drafters with confidences (DSpark) draft up to max_k tokens per row and Algorithm 1 with the
early stop trims them (only the forward's cost is weighed). With the column search, a drafter
whose confidence for draft j comes before draft j (DSpark's head reads x_{j-1}) asks the same
search column by column while it drafts (`draft_gate`, `ColumnSearch`) and stops at the first
column that will not open: the verify lengths are the same, the sequential steps after that
column are not paid.

Whether to draft at all is decided in choose(), from what is known before the round: each
request's running acceptance and the cost model of policy/cost.py, which corrects the
profiled SPS(B) online from measured rounds and learns the drafter's time per round (a
trained drafter costs a real share of a CPU round). For a drafter whose drafts trim() schedules
column by column (DSpark), the prediction is the column search's own plan on the running
estimates (`choose_plan="columns"`, `plan_columns`); for the others, and with
`choose_plan="best-prefix"`, it is the best prefix of Algorithm 1's order, which for a drafter
with confidences can count on cheap columns behind a column that does not pay alone, which
trim()'s column search never opens (BENCHMARKS.md, stop 57, 16 rows on a 2-core Zen 3: plans of
1.04-1.14x on three columns, rounds that verified one column and realized 0.72-0.79x plain; the
field's comment has the side by side that made "columns" the default). A round drafts only if
the best plan beats plain decoding by `min_gain`; otherwise every row decodes plainly, except that a
drafter cheaper than `cheap_draft` of a plain step still drafts (evidence for free) and a
probe comes after `probe_every` rounds that verified no draft (whatever choose() planned: a
plan can draft while the column search opens nothing), so estimates made under other
conditions are revisited. A probe verifies at least `probe_verifies` drafts per row whatever
the estimates say (a probe trimmed by them measured nothing: drafting could stop for good);
one whose measured gain falls below plain decoding's doubles the interval, up to
`probe_backoff_max`, so a drafter that never pays on this machine costs one short verify per
interval; and a probe due at a load where a round whose every draft had conditional acceptance
`probe_ceiling` would still lose to plain decoding (drafting time included, and the backlog of
context features its rows hold queued, which a feature-fed drafter consumes before it drafts:
prompts and the commits of rounds it did not draft; the engine says how many, `queued`; a single
row's spread over the rounds its request has left) is skipped
and backs off the same way, until the interval reaches `probe_backoff_max`. All of this uses past rounds and
timings only: lossless whatever it decides.

An optional check on the prediction (`realized_check`, off by default: measured, it did not
pay; see the field): after every round drafted on a predicted
gain, the cost model records what it actually gained (tokens committed per second of the
round, drafting included, over plain decoding's rate for the same rows) divided by what was
predicted, a moving average per row count. Predictions are scaled by it before the
`min_gain` test. They lean on estimates that can be wrong in the same direction for a while
(confidences trimmed by Algorithm 1 after drafting, acceptance that differs between the
requests in flight, a slower machine than the profile's); measured, a drafter whose
predictions keep overshooting at this load drafts only where the corrected gain still pays,
while a request whose own acceptance predicts a large gain still drafts.
`static_prefix_scheduler()` is Algorithm 1 on the start-up profile alone, for comparison.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from draftsmith.core.grammar_drafts import forced_widths
from draftsmith.core.types import Proposal
from draftsmith.core.request import Request
from draftsmith.errors import DraftsmithError
from draftsmith.policy.acceptance import (
    AcceptancePool, AcceptancePrior, cumulative, drafter_has_confidences, record_round, remember_drafts,
    running_confidences,
)
from draftsmith.policy.base import keep_all
from draftsmith.policy.cost import StepCost
from draftsmith.policy.profile import SPSTable
from draftsmith.policy.recent_confidences import recent_confidences, remember_confidences

BatchTokens = Literal["padded", "packed"]


def _ranked(conf: list[list[float]]) -> list[tuple[float, int, int]]:
    """All candidates (a_{r,j}, j, r), a descending; ties: smaller j first, then smaller r."""
    cands = [(a, j, r) for r, c in enumerate(conf) for j, a in enumerate(cumulative(c), 1)]
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    return cands


def _tokens(R: int, width: int, admitted: int, batch_tokens: BatchTokens) -> int:
    """Forward size: R rows padded to `width` columns, or R + admitted drafts (ragged)."""
    return R * width if batch_tokens == "padded" else R + admitted


def admit(conf: list[list[float]], sps: Callable[[float], float],
          batch_tokens: BatchTokens = "padded") -> list[int]:
    """Algorithm 1 with the early stop. conf[r] = c_{r,1..n_r}; returns l_r per row."""
    R = len(conf)
    ell = [0] * R
    if R == 0:
        return ell
    tau, width, admitted = float(R), 1, 0
    best = R * sps(_tokens(R, 1, 0, batch_tokens))
    for a, j, r in _ranked(conf):
        w = max(width, 1 + j)
        theta = (tau + a) * sps(_tokens(R, w, admitted + 1, batch_tokens))
        if not theta > best:
            break  # the early stop: nothing ranked below this is admitted
        ell[r], tau, width, admitted, best = j, tau + a, w, admitted + 1, theta
    return ell


class ColumnSearch:
    """`admit_columns` one column at a time, for a drafter that asks before it drafts a column.

    Column j of a DSpark round is decided by c_{r,1..j} alone, and c_{r,j} is known before draft
    j is sampled (the head reads x_{j-1}), so the drafter can stop at the first column that will
    not open: `open_next(c_{., j})` says whether column j opens (its drafts would be verified);
    after the first False nothing later opens. trim() on the shortened proposal then returns
    exactly what it returns on the full one (tests/unit/test_policies.py, test_draft_gate_*).
    `opened`: the first columns that open whatever they are predicted to pay, for every row whose
    draft there has a confidence above 0 (a probe's: PrefixScheduler.probe_verifies); a later
    column opens where the verify it makes pays against plain decoding. With `keep_asked`, `asked`
    keeps every column it was asked about, the one that did not open included (`vectors`: what the
    drafter said; PrefixScheduler keeps them for choose_plan="replay")."""

    def __init__(self, rows: int, sps: Callable[[float], float], opened: int = 0, keep_asked: bool = False) -> None:
        self.R, self.sps, self.opened, self.keep_asked = rows, sps, opened, keep_asked
        self.ell = [0] * rows
        self.surv = [1.0] * rows  # a_{r,j} of the last column seen
        self.alive = list(range(rows))  # rows whose every column so far opened
        self.tau = float(rows)
        self.best = rows * sps(rows) if rows else 0.0
        self.j = 0
        self.closed = rows == 0
        self.asked: list[list[float | None]] = []

    def open_next(self, column: Sequence[float | None]) -> bool:
        """column[r] = c_{r,j} of the next column j (None: row r has no draft j). True when
        column j opens: its drafts are verified; False: the search is over (every later call
        is False too)."""
        if self.closed:
            return False
        if self.keep_asked:
            self.asked.append([None if c is None else float(c) for c in column])
        self.j += 1
        j = self.j
        col = []
        for r in self.alive:
            c = column[r]
            if c is None:
                continue
            self.surv[r] *= min(max(float(c), 0.0), 1.0)
            if self.surv[r] > 0.0:
                col.append(r)
        if not col:
            self.closed = True
            return False
        gain = sum(self.surv[r] for r in col)
        theta = (self.tau + gain) * self.sps(self.R * (1 + j))
        if not theta > self.best and j > self.opened:
            self.closed = True
            return False
        for r in col:
            self.ell[r] = j
        # (an opened column that does not pay leaves the bar where it was: a later column opens
        # only where the verify it makes pays against plain decoding)
        self.tau, self.best, self.alive = self.tau + gain, max(theta, self.best), col
        return True

    def vectors(self) -> list[list[float]]:
        """Per row, the confidences of the columns asked about, up to its first column without one."""
        out: list[list[float]] = []
        for r in range(self.R):
            v: list[float] = []
            for column in self.asked:
                if column[r] is None:
                    break
                v.append(column[r])
            out.append(v)
        return out


def admit_columns(conf: list[list[float]], sps: Callable[[float], float], opened: int = 0) -> list[int]:
    """Algorithm 1 by columns for padded forwards (module doc): column j opens when the j-th
    drafts of the rows still in play pay for its width together; then all of them are
    verified; the first column that does not pay stops the search. conf[r] = c_{r,1..n_r}.
    `opened`: columns opened whatever they pay (ColumnSearch)."""
    return _column_search(conf, sps, opened).ell


def _column_search(conf: list[list[float]], sps: Callable[[float], float], opened: int = 0) -> ColumnSearch:
    """The column search run over every column of conf, as it ended (its ell, tau)."""
    search = ColumnSearch(len(conf), sps, opened)
    for j in range(max((len(c) for c in conf), default=0)):
        if not search.open_next([c[j] if len(c) > j else None for c in conf]):
            break
    return search


def admit_best_prefix(conf: list[list[float]], sps: Callable[[float], float],
                      batch_tokens: BatchTokens = "padded") -> list[int]:
    """The best prefix of Algorithm 1's order (no early stop).

    ONLY for confidences fixed before this round's drafts were sampled (running acceptance):
    with a drafter's confidences this is exactly the biased variant of DSpark appendix A.
    """
    return plan_best_prefix(conf, lambda b: 1.0 / sps(b), batch_tokens)[0]


def _once_per_size(step_time: Callable[[float], float]) -> Callable[[int], float]:
    """step_time, asked once per forward size (a padded plan has at most max_k + 1 of them)."""
    times: dict[int, float] = {}

    def of(tokens: int) -> float:
        t = times.get(tokens)
        if t is None:
            t = times[tokens] = step_time(tokens)
        return t
    return of


def plan_best_prefix(conf: list[list[float]], step_time: Callable[[float], float],
                     batch_tokens: BatchTokens = "padded", draft_time: float = 0.0) -> tuple[list[int], float]:
    """Best prefix of Algorithm 1's order when a round that verifies any draft also pays
    `draft_time` seconds of drafting. Returns (l_r per row, predicted tokens/s of that plan
    over plain decoding's). Same caveat as admit_best_prefix: running confidences only."""
    R = len(conf)
    if R == 0:
        return [], 1.0
    ranked = _ranked(conf)
    step_time_of = _once_per_size(step_time)
    base = R / step_time_of(_tokens(R, 1, 0, batch_tokens))
    tau, width = float(R), 1
    best, best_n = base, 0
    for n, (a, j, _) in enumerate(ranked, 1):
        tau, width = tau + a, max(width, 1 + j)
        theta = tau / (step_time_of(_tokens(R, width, n, batch_tokens)) + draft_time)
        if theta > best:
            best, best_n = theta, n
    ell = [0] * R
    for _, j, r in ranked[:best_n]:
        ell[r] = j
    return ell, best / base


def plan_columns(conf: list[list[float]], step_time: Callable[[float], float],
                 draft_time: float = 0.0) -> tuple[list[int], float]:
    """What the column search (admit_columns, padded forwards) would verify given these
    confidences, and that plan's predicted tokens/s over plain decoding's when the round also
    pays `draft_time` of drafting. choose()'s prediction for a drafter whose drafts trim()
    schedules column by column: the best prefix of Algorithm 1's order (plan_best_prefix) can
    count on columns the search will not open (a column that does not pay alone, with cheap ones
    behind it), so a round drafted on it gains less than predicted (module doc)."""
    R = len(conf)
    if R == 0:
        return [], 1.0
    search = _column_search(conf, lambda b: 1.0 / step_time(b))
    if not any(search.ell):
        return search.ell, 1.0
    theta = search.tau / (step_time(_tokens(R, 1 + max(search.ell), 0, "padded")) + draft_time)
    return search.ell, theta * step_time(R) / R


def plan_replayed(recent: list[list[list[float]]], running: list[list[float]], step_time: Callable[[float], float],
                  draft_time: float = 0.0) -> tuple[list[int], float]:
    """choose()'s prediction for a drafter whose drafts trim() schedules column by column, from
    each row's recent confidence vectors (policy/recent_confidences.py): replay i runs the column
    search on the i-th most recent vector of every row (a row with fewer cycles through its own; a
    row with none uses its running estimates `running[r]`), for i up to the longest history. What
    the replays verify together: (per row, the most drafts any replay verified; their expected
    tokens over their time, each paying `draft_time`, as tokens/s over plain decoding's). A replay
    that opens nothing counts too: a drafted round that verifies nothing is pure cost. Without any
    history: plan_columns on the running estimates."""
    R = len(running)
    n = max((len(h) for h in recent), default=0)
    if R == 0 or n == 0:
        return plan_columns(running, step_time, draft_time)
    step = _once_per_size(step_time)

    def sps(b: float) -> float:
        return 1.0 / step(b)

    ell, tokens, seconds = [0] * R, 0.0, 0.0
    for i in range(n):
        search = _column_search([h[i % len(h)] if h else c for h, c in zip(recent, running)], sps)
        ell = [max(a, b) for a, b in zip(ell, search.ell)]
        tokens += search.tau
        seconds += step(_tokens(R, 1 + max(search.ell), 0, "padded")) + draft_time
    if not any(ell):
        return ell, 1.0
    return ell, tokens / seconds * step(R) / R


def can_gain(R: int, max_k: int, sps: Callable[[float], float], batch_tokens: BatchTokens = "padded") -> bool:
    """Could any verify length beat plain decoding for R rows, even if every draft were
    certain to be accepted (a = 1)? If not, drafting is pure waste this round."""
    if R == 0 or max_k == 0:
        return False
    base = R * sps(R)
    if batch_tokens == "padded":  # a width costs the same however full: only full columns can win
        return any(R * w * sps(R * w) > base for w in range(2, max_k + 2))
    for n in range(1, R * max_k + 1):  # n admitted drafts, spread column by column
        width = 1 + -(-n // R)
        if (R + n) * sps(_tokens(R, width, n, batch_tokens)) > base:
            return True
    return False


@dataclass
class PrefixScheduler:
    sps: SPSTable  # profiled target steps/s per tokens-per-step (policy/profile.py)
    max_k: int = 5  # drafts requested per row; the scheduler verifies a prefix of them
    batch_tokens: BatchTokens = "padded"  # how a forward's size is counted (see module doc)
    running_search: Literal["best-prefix", "early-stop"] = "best-prefix"  # confidence-free drafters
    # Confidence-free drafters: draft max_k and schedule after drafting ("trim": every draft is
    # scored against the output, verified or not, so the estimates never starve; the engine
    # forwards only the kept drafts) or schedule before drafting ("choose": only verified
    # drafts are drafted; for drafters too dear to run without verifying).
    running_at: Literal["choose", "trim"] = "trim"
    # Drafters with confidences, padded forwards: decide column by column ("columns",
    # admit_columns) or candidate by candidate with the paper's early stop ("early-stop",
    # admit). Packed forwards always use the paper's.
    padded_search: Literal["columns", "early-stop"] = "columns"
    # With the column search, a drafter whose confidences come before its drafts (DSpark) stops
    # drafting at the first column that will not open (draft_gate): the same verify lengths,
    # fewer sequential steps. False drafts every column (the before / after).
    stop_drafting: bool = True
    # choose()'s predicted gain, for drafters with confidences under the column search: the column
    # search's own plan on the running estimates ("columns", plan_columns: what trim() will verify;
    # used once the drafter's last proposal carried confidences), or the best prefix of Algorithm 1's
    # order ("best-prefix", the default until stop 58), which can count on columns the search does
    # not open. Side by side at batch 1 with each prompt run on both before the next (BENCHMARKS.md,
    # stop 58; stop 57's pass-by-pass runs that favoured best-prefix moved with this VM's drift):
    # HumanEval 1.296x vs 1.206x plain (96 tokens) and 1.259x vs 1.174x (128); MT-Bench mixed,
    # 1.037x vs 0.879x (96; best-prefix had lost ground round after round on the code before it)
    # but 1.021x vs 1.102x (128) and 1.13x vs 1.16-1.19x (fresh engines). "columns" leads on code and
    # its lowest batch-1 median (1.02x) stays above the 0.97x floor; best-prefix's does not
    # "replay" (plan_replayed): the column search run on each request's recent confidence vectors,
    # i.e. the mixture of widths trim() opens, not the plan on one running estimate per position
    # (4 rows, 2-core Zen 3, stop 60: "columns" planned two columns where trim opened the second in
    # about half the rounds, and the rounds of one column realized 0.91-0.94x plain)
    choose_plan: Literal["best-prefix", "columns", "replay"] = "columns"
    prior: AcceptancePrior = field(default_factory=AcceptancePrior)  # running acceptance prior
    # Draft at all only when the predicted gain (running acceptance, measured drafting time)
    # beats plain decoding by this fraction: a margin for the model's error, so that a busy
    # server does not pay for speculation that the cost model only barely favours.
    min_gain: float = 0.03
    adapt: bool = True  # correct SPS(B) online from measured rounds and learn the drafting time
    # adapt: scale predicted gains by the measured realized / predicted gain of earlier
    # drafting rounds at this row count (a moving average: see the module doc). Off by default:
    # measured side by side (BENCHMARKS.md, serving with the built-in DSpark drafter) it did not
    # lift the tiers where the scheduler loses (its loss there is the idle cost of a drafter
    # that is not drafting) and at batch 1 it sometimes cost the speedup
    realized_check: bool = False
    pooled_prior: bool = True  # a new request's prior = this server's pooled acceptance (else prior.mean)
    # When the estimates say "do not draft": draft anyway if drafting costs at most this share
    # of a plain step (evidence for free); and probe after `probe_every` rounds that verified no
    # draft (0 = never), so that estimates made under other conditions (or by the prior) get revisited.
    cheap_draft: float = 0.05
    probe_every: int = 16
    probe_backoff_max: int = 1024  # a probe that did not pay (or, probe_verifies=0, verified nothing) doubles the interval, up to this
    # Drafts a probe verifies per row (where it drafted them) whatever the cost model predicts.
    # A probe trimmed by the same estimates that stopped drafting verifies nothing, so it measures
    # no verify forward and no acceptance, and the estimates never change: measured on a 2-core
    # Zen 3 (BENCHMARKS.md, stop 56), drafting stopped after ~40 of 128 requests at batch 1 and
    # never resumed (0.94x plain from there, 1.13x before). 0: a probe is trimmed like any round.
    probe_verifies: int = 1
    # A probe is due only where a round whose every draft had this conditional acceptance would beat
    # plain decoding (the cost model, drafting time included): where even that loses, a probe can
    # only measure what does not pay. At 32 rows on a 2-core Zen 3 (stop 60) a verify column costs
    # ~0.95 plain steps and drafting ~0.6; a probe took ~4.5 plain steps (its rows' prompts consumed
    # too) for 0.45 accepted drafts per row: ~3 plain steps lost per probe, two in a 64-request pass
    # even with the backoff. A probe skipped so backs off as one that did not pay, and at probe_backoff_max runs
    # whatever the ceiling says (a drafting time once measured dear must not stop probes for good).
    # 1.0: probe wherever all-accepted drafts could pay, drafting time included. The rows' backlog of
    # queued context features counts too (at its measured rate: StepCost.backlog_time): at 16 rows on a
    # 2-core Zen 3 (stop 61) the ~3 probes of a 48-request pass cost ~10% of the decode rate (decode
    # 0.89x plain with probes, 0.96x = the A/A control without), their rows' prompts consumed first.
    # (One row's backlog is spread over its request's remaining rounds: _probe_backlog.)
    probe_ceiling: float = 0.9
    # the online cost model's machine factor (policy/cost.py StepCost.machine_alpha, at most 0.95;
    # 0 = one correction per forward size, the model before); used when `cost` is made here
    machine_alpha: float = StepCost.machine_alpha
    cost: StepCost | None = None  # the online cost model (made from `sps` when None)
    pool: AcceptancePool | None = None  # pooled acceptance (made when pooled_prior and None)
    name: str = "prefix-scheduler"
    _idle: int = field(default=0, init=False, repr=False)  # rounds since the last round that verified a draft
    _interval: int = field(default=0, init=False, repr=False)  # current probe interval (backs off)
    _probing: bool = field(default=False, init=False, repr=False)  # this round is a probe
    _drafted: bool = field(default=False, init=False, repr=False)  # this round's drafter proposed any draft (trim)
    _predicted: float | None = field(default=None, init=False, repr=False)  # this round's planned gain
    # the drafter's last proposal carried confidences (trim() then runs the column search): kept here,
    # not per request, so that a request that has not drafted yet does not send a batch back to the
    # best-prefix plan (a request joining while drafting is off never gets its own mark)
    _confidences: bool = field(default=False, init=False, repr=False)
    # this round's draft gate, kept for choose_plan="replay" (trim() remembers what it was asked)
    _gate: ColumnSearch | None = field(default=None, init=False, repr=False)
    _queued: int = field(default=0, init=False, repr=False)  # this round's backlog positions (queued(); 0 unless told)

    def __post_init__(self) -> None:
        if self.max_k < 0:
            raise DraftsmithError(f"max_k must be >= 0, got {self.max_k}")
        if self.batch_tokens not in ("padded", "packed"):
            raise DraftsmithError(f"batch_tokens must be 'padded' or 'packed', got {self.batch_tokens!r}")
        if self.running_at not in ("choose", "trim"):
            raise DraftsmithError(f"running_at must be 'choose' or 'trim', got {self.running_at!r}")
        if self.padded_search not in ("columns", "early-stop"):
            raise DraftsmithError(f"padded_search must be 'columns' or 'early-stop', got {self.padded_search!r}")
        if self.choose_plan not in ("columns", "best-prefix", "replay"):
            raise DraftsmithError(f"choose_plan must be 'best-prefix', 'columns' or 'replay', got {self.choose_plan!r}")
        if self.running_search not in ("best-prefix", "early-stop"):
            raise DraftsmithError(f"running_search must be 'best-prefix' or 'early-stop', got {self.running_search!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise DraftsmithError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 < self.probe_ceiling <= 1.0:
            raise DraftsmithError(f"probe_ceiling must be in (0, 1], got {self.probe_ceiling}")
        if self.probe_every < 0 or self.cheap_draft < 0 or self.probe_verifies < 0:
            raise DraftsmithError(f"probe_every, probe_verifies and cheap_draft must be >= 0, got {self.probe_every}, "
                                  f"{self.probe_verifies}, {self.cheap_draft}")
        if self.cost is None:
            self.cost = StepCost(self.sps, machine_alpha=self.machine_alpha)
        if self.pool is None and self.pooled_prior:
            self.pool = AcceptancePool()
        self._interval = self.probe_every

    def _sps(self) -> Callable[[float], float]:
        return self.cost.sps if self.adapt else self.sps

    def _step_time(self) -> Callable[[float], float]:
        return self.cost.target_time if self.adapt else self.sps.step_time

    def _by_columns(self) -> bool:
        """Whether trim() schedules a drafter's confidences column by column (admit_columns)."""
        return self.batch_tokens == "padded" and self.padded_search == "columns"

    def _conf(self, seq: Request, k: int) -> list[float]:
        return running_confidences(seq, k, self.prior, self.pool if self.pooled_prior else None)

    def queued(self, positions: int) -> None:
        """Engine hook, before choose(): the context positions a feature-fed drafter holds queued for
        these rows as a backlog (drafter.backlog_positions), consumed before it drafts them. choose()
        prices a probe with it, then forgets it (a round not told has none). It counts every row,
        also one that could draft nothing this round (its last token, a grammar renewal): at most an
        overestimate, which skips a probe a little early."""
        self._queued = max(0, int(positions))

    def choose(self, seqs: list[Request]) -> list[int]:
        R = len(seqs)
        self._predicted = None
        queued, self._queued = self._queued, 0
        self._gate = None  # (a round that raised before trim() leaves its gate behind)
        sps = self._sps()
        # Batch size only: skip drafting when no verify length could pay off at this load.
        if not can_gain(R, self.max_k, sps, self.batch_tokens):
            return [0] * R
        # Predicted gain from what is known before drafting: each request's running
        # acceptance and (adapt) the drafter's measured time per round. Past rounds only:
        # lossless whatever is decided.
        conf = [self._conf(s, self.max_k) for s in seqs]
        draft_time = self.cost.draft_time(R) if self.adapt else 0.0
        # The rows' backlog (queued): what a round that drafts them pays first, once, so a plan (which
        # counts on rounds to come) does not weigh it, nor does a cheap draft (paid once, then cheap
        # every round); a probe does (_probe_backlog: one row's spread over the rounds its request has
        # left, so a draft model's unconsumed prompt does not rule out every probe at batch 1; several
        # rows' whole: at 16 rows, 0.13 ms a position padded on a 2-core Zen 3 (stop 62), a round of
        # prompts costs ~7 plain steps, more than a probe can gain).
        if self.choose_plan == "replay" and self._by_columns() and self._confidences:  # as trim() will decide
            ell, gain = plan_replayed([recent_confidences(s) for s in seqs], conf, self._step_time(), draft_time)
        elif self.choose_plan == "columns" and self._by_columns() and self._confidences:  # trim's plan, on the mean
            ell, gain = plan_columns(conf, self._step_time(), draft_time)
        else:
            ell, gain = plan_best_prefix(conf, self._step_time(), self.batch_tokens, draft_time)
        full = [self.max_k] * R
        if self._probing:  # the last probe verified drafts and no timing came (no observe()): it counts as paid
            self._interval = self.probe_every
        # A probe is due after `_interval` rounds that verified no draft, whatever this round decides:
        # a plan that drafts can still verify nothing (trim's confidences and costs say no), round
        # after round, and would otherwise never be checked (stop 56: drafting stayed off for good).
        due = bool(self.probe_every) and self._idle >= self._interval
        if due and self._interval < self.probe_backoff_max and not self._probe_can_pay(
                R, draft_time + self._probe_backlog(seqs, queued)):
            # (skipped as if it had not paid: the interval backs off, and at probe_backoff_max a probe
            # runs whatever the ceiling says, so a drafting time measured dear cannot stop probes for good)
            due, self._idle = False, 0
            self._back_off()
        if due:
            self._idle = 0  # (the interval counts from this probe)
        self._probing = False
        checked = self.adapt and self.realized_check
        calib = self.cost.calibration(R) if checked else None
        if checked and any(ell) and gain > 1.0:
            self._predicted = gain  # observe() compares the round's measured gain with it
        if any(ell) and gain * (1.0 if calib is None else calib) >= 1.0 + self.min_gain:
            self._probing = due  # (then trim() verifies at least probe_verifies drafts per row)
            if self.running_at == "trim" or all(drafter_has_confidences(s) for s in seqs):
                return full  # draft fully; trim() schedules
            # Schedule now, so that drafts that would not be verified are neither drafted
            # nor carried through the forward.
            if self.running_search == "early-stop":
                ell = admit(conf, sps, self.batch_tokens)
            return [self.max_k if drafter_has_confidences(s) else c for s, c in zip(seqs, ell)]
        plain_step = self._step_time()(_tokens(R, 1, 0, self.batch_tokens))
        self._probing = due
        if self.running_at == "trim" and draft_time <= self.cheap_draft * plain_step:
            return full  # evidence for free: trim() verifies only what pays (a probe: at least probe_verifies)
        if due:
            return full  # a probe: trim() verifies what pays, and at least probe_verifies drafts per row
        return [0] * R

    def _back_off(self) -> None:
        """A probe that did not pay (or was skipped): probe half as often, down to probe_backoff_max."""
        self._interval = min(2 * self._interval, self.probe_backoff_max)

    def _probe_backlog(self, seqs: list[Request], queued: int) -> float:
        """A probe's price for its rows' backlog (queued positions, at the cost model's measured rate).
        A single row's probe that pays leads to drafting for the rest of its request, which consumes the
        backlog once, so there it is spread over the rounds the request has left at probe_ceiling's tokens
        a round (at least one: a request about to end pays it all). Priced whole, a prompt the drafter
        never consumed kept a dear draft model from ever probing at batch 1: the Qwen2.5-Coder 0.5B
        drafting for the 1.5B, ~150 prompt positions at ~4 ms, ~5 plain steps against a probe's ~2-step
        gain (stop 64: tau 1.00 on 5 of 6 prompts). Several rows keep it whole: their padded backlog is
        dearer, their requests end at different rounds, and at 16 rows probes priced without it cost
        ~10% of the decode rate (stop 61, probe_ceiling's note)."""
        if not self.adapt or queued <= 0:
            return 0.0
        rounds = 1.0
        if len(seqs) == 1:
            c, k = self.probe_ceiling, self.max_k
            per_round = (1.0 - c ** (k + 1)) / (1.0 - c) if c < 1.0 else k + 1.0
            rounds = max(1.0, seqs[0].remaining / per_round)
        return self.cost.backlog_time(queued, len(seqs)) / rounds

    def _probe_can_pay(self, R: int, draft_time: float) -> bool:
        """Would a round whose every draft had conditional acceptance probe_ceiling beat plain
        decoding at R rows, drafting time included (`draft_time`: with the probe's price for the rows'
        backlog, _probe_backlog)? On the
        profiled SPS(B) at the machine's
        current speed: the learned shapes of verify sizes are what a probe revisits (a slow
        stretch can leave them dear: stop 56), so they do not get to rule the probe out."""
        machine = self.cost.machine() if self.adapt else 1.0
        conf = [[self.probe_ceiling] * self.max_k] * R
        return plan_best_prefix(conf, lambda b: self.sps.step_time(b) * machine, self.batch_tokens,
                                draft_time)[1] > 1.0

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        self._drafted = bool(proposal.max_len)
        gated = self._gate is not None
        if gated:  # what the drafter said to the gate, the refused column included
            remember_confidences(seqs, self._gate.vectors())  # (a round in which it opened nothing too)
            self._gate = None
        if not proposal.max_len:
            return [0] * len(seqs)
        self._confidences = proposal.confidences is not None
        remember_drafts(seqs, proposal)
        lengths = proposal.lengths.tolist()
        sps = self._sps()
        floor = self.probe_verifies if self._probing else 0  # a probe verifies at least this many

        def at_least_floor(ell: list[int]) -> list[int]:
            return [max(e, min(floor, n)) for e, n in zip(ell, lengths)]

        if proposal.confidences is None:
            if self.running_at == "choose":
                return keep_all(proposal)  # already scheduled in choose()
            conf = [self._conf(s, n) for s, n in zip(seqs, lengths)]
            if self.running_search == "early-stop":
                return at_least_floor(admit(conf, sps, self.batch_tokens))
            ell, gain = plan_best_prefix(conf, self._step_time(), self.batch_tokens)
            return at_least_floor(ell if any(ell) and gain >= 1.0 + self.min_gain else [0] * len(seqs))
        raw = proposal.confidences.detach().float().cpu().tolist()
        conf = [raw[b][:n] for b, n in enumerate(lengths)]
        if self.choose_plan == "replay" and not gated:
            remember_confidences(seqs, conf)
        # Drafting is paid by now: Algorithm 1 weighs only the forward's cost.
        if self._by_columns():
            return admit_columns(conf, sps, floor)  # (draft_gate's search: the same columns)
        return at_least_floor(admit(conf, sps, self.batch_tokens))

    def draft_gate(self, seqs: list[Request], max_lengths: list[int]) -> ColumnSearch | None:
        """Engine hook, before drafting: the column search trim() will run on this round's
        confidences, for a drafter that can stop at the first column that does not open
        (None where trim() decides otherwise). Drafting is paid column by column then, and trim()
        still decides on what was drafted (the same lengths: ColumnSearch).

        A stopped chain is shorter, so the running acceptance (remember_drafts) no longer scores
        the drafts after a column that did not open: those are rounds whose confidence fell, so
        later positions are scored mostly in rounds that went well (choose() sees them a little
        optimistically; verification and its losslessness do not depend on it)."""
        if not (self.stop_drafting and self._by_columns()):
            return None
        search = ColumnSearch(len(seqs), self._sps(), self.probe_verifies if self._probing else 0,
                              keep_asked=self.choose_plan == "replay")
        self._gate = search if self.choose_plan == "replay" else None  # (trim() keeps what it was asked)
        return search

    def forced_lengths(self, seqs: list[Request], kept: list[int], forced: list[int]) -> list[int]:
        """Engine hook, after trim: how many of each row's grammar-forced drafts to verify beside
        the drafts kept (forced rows keep none of the drafter's). The width whose predicted
        tokens/s is best, forced drafts counted as certain (a grammar that forces its tokens
        leaves the target no other) and kept drafts as if all accepted (which only favours
        verifying no forced draft): at batch 1 every one, on a loaded batch only what the wider
        forward pays for. Deterministic drafts: any rule is lossless."""
        R, step = len(seqs), self._step_time()
        return forced_widths(kept, forced, lambda w, n: step(_tokens(R, w, n, self.batch_tokens)))

    def update(self, seqs, proposal, result) -> None:
        record_round(seqs, proposal, result, self.prior, self.pool)
        verified = bool(proposal.max_len) and int(proposal.lengths.sum()) > 0
        self._idle = 0 if verified else self._idle + 1
        if self._probing and not verified:
            if self.probe_verifies and not self._drafted:  # it could not draft (no room, forced rows): still due
                self._idle = self._interval
            else:  # drafted, and nothing verified (trimmed, or confidences 0): wasted, probe half as often
                self._back_off()
        self._drafted = False
        self._probing = self._probing and verified  # verified something: observe() judges it by its measured gain

    def observe(self, info) -> None:
        """Engine hook: one round's forward shape and timings (engine.StepInfo). A probe that
        verified drafts but measured below plain decoding's rate did not pay either: back off."""
        if self.adapt:
            self.cost.observe(info)
        if self._predicted is None and not self._probing:
            return
        gain = self.cost.round_gain(info)
        if self._predicted is not None:
            if gain is not None:
                self.cost.add_calibration(info.rows, gain / self._predicted)
            self._predicted = None
        if self._probing:
            if gain is not None:  # (None: no acceptance reported, a grammar-forced row: no evidence either way)
                if gain >= 1.0:
                    self._interval = self.probe_every
                else:
                    self._back_off()
            self._probing = False


def static_prefix_scheduler(sps: SPSTable, max_k: int = 5, **kw) -> PrefixScheduler:
    """Algorithm 1 on the start-up SPS(B) profile alone, as in the paper: no online cost
    model, no gain margin, no pooled prior, no probing, the paper's candidate-by-candidate
    early stop; confidence-free drafters scheduled before drafting. The baseline the adaptive
    scheduler is measured against."""
    kw.setdefault("padded_search", "early-stop")
    return PrefixScheduler(sps, max_k=max_k, running_at="choose", min_gain=0.0, adapt=False, pooled_prior=False,
                           probe_every=0, **kw)

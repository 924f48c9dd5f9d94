"""Step cost for the prefix scheduler: the profiled SPS(B), corrected online by measured rounds.

The SPS(B) profile (policy/profile.py) is taken once, on an otherwise idle target, and times
the target forward only. A serving process sees two things the profile cannot:

- drift: other load on the machine, a warmer or colder cache, longer contexts than the
  profile's; what matters to the scheduler is the *relative* cost of a wider forward, so a
  correction is kept per forward size B = rows x width, not one global factor;
- the drafter: a trained drafter's forward is a real share of a round on a CPU (its lm_head
  alone is a fifth of a 135M target's), paid every round it drafts, whatever is verified.

StepCost splits measured / profiled forward time into two factors: the machine's speed now
(`machine`: a fast moving average over the rounds of sizes it knows, whatever the size) and,
per B, the size's own shape (slow: what the machine factor does not explain, learnt only on a
round that follows a round of another size, both moving by their share of one residual in
logarithms (`_observe_factors`); used once a size has `min_samples` measurements; between
measured sizes it is interpolated, outside them the nearest one is used); and per row count
the moving average of the drafting time (choose + propose + trim), in the same machine units,
and the drafter's time per queued context position it consumes as a backlog (kept out of the
drafting time: a prompt's worth of it would make every round look dear), which prices a probe.
The split is what lets a scheduler come back after a slow stretch: with one average per size
(`machine_alpha = 0`, the model before), a stretch of load measured on the sizes and the
drafter of speculative rounds stayed in their averages once plain rounds took over (only
drafting rounds update them, and a scheduler that believes drafting is dear does not draft), so
speculation stayed off long after the load had gone; with the split, the plain rounds that
follow bring the machine factor back down, and with it every size's predicted time and the
drafter's. A timing is only ever inflated by what happens once (a first-use weight layout, page
faults, a kernel compiled on first call), and one inflated first sample must not stop a drafter
for good: a scheduler that believes drafting is dear stops drafting, and then learns nothing
more. So a timing average starts from the smallest of its first `min_samples` measurements and
moves as an average from there.

It also keeps, per row count, the moving average of the *realized* gain of rounds that
drafted: tokens committed per second of that round (drafting included) over what plain
decoding of the same rows commits per second (its corrected forward time); and, fed by the
scheduler, the moving average of realized / predicted gain of the rounds it drafted on a
prediction (`calibration`). The planner's predicted gain rests on estimates (acceptance,
confidences, the SPS(B) curve); the calibration is the check on all of them at once.
Everything here comes from finished rounds, so decisions made from it are non-anticipating
like the profile itself (see prefix_scheduler.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from draftsmith.core.request import StepInfo
from draftsmith.errors import DraftsmithError
from draftsmith.policy.profile import SPSTable


@dataclass
class _Ewma:
    value: float
    count: int = 1

    def add(self, x: float, alpha: float, warmup: int = 0) -> None:
        """One measurement: the moving average, or while fewer than `warmup` measurements have
        come, the smallest so far (for timings, which one-time costs only ever inflate)."""
        if self.count < warmup:
            self.value = min(self.value, x)
        else:
            self.value += alpha * (x - self.value)
        self.count += 1

    def move_log(self, residual: float, alpha: float) -> None:
        """One measurement as a step in logarithms: alpha of `residual` (log measured - log predicted)."""
        self.value *= math.exp(alpha * residual)
        self.count += 1


@dataclass
class StepCost:
    profile: SPSTable
    alpha: float = 0.1  # weight of a new measurement in the per-size, drafting and gain averages
    min_samples: int = 4  # measurements of a forward size (or of the machine) before they are used
    # weight of a round's residual in the machine factor (at most 1 - shape_alpha: 0.95 at the
    # default); 0 = no machine factor, every size's correction on its own, learnt at `alpha` (the
    # model before: module doc)
    machine_alpha: float = 0.5
    # weight of a round's residual in its size's shape (a round after another size: _observe_factors)
    # beside the machine factor's: slow, so that a change of the machine's speed goes to the machine
    # factor (fast) and only what persists between sizes to the shapes. tests/unit/test_step_cost.py's
    # slow stretch (10 drafting rounds at twice the time, then 8 plain ones) leaves a 4-token forward
    # predicted 4% dearer than before it (7% with the model before stop 59; 65% with no machine factor)
    shape_alpha: float = 0.05
    _machine: _Ewma | None = None  # measured / (profiled x shape) time of every round: the machine now
    _ratio: dict[int, _Ewma] = field(default_factory=dict)  # B -> the size's shape (_observe_factors)
    _draft: dict[int, _Ewma] = field(default_factory=dict)  # rows -> seconds of drafting
    _consume: dict[int, _Ewma] = field(default_factory=dict)  # rows -> seconds per backlog position (machine units)
    _gain: dict[int, _Ewma] = field(default_factory=dict)  # rows -> realized gain of drafting rounds
    _calib: dict[int, _Ewma] = field(default_factory=dict)  # rows -> realized / predicted gain
    _known: list[tuple[int, float]] | None = field(default=None, repr=False)  # usable ratios, sorted by B
    _last_b: int | None = field(default=None, repr=False)  # the forward size of the last round measured

    def __post_init__(self) -> None:
        if (not 0.0 < self.alpha <= 1.0 or not 0.0 < self.shape_alpha <= 1.0 or self.min_samples < 1
                or not 0.0 <= self.machine_alpha <= 1.0 or self.machine_alpha + self.shape_alpha > 1.0):
            raise DraftsmithError(f"StepCost needs 0 < alpha <= 1, 0 < shape_alpha <= 1, "
                                  f"0 <= machine_alpha <= 1 - shape_alpha (both move by their share of one residual: "
                                  f"machine_alpha <= {1.0 - self.shape_alpha:.2f} here) and min_samples >= 1, "
                                  f"got alpha={self.alpha}, shape_alpha={self.shape_alpha}, "
                                  f"machine_alpha={self.machine_alpha}, min_samples={self.min_samples}")

    # ---- learning ---------------------------------------------------------------------

    def observe(self, t: "StepInfo") -> None:
        """Learn from one engine round (engine.last_step)."""
        if t.rows < 1 or t.block_len < 1:
            return
        b = t.rows * t.block_len
        if t.forward_s > 0 and math.isfinite(t.forward_s):
            r = max(t.forward_s / self.profile.step_time(b), 1e-9)
            self._known = None  # re-derived on the next prediction
            if self.machine_alpha > 0:
                self._observe_factors(b, r)
            else:
                self._add(self._ratio, b, r, timing=True)
        if t.drafted and t.draft_s >= 0:
            self._add(self._draft, t.rows, t.draft_s / self.machine(), timing=True)
        if t.consumed_positions > 0 and t.consumed_s > 0:  # (a 0 s reading is the timer's, not a rate)
            self._add(self._consume, t.rows, t.consumed_s / t.consumed_positions / self.machine(), timing=True)
        g = self.round_gain(t)
        if g is not None:
            self._add(self._gain, t.rows, g)

    def _observe_factors(self, b: int, r: float) -> None:
        """One forward of b tokens at r x its profiled time, split between the machine factor and
        the size's shape.

        A known size (past its warm-up), the machine past its own: the residual of this round,
        in logarithms, log r - log machine - log shape(b), what the model does not explain, moves
        the machine by machine_alpha of it, and the shape by shape_alpha of it only when the round
        before ran another size. A shape is relative, so only a contrast between sizes run close
        in time says anything about it: a stretch in which one size runs alone is the machine's
        speed to the model, however long, and moves no shape against the sizes that did not run.
        (Updated one after the other, the machine first and the shape from what the moved machine
        left, in plain ratios, every round, each slow spike left the running size's shape lower
        than before it: measured at 4 rows on a 2-core Zen 3 (BENCHMARKS.md, stop 59), the width-2
        verify's shape fell 15% in ~300 rounds of it alone while the plain step's stood still,
        until the model believed 8 tokens cheaper than 4 and drafted every round at 0.89x plain.)
        A size still in its warm-up learns its shape from the machine as it stands (the smallest of
        its first `min_samples` samples); the machine learns from every size until one is known."""
        contrast, self._last_b = b != self._last_b, b  # (a contrast with the size before it: see above)
        e = self._ratio.get(b)
        if e is not None and e.count >= self.min_samples and self._machine is not None \
                and self._machine.count >= self.min_samples:
            residual = math.log(r) - math.log(self._machine.value) - math.log(e.value)
            self._machine.move_log(residual, self.machine_alpha)
            if contrast:
                e.move_log(residual, self.shape_alpha)
            return
        if self._informs_machine(b):  # this forward over its size's shape
            m = r / self.shape(b)
            if self._machine is None:
                self._machine = _Ewma(m)
            elif self._machine.count < self.min_samples:
                self._machine.add(m, self.machine_alpha, self.min_samples)  # (the smallest so far)
            else:
                self._machine.move_log(math.log(m / self._machine.value), self.machine_alpha)
        if e is None or e.count < self.min_samples:
            self._add(self._ratio, b, r / self.machine(), timing=True)

    def _add(self, table: dict[int, _Ewma], key: int, x: float, timing: bool = False) -> None:
        """One measurement into a table of moving averages (a timing: see the module's note)."""
        if key in table:
            table[key].add(x, self.alpha, self.min_samples if timing else 0)
        else:
            table[key] = _Ewma(x)

    # ---- predicting -------------------------------------------------------------------

    def _informs_machine(self, b: int) -> bool:
        """Whether a forward of b tokens moves the machine factor: once any size's shape is known,
        only a size whose own shape is (what a size not yet measured deviates from the profile by
        is its shape, not the machine's speed); before, every size (the first rounds set it)."""
        e = self._ratio.get(b)
        if e is not None and e.count >= self.min_samples:
            return True
        return not any(x.count >= self.min_samples for x in self._ratio.values())

    def machine(self) -> float:
        """The machine factor: measured / (profiled x shape) forward time of recent rounds, any
        size (1.0 before the first). In use from the first round: it scales every prediction
        alike (the target's forwards of every size and the drafter's time), so it moves no
        decision by itself; what it changes is what the per-size shapes and the drafting time
        learn. Its first `min_samples` rounds keep the smallest, as every timing does."""
        return 1.0 if self._machine is None else self._machine.value

    def correction(self, b: float) -> float:
        """Measured / profiled forward time at b tokens: the machine factor x the size's shape."""
        return self.machine() * self.shape(b)

    def shape(self, b: float) -> float:
        """The size's own measured / profiled time beside the machine factor (1.0 until a size has
        enough measurements; interpolated in B between measured sizes, the nearest outside)."""
        if self._known is None:
            self._known = sorted((k, e.value) for k, e in self._ratio.items() if e.count >= self.min_samples)
        known = self._known
        if not known:
            return 1.0
        xs = [k for k, _ in known]
        i = bisect_left(xs, b)
        if i == 0:
            return known[0][1]
        if i == len(xs):
            return known[-1][1]
        (x0, r0), (x1, r1) = known[i - 1], known[i]
        return r0 + (r1 - r0) * (b - x0) / (x1 - x0)

    def target_time(self, b: float) -> float:
        """Seconds of one target forward of b tokens, as it runs now."""
        return self.profile.step_time(b) * self.correction(b)

    def sps(self, b: float) -> float:
        """Corrected SPS(b): target forwards per second at b tokens per forward."""
        return 1.0 / self.target_time(b)

    def draft_time(self, rows: int) -> float:
        """Seconds the drafter takes per round for this many rows (0 until measured;
        the nearest measured row count stands in for an unmeasured one)."""
        t = self._nearest(self._draft, rows, min_count=1)
        return 0.0 if t is None else t * self.machine()

    def backlog_time(self, positions: int, rows: int) -> float:
        """Seconds a drafter takes to consume a backlog of this many queued context positions
        (prompts, the commits of rounds it did not draft) over this many rows, at its measured rate
        per position at that row count (the nearest measured one stands in; 0 until one backlog was
        measured). Per row count: the rows' queues are padded to the longest, so a position costs
        more in a wide flush (2-core Zen 3, stop 62: 0.03 ms at 1 row, 0.13 ms at 16)."""
        rate = self._nearest(self._consume, rows, min_count=1)
        return 0.0 if rate is None or positions <= 0 else positions * rate * self.machine()

    def round_gain(self, t: "StepInfo") -> float | None:
        """What one drafting round gained over plain decoding of its rows: (rows + accepted)
        tokens in draft_s + forward_s seconds, against rows tokens per plain forward (None for
        a round that did not draft or reported no acceptance)."""
        if not t.drafted or t.accepted is None or t.rows < 1 or t.draft_s + t.forward_s <= 0:
            return None
        return (t.rows + t.accepted) * self.target_time(t.rows) / (t.rows * (t.draft_s + t.forward_s))

    def realized_gain(self, rows: int) -> float | None:
        """Moving average of the realized gain of drafting rounds at this many rows (the
        nearest measured row count stands in); None until `min_samples` such rounds."""
        return self._nearest(self._gain, rows)

    def add_calibration(self, rows: int, ratio: float) -> None:
        """One drafting round's realized / predicted gain (the scheduler's prediction)."""
        self._add(self._calib, rows, ratio)

    def calibration(self, rows: int) -> float | None:
        """Moving average of realized / predicted gain at this many rows (nearest measured row
        count); None until `min_samples` rounds."""
        return self._nearest(self._calib, rows)

    def _nearest(self, table: dict[int, _Ewma], rows: int, min_count: int | None = None) -> float | None:
        """The moving average at `rows`, else at the nearest row count (ties: the smaller),
        among those with enough measurements (`min_samples` unless given); None if none."""
        need = self.min_samples if min_count is None else min_count
        known = {r: e for r, e in table.items() if e.count >= need}
        if not known:
            return None
        return known[min(known, key=lambda r: (abs(r - rows), r))].value

    def summary(self) -> dict:
        return {"machine": round(self.machine(), 4),
                "correction": {b: round(self.correction(b), 4) for b in sorted(self._ratio)},
                "draft_s": {r: round(self.draft_time(r), 6) for r in sorted(self._draft)},
                "backlog_s_per_position": {r: round(self.backlog_time(1, r), 9) for r in sorted(self._consume)},
                "realized_gain": {r: round(e.value, 4) for r, e in sorted(self._gain.items())},
                "calibration": {r: round(e.value, 4) for r, e in sorted(self._calib.items())}}

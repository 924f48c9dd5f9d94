"""One request's state inside the engine, the counters its stats come from, and what the
engine reports of its last round (StepInfo, read by policies that learn step cost)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.core.logprobs import TokenLogprobs
from draftsmith.core.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Counters for one request. τ and acceptance are derived, never stored."""

    target_forwards: int = 0  # target forward passes this request took part in (prefill incl.)
    rounds: int = 0  # verification rounds (decode steps)
    committed: int = 0  # tokens committed by rounds (bonus/correction included)
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    proposed_at: list[int] = field(default_factory=list)  # [k] rounds that proposed >= k+1
    accepted_at: list[int] = field(default_factory=list)  # [k] rounds that accepted >= k+1
    t_arrival: float = field(default_factory=time.perf_counter)
    t_scheduled: float | None = None  # given a KV row (the engine's admission)
    t_first_token: float | None = None
    t_last_token: float | None = None  # its latest output token committed
    t_finish: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV a free row already held (prefix caching)
    forced_proposed: int = 0  # drafts the request's grammar forced (core/grammar_drafts.py; not in proposed)
    forced_accepted: int = 0  # of those, accepted (not in accepted)
    # rounds with drafts, where someone reads them (the server's --per-request-spec-decode-metrics):
    # step_counts {(drafted, accepted): rounds} (summary: bounded by K), step_log each round's pair
    # in order (detailed); None: not kept
    step_counts: dict[tuple[int, int], int] | None = None
    step_log: list[tuple[int, int]] | None = None

    def record_round(self, proposed: int, accepted: int, committed: int) -> None:
        self.rounds += 1
        self.committed += committed
        self.proposed += proposed
        self.accepted += accepted
        grow = max(proposed - len(self.proposed_at), 0)
        self.proposed_at.extend([0] * grow)
        self.accepted_at.extend([0] * grow)
        for k in range(proposed):
            self.proposed_at[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1
        if proposed > 0:
            if self.step_counts is not None:
                self.step_counts[proposed, accepted] = self.step_counts.get((proposed, accepted), 0) + 1
            if self.step_log is not None:
                self.step_log.append((proposed, accepted))

    def record_forced(self, proposed: int, accepted: int) -> None:
        """A round whose drafts were the grammar's forced tokens (record_round counts it too,
        with no drafts of the drafter's)."""
        self.forced_proposed += proposed
        self.forced_accepted += accepted

    @property
    def tau(self) -> float:
        """Tokens committed per verification round, bonus included."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def prefix_survival(self) -> list[float]:
        """Per position k: rounds with >= k accepted drafts / rounds that proposed >= k."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def to_dict(self) -> dict:
        return {
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "committed": self.committed,
            "draft_proposed": self.proposed,
            "draft_accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "prefix_survival": self.prefix_survival,
            "cached_tokens": self.cached_tokens,
            "forced_proposed": self.forced_proposed,
            "forced_accepted": self.forced_accepted,
        }


@dataclass
class Request:
    """A request: prompt, what has been committed, its sampling state and its cache row.

    Invariant while running: the target KV cache row holds every token of `all_ids` except
    the last one (the "pending" token, whose KV is written by the next forward).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1  # KV cache row while running
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cached KV
    priority: int = 0  # vLLM's: waiting requests are admitted lowest first (arrival order within one)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (`error` says why)
    error: str | None = None  # why it ended with "error": its grammar failed mid-generation (core/structured.py)
    grammar_renewals: int = 0  # fresh matchers its grammar needed (core/structured.renew): none drafts after one
    stopped_by_token: bool = False  # ended on EOS or a stop_token_id (its text is not shown)
    stop_reason: int | str | None = None  # vLLM's: the stop_token_id or stop string that ended it (None: EOS, length)
    text: str = ""  # decoded output, stop string removed
    stats: RequestStats = field(default_factory=RequestStats)
    # one dict per output token when params.logprobs is not None (core/logprobs.py)
    logprobs: list[TokenLogprobs] | None = None
    # params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # The draft-length policy's per-request scratch (policy/*.py). Drafters keep typed state
    # of their own per request instead (drafters/base.py: RequestStates).
    drafter_state: dict = field(default_factory=dict)
    # params.structured_outputs: the grammar matcher at the committed output (core/structured.py)
    grammar: Any = None
    # params.bad_words as token sequences (engine: each word alone and after a space; core/penalties.py)
    bad_words_ids: list[list[int]] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class StepInfo:
    """The last round: forward shape rows × (1 + longest draft), useful tokens, timings."""

    rows: int = 0
    block_len: int = 0  # 1 + max draft length in the batch (padded verify width)
    useful_tokens: int = 0  # sum over rows of 1 + that row's draft length
    drafted: bool = False  # did the drafter run with a draft length > 0
    draft_s: float = 0.0  # wall seconds of choose + propose + trim (a backlog of context features consumed excluded)
    forward_s: float = 0.0  # wall seconds of the target forward + warp + verify
    accepted: int | None = None  # drafts accepted over all rows (None: not reported)
    consumed_s: float = 0.0  # wall seconds, within choose + propose + trim, of that backlog (drafter.consumed_s)
    consumed_positions: int = 0  # the backlog's positions (drafter.consumed_positions): the cost model's rate

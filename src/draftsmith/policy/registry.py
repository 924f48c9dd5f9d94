"""The one registry of draft-length policies (how many drafts K to verify per round).

`make_policy(name, k, target=..., max_batch=...)` builds one; the CLI's `--policy` choices
and help come from `policies()`. Register another with `register(PolicyKind(...))`.
"""

from __future__ import annotations

import difflib
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.batch_schedule import BatchSizeSchedule, default_schedule
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.heuristic import HeuristicK
from draftsmith.policy.prefix_scheduler import PrefixScheduler
from draftsmith.policy.profile import ProfileConfig, load_or_profile
from draftsmith.policy.threshold import ConfidenceThreshold

# make(k, target: LoadedTarget | None, max_batch) -> DraftLengthPolicy
Factory = Callable[[int, object, int], DraftLengthPolicy]


@dataclass(frozen=True)
class PolicyKind:
    name: str
    summary: str
    make: Factory


def _prefix_scheduler(k: int, target, max_batch: int) -> DraftLengthPolicy:
    if target is None:
        raise DraftsmithError(
            "the prefix-scheduler policy needs the target to profile SPS(B): call "
            "make_policy(name, k, target=loaded_target, max_batch=...) or pass "
            "PrefixScheduler(load_or_profile(model, ...)) as the policy")
    sps = load_or_profile(
        target.model, weights_hash=target.weights_hash, name=target.target_id,
        config=ProfileConfig(max_batch=max_batch, max_k=k),
        log=lambda m: print(f"draftsmith: {m}", file=sys.stderr, flush=True),
    )
    return PrefixScheduler(sps, max_k=k)


_POLICIES: dict[str, PolicyKind] = {}


def register(kind: PolicyKind, replace: bool = False) -> PolicyKind:
    if kind.name in _POLICIES and not replace:
        raise DraftsmithError(f"policy {kind.name!r} is already registered")
    _POLICIES[kind.name] = kind
    return kind


for _p in (
    PolicyKind("fixed", "always K drafts", lambda k, t, b: FixedK(k)),
    PolicyKind("heuristic", "grow K after a fully accepted round, shrink after a rejection",
               lambda k, t, b: HeuristicK(initial=min(k, 16), max_k=max(16, k))),
    PolicyKind("threshold", "verify the prefix whose drafter confidence stays high (DSpark)",
               lambda k, t, b: ConfidenceThreshold(max_k=k)),
    PolicyKind("batch-schedule", "K by the number of running requests", lambda k, t, b: BatchSizeSchedule(default_schedule(k))),
    PolicyKind("prefix-scheduler", "DSpark's hardware-aware prefix scheduler (profiles SPS(B) once per machine)",
               _prefix_scheduler),
):
    register(_p)


def policies() -> Mapping[str, PolicyKind]:
    return types.MappingProxyType(_POLICIES)


def make_policy(name: str, k: int, *, target=None, max_batch: int = 8) -> DraftLengthPolicy:
    """A draft-length policy by name, K = k drafts per round at most.

    prefix-scheduler profiles SPS(B) for `target` (a LoadedTarget) on first use per machine
    (cached under $DRAFTSMITH_HOME/profiles/), for up to `max_batch` rows of k + 1 tokens.
    """
    if name not in _POLICIES:
        close = difflib.get_close_matches(name, list(_POLICIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DraftsmithError(f"unknown draft-length policy {name!r}{hint}; choose one of {', '.join(_POLICIES)}")
    return _POLICIES[name].make(k, target, max_batch)

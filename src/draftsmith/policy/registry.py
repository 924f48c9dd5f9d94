"""The one registry of draft-length policies (how many drafts K to verify per round).

`make_policy(spec, k, target=..., max_batch=...)` builds one; the CLI's `--policy` names and
help come from `policies()`. Register another with `register(PolicyKind(...))`.

A spec is a name, optionally with settings of that policy: `NAME:KEY=VALUE[,KEY=VALUE...]`,
e.g. `prefix-scheduler:min_gain=0.05,padded_search=columns`; each KEY is one of the kind's
`options` (typed fields of its dataclass), each VALUE a number, true/false or a word.
"""

from __future__ import annotations

import difflib
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.batch_schedule import BatchSizeSchedule, default_schedule
from draftsmith.policy.fixed import FixedK
from draftsmith.policy.heuristic import HeuristicK
from draftsmith.policy.prefix_scheduler import PrefixScheduler
from draftsmith.policy.profile import ProfileConfig, SPSTable, load_or_profile
from draftsmith.policy.threshold import ConfidenceThreshold

# make(k, target: LoadedTarget | None, max_batch, **options) -> DraftLengthPolicy
Factory = Callable[..., DraftLengthPolicy]


@dataclass(frozen=True)
class PolicyKind:
    name: str
    summary: str
    make: Factory
    options: tuple[str, ...] = ()  # settings a spec may give (fields of `config`), passed to make
    config: type | None = None  # the dataclass whose type hints type the options
    check: Callable[[dict], None] | None = None  # validates typed options before anything loads


# The prefix scheduler's settings a user may tune from a spec (docs: policy/prefix_scheduler.py).
PREFIX_SCHEDULER_OPTIONS = ("min_gain", "padded_search", "batch_tokens", "running_search", "running_at",
                            "adapt", "realized_check", "pooled_prior", "cheap_draft", "probe_every",
                            "probe_backoff_max", "probe_verifies", "probe_ceiling", "stop_drafting", "machine_alpha",
                            "choose_plan")


def _check_prefix_scheduler(options: dict) -> None:
    """The scheduler's own checks of these settings, on a stand-in profile (no target needed)."""
    PrefixScheduler(SPSTable((1,), (1.0,)), **options)


def _prefix_scheduler(k: int, target, max_batch: int, **options) -> DraftLengthPolicy:
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
    return PrefixScheduler(sps, max_k=k, **options)


_POLICIES: dict[str, PolicyKind] = {}


def register(kind: PolicyKind, replace: bool = False) -> PolicyKind:
    if kind.name in _POLICIES and not replace:
        raise DraftsmithError(f"policy {kind.name!r} is already registered")
    _POLICIES[kind.name] = kind
    return kind


for _p in (
    PolicyKind("auto", "the default: prefix-scheduler where a drafter drafts, fixed for plain decoding (no drafter)",
               _prefix_scheduler),
    PolicyKind("fixed", "always K drafts", lambda k, t, b: FixedK(k)),
    PolicyKind("heuristic", "grow K after a fully accepted round, shrink after a rejection",
               lambda k, t, b: HeuristicK(initial=min(k, 16), max_k=max(16, k))),
    PolicyKind("threshold", "verify the prefix whose drafter confidence stays high (DSpark)",
               lambda k, t, b: ConfidenceThreshold(max_k=k)),
    PolicyKind("batch-schedule", "K by the number of running requests", lambda k, t, b: BatchSizeSchedule(default_schedule(k))),
    PolicyKind("prefix-scheduler", "DSpark's hardware-aware prefix scheduler (profiles SPS(B) once per machine; "
               "settings: prefix-scheduler:KEY=VALUE,... with KEY one of " + ", ".join(PREFIX_SCHEDULER_OPTIONS) + ")",
               _prefix_scheduler, PREFIX_SCHEDULER_OPTIONS, PrefixScheduler, _check_prefix_scheduler),
):
    register(_p)


def policies() -> Mapping[str, PolicyKind]:
    return types.MappingProxyType(_POLICIES)


def parse_policy_spec(spec: str) -> tuple[PolicyKind, dict[str, Any]]:
    """`NAME[:KEY=VALUE,...]` -> (its registered kind, typed options); a DraftsmithError that
    names what is wrong for an unknown name, an unknown or repeated key, or a bad value."""
    name, sep, rest = str(spec).partition(":")
    name = name.strip()
    if name not in _POLICIES:
        close = difflib.get_close_matches(name, list(_POLICIES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DraftsmithError(f"unknown draft-length policy {name!r}{hint}; choose one of {', '.join(_POLICIES)}")
    kind = _POLICIES[name]
    options: dict[str, Any] = {}
    if not sep:
        return kind, options
    if not kind.options:
        raise DraftsmithError(f"policy {name!r} takes no settings (got {rest!r}); use --policy {name}")
    hints = typing.get_type_hints(kind.config) if kind.config is not None else {}
    for item in rest.split(","):
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key or not raw:
            raise DraftsmithError(f"policy {spec!r}: expected {name}:KEY=VALUE[,KEY=VALUE...], got {item!r}")
        if key not in kind.options:
            raise DraftsmithError(f"policy {name!r} has no setting {key!r}; settings: {', '.join(kind.options)}")
        if key in options:
            raise DraftsmithError(f"policy {spec!r} sets {key!r} twice")
        options[key] = _typed(f"policy {name!r} setting {key!r}", hints.get(key, str), raw)
    if kind.check is not None:
        try:
            kind.check(options)
        except DraftsmithError as e:
            raise DraftsmithError(f"policy {spec!r}: {e}") from None
    return kind, options


def _typed(what: str, tp: Any, raw: str) -> Any:
    """A spec's text value as the field's type: bool, int, float or one of a Literal's words."""
    if typing.get_origin(tp) is typing.Literal:
        if raw not in typing.get_args(tp):
            raise DraftsmithError(f"{what} must be one of {', '.join(typing.get_args(tp))}, got {raw!r}")
        return raw
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str:
        return raw
    word = {bool: "true or false", int: "an integer", float: "a number"}.get(tp, getattr(tp, "__name__", str(tp)))
    raise DraftsmithError(f"{what} must be {word}, got {raw!r}")


def make_policy(spec: str, k: int, *, target=None, max_batch: int = 8) -> DraftLengthPolicy:
    """A draft-length policy from its spec (a name, or `NAME:KEY=VALUE,...`), K = k drafts
    per round at most.

    prefix-scheduler profiles SPS(B) for `target` (a LoadedTarget) on first use per machine
    (cached under $DRAFTSMITH_HOME/profiles/), for up to `max_batch` rows of k + 1 tokens.
    """
    kind, options = parse_policy_spec(spec)
    return kind.make(k, target, max_batch, **options)


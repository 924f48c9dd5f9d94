"""The one way to put a target, a drafter and a draft-length policy together into an Engine
(`LLM`, eval, bench, regen and the serving benchmark all come through here)."""

from __future__ import annotations

from draftsmith.drafters.base import Drafter, NoDrafter
from draftsmith.drafters.registry import build_drafter
from draftsmith.engine.engine import Engine, EngineConfig
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.loading import LoadedTarget
from draftsmith.models.target import eos_token_ids
from draftsmith.policy.base import DraftLengthPolicy
from draftsmith.policy.registry import make_policy


def build_engine(target: LoadedTarget, drafter: str | Drafter = "none", policy: str | DraftLengthPolicy = "auto",
                 num_speculative_tokens: int = 5, max_batch: int = 8, max_len: int = 2048,
                 cache: KVCache | None = None, reproducible_seeds: bool = True,
                 drafter_dtype: str = "auto", enable_prefix_caching: bool | None = False,
                 adaptive_threads: bool = False, forced_drafts: int = 16) -> Engine:
    """An Engine for `target` with `drafter` (a registry spec such as "ngram" or
    "dspark:CKPT", or a Drafter) and `policy` (a registered name or a policy object), K =
    num_speculative_tokens drafts per round at most, max_batch rows of max_len tokens
    (capped at the target's context). `cache`: share an idle engine's KV cache.
    `reproducible_seeds`: EngineConfig's (seeded requests by position-keyed coupling).
    `drafter_dtype`: what a model drafter built from a spec computes in (drafters/precision.py).
    `enable_prefix_caching`: reuse the KV of prompt prefixes free rows still hold (engine/prefix_cache.py;
    only with drafters that read no target features; None: wherever the drafter allows).
    `adaptive_threads`: on a CPU, run on the cores other busy processes leave free (models/threads.py).
    `forced_drafts`: at most this many tokens a request's grammar forces are its draft for a round
    (core/grammar_drafts.py; 0: off).
    Policy "auto" (the default) is the prefix scheduler (policy/prefix_scheduler.py: it verifies a
    draft only where its expected gain pays for the bigger forward on this machine's measured
    SPS(B)) when the drafter drafts, and "fixed" for plain decoding (nothing to schedule, no profile)."""
    max_len = min(max_len, target.model.config.max_position_embeddings)
    if isinstance(drafter, str):
        drafter = build_drafter(drafter, target, max_batch, max_len, drafter_dtype)
    if policy == "auto":
        policy = "fixed" if isinstance(drafter, NoDrafter) else "prefix-scheduler"
    if isinstance(policy, str):
        policy = make_policy(policy, num_speculative_tokens, target=target, max_batch=max_batch)
    config = EngineConfig(max_batch, max_len, reproducible_seeds, enable_prefix_caching, adaptive_threads,
                          forced_drafts)
    return Engine(target.model, target.tokenizer, drafter, policy, config,
                  eos_token_ids=eos_token_ids(target), cache=cache)

"""Prompt sources for the Mint stage: where the conversations to regenerate come from.

    from draftsmith.data.sources import load_mix
    prompts = load_mix("code:0.4,chat:0.6", split="train", max_samples=2000, seed=0)

Built-in names: humaneval, mtbench, sharegpt, stdlib-code; aliases code (humaneval +
stdlib-code) and chat (mtbench + sharegpt); or a path to a .jsonl / .parquet prompt file.
Every conversation's split is a function of its id (`split_of`), so any later stage can
tell held-out prompts apart without a side file.
"""

from draftsmith.data.sources.base import Source, package_file
from draftsmith.data.sources.conversation import (
    DEFAULT_HELDOUT_FRACTION,
    FALLBACK_HELDOUT_FRACTION,
    Conversation,
    Split,
    heldout_fraction_for,
    split_of,
)
from draftsmith.data.sources.files import BadRecord, JsonlSource, OnError, ParquetSource
from draftsmith.data.sources.mix import MixEntry, load_mix, parse_mix, validate_mix
from draftsmith.data.sources.packaged import HumanEvalSource, MTBenchSource, ShareGPTSource
from draftsmith.data.sources.registry import (
    ALIASES,
    BUILTIN_SOURCES,
    iter_conversations,
    resolve_source,
    source_names,
)
from draftsmith.data.sources.stdlib_code import StdlibCodeSource

__all__ = [
    "ALIASES", "BUILTIN_SOURCES", "DEFAULT_HELDOUT_FRACTION", "FALLBACK_HELDOUT_FRACTION",
    "BadRecord", "Conversation", "HumanEvalSource", "JsonlSource", "MTBenchSource", "MixEntry",
    "OnError", "ParquetSource", "ShareGPTSource", "Source", "Split", "StdlibCodeSource",
    "heldout_fraction_for", "iter_conversations", "load_mix", "package_file", "parse_mix",
    "resolve_source", "source_names", "split_of", "validate_mix",
]

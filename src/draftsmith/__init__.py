"""Draftsmith: mint, verify and serve speculative-decoding drafters for your own LLM."""

import os

# Before torch loads OpenMP (libgomp): worker threads spin ~3000 iterations, then sleep, so a
# busy machine does not stall every kernel on a spinning thread (models/threads.py). The
# environment wins: a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from draftsmith.core.sampling import SamplingParams  # noqa: E402
from draftsmith.core.structured import StructuredOutputsParams  # noqa: E402
from draftsmith.errors import DraftsmithError

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "DraftsmithError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import draftsmith` stays cheap (no torch model code) for the CLI's --help.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from draftsmith import api

        return getattr(api, name)
    raise AttributeError(name)

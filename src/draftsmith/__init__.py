"""Draftsmith: mint, verify and serve speculative-decoding drafters for your own LLM."""

import os

# Before torch loads OpenMP: worker threads sleep instead of spinning between parallel regions,
# so a loaded machine does not stall every region on a spinning thread (models/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from draftsmith.core.sampling import SamplingParams  # noqa: E402
from draftsmith.errors import DraftsmithError

__all__ = ["LLM", "SamplingParams", "DraftsmithError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import draftsmith` stays cheap (no torch model code) for the CLI's --help.
    if name == "LLM":
        from draftsmith.api import LLM

        return LLM
    raise AttributeError(name)

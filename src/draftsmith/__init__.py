"""Draftsmith: mint, verify and serve speculative-decoding drafters for your own LLM."""

from draftsmith.core.sampling import SamplingParams
from draftsmith.errors import DraftsmithError

__all__ = ["LLM", "SamplingParams", "DraftsmithError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import draftsmith` stays cheap (no torch model code) for the CLI's --help.
    if name == "LLM":
        from draftsmith.api import LLM

        return LLM
    raise AttributeError(name)

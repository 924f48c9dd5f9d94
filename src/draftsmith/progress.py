"""Progress bars only where someone watches them.

On a terminal a tqdm bar redraws one line with `\\r`; in a log file (stderr not a terminal)
every redraw stays, and the file gets one long line of `\\r`-joined bars. Draftsmith's own
bars are off there (`disable=not sys.stderr.isatty()`, or --progress) and a few plain stage
lines say what is happening; `hf_bars_on_terminal_only` does the same for the bars
transformers draws while it loads or converts weights.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


@contextmanager
def hf_bars_on_terminal_only(*modules: ModuleType) -> Iterator[None]:
    """Within: unless stderr is a terminal, transformers' progress bars are off, and so are the
    bars of each of `modules` that calls tqdm itself (transformers' GGUF converter does, past
    transformers' own switch); both are restored on the way out."""
    if sys.stderr.isatty():
        yield
        return
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    saved = [(m, m.tqdm) for m in modules]
    for m, bar in saved:
        m.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        for m, bar in saved:
            m.tqdm = bar
        if enabled:
            hf_logging.enable_progress_bar()

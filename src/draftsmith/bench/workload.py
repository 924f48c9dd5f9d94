"""The prompt set of a bench run: the first user turn (plus any system message) of each
conversation of a source, from one split, in the source's fixed order.

Built-in sources default to the held-out split (docs/MEASURING.md #5: drafters are judged on
prompts they never trained on); a user's prompt file defaults to all of it. Prompts too long
for the context (prompt + max_tokens + drafts) are skipped and listed. When the split has
fewer prompts than `--requests`, the list is cycled and the report says how many repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftsmith.data.sources.registry import is_prompt_file, iter_conversations
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # conversation id (with "#rN" when a prompt is reused N times over)
    source: str
    split: str
    messages: tuple[dict, ...]  # system (optional) + first user turn
    token_ids: tuple[int, ...] | None = None  # in-process only: the chat-templated prompt


@dataclass
class Workload:
    prompts: list[BenchPrompt]
    split: str
    skipped: list[dict]  # {"id", "reason"}
    reused: int  # prompts beyond the unique ones (cycled)

    @property
    def unique_ids(self) -> list[str]:
        return [p.id for p in self.prompts if "#r" not in p.id]


def default_split(workload: str) -> str:
    return "all" if is_prompt_file(workload) else "heldout"


def load_workload(workload: str, split: str | None, n: int,
                  tokenize: Callable[[list[dict]], list[int]] | None = None,
                  max_prompt_tokens: int | None = None) -> Workload:
    """`n` prompts of `workload`. With `tokenize`, prompts get token ids and those over
    `max_prompt_tokens` are skipped."""
    split = split or default_split(workload)
    picked: list[BenchPrompt] = []
    skipped: list[dict] = []
    for conv in iter_conversations(workload, split=None if split == "all" else split):  # type: ignore[arg-type]
        if len(picked) >= n:
            break
        system = [dict(m) for m in conv.messages if m["role"] == "system"][:1]
        user = next((m["content"] for m in conv.messages if m["role"] == "user" and m["content"].strip()), None)
        if user is None:
            continue
        msgs = tuple(system + [{"role": "user", "content": user}])
        ids = None
        if tokenize is not None:
            ids = tuple(tokenize(list(msgs)))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                skipped.append({"id": conv.id, "reason": f"prompt has {len(ids)} tokens > {max_prompt_tokens}"})
                continue
        picked.append(BenchPrompt(conv.id, conv.source, conv.split, msgs, ids))
    if not picked:
        why = f" ({len(skipped)} too long for the context)" if skipped else ""
        raise DraftsmithError(f"workload {workload!r} has no usable prompts in split {split!r}{why}")
    unique = len(picked)
    r = 0
    while len(picked) < n:
        r += 1
        for p in picked[:unique]:
            if len(picked) >= n:
                break
            picked.append(BenchPrompt(f"{p.id}#r{r}", p.source, p.split, p.messages, p.token_ids))
    return Workload(picked, split, skipped, len(picked) - unique)

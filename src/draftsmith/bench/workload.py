"""The prompt set of a bench run: the first user turn (plus any system message) of each
conversation of a source, from one split, in the source's fixed order; with `turns` > 1 also
the conversation's next user turns (up to turns - 1 of them), which the load generator sends one
after the other with the answers so far in the prompt (bench/loadgen.py).

Built-in sources default to the held-out split (docs/MEASURING.md #5: drafters are judged on
prompts they never trained on); a user's prompt file defaults to all of it. Prompts too long
for the context (prompt + max_tokens + drafts) are skipped and listed. When the split has
fewer prompts than `--requests`, the list is cycled and the report says how many repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from draftsmith.data.sources.registry import is_prompt_file, iter_conversations
from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # conversation id (with "#rN" when a prompt is reused N times over)
    source: str
    split: str
    messages: tuple[dict, ...]  # system (optional) + first user turn
    token_ids: tuple[int, ...] | None = None  # in-process only: the chat-templated prompt
    followups: tuple[str, ...] = ()  # the next user turns (--turns > 1)
    longest_prompt: int | None = None  # in-process: a bound on the last turn's prompt tokens


@dataclass
class Workload:
    prompts: list[BenchPrompt]
    split: str
    skipped: list[dict]  # {"id", "reason"}
    reused: int  # prompts beyond the unique ones (cycled)
    turns: int = 1  # user turns asked for per request

    @property
    def total_turns(self) -> int:
        """Turns over every prompt of the list (a conversation may have fewer than asked for)."""
        return sum(1 + len(p.followups) for p in self.prompts)

    @property
    def unique_ids(self) -> list[str]:
        return [p.id for p in self.prompts if "#r" not in p.id]


def default_split(workload: str) -> str:
    return "all" if is_prompt_file(workload) else "heldout"


def load_workload(workload: str, split: str | None, n: int,
                  tokenize: Callable[[list[dict]], list[int]] | None = None,
                  max_prompt_tokens: int | None = None, turns: int = 1, answer_tokens: int = 0) -> Workload:
    """`n` prompts of `workload`. With `tokenize`, prompts get token ids and those over
    `max_prompt_tokens` are skipped; with `turns` > 1, a conversation whose last turn's prompt
    could pass it (its user turns + `answer_tokens` per earlier answer) is skipped."""
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
        users = [m["content"] for m in conv.messages if m["role"] == "user" and m["content"].strip()]
        followups = tuple(users[1:turns])
        ids = None
        if tokenize is not None:
            ids = tuple(tokenize(list(msgs)))
            longest = len(ids)
            if followups:  # the last turn's prompt at most: every user turn, empty answers + answer_tokens each
                shape = list(msgs)
                for u in followups:
                    shape += [{"role": "assistant", "content": ""}, {"role": "user", "content": u}]
                longest = len(tokenize(shape)) + len(followups) * answer_tokens
            if max_prompt_tokens is not None and longest > max_prompt_tokens:
                what = "prompt has" if not followups else f"turn {1 + len(followups)}'s prompt could reach"
                skipped.append({"id": conv.id, "reason": f"{what} {longest} tokens > {max_prompt_tokens}"})
                continue
        picked.append(BenchPrompt(conv.id, conv.source, conv.split, msgs, ids, followups,
                                  None if ids is None else longest))
    if not picked:
        why = f" ({len(skipped)} too long for the context)" if skipped else ""
        raise DraftsmithError(f"workload {workload!r} has no usable prompts in split {split!r}{why}")
    if turns > 1 and not any(p.followups for p in picked):
        raise DraftsmithError(f"--turns {turns}: no conversation of workload {workload!r} (split {split!r}) has a "
                              "second user turn; use a multi-turn source (mtbench, sharegpt, chat) or a file whose "
                              "records hold several user messages")
    unique = len(picked)
    r = 0
    while len(picked) < n:
        r += 1
        for p in picked[:unique]:
            if len(picked) >= n:
                break
            picked.append(replace(p, id=f"{p.id}#r{r}"))
    return Workload(picked, split, skipped, len(picked) - unique, turns)

"""The unit every Mint stage passes around: one prompt conversation, and its split.

A `Conversation` carries the user turns that regeneration replays (in order) and, when the
source has them, the original assistant turns as references. The train / held-out split is a
pure function of the conversation id (`split_of`), so regen, cache, train and eval can each
recompute it from the id alone and held-out prompts cannot leak into training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, get_args

from draftsmith.errors import DraftsmithError

Split = Literal["train", "heldout"]
Role = Literal["system", "user", "assistant"]
SPLITS: Final = get_args(Split)
ROLES: Final = get_args(Role)

# Held-out fraction per id prefix (the part of the id before the first "/"). Small benchmark
# sets keep a fifth aside so eval has enough prompts; large sources only need a sliver.
DEFAULT_HELDOUT_FRACTION: Final[Mapping[str, float]] = MappingProxyType({
    "humaneval": 0.20,  # 164 prompts -> ~33 held out
    "mtbench": 0.20,    # 80 questions -> ~16 held out
    "sharegpt": 0.02,
    "stdlib": 0.02,
})
FALLBACK_HELDOUT_FRACTION: Final = 0.02  # user files and anything not listed above


def heldout_fraction_for(conversation_id: str) -> float:
    """The documented default held-out fraction for an id, looked up by its prefix."""
    prefix = conversation_id.split("/", 1)[0]
    return DEFAULT_HELDOUT_FRACTION.get(prefix, FALLBACK_HELDOUT_FRACTION)


def split_of(conversation_id: str, heldout_fraction: float | None = None) -> Split:
    """Which split an id belongs to: a stable hash of the id, compared with the fraction.

    sha256 (not Python's salted `hash`) makes it identical across processes, machines and
    Python versions. The id maps to a point u in [0, 1); it is held out iff u < fraction, so
    raising the fraction only ever moves ids from train to held-out, never back.
    """
    fraction = heldout_fraction_for(conversation_id) if heldout_fraction is None else heldout_fraction
    if not 0.0 <= fraction <= 1.0:
        raise DraftsmithError(f"held-out fraction must be in [0, 1], got {fraction}")
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    point = int.from_bytes(digest[:8], "big") / 2.0**64
    return "heldout" if point < fraction else "train"


def normalize_messages(messages: Any) -> tuple[dict[str, str], ...]:
    """Validate OpenAI-style chat messages and copy them to plain {role, content} dicts.

    Raises ValueError with a short reason; callers at I/O boundaries wrap it with the file
    and line. Extra keys (name, tool_calls, ...) are dropped: Mint only replays text turns.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise ValueError("messages must be a list of {role, content} objects")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {index} has role {role!r}; expected one of {ROLES}")
        if not isinstance(content, str):
            raise ValueError(f"message {index} content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise ValueError("messages contain no non-empty user turn")
    return tuple(out)


@dataclass(frozen=True)
class Conversation:
    """One prompt conversation from a source.

    id:       globally unique and stable, "<prefix>/<local id>" (e.g. "humaneval/HumanEval_12").
    source:   the registry name that produced it (e.g. "stdlib-code", "file:prompts.jsonl").
    split:    "train" or "heldout", from `split_of(id, fraction)`.
    messages: OpenAI chat messages; user turns in order, assistant turns are references that
              regeneration replaces. Treat as read-only (hashing uses only the id).
    """

    id: str
    source: str
    split: Split
    messages: tuple[dict[str, str], ...]

    def __post_init__(self) -> None:
        if not self.id or not isinstance(self.id, str):
            raise DraftsmithError(f"conversation id must be a non-empty string, got {self.id!r}")
        if self.split not in SPLITS:
            raise DraftsmithError(f"{self.id}: split must be one of {SPLITS}, got {self.split!r}")
        try:
            object.__setattr__(self, "messages", normalize_messages(self.messages))
        except ValueError as err:
            raise DraftsmithError(f"{self.id}: {err}") from err

    def __hash__(self) -> int:
        return hash(self.id)

    def user_turns(self) -> tuple[str, ...]:
        """The user messages in order: what regeneration sends to the target."""
        return tuple(m["content"] for m in self.messages if m["role"] == "user")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "split": self.split,
                "messages": [dict(m) for m in self.messages]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Conversation:
        missing = [k for k in ("id", "source", "split", "messages") if k not in data]
        if missing:
            raise DraftsmithError(f"conversation record lacks {missing}")
        return cls(id=data["id"], source=data["source"], split=data["split"],
                   messages=data["messages"])

    def to_json(self) -> str:
        """One line of JSON (no newlines inside), as stored in the Mint JSONL files."""
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Conversation:
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise DraftsmithError(f"conversation is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise DraftsmithError("conversation JSON must be an object")
        return cls.from_dict(data)


def make_conversation(prefix: str, local_id: str, source: str, messages: Any,
                      heldout_fraction: float | None = None) -> Conversation:
    """Build a Conversation with id "<prefix>/<local_id>" and its split computed from that id."""
    conversation_id = f"{prefix}/{local_id}"
    return Conversation(id=conversation_id, source=source,
                        split=split_of(conversation_id, heldout_fraction), messages=messages)


def in_split(conversations: Iterable[Conversation], split: Split | None) -> Iterator[Conversation]:
    """Keep one split (None keeps both); the single place sources filter by split."""
    if split is not None and split not in SPLITS:
        raise DraftsmithError(f"split must be one of {SPLITS} or None, got {split!r}")
    return (c for c in conversations if split is None or c.split == split)

"""Run held-out prompts through the engine with a drafter and record every verification round.

    drafter = load_drafter("dspark:runs/x", target, max_rows, max_len)
    run = run_rounds(target, drafter, heldout_conversations(["humaneval", "mtbench"]), gamma=7)
    run.records  -> [RoundRecord(task, request, drafted, proposed, accepted, committed, confidences)]

Prompts come only from the held-out split of data/sources (the split is a pure function of
the conversation id, so they were never regenerated for training). Multi-turn conversations
(MT-Bench) are replayed turn by turn: turn t+1 follows the target's own answer to turn t.

Recording is a draft-length policy (`RecordingPolicy`: fixed γ, optional static threshold
on the cumulative confidence in `trim`, one record per row in `update`), so the engine runs
exactly as it serves; nothing is patched. The target is loaded once and shared with the
drafter, so the engine is built directly rather than through `LLM` (which loads its own).

Confidences are recorded raw (before STS): when the drafter applies calibration.json
temperatures (to rows of the fit's regime: greedy or sampled), the runner inverts them (c = σ(T_k · logit(c'_k))) so that "before" and
"after" calibration are both computed from the same rounds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from draftsmith.core.request import Request
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.types import Proposal, VerifyResult
from draftsmith.data.cache import iter_records
from draftsmith.data.sources.registry import ALIASES, iter_conversations
from draftsmith.drafters import registry
from draftsmith.drafters.calibration import STSFit
from draftsmith.drafters.checkpoint import read_checkpoint_config
from draftsmith.engine.builder import build_engine
from draftsmith.errors import DraftsmithError
from draftsmith.eval.metrics import RoundRecord
from draftsmith.eval.sts import unscale
from draftsmith.models.prompts import encode_messages

DEFAULT_TASKS = ("humaneval", "mtbench")


# ---- prompts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalConversation:
    task: str
    id: str
    user_turns: tuple[str, ...]
    system: str | None = None


def heldout_conversations(tasks: Sequence[str], max_prompts: int | None = None) -> list[EvalConversation]:
    """Held-out conversations of each task (a built-in source, alias or prompt file), in file order."""
    out: list[EvalConversation] = []
    first_task: dict[str, str] = {}  # conversation id -> the task that gave it
    for task in tasks:
        n = 0
        for conv in iter_conversations(task, split="heldout"):
            if max_prompts is not None and n >= max_prompts:
                break
            if conv.id in first_task:  # its rounds would be counted under one id twice: a wrong τ
                aliases = "; ".join(f"{a} = {' + '.join(m)}" for a, m in ALIASES.items())
                raise DraftsmithError(f"--tasks: {task} repeats the prompt {conv.id!r} of {first_task[conv.id]}; "
                                      f"name each source once ({aliases})")
            first_task[conv.id] = task
            system = next((m["content"] for m in conv.messages if m["role"] == "system"), None)
            out.append(EvalConversation(task, conv.id, conv.user_turns(), system))
            n += 1
        if n == 0:
            raise DraftsmithError(f"task {task!r} has no held-out prompts")
    return out


def heldout_from_regen(path: Path, max_prompts: int | None = None) -> list[EvalConversation]:
    """Held-out records of a regen JSONL (their user turns); training-split records are refused."""
    out, skipped = [], 0
    for rec in iter_records(Path(path)):
        sid = str(rec["id"])
        if (rec.get("split") or "train") != "heldout":  # the trainer skips exactly these
            skipped += 1
            continue
        msgs = rec.get("messages") or []
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and (m.get("role") not in ("user", "system") or isinstance(m.get("content"), str))
                for m in msgs):
            raise DraftsmithError(f"{path}: record {sid!r}: messages must be a list of {{role, content}} objects "
                                  "with text content; give the JSONL file `draftsmith regen` wrote")
        turns = tuple(m["content"] for m in msgs if m.get("role") == "user")
        if not turns:
            continue
        system = next((m["content"] for m in msgs if m.get("role") == "system"), None)
        out.append(EvalConversation(str(rec.get("source") or Path(path).stem), sid, turns, system))
        if max_prompts is not None and len(out) >= max_prompts:
            break
    if not out:
        raise DraftsmithError(f"{path} has no held-out records ({skipped} training-split records skipped); "
                              "calibrate on data regenerated with --split heldout")
    return out


# ---- drafters -----------------------------------------------------------------------------------


@dataclass
class LoadedDrafter:
    drafter: Any
    spec: str
    kind: str
    checkpoint: Path | None
    sts: STSFit | None  # the STS the drafter applies to its confidences (in the fit's regime)
    config: dict = field(default_factory=dict)
    dtype: str | None = None  # what a trained drafter computes in (drafters/precision.py)

    @property
    def temperatures(self) -> tuple[float, ...] | None:
        return None if self.sts is None else self.sts.temperatures

    def applied_at(self, temperature: float) -> tuple[float, ...] | None:
        """The STS temperatures the drafter applies to rows sampled at `temperature` (None: raw)."""
        return self.sts.temperatures if self.sts is not None and self.sts.applies_to(temperature == 0) else None

    @property
    def label(self) -> str:
        return self.kind if self.checkpoint is None else f"{self.kind}:{self.checkpoint.name or self.checkpoint}"


def load_drafter(spec: str, target, max_rows: int, max_len: int, dtype: str = "auto") -> LoadedDrafter:
    """Any registered spec; a trained kind's checkpoint config and STS come along. A model
    drafter computes in `dtype` (drafters/precision.py)."""
    kind, arg = registry.parse_spec(spec)
    if kind.wrap is not None:  # e.g. lookup:dspark:CKPT: the inner drafter's checkpoint, config and STS
        inner = load_drafter(arg, target, max_rows, max_len, dtype)
        return LoadedDrafter(kind.wrap(inner.drafter), spec, kind.name, inner.checkpoint, inner.sts,
                             inner.config, inner.dtype)
    resolved = registry.resolve_dtype(dtype, target, kind)
    drafter = kind.load(arg, target, max_rows, max_len, resolved)
    if not kind.trainable:
        return LoadedDrafter(drafter, spec, kind.name, None, None)
    ckpt = Path(arg)
    return LoadedDrafter(drafter, spec, kind.name, ckpt, getattr(drafter, "sts", None),
                         read_checkpoint_config(ckpt), str(resolved).removeprefix("torch."))


# ---- recording --------------------------------------------------------------------------------


class RecordingPolicy:
    """Fixed draft length γ; optional static threshold; one RoundRecord per row per round.

    threshold: verify the longest prefix whose cumulative confidence Π_{i≤k} c_i (as the
    drafter reports it, i.e. calibrated when it applies STS) stays ≥ threshold. Draft k's
    admission depends on c_k, computed before x_k is sampled: a stopping time, lossless.
    """

    name = "eval-fixed"

    def __init__(self, gamma: int, threshold: float | None = None, applied_temperatures: Sequence[float] | None = None,
                 tags: dict[str, tuple[str, str]] | None = None) -> None:
        if gamma < 0:
            raise DraftsmithError(f"block size must be >= 0, got {gamma}")
        self.gamma = int(gamma)
        self.threshold = threshold
        self.applied = tuple(applied_temperatures) if applied_temperatures else None
        self.tags = tags if tags is not None else {}
        self.records: list[RoundRecord] = []
        self._drafted: list[tuple[int, tuple[float, ...] | None]] = []
        self._committed: dict[str, int] = {}

    def choose(self, seqs: list[Request]) -> list[int]:
        return [self.gamma] * len(seqs)

    def trim(self, seqs: list[Request], proposal: Proposal) -> list[int]:
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        conf = proposal.confidences.tolist() if proposal.confidences is not None and proposal.max_len else None
        self._drafted = [(n, tuple(conf[b][:n]) if conf is not None else None) for b, n in enumerate(lengths)]
        if self.threshold is None or conf is None:
            return lengths
        keep = []
        for b, n in enumerate(lengths):
            a, ell = 1.0, 0
            for k in range(n):
                a *= conf[b][k]
                if a < self.threshold:
                    break
                ell += 1
            keep.append(ell)
        return keep

    def update(self, seqs: list[Request], proposal: Proposal, result: VerifyResult) -> None:
        lengths = proposal.lengths.tolist() if proposal.max_len else [0] * len(seqs)
        accepted = result.num_accepted.tolist()
        for b, s in enumerate(seqs):
            now = s.stats.committed
            committed = now - self._committed.get(s.request_id, 0)
            self._committed[s.request_id] = now
            drafted, conf = self._drafted[b] if b < len(self._drafted) else (lengths[b], None)
            if conf is not None and self.applied:
                conf = tuple(unscale(conf, self.applied))
            task, request = self.tags.get(s.request_id, ("", s.request_id))
            self.records.append(RoundRecord(task=task, request=request, drafted=int(drafted), proposed=int(lengths[b]),
                                            accepted=int(accepted[b]), committed=int(committed), confidences=conf))
        self._drafted = []


@dataclass
class RunOutput:
    records: list[RoundRecord]
    requests: int
    output_tokens: int
    wall_s: float
    skipped: list[dict] = field(default_factory=list)
    texts: dict[str, list[str]] = field(default_factory=dict)  # conversation id -> answers


def run_rounds(target, loaded: LoadedDrafter, conversations: Sequence[EvalConversation], gamma: int,
               temperature: float = 1.0, max_new_tokens: int = 128, max_batch: int = 4, max_len: int = 2048,
               threshold: float | None = None, seed: int = 0, max_turns: int = 2,
               progress: bool | None = None) -> RunOutput:
    """Generate answers for every conversation turn with the drafter; record each round."""

    tags: dict[str, tuple[str, str]] = {}
    policy = RecordingPolicy(gamma, threshold, loaded.applied_at(temperature), tags)
    engine = build_engine(target, loaded.drafter, policy, gamma, max_batch, max_len)
    history = {c.id: ([{"role": "system", "content": c.system}] if c.system else []) for c in conversations}
    answers: dict[str, list[str]] = {c.id: [] for c in conversations}
    skipped: list[dict] = []
    total = sum(min(len(c.user_turns), max_turns) for c in conversations)
    bar = tqdm(total=total, desc=f"eval {loaded.label}", unit="req", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if progress is None else not progress)
    t0 = time.perf_counter()
    out_tokens = requests = 0
    try:
        for turn in range(max_turns):
            live = []
            for i, c in enumerate(conversations):
                if turn >= len(c.user_turns) or len(answers[c.id]) < turn:
                    continue  # no such turn, or an earlier turn was skipped
                msgs = history[c.id] + [{"role": "user", "content": c.user_turns[turn]}]
                ids = encode_messages(target.tokenizer, msgs)
                if len(ids) + max_new_tokens > engine.max_len:
                    skipped.append({"id": c.id, "turn": turn, "reason": f"prompt of {len(ids)} tokens + "
                                    f"{max_new_tokens} new exceeds the context of {engine.max_len}"})
                    bar.update(1)
                    continue
                params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature,
                                        seed=seed * 1_000_003 + i * 101 + turn)
                seq = engine.add_request(ids, params, request_id=f"{c.id}#{turn}")
                tags[seq.request_id] = (c.task, seq.request_id)
                live.append((c, msgs, seq))
            while engine.has_unfinished():
                for s in engine.step():
                    bar.update(1)
            for c, msgs, seq in live:
                answers[c.id].append(seq.text)
                history[c.id] = msgs + [{"role": "assistant", "content": seq.text}]
                out_tokens += len(seq.output_ids)
                requests += 1
    finally:
        bar.close()
    return RunOutput(records=policy.records, requests=requests, output_tokens=out_tokens,
                     wall_s=time.perf_counter() - t0, skipped=skipped, texts=answers)


def default_block_size(loaded: LoadedDrafter, fallback: int = 7) -> int:
    """γ: the checkpoint's block size (DFlash / DSpark) or TTT depth (EAGLE-3), else `fallback`."""
    return registry.get(loaded.kind).default_k(loaded.config, fallback)


def group_by_task(records: Iterable[RoundRecord]) -> dict[str, list[RoundRecord]]:
    out: dict[str, list[RoundRecord]] = {}
    for r in records:
        out.setdefault(r.task, []).append(r)
    return out

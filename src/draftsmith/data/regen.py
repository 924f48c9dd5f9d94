"""`draftsmith regen`: replace every assistant turn of a prompt mix with the target's own answer.

Each conversation is replayed turn by turn: the target answers the first user turn, its
answer becomes the assistant turn, then the next user turn is answered after it, and so on
(every user turn gets an answer; original assistant turns are dropped). Output is JSONL,
one conversation per line:

    id, source, split       from the prompt source
    messages                system/user turns + the regenerated assistant turns
    input_ids               token ids of the whole templated conversation
    loss_mask               1 on tokens the target generated (incl. its end-of-turn token)
    turns                   per answer: prompt_tokens, generated_tokens, finish_reason
    dropped_user_turns      user turns left out because the context was full (usually 0)
    target                  {id, weights_hash} (+ endpoint, served_model with --endpoint)
    sampling                {temperature, top_p, top_k, max_new_tokens, seed, origin}
    format_version

Token ids are built incrementally, exactly as the target saw them (`ChatTokens`): the prompt
of turn k is the ids of turns < k (generated tokens verbatim, never re-tokenized) plus the
template's text between them and the new generation prompt. So every prompt the target
received is a prefix of `input_ids`, and the masked tokens are precisely what it sampled.

Writes are append-only (flush + fsync per record); `--resume` skips ids already written and
drops a truncated last line left by a killed run. Failures go to `<out>.errors.jsonl`.
`--exclude FILE` leaves out the ids of another run's output (or an id list): the mix's list is
chosen first (--max-samples), then those ids dropped, so a data set made elsewhere grows by the
next prompts of the same list.

`--features-out DIR` (built-in engine) also writes the feature cache `draftsmith cache` would
build from the output, recorded while the target answers (data/feature_recorder.py); a record's
features are written after the record, and conversations without recorded features (an earlier
run's, one too long for the last feed) get theirs from the cache pass at the end.

Split by role (this module keeps the job and re-exports the names other code imports from it):

    regen_config.py    RegenConfig, RegenSampling, recommended/resolve_sampling, turn_seed
    chat_tokens.py     answer_slots, ChatTokens
    regen_records.py   make_record, JsonlAppender, scan_output, load_records, errors_path
    regen_backends.py  EngineBackend, EndpointBackend
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draftsmith.data.cache import CacheConfig, open_writer, run_cache
from draftsmith.data.cache_writer import CacheWriter
from draftsmith.data.chat_tokens import ChatTokens, answer_slots
from draftsmith.data.features import record_tensors
from draftsmith.data.outdir import check_out_dir, check_out_file
from draftsmith.data.regen_backends import EndpointBackend, EngineBackend
from draftsmith.data.regen_config import (
    FALLBACK_TEMPERATURE,
    FALLBACK_TOP_P,
    RegenConfig,
    RegenSampling,
    recommended_sampling,
    resolve_sampling,
    turn_seed,
)
from draftsmith.data.regen_records import (
    REGEN_FORMAT_VERSION,
    JsonlAppender,
    errors_path,
    load_records,
    make_record,
    read_ids,
    record_split,
    scan_output,
)
from draftsmith.data.sources import load_mix, parse_mix
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import same_weights

__all__ = [
    "FALLBACK_TEMPERATURE", "FALLBACK_TOP_P", "REGEN_FORMAT_VERSION",
    "ChatTokens", "JsonlAppender", "RegenConfig", "RegenSampling",
    "RegenSink", "RegenSummary",
    "answer_slots", "errors_path", "load_records", "make_record", "recommended_sampling", "resolve_sampling",
    "run_regen", "scan_output", "turn_seed",
]


@dataclass
class RegenSummary:
    written: int = 0
    errors: int = 0
    skipped_done: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # built-in engine: prompt tokens of every turn it answered
    cached_prompt_tokens: int = 0  # ... of which prefix caching reused the KV (not prefilled)
    wall_s: float = 0.0
    truncated_bytes: int = 0
    recorded_features: int = 0  # --features-out: conversations whose features regen recorded
    computed_features: int = 0  # ... and those the catch-up pass computed (earlier runs, too long)
    error_ids: list[str] = field(default_factory=list)
    first_error: str | None = None  # this run's first failure (the errors file keeps earlier runs' too)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class RegenSink:
    """Where backends report: one finished record or one failed conversation at a time.

    `features`: the feature-cache writer of --features-out and the ids the cache already holds;
    a record's features go to it only after the record itself is on disk, so the cache never
    holds a conversation the JSONL lacks."""

    def __init__(self, out: Path, errors: Path, bar, summary: RegenSummary,
                 features: tuple[CacheWriter, set[str]] | None = None) -> None:
        self.out = JsonlAppender(out)
        self.err = JsonlAppender(errors)
        self.bar = bar
        self.summary = summary
        self.features = features
        self.t0 = self._drawn = time.perf_counter()
        self.answered_tokens = 0  # new tokens of every answered turn, finished conversations or not

    def _rate(self, refresh: bool) -> None:
        dt = time.perf_counter() - self.t0
        if dt > 0:
            self.bar.set_postfix_str(f"{self.answered_tokens / dt:.1f} tok/s", refresh=refresh)

    def _tick(self) -> None:
        self.bar.update(1)
        self._rate(refresh=False)

    def answered(self, tokens: int) -> None:
        """A turn was answered with `tokens` new tokens. The rate on the bar counts answered turns,
        not finished conversations: with many long conversations in flight, the first finish only
        after most of their turns (a rate from finished conversations read 7 tok/s where the
        engine generated several times that). Redrawn at most every 2 s between conversations."""
        self.answered_tokens += tokens
        now = time.perf_counter()
        if now - self._drawn >= 2.0:
            self._drawn = now
            self._rate(refresh=True)

    def record(self, rec: Mapping[str, Any],
               features: tuple[Mapping[int, torch.Tensor], torch.Tensor] | None = None) -> None:
        """Write a finished conversation, and its recorded features ({layer: [T, H]}, final
        [T, H]) where there are some (the rest get theirs from the catch-up pass)."""
        self.out.write(rec)
        self.summary.written += 1
        self.summary.generated_tokens += sum(t["generated_tokens"] for t in rec.get("turns", ()))
        if features is not None and self.features is not None and str(rec["id"]) not in self.features[1]:
            writer, held = self.features
            ids, mask = record_tensors(rec)
            hidden, final = features
            writer.add(str(rec["id"]), record_split(rec), ids, mask, hidden, final)
            held.add(str(rec["id"]))
            self.summary.recorded_features += 1
        self._tick()

    def error(self, conv, reason: str) -> None:
        self.err.write({"id": conv.id, "source": conv.source, "split": conv.split, "reason": reason,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.summary.errors += 1
        self.summary.error_ids.append(conv.id)
        if self.summary.first_error is None:
            self.summary.first_error = reason
        self._tick()

    def close(self) -> None:
        self.out.close()
        self.err.close()
        if self.features is not None:  # what was recorded is kept, even on an interrupt
            self.features[0].close(complete=False)
        errs = Path(self.err.path)
        if errs.is_file() and errs.stat().st_size == 0:  # no failures: leave no empty errors file
            errs.unlink()


def _prepare_output(cfg: RegenConfig, target_info: Mapping[str, Any], sampling: RegenSampling | None,
                    summary: RegenSummary, run_ids: set[str], legacy: str | None = None) -> set[str]:
    """Check what --out already holds against this run (`legacy`: the target's older-style
    weights fingerprint, which records written before the content hash carry)."""
    out = check_out_file(cfg.out, example="regen.jsonl")
    errs = errors_path(out)
    if out.exists() and out.stat().st_size > 0 and not (cfg.resume or cfg.overwrite):
        raise DraftsmithError(f"{out} exists; pass --resume to continue it or --overwrite to start over")
    if cfg.overwrite and not cfg.resume:
        for f in (out, errs):
            if f.exists():
                f.unlink()
        return set()
    done, dropped = scan_output(out)
    summary.truncated_bytes = dropped
    if dropped:
        print(f"[draftsmith] {out}: dropped an incomplete last record ({dropped} bytes) from a killed run; "
              "it will be regenerated", file=sys.stderr)
    for rec in done.values():
        h = (rec.get("target") or {}).get("weights_hash")
        if same_weights(h, target_info.get("weights_hash"), legacy) is False:
            raise DraftsmithError(f"cannot resume {out}: it was written by target weights {h}, this run uses "
                                  f"{target_info.get('weights_hash')}; use the same target or a new --out")
        old = {k: v for k, v in (rec.get("sampling") or {}).items() if k != "origin"}
        new = {k: v for k, v in sampling.to_dict().items() if k != "origin"} if sampling else old
        if old and old != new:
            raise DraftsmithError(f"cannot resume {out}: it was sampled with {old}, this run asks for {new}; "
                                  "use the same sampling flags or a new --out")
        break
    if errs.exists():  # ids of this run that failed before are retried: drop their old error lines
        keep = []
        for line in errs.read_bytes().splitlines(keepends=True):
            try:
                rid = json.loads(line.decode("utf-8")).get("id")
            except (ValueError, AttributeError):  # not JSON (or not UTF-8): dropped
                continue
            if rid not in run_ids and line.endswith(b"\n"):
                keep.append(line)
        # Not fileio.atomic_write: its mkstemp temporary would turn the errors file mode 0600
        # (the output beside it keeps the umask default).
        tmp = errs.with_name(f".{errs.name}.tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, errs)
    return set(done)


def run_regen(cfg: RegenConfig, conversations: Sequence | None = None, backend=None) -> RegenSummary:
    """Regenerate a mix (or the given conversations) into cfg.out. Returns counters."""
    check_out_file(cfg.out, example="regen.jsonl")  # before the mix is read or the target loads
    if conversations is None:
        _check_out_is_no_prompt_file(cfg)
    if cfg.features_out is not None:
        check_out_dir(cfg.features_out, "--features-out")
    if conversations is None:
        conversations = load_mix(cfg.mix, split=cfg.split, max_samples=cfg.max_samples,
                                 seed=cfg.seed if cfg.mix_seed is None else cfg.mix_seed)
    if cfg.exclude:
        conversations = _drop_excluded(conversations, cfg.exclude)
    records = not cfg.endpoint and getattr(backend or EngineBackend, "records_features", False)
    if cfg.features_out is not None and not records:
        raise DraftsmithError("--features-out needs the built-in engine: an endpoint returns text, not the target's "
                              "hidden states. Regenerate, then run `draftsmith cache --data` on the output")
    if backend is None:
        backend = EndpointBackend(cfg) if cfg.endpoint else EngineBackend(cfg)
    summary = RegenSummary()
    done = _prepare_output(cfg, backend.target_info, getattr(backend, "sampling", None), summary,
                           {c.id for c in conversations}, backend.legacy_weights_hash)
    features = open_writer(_cache_config(cfg), backend.target) if cfg.features_out is not None else None
    todo = [c for c in conversations if c.id not in done]
    summary.skipped_done = len(conversations) - len(todo)
    bar = tqdm(total=len(todo), unit="sample", desc="regen", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    sink = RegenSink(Path(cfg.out), errors_path(Path(cfg.out)), bar, summary, features)
    t0 = time.perf_counter()
    try:
        backend.run(todo, sink)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through the CLI
        print(f"[draftsmith] regen: the {summary.written} conversations this run finished are kept in {cfg.out}"
              + (f" (features of {summary.recorded_features} in {cfg.features_out}; the cache pass of --resume "
                 "adds the rest)" if cfg.features_out is not None else "")
              + "; continue with the same command and --resume", file=sys.stderr)
        raise
    finally:
        summary.wall_s = time.perf_counter() - t0
        sink.close()
        bar.close()
    if features is not None:
        # Conversations written without recorded features (by an earlier run, or too long for the
        # tail request) get theirs from the cache pass, which also marks the cache complete.
        backend.release()
        before = features[0].manifest["num_samples"] + len(features[0].manifest["skipped"])
        done_cache = run_cache(_cache_config(cfg, resume=True), target=backend.target)
        summary.computed_features = done_cache["num_samples"] + done_cache["skipped"] - before
    return summary


def _drop_excluded(conversations: Sequence, paths: Sequence[Path]) -> list:
    """--exclude: the selected conversations less the ids in `paths` (a warning for a file that
    names none of them: another --mix / --split / --mix-seed); none left is an error."""
    selected = {c.id for c in conversations}
    excluded: set[str] = set()
    for path in paths:
        ids = read_ids(path)
        if ids and not ids & selected:
            print(f"[draftsmith] warning: --exclude {path}: none of its {len(ids)} ids is in this selection "
                  "(the run that wrote it used another --mix, --split or --mix-seed?)", file=sys.stderr)
        excluded |= ids
    kept = [c for c in conversations if c.id not in excluded]
    print(f"[draftsmith] --exclude: left out {len(conversations) - len(kept)} of {len(conversations)} "
          "conversations", file=sys.stderr)
    if not kept:
        raise DraftsmithError(f"--exclude leaves none of the {len(conversations)} selected conversations; "
                              "raise --max-samples (the list is chosen first, then the excluded ids dropped)")
    return kept


def _check_out_is_no_prompt_file(cfg: RegenConfig) -> None:
    """--out must not be a prompt file of --mix: --overwrite would delete the prompts (read first,
    then replaced by the answers), --resume would read them as records."""
    out = Path(cfg.out)
    if not out.is_file():
        return
    for entry in parse_mix(cfg.mix):
        f = Path(entry.name).expanduser()  # (as the sources resolve it)
        if f.is_file() and os.path.samefile(f, out):
            raise DraftsmithError(f"--out {out} is the prompt file --mix reads; writing there would replace "
                                  "the prompts with the answers. Give another --out, e.g. data/regen.jsonl")


def _cache_config(cfg: RegenConfig, resume: bool | None = None) -> CacheConfig:
    """The `draftsmith cache` job --features-out stands for: the regen output, its target, dtype,
    device and thread policy, into cfg.features_out."""
    resume = cfg.resume if resume is None else resume
    return CacheConfig(target=cfg.target, data=Path(cfg.out), out=Path(cfg.features_out),
                       layers=cfg.feature_layers, dtype=cfg.feature_dtype,
                       resume=resume, overwrite=cfg.overwrite and not resume,
                       device=cfg.device, model_dtype=cfg.dtype, progress=cfg.progress,
                       adaptive_threads=cfg.adaptive_threads)

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
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

REGEN_FORMAT_VERSION = 1
FALLBACK_TEMPERATURE = 0.7
FALLBACK_TOP_P = 0.8
_SENTINEL = "\x1fDRAFTSMITH-ANSWER\x1f"


# ---- sampling -------------------------------------------------------------------------


@dataclass(frozen=True)
class RegenSampling:
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    origin: str  # where temperature/top_p came from: "generation_config", "fallback", "cli" or a mix

    def to_dict(self) -> dict:
        return asdict(self)


def recommended_sampling(model_dir: Path | None) -> dict[str, Any]:
    """The target's recommended sampling (generation_config.json), else T=0.7, top-p 0.8."""
    gen: dict[str, Any] = {}
    f = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if f is not None and f.is_file():
        try:
            gen = json.loads(f.read_text())
        except json.JSONDecodeError:
            gen = {}
    out: dict[str, Any] = {}
    if gen.get("do_sample") is False:
        out.update(temperature=0.0, top_p=1.0, origin="generation_config")
        return out
    has_t, has_p = isinstance(gen.get("temperature"), (int, float)), isinstance(gen.get("top_p"), (int, float))
    out["temperature"] = float(gen["temperature"]) if has_t else FALLBACK_TEMPERATURE
    out["top_p"] = float(gen["top_p"]) if has_p else FALLBACK_TOP_P
    if isinstance(gen.get("top_k"), int):
        out["top_k"] = int(gen["top_k"])
    out["origin"] = "generation_config" if (has_t or has_p) else "fallback"
    return out


def resolve_sampling(model_dir: Path | None, temperature: float | None, top_p: float | None,
                     top_k: int | None, max_new_tokens: int, seed: int) -> RegenSampling:
    rec = recommended_sampling(model_dir)
    origin = rec["origin"]
    if temperature is not None or top_p is not None or top_k is not None:
        origin = "cli" if (temperature is not None and top_p is not None) else f"cli+{origin}"
    t = rec["temperature"] if temperature is None else float(temperature)
    p = rec["top_p"] if top_p is None else float(top_p)
    k = rec.get("top_k", 0) if top_k is None else int(top_k)
    from draftsmith.core.sampling import SamplingParams

    SamplingParams(max_tokens=max_new_tokens, temperature=t, top_p=p, top_k=k)  # validates
    return RegenSampling(temperature=t, top_p=p, top_k=k, max_new_tokens=int(max_new_tokens),
                         seed=int(seed), origin=origin)


def turn_seed(seed: int, conversation_id: str, turn: int) -> int:
    """Per-answer seed from (run seed, id, turn): a resumed or re-batched run reproduces."""
    d = hashlib.sha256(f"{seed}\0{conversation_id}\0{turn}".encode()).digest()
    return int.from_bytes(d[:8], "big") & ((1 << 63) - 1)


# ---- templated token ids --------------------------------------------------------------


def answer_slots(messages: Sequence[Mapping[str, str]]) -> list[list[dict[str, str]]]:
    """Split a conversation into the blocks that each regenerated answer follows.

    Every user turn is answered (in order, after the previously regenerated answers);
    original assistant turns are dropped. A system message is kept in place: it joins the
    block of the next user turn (trailing system messages with no user turn after them are
    dropped).
    """
    blocks: list[list[dict[str, str]]] = []
    cur: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "assistant":
            continue
        cur.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            blocks.append(cur)
            cur = []
    return blocks


class ChatTokens:
    """A conversation's templated token ids and loss mask, built turn by turn.

        ct = ChatTokens(tokenizer)
        prompt = ct.open_turn(block)          # ids the target must continue
        ct.close_turn(generated_ids, stopped) # its answer, verbatim, mask 1

    Template text between answers is tokenized piecewise (text deltas between successive
    renderings), the generated ids are appended untouched, and the template's end-of-turn
    marker (e.g. "<|im_end|>\\n") follows: its first token is the generated stop token when
    the answer stopped (mask 1: the target produced it), else all of it is added with mask 0.
    """

    def __init__(self, tokenizer, eos_token_ids: Iterable[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DraftsmithError("the target's tokenizer has no chat template; regen needs one")
        self.tok = tokenizer
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.messages: list[dict[str, str]] = []
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.turns: list[dict[str, Any]] = []
        self._text = ""  # rendering of self.messages that self.ids encode
        self._open: tuple[str, list[dict[str, str]]] | None = None

    def _render(self, messages: list[dict[str, str]], gen_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"]) if text else []

    def open_turn(self, block: Sequence[Mapping[str, str]]) -> list[int]:
        """Append `block` (system/user messages) + the generation prompt; return the prompt ids."""
        block = [dict(m) for m in block]
        text_b = self._render(self.messages + block, gen_prompt=True)
        prev = self._text
        if not text_b.startswith(prev):
            prev = self._render(self.messages, gen_prompt=False)  # templates that trim content
            if not text_b.startswith(prev):
                raise DraftsmithError(
                    "the chat template renders earlier turns differently once a new turn is added, "
                    "so turn-by-turn token ids cannot be kept consistent for this conversation")
        delta = self._encode(text_b[len(prev):])
        self._before = (len(self.ids), self._text)
        self.ids += delta
        self.mask += [0] * len(delta)
        self._text = text_b
        self._open = (text_b, block)
        return list(self.ids)

    def cancel_turn(self) -> None:
        """Undo the last open_turn() (e.g. its prompt does not fit the context)."""
        if self._open is None:
            return
        n, text = self._before
        del self.ids[n:], self.mask[n:]
        self._text = text
        self._open = None

    def answer_text(self, generated: Sequence[int], stopped: bool) -> str:
        body = list(generated[:-1]) if stopped and generated and int(generated[-1]) in self.eos else list(generated)
        return self.tok.decode(body, skip_special_tokens=False)

    def close_turn(self, generated: Sequence[int], finish_reason: str, content: str | None = None) -> str:
        """Append the answer's ids (mask 1) and the end-of-turn marker; returns the answer text."""
        if self._open is None:
            raise RuntimeError("close_turn() without open_turn()")
        text_b, block = self._open
        prompt_tokens = len(self.ids)
        generated = [int(t) for t in generated]
        stopped = finish_reason == "stop"
        own_stop = stopped and bool(generated) and generated[-1] in self.eos
        if content is None:
            content = self.answer_text(generated, own_stop)
        # The end-of-turn marker, found by rendering a sentinel answer in this position.
        text_s = self._render(self.messages + block + [{"role": "assistant", "content": _SENTINEL}], False)
        at = text_s.find(_SENTINEL, len(text_b))
        if not text_s.startswith(text_b) or at != len(text_b):
            raise DraftsmithError("the chat template inserts text between the generation prompt and the "
                                  "answer; turn-by-turn token ids cannot be kept consistent")
        closing = self._encode(text_s[at + len(_SENTINEL):])
        if own_stop and closing and closing[0] == generated[-1]:
            closing = closing[1:]  # the target's own stop token is the template's end-of-turn token
        elif stopped and not own_stop and closing and closing[0] in self.eos:
            generated = generated + closing[:1]  # text-only backend: the server's target emitted it
            closing = closing[1:]
        self.ids += generated
        self.mask += [1] * len(generated)
        self.ids += closing
        self.mask += [0] * len(closing)
        self.messages += block + [{"role": "assistant", "content": content}]
        self._text = text_s.replace(_SENTINEL, content, 1)
        self.turns.append({"prompt_tokens": prompt_tokens, "generated_tokens": len(generated),
                           "finish_reason": finish_reason})
        self._open = None
        return content


# ---- output file ----------------------------------------------------------------------


def errors_path(out: Path) -> Path:
    return out.with_name(out.name + ".errors.jsonl")


class JsonlAppender:
    """Append-only JSONL: one write per record, then flush + fsync (a kill loses nothing written)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        self._f.write(line)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def scan_output(path: Path, repair: bool = True) -> tuple[dict[str, dict], int]:
    """Read a regen output for --resume: {id: record}, and bytes of a dropped partial last line.

    Only the last line may be incomplete (append + fsync per record); it is cut off (the file
    is truncated to the last complete record) so the sample is regenerated. A damaged line
    elsewhere means the file was edited or is not a regen output: a clear error.
    """
    done: dict[str, dict] = {}
    path = Path(path)
    if not path.is_file():
        return done, 0
    data = path.read_bytes()
    good_end = 0
    pos = 0
    n = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        n += 1
        line = data[pos:] if nl < 0 else data[pos:nl]
        end = len(data) if nl < 0 else nl + 1
        rec = None
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
            last = data[end:].strip() == b""
            if rec is None or nl < 0 or not isinstance(rec, dict) or "id" not in rec:
                if last:
                    break  # a truncated final record: drop it
                raise DraftsmithError(f"{path}:{n} is not a complete regen record and is not the last line; "
                                      "the file is damaged (fix or remove that line, then --resume)")
            done[str(rec["id"])] = rec
        good_end = end
        pos = end
    dropped = len(data) - good_end
    if dropped and repair:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done, dropped


# ---- the job --------------------------------------------------------------------------


@dataclass
class RegenConfig:
    target: str = "smollm2-135m"
    mix: str = "code:0.4,chat:0.6"
    out: Path = Path("data/regen.jsonl")
    split: str = "train"
    max_samples: int | None = None
    mix_seed: int | None = None  # sample selection seed (default: the sampling seed)
    seed: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int = 256
    max_len: int | None = None  # context limit per turn (prompt + answer); engine default 2048,
    # endpoint default: no local check (the server answers 400 and the sample goes to errors)
    batch_size: int = 8  # built-in engine: conversations in flight
    endpoint: str | None = None
    endpoint_model: str | None = None
    concurrency: int = 8
    retries: int = 3
    request_timeout: float = 120.0
    retry_backoff: float = 0.5
    resume: bool = False
    overwrite: bool = False
    device: str | None = None
    dtype: str | None = None
    progress: bool | None = None  # None = only on a terminal


@dataclass
class RegenSummary:
    written: int = 0
    errors: int = 0
    skipped_done: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    truncated_bytes: int = 0
    error_ids: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class RegenSink:
    """Where backends report: one finished record or one failed conversation at a time."""

    def __init__(self, out: Path, errors: Path, bar, summary: RegenSummary) -> None:
        self.out = JsonlAppender(out)
        self.err = JsonlAppender(errors)
        self.bar = bar
        self.summary = summary
        self.t0 = time.perf_counter()

    def _tick(self) -> None:
        dt = time.perf_counter() - self.t0
        self.bar.update(1)
        if dt > 0:
            self.bar.set_postfix_str(f"{self.summary.generated_tokens / dt:.1f} tok/s", refresh=False)

    def record(self, rec: Mapping[str, Any]) -> None:
        self.out.write(rec)
        self.summary.written += 1
        self.summary.generated_tokens += sum(t["generated_tokens"] for t in rec.get("turns", ()))
        self._tick()

    def error(self, conv, reason: str) -> None:
        self.err.write({"id": conv.id, "source": conv.source, "split": conv.split, "reason": reason,
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.summary.errors += 1
        self.summary.error_ids.append(conv.id)
        self._tick()

    def close(self) -> None:
        self.out.close()
        self.err.close()
        errs = Path(self.err.path)
        if errs.is_file() and errs.stat().st_size == 0:  # no failures: leave no empty errors file
            errs.unlink()


def make_record(conv, ct: ChatTokens, target_info: Mapping[str, Any], sampling: RegenSampling,
                dropped_user_turns: int = 0) -> dict:
    return {
        "id": conv.id, "source": conv.source, "split": conv.split,
        "messages": ct.messages, "input_ids": ct.ids, "loss_mask": ct.mask, "turns": ct.turns,
        "dropped_user_turns": dropped_user_turns, "num_tokens": len(ct.ids),
        "target": dict(target_info), "sampling": sampling.to_dict(),
        "format_version": REGEN_FORMAT_VERSION,
    }


def _prepare_output(cfg: RegenConfig, target_info: Mapping[str, Any], sampling: RegenSampling | None,
                    summary: RegenSummary, run_ids: set[str]) -> set[str]:
    out = Path(cfg.out)
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
        if h and h != target_info.get("weights_hash"):
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
                rid = json.loads(line).get("id")
            except (json.JSONDecodeError, AttributeError):
                continue
            if rid not in run_ids and line.endswith(b"\n"):
                keep.append(line)
        tmp = errs.with_name(f".{errs.name}.tmp")
        tmp.write_bytes(b"".join(keep))
        os.replace(tmp, errs)
    return set(done)


def run_regen(cfg: RegenConfig, conversations: Sequence | None = None, backend=None) -> RegenSummary:
    """Regenerate a mix (or the given conversations) into cfg.out. Returns counters."""
    from tqdm import tqdm

    from draftsmith.data.regen_backends import EndpointBackend, EngineBackend

    if conversations is None:
        from draftsmith.data.sources import load_mix

        conversations = load_mix(cfg.mix, split=cfg.split, max_samples=cfg.max_samples,
                                 seed=cfg.seed if cfg.mix_seed is None else cfg.mix_seed)
    if backend is None:
        backend = EndpointBackend(cfg) if cfg.endpoint else EngineBackend(cfg)
    summary = RegenSummary()
    done = _prepare_output(cfg, backend.target_info, getattr(backend, "sampling", None), summary,
                           {c.id for c in conversations})
    todo = [c for c in conversations if c.id not in done]
    summary.skipped_done = len(conversations) - len(todo)
    bar = tqdm(total=len(todo), unit="sample", desc="regen", file=sys.stderr, dynamic_ncols=True,
               disable=(not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress)
    sink = RegenSink(Path(cfg.out), errors_path(Path(cfg.out)), bar, summary)
    t0 = time.perf_counter()
    try:
        backend.run(todo, sink)
    finally:
        summary.wall_s = time.perf_counter() - t0
        sink.close()
        bar.close()
    return summary


def load_records(path: Path) -> list[dict]:
    """All complete records of a regen output (a truncated last line is ignored)."""
    done, _ = scan_output(path, repair=False)
    return list(done.values())


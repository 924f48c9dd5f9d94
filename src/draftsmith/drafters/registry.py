"""The one registry of drafter kinds: everything that lists, parses, builds or describes a
kind reads it (the CLI's help, `LLM(drafter=...)`, recipes, eval, bench, serve).

A drafter spec is `KIND` or `KIND:ARG`. Built-in kinds:

    none                 plain decoding
    ngram[:SETTINGS]     prompt lookup (drafters/ngram.py); SETTINGS as vLLM names them:
                         ngram:prompt_lookup_min=2,prompt_lookup_max=4 (one alone sets both)
    draft-model:PATH     a smaller model of the same tokenizer (drafters/draft_model.py)
    eagle3:CKPT          trained kinds, from a checkpoint directory (drafters/checkpoint.py)
    dflash:CKPT          or a built-in drafter's name (drafters/builtin.py), e.g.
    dspark:CKPT          dspark:smollm2-135m
    lookup:SPEC          prompt lookup where it finds a match, SPEC's drafter elsewhere
                         (drafters/lookup_first.py), e.g. lookup:dspark:smollm2-135m

A new trainable kind is one file: its config dataclass, `build(target, config) -> model`
(drafters/protocol.py), and a `register(DrafterKind(...))` call; plus a recipe. `register`
is explicit, no import-time discovery: call it before using the kind (tests/unit/toy_kind.py
does, and runs the toy kind through train, generate and eval). `auto_dtype=True` says its
inference casts the target's features to its own dtype, so that `--drafter-dtype auto` may run
it in bfloat16 beside a float32 target (drafters/precision.py).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.drafters import builtin, dflash, dspark, eagle3
from draftsmith.drafters.base import Drafter, NoDrafter
from draftsmith.drafters.checkpoint import load_trained_drafter, load_trained_model, read_checkpoint_config
from draftsmith.drafters.draft_model import DraftModelDrafter
from draftsmith.drafters.kind_config import config_from_dict
from draftsmith.drafters.lookup_first import LookupFirstDrafter
from draftsmith.drafters.ngram import NgramConfig, NgramDrafter
from draftsmith.drafters.precision import drafter_dtype
from draftsmith.errors import DraftsmithError
from draftsmith.models.target import load_target

# load(arg, target: LoadedTarget, max_rows, max_len, dtype) -> Drafter; arg is the text after
# "KIND:", dtype the torch dtype a model drafter computes in (drafters/precision.py)
Loader = Callable[[str, Any, int, int, torch.dtype], Drafter]


@dataclass(frozen=True)
class DrafterKind:
    """One drafter kind. Trainable kinds have `config_cls` and `build`, and load from a
    checkpoint directory; their default K is the checkpoint's block size / TTT depth."""

    name: str
    usage: str  # how the spec is written, e.g. "dspark:CKPT"
    summary: str  # one line for --help
    load: Loader
    config_cls: type | None = None  # trainable: the typed config a recipe's `drafter:` fills
    build: Callable[..., Any] | None = None  # trainable: build(target Decoder, config) -> model
    needs_arg: bool = False  # the spec must carry ":ARG"
    # a kind without needs_arg takes ":ARG" only where it has this: ARG's check before anything
    # loads (ngram's settings); elsewhere ":ARG" is an error
    check_arg: Callable[[str], Any] | None = None
    wrap: Callable[[Drafter], Drafter] | None = None  # ARG is another drafter's spec; this wraps it
    # dtype "auto" may run it in another dtype than the target's (drafters/precision.py): its
    # inference casts the target's features to its own dtype. A kind without it gets the target's
    # dtype under "auto", and an explicit --drafter-dtype as given
    auto_dtype: bool = False

    @property
    def trainable(self) -> bool:
        return self.config_cls is not None

    def default_k(self, config: Mapping[str, Any] | None, fallback: int = 7) -> int:
        """γ for evaluation: a trained checkpoint's block size (DFlash / DSpark) or TTT depth
        (EAGLE-3), else `fallback`."""
        for key in ("block_size", "ttt_steps"):
            v = (config or {}).get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return fallback


def _none(arg: str, target, max_rows: int, max_len: int, dtype: torch.dtype) -> Drafter:
    return NoDrafter()


NGRAM_SETTINGS = {"prompt_lookup_min": "min_ngram", "prompt_lookup_max": "max_ngram"}  # vLLM's names -> NgramConfig


def ngram_config(arg: str) -> NgramConfig:
    """NgramConfig of `ngram:ARG`, ARG = `prompt_lookup_min=N,prompt_lookup_max=M` (n-gram sizes
    >= 1, min <= max; one of them alone sets both, as vLLM reads them) or empty (1..3)."""
    values: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in arg.split(","))):
        key, eq, raw = (x.strip() for x in item.partition("="))
        if not eq or key not in NGRAM_SETTINGS:
            raise DraftsmithError(f"drafter ngram:{arg}: expected ngram:KEY=N[,KEY=N] with KEY one of "
                                  f"{', '.join(NGRAM_SETTINGS)}, got {item!r}")
        if NGRAM_SETTINGS[key] in values:
            raise DraftsmithError(f"drafter ngram:{arg} sets {key} twice")
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise DraftsmithError(f"drafter ngram:{arg}: {key} must be an integer >= 1 (an n-gram size), got {raw!r}")
        values[NGRAM_SETTINGS[key]] = int(raw)
    if len(values) == 1:  # one given: the other equals it (vLLM's rule)
        (n,) = values.values()
        values = {"min_ngram": n, "max_ngram": n}
    config = NgramConfig(**values)
    if config.min_ngram > config.max_ngram:
        raise DraftsmithError(f"drafter ngram:{arg}: prompt_lookup_min {config.min_ngram} is above prompt_lookup_max "
                              f"{config.max_ngram}")
    return config


def _ngram(arg: str, target, max_rows: int, max_len: int, dtype: torch.dtype) -> Drafter:
    return NgramDrafter(ngram_config(arg))


def _draft_model(arg: str, target, max_rows: int, max_len: int, dtype: torch.dtype) -> Drafter:
    try:
        draft = load_target(arg, device=str(target.model.device), dtype=str(dtype).removeprefix("torch."))
    except DraftsmithError as e:  # (load_target speaks of a target; here the model is the drafter)
        raise DraftsmithError(f"drafter draft-model:{arg}: {e}") from None
    return DraftModelDrafter(draft.model, target.model.config.vocab_size, max_rows, max_len)


def _wrapping(wrap: Callable[[Drafter], Drafter]) -> Loader:
    """The loader of a wrapping kind: build the inner spec's drafter, then wrap it."""
    def load(arg: str, target, max_rows: int, max_len: int, dtype: torch.dtype) -> Drafter:
        return wrap(build_drafter(arg, target, max_rows, max_len, dtype))
    return load


def checkpoint_loader(name: str) -> Loader:
    """The loader of a trainable kind: its checkpoint directory (drafters/checkpoint.py) -> Drafter."""
    def load(arg: str, target, max_rows: int, max_len: int, dtype: torch.dtype) -> Drafter:
        return load_trained_drafter(arg, target, max_rows, max_len, get(name, trainable=True), dtype)
    return load


_KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind, replace: bool = False) -> DrafterKind:
    """Add a kind (or, with replace=True, swap one). Returns it."""
    if kind.name in _KINDS and not replace:
        raise DraftsmithError(f"drafter kind {kind.name!r} is already registered")
    if ":" in kind.name or not kind.name:
        raise DraftsmithError(f"a drafter kind name must be non-empty and without ':' (got {kind.name!r})")
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


for _k in (
    DrafterKind("none", "none", "plain decoding, no drafter", _none),
    DrafterKind("ngram", "ngram[:prompt_lookup_min=N,prompt_lookup_max=M]",
                "prompt lookup: copy what followed the last n-gram seen before", _ngram, check_arg=ngram_config),
    DrafterKind("draft-model", "draft-model:PATH", "a smaller model with the target's tokenizer (alias or HF dir)",
                _draft_model, needs_arg=True, auto_dtype=True),
    DrafterKind("eagle3", "eagle3:CKPT", "EAGLE-3 head trained by `draftsmith train`", checkpoint_loader("eagle3"),
                eagle3.Eagle3Config, eagle3.build, needs_arg=True, auto_dtype=True),
    DrafterKind("dflash", "dflash:CKPT", "DFlash block drafter trained by `draftsmith train`", checkpoint_loader("dflash"),
                dflash.DFlashConfig, dflash.build, needs_arg=True, auto_dtype=True),
    DrafterKind("dspark", "dspark:CKPT", "DSpark block drafter + Markov head + confidence head", checkpoint_loader("dspark"),
                dspark.DSparkConfig, dspark.build, needs_arg=True, auto_dtype=True),
    DrafterKind("lookup", "lookup:SPEC", "prompt lookup where the last 2-3 tokens occurred before, SPEC's drafter "
                "elsewhere (e.g. lookup:dspark:smollm2-135m)", _wrapping(LookupFirstDrafter), needs_arg=True,
                wrap=LookupFirstDrafter),
):
    register(_k)


def kinds() -> Mapping[str, DrafterKind]:
    """All registered kinds (read-only view, registration order)."""
    return types.MappingProxyType(_KINDS)


def trainable_kinds() -> Mapping[str, DrafterKind]:
    return types.MappingProxyType({n: k for n, k in _KINDS.items() if k.trainable})


def get(name: str, trainable: bool = False) -> DrafterKind:
    table = trainable_kinds() if trainable else kinds()
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = "trainable drafter kind" if trainable else "drafter kind"
        raise DraftsmithError(f"unknown {what} {name!r}{hint}; known: {', '.join(table)}")
    return table[name]


def parse_spec(spec: str) -> tuple[DrafterKind, str]:
    """`KIND[:ARG]` -> (kind, arg), with a clear error for an unknown kind or a missing ARG."""
    name, _, arg = spec.partition(":")
    kind = get(name)

    def shipped() -> str:
        specs = builtin.builtin_specs(name) if kind.trainable else []
        return f" (built-in: {', '.join(specs)})" if specs else ""

    if kind.needs_arg and not arg:
        raise DraftsmithError(f"drafter {name} needs an argument: --drafter {kind.usage}{shipped()}")
    if arg and not (kind.needs_arg or kind.check_arg):
        raise DraftsmithError(f"drafter {name} takes no argument (got {spec!r}); use --drafter {name}")
    if kind.check_arg is not None:
        kind.check_arg(arg)
    if kind.wrap is not None:
        inner, _ = parse_spec(arg)  # checked now, with the inner kind's own errors
        if inner.wrap is not None or inner.name == "none":
            raise DraftsmithError(f"drafter {spec}: {name} wraps a drafter (e.g. {name}:dspark:smollm2-135m), "
                                  f"not {inner.name!r}")
    if kind.trainable:
        arg = builtin.resolve(name, arg)
        if not Path(arg).exists():
            raise DraftsmithError(f"drafter {spec}: no checkpoint directory {arg!r} and no built-in drafter of that "
                                  f"name{shipped()}; train one with `draftsmith train`")
    return kind, arg


def build_drafter(spec: str, target, max_rows: int, max_len: int, dtype: str | torch.dtype | None = "auto") -> Drafter:
    """A ready Drafter for a LoadedTarget from a spec string; a model drafter computes in
    `dtype` ("auto", a dtype name or a torch dtype: drafters/precision.py)."""
    kind, arg = parse_spec(spec)
    if kind.wrap is not None:  # the wrapped spec's kind decides what "auto" means for it
        return kind.wrap(build_drafter(arg, target, max_rows, max_len, dtype))
    return kind.load(arg, target, max_rows, max_len, resolve_dtype(dtype, target, kind))


def resolve_dtype(dtype: str | torch.dtype | None, target, kind: DrafterKind | None = None) -> torch.dtype:
    """The torch dtype a drafter of `kind` computes in beside `target` (drafters/precision.py);
    "auto" is the target's dtype for a kind that does not declare `auto_dtype`."""
    if kind is not None and not kind.auto_dtype and (dtype is None or dtype == "auto"):
        return target.model.dtype
    return drafter_dtype(dtype, target.model.dtype, target.model.device)


def usage() -> str:
    """Spec forms for --help: 'none | ngram | draft-model:PATH | eagle3:CKPT | ...', then the
    built-in drafters."""
    forms = " | ".join(k.usage for k in _KINDS.values())
    shipped = builtin.builtin_specs()
    return forms + (f"; built-in: {', '.join(shipped)}" if shipped else "")


def config_for(data: Mapping[str, Any]):
    """The typed config of the trainable kind named by data["kind"], from plain data."""
    if "kind" not in data:
        raise DraftsmithError(f"drafter config has no 'kind'; choose one of {', '.join(trainable_kinds())}")
    kind = get(str(data["kind"]), trainable=True)
    return config_from_dict(data, kind.config_cls, kind.name)


def load_checkpoint_model(ckpt_dir: str | Path, target):
    """The trained model in a checkpoint directory, whatever its kind, on a LoadedTarget."""
    kind = get(str(read_checkpoint_config(ckpt_dir)["kind"]), trainable=True)
    return load_trained_model(ckpt_dir, target, kind)


def load_checkpoint(ckpt_dir: str | Path, target, max_rows: int, max_len: int,
                    dtype: str | torch.dtype | None = None) -> Drafter:
    """A ready Drafter from a checkpoint directory, whatever its kind (calibration included),
    computing in `dtype` (default: the target's; "auto": drafters/precision.py)."""
    kind = get(str(read_checkpoint_config(ckpt_dir)["kind"]), trainable=True)
    return load_trained_drafter(ckpt_dir, target, max_rows, max_len, kind,
                                None if dtype is None else resolve_dtype(dtype, target, kind))

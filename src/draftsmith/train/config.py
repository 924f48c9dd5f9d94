"""The training configuration: a recipe YAML + `key=value` overrides -> a frozen `TrainConfig`.

Pydantic checks the recipe at the I/O boundary (unknown field, wrong type, out-of-range
value -> one clear `DraftsmithError` naming the dotted field); inside, the trainer only
sees frozen dataclasses. A recipe looks like:

    target: smollm2-135m             # built-in alias or HF-format model dir
    out: runs/smollm2-135m-dspark    # run directory (checkpoints, metrics.jsonl)
    drafter:                         # `kind` + the fields of that kind's Config dataclass
      kind: dspark
      block_size: 7
    data:
      cache: data/smollm2-135m/cache # offline features (`draftsmith cache`) ...
      online: false                  # ... or run the target on the fly over `regen`
      regen: data/smollm2-135m/regen.jsonl
    train:
      lr: 6.0e-4
      ...

The drafter section is validated against the kind's own `Config` dataclass from the
registry of drafter kinds (drafters/registry.py), so every kind's options are typed in
one place, next to the model code. Layer ids are checked against the target's depth.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from draftsmith.drafters.registry import trainable_kinds
from draftsmith.engine.speculative_config import MAX_SPECULATIVE_TOKENS
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import read_config
from draftsmith.models.registry import resolve_target

# ---- the catalogue of trainable kinds --------------------------------------------------


def trained_catalogue() -> Mapping[str, Any]:
    """The registered trainable kinds (drafters/registry.py): name -> DrafterKind, which has
    the `config_cls` and `build` the trainer needs."""
    return trainable_kinds()


Catalogue = Mapping[str, Any]  # name -> anything with config_cls and build(target, config)


# ---- frozen config seen by the trainer --------------------------------------------------


@dataclass(frozen=True)
class DataConfig:
    cache: Path | None  # offline feature cache directory
    online: bool  # compute features with the target on the fly
    regen: Path | None  # regenerated JSONL (needed when online)
    max_len: int  # tokens per training window
    max_samples: int | None  # use at most this many training samples
    online_batch: int  # records per target forward when online
    eval_cache: Path | None = None  # feature cache whose held-out samples are evaluated during training
    eval_samples: int = 64  # held-out samples evaluated (the first, in a fixed order)


@dataclass(frozen=True)
class OptimConfig:
    seed: int
    device: str
    dtype: Literal["auto", "fp32", "bf16"]
    batch_size: int  # global: samples per optimizer step, summed over processes
    epochs: float
    max_steps: int | None
    lr: float
    min_lr_ratio: float
    warmup_ratio: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    log_every: int
    save_every: int
    keep_checkpoints: int
    budget_minutes: float | None
    budget_clock: Literal["wall", "cpu"]
    tensorboard: Literal["auto", "on", "off"]
    progress: Literal["auto", "on", "off"]
    ddp_find_unused: bool
    threads: int | None
    init_from: str | None = None  # start from a trained drafter's weights (a directory or KIND:NAME)


@dataclass(frozen=True)
class TrainConfig:
    target: str
    out: Path
    kind: str
    drafter: Any  # the kind's frozen Config dataclass instance
    data: DataConfig
    train: OptimConfig

    def to_dict(self) -> dict[str, Any]:
        """Plain, YAML/JSON-ready form (round-trips through `parse_config`)."""
        drafter = {k: v for k, v in _plain(dataclasses.asdict(self.drafter)).items() if k != "kind"}
        return {"target": self.target, "out": str(self.out), "drafter": {"kind": self.kind, **drafter},
                "data": _plain(dataclasses.asdict(self.data)), "train": _plain(dataclasses.asdict(self.train))}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


# ---- pydantic schema at the boundary ----------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _DataSection(_Strict):
    cache: Path | None = Field(None, description="offline feature cache dir (draftsmith cache)")
    online: bool = Field(False, description="compute target features on the fly (no cache)")
    regen: Path | None = Field(None, description="regenerated JSONL, read when online")
    max_len: int = Field(512, ge=8, description="tokens per training window")
    max_samples: int | None = Field(None, ge=1, description="cap on training samples")
    online_batch: int = Field(4, ge=1, description="records per target forward when online")
    eval_cache: Path | None = Field(None, description="feature cache of held-out conversations, evaluated "
                                    "at every checkpoint (teacher-forced acceptance)")
    eval_samples: int = Field(64, ge=1, description="held-out samples evaluated")


_Beta = Annotated[float, Field(ge=0, lt=1)]  # AdamW's: 0 <= beta < 1


class _TrainSection(_Strict):
    seed: int = 0
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto")
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "fp32", description="autocast dtype of the drafter's compute (auto: bf16 on CUDA and on CPUs with "
        "bf16 hardware, else fp32)")
    batch_size: int = Field(8, ge=1, description="samples per step, over all processes")
    epochs: float = Field(1.0, gt=0, allow_inf_nan=False)
    max_steps: int | None = Field(None, ge=1, description="overrides epochs when set")
    lr: float = Field(6e-4, gt=0, allow_inf_nan=False)
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_ratio: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    betas: tuple[_Beta, _Beta] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)  # inf: no clipping
    log_every: int = Field(10, ge=1)
    save_every: int = Field(200, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    budget_minutes: float | None = Field(None, gt=0, allow_inf_nan=False,
                                         description="training budget in minutes (sets the step count)")
    budget_clock: Literal["wall", "cpu"] = Field(
        "wall", description="what the budget counts: wall clock, or this process's CPU time (all its threads, "
                            "summed over resumes): runs that share a machine get equal work, not equal hours")
    tensorboard: Literal["auto", "on", "off"] = "auto"
    progress: Literal["auto", "on", "off"] = "auto"
    ddp_find_unused: bool = False
    threads: int | None = Field(None, ge=1, description="CPU threads per process, at most the machine's CPUs "
                                "(more: its CPUs, with a warning; None: torch's default)")
    init_from: str | None = Field(None, description="start from this trained drafter's weights (a run or checkpoint "
                                  "directory, or a built-in KIND:NAME) with a fresh optimizer and schedule: "
                                  "fine-tune on more or other data")

    @field_validator("tensorboard", "progress", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        """YAML 1.1 reads the words `on` / `off` (train.progress=off, `tensorboard: off`) as booleans."""
        return ("on" if v else "off") if isinstance(v, bool) else v


class _Root(_Strict):
    target: str = "smollm2-135m"
    out: Path
    drafter: dict[str, Any]
    data: _DataSection = Field(default_factory=_DataSection)
    train: _TrainSection = Field(default_factory=_TrainSection)


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _kind_schema(kind: str, config_cls: type) -> type[BaseModel]:
    """A pydantic model with the fields, types and defaults of a kind's Config dataclass."""
    hints = typing.get_type_hints(config_cls)
    fields: dict[str, Any] = {}
    for name, f in _init_fields(config_cls).items():
        if name == "kind":
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = ...
        fields[name] = (hints.get(name, Any), default)
    return create_model(f"{kind}_drafter", __config__=ConfigDict(extra="forbid"), **fields)


def _where(loc: Sequence[Any]) -> str:
    return ".".join(str(x) for x in loc) or "(top level)"


def _format_errors(err: ValidationError, prefix: str, known: Mapping[str, Sequence[str]]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = _where((prefix, *loc) if prefix else loc)
        if e["type"] == "extra_forbidden":
            section = _where(((prefix,) if prefix else ()) + loc[:-1])
            names = known.get(section, ())
            close = difflib.get_close_matches(str(loc[-1]), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{where}: unknown field{hint} (known: {', '.join(names)})")
        elif e["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            got = e.get("input")
            lines.append(f"{where}: {e['msg']} (got {got!r})")
    return "; ".join(lines)


def _known_fields() -> dict[str, list[str]]:
    return {"(top level)": list(_Root.model_fields), "data": list(_DataSection.model_fields),
            "train": list(_TrainSection.model_fields)}


# ---- overrides --------------------------------------------------------------------------


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`a.b=value` pairs set nested keys; values are parsed as YAML (1e-3, true, [1, 2], null)."""
    out = _deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            raise DraftsmithError(f"override {item!r} is not of the form key=value (e.g. train.lr=3e-4)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            parsed = value
        except RecursionError:
            raise DraftsmithError(f"override {key}=…: the value is nested too deeply to read") from None
        _check_tree(parsed, f"override {key}=…")
        if isinstance(parsed, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                parsed = float(parsed) if parsed.strip().lower() not in ("nan", "inf", "-inf", "infinity") else parsed
            except ValueError:
                pass
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise DraftsmithError(f"override {item!r}: {p!r} is a value, not a section")
            node = nxt
        node[parts[-1]] = parsed
    return out


MAX_K = MAX_SPECULATIVE_TOKENS  # the longest draft generate / serve / bench / profile take (-k)

_MAX_DEPTH = 32  # a recipe is sections of values and short lists
_MAX_VALUES = 100_000  # values after expanding aliases (an alias repeated inside aliases grows exponentially)


def _check_tree(node: Any, where: str) -> None:
    """Refuse what YAML aliases can build and a recipe never needs, before anything recurses into
    it: a list or mapping that contains itself (`a: &a [*a]`: a RecursionError otherwise), deep
    nesting, and aliases that expand to more values than memory holds."""
    memo: dict[int, int] = {}  # id -> values under it: a shared node is counted once
    on_path: set[int] = set()

    def measure(n: Any) -> int:
        if not isinstance(n, (dict, list)):
            return 1
        key = id(n)
        if key in on_path:
            raise DraftsmithError(f"{where}: a YAML alias refers to a list or mapping that contains it (e.g. "
                                  "`a: &a [*a]`); write the value out instead")
        if key not in memo:
            if len(on_path) >= _MAX_DEPTH:
                raise DraftsmithError(f"{where} is nested more than {_MAX_DEPTH} levels deep; a recipe holds "
                                      "sections of plain values")
            on_path.add(key)
            values = 1
            for child in (n.values() if isinstance(n, dict) else n):
                values += measure(child)
                if values > _MAX_VALUES:
                    raise DraftsmithError(f"{where} expands to more than {_MAX_VALUES} values (aliases repeated "
                                          "inside aliases); write the recipe out")
            on_path.discard(key)
            memo[key] = values
        return memo[key]

    measure(node)


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


# ---- the entry points -------------------------------------------------------------------


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise DraftsmithError(f"recipe {path} is a directory; give the recipe YAML file "
                              "(e.g. recipes/smollm2-135m-dspark.yaml)")
    if not path.is_file():
        raise DraftsmithError(f"recipe {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise DraftsmithError(f"recipe {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError:
        raise DraftsmithError(f"recipe {path} is not UTF-8 text; give a recipe YAML file "
                              "(e.g. recipes/smollm2-135m-dspark.yaml)") from None
    except RecursionError:
        raise DraftsmithError(f"recipe {path} is nested too deeply to read; a recipe holds sections of plain "
                              "values") from None
    _check_tree(raw, f"recipe {path}")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DraftsmithError(f"recipe {path} must be a mapping of sections (target, out, drafter, data, train)")
    return raw


def parse_config(raw: Mapping[str, Any], catalogue: Catalogue | None = None, source: str = "config",
                 num_layers: int | None = None) -> TrainConfig:
    """Validate a plain dict (a recipe after overrides) into a frozen `TrainConfig`.

    `num_layers` (the target's depth), when given, bounds every layer id.
    """
    try:
        root = _Root.model_validate(dict(raw))
    except ValidationError as e:
        raise DraftsmithError(f"{source}: {_format_errors(e, '', _known_fields())}") from None
    cat = trained_catalogue() if catalogue is None else catalogue
    section = dict(root.drafter)
    kind = section.pop("kind", None)
    if kind is None:
        raise DraftsmithError(f"{source}: drafter.kind is missing; choose one of {', '.join(sorted(cat))}")
    if kind not in cat:
        close = difflib.get_close_matches(str(kind), list(cat), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DraftsmithError(f"{source}: drafter.kind {kind!r} is not a trainable kind{hint}; "
                              f"choose one of {', '.join(sorted(cat))}")
    entry = cat[kind]
    schema = _kind_schema(kind, entry.config_cls)
    try:
        checked = schema.model_validate(section)
    except ValidationError as e:
        known = {"drafter": ["kind", *schema.model_fields]}
        raise DraftsmithError(f"{source}: {_format_errors(e, 'drafter', known)}") from None
    values = {k: getattr(checked, k) for k in schema.model_fields}
    _check_drafter_values(values, num_layers, source)
    if "kind" in _init_fields(entry.config_cls):
        values["kind"] = kind
    try:
        drafter = entry.config_cls(**values)
    except (TypeError, ValueError, DraftsmithError) as e:  # the kind's own __post_init__ checks
        raise DraftsmithError(f"{source}: drafter: {e}") from None
    d, t = root.data, root.train
    if d.online and d.regen is None:
        raise DraftsmithError(f"{source}: data.online=true needs data.regen=<regenerated JSONL>")
    if not d.online and d.cache is None:
        raise DraftsmithError(f"{source}: set data.cache=<feature cache dir> (draftsmith cache), "
                              "or data.online=true with data.regen=<regen JSONL>")
    return TrainConfig(
        target=root.target, out=root.out, kind=kind, drafter=drafter,
        data=DataConfig(cache=d.cache, online=d.online, regen=d.regen, max_len=d.max_len,
                        max_samples=d.max_samples, online_batch=d.online_batch, eval_cache=d.eval_cache,
                        eval_samples=d.eval_samples),
        train=OptimConfig(**t.model_dump()),
    )


def _check_drafter_values(values: Mapping[str, Any], num_layers: int | None, source: str) -> None:
    """Checks common to every kind, with messages that name the field."""
    for name, v in values.items():
        if name == "block_size" or name.endswith("_block_size"):
            if v is not None and int(v) < 1:
                raise DraftsmithError(f"{source}: drafter.{name} must be >= 1 (draft tokens per block), got {v}")
        if name in ("block_size", "ttt_steps") and v is not None and int(v) > MAX_K:
            # the drafter's K where it is used: generate / serve / profile take K up to MAX_K (a larger
            # one had generate profile the SPS(B) table for minutes)
            raise DraftsmithError(f"{source}: drafter.{name} must be at most {MAX_K} (the draft length K it "
                                  f"sets on generate / serve / bench), got {v}")
        if name.endswith("_weight") and isinstance(v, float) and not math.isfinite(v):
            # (a loss weight of inf / nan was 'loss is inf at step 0; lower train.lr' after the target loaded)
            raise DraftsmithError(f"{source}: drafter.{name} must be a finite number, got {v}")
        if name == "layer_ids" or name.endswith("layer_ids"):
            if v is None:
                continue
            ids = [v] if isinstance(v, int) else list(v)
            if num_layers is not None:
                bad = [i for i in ids if not 0 <= int(i) < num_layers]
                if bad:
                    raise DraftsmithError(
                        f"{source}: drafter.{name} {bad} out of range: the target has {num_layers} "
                        f"layers (0-based ids 0..{num_layers - 1})")
            if len(set(ids)) != len(ids):
                raise DraftsmithError(f"{source}: drafter.{name} repeats a layer: {ids}")


def target_num_layers(target: str) -> int:
    """Depth of a target from its config.json (no weights loaded)."""
    _, path = resolve_target(target)
    return read_config(path).num_layers


def load_train_config(recipe: str | Path | None, overrides: Sequence[str] = (), budget_minutes: float | None = None,
                      catalogue: Catalogue | None = None, check_target: bool = True) -> TrainConfig:
    """Recipe file (or None: overrides only) + overrides + --budget -> checked TrainConfig."""
    raw = read_recipe(recipe) if recipe is not None else {}
    raw = apply_overrides(raw, overrides)
    if budget_minutes is not None:
        raw = apply_overrides(raw, [f"train.budget_minutes={budget_minutes}"])
    source = str(recipe) if recipe is not None else "config"
    cfg = parse_config(raw, catalogue, source)  # types first: clear errors before touching the target
    if check_target:
        cfg = parse_config(raw, catalogue, source, num_layers=target_num_layers(cfg.target))
    return cfg

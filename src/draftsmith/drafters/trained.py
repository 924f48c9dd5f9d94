"""The explicit, immutable catalogue of trainable drafter kinds, and their checkpoints.

    kind      config class     build(target: Decoder, config) -> model
    eagle3    Eagle3Config     drafters/eagle3.py
    dflash    DFlashConfig     drafters/dflash.py
    dspark    DSparkConfig     drafters/dspark.py

A model's `config` is the resolved one (feature layers and mask token filled in for its
target); that is what a checkpoint stores, so loading never re-derives a default.

Checkpoint directory (train/protocol.py): config.json ({"kind", "target_id",
"target_weights_hash", "format_version", ...config}), model.safetensors (trainable
parameters and persistent buffers only; the target's embedding / lm_head are not in it),
optional calibration.json ({"temperatures": [T_1, ..., T_γ], ...}: STS, applied to DSpark
confidences at inference), train_state/ (the trainer's).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from draftsmith.drafters import dflash, dspark, eagle3
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import Decoder
from draftsmith.tensorfile import load_tensors, save_tensors
from draftsmith.train.checkpoint import restore_state

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class TrainedKind:
    name: str
    config_cls: type
    build: Callable[[Decoder, Any], nn.Module]


CATALOGUE: Mapping[str, TrainedKind] = types.MappingProxyType({
    "eagle3": TrainedKind("eagle3", eagle3.Eagle3Config, eagle3.build),
    "dflash": TrainedKind("dflash", dflash.DFlashConfig, dflash.build),
    "dspark": TrainedKind("dspark", dspark.DSparkConfig, dspark.build),
})


def trained_kind(name: str) -> TrainedKind:
    if name not in CATALOGUE:
        raise DraftsmithError(f"unknown drafter kind {name!r}; trainable kinds: {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


# ---------------------------------------------------------------------------- configs


def config_from_dict(data: Mapping[str, Any], kind: str | None = None):
    """A typed config from plain data (JSON / YAML): unknown fields and wrong types are
    DraftsmithErrors naming the field. `kind` defaults to data["kind"]."""
    kind = kind or data.get("kind")
    if kind is None:
        raise DraftsmithError(f"drafter config has no 'kind'; choose one of {', '.join(CATALOGUE)}")
    cls = trained_kind(str(kind)).config_cls
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftsmithError(f"{kind} config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    values = {}
    for key, raw in data.items():
        values[key] = _coerce(f"{kind} config field {key!r}", hints[key], raw)
    if values.get("kind", kind) != kind:
        raise DraftsmithError(f"config kind {values['kind']!r} does not match {kind!r}")
    return cls(**values)


def config_to_dict(config) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def _coerce(what: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(what, a, value)
            except DraftsmithError as e:
                errors.append(str(e))
        raise DraftsmithError(errors[0] if errors else f"{what}: got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise DraftsmithError(f"{what} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise DraftsmithError(f"{what} must be a list, got {value!r}")
        return tuple(_coerce(what, args[0], v) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise DraftsmithError(f"{what} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DraftsmithError(f"{what} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DraftsmithError(f"{what} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise DraftsmithError(f"{what} must be a string, got {value!r}")
        return value
    return value


def resolve_for_target(config, target) -> Any:
    """Fill tokenizer-dependent defaults from a LoadedTarget before `build` (the trainer's
    step): block drafters get the mask token of `block.choose_mask_token_id(V, tokenizer)`
    instead of the tokenizer-free fallback (the last vocabulary row)."""
    from draftsmith.drafters.block import choose_mask_token_id

    if getattr(config, "mask_token_id", 0) is None:
        v = target.model.config.vocab_size
        return dataclasses.replace(config, mask_token_id=choose_mask_token_id(v, target.tokenizer))
    return config


# ---------------------------------------------------------------------------- checkpoints


def save_trained_drafter(model: nn.Module, ckpt_dir: str | Path, target_id: str, target_weights_hash: str) -> Path:
    """Write config.json + model.safetensors into ckpt_dir, each atomically (temp + rename).
    Leaves calibration.json and train_state/ alone."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"kind": model.config.kind, "target_id": target_id, "target_weights_hash": target_weights_hash,
           "format_version": FORMAT_VERSION, **config_to_dict(model.config)}
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _atomic(d / WEIGHTS_FILE, lambda p: save_tensors(p, state, metadata={"format": "pt", "kind": cfg["kind"]}))
    _atomic(d / CONFIG_FILE, lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    return d


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_checkpoint_config(ckpt_dir: str | Path) -> dict[str, Any]:
    d = Path(ckpt_dir)
    f = d / CONFIG_FILE
    if not f.is_file():
        raise DraftsmithError(f"{d} is not a drafter checkpoint: it has no {CONFIG_FILE}")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{f} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict) or "kind" not in raw:
        raise DraftsmithError(f"{f} has no 'kind'; not a drafter checkpoint")
    version = raw.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise DraftsmithError(f"{f} has format_version {version}; this Draftsmith reads version {FORMAT_VERSION}")
    return raw


def read_calibration(ckpt_dir: str | Path) -> tuple[float, ...] | None:
    """STS temperatures from calibration.json, or None when the checkpoint has none."""
    f = Path(ckpt_dir) / CALIBRATION_FILE
    if not f.is_file():
        return None
    try:
        raw = json.loads(f.read_text())
        temps = tuple(float(t) for t in raw["temperatures"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise DraftsmithError(
            f"{f} is not a calibration file: expected {{\"temperatures\": [T_1, ...]}}; re-run draftsmith calibrate"
        ) from None
    if not temps or any(not (t > 0 and math.isfinite(t)) for t in temps):
        raise DraftsmithError(f"{f}: temperatures must be positive numbers, got {list(temps)}")
    return temps


def check_target(raw: Mapping[str, Any], target_id: str, weights_hash: str | None, where: str) -> None:
    """Refuse a checkpoint trained for another target. Same weights (hash) pass even when the
    directory was renamed; without a stored hash, the target ids must agree."""
    ck_id, ck_hash = raw.get("target_id"), raw.get("target_weights_hash")
    same = (ck_hash == weights_hash) if (ck_hash and weights_hash) else (ck_id == target_id)
    if not same:
        raise DraftsmithError(
            f"drafter checkpoint {where} was trained for target {ck_id!r} (weights {ck_hash}), "
            f"not for {target_id!r} (weights {weights_hash}); use a drafter trained for this target"
        )


def load_trained_model(ckpt_dir: str | Path, target) -> nn.Module:
    """Rebuild a trained model on a LoadedTarget (refusing other targets) and load its weights."""
    d = Path(ckpt_dir)
    raw = read_checkpoint_config(d)
    check_target(raw, target.target_id, getattr(target, "weights_hash", None), str(d))
    kind = trained_kind(str(raw["kind"]))
    fields = {f.name for f in dataclasses.fields(kind.config_cls)}
    config = config_from_dict({k: v for k, v in raw.items() if k in fields}, kind.name)
    model = kind.build(target.model, config)
    f = d / WEIGHTS_FILE
    if not f.is_file():
        raise DraftsmithError(f"{d} has no {WEIGHTS_FILE}; the checkpoint is incomplete")
    restore_state(model, load_tensors(f, "drafter checkpoint"), d)
    return model.to(device=target.model.device, dtype=target.model.dtype).eval()


def load_trained_drafter(ckpt_dir: str | Path, target, max_rows: int, max_len: int):
    """A ready Drafter from a checkpoint directory for a LoadedTarget (with calibration.json's
    STS temperatures when present)."""
    model = load_trained_model(ckpt_dir, target)
    return model.make_drafter(target.model, max_rows, max_len, temperatures=read_calibration(ckpt_dir))

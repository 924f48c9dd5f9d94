"""A trained drafter's checkpoint directory: the one place that reads and writes it.

    config.json         {"kind", "target_id", "target_weights_hash", "format_version", ...config}
    model.safetensors   the drafter's state dict (trainable parameters + persistent buffers;
                        the target's embedding / lm_head are shared, not saved)
    calibration.json    optional: {"temperatures": [T_1, ..., T_γ], "regime": "greedy" | "sampled"}
                        (STS, `draftsmith calibrate`; the regime: the rounds it was fitted on, T = 0 or
                        T > 0, and the rows it applies to; a file without one applies to every row)
    train_state/        the trainer's, for an exact resume (train/checkpoint.py)

Which target a checkpoint fits (`check_target`), for every command alike (generate, serve,
eval, bench, calibrate, train --resume): **the weights decide.** When both the checkpoint and
the target carry a weights hash (a content hash of the target's tensors), they must be equal:
the same weights under another directory name or alias pass, and a model changed in place
under the same name is refused. Only when either side has no hash do the target ids decide.

A foreign drafter directory (speculators, DeepSpec, z-lab DFlash; export/detect.py) given as
`KIND:DIR` is imported in memory (export/importing.py checks it against the target instead),
and `read_checkpoint_config` describes it by its kind and draft length.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.drafters.calibration import STSFit, sts_regime
from draftsmith.drafters.kind_config import config_from_dict, config_to_dict
from draftsmith.errors import DraftsmithError
from draftsmith.export.detect import foreign_format, foreign_summary
from draftsmith.fileio import atomic_write
from draftsmith.models.loading import same_weights
from draftsmith.tensorfile import load_tensors, save_tensors

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CALIBRATION_FILE = "calibration.json"
# Config fields added after format 1 changed a default: what a checkpoint written without
# the field meant (read_checkpoint_config fills it in, so loading and resuming see it).
LEGACY_FIELDS: dict[str, dict[str, Any]] = {"dflash": {"layout": "mask-first"}}


def checkpoint_config(kind: str, drafter_config: Any, target_id: str, weights_hash: str) -> dict[str, Any]:
    """config.json: the target's identity + the kind's config fields."""
    fields = config_to_dict(drafter_config) if dataclasses.is_dataclass(drafter_config) else dict(drafter_config)
    fields.pop("kind", None)
    return {"kind": kind, "target_id": target_id, "target_weights_hash": weights_hash,
            "format_version": FORMAT_VERSION, **jsonable(fields)}


def jsonable(x: Any) -> Any:
    """Plain JSON values from configs and metadata (tuples -> lists, Paths -> str)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def read_checkpoint_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint, checked for the fields every reader relies on; for a
    foreign directory, {"kind", "block_size" or "ttt_steps", "format"} read from its own."""
    d = Path(ckpt_dir)
    fmt = foreign_format(d)
    if fmt is not None:
        return foreign_summary(d, fmt)
    f = d / CONFIG_FILE
    if not f.is_file():
        raise DraftsmithError(f"{d} is not a drafter checkpoint: it has no {CONFIG_FILE}; "
                              "train one with `draftsmith train`")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{f} is not valid JSON ({e.msg} at line {e.lineno}); the checkpoint is damaged") from None
    except (RecursionError, UnicodeDecodeError):
        raise DraftsmithError(f"{f} is not a readable JSON object (nested too deeply, or not UTF-8); the checkpoint is "
                              "damaged") from None
    if not isinstance(raw, dict) or "kind" not in raw:
        raise DraftsmithError(f"{f} has no 'kind'; not a Draftsmith drafter checkpoint")
    for k in ("target_id", "target_weights_hash"):
        if k not in raw:
            raise DraftsmithError(f"{f} lacks {k!r}; not a Draftsmith drafter checkpoint")
    version = raw.get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise DraftsmithError(f"{f} has format_version {version}; this Draftsmith reads version {FORMAT_VERSION}")
    for k, v in LEGACY_FIELDS.get(raw["kind"], {}).items():
        raw.setdefault(k, v)
    return raw


def check_target(raw: Mapping[str, Any], target_id: str, weights_hash: str | None, where: str,
                 kind: str | None = None, legacy_hash: str | None = None) -> None:
    """Refuse a checkpoint (its config.json `raw`) made for another target, or of another
    kind when `kind` is given. The rule is the module docstring's: the weights decide."""
    problems = []
    if kind is not None and (wrong := _wrong_kind(raw, kind, where)):
        problems.append(wrong)
    ck_id, ck_hash = raw.get("target_id"), raw.get("target_weights_hash")
    same = same_weights(ck_hash, weights_hash, legacy_hash)
    if same is None:
        same = ck_id == target_id
    if not same:
        problems.append(f"it was trained for target {ck_id!r} (weights {ck_hash}), not {target_id!r} "
                        f"(weights {weights_hash}); use a drafter trained for this target")
    if problems:
        raise DraftsmithError(f"drafter checkpoint {where} does not fit: " + "; ".join(problems))


def check_kind(raw: Mapping[str, Any], kind: str, where: str) -> None:
    """check_target's kind rule alone, with its error: for a job that checks KIND before the
    target loads (export), which check_target, needing the target's weights hash, cannot."""
    if wrong := _wrong_kind(raw, kind, where):
        raise DraftsmithError(f"drafter checkpoint {where} does not fit: {wrong}")


def _wrong_kind(raw: Mapping[str, Any], kind: str, where: str) -> str | None:
    have = raw.get("kind")
    return None if have == kind else f"it is a {have!r} drafter, not {kind!r} (use --drafter {have}:{where})"


def read_sts(ckpt_dir: str | Path) -> STSFit | None:
    """STS from calibration.json (temperatures and regime), or None when the checkpoint has none."""
    f = Path(ckpt_dir) / CALIBRATION_FILE
    if not f.is_file():
        return None
    try:
        raw = json.loads(f.read_text())
        temps = tuple(float(t) for t in raw["temperatures"])
        greedy = sts_regime(raw)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise DraftsmithError(
            f"{f} is not a calibration file: expected {{\"temperatures\": [T_1, ...], \"regime\": \"greedy\" or "
            f"\"sampled\"}}; re-run draftsmith calibrate"
        ) from None
    if not temps or any(not (t > 0 and math.isfinite(t)) for t in temps):
        raise DraftsmithError(f"{f}: temperatures must be positive numbers, got {list(temps)}")
    return STSFit(temps, greedy)


def read_calibration(ckpt_dir: str | Path) -> tuple[float, ...] | None:
    """STS temperatures from calibration.json, or None when the checkpoint has none (read_sts: with
    the regime they apply to)."""
    fit = read_sts(ckpt_dir)
    return None if fit is None else fit.temperatures


def write_calibration(ckpt_dir: str | Path, fit: STSFit | None) -> None:
    """calibration.json with `fit` (export / import: the same weights, so it holds), or none:
    one left there by other weights would be read as these weights' temperatures."""
    f = Path(ckpt_dir) / CALIBRATION_FILE
    if fit is None:
        f.unlink(missing_ok=True)
    else:
        data: dict[str, Any] = {"temperatures": list(fit.temperatures)}
        if fit.regime is not None:
            data["regime"] = fit.regime
        atomic_write(f, lambda p: p.write_text(json.dumps(data) + "\n"))


def save_trained_drafter(model: nn.Module, ckpt_dir: str | Path, target_id: str, target_weights_hash: str) -> Path:
    """Write config.json + model.safetensors into ckpt_dir, each atomically (model first).
    Leaves calibration.json and train_state/ alone."""
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint_config(model.config.kind, model.config, target_id, target_weights_hash)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(d / WEIGHTS_FILE, lambda p: save_tensors(p, state, metadata={"format": "pt", "kind": cfg["kind"]}))
    atomic_write(d / CONFIG_FILE, lambda p: p.write_text(json.dumps(cfg, indent=2) + "\n"))
    return d


def load_model_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    f = Path(ckpt_dir) / WEIGHTS_FILE
    if not f.is_file():
        raise DraftsmithError(f"{ckpt_dir} has no {WEIGHTS_FILE}; the checkpoint is incomplete")
    return load_tensors(f, "drafter checkpoint")


def restore_state(model: nn.Module, state: Mapping[str, torch.Tensor], ckpt: str | Path) -> None:
    """Load a saved state dict into `model`: every name and shape must match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:
        first = (missing or unexpected or shapes)[0]
        raise DraftsmithError(
            f"checkpoint {ckpt} does not fit this drafter ({len(missing)} missing, {len(unexpected)} unexpected, "
            f"{len(shapes)} mis-shaped tensors; first: {first}); the drafter config differs from the one it was "
            "trained with")
    model.load_state_dict({k: v.to(own[k].device, own[k].dtype) for k, v in state.items()})


def load_trained_model(ckpt_dir: str | Path, target, kind, dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a trained model of `kind` (a registry.DrafterKind) on a LoadedTarget,
    refusing other targets and kinds, and load its weights; in `dtype` (default: the
    target's; drafters/precision.py chooses one for inference)."""
    d = Path(ckpt_dir)
    fmt = foreign_format(d)
    if fmt is not None:
        model = _import_foreign(d, target, kind, fmt)
    else:
        raw = read_checkpoint_config(d)
        check_target(raw, target.target_id, getattr(target, "weights_hash", None), str(d), kind=kind.name,
                     legacy_hash=getattr(target, "legacy_weights_hash", None))
        fields = {f.name for f in dataclasses.fields(kind.config_cls)}
        config = config_from_dict({k: v for k, v in raw.items() if k in fields}, kind.config_cls, kind.name)
        model = kind.build(target.model, config)
        restore_state(model, load_model_state(d), d)
    return model.to(device=target.model.device, dtype=dtype or target.model.dtype).eval()


def _import_foreign(d: Path, target, kind, fmt: str) -> nn.Module:
    """A speculators / DeepSpec / z-lab DFlash directory given as KIND:DIR, imported in memory;
    it must import as that kind (DeepSpec's DFlash baseline, for one, is our DSpark)."""
    from draftsmith.export.importing import import_model  # here: the importer builds through the registry

    model = import_model(d, target, fmt)
    if model.config.kind != kind.name:
        raise DraftsmithError(f"{d} is a {fmt} directory that imports as a {model.config.kind} drafter, not "
                              f"{kind.name}; use --drafter {model.config.kind}:{d}")
    return model


def load_trained_drafter(ckpt_dir: str | Path, target, max_rows: int, max_len: int, kind,
                         dtype: torch.dtype | None = None):
    """A ready Drafter from a checkpoint directory for a LoadedTarget (with calibration.json's
    STS when present), computing in `dtype` (default: the target's)."""
    model = load_trained_model(ckpt_dir, target, kind, dtype)
    return model.make_drafter(target.model, max_rows, max_len, temperatures=read_sts(ckpt_dir))

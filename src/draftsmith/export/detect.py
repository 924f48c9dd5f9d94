"""Which layout a drafter directory is in, from its config.json alone (no tensors, no target):
`draftsmith import` without --format, and `--drafter KIND:DIR` given a foreign directory.

    draftsmith      our checkpoint: top-level "kind" and "target_weights_hash"
    speculators     "speculators_model_type"
    deepspec        architectures Qwen3DSparkModel / Qwen3Eagle3Model (or DeepSpec's other
                    *DSparkModel / *Eagle3Model, which the importer refuses with the reason)
    dflash-native   "dflash_config", or architectures DFlashDraftModel (z-lab)

A directory with none of the markers, or with those of two layouts, is a DraftsmithError:
guessing would load a drafter that computes something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json

IMPORT_FORMATS = ("speculators", "deepspec", "dflash-native")


def config_path(src: str | Path) -> Path:
    """config.json of a drafter directory (a DeepSpec run directory: its step_latest's)."""
    d = Path(src)
    if not (d / "config.json").is_file() and (d / "step_latest" / "config.json").is_file():
        return d / "step_latest" / "config.json"
    return d / "config.json"


def markers(cfg: Mapping[str, Any]) -> list[str]:
    """The layouts whose markers `cfg` (a parsed config.json) carries, in a fixed order."""
    arch = cfg.get("architectures")
    arch = [str(a) for a in arch] if isinstance(arch, list) else []
    found = []
    if "kind" in cfg and "target_weights_hash" in cfg:
        found.append("draftsmith")
    if "speculators_model_type" in cfg:
        found.append("speculators")
    if any(a.endswith(("DSparkModel", "Eagle3Model")) for a in arch):
        found.append("deepspec")
    if "dflash_config" in cfg or "DFlashDraftModel" in arch:
        found.append("dflash-native")
    return found


def _read(src: str | Path) -> dict[str, Any]:
    cfg = read_json(config_path(src), "drafter config")
    if not isinstance(cfg, dict):
        raise DraftsmithError(f"{config_path(src)} is not a JSON object; not a drafter config")
    return cfg


def detect_format(src: str | Path) -> str:
    """The one layout of directory `src` ("draftsmith" for our own checkpoints)."""
    found = markers(_read(src))
    if len(found) == 1:
        return found[0]
    if found:
        raise DraftsmithError(f"cannot tell the format of {src}: its config.json has the markers of {' and '.join(found)}; "
                              f"pass --format ({', '.join(IMPORT_FORMATS)})")
    raise DraftsmithError(f"cannot tell the format of {src} from its config.json (no speculators_model_type, no DeepSpec "
                          f"architectures, no dflash_config); pass --format ({', '.join(IMPORT_FORMATS)})")


def detect_foreign(src: str | Path) -> str:
    """`detect_format` for an import: our own checkpoints need none (a DraftsmithError)."""
    fmt = detect_format(src)
    if fmt == "draftsmith":
        raise DraftsmithError(f"{src} is already a Draftsmith checkpoint; use it as --drafter {_read(src)['kind']}:{src}")
    return fmt


def foreign_format(src: str | Path) -> str | None:
    """The foreign layout of `src` when its config.json names exactly one, else None (our own
    checkpoints, and directories that are neither: their readers give the error)."""
    try:
        found = markers(_read(src))
    except DraftsmithError:
        return None
    return found[0] if len(found) == 1 and found[0] != "draftsmith" else None


def count_field(v: Any) -> int:
    """A config's count field: an int as given (bools excluded), 0 (the default's turn) for anything else."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def speculators_proposal(cfg: Mapping[str, Any], src: str | Path) -> dict[str, Any]:
    """The first of a speculators config's speculators_config.proposal_methods ({} when it has
    none: the defaults hold). A field of another shape is a DraftsmithError that names it."""
    spec = cfg.get("speculators_config") or {}
    if not isinstance(spec, dict):
        raise DraftsmithError(f"{src}: speculators_config must be an object (with proposal_methods), got "
                              f"{type(spec).__name__} {spec!r}")
    methods = spec.get("proposal_methods") or []
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise DraftsmithError(f"{src}: speculators_config.proposal_methods must be a list of objects "
                              f"(speculative_tokens, ...), got {methods!r}")
    return methods[0] if methods else {}


def foreign_summary(src: str | Path, fmt: str) -> dict[str, Any]:
    """What a reader of our config.json needs of a foreign directory before importing it:
    the kind it imports as and its draft length in our terms (block_size γ, or ttt_steps;
    0 when the file has none: the importer then says what is missing). The full translation
    (export/importing.py) needs the target and the tensors."""
    cfg = _read(src)
    if fmt == "speculators":
        kind = cfg.get("speculators_model_type")
        if kind == "eagle3":
            try:
                first = speculators_proposal(cfg, src)
            except DraftsmithError:  # (fields of another type: the importer names them)
                first = {}
            return {"kind": kind, "ttt_steps": count_field(first.get("speculative_tokens")) or 7, "format": fmt}
        slots = count_field(cfg.get("block_size"))  # mask-first DFlash: the anchor + γ masks; anchor-first: γ
        mask_first = kind == "dflash" and cfg.get("sample_from_anchor") is not True
        return {"kind": kind, "block_size": max(slots - 1, 0) if mask_first else slots, "format": fmt}
    if fmt == "deepspec":
        if any(str(a).endswith("Eagle3Model") for a in cfg.get("architectures") or []):
            return {"kind": "eagle3", "ttt_steps": count_field(cfg.get("ttt_length")), "format": fmt}
        baseline = cfg.get("markov_rank") == 0 and cfg.get("enable_confidence_head") is False  # DeepSpec's DFlash
        return {"kind": "dflash" if baseline else "dspark", "block_size": count_field(cfg.get("block_size")), "format": fmt}
    dc = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}
    slots = count_field(dc.get("block_size")) or count_field(cfg.get("block_size"))
    return {"kind": "dflash", "block_size": max(slots - 1, 0), "format": fmt}

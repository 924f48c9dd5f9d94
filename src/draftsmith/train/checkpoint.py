"""Drafter checkpoints: written atomically, resumed exactly.

A run directory (`out:` in the recipe) looks like

    out/
      checkpoint-00000200/         one complete checkpoint (protocol.py layout)
        config.json                {"kind", "target_id", "target_weights_hash", "format_version", ...config}
        model.safetensors          the drafter's state dict (trainable parameters + persistent buffers)
        train_state/state.pt       optimizer, scheduler, step, data position, RNG states per rank
        train_state/meta.json      the same step / position / run config, readable
      checkpoint-00000400/
      config.json                  the newest checkpoint's inference files, so `KIND:out` loads
      model.safetensors            (a hard link to the checkpoint's file: no copy)
      train_info.json              which checkpoint that is (step, loss, time)
      metrics.jsonl                the training log
      target_stats.safetensors     block drafters: the target's statistics of every training
                                   window (train/data.py), so a resume does not recompute them

A checkpoint is built in a hidden temporary directory, every file and the directory are
fsynced, and only then is it renamed to `checkpoint-<step>`: a rename is atomic, so a killed
run leaves either the whole checkpoint or none (stray temporaries are removed on the next
save). The top-level inference files are each replaced atomically, model before config.

State files hold only tensors and plain Python values, so they load with
`torch.load(weights_only=True)` (no pickled code).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith.drafters.checkpoint import (  # noqa: F401  (the trainer reads the format through here)
    FORMAT_VERSION,
    check_target,
    checkpoint_config,
    jsonable,
    load_model_state,
    read_checkpoint_config,
    restore_state,
)
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import fsync_dir as _fsync_dir
from draftsmith.fileio import write_json_atomic
from draftsmith.tensorfile import save_tensors
_CKPT_RE = re.compile(r"^checkpoint-(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


# ---- fsync helpers ----------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ---- what goes in a checkpoint ------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU/CUDA, python, numpy) as weights_only-safe values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save ---------------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, config_json: Mapping[str, Any], model_state: Mapping[str, torch.Tensor],
                    train_state: Mapping[str, Any], meta: Mapping[str, Any], keep: int = 2) -> Path:
    """Write `run_dir/checkpoint-<step>` atomically, export it to the top level, prune old ones."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    final = run_dir / checkpoint_name(step)
    tmp = run_dir / f".{checkpoint_name(step)}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "train_state").mkdir(parents=True)
    try:
        files = []
        (tmp / "config.json").write_text(json.dumps(dict(config_json), indent=1) + "\n")
        files.append(tmp / "config.json")
        save_tensors(tmp / "model.safetensors", model_state, metadata={"format": "pt", "step": str(step)})
        files.append(tmp / "model.safetensors")
        torch.save(dict(train_state), tmp / "train_state" / "state.pt")
        files.append(tmp / "train_state" / "state.pt")
        (tmp / "train_state" / "meta.json").write_text(json.dumps(jsonable(dict(meta)), indent=1) + "\n")
        files.append(tmp / "train_state" / "meta.json")
        for f in files:
            _fsync_file(f)
        _fsync_dir(tmp / "train_state")
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. a resumed run's last step): replace it
            trash = run_dir / f".{final.name}.old-{os.getpid()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _export(run_dir, final, step, meta)
    prune_checkpoints(run_dir, keep)
    return final


def _export(run_dir: Path, ckpt: Path, step: int, meta: Mapping[str, Any]) -> None:
    """Top-level inference files = the newest checkpoint's (model first, config last)."""
    link_tmp = run_dir / f".model.safetensors.tmp-{os.getpid()}"
    if link_tmp.exists():
        link_tmp.unlink()
    try:
        os.link(ckpt / "model.safetensors", link_tmp)
    except OSError:  # a file system without hard links: copy
        shutil.copyfile(ckpt / "model.safetensors", link_tmp)
        _fsync_file(link_tmp)
    os.replace(link_tmp, run_dir / "model.safetensors")
    write_json_atomic(run_dir / "train_info.json", {
        "checkpoint": ckpt.name, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **{k: meta[k] for k in ("total_steps", "epoch", "loss", "elapsed_s", "cpu_s", "train_cpu_s", "budget_s")
           if k in meta}})
    cfg = json.loads((ckpt / "config.json").read_text())
    calib = run_dir / "calibration.json"
    if calib.exists():  # fitted for older weights: no longer valid
        calib.unlink()
    write_json_atomic(run_dir / "config.json", cfg)


def remove_stale_temporaries(run_dir: Path) -> None:
    for d in Path(run_dir).glob(".checkpoint-*"):
        shutil.rmtree(d, ignore_errors=True)
    for f in Path(run_dir).glob(".*.tmp-*"):
        if f.is_file():
            f.unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run directory, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = []
    for d in run_dir.iterdir():
        m = _CKPT_RE.match(d.name)
        if m and (d / "train_state" / "state.pt").is_file() and (d / "model.safetensors").is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for _, d in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(d, ignore_errors=True)


# ---- load ----------------------------------------------------------------------------------


def find_resume_checkpoint(path: Path, ckpts: list[tuple[int, Path]] | None = None) -> Path:
    """A checkpoint directory, or a run directory (-> its newest complete checkpoint; `ckpts`:
    its list_checkpoints when the caller has it already)."""
    path = Path(path)
    if (path / "train_state" / "state.pt").is_file():
        return path
    ckpts = list_checkpoints(path) if ckpts is None else ckpts
    if not ckpts:
        raise DraftsmithError(f"nothing to resume in {path}: no complete checkpoint-* directory")
    return ckpts[-1][1]


def load_train_state(ckpt: Path) -> dict[str, Any]:
    f = Path(ckpt) / "train_state" / "state.pt"
    if not f.is_file():
        raise DraftsmithError(f"checkpoint {ckpt} has no train_state/ to resume from")
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged file
        raise DraftsmithError(f"cannot read {f} ({type(e).__name__}); the checkpoint is damaged") from None

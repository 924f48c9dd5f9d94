"""Resolve + load a target in one call: the decoder, its tokenizer and its stop tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import LoadedTarget, load_decoder, load_tokenizer, weights_fingerprint
from draftsmith.models.registry import resolve_target


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftsmithError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    return torch.device(device)


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 has no hardware support on these CPUs); bf16 on CUDA by default."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise DraftsmithError(f"unknown dtype {dtype!r}; choose from {', '.join(table)}")
    return table[dtype]


def load_target(name_or_path: str, device: str | None = None, dtype: str | None = None) -> LoadedTarget:
    target_id, path = resolve_target(name_or_path)
    dev = pick_device(device)
    model = load_decoder(path, dtype=pick_dtype(dtype, dev), device=dev)
    tok = load_tokenizer(path)
    return LoadedTarget(
        model=model, tokenizer=tok, target_id=target_id, path=path,
        weights_hash=weights_fingerprint(path),
    )


def eos_token_ids(target: LoadedTarget) -> tuple[int, ...]:
    """EOS ids from the config, generation_config.json and the tokenizer, merged."""
    ids: set[int] = set(target.model.config.eos_token_ids)
    gen = Path(target.path) / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else ([] if e is None else [e]))
    if getattr(target.tokenizer, "eos_token_id", None) is not None:
        ids.add(int(target.tokenizer.eos_token_id))
    return tuple(sorted(ids))

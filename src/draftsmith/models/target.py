"""Resolve + load a target in one call: the decoder, its tokenizer and its stop tokens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError, DraftsmithWarning
from draftsmith.kernels.build import cpu_flags
from draftsmith.models.loading import (
    LoadedTarget,
    legacy_weights_fingerprint,
    load_decoder,
    load_tokenizer,
    weights_fingerprint,
)
from draftsmith.models.registry import resolve_target
from draftsmith.models.threads import configure_threads


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DraftsmithError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise DraftsmithError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls in hardware: AVX512-BF16 or AMX on x86-64, the BF16 extension on Arm."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_fast_fp16() -> bool:
    """float16 arithmetic in hardware: AVX512-FP16 or AMX-FP16 on x86-64, half-precision SIMD
    (asimdhp) on Arm. (F16C only converts: float16 matmuls without these are emulated.)"""
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16", "asimdhp"})


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """fp32 on CPU by default, bf16 on CUDA. bfloat16 / float16 on a CPU pay where the CPU
    computes them in hardware (AVX512-BF16 / AMX / Arm BF16, AVX512-FP16 / AMX-FP16 / Arm FP16);
    elsewhere they are emulated and slower: warn."""
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise DraftsmithError(f"unknown dtype {dtype!r}; choose from {', '.join(table)}")
    chosen = table[dtype]
    if device.type != "cpu" or chosen == torch.float32:
        return chosen
    bf16 = chosen == torch.bfloat16
    if not (cpu_has_fast_bf16() if bf16 else cpu_has_fast_fp16()):
        from draftsmith.kernels.build import cpu_kernels

        none = "no AVX512-BF16 / AMX / BF16 flag" if bf16 else "no AVX512-FP16 / AMX-FP16 / Arm FP16 flag"
        if bf16 and (st := cpu_kernels()).ok and st.bf16:
            warnings.warn(
                f"{dtype} on this CPU has no hardware support ({none}): Draftsmith's "
                f"{st.isa} kernels stream the bfloat16 weights (half the bytes) and compute in float32, so decoding "
                "and few-token verify steps are faster than float32 but wide batched steps "
                f"({'16+ rows) are slower' if st.isa == 'avx2' else '32+ rows) are no faster'}; "
                "use --dtype float32 for batch throughput", DraftsmithWarning, stacklevel=2)
        else:
            warnings.warn(
                f"{dtype} on this CPU has no hardware support ({none}): it runs "
                "emulated and is likely slower than float32; use --dtype float32",
                DraftsmithWarning, stacklevel=2,
            )
    return chosen


def load_target(
    name_or_path: str, device: str | None = None, dtype: str | None = None,
    threads: int | None = None, linear_backend: str = "auto",
) -> LoadedTarget:
    """Resolve, load and prepare a target. On a CPU this also sets torch's threads
    (models/threads.py: `threads`, default the physical cores)."""
    target_id, path = resolve_target(name_or_path)
    dev = pick_device(device)
    if dev.type == "cpu":
        configure_threads(threads)
    model = load_decoder(path, dtype=pick_dtype(dtype, dev), device=dev, linear_backend=linear_backend)
    tok = load_tokenizer(path)
    return LoadedTarget(
        model=model, tokenizer=tok, target_id=target_id, path=path,
        weights_hash=weights_fingerprint(path), legacy_weights_hash=legacy_weights_fingerprint(path),
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

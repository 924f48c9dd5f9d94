"""The precision a model drafter computes in (`--drafter-dtype`, `LLM(drafter_dtype=...)`).

A drafter's precision changes which tokens it proposes, never what the target outputs:
verification compares the target's own distribution with the q the drafts were actually
drawn from (computed from the same logits), so every guarantee holds in any drafter dtype.
It changes speed. At batch 1 a drafting round reads all the drafter's weights (the draft
layers, the draft-vocabulary lm_head rows, the Markov head) from memory, because the target's
forward in between has evicted them from the caches: in bfloat16 that is half the bytes.

    auto      bfloat16 when the target runs in float32 on a CPU whose kernels run bfloat16
              linears at least as fast as float32 at every batch size (AVX-512, with or without
              AVX512-BF16, and AMX: BENCHMARKS "Runtime"); otherwise the target's dtype (on
              AVX2 CPUs bfloat16 is faster up to 8 rows and slower beyond, on CUDA the target
              already runs in bfloat16 or float16)
    float32 | bfloat16 | float16    that dtype

Applies to the kinds that are models (trained drafters, draft-model); prompt lookup has no
weights. Measured (BENCHMARKS "Drafter precision"): the built-in DSpark drafter's drafting
time at batch 1, with its τ unchanged.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError

DRAFTER_DTYPES = ("auto", "float32", "bfloat16", "float16")
FAST_BF16_ISAS = ("avx512", "avx512-bf16", "avx512-bf16+amx")  # KernelStatus.isa values (not "avx2")


def bf16_pays_on_cpu() -> bool:
    """Whether this CPU's kernels run bfloat16 linears at least as fast as float32 at every size."""
    from draftsmith.kernels.build import cpu_kernels

    status = cpu_kernels()
    return status.ok and status.bf16 and status.isa in FAST_BF16_ISAS


def drafter_dtype(requested: str | torch.dtype | None, target_dtype: torch.dtype, device: torch.device | str,
                  bf16_pays: bool | None = None) -> torch.dtype:
    """The dtype a model drafter runs in beside a target of `target_dtype` on `device`
    (`bf16_pays`: the CPU answer, asked of the kernels when None)."""
    if isinstance(requested, torch.dtype):
        name = str(requested).removeprefix("torch.")
    else:
        name = "auto" if requested is None else str(requested)
    if name not in DRAFTER_DTYPES:
        raise DraftsmithError(f"drafter dtype must be one of {', '.join(DRAFTER_DTYPES)}, got {requested!r}")
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type != "cpu" or target_dtype != torch.float32:
        return target_dtype
    if bf16_pays is None:
        bf16_pays = bf16_pays_on_cpu()
    return torch.bfloat16 if bf16_pays else target_dtype

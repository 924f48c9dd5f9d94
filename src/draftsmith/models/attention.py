"""Attention over the KV cache: Draftsmith's CPU kernel for decode / verify steps, torch's SDPA,
or grouped matmuls where SDPA is slow.

On a CPU where Draftsmith's kernels load (kernels/build.py), steps of up to 64 query tokens
(decode, verify blocks, batched decode) run `torch.ops.draftsmith.attention` (kernels/gemv.cpp):
each query on its own, float32 softmax, the same order of operations whatever the number of
queries, so the logits of a verify block equal those of decoding its tokens one at a time. With
the batch-invariant "kernels" linears that makes a bfloat16 target's greedy speculative output
equal its plain decoding (SDPA picks its blocking by query length, and bf16 rounds the
difference into every later layer). Prefill chunks and tensors that need gradients keep SDPA.

PyTorch's CPU `scaled_dot_product_attention` has no fast kernel for batches of 16-bit
queries of a few tokens against a long cache: in bfloat16 a batch-32 decode step with a
padding mask took 7.5 ms per layer (0.5 with the matmuls below). For one row it is fine, and
in float32 it is as fast as the alternative, so those keep it (float32's numerics are what
the HF-parity tests pin).

The grouped form never copies K/V per query head (GQA): the G = heads / kv_heads query
heads that share one kv head are stacked along the query axis, so one matmul per kv head
scores all of them. Scores are softmaxed in float32, as SDPA does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPED_MAX_QUERY = 64  # decode and verify steps; prefill of longer chunks goes to SDPA


def use_grouped(q: torch.Tensor) -> bool:
    """q [B, H, S, D]: 16-bit, on CPU, several rows, a decode/verify-sized step. One row goes
    to SDPA: measured (bench_runtime, bf16, 2 threads) it is as fast at one token and faster
    for a verify block (8 tokens: 1.06 vs 1.21 decode steps), while batched rows are where
    SDPA falls behind (64 rows of one token: 5.2 vs 15.6 steps/s)."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[0] > 1
            and q.shape[2] <= GROUPED_MAX_QUERY)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, scale: float | None = None) -> torch.Tensor:
    """q [B, H, S, D], k / v [B, KV, T, D], mask [B or 1, 1, S, T] bool (True = attend) or None;
    causal: the S queries are the last S positions of T with a lower-triangular mask;
    scale: of the scores, default D ** -0.5.
    Returns [B, H, S, D] like SDPA (HF's head h reads kv head h // G)."""
    B, H, S, D = q.shape
    KV, T = k.shape[1], k.shape[2]
    G = H // KV
    scale = D ** -0.5 if scale is None else scale
    scores = torch.matmul((q * scale).reshape(B, KV, G * S, D), k.transpose(-1, -2)).float()
    if causal and mask is None:
        q_pos = torch.arange(T - S, T, device=q.device)
        mask = (torch.arange(T, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    if mask is not None:
        scores = scores.view(B, KV, G, S, T).masked_fill(~mask[:, :, None], float("-inf")).view(B, KV, G * S, T)
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(B, H, S, D)


STEP_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)  # compiled into the step kernel


def use_step_kernel(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Draftsmith's CPU attention kernel for this step: a CPU, float32 / bfloat16, no gradient,
    at most GROUPED_MAX_QUERY queries, a head_dim of STEP_HEAD_DIMS, and the kernels load."""
    if not (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and k.dtype == q.dtype
            and q.shape[2] <= GROUPED_MAX_QUERY and q.shape[-1] in STEP_HEAD_DIMS
            and k.stride(-1) == 1 and not (torch.is_grad_enabled() and q.requires_grad)):
        return False
    from draftsmith.kernels.build import cpu_kernels

    return cpu_kernels().ok


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool, kernel: str = "auto", scale: float | None = None,
           suffix_causal: bool = False) -> torch.Tensor:
    """Softmax attention of q [B, H, S, D] over k / v [B, KV, T, D] (GQA when KV < H).
    kernel: "auto" (Draftsmith's step kernel where `use_step_kernel`, else grouped where
    `use_grouped`, else SDPA), "torch" ("auto" without the step kernel: the path before it),
    "step", "sdpa" or "grouped" (benchmarks, tests).
    scale: of the scores, default D ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
    suffix_causal: `mask` is the causal mask of S queries at the end of the T keys (query s sees
    keys up to T - S + s), which the step kernel computes without reading it (the same result)."""
    if kernel == "step" or (kernel == "auto" and use_step_kernel(q, k)):
        if kernel == "step":  # asked for by name: load it, or say why not
            from draftsmith.kernels.build import cpu_kernels

            if not (status := cpu_kernels()).ok:
                raise RuntimeError(f"Draftsmith's attention kernel is not available: {status.reason}")
        if suffix_causal:
            mask, causal = None, True
        if mask is not None and mask.shape[-1] != k.shape[2]:
            mask = mask[..., : k.shape[2]]
        return torch.ops.draftsmith.attention(q, k, v, mask, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    if kernel == "grouped" or (kernel in ("auto", "torch") and use_grouped(q)):
        return grouped_attention(q, k, v, mask, causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """A step's attention for rows anywhere in the cache, at their own positions, in one call of
    Draftsmith's CPU kernel (where `use_step_kernel`): q [B, H, S, D]; k_cache / v_cache a layer's
    whole cache [R, KV, T, D]; query (b, s) reads cache row rows[b] and sees its keys 0 ..
    positions[b, s]. The same bits as `attend` with the equivalent mask over gathered rows, but each
    row reads only its own keys: with rows of mixed lengths the masked path read the longest row's
    keys for every row of a run, or cut the batch into one call per run of similar rows."""
    return torch.ops.draftsmith.attention_rows(q, k_cache, v_cache, rows, positions,
                                               q.shape[-1] ** -0.5 if scale is None else scale)


MAX_ROW_RUNS = 8  # on GPUs, beyond this many runs of consecutive rows one gather is cheaper
SEGMENT_WASTE_KEYS = 256  # padding keys worth one more attention call (~20 us on a CPU)


def _row_runs(rows: list[int], starts: list[int], S: int, max_runs: int | None = MAX_ROW_RUNS,
              ) -> list[tuple[int, int, int, int]] | None:
    """Attention segments of a batch, (b0, b1, rows[b0], keys): batch rows b0:b1 sit in
    consecutive cache rows (so their keys are one view of the cache) and attend over their
    own `keys` = max(starts[b0:b1]) + S. None when the rows form more than `max_runs` runs
    (attention then gathers them: one kernel instead of many, which pays on a GPU; on a CPU
    a call costs ~20 us while a gather copies every row's keys, so the CPU passes None).

    The engine keeps its batch sorted by row, so a full batch is one run and a batch with
    free rows a few. A run is cut further where a row would add more than
    SEGMENT_WASTE_KEYS masked-out keys: rows of 100 and 2,000 tokens attending together both
    read 2,000 keys (at batch 64 of mixed lengths, attention was half of a step)."""
    segs: list[tuple[int, int, int, int]] = []
    runs = 0
    b0, top = 0, starts[0] + S
    for b in range(1, len(rows) + 1):
        new_run = b == len(rows) or rows[b] != rows[b - 1] + 1
        if not new_run:
            n, end = b - b0, starts[b] + S
            waste = (n + 1) * max(top, end) - n * top - end
            if waste <= SEGMENT_WASTE_KEYS:
                top = max(top, end)
                continue
        segs.append((b0, b, rows[b0], top))
        runs += new_run
        if max_runs is not None and runs > max_runs:
            return None
        if b < len(rows):
            b0, top = b, starts[b] + S
    return segs

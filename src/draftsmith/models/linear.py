"""Inference linears: y = x Wᵀ (+ b) with the weight laid out once, at load, for the kernel.

Decode on a CPU is memory-bound: a step streams every weight once. How fast a linear streams
its weight depends on the kernel and the weight's layout, and differs most at the few-row
sizes speculative verification uses (1 + K tokens per row):

- "kernels": Draftsmith's own kernel (kernels/gemv.cpp, compiled once per machine for its
  AVX-512 or AVX2 + FMA): the weight packed once into 32-column blocks that each thread streams
  front to back, every row of x applied to a block while it is in cache. float32 and bfloat16
  (AVX512-BF16 dot products, or where the CPU has no AVX512-BF16 (AVX2, or AVX-512 without it)
  bfloat16 weights widened to float32 in registers: half the bytes streamed, float32 arithmetic; on CPUs with AMX, bfloat16 on the tile unit, where 8-16 rows
  cost about what one does); other dtypes fall back to F.linear per linear. Measured on
  2-core machines over smollm2-135m's linears (BENCHMARKS.md, Runtime): ~1.5x oneDNN's throughput
  at 1 to 8 rows on a Zen 4. A row's result does not depend on how many rows are computed with it
  (same summation order). "avx512", its first name, is still accepted.
- "onednn": the weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the same op torch.compile's CPU freezing
  uses) and applied with `torch.ops.mkldnn._linear_pointwise`. Measured on a 2-core Zen 4
  over smollm2-135m's shapes (BENCHMARKS.md, Runtime): about 2× faster than MKL at one
  row and nearly flat from 1 to 16 rows, in float32 and bfloat16. The blocked copy is made
  from the checkpoint weight, which stays as the parameter (state_dict, drafters sharing the
  target's embedding / lm_head), so these linears hold their weights twice.
- "mkl": the previous CPU path, kept as the reference the benchmark compares against:
  fused weights stored [in, out] and multiplied with `torch.matmul` (MKL sgemv / sgemm).
  The parameters become views of the fused matrix, nothing is duplicated.
- "torch": `F.linear` on the [out, in] weight (CUDA, and CPUs without oneDNN).

`choose_backend("auto", device)` picks "kernels" on a CPU where the kernel builds and loads
(kernels/build.py says why not), else "onednn" where torch has oneDNN, else "torch". Numerics differ between backends only in summation order (~1e-6 relative).
"""

from __future__ import annotations

import functools
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_kernels

BACKENDS = ("auto", "kernels", "onednn", "mkl", "torch")
ALIASES = {"avx512": "kernels"}  # the name before the kernels also ran on AVX2


def choose_backend(backend: str, device: torch.device | str) -> str:
    """Resolve "auto" for a device; refuse a CPU-only backend on another device."""
    dev = torch.device(device)
    backend = ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise DraftsmithError(f"unknown linear backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if dev.type != "cpu":
            return "torch"
        if cpu_kernels().ok:
            return "kernels"
        return "onednn" if torch.backends.mkldnn.is_available() else "torch"
    if backend in ("kernels", "onednn", "mkl") and dev.type != "cpu":
        raise DraftsmithError(f"linear backend {backend!r} runs on the CPU only; use 'torch' or 'auto' on {dev}")
    if backend == "onednn" and not torch.backends.mkldnn.is_available():
        raise DraftsmithError("this torch build has no oneDNN (mkldnn); use linear backend 'torch' or 'mkl'")
    if backend == "kernels" and not (status := cpu_kernels()).ok:
        raise DraftsmithError(f"linear backend 'kernels' is not available here: {status.reason}; use 'auto'")
    return backend


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN's linears take bfloat16 on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class FastLinear:
    """One prepared linear. `weight` is backend-specific: 32-column blocks ("kernels"),
    oneDNN-blocked ("onednn"), [in, out] ("mkl") or [out, in] ("torch"); bias [out] or None.
    in_features is the checkpoint's (the "kernels" bfloat16 layout pads it to even)."""

    backend: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @staticmethod
    def build(weight: torch.Tensor, bias: torch.Tensor | None, backend: str) -> "FastLinear":
        """weight [out, in] (a checkpoint layout); `backend` already resolved."""
        backend = ALIASES.get(backend, backend)
        w = weight.detach()
        b = None if bias is None else bias.detach()
        if backend == "kernels":
            if w.dtype == torch.float32:
                w = torch.ops.draftsmith.pack_f32(w)
            elif w.dtype == torch.bfloat16 and cpu_kernels().bf16:
                w = torch.ops.draftsmith.pack_bf16(w)
            else:  # float16 (or a build without a bfloat16 kernel): F.linear for this one
                backend = "torch"
        if backend == "onednn" and w.dtype == torch.bfloat16 and not onednn_bf16():
            backend = "torch"  # oneDNN refuses bfloat16 on CPUs without avx512bw/vl/dq or avx_ne_convert
        if backend == "onednn":
            w = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
        elif backend == "mkl":
            w = w.t().contiguous()
        return FastLinear(backend, w, b, int(weight.shape[0]), int(weight.shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "kernels":
            if self.weight.dtype == torch.float32:
                return torch.ops.draftsmith.gemv_f32(x, self.weight, self.out_features, self.bias)
            return torch.ops.draftsmith.gemv_bf16(x, self.weight, self.out_features, self.in_features, self.bias)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        if self.backend == "mkl":
            return linear_t(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_t(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w_t [in, out] (+ bias): a Linear whose weight is stored transposed."""
    if bias is None:
        return torch.matmul(x, w_t)
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), w_t).view(*x.shape[:-1], w_t.shape[1])


class PackedWeight:
    """A linear whose weight may change (a drafter that is also trained, a new draft
    vocabulary, load_state_dict): the weight is laid out for the kernel on first use and again
    whenever the tensor or its version (bumped by every in-place update) changes. While
    gradients flow, or off the CPU, it is plain F.linear. A stale layout could only make a
    drafter propose worse tokens, never break losslessness: q is computed from the same logits
    the drafts are sampled from."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self._key: tuple | None = None
        self._src: weakref.ref | None = None  # the weight the layout was made from
        self._fast: FastLinear | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, bias)
        key = (_tensor_key(weight), None if bias is None else _tensor_key(bias))
        if key != self._key or self._src is None or self._src() is not weight:  # a new tensor at the same address too
            self._fast = FastLinear.build(weight, bias, choose_backend(self.backend, weight.device))
            self._key, self._src = key, weakref.ref(weight)
        return self._fast(x.to(weight.dtype))

    def __deepcopy__(self, memo) -> "PackedWeight":  # a copy lays out its own weights
        return PackedWeight(self.backend)

    def __getstate__(self) -> dict:
        return {"backend": self.backend, "_key": None, "_src": None, "_fast": None}


def _tensor_key(t: torch.Tensor) -> tuple:
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter
        version = None
    return (t.data_ptr(), tuple(t.shape), t.dtype, version)


def pack_linears_for_inference_(module: torch.nn.Module, backend: str = "auto") -> torch.nn.Module:
    """Every nn.Linear in `module` computes through a `PackedWeight` (a prepacked copy of its
    weight, kept in step with it) when no gradient is needed, and as before otherwise, so the
    same module still trains. Parameters, names and state_dict are unchanged. Idempotent."""
    for lin in module.modules():
        if isinstance(lin, torch.nn.Linear) and "forward" not in vars(lin):
            lin.inference_pack = PackedWeight(backend)
            lin.forward = types.MethodType(_packed_linear_forward, lin)  # deepcopy re-binds to the copy
    return module


@torch.inference_mode()
def warm_packed_linears_(module: torch.nn.Module) -> torch.nn.Module:
    """Lay out now every weight `pack_linears_for_inference_` gave a `PackedWeight`, instead of on
    first use (a drafter's first round would otherwise carry it, and a load-aware policy would count
    it as drafting time)."""
    for lin in module.modules():
        pack = getattr(lin, "inference_pack", None)
        if isinstance(pack, PackedWeight) and lin.weight.device.type == "cpu":
            pack(lin.weight.new_zeros(1, lin.in_features), lin.weight, lin.bias)
    return module


def _packed_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self.inference_pack(x, self.weight, self.bias)

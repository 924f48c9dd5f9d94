"""One compact decoder for the Llama / Qwen2 / Qwen3 family, Qwen3-MoE and Gemma 3 (text).

Family differences are flags, not copies: qkv bias (Qwen2), q/k RMSNorm (Qwen3), tied
embeddings (SmolLM2, small Qwen), RoPE scaling variants; a sparse mixture-of-experts MLP on
some layers (Qwen3-MoE); and Gemma 3's set: embeddings scaled by sqrt(hidden), RMSNorm
scaling by (1 + w), norms after attention and MLP too ("sandwich"), a GeGLU MLP, its own
attention scale, sliding-window layers with their own RoPE base, optional tanh soft-capping
of the logits. Parameter names mirror the HF checkpoints
(`model.layers.N.self_attn.q_proj.weight`, ...) so safetensors load strictly.

The forward pass works on a batch of KV-cache rows with independent lengths: row b's new
tokens go to positions lengths[b] .. lengths[b] + S - 1. The caller commits how many of
them to keep by setting the row length afterwards (speculative verification keeps only the
accepted prefix). Layer features for drafters: `layer_ids` index decoder-layer outputs
(0-based; layer i's output is HF's `hidden_states[i + 1]`, except the last layer: HF
replaces its last entry by the normed state, which is our `final_hidden`, the lm_head input).

Speed (CPU decode is memory-bound, one small op costs several microseconds): `load_decoder`
calls `prepare_inference_()`, which fuses q/k/v and gate/up into single matrices and lays out
every linear once for its kernel (models/linear.py: oneDNN-blocked weights on a CPU); RoPE
cos/sin come from a table indexed by position, single-length batches skip the attention mask,
and layers call functional ops directly. With the "kernels" linears a plain pre-norm SwiGLU layer
(Llama, Qwen2, Mistral) runs a step whose rows are one run of the cache at one start as ONE kernel
call (`DecoderLayer.forward_step`, the same ops in the same order: the same bits), which saves the
~20 Python dispatches per layer that were ~7% of a smollm2-135m decode step. Logits differ from HF
transformers only in summation order (~1e-5 on smollm2-135m).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.attention import (GROUPED_MAX_QUERY, MAX_ROW_RUNS, STEP_HEAD_DIMS, _row_runs, attend,
                                         attend_rows, use_step_kernel)
from draftsmith.models.kv_cache import KVCache
from draftsmith.models.linear import FastLinear, choose_backend
from draftsmith.models.rope import RopeConfig, _rope_from_hf, _rope_signed, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gemma3_text")

# MLP activations by their HF config names (`hidden_act`, Gemma's `hidden_activation`)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2: always)
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation (ACTIVATIONS): SwiGLU, or GeGLU for Gemma
    o_bias: bool = False  # o_proj bias too (Qwen3-MoE / Gemma 3 with attention_bias)
    # Qwen3-MoE: the MLP of `moe_layers` is a router over `num_experts` SwiGLU experts of
    # `moe_intermediate_size`, `num_experts_per_tok` of them per token; the other layers are dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[int, ...] = ()
    # Gemma 3
    embed_scale: bool = False  # embeddings × sqrt(hidden_size), rounded to the weight dtype
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w), in float32 (w is stored around 0)
    sandwich_norm: bool = False  # post-attention norm on the attention output; pre/post-MLP norms
    attn_scale: float | None = None  # score scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_softcap: float | None = None  # logits → c · tanh(logits / c) (final_logit_softcapping)
    # Sliding-window layers: a query at position p sees keys p - sliding_window < j <= p.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None  # RoPE of the sliding layers (Gemma's local base); None = `rope`

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "DecoderConfig":
        """Build from a HF `config.json` dict (transformers 4.x and 5.x spellings)."""
        mt = cfg.get("model_type")
        if mt == "gemma3":
            raise DraftsmithError(
                "model_type 'gemma3' is the multimodal Gemma 3 (a vision tower beside the language model); "
                "Draftsmith runs only the text model: use a text-only checkpoint (model_type 'gemma3_text', "
                "e.g. gemma-3-1b) or one saved from Gemma3ForCausalLM"
            )
        if mt is None and ("kind" in cfg and "target_weights_hash" in cfg or "speculators_model_type" in cfg):
            kind = cfg.get("kind") or cfg.get("speculators_model_type")
            raise DraftsmithError(f"this directory holds a {kind} drafter, not a target model; give it as the drafter "
                                  f"(--drafter {kind}:DIR) and the model it drafts for as the target")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise DraftsmithError(
                f"model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            head_dim = cfg.get("head_dim") or hidden // heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            fields: dict[str, Any] = dict(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=(mt == "qwen2") or bool(cfg.get("attention_bias", False)),
                qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3_text"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            if mt == "qwen3_moe":
                fields.update(_qwen3_moe_fields(cfg, layers))
            elif mt == "gemma3_text":
                fields.update(_gemma3_fields(cfg, layers))
            else:
                fields["rope"] = _rope_from_hf(cfg)
            return DecoderConfig(**fields)
        except KeyError as e:
            raise DraftsmithError(f"config.json is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:  # e.g. "num_hidden_layers": "thirty"
            raise DraftsmithError(
                f"config.json has a field of the wrong type ({' '.join(str(e).split())}); "
                "sizes and counts must be numbers"
            ) from None


def _activation(name: Any) -> str:
    if name not in ACTIVATIONS:
        raise DraftsmithError(f"MLP activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return name


def _qwen3_moe_fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen3-MoE beyond Qwen3: which layers are sparse (HF: not in `mlp_only_layers` and
    (i + 1) % `decoder_sparse_step` == 0), the experts' geometry, and an optional sliding window
    on every layer (`use_sliding_window`). `save_pretrained` writes `num_local_experts`, the Hub
    configs `num_experts`."""
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    moe_layers = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    top_k = int(cfg["num_experts_per_tok"]) if moe_layers else 0
    if moe_layers and not 1 <= top_k <= experts:
        raise DraftsmithError(f"config.json: num_experts_per_tok {top_k} must be between 1 and num_experts {experts}")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return dict(
        rope=_rope_from_hf(cfg),
        hidden_act=_activation(cfg.get("hidden_act", "silu")),
        o_bias=bool(cfg.get("attention_bias", False)),
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]) if moe_layers else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=moe_layers,
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(range(layers)) if window else (),
    )


GEMMA3_ROPE_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # HF's defaults


def _gemma3_fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """Gemma 3 (text): layer kinds from `layer_types` or, in older configs, every
    `sliding_window_pattern`-th layer full (default 6); two RoPEs, transformers 5's
    `rope_parameters` {"full_attention": ..., "sliding_attention": ...} or 4.x's `rope_theta` +
    `rope_scaling` (global layers only) + `rope_local_base_freq`. Defaults are HF's."""
    if cfg.get("use_bidirectional_attention"):
        raise DraftsmithError("Gemma 3 with use_bidirectional_attention (an embedding model) cannot generate text")
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) < layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise DraftsmithError(
            f"config.json: layer_types must give 'sliding_attention' or 'full_attention' for each of the "
            f"{layers} layers, got {types!r}"
        )
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        ropes = {t: dict(params.get(t) or {}) for t in GEMMA3_ROPE_THETA}
    else:  # transformers 4.x
        ropes = {
            "full_attention": {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta")},
            "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq")},
        }
    for t, theta in GEMMA3_ROPE_THETA.items():
        if ropes[t].get("rope_theta") is None:
            ropes[t]["rope_theta"] = theta
    window = cfg.get("sliding_window", 4096)
    # `attn_logit_softcapping` is not read: HF's Gemma 3 attention never applies it (Gemma 2's
    # did), so a config that sets it still means uncapped scores.
    final_cap = cfg.get("final_logit_softcapping")
    return dict(
        head_dim=int(cfg.get("head_dim") or 256),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope=_rope_from_hf({"rope_parameters": ropes["full_attention"]}),
        local_rope=_rope_from_hf({"rope_parameters": ropes["sliding_attention"]}),
        hidden_act=_activation(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        o_bias=bool(cfg.get("attention_bias", False)),
        embed_scale=True,
        norm_unit_offset=True,
        sandwich_norm=True,
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_softcap=None if final_cap is None else float(final_cap),
        sliding_window=None if window is None else int(window),
        sliding_layers=tuple(i for i in range(layers) if types[i] == "sliding_attention"),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, scale. The fused kernel normalises (on CPU
    bit-identical to HF's pow / mean / rsqrt composite); float32 scales inside it."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF's order: normalise in float32, round to the input dtype, then scale (3 ops, not 7).
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: normalise and scale by (1 + w), both in float32, then cast back (HF
    rounds once, after the scale, unlike `rms_norm`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + weight.float(), eps).to(x.dtype)


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in one pass per row (kernels/gemv.cpp; inference on a CPU with the "kernels"
    linears): the same order of operations, the sum of squares in another order (~1 ulp)."""
    return torch.ops.draftsmith.rms_norm(x, weight, eps)


def rope_composite(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, n: int) -> torch.Tensor:
    """RoPE of the first n heads of x [B, S, heads, D] (models/rope.py)."""
    return _rope_signed(x[:, :, :n], cos, sin_signed)


def rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, n: int) -> torch.Tensor:
    """`rope_composite` as one op (kernels/gemv.cpp): the same products and sum, bit-identical."""
    return torch.ops.draftsmith.rope(x, cos, sin_signed, n)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return rms_norm_unit_offset(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.qk_norm = cfg.qk_norm
        self.sliding = layer_idx in cfg.sliding_layers  # reads `ctx.sliding`, its window and RoPE
        self.scale = cfg.attn_scale  # None: SDPA's default head_dim ** -0.5
        # Set by `Decoder.prepare_inference_()`: [q; k; v] as one linear, and o_proj; RoPE of the
        # first n heads of x [B, S, heads, D] (the one-op kernel with the "kernels" linears).
        self.qkv: FastLinear | None = None
        self.o: FastLinear | None = None
        self.rope_fn = rope_composite
        # q / k RMSNorm as the one-pass kernel with the fused ops (what the one-call layer runs); None:
        # the modules
        self.qk_norm_fn: Callable[..., torch.Tensor] | None = None

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            return self.qkv(x)
        return torch.cat(
            [F.linear(x, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1
        )

    def forward(self, x: torch.Tensor, ctx: "_StepContext", cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        nh, nkv = self.n_heads, self.n_kv
        if self.sliding:
            ctx = ctx.sliding
        qkv = self._qkv(x).view(B, S, nh + 2 * nkv, self.hd)  # [B, S, heads, D]
        rope = self.rope_fn
        if self.qk_norm:
            qs, ks = qkv[:, :, :nh], qkv[:, :, nh : nh + nkv]
            if self.qk_norm_fn is not None:
                qs = self.qk_norm_fn(qs, self.q_norm.weight, self.q_norm.eps)
                ks = self.qk_norm_fn(ks, self.k_norm.weight, self.k_norm.eps)
            else:
                qs, ks = self.q_norm(qs), self.k_norm(ks)
            q = rope(qs, ctx.cos, ctx.sin_signed, nh)
            k = rope(ks, ctx.cos, ctx.sin_signed, nkv)
        else:  # rotate q and k together: one set of elementwise ops instead of two
            qk = rope(qkv, ctx.cos, ctx.sin_signed, nh + nkv)
            q, k = qk[:, :, :nh], qk[:, :, nh:]
        v = qkv[:, :, nh + nkv :]
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [rows, kv_heads, T, D]
        if ctx.positions is None:  # contiguous rows, one start: a plain slice assignment
            s0 = ctx.starts_list[0]
            kc[ctx.row_slice, :, s0 : s0 + S] = k.transpose(1, 2)
            vc[ctx.row_slice, :, s0 : s0 + S] = v.transpose(1, 2)
        else:  # one scatter for all rows (a per-row loop cost ~12 ms per step at batch 32)
            kc[ctx.rows[:, None], :, ctx.positions] = k
            vc[ctx.rows[:, None], :, ctx.positions] = v
        q = q.transpose(1, 2)  # [B, H, S, D]
        lo = ctx.kv_lo  # keys before it are outside every query's window (0 but in sliding layers)
        if ctx.rows_pos is not None and lo == 0 and ctx.attention == "auto" and use_step_kernel(q, kc):
            out = attend_rows(q, kc, vc, *ctx.rows_pos, self.scale)  # every row over its own keys, one call
        elif ctx.row_runs is None:  # rows in no useful order: gather their keys (a copy)
            out = attend(q, kc[ctx.rows, :, lo : ctx.kv_len], vc[ctx.rows, :, lo : ctx.kv_len], ctx.mask,
                         ctx.causal, ctx.attention, self.scale, ctx.suffix_causal)
        else:  # runs of consecutive rows (one run always for batch 1): views of the cache
            outs = []
            for b0, b1, r0, kv in ctx.row_runs:
                m = ctx.mask if ctx.mask is None or ctx.mask.shape[0] == 1 else ctx.mask[b0:b1, :, :, : kv - lo]
                r = slice(r0, r0 + b1 - b0)
                outs.append(attend(q[b0:b1], kc[r, :, lo:kv], vc[r, :, lo:kv], m, ctx.causal, ctx.attention,
                                   self.scale, ctx.suffix_causal))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = out.transpose(1, 2).reshape(B, S, nh * self.hd)
        if self.o is not None:
            return self.o(out)
        return F.linear(out, self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x)); SwiGLU with "silu", GeGLU with a gelu."""

    def __init__(self, cfg: DecoderConfig, intermediate_size: int | None = None, act: str = "silu") -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[act]
        self.fused_act = act == "silu"  # SwiGLU: silu(gate) * up as one kernel with the "kernels" linears
        # Set by `Decoder.prepare_inference_()` (inference only): [gate; up] as one linear, down, and
        # the product act(gate) * up of the fused output.
        self.gate_up: FastLinear | None = None
        self.down: FastLinear | None = None
        self.glu: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down(self.glu(self.gate_up(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    def prepare_inference_(self, backend: str) -> None:
        self.gate_up = FastLinear.build(_fuse([self.gate_proj, self.up_proj], "weight", backend), None, backend)
        # "mkl" (the earlier path) kept down_proj [out, in]: faster there.
        self.down = FastLinear.build(self.down_proj.weight, None, "torch" if backend == "mkl" else backend)
        self.set_fused_act_(backend == "kernels")

    def set_fused_act_(self, enabled: bool) -> None:
        """silu(gate) * up as one kernel (SwiGLU, float32 / bfloat16 on the "kernels" path) or torch's ops."""
        kernel = enabled and self.fused_act and self.gate_proj.weight.dtype in _KERNEL_DTYPES
        self.glu = torch.ops.draftsmith.silu_mul if kernel else self._glu


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse MLP. The router (`gate`, hidden → experts) scores each token; softmax
    in float32, the top `num_experts_per_tok` experts (renormalised to sum 1 with
    `norm_topk_prob`) each run their SwiGLU MLP on the token, and the outputs are summed with
    those weights. Checkpoint names as on the Hub and as `save_pretrained` writes them:
    `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`.

    Tokens are grouped by expert with one sort; only experts that received tokens run, each
    once on all of its tokens (a gather, a batched MLP, a weighted index_add)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(cfg, cfg.moe_intermediate_size, cfg.hidden_act) for _ in range(cfg.num_experts)
        )
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] → (weights [T, k] in h's dtype, experts [T, k])."""
        probs = torch.softmax(F.linear(h, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, chosen = self.route(h)
        flat = chosen.flatten()  # [T·k], token t's picks at t·k .. t·k + k - 1
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token, weight = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):  # experts in index order, as HF sums them
            if n:
                idx = token[start : start + n]
                y = self.experts[e].forward(h[idx]) * weight[start : start + n, None]
                out.index_add_(0, idx, y)
                start += n
        return out.view(x.shape)

    def prepare_inference_(self, backend: str) -> None:
        for expert in self.experts:
            expert.prepare_inference_(backend)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        H, eps, unit = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if layer_idx in cfg.moe_layers else MLP(cfg, act=cfg.hidden_act)
        self.input_layernorm = RMSNorm(H, eps, unit)
        self.post_attention_layernorm = RMSNorm(H, eps, unit)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:  # Gemma: post_attention_layernorm normalises the attention output instead
            self.pre_feedforward_layernorm = RMSNorm(H, eps, unit)
            self.post_feedforward_layernorm = RMSNorm(H, eps, unit)
        self.eps = eps
        self.norm_fn = rms_norm_unit_offset if unit else rms_norm
        # The residual add and the post-attention norm as one kernel (set with the "kernels" linears).
        self.add_norm_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # The whole layer as one kernel call for steps whose rows are one run of the cache at one
        # start (`forward_step`): its weights and sizes, set by `Decoder.set_fused_ops_` where the
        # layer is a plain pre-norm SwiGLU layer on the "kernels" linears; None otherwise.
        self.step_args: tuple | None = None

    def forward(self, x: torch.Tensor, ctx: "_StepContext", cache: KVCache) -> torch.Tensor:
        # Functional calls (not module __call__): ~10 fewer Python dispatches per layer.
        norm, eps = self.norm_fn, self.eps
        if self.sandwich:
            a = self.self_attn.forward(norm(x, self.input_layernorm.weight, eps), ctx, cache)
            x = x + norm(a, self.post_attention_layernorm.weight, eps)
            m = self.mlp.forward(norm(x, self.pre_feedforward_layernorm.weight, eps))
            return x + norm(m, self.post_feedforward_layernorm.weight, eps)
        a = self.self_attn.forward(norm(x, self.input_layernorm.weight, eps), ctx, cache)
        if self.add_norm_fn is not None:
            x, h = self.add_norm_fn(x, a, self.post_attention_layernorm.weight, eps)
            return x + self.mlp.forward(h)
        x = x + a
        return x + self.mlp.forward(norm(x, self.post_attention_layernorm.weight, eps))

    def forward_step(self, x: torch.Tensor, ctx: "_StepContext", cache: KVCache) -> torch.Tensor:
        """`forward` as one kernel call (kernels/gemv.cpp `layer`: the same ops in the same order,
        the same bits) for a step `Decoder.forward` found eligible: `step_args` set, the rows one
        run of consecutive cache rows at one start, keys from 0."""
        a = self.self_attn
        ln1, ln2, eps, qkv, o, gu, down, dims, qn, kn = self.step_args
        i = a.layer_idx
        return torch.ops.draftsmith.layer(
            x, ln1, ln2, eps, qkv.weight, qkv.bias, o.weight, o.bias, gu.weight, down.weight, dims,
            cache.k[i], cache.v[i], ctx.row_runs[0][2], ctx.starts_list[0], ctx.cos, ctx.sin_signed,
            None if ctx.suffix_causal else ctx.mask, ctx.causal or ctx.suffix_causal,
            a.hd ** -0.5 if a.scale is None else a.scale, qn, kn)

    def _step_args(self) -> tuple | None:
        """What `forward_step` needs, or None where this layer is not the plain kind it runs."""
        a, mlp = self.self_attn, self.mlp
        if a.qk_norm and (a.qk_norm_fn is not rms_norm_kernel or a.q_norm.eps != self.eps or a.k_norm.eps != self.eps):
            return None
        if (self.sandwich or a.sliding or not isinstance(mlp, MLP) or a.qkv is None
                or a.rope_fn is not rope_kernel or self.add_norm_fn is None
                or mlp.glu is not torch.ops.draftsmith.silu_mul or a.hd not in STEP_HEAD_DIMS):
            return None
        lins = (a.qkv, a.o, mlp.gate_up, mlp.down)
        if any(f.backend != "kernels" for f in lins) or mlp.gate_up.bias is not None or mlp.down.bias is not None:
            return None
        dims = [a.o.out_features, a.n_heads, a.n_kv, a.hd, mlp.down.in_features]
        norms = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
        return (self.input_layernorm.weight, self.post_attention_layernorm.weight, self.eps, *lins, dims, *norms)


@dataclass
class _StepContext:
    rows: torch.Tensor | None  # [B] cache rows on the model device (for scatters and gathers)
    row_slice: slice | None  # rows as a contiguous slice when they are one
    row_runs: list[tuple[int, int, int, int]] | None  # (b0, b1, first row, keys): see _row_runs
    starts_list: list[int]  # per-row start positions
    positions: torch.Tensor | None  # [B, S] (general path only)
    kv_len: int  # keys visible this step: max(start) + S
    mask: torch.Tensor | None  # [B or 1, 1, S, kv_len - kv_lo] bool, True = attend; None when not needed
    causal: bool  # no mask, SDPA's own causal mask (all rows start at 0)
    attention: str  # "auto", "sdpa" or "grouped" (models/attention.py)
    cos: torch.Tensor  # [B or 1, S, 1, D]
    sin_signed: torch.Tensor  # [B or 1, S, 1, D], first half negated (see _rope_signed)
    kv_lo: int = 0  # first key attended (sliding layers: keys before it are outside every window)
    sliding: "_StepContext | None" = None  # the step as sliding-window layers see it (_window_context)
    # `mask` is the causal mask of rows that all start at one position: query s sees keys up to
    # kv_len - S + s, which Draftsmith's step kernel computes without reading a mask (the same result)
    suffix_causal: bool = False
    # CPU, rows not one contiguous run at one start: (rows [B], positions [B, S]) int64 for the
    # kernel that attends every row over its own keys in one call (models/attention.attend_rows)
    rows_pos: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class DecoderOutput:
    logits: torch.Tensor | None  # [B, S or M, V] (float32)
    hidden: dict[int, torch.Tensor]  # layer id -> [B, S, H], decoder-layer outputs
    final_hidden: torch.Tensor  # [B, S, H] after the final norm (lm_head input)


class Decoder(nn.Module):
    """Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 decoder with a row-batched, preallocated KV
    cache (sliding-window layers keep every position too; they only read their window)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv, scale = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin_signed) [T, D]
        self._local_rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # of cfg.local_rope
        self.head: FastLinear | None = None  # lm_head, set by prepare_inference_()
        self.linear_backend: str | None = None  # resolved backend of prepare_inference_()
        self.final_norm_fn = None  # set by prepare_inference_() (None: the RMSNorm module)
        self.attention_kernel = "auto"  # models/attention.attend: auto, torch, step, sdpa or grouped
        # New weights through load_state_dict reach the prepared linears (oneDNN holds copies).
        self.register_load_state_dict_post_hook(_reprepare_after_load)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_rows: int, max_len: int | None = None) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers, max_rows, c.num_kv_heads, max_len or c.max_position_embeddings,
            c.head_dim, dtype=self.dtype, device=self.device,
        )

    @torch.no_grad()
    def prepare_inference_(self, backend: str = "auto") -> "Decoder":
        """Inference layout (models/linear.py): q/k/v and gate/up each become one linear, and
        every linear (o_proj, down_proj and the lm_head too) is laid out once for `backend`.

        One larger product instead of 2-3 saves dispatch overhead. The original parameters
        stay usable (names, shapes, `state_dict`): with "mkl" and "torch" they become views of
        the fused matrices (no memory duplicated); "kernels" and "onednn" keep them and add
        copies in their own layouts.
        Numerics change only in summation order (~1e-6 relative). Idempotent; call again after
        moving the model to another device or dtype, or changing weights in place (a
        `load_state_dict` re-prepares by itself)."""
        backend = choose_backend(backend, self.device)
        for layer in self.model.layers:
            a = layer.self_attn
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            w, b = _fuse(qkv, "weight", backend), _fuse(qkv, "bias", backend) if a.q_proj.bias is not None else None
            a.qkv = FastLinear.build(w, b, backend)
            a.o = FastLinear.build(_fuse([a.o_proj], "weight", backend), a.o_proj.bias, backend)
            layer.mlp.prepare_inference_(backend)  # an MLP, or every expert of a SparseMoE
            layer.norm_fn = self._norm_fn(backend)
        # "mkl" (the earlier path) kept down_proj and the lm_head [out, in]: faster there.
        self.head = FastLinear.build(self.lm_head.weight, None, "torch" if backend == "mkl" else backend)
        self.final_norm_fn = None if self.config.norm_unit_offset else self._norm_fn(backend)
        self.linear_backend = backend
        return self.set_fused_ops_(True)

    def set_fused_ops_(self, enabled: bool = True, one_call_layers: bool = True) -> "Decoder":
        """RoPE, SwiGLU's silu(gate) * up and the residual add + RMSNorm each as one kernel
        (kernels/gemv.cpp; the default with the "kernels" linears, float32 / bfloat16), or as torch's
        ops (`enabled=False`: the benchmarks' before / after). The same numerics but for silu's
        exp (a few float32 ulps). `one_call_layers`: plain layers run a step as one kernel call
        (`DecoderLayer.forward_step`, the same bits); False calls the fused kernels one by one.
        A no-op for other backends; call after `prepare_inference_`."""
        for layer in self.model.layers:
            on = enabled and layer.norm_fn is rms_norm_kernel
            layer.self_attn.rope_fn = rope_kernel if on and self.config.head_dim % 2 == 0 else rope_composite
            layer.add_norm_fn = torch.ops.draftsmith.add_rms_norm if on else None
            layer.self_attn.qk_norm_fn = rms_norm_kernel if on and layer.self_attn.qk_norm else None
            for mlp in getattr(layer.mlp, "experts", [layer.mlp]):  # an MLP, or a SparseMoE's experts
                if mlp.gate_up is not None:
                    mlp.set_fused_act_(on)
            layer.step_args = layer._step_args() if on and one_call_layers else None
        return self

    def _norm_fn(self, backend: str):
        """The layers' RMSNorm for `backend`: with the "kernels" linears, the one-pass kernel (torch's
        composite costs ~25 us a call on a CPU; a row's result does not depend on the batch)."""
        if self.config.norm_unit_offset:
            return rms_norm_unit_offset
        return rms_norm_kernel if backend == "kernels" and self.dtype in _KERNEL_DTYPES else rms_norm

    def _rope_tables(self, n: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin for positions 0..n-1, computed once with the same ops (hence the same
        bits) as a per-step computation; grown by doubling when a longer cache shows up.
        local: the table of `config.local_rope` (Gemma's sliding layers)."""
        tab = self._local_rope_cache if local else self._rope_cache
        if tab is None or tab[0].shape[0] < n or tab[0].device != self.device or tab[0].dtype != self.dtype:
            n = max(n, 2 * tab[0].shape[0] if tab is not None else 0, 256)
            if local:  # derived from the config (not a buffer: loading rebuilds only inv_freq)
                c = self.config
                inv, scale = rope_inv_freq(c.local_rope, c.head_dim, c.max_position_embeddings)
            else:
                inv, scale = self.inv_freq, self.rope_scale
            pos = torch.arange(n, device=inv.device)
            freqs = pos[:, None].float() * inv.float()[None, :]  # [n, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * scale).to(self.dtype)
            sin = (emb.sin() * scale).to(self.dtype)
            half = sin.shape[-1] // 2
            sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            tab = (cos.to(self.device), sin_signed.to(self.device))
            if local:
                self._local_rope_cache = tab
            else:
                self._rope_cache = tab
        return tab

    def _context(self, rows_list: list[int], S: int, cache: KVCache) -> _StepContext:
        B = len(rows_list)
        starts_list = cache.lengths[rows_list].tolist() if B > 1 else [int(cache.lengths[rows_list[0]])]
        kv_len = max(starts_list) + S
        cache.check_need(kv_len)
        cos_t, sin_t = self._rope_tables(kv_len)
        r0 = rows_list[0]
        contiguous = rows_list == list(range(r0, r0 + B))
        same_start = all(s == starts_list[0] for s in starts_list)
        dev = self.device
        if same_start:  # cos/sin are views of the tables, shared by all rows
            s0 = starts_list[0]
            cos, sin_signed = cos_t[None, s0 : s0 + S, None], sin_t[None, s0 : s0 + S, None]
        positions = None
        if not (same_start and contiguous):
            positions = (torch.tensor(starts_list)[:, None] + torch.arange(S)[None, :]).to(dev)  # [B, S]
        if not same_start:
            cos, sin_signed = cos_t[positions][:, :, None], sin_t[positions][:, :, None]
        # Masks: none for one new token per row when all rows see the same keys (every key
        # is visible), SDPA's causal mask when all rows start at 0, an explicit one otherwise.
        mask, causal, suffix_causal = None, False, False
        if same_start and S > 1:
            if starts_list[0] == 0:
                causal = True
            else:
                q_pos = torch.arange(starts_list[0], kv_len, device=dev)
                mask = (torch.arange(kv_len, device=dev)[None, :] <= q_pos[:, None])[None, None]
                suffix_causal = True
        elif not same_start:
            key_pos = torch.arange(kv_len, device=dev)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, kv_len]
        runs = _row_runs(rows_list, starts_list, S, None if dev.type == "cpu" else MAX_ROW_RUNS)
        rows = None if positions is None and runs is not None else torch.tensor(rows_list, device=dev)
        ctx = _StepContext(
            rows=rows,
            row_slice=slice(r0, r0 + B) if contiguous else None,
            row_runs=runs,
            starts_list=starts_list,
            positions=positions,
            kv_len=kv_len,
            mask=mask,
            causal=causal,
            suffix_causal=suffix_causal,
            attention=self.attention_kernel,
            cos=cos,
            sin_signed=sin_signed,
            rows_pos=(rows, positions) if dev.type == "cpu" and positions is not None else None,
        )
        if self.config.sliding_layers:
            ctx.sliding = self._window_context(ctx, S, same_start)
        return ctx

    def _window_context(self, ctx: _StepContext, S: int, same_start: bool) -> _StepContext:
        """The step for sliding-window layers: their RoPE (`local_rope`, else the same), and a
        query at position p sees keys p - W < j <= p (HF's sliding mask). Keys before
        kv_lo = min(start) - W + 1 are outside every window and not read at all; one new token
        per row at one position then needs no mask (its window is exactly kv_lo .. kv_len - 1)."""
        cfg, W = self.config, self.config.sliding_window
        cos, sin_signed = ctx.cos, ctx.sin_signed
        if cfg.local_rope is not None:
            cos_t, sin_t = self._rope_tables(ctx.kv_len, local=True)
            if same_start:
                s0 = ctx.starts_list[0]
                cos, sin_signed = cos_t[None, s0 : s0 + S, None], sin_t[None, s0 : s0 + S, None]
            else:
                cos, sin_signed = cos_t[ctx.positions][:, :, None], sin_t[ctx.positions][:, :, None]
        if W is None or ctx.kv_len <= W:  # every visible key lies in every query's window
            return replace(ctx, cos=cos, sin_signed=sin_signed, sliding=None)
        lo = max(0, min(ctx.starts_list) - W + 1)
        # The step attention kernel sums keys in tiles of 16 counted from the first key it is
        # given: start at a multiple of 16 so a key lands in the same tile in a verify block as
        # in a one-token step (the keys it adds are masked out).
        exact_lo, lo = lo, lo - lo % KEY_TILE
        mask = None
        if not (same_start and S == 1 and lo == exact_lo):
            dev = self.device
            if ctx.positions is not None:
                q_pos = ctx.positions[:, :, None]  # [B, S, 1]
            else:
                q_pos = (torch.arange(S, device=dev) + ctx.starts_list[0])[None, :, None]  # [1, S, 1]
            key_pos = torch.arange(lo, ctx.kv_len, device=dev)
            mask = ((key_pos <= q_pos) & (key_pos > q_pos - W))[:, None]  # [B or 1, 1, S, kv_len - lo]
        return replace(ctx, cos=cos, sin_signed=sin_signed, mask=mask, causal=False, suffix_causal=False, kv_lo=lo,
                       rows_pos=None,  # attend_rows knows no window: the masked path
                       sliding=None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        cache: KVCache,
        rows: torch.Tensor | None = None,  # [B] cache rows (default 0..B-1)
        layer_ids: tuple[int, ...] = (),
        logit_index: torch.Tensor | None = None,  # [B, M] positions in S to score; None = all
        compute_logits: bool = True,
    ) -> DecoderOutput:
        """Run S new tokens per row; does NOT advance cache lengths (the caller commits)."""
        B, S = input_ids.shape
        rows_list = list(range(B)) if rows is None else rows.tolist()
        if input_ids.numel():
            lo, hi = torch.aminmax(input_ids)
            if int(hi) >= self.config.vocab_size or int(lo) < 0:
                raise DraftsmithError(
                    f"token id outside the model vocabulary [0, {self.config.vocab_size})"
                )
        ctx = self._context(rows_list, S, cache)
        x = F.embedding(input_ids.to(self.device), self.model.embed_tokens.weight)
        if self.config.embed_scale:  # Gemma: × sqrt(hidden), the factor rounded to the weight dtype
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32, device=x.device).to(x.dtype)
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(layer_ids)
        # One run of consecutive rows at one start, every key from 0, the step attention kernel's
        # size: layers with step_args run as one kernel call each (DecoderLayer.forward_step).
        one_call = (ctx.positions is None and ctx.row_runs is not None and len(ctx.row_runs) == 1
                    and ctx.row_runs[0][3] == ctx.kv_len and ctx.attention == "auto"
                    and S <= GROUPED_MAX_QUERY and x.dtype == cache.k[0].dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_step(x, ctx, cache) if one_call and layer.step_args is not None else \
                layer.forward(x, ctx, cache)
            if i in wanted:
                hidden[i] = x
        final = self.model.norm.forward(x) if self.final_norm_fn is None else \
            self.final_norm_fn(x, self.model.norm.weight, self.model.norm.eps)
        logits = None
        if compute_logits:
            h = final
            if logit_index is not None:
                idx = logit_index.to(self.device)
                h = torch.gather(final, 1, idx[..., None].expand(-1, -1, final.shape[-1]))
            logits = self.logits_from(h)
        return DecoderOutput(logits=logits, hidden=hidden, final_hidden=final)

    @torch.inference_mode()
    def logits_from(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of normed final states [..., H] (a forward's `final_hidden`)."""
        logits = self.head(final_hidden) if self.head is not None else F.linear(final_hidden, self.lm_head.weight)
        if self.config.final_softcap is not None:
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return logits.float()


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
KEY_TILE = 16  # keys per score tile of the step attention kernel (kernels/gemv.cpp)


def _reprepare_after_load(module: "Decoder", incompatible_keys) -> None:
    if module.linear_backend is not None:
        module.prepare_inference_(module.linear_backend)


def _fuse(linears: list[nn.Linear], name: str, backend: str) -> torch.Tensor:
    """Concatenate `name` ("weight" [out, in] or "bias" [out]) of Linears along the output dim
    → [sum(out), in] (or [sum(out)]). Except for "kernels" / "onednn" (which copy the result into their own
    layout), the Linears' parameters are re-pointed at views of the fused tensor; "mkl" stores
    it [in, out] underneath, as its kernel wants, and returns the [out, in] view of that."""
    params = [getattr(m, name) for m in linears]
    if name == "bias" or backend != "mkl":
        fused = torch.cat([p.detach() for p in params], dim=0)
        if backend in ("kernels", "onednn"):
            return fused
        views, start = [], 0
        for p in params:
            views.append(fused[start : start + p.shape[0]])
            start += p.shape[0]
    else:
        fused_t = torch.cat([p.detach().t() for p in params], dim=1).contiguous()  # [in, out]
        fused = fused_t.t()
        views, start = [], 0
        for p in params:
            views.append(fused_t[:, start : start + p.shape[0]].t())  # [out, in] view
            start += p.shape[0]
    for m, p, v in zip(linears, params, views):
        setattr(m, name, nn.Parameter(v, requires_grad=p.requires_grad))
    return fused

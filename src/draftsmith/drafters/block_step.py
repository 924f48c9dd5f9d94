"""A block drafter's inference forward as one kernel call per draft layer (CPU kernels).

The KV-injected layer (drafters/block_attention.py) attends over [context keys ; the block's own
keys], bidirectionally inside the block. At inference a row's context keys are already in the
drafter's cache at positions 0 .. L − 1 (L = its context length) and the block sits at positions
L .. L + n − 1, so writing the block's keys and values there and letting every block query see
every key up to L + n (no mask, not causal) is the same attention. That is the target's one-call
decoder layer (kernels/gemv.cpp `layer`, with the drafter's q / k norm): RMSNorm, fused q/k/v,
q / k norm, RoPE, the K/V write, attention, o, add + RMSNorm, fused gate/up SwiGLU and down in
one C++ call instead of ~40 torch ops. The block's keys land past the context length, where the
next context append overwrites them.

Same math as the op-by-op path in another summation order (~1e-6 relative): drafts may differ
on near-ties, never losslessness — q is computed from the logits the drafts are sampled from.
"""

from __future__ import annotations

import torch

from draftsmith.drafters.block_attention import rope_cos_sin
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.attention import STEP_HEAD_DIMS, attend_rows
from draftsmith.models.decoder import _fuse, rms_norm_kernel, rope_kernel
from draftsmith.models.linear import FastLinear, _tensor_key


def one_call_reason(backbone) -> str | None:
    """Why this backbone's layers cannot run as one kernel call each (None: they can)."""
    c = backbone.cfg
    if backbone.fc.weight.device.type != "cpu":
        return "not on the CPU"
    status = cpu_kernels()
    if not status.ok:
        return f"no CPU kernels ({status.reason})"
    if backbone.dtype not in (torch.float32, torch.bfloat16) or (backbone.dtype == torch.bfloat16 and not status.bf16):
        return f"no kernel for {backbone.dtype}"
    if c.head_dim not in STEP_HEAD_DIMS:
        return f"head_dim {c.head_dim} is not compiled into the step kernel"
    if any(not layer.mlp.fused_act for layer in backbone.layers):
        return "the MLP is not SwiGLU"
    return None


class BlockStep:
    """The draft layers' `torch.ops.draftsmith.layer` arguments: q/k/v and gate/up fused, every
    linear laid out for the CPU kernel; laid out again whenever a weight changes (a drafter that
    is also trained, load_state_dict)."""

    def __init__(self, backbone) -> None:
        self.backbone = backbone
        self._key: tuple | None = None
        self._layers: list[tuple] = []
        # the draft layers' parameters, listed once (walking the modules every round cost ~0.1 ms)
        self._params = [p for layer in backbone.layers for p in layer.parameters()]
        self._refresh()  # now, not in the first round (a load-aware policy would count it as drafting time)

    @torch.no_grad()
    def _refresh(self) -> None:
        key = tuple(_tensor_key(p) for p in self._params)
        if key != self._key:
            self._lay_out()
            self._key = key

    def _lay_out(self) -> None:
        c = self.backbone.cfg
        out = []
        for layer in self.backbone.layers:
            a, m = layer.self_attn, layer.mlp
            qkv_lins = [a.q_proj, a.k_proj, a.v_proj]
            qkv_b = _fuse(qkv_lins, "bias", "kernels") if a.q_proj.bias is not None else None
            qkv = FastLinear.build(_fuse(qkv_lins, "weight", "kernels"), qkv_b, "kernels")
            o = FastLinear.build(a.o_proj.weight, a.o_proj.bias, "kernels")
            gu = FastLinear.build(_fuse([m.gate_proj, m.up_proj], "weight", "kernels"), None, "kernels")
            down = FastLinear.build(m.down_proj.weight, None, "kernels")
            dims = [c.hidden_size, a.n_heads, a.n_kv, a.hd, down.in_features]
            norms = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
            out.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        float(layer.input_layernorm.eps), qkv, o, gu, down, dims, *norms))
        self._layers = out

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, row0: int, start: int, kc: list[torch.Tensor],
                vc: list[torch.Tensor]) -> torch.Tensor:
        """Block ids [B, n] of cache rows row0 .. row0 + B − 1, whose contexts all hold `start`
        positions → final-normed hidden [B, n, H]; writes the block's keys / values at positions
        start .. start + n − 1 of those rows (past the context: overwritten by the next append)."""
        bb = self.backbone
        self._refresh()
        n = ids.shape[1]
        x = bb.head.embed_ids(ids, bb.dtype)
        cos, sin_signed = self._rope(torch.arange(start, start + n)[None], x.dtype)
        for i, (ln1, ln2, eps, qkv, o, gu, down, dims, qn, kn) in enumerate(self._layers):
            x = torch.ops.draftsmith.layer(
                x, ln1, ln2, eps, qkv.weight, qkv.bias, o.weight, o.bias, gu.weight, down.weight, dims,
                kc[i], vc[i], row0, start, cos, sin_signed, None, False, dims[3] ** -0.5, qn, kn)
        return self._final_norm(x)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, n] → cos and sin with its first half negated, [B or 1, n, 1, D]: the
        layout of the kernels' RoPE."""
        bb = self.backbone
        cos, sin = rope_cos_sin(bb.inv_freq, positions, bb.rope_scale, dtype)
        half = cos.shape[-1] // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        return cos[:, :, None].contiguous(), sin_signed[:, :, None]

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        bb = self.backbone
        if bb.norm.unit_offset:
            return bb.norm(x)
        return rms_norm_kernel(x, bb.norm.weight, bb.norm.eps)  # one pass per row (torch's took ~60 us here)

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, kc: list[torch.Tensor],
                     vc: list[torch.Tensor]) -> torch.Tensor:
        """Block ids [B, n] of cache rows `rows` [B] (any rows) whose contexts hold `starts` [B]
        positions (any lengths) → final-normed hidden [B, n, H]; writes each block's keys / values
        at positions starts[b] .. starts[b] + n − 1 of its row, past its context.

        The layer of forward()'s one call, op by op through the same kernels: each block query
        sees its own row's keys up to the block's last position (`attention_rows`: every row over
        its own keys, no gather, no mask). Rows of mixed lengths took the two-part attention path
        before: gathered context keys, torch's einsums and a masked softmax (~30 ms a round at 16-32
        rows on 2 cores)."""
        bb = self.backbone
        self._refresh()
        B, n = ids.shape
        x = bb.head.embed_ids(ids, bb.dtype)
        pos = starts[:, None] + torch.arange(n)  # [B, n]
        cos, sin_signed = self._rope(pos, x.dtype)
        visible = (starts + (n - 1))[:, None].expand(B, n).contiguous()  # the whole block, both ways
        for i, (ln1, ln2, eps, qkv, o, gu, down, dims, qn, kn) in enumerate(self._layers):
            nh, nkv, hd = dims[1], dims[2], dims[3]
            y = qkv(rms_norm_kernel(x, ln1, eps)).view(B, n, nh + 2 * nkv, hd)
            qs, ks, v = y[:, :, :nh], y[:, :, nh:nh + nkv], y[:, :, nh + nkv:]
            if qn is not None:
                qs, ks = rms_norm_kernel(qs, qn, eps), rms_norm_kernel(ks, kn, eps)
            q, k = rope_kernel(qs, cos, sin_signed, nh), rope_kernel(ks, cos, sin_signed, nkv)
            kc[i][rows[:, None], :, pos] = k
            vc[i][rows[:, None], :, pos] = v
            a = attend_rows(q.transpose(1, 2), kc[i], vc[i], rows, visible, hd ** -0.5)  # [B, nh, n, hd]
            x = x + o(a.transpose(1, 2).reshape(B, n, nh * hd))
            x = x + down(torch.ops.draftsmith.silu_mul(gu(rms_norm_kernel(x, ln2, eps))))
        return self._final_norm(x)

"""Will the drafter fit? A size estimate from the configs alone, checked before it is built.

`drafter.num_layers=1000` (or an intermediate_size of millions) built tens of GB of layers
before anything said no. Every trainable kind's draft layers are decoder layers as wide as the
target's (drafters/block.py, eagle3.py: `dataclasses.replace(target config, intermediate_size=...)`),
so their parameters are known before anything is built: `num_layers` of them (EAGLE-3: one),
each attention (q, k, v, o) plus a SwiGLU MLP. That is a lower bound (it leaves out W_c, norms and
an EAGLE-3 head); training keeps four float32 numbers per parameter (weight, gradient, AdamW's
two moments), so the run needs at least 16 bytes per parameter beside the target.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models import kv_cache
from draftsmith.models.decoder import DecoderConfig

BYTES_PER_PARAM = 16  # float32 weight + gradient + AdamW exp_avg + exp_avg_sq


def draft_layer_params(drafter, tc: DecoderConfig) -> tuple[int, int]:
    """(draft layers, parameters of each) of a drafter config on a target of config `tc`."""
    H, D = tc.hidden_size, tc.head_dim
    inter = getattr(drafter, "intermediate_size", None) or tc.intermediate_size
    attention = 2 * H * tc.num_heads * D + 2 * H * tc.num_kv_heads * D
    return int(getattr(drafter, "num_layers", 1)), attention + 3 * H * inter


def check_fits(kind: str, drafter, tc: DecoderConfig, device: torch.device) -> None:
    """Refuse a drafter whose training state cannot fit the memory `device` has free, naming the
    settings that size it. Nothing is checked for a config without them (a kind that is no stack
    of decoder layers) or where the free memory cannot be read."""
    knobs = [f"drafter.{k}={getattr(drafter, k)}" for k in ("num_layers", "intermediate_size")
             if getattr(drafter, k, None) is not None]
    layers, per_layer = draft_layer_params(drafter, tc)
    need = layers * per_layer * BYTES_PER_PARAM
    free = kv_cache.free_memory(device) if knobs else None
    if free is None or need <= free:
        return
    raise DraftsmithError(
        f"the {kind} drafter is too large to train here: {layers} draft layer(s) of {per_layer / 1e6:.1f} M parameters "
        f"need at least {need / 1e9:.1f} GB ({BYTES_PER_PARAM} bytes a parameter: float32 weights, gradients and "
        f"AdamW's two moments), and the {device.type} has {free / 1e9:.1f} GB free; lower {' or '.join(knobs)}")

"""The contract between trainable drafters (drafters/eagle3.py, dflash.py, dspark.py) and
the generic training / calibration / evaluation machinery (train/, eval/).

A trainable drafter kind provides, in its own file:

    <Kind>Config       frozen dataclass; `kind` literal; fields with defaults from docs/ALGORITHMS.md
    <Kind>Model        nn.Module built by `build(target: Decoder, config)`; shares the target's
                       embedding and lm_head (frozen, not saved); exposes
                         feature_spec -> FeatureSpec (which target layers it reads)
                         training_loss(batch: TrainBatch, generator) -> LossOutput
                         target_stats(final_hidden [T, H]) -> (rest_lse [T], top1 [T]) | None
                           (optional: per-position statistics of the frozen target that
                           training would otherwise recompute at every step; asked first
                           with T = 0 whether the model has them)
                         make_drafter(target: Decoder, max_rows, max_len) -> Drafter (inference)
    registered once in `drafters/registry.py` (the one registry of drafter kinds).

Checkpoint directory (written atomically by train/checkpoint.py):
    config.json          {"kind", "target_id", "target_weights_hash", "format_version", ...config}
    model.safetensors    trainable parameters only (not the frozen target embedding / lm_head)
    calibration.json     optional: STS temperatures per position and their regime (draftsmith calibrate)
    train_state/         optimizer, scheduler, RNG states, step (exact resume)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """A padded batch of regenerated conversations with their target features.

    input_ids:    [B, T] int64 token ids (padding = 0 past lengths)
    loss_mask:    [B, T] bool, True on assistant tokens the drafter should learn to predict
    lengths:      [B] int64 valid tokens per row
    hidden:       layer id -> [B, T, H] target decoder-layer outputs (float32 on the device)
    final_hidden: [B, T, H] target's normed last hidden state; target logits at position t
                  (predicting token t+1) are lm_head(final_hidden[:, t])
    target_rest_lse, target_top1: optional [B, T] float32 / int64, what a model's
                  `target_stats(final_hidden)` returned for these positions (train/data.py
                  computes them once per window): with a reduced draft vocabulary, the
                  log-sum-exp of the target logits outside it and the target's argmax token
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    hidden: dict[int, torch.Tensor]
    final_hidden: torch.Tensor
    target_rest_lse: torch.Tensor | None = None
    target_top1: torch.Tensor | None = None


@dataclass
class LossOutput:
    """total: scalar to backpropagate; parts: detached components for logging
    (e.g. {"ce": .., "tv": .., "conf": .., "acc@1": ..})."""

    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)

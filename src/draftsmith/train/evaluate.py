"""Held-out evaluation during training: the training objective's own parts, teacher-forced,
on conversations the drafter never trains on.

`data.eval_cache` names a feature cache (`draftsmith cache`) holding held-out conversations
(regenerated with `--split heldout`); its first `data.eval_samples` held-out samples, in a
fixed order, are scored at every checkpoint with fixed anchor draws, so successive numbers
differ only by the weights. The parts are the kind's training parts (drafters/losses.py):
for DSpark `accept` = mean 1 − TV(p_draft, p_target) at T = 1 (the expected acceptance of a
draft position when everything before it was accepted), `acc@1` / `acc` = top-1 agreement
with the data token at the first / every block position. Training numbers against these
tell overfitting (train up, held-out flat) from a train / inference mismatch (both high,
measured τ low).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from draftsmith.train.config import DataConfig
from draftsmith.train.data import TrainData

EVAL_SEED = 20261130  # anchor draws: the same at every evaluation


class HeldoutEval:
    def __init__(self, cfg: DataConfig, target, layer_ids: Sequence[int], batch_size: int,
                 device: torch.device | str = "cpu") -> None:
        held = dataclasses.replace(cfg, cache=cfg.eval_cache, online=False, max_samples=None)
        self.data = TrainData(held, target, layer_ids, seed=EVAL_SEED, batch_size=1, device=device, split="heldout")
        # the fixed order is epoch 0's; keep the windows of the first `eval_samples` samples in it
        keep: list = []
        seen: set[int] = set()
        for w in self.data.epoch_order(0):
            if w.sample in seen or len(seen) < cfg.eval_samples:
                seen.add(w.sample)
                keep.append(w)
        self.windows = keep
        self.batch_size = max(1, int(batch_size))
        self.source = self.data.source

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Window-weighted means of the model's loss parts (and the loss) over the held-out windows."""
        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        total = 0
        try:
            for i in range(0, len(self.windows), self.batch_size):
                ws = self.windows[i: i + self.batch_size]
                batch = self.data.collate_windows(ws)
                gen = torch.Generator()
                gen.manual_seed(EVAL_SEED + i)
                out = model.training_loss(batch, gen)
                n = len(ws)
                for k, v in {"loss": float(out.total), **out.parts}.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * n
                total += n
        finally:
            model.train(was_training)
        return {k: v / max(total, 1) for k, v in sums.items()}

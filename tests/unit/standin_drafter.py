"""A tiny trainable drafter that satisfies drafters/protocol.py, for testing the machinery.

`HeadModel`: a linear map over [chosen target layers ; final_hidden] followed by the
target's frozen lm_head, predicting the next token (dropout on, to exercise RNG restore;
a random subset of positions per step drawn from the trainer's generator, to exercise it).
`sequence_records` writes regen-like records whose next token is a function of the
current one, so the loss visibly falls within a few steps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters.base import FeatureSpec
from draftsmith.drafters.protocol import LossOutput, TrainBatch


@dataclass(frozen=True)
class HeadConfig:
    kind: str = "head"
    layer_ids: tuple[int, ...] = (0,)
    block_size: int = 1
    dropout: float = 0.1
    keep: float = 0.8  # fraction of loss positions used per step
    stats: bool = False  # provide target_stats (the protocol's optional per-position statistics)


class HeadModel(nn.Module):
    def __init__(self, target, cfg: HeadConfig) -> None:
        super().__init__()
        H = target.config.hidden_size
        self.cfg = cfg
        self.lm_head = target.lm_head.weight.detach()  # frozen, shared, not a parameter
        self.proj = nn.Linear(H * (len(cfg.layer_ids) + 1), H)
        self.norm = nn.LayerNorm(H)
        self.drop = nn.Dropout(cfg.dropout)
        self.seen: list[TrainBatch] = []  # batches that carried target statistics (tests read them)

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(layer_ids=tuple(self.cfg.layer_ids), final_hidden=True)

    def target_stats(self, final_hidden: torch.Tensor):
        """The full-vocabulary log-sum-exp and argmax of the target's logits (None when off)."""
        if not self.cfg.stats:
            return None
        logits = F.linear(final_hidden.float(), self.lm_head.float())
        return torch.logsumexp(logits, -1), logits.argmax(-1)

    def training_loss(self, batch: TrainBatch, generator: torch.Generator | None) -> LossOutput:
        if batch.target_rest_lse is not None:
            self.seen.append(batch)
        x = torch.cat([batch.hidden[i] for i in self.cfg.layer_ids] + [batch.final_hidden], dim=-1)
        h = self.drop(self.norm(self.proj(x)))
        logits = F.linear(h, self.lm_head)[:, :-1]  # [B, T-1, V]
        targets = batch.input_ids[:, 1:]
        mask = batch.loss_mask[:, 1:].clone()
        keep = (torch.rand(mask.shape, generator=generator) < self.cfg.keep).to(mask.device)  # CPU generator
        mask &= keep
        ce = F.cross_entropy(logits[mask].float(), targets[mask])
        acc = (logits[mask].argmax(-1) == targets[mask]).float().mean()
        return LossOutput(ce, {"ce": float(ce.detach()), "acc@1": float(acc)})


def build(target, cfg: HeadConfig) -> HeadModel:
    return HeadModel(target, cfg)


class _Entry:  # what the trainer reads of a kind: config_cls and build (drafters/registry.DrafterKind)
    config_cls = HeadConfig
    build = staticmethod(build)


CATALOGUE = {"head": _Entry()}


def next_token(t: int) -> int:
    return (t * 5 + 3) % 250


def sequence_records(path: Path, n: int = 24, length: int = 40, heldout: int = 2, seed: int = 0) -> Path:
    """Regen-like JSONL: a short 'prompt' (mask 0) then a deterministic chain (mask 1).

    The last `heldout` records are marked split=heldout (the trainer must never read them).
    """
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = [rng.randrange(250) for _ in range(6)]
            ids = list(prompt)
            t = rng.randrange(250)
            while len(ids) < length + rng.randrange(-8, 8):
                ids.append(t)
                t = next_token(t)
            split = "heldout" if i >= n - heldout else "train"
            sid = f"synthetic/{split}-{i}"
            rec = {"id": sid, "source": "synthetic", "split": split, "input_ids": ids,
                   "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt))}
            f.write(json.dumps(rec) + "\n")
    return path

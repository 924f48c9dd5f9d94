"""A new drafter kind in one file, registered at runtime: the proof that adding a kind
touches no source file (issue 14). `register_toy()` adds kind "toy"; tests/unit/test_toy_kind.py
trains it (`draftsmith train`), generates with it and evaluates it.

The model is one linear map of the target's final hidden state through the target's frozen
lm_head, trained to predict the token after next. Its drafter proposes one token per round
from the last verified position's features: lossless like any drafter, not a good one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafters import registry
from draftsmith.drafters.base import FeatureSpec, TargetFeatures, pad_proposal
from draftsmith.drafters.protocol import LossOutput, TrainBatch


@dataclass(frozen=True)
class ToyConfig:
    kind: str = "toy"
    block_size: int = 1  # drafts per round (eval's default K reads this)


class ToyDrafter:
    name = "toy"
    needs = FeatureSpec(final_hidden=True)

    def __init__(self, model: "ToyModel") -> None:
        self.model = model
        self.last: dict[int, torch.Tensor] = {}  # row -> final hidden of its last verified position

    def start(self, seq, features: TargetFeatures | None) -> None:
        if features is not None and features.final_hidden is not None and features.final_hidden.shape[1]:
            self.last[seq.row] = features.final_hidden[0, -1]

    @torch.inference_mode()
    def propose(self, seqs, max_lengths):
        drafts = []
        for s, n in zip(seqs, max_lengths):
            h = self.last.get(s.row)
            drafts.append([] if h is None or n < 1 else [int(self.model.logits(h).argmax())])
        return pad_proposal(drafts)

    def on_verified(self, seqs, proposal, result, features) -> None:
        for b, s in enumerate(seqs):
            self.last[s.row] = features.final_hidden[b, int(result.num_accepted[b])]

    def release(self, seq) -> None:
        self.last.pop(seq.row, None)


class ToyModel(nn.Module):
    def __init__(self, target, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        H = target.config.hidden_size
        self.lm_head = target.lm_head.weight.detach()  # frozen, shared, not saved
        self.proj = nn.Linear(H, H)

    @property
    def feature_spec(self) -> FeatureSpec:
        return FeatureSpec(final_hidden=True)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.proj(h), self.lm_head)

    def training_loss(self, batch: TrainBatch, generator) -> LossOutput:
        logits = self.logits(batch.final_hidden)[:, :-2]  # position t predicts token t + 2
        mask = batch.loss_mask[:, 2:]
        ce = F.cross_entropy(logits[mask].float(), batch.input_ids[:, 2:][mask])
        return LossOutput(ce, {"ce": float(ce.detach())})

    @torch.no_grad()
    def make_drafter(self, target, max_rows: int, max_len: int, temperatures=None) -> ToyDrafter:
        return ToyDrafter(self)


def build(target, config: ToyConfig) -> ToyModel:
    return ToyModel(target, config)


def register_toy() -> registry.DrafterKind:
    return registry.register(registry.DrafterKind(
        "toy", "toy:CKPT", "a one-linear test drafter", registry.checkpoint_loader("toy"),
        config_cls=ToyConfig, build=build, needs_arg=True), replace=True)
